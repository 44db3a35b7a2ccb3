"""Compute-bound model rows (issue #30): SmolLM2-135M prefill of 512 tokens and all-MiniLM-L6-v2 on 16 sentences,
every config against the best float path, all candidates of one model timed round-robin in one process.

    python benchmarks/bench_prefill.py                    # both models, every config (~10 min on 2 cores)
    python benchmarks/bench_prefill.py --quick            # SmolLM2 64 tokens, 3 configs: a smoke run

Rows: float32 and bfloat16 (the float paths; "best float" is the faster of the two), torch.ao's
`quantize_dynamic` (int8, fp32 model), and affineq's configs in two set-ups:
- `fp32 model, compute bf16`: the float32 model quantized with `compute_dtype=torch.bfloat16` (float32 activations
  rounded to bf16 inside each quantized linear, then quantized there by the W8A8 configs; every other op stays
  float32);
- `bf16 model`: the model cast to bfloat16 first, then quantized (every activation bf16).
W8A8 configs (int8 dynamic, 8da4w) also get a `fp32 model` row: float32 activations quantized exactly; so do the
weight-only configs where bf16 has no hardware GEMM (`native_bf16_gemm()` false: AVX2-only CPUs), whose best float
path is float32 (the exact fp32 kernels; elsewhere they are slower than bf16, which the two rows above use).
Accuracy next to speed: SmolLM2 mean KL divergence of the prefill's next-token distributions against the float32
model, MiniLM cosine of the sentence embeddings against float32. Writes results/bench_prefill.json.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_line, round_robin_ms, save_json, table  # noqa: E402

from affineq import models as M  # noqa: E402
from affineq import quantize_, record_kernels  # noqa: E402
from affineq.demo import CONFIGS  # noqa: E402
from affineq.tensor.compute_bound import cpu_kind, native_bf16_gemm  # noqa: E402

WEIGHT_ONLY = ["int8", "int4-g64", "int4-g128", "int4-g32", "fp8", "fp6-g32", "mxfp6", "fp4-g32", "mxfp4"]
W8A8 = ["int8-dyn", "8da4w"]


def _variants(model_name: str) -> dict[str, tuple[str, str]]:
    """row name -> (demo config name, set-up: 'fp32' | 'fp32-bf16c' | 'bf16')."""
    rows = {"float32": ("float32", "fp32"), "bfloat16": ("bfloat16", "bf16"),
            "torch.ao-int8-dyn": ("torch.ao-int8-dyn", "fp32")}
    wo = [c for c in WEIGHT_ONLY if not (model_name == "smollm2" and c == "int4-g128")]  # 128 does not divide 576
    for c in wo:
        if not native_bf16_gemm():
            rows[f"{c} (fp32 model)"] = (c, "fp32")
        rows[f"{c} (fp32 model, compute bf16)"] = (c, "fp32-bf16c")
        rows[f"{c} (bf16 model)"] = (c, "bf16")
    for c in W8A8:
        rows[f"{c} (fp32 model)"] = (c, "fp32")
        rows[f"{c} (fp32 model, compute bf16)"] = (c, "fp32-bf16c")
        rows[f"{c} (bf16 model)"] = (c, "bf16")
    return rows


def _build(base: nn.Module, config: str, setup: str) -> nn.Module:
    model = copy.deepcopy(base)
    if config == "torch.ao-int8-dyn":
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    if setup == "bf16":
        model = model.to(torch.bfloat16)
    cfg = CONFIGS.get(config)
    if cfg is not None:
        if setup == "fp32-bf16c":
            cfg = dataclasses.replace(cfg, compute_dtype=torch.bfloat16)
        quantize_(model, cfg)
    return model


def run(args) -> dict:
    print(machine_line() + f", CPU kind {cpu_kind()}")
    out: dict = {"rows": []}
    for model_name in args.model:
        if model_name == "smollm2":
            base, _ = M.load_smollm2()
            ids = torch.tensor([M.byte_tokenize(M.eval_text(), 49152)[:args.tokens].tolist()])
            call = lambda m, ids=ids: m(ids).logits  # noqa: E731
        else:
            base, tok = M.load_minilm()
            batch = tok(list(M.SENTENCES), padding=True, truncation=True, return_tensors="pt")
            call = lambda m, tok=tok: M.embed(m, tok, M.SENTENCES)  # noqa: E731
            print(f"# MiniLM: {len(M.SENTENCES)} sentences, {int(batch['attention_mask'].sum())} tokens "
                  f"({tuple(batch['input_ids'].shape)} padded)")
        base.eval()
        variants = _variants(model_name)
        if args.configs:
            variants = {k: v for k, v in variants.items() if v[0] in args.configs or k in ("float32", "bfloat16")}
        models, kernels = {}, {}
        with torch.inference_mode():
            ref = call(base).float()
            for name, (config, setup) in variants.items():
                models[name] = _build(base, config, setup)
                with record_kernels() as used:
                    got = call(models[name]).float()
                kernels[name] = sorted(set(used))
                if model_name == "smollm2":
                    kl = F.kl_div(F.log_softmax(got[0], -1), F.log_softmax(ref[0], -1), log_target=True,
                                  reduction="none").sum(-1)
                    kernels[name + ":acc"] = float(kl.mean())
                else:
                    kernels[name + ":acc"] = float(F.cosine_similarity(got, ref, dim=-1).mean())
            cands = {name: (lambda m=m, call=call: call(m)) for name, m in models.items()}
            ms = round_robin_ms(cands, budget_s=args.budget, min_runs=5, warmup=2)
        best_float = min(ms["float32"], ms["bfloat16"])
        rows = []
        for name, (config, setup) in variants.items():
            acc = kernels[name + ":acc"]
            rec = {"model": model_name, "row": name, "config": config, "setup": setup, "ms": ms[name],
                   "vs_best_float": best_float / ms[name], "kernels": kernels[name],
                   ("mean_kld" if model_name == "smollm2" else "cosine"): acc}
            out["rows"].append(rec)
            rows.append({"row": name, "ms": f"{ms[name]:.1f}", "vs best float": f"{best_float / ms[name]:.2f}x",
                         ("mean KLD" if model_name == "smollm2" else "cosine"): f"{acc:.4f}",
                         "kernels": ",".join(k.removeprefix("affineq.") for k in kernels[name]) or "-"})
        what = f"prefill {args.tokens} tokens" if model_name == "smollm2" else f"{len(M.SENTENCES)} sentences"
        print(f"\n{model_name}, {what}, eager, median of round-robin runs:")
        print(table(rows, list(rows[0])))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["smollm2", "minilm"], choices=["smollm2", "minilm"])
    p.add_argument("--configs", nargs="+", default=None, help="demo config names (float rows always run)")
    p.add_argument("--tokens", type=int, default=512, help="SmolLM2 prompt length")
    p.add_argument("--budget", type=float, default=3.0, help="seconds per candidate")
    p.add_argument("--quick", action="store_true", help="SmolLM2 only, 64 tokens, int8 and int8-dyn, short timings")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--out", default="bench_prefill", help="results/<out>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.tokens, args.budget, args.configs = ["smollm2"], 64, 0.2, ["int8", "int8-dyn"]
    result = run(args)
    if not args.no_save:
        print(save_json(args.out + "_quick" if args.quick else args.out, result))


if __name__ == "__main__":
    main()
