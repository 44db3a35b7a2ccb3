"""Peak memory of quantizing SmolLM2-135M straight from its float safetensors checkpoint
(`affineq.quantize_checkpoint`) against loading the float model and running `quantize_`.

    python benchmarks/bench_streaming.py [--config int4-g64] [--dir /tmp/affineq_stream_bench] [--quick]

SmolLM2 ships as a GGUF file, so the float model is first written once as a transformers checkpoint
(`load_smollm2()` + `save_pretrained`, float32 safetensors in 100 MB shards) under --dir (`--quick`: a seeded
TinyLM instead, no model package needed). Each row then runs in a fresh subprocess, which reports (MB):
`base`, the resident set after imports (one small quantization, so the kernels are loaded, and one meta-device
construction of the model, which imports torch's meta kernels); `peak - base`,
the high-water mark (VmHWM, reset at `base`; it counts the checkpoint's memory-mapped pages while resident)
above it; `out MB`, the bytes written (the model's bytes for `quantize_`) and the wall time. Rows:
  - `quantize_checkpoint (by name)`: no model; every 2-D ``*.weight`` but the embedding is quantized.
  - `quantize_checkpoint (meta model)`: the model built on the meta device from config.json decides, exactly as
    `quantize_` does (SmolLM2's lm_head is tied to the embedding: both are quantized, stored once).
  - `from_pretrained + quantize_`: the float model loaded in memory, then quantized (the baseline).
The claim to check: streaming peaks below the float checkpoint's size plus the quantized size. Peak memory does
not depend on CPU contention (times are rough indications only). Writes results/bench_streaming.json.
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


def _save_float(src: Path, quick: bool) -> None:
    from affineq import models

    if quick:  # TinyLM is no transformers model: a plain sharded safetensors checkpoint
        import safetensors.torch

        src.mkdir(parents=True)
        state = models.build_tiny_lm(vocab=2048, dim=512, layers=4, heads=8, ffn=2048).state_dict()
        weight_map = {}
        for i, keys in enumerate((list(state)[:20], list(state)[20:])):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            safetensors.torch.save_file({k: state[k] for k in keys}, src / name)
            weight_map.update({k: name for k in keys})
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return
    model, tok = models.load_smollm2()
    model.save_pretrained(src, max_shard_size="100MB")
    tok.save_pretrained(src)


def _meta_factory(src: str, quick: bool):
    if quick:
        from affineq.models import TinyLM, TinyLMConfig

        cfg = TinyLMConfig(vocab_size=2048, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                           intermediate_size=2048)
        return lambda: TinyLM(cfg)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    return lambda: AutoModelForCausalLM.from_config(config)


def child(mode: str, src: str, dst: str, config_name: str, quick: bool) -> dict:
    """One measurement, in its own process (`--child`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import affineq
    from affineq.demo import CONFIGS, model_bytes
    from affineq.process_memory import status_bytes

    if mode == "save-float":
        _save_float(Path(src), quick)
        return {}
    cfg = CONFIGS[config_name]
    factory = _meta_factory(src, quick) if mode != "by-name" else None  # imports transformers before `base`
    base = reset_peak_rss(cfg, factory)
    t0 = time.perf_counter()
    if mode == "quantize_":
        if quick:
            with torch.device("meta"):
                model = affineq.load_quantized(factory(), src)  # float: views of the mapped files
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        with torch.no_grad():  # a loaded model has all its (memory-mapped) weights resident once used
            for p in model.parameters():
                p.sum()
        affineq.quantize_(model, cfg)
        written = model_bytes(model) / MB
        label = "from_pretrained + quantize_" if not quick else "load + quantize_"
    else:
        info = affineq.quantize_checkpoint(src, dst, cfg, model=factory)
        written = info.dst_bytes / MB
        label = f"quantize_checkpoint ({'meta model' if factory else 'by name'})"
    secs = time.perf_counter() - t0
    return {"row": label, "base MB": round(base / MB, 1), "peak - base": round((status_bytes("VmHWM") - base) / MB, 1),
            "out MB": round(written, 1), "s": round(secs, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="int4-g64", help="a config name of affineq.demo.CONFIGS")
    p.add_argument("--dir", default="/tmp/affineq_stream_bench", help="where the float and quantized checkpoints go")
    p.add_argument("--quick", action="store_true", help="a seeded TinyLM (17 M parameters) instead of SmolLM2")
    p.add_argument("--child", nargs=5, metavar=("MODE", "SRC", "DST", "CONFIG", "QUICK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, src, dst, config, quick = args.child
        print(json.dumps(child(mode, src, dst, config, quick == "1")))
        return
    q = "1" if args.quick else "0"
    d = Path(args.dir) / ("tiny" if args.quick else "smollm2")
    flt = d / "float"
    if not flt.exists():
        run_child(__file__, "save-float", str(flt), "-", args.config, q)
    rows = []
    for mode in ("by-name", "meta-model", "quantize_"):
        out = d / f"{args.config}-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        rows.append(run_child(__file__, mode, str(flt), str(out), args.config, q))
    float_mb, quant_mb = _dir_mb(flt), rows[1]["out MB"]
    print(machine_line())
    print(f"{'TinyLM' if args.quick else 'SmolLM2-135M'} float32 checkpoint {float_mb:.1f} MB; {args.config}: "
          f"{rows[0]['out MB']} MB by name, {quant_mb} MB with the meta model")
    print(table(rows, list(rows[0])))
    for r in rows[:2]:
        bound = float_mb + r["out MB"]
        verdict = "below" if r["peak - base"] < bound else "NOT below"
        print(f"{r['row']}: peak - base {r['peak - base']} MB, {verdict} float size + quantized size = {bound:.1f} MB "
              f"({r['peak - base'] / float_mb:.2f} x the float checkpoint)")
    path = save_json("bench_streaming_quick" if args.quick else "bench_streaming",
                     {"config": args.config, "float_mb": round(float_mb, 1), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
