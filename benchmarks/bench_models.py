"""Real-model benchmark: SmolLM2-135M decode/prefill/perplexity and MiniLM encode/similarity, float vs
affineq configs vs torch.ao.quantization.quantize_dynamic, side by side in one run.

    python benchmarks/bench_models.py                      # both models, eager and compiled
    python benchmarks/bench_models.py --model smollm2 --no-compile --configs int8 int4-g64
    python benchmarks/bench_models.py --model smollm2 --configs int8-dyn --modes compiled --no-save  # one row

Every row runs in its own subprocess (one after another, never in parallel) so that peak memory (max RSS)
and timings of one configuration do not leak into the next. Writes results/bench_models.json and
results/bench_models.png (results/bench_models_<model>.* for one model); README quotes the table.
--no-save prints the rows and table only. Compiled rows also record compile_s: dynamo + inductor time
summed over every (re)compile the row triggers (warm-up, prefill, perplexity). Speedups are over the faster
float row (float32 or bfloat16) of the same mode; accuracy changes are against float32.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, machine_line, median_ms, save_json, table  # noqa: E402

from affineq import models as M  # noqa: E402
from affineq.demo import CONFIGS, FLOAT_ROWS, model_bytes, quantized_bytes_per_param  # noqa: E402

LM_CONFIGS = ["float32", "bfloat16", "torch.ao-int8-dyn", "int8", "int4-g64", "int4-g64+int8-head", "int4-g32",
              "int8-dyn", "8da4w", "fp8", "fp6-g32", "mxfp6", "fp4-g32", "mxfp4"]
ENC_CONFIGS = ["float32", "bfloat16", "torch.ao-int8-dyn", "int8", "int4-g128", "int8-dyn", "fp6-g32", "mxfp6",
               "fp4-g32", "mxfp4"]


def _linear_bytes(model: nn.Module, dtype_bytes: int = 2) -> tuple[int, int]:
    """(stored bytes of the nn.Linear weights, their bytes in bf16) -- the 'smaller than bf16' ratio."""
    stored = ref = 0
    seen = set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if w is None or not (isinstance(m, nn.Linear) or type(m).__name__ == "Linear"):
            continue
        key = id(m) if callable(w) else id(w)  # a bound method is a new object each time: key on the module
        if key in seen:
            continue
        seen.add(key)
        if hasattr(w, "storage_bytes"):
            stored += w.storage_bytes()
            ref += w.numel() * dtype_bytes
        elif callable(w):  # torch.ao dynamic quantized linear: per-tensor qint8 packed params
            qw = w()
            stored += qw.numel() * qw.element_size() + 8  # codes + one scale and zero point
            ref += qw.numel() * dtype_bytes
        else:
            stored += w.numel() * w.element_size()
            ref += w.numel() * dtype_bytes
    return stored, ref


def _quantize(model: nn.Module, name: str) -> nn.Module:
    if name == "torch.ao-int8-dyn":
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    if name in FLOAT_ROWS:
        return model.to(FLOAT_ROWS[name])
    if CONFIGS[name] is not None:
        from affineq import quantize_

        quantize_(model, CONFIGS[name])
    return model


def run_one(model_name: str, config: str, compile: bool, new_tokens: int, eval_tokens: int,
            model_dtype: str = "float32") -> dict:
    """One row, measured in this process."""
    torch.manual_seed(0)
    if model_name == "smollm2":
        model, tok = M.load_smollm2()
    else:
        model, tok = M.load_minilm()
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    if model_dtype != "float32" and config not in FLOAT_ROWS:  # quantize the bf16 model: bf16 activations
        model = model.to(FLOAT_ROWS[model_dtype])
    model = _quantize(model, config)
    quantize_s = time.perf_counter() - t0
    lin_stored, lin_bf16 = _linear_bytes(model)
    row = {
        "model": model_name,
        "config": config,
        "mode": "compiled" if compile else "eager",
        "model_dtype": model_dtype,
        "quantize_s": quantize_s,
        "linear_mb": lin_stored / 1e6,
        "smaller_than_bf16": lin_bf16 / lin_stored if lin_stored else None,
    }
    if config != "torch.ao-int8-dyn":
        row["model_mb"] = model_bytes(model) / 1e6
        row["bytes_per_param"] = quantized_bytes_per_param(model)
    if compile:
        model.forward = torch.compile(model.forward, dynamic=True)
    t_warm = time.perf_counter()
    with torch.inference_mode():
        if model_name == "smollm2":
            prompt = tok("Quantization makes language models smaller and faster because", return_tensors="pt")[
                "input_ids"
            ]
            prefill = torch.tensor([M.byte_tokenize(M.eval_text(), 49152)[:256].tolist()])
            M.generate_greedy(model, tok, prompt, 4)  # warm-up / compile
            model(prefill)
            row["warmup_s"] = time.perf_counter() - t_warm
            t = time.perf_counter()
            M.generate_greedy(model, tok, prompt, new_tokens)
            row["decode_tok_s"] = new_tokens / (time.perf_counter() - t)
            row["prefill256_ms"] = median_ms(lambda: model(prefill), min_runs=3, budget_s=3.0, warmup=1)
            row["perplexity"] = M.perplexity(model, tok, max_tokens=eval_tokens)
        else:
            ref_model, _ = M.load_minilm()
            ref = M.embed(ref_model, tok, M.SENTENCES)
            M.embed(model, tok, M.SENTENCES)
            row["warmup_s"] = time.perf_counter() - t_warm
            ms = median_ms(lambda: M.embed(model, tok, M.SENTENCES), min_runs=5, budget_s=3.0)
            row["sentences_s"] = len(M.SENTENCES) / (ms * 1e-3)
            row["cosine"] = M.embedding_similarity(ref, M.embed(model, tok, M.SENTENCES))
    if compile:
        row["compile_s"] = _compile_seconds()
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row["rss_after_load_mb"] = rss_loaded
    return row


def _compile_seconds() -> float | None:
    """Seconds torch.compile spent in dynamo + AOT + inductor (all frames and recompiles) in this process."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # private API: absent in some torch versions
        return None
    return sum(compilation_time_metrics.get("_compile.compile_inner", [])) or None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["smollm2", "minilm"], choices=["smollm2", "minilm"])
    p.add_argument("--configs", nargs="+", default=None)
    p.add_argument("--no-compile", action="store_true", help="eager rows only (same as --modes eager)")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--model-dtype", default="float32", choices=list(FLOAT_ROWS),
                   help="dtype of the model the quantized rows start from (bfloat16: bf16 activations)")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "CONFIG", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        model_name, config, mode = args.one
        print("ROW " + json.dumps(run_one(model_name, config, mode == "compiled", args.tokens, args.eval_tokens,
                                          args.model_dtype)))
        return
    print(machine_line())
    if "smollm2" in args.model:
        print(f"# note: {M.SMOLLM2_WEIGHT_NOTE}")
    rows = []
    modes = [m for m in ("eager", "compiled") if m in args.modes and not (args.no_compile and m == "compiled")]
    for model_name in args.model:
        configs = args.configs or (LM_CONFIGS if model_name == "smollm2" else ENC_CONFIGS)
        for mode in modes:
            for config in configs:
                if mode == "compiled" and config == "torch.ao-int8-dyn":
                    continue  # quantize_dynamic modules do not compile to a faster graph
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    model_name,
                    config,
                    mode,
                    "--tokens",
                    str(args.tokens),
                    "--eval-tokens",
                    str(args.eval_tokens),
                    "--model-dtype",
                    args.model_dtype,
                ]
                out = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
                )
                line = next((x for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
                if line is None:
                    print(f"{model_name} {config} {mode}: failed\n{out.stderr[-2000:]}", flush=True)
                    continue
                rows.append(json.loads(line[4:]))
                print(json.dumps(rows[-1]), flush=True)
    if rows:
        _report(rows, save=not args.no_save)


def _report(rows: list[dict], save: bool = True) -> None:
    for model_name, metric, speed in (("smollm2", "perplexity", "decode_tok_s"), ("minilm", "cosine", "sentences_s")):
        rs = [r for r in rows if r["model"] == model_name]
        if not rs:
            continue
        out = []
        for r in rs:
            # speed against the faster float row of the same mode (bf16 GEMMs win on AVX512-BF16 CPUs),
            # accuracy against float32; no float row of that mode in this run (e.g. --configs int8-dyn): no
            # relative columns
            floats = [b for b in rs if b["config"] in FLOAT_ROWS and b["mode"] == r["mode"]]
            fastest = max(floats, key=lambda b: b[speed]) if floats else None
            base = next((b for b in floats if b["config"] == "float32"), None)
            entry = {
                "config": r["config"],
                "mode": r["mode"],
                speed: f"{r[speed]:.1f}",
                "speedup": f"{r[speed] / fastest[speed]:.2f}x" if fastest else "",
                metric: f"{r[metric]:.4f}",
                "change": f"{(r[metric] - base[metric]) / base[metric] * 100:+.2f}%" if base else "",
                "linear MB": f"{r['linear_mb']:.1f}",
                "vs bf16": f"{r['smaller_than_bf16']:.2f}x" if r.get("smaller_than_bf16") else "",
                "peak RSS MB": f"{r['peak_rss_mb']:.0f}",
                "quantize s": f"{r['quantize_s']:.2f}",
                "compile s": f"{r['compile_s']:.0f}" if r.get("compile_s") else "",
            }
            if model_name == "smollm2":
                entry["prefill256 ms"] = f"{r['prefill256_ms']:.1f}"
            out.append(entry)
        print(f"\n{model_name}:")
        print(table(out, list(out[0])))
    if not save:
        return
    name = "bench_models" if len({r["model"] for r in rows}) > 1 else f"bench_models_{rows[0]['model']}"
    save_json(name, {"rows": rows})
    _plot(rows, name)


def _plot(rows: list[dict], name: str = "bench_models") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(pip install matplotlib for results/{name}.png)")
        return
    lm = [r for r in rows if r["model"] == "smollm2"]
    if not lm:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, marker in (("eager", "o"), ("compiled", "s")):
        rs = [r for r in lm if r["mode"] == mode]
        ax.scatter([r["decode_tok_s"] for r in rs], [r["perplexity"] for r in rs], marker=marker, label=mode)
        for r in rs:
            ax.annotate(r["config"], (r["decode_tok_s"], r["perplexity"]), fontsize=7)
    ax.set_xlabel("decode tokens/s (batch 1)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("SmolLM2-135M: speed vs accuracy")
    ax.legend()
    fig.suptitle(machine_line().lstrip("# "), fontsize=7)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / name}.png")


if __name__ == "__main__":
    main()
