"""Benchmark the experts of a Qwen3-30B-A3B-shaped MoE layer: bf16 float paths against quantized experts run by
`affineq.tensor.grouped.grouped_linear` (the C++ op ``affineq::grouped_lowbit_linear``).

    python benchmarks/bench_moe.py            # 128 experts, top-8, hidden 2048, expert width 768; T = 1 and 64
    python benchmarks/bench_moe.py --quick    # smoke run: 16 experts, hidden 256, width 128, short timings

The layer, for tokens x [T, H] routed to k experts each (ids [T, k], routing weights r [T, k])::

    y[t] = sum_j r[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),   e = ids[t, j]

gate_up [E, 2I, H] (gate rows first) and down [E, H, I], random weights and random routings (fixed seed); the
router's own matmul is left out (the same float op for every candidate). Each candidate cycles through
--routings different routings, so successive calls read different experts, as a decode step through a real model
does (48 layers x 8 experts never stay in cache). Activations are bf16 in every candidate, and also float32 where
bf16 has no hardware GEMM (`native_bf16_gemm()` false: AVX2-only CPUs, whose best float path is float32).

Candidates (timed round-robin, medians; compare ratios):
  bf16-loop        per routed expert, F.linear of its rows with bf16 weights (transformers' eager experts loop,
                   restricted to the routed experts)
  bf16-grouped_mm  torch._grouped_mm over the rows sorted by expert (where this torch has it on CPU)
  int4-g32/g128    int4, bf16 scale and zero per group (Int4WeightOnlyConfig, packing_format="dense")
  int8             int8 per output channel, fp32 qparams (Int8WeightOnlyConfig, packing_format="dense")
  mxfp4            fp4 e2m1 codes, one e8m0 scale per 32 (MXWeightOnlyConfig; gpt-oss's expert format)
  fp32-loop, ... (fp32 x)  without a hardware bf16 GEMM: the float loop with float32 weights, and each quantized
                   config on float32 activations

Columns: ms; "x float" = the best float candidate's ms / ms; "MB/tok" = bytes of the routed experts' weights
(codes and qparams; each routed expert once) per token; "GB/s" = those bytes / time; "% bw" = of the read
bandwidth measured here (common.memory_bandwidth_gbs). Writes results/bench_moe.json (--quick:
bench_moe_quick.json; --out NAME: NAME.json).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_line, memory_bandwidth_gbs, round_robin_ms, save_json, table  # noqa: E402

import affineq.cpp as K  # noqa: E402
from affineq.configs import (  # noqa: E402
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    MXWeightOnlyConfig,  # noqa: E402
)
from affineq.tensor.affine import AffineQuantizedTensor  # noqa: E402
from affineq.tensor.compute_bound import native_bf16_gemm  # noqa: E402
from affineq.tensor.grouped import grouped_linear  # noqa: E402

CONFIGS = {
    "int4-g32": Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
    "int4-g128": Int4WeightOnlyConfig(group_size=128, packing_format="dense"),
    "int8": Int8WeightOnlyConfig(packing_format="dense"),
    "mxfp4": MXWeightOnlyConfig(packing_format="dense"),
}


def expert_weight(cfg, e: int, n: int, k: int, gen: torch.Generator) -> AffineQuantizedTensor:
    """A 3-D dense expert weight [e, n, k] as `grouped_linear` takes it: random codes, and the qparams of one
    expert quantized by `cfg` (a real [n, k] weight) repeated for each expert (their values do not change the
    time; quantizing all 128 experts for real would take minutes)."""
    one = cfg.quantize_weight(torch.randn(n, k, generator=gen) * 0.02, nn.Linear(k, n, bias=False))
    tensors = {}
    for name, t in one.tensors.items():
        if name == "qdata":
            tensors[name] = torch.randint(0, 256, (e, *t.shape), dtype=torch.uint8, generator=gen)
        else:
            tensors[name] = t.unsqueeze(0).repeat(e, *([1] * t.dim()))
    spec = one.spec.replace(shape=(e, n, k), block_size=(1, *one.spec.block_size))
    return AffineQuantizedTensor(tensors, spec)


def nbytes(w: torch.Tensor) -> int:
    """Bytes of one expert of w [E, ...] (codes and qparams)."""
    ts = w.tensors.values() if isinstance(w, AffineQuantizedTensor) else [w]
    return sum(t.numel() * t.element_size() for t in ts) // w.shape[0]


def routings(count: int, t: int, e: int, topk: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` random routings of t tokens: (ids [t, topk] int64, weights [t, topk] bf16, softmax of the top-k)."""
    out = []
    for _ in range(count):
        logits = torch.randn(t, e, generator=gen)
        val, ids = logits.topk(topk, dim=-1)
        out.append((ids, torch.softmax(val, -1).bfloat16()))
    return out


def moe_grouped(x, ids, r, gate_up, down):
    """The layer through grouped_linear: one row per (token, expert) pair."""
    t, topk = ids.shape
    flat = ids.reshape(-1)
    h = grouped_linear(x.repeat_interleave(topk, 0), flat, gate_up)
    g, u = h.chunk(2, dim=-1)
    y = grouped_linear(F.silu(g) * u, flat, down)
    return (y.view(t, topk, -1) * r.unsqueeze(-1)).sum(1)


