"""Peak memory of quantizing a Qwen3-30B-A3B-shaped MoE checkpoint with `affineq.quantize_checkpoint` (issue #34:
peak RSS below the bf16 checkpoint's size; the 3-D expert weights are streamed one expert at a time).

    python benchmarks/bench_moe_memory.py [--layers 4] [--config int4-g32 mxfp4] [--dir /tmp/affineq_moe_mem]
    python benchmarks/bench_moe_memory.py --quick     # smoke run: the tiny MoE body (2 layers, 8 experts)

The bf16 checkpoint is written once under --dir by `make_synthetic.py qwen3-30b-a3b --layers 4` (128 experts, top-8,
hidden 2048, expert width 768, vocabulary 151936, untied head; random weights, written tensor by tensor). Each row
runs in a fresh subprocess, which reports (MB): `base`, the resident set after imports (one small quantization, so
the kernels are loaded, and one meta-device construction of the model); `peak - base`, the high-water mark (VmHWM,
reset at `base`; it counts the checkpoint's memory-mapped pages while resident) above it; `out MB`, the bytes
written; and the wall time. The model built on `meta` from config.json decides what is quantized (every nn.Linear
and the experts' 3-D `gate_up_proj` / `down_proj`, as `quantize_` does; the router, embedding and norms stay
bf16). A last subprocess per row loads the quantized directory (`load_quantized` into a meta-built model) and
runs one forward of 8 tokens: finite logits and the grouped kernel in `record_kernels()` are checked.
Peak memory does not depend on CPU contention or threads (times are rough; the children run one thread unless
AFFINEQ_BENCH_THREADS says otherwise). Writes results/bench_moe_memory.json
(--quick: bench_moe_memory_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, reset_peak_rss, run_child, save_json, table  # noqa: E402

MB = 2**20


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / MB


def _meta_factory(src: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    return lambda: AutoModelForCausalLM.from_config(config, dtype="bfloat16")


def child(mode: str, src: str, dst: str, config_name: str, layers: str) -> dict:
    """One measurement, in its own process (`--child`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import affineq
    from affineq.demo import CONFIGS
    from affineq.process_memory import status_bytes

    if mode == "make":
        from make_synthetic import make

        body = "tiny-qwen3-moe" if layers == "quick" else "qwen3-30b-a3b"
        return make(body, Path(src), layers=None if layers == "quick" else int(layers), tokenizer=False)
    # peak memory does not depend on the thread count; one thread (AFFINEQ_BENCH_THREADS overrides) avoids the
    # per-op synchronisation that makes thousands of per-expert ops crawl on a loaded machine
    torch.set_num_threads(int(os.environ.get("AFFINEQ_BENCH_THREADS", "1")))
    cfg = CONFIGS[config_name]
    factory = _meta_factory(src)
    base = reset_peak_rss(cfg, factory)
    t0 = time.perf_counter()
    if mode == "quantize":
        info = affineq.quantize_checkpoint(src, dst, cfg, model=factory)
        out = {"out MB": round(info.dst_bytes / MB, 1)}
    else:  # "load": the quantized directory into a meta-built model, one forward
        from affineq.experts import EXPERTS_IMPLEMENTATION
        from affineq.tensor.grouped import GROUPED_KERNEL

        with torch.device("meta"):
            model = factory()
        model = affineq.load_quantized(model, dst).eval()
        tokens = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        with affineq.record_kernels() as ran, torch.no_grad():
            logits = model(tokens).logits
        out = {"finite logits": bool(torch.isfinite(logits).all()), "grouped kernel": GROUPED_KERNEL in ran,
               "experts impl": model.config._experts_implementation == EXPERTS_IMPLEMENTATION}
    secs = time.perf_counter() - t0
    return {"row": f"{mode} {config_name}", "base MB": round(base / MB, 1),
            "peak - base": round((status_bytes("VmHWM") - base) / MB, 1), **out, "s": round(secs, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["int4-g32", "mxfp4"], help="config names of affineq.demo.CONFIGS")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dir", default="/tmp/affineq_moe_mem", help="where the bf16 and quantized checkpoints go")
    p.add_argument("--quick", action="store_true", help="the tiny MoE body instead of Qwen3-30B-A3B's shape")
    p.add_argument("--keep", action="store_true", help="keep the quantized checkpoints (default: deleted)")
    p.add_argument("--child", nargs=5, metavar=("MODE", "SRC", "DST", "CONFIG", "LAYERS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    layers = "quick" if args.quick else str(args.layers)
    d = Path(args.dir) / ("tiny" if args.quick else f"qwen3-30b-a3b-{args.layers}l")
    flt = d / "bf16"
    if not (flt / "config.json").exists():
        run_child(__file__, "make", str(flt), "-", "-", layers)
    bf16_mb = _dir_mb(flt)
    rows = []
    for name in args.config:
        out = d / name
        shutil.rmtree(out, ignore_errors=True)
        q = run_child(__file__, "quantize", str(flt), str(out), name, layers)
        q["peak / bf16"] = round(q["peak - base"] / bf16_mb, 3)
        q["below bf16"] = q["peak - base"] < bf16_mb
        rows.append(q)
        rows.append(run_child(__file__, "load", str(flt), str(out), name, layers))
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    body = "tiny MoE" if args.quick else f"Qwen3-30B-A3B shape, {args.layers} layers"
    print(machine_line())
    print(f"{body}: bf16 checkpoint {bf16_mb:.1f} MB")
    print(table(rows, ["row", "base MB", "peak - base", "peak / bf16", "below bf16", "out MB", "finite logits",
                       "grouped kernel", "s"]))
    path = save_json("bench_moe_memory_quick" if args.quick else "bench_moe_memory",
                     {"body": body, "layers": None if args.quick else args.layers, "bf16_mb": round(bf16_mb, 1),
                      "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