def moe_loop(x, ids, r, gate_up, down):
    """The layer as a loop over the routed experts (bf16 F.linear)."""
    t, topk = ids.shape
    flat, rf = ids.reshape(-1), r.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start:start + c]
        start += c
        tok = pairs // topk
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * rf[pairs].unsqueeze(-1))
    return out


def moe_grouped_mm(x, ids, r, gate_up, down):
    """The layer through torch._grouped_mm over the (token, expert) rows sorted by expert."""
    t, topk = ids.shape
    flat, rf = ids.reshape(-1), r.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    tok = order // topk
    g, u = torch._grouped_mm(x[tok], gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)
    out = torch.zeros_like(x)
    return out.index_add_(0, tok, y * rf[order].unsqueeze(-1))


def grouped_mm_works() -> bool:
    try:
        x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(2, 8, 16, dtype=torch.bfloat16)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def cycling(fn: Callable, x: torch.Tensor, routes: list, gate_up, down) -> Callable[[], object]:
    """fn on the next routing at every call."""
    state = {"i": 0}

    def call():
        ids, r = routes[state["i"] % len(routes)]
        state["i"] += 1
        return fn(x, ids, r, gate_up, down)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768, help="expert intermediate size inter")
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--routings", type=int, default=16)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per candidate per row")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="smoke run: a small layer, short timings")
    ap.add_argument("--out", default=None, help="results/<out>.json (default bench_moe, --quick bench_moe_quick)")
    args = ap.parse_args()
    if args.quick:
        args.experts, args.hidden, args.width, args.routings, args.budget = 16, 256, 128, 4, 0.05
    if args.threads:
        torch.set_num_threads(args.threads)
    if not K.is_available():
        sys.exit(f"affineq C++ kernels unavailable: {K.unavailable_reason()}")
    E, H, inter, topk = args.experts, args.hidden, args.width, args.topk
    gen = torch.Generator().manual_seed(0)
    print(machine_line())
    bw = memory_bandwidth_gbs(64 if args.quick else 512)
    print(f"# MoE experts: E={E}, top-{topk}, hidden {H}, width {inter}; read bandwidth {bw:.1f} GB/s")
    weights: dict[str, tuple] = {"bf16": (torch.randn(E, 2 * inter, H, generator=gen, dtype=torch.bfloat16) * 0.02,
                                          torch.randn(E, H, inter, generator=gen, dtype=torch.bfloat16) * 0.02)}
    for name, cfg in CONFIGS.items():
        weights[name] = (expert_weight(cfg, E, 2 * inter, H, gen), expert_weight(cfg, E, H, inter, gen))
    # candidate -> (layer function, weights, activation dtype)
    cands: dict[str, tuple[Callable, str, torch.dtype]] = {"bf16-loop": (moe_loop, "bf16", torch.bfloat16)}
    if grouped_mm_works():
        cands["bf16-grouped_mm"] = (moe_grouped_mm, "bf16", torch.bfloat16)
    for name in CONFIGS:
        cands[name] = (moe_grouped, name, torch.bfloat16)
    if not native_bf16_gemm():  # the best float path is float32 here: the float loop and quantized rows on fp32 x
        weights["fp32"] = tuple(w.float() for w in weights["bf16"])
        cands["fp32-loop"] = (moe_loop, "fp32", torch.float32)
        for name in CONFIGS:
            cands[f"{name} (fp32 x)"] = (moe_grouped, name, torch.float32)
    floats = [c for c, (_, w, _) in cands.items() if w in ("bf16", "fp32")]
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        routes = routings(args.routings, t, E, topk, gen)
        x = torch.randn(t, H, generator=gen)
        ref = moe_loop(x.bfloat16(), *routes[0], *weights["bf16"])
        # the float paths compute the same layer (bf16 rounding apart)
        for c in floats:
            fn, w, dtype = cands[c]
            torch.testing.assert_close(fn(x.to(dtype), *routes[0], *weights[w]).to(ref.dtype), ref, rtol=0.05,
                                       atol=0.02)
        fns = {c: cycling(fn, x.to(dtype), routes, *weights[w]) for c, (fn, w, dtype) in cands.items()}
        ms = round_robin_ms(fns, budget_s=args.budget, min_runs=5, max_runs=2000)
        best = min(ms[c] for c in floats)
        # experts read per call: each routed expert once, averaged over the routings
        routed = sum(len(torch.unique(ids)) for ids, _ in routes) / len(routes)
        for c, (_, w, _) in cands.items():
            per_expert = nbytes(weights[w][0]) + nbytes(weights[w][1])
            read = routed * per_expert
            rows.append({"T": t, "candidate": c, "ms": round(ms[c], 3), "x float": round(best / ms[c], 2),
                         "MB/tok": round(read / t / 1e6, 2), "GB/s": round(read / (ms[c] * 1e-3) / 1e9, 1),
                         "% bw": round(100 * read / (ms[c] * 1e-3) / 1e9 / bw, 1)})
    print(table(rows, ["T", "candidate", "ms", "x float", "MB/tok", "GB/s", "% bw"]))
    path = save_json(args.out or ("bench_moe_quick" if args.quick else "bench_moe"),
                     {"machine_line": machine_line(), "read_bandwidth_gbs": round(bw, 1),
                      "layer": {"experts": E, "topk": topk, "hidden": H, "width": inter, "routings": args.routings},
                      "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
