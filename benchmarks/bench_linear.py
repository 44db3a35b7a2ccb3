"""Linear micro-benchmark: float vs affineq configs vs the best aten kernel, side by side in one run.

    python benchmarks/bench_linear.py                       # full grid, eager
    python benchmarks/bench_linear.py --compile --m 1 32    # add torch.compile rows
    python benchmarks/bench_linear.py --quick               # one shape, M = 1 and 32
    python benchmarks/bench_linear.py --quick --dtypes fp32 bf16 --configs mxfp4 mxfp6-e2m3 fp6-e3m2 mxfp8-e4m3
    python benchmarks/bench_linear.py --compute-bound       # M = 32, 128, 512: float = min(fp32, bf16), + torch.ao
    python benchmarks/bench_linear.py --compute-bound --quick   # the same on a tiny shape: a smoke run of seconds
    python benchmarks/bench_linear.py --hot                 # M = 1 with the weights in cache: x fp32 and x bf16
    python benchmarks/bench_linear.py --hot --quick         # the same on a tiny shape: a smoke run of seconds

For every (shape N x K, M, dtype) it prints the time of F.linear in fp32 and in the input dtype, the
best of them ("float"), each config's time and speedup over "float", and at M = 1 the effective weight
bandwidth (bytes of stored weights / time) as a fraction of the measured memory bandwidth, which is the
physical limit of a batch-1 linear. The float paths and every config of one (shape, M, dtype) are timed
round-robin, so that a noisy spell on the machine cannot tilt their ratios. Writes results/bench_linear.json
and results/bench_linear.png.

`--compute-bound` (issue 30) times M = 32, 128, 512 on 4096x4096 and 11008x4096 for fp32 and bf16 input, with
"float" = the best of fp32 and bf16 F.linear (whatever the input dtype) and torch.ao's `quantize_dynamic` (int8
dynamic, fp32 input) as a column; the kernel each config ran at that M and the CPU kind (amx / avx512 / avx2,
which picks the row thresholds of `affineq.tensor.compute_bound`) are printed and saved.

`--hot` (issue 30's M = 1 target: int4 and int8 >= 4x fp32 and >= 2.5x bf16 with hot weights) calls one copy of
each weight again and again, in bursts of calls (the first untimed) so that it is back in the last-level cache
whatever the other candidates read in between, at M = 1 on 4096x4096 and 11008x4096, and prints each config's
speed over fp32 and over bf16 F.linear (results/bench_linear_hot.json).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, machine_line, memory_bandwidth_gbs, round_robin_ms, save_json, table  # noqa: E402

import affineq  # noqa: E402
from affineq import (  # noqa: E402
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MXWeightOnlyConfig,
    PerGroup,
    quantize_,
)
from affineq.tensor.compute_bound import cpu_kind  # noqa: E402

CONFIGS = {
    "int4-g128": Int4WeightOnlyConfig(group_size=128),
    "int4-g128-aten": Int4WeightOnlyConfig(group_size=128, packing_format="int4_cpu"),
    "int8": Int8WeightOnlyConfig(),
    "int8-aten": Int8WeightOnlyConfig(packing_format="plain"),
    "int2-g64": IntxWeightOnlyConfig(torch.int2, PerGroup(64)),
    "int3-g32": IntxWeightOnlyConfig(torch.int3, PerGroup(32)),
    "int8-dyn": Int8DynamicActivationInt8WeightConfig(),
    "int8-dyn-dense": Int8DynamicActivationInt8WeightConfig(packing_format="dense"),
    "8da4w-g32": Int8DynamicActivationInt4WeightConfig(group_size=32),
    "fp8-e4m3": Float8WeightOnlyConfig(),
    # OCP MX (e8m0 scale per 32) and FPx (fp32 scale per 32) weight-only, on affineq.lowbit_linear
    "mxfp4": MXWeightOnlyConfig("fp4_e2m1"),
    "mxfp6-e2m3": MXWeightOnlyConfig("fp6_e2m3"),
    "fp6-e3m2": FPxWeightOnlyConfig(3, 2, group_size=32),
    "fp4-g32": FPxWeightOnlyConfig(2, 1, group_size=32),
    "mxfp8-e4m3": MXWeightOnlyConfig(torch.float8_e4m3fn),
    # compute_dtype=bf16 (fp32 input rounded to bf16, the bf16 kernels): fp32 rows only
    "int4-g128@bf16": Int4WeightOnlyConfig(group_size=128, compute_dtype=torch.bfloat16),
    "int8@bf16": Int8WeightOnlyConfig(compute_dtype=torch.bfloat16),
    "int3-g32@bf16": IntxWeightOnlyConfig(torch.int3, PerGroup(32), compute_dtype=torch.bfloat16),
    "fp8-e4m3@bf16": Float8WeightOnlyConfig(compute_dtype=torch.bfloat16),
    "mxfp4@bf16": MXWeightOnlyConfig("fp4_e2m1", compute_dtype=torch.bfloat16),
    "fp6-e3m2@bf16": FPxWeightOnlyConfig(3, 2, group_size=32, compute_dtype=torch.bfloat16),
    # ... and for the configs that quantize activations (the bf16-rounded x quantized as a bf16 input is)
    "8da4w-g32@bf16": Int8DynamicActivationInt4WeightConfig(group_size=32, compute_dtype=torch.bfloat16),
    "int8-dyn@bf16": Int8DynamicActivationInt8WeightConfig(compute_dtype=torch.bfloat16),
}
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N = out_features, K = in_features)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --compute-bound (issue 30): the shapes and configs of the compute-bound comparison
COMPUTE_BOUND_SHAPES = [(4096, 4096), (11008, 4096)]
COMPUTE_BOUND_CONFIGS = ["int4-g128", "int8", "int3-g32", "fp8-e4m3", "mxfp4", "fp6-e3m2", "int8-dyn",
                         "int8-dyn-dense", "8da4w-g32", "int4-g128@bf16", "int8@bf16", "int3-g32@bf16",
                         "fp8-e4m3@bf16", "mxfp4@bf16", "fp6-e3m2@bf16", "8da4w-g32@bf16", "int8-dyn@bf16"]


def _linear(n: int, k: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Linear(k, n, bias=False)
    nn.init.normal_(m.weight, std=0.02)
    return m.to(dtype).eval()


COLD_BYTES = 160 * 2**20  # more than the last-level cache: each call reads its weights from DRAM
HOT_BURST = 8  # --hot: calls per turn of the round-robin; the first (weights back into cache) is not timed


def _weight_bytes(w: torch.Tensor) -> int:
    return w.storage_bytes() if hasattr(w, "storage_bytes") else w.numel() * w.element_size()


def _copies(w: torch.Tensor, hot: bool = False) -> list[torch.Tensor]:
    """Enough copies of w that cycling through them never finds the weights in cache (an honest M = 1); w alone
    when `hot`."""
    return [w] if hot else [w] + [w.clone() for _ in range(min(31, -(-COLD_BYTES // _weight_bytes(w)) - 1))]


def _cycling(fn, x, weights: list[torch.Tensor]):
    """fn(x, w) over the copies of w in turn."""
    i = 0

    def step():
        nonlocal i
        i += 1
        return fn(x, weights[i % len(weights)])

    return step


def _time_all(fn, xs: dict[str, torch.Tensor], weights: dict[str, list[torch.Tensor]], extra=None,
              budget_s: float = 0.4, hot: bool = False) -> dict[str, float]:
    """Median ms of fn(xs[name], copy of weights[name]) per name (and of each callable in `extra`), all timed
    round-robin; `hot`: in bursts of HOT_BURST calls, the first untimed (it brings the weights back into cache)."""
    cands = {name: _cycling(fn, xs[name], ws) for name, ws in weights.items()}
    cands.update(extra or {})
    with torch.inference_mode():
        return round_robin_ms(cands, budget_s=budget_s, min_runs=max(5, max(len(w) for w in weights.values())),
                              burst=HOT_BURST if hot else 1)


def _ao_dynamic(base: nn.Module, hot: bool = False) -> list[nn.Module]:
    """torch.ao's int8 dynamic quantization of the fp32 linear (fbgemm / onednn engine), as cold copies (one when
    `hot`)."""
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice: it is the comparison here
        warnings.simplefilter("ignore", DeprecationWarning)
        q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base).float(), {nn.Linear}, dtype=torch.qint8)
    return [q] + [copy.deepcopy(q) for _ in range(len(_copies(base.weight.detach(), hot)) - 1)]


def _calling(mods: list[nn.Module], x: torch.Tensor):
    """mods[i](x) over the copies in turn (as `_cycling` for whole modules)."""
    return _cycling(lambda xx, m: m(xx), x, mods)


def run(args) -> list[dict]:
    bw = memory_bandwidth_gbs(64 if args.quick else 512)
    print(machine_line() + f", CPU kind {cpu_kind()} (affineq.tensor.compute_bound row thresholds)")
    print(f"# measured read bandwidth: {bw:.1f} GB/s (the M = 1 limit: weight bytes / bandwidth)")
    print("# every call reads the same weights (hot: in cache)\n" if args.hot else
          "# each call reads a different copy of the weights (cold cache), as in a real model's forward\n")
    rows = []
    modes = ["eager"] + (["compiled"] if args.compile else [])
    hot = args.hot
    for n, k in args.shapes:
        base = _linear(n, k, torch.float32)
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            w_fp32 = _copies(base.weight.detach(), hot)
            w_same = _copies(base.weight.detach().to(dtype), hot) if dtype != torch.float32 else w_fp32
            # --compute-bound / --hot: the best float path is min(fp32, bf16) whatever the input dtype (and bf16
            # F.linear is timed); --compute-bound: torch.ao's column
            w_bf16 = (w_same if dtype == torch.bfloat16 else _copies(base.weight.detach().bfloat16(), hot)) \
                if args.compute_bound or hot else None
            ao = _ao_dynamic(base, hot) if args.compute_bound else None
            quantized = {}
            for cname in args.configs:
                if cname.endswith("@bf16") and dtype != torch.float32:
                    continue  # compute_dtype changes float32 inputs only
                t0 = time.perf_counter()
                cfg = CONFIGS[cname]
                qm = quantize_(copy.deepcopy(base).to(dtype), cfg)
                quantize_s = time.perf_counter() - t0
                quantized[cname] = (_copies(qm.weight.detach(), hot), quantize_s)
            kernels: dict[str, str] = {}
            for mode in modes:
                fn = F.linear
                if mode == "compiled":
                    # One compiled function serves every config and M: each (format, M) is its own graph.
                    torch._dynamo.reset()
                    torch._dynamo.config.cache_size_limit = 256
                    fn = torch.compile(lambda x, w: F.linear(x, w), fullgraph=True, dynamic=False)
                for mm in args.m:
                    x = torch.randn(mm, k, dtype=dtype)
                    for cname, (ws, _) in quantized.items():
                        with torch.inference_mode(), affineq.record_kernels() as used:
                            F.linear(x, ws[0])  # the kernel this M runs (some start at a row threshold)
                        kernels[cname] = used[0] if used else "?"
                    xs = {"fp32": x.float(), "same": x, "bf16": x.bfloat16(), **{c: x for c in quantized}}
                    ws_all = {"fp32": w_fp32, **({"same": w_same} if dtype != torch.float32 else {}),
                              **({"bf16": w_bf16} if w_bf16 is not None and dtype != torch.bfloat16 else {}),
                              **{c: ws for c, (ws, _) in quantized.items()}}
                    extra = {"ao-dynamic": _calling(ao, x.float())} if ao is not None and mode == "eager" else {}
                    times = _time_all(fn, xs, ws_all, extra, budget_s=args.budget, hot=hot)
                    t_fp32 = times["fp32"]
                    t_same = times.get("same", t_fp32)
                    t_float = min(t_fp32, t_same, times.get("bf16", t_same))
                    row = {"N x K": f"{n}x{k}", "M": mm, "dtype": dname, "mode": mode,
                           "fp32 ms": f"{t_fp32:.3f}", "float ms": f"{t_float:.3f}"}
                    record = dict(shape=(n, k), m=mm, dtype=dname, mode=mode, fp32_ms=t_fp32,
                                  same_dtype_ms=t_same, float_ms=t_float, configs={},
                                  cpu_kind=cpu_kind(), threads=torch.get_num_threads())
                    if "bf16" in times or dtype == torch.bfloat16:
                        record["bf16_ms"] = times.get("bf16", t_same)
                    if "ao-dynamic" in times:
                        t_ao = times["ao-dynamic"]
                        row["ao-dynamic"] = f"{t_ao:.3f} ({t_float / t_ao:.2f}x)"
                        record["ao_dynamic_ms"] = t_ao
                    for cname, (ws, quantize_s) in quantized.items():
                        t = times[cname]
                        gbs = _weight_bytes(ws[0]) / (t * 1e-3) / 1e9
                        row[cname] = f"{t:.3f} ({t_float / t:.2f}x)"
                        record["configs"][cname] = dict(ms=t, speedup=t_float / t, weight_gbs=gbs,
                                                        bw_fraction=gbs / bw, kernel=kernels[cname],
                                                        quantize_s=quantize_s, over_fp32=t_fp32 / t)
                        if "bf16_ms" in record:
                            record["configs"][cname]["over_bf16"] = record["bf16_ms"] / t
                            if args.hot:
                                row[cname] = f"{t:.3f} ({t_fp32 / t:.2f}x fp32, {record['bf16_ms'] / t:.2f}x bf16)"
                    rows.append(row)
                    records.append(record)
                    print(f"  {n}x{k} M={mm} {dname} {mode}: float {t_float:.3f} ms  " + "  ".join(
                        f"{c} {record['configs'][c]['ms']:.3f}" for c in quantized), flush=True)
    print()
    columns = ["N x K", "M", "dtype", "mode", "fp32 ms", "float ms",
               *(["ao-dynamic"] if args.compute_bound else []), *args.configs]
    print(table(rows, columns))
    print("\nkernel per config and M (record_kernels): " + "; ".join(
        f"{r['shape'][0]}x{r['shape'][1]} M={r['m']} {r['dtype']}: "
        + ", ".join(f"{c} {v['kernel']}" for c, v in r["configs"].items()) for r in records if r["mode"] == "eager"))
    print("\nM = 1 effective weight bandwidth (GB/s, fraction of measured) and kernel:")
    for r in records:
        if r["m"] == 1:
            parts = [f"{c} {v['weight_gbs']:.1f} ({v['bw_fraction']:.0%}, {v['kernel']})"
                     for c, v in r["configs"].items()]
            print(f"  {r['shape'][0]}x{r['shape'][1]} {r['dtype']} {r['mode']}: " + "; ".join(parts))
    save_json(args.out, {"bandwidth_gbs": bw, "records": records})
    _plot(records, bw, args.out)
    return records


records: list[dict] = []


def _plot(records: list[dict], bw: float, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for results/bench_linear.png)")
        return
    mode = "eager" if any(r["mode"] == "eager" for r in records) else "compiled"
    eager = [r for r in records if r["mode"] == mode and tuple(r["shape"]) == (4096, 4096)]
    if not eager:
        return
    dtypes = sorted({r["dtype"] for r in eager})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
    for ax, dname in zip(axes[0], dtypes, strict=False):
        rs = sorted((r for r in eager if r["dtype"] == dname), key=lambda r: r["m"])
        ms = [r["m"] for r in rs]
        for cname in rs[0]["configs"]:
            ax.plot(ms, [r["configs"][cname]["speedup"] for r in rs], marker="o", label=cname)
        ax.axhline(1.0, color="k", lw=1, ls="--", label="best float")
        ax.set_xscale("log", base=2)
        ax.set_title(f"4096x4096 linear, {dname} input, {mode}")
        ax.set_xlabel("M (rows of the input)")
        ax.set_ylabel("speedup over the best float path")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(machine_line().lstrip("# "), fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / name}.png")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--shapes", type=lambda s: tuple(int(v) for v in s.split("x")), nargs="+", default=SHAPES,
                   help="N x K pairs, e.g. 4096x4096")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(fullgraph=True)")
    p.add_argument("--quick", action="store_true",
                   help="4096x4096 only, M = 1 and 32; with --compute-bound: 512x512, M = 32, a few configs; with "
                        "--hot: 512x512")
    p.add_argument("--compute-bound", action="store_true",
                   help="M = 32, 128, 512 on 4096x4096 and 11008x4096, fp32 and bf16, with min(fp32, bf16) as "
                        "the float path and torch.ao quantize_dynamic as a column")
    p.add_argument("--hot", action="store_true",
                   help="M = 1 on 4096x4096 and 11008x4096 with one copy of each weight (it stays in cache), fp32 "
                        "and bf16 input, speed over fp32 and over bf16 F.linear")
    p.add_argument("--budget", type=float, default=0.4, help="seconds of timing per (shape, M, dtype)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench_linear", help="results/<out>.json and .png")
    args = p.parse_args(argv)
    if args.compute_bound:
        args.shapes, args.m, args.dtypes = COMPUTE_BOUND_SHAPES, [32, 128, 512], ["fp32", "bf16"]
        if args.configs == list(CONFIGS):
            args.configs = COMPUTE_BOUND_CONFIGS
        if args.out == "bench_linear":
            args.out = "bench_linear_compute_bound"
        if args.quick:  # a smoke run: every code path once, in seconds (no meaningful timing)
            args.shapes, args.m, args.budget = [(512, 512)], [32], 0.02
            args.configs, args.out = ["int4-g128", "int8", "int8-dyn"], args.out + "_quick"
    elif args.hot:
        args.shapes, args.m, args.dtypes = COMPUTE_BOUND_SHAPES, [1], ["fp32", "bf16"]
        if args.configs == list(CONFIGS):
            args.configs = ["int4-g128", "int8"]
        if args.out == "bench_linear":
            args.out = "bench_linear_hot"
        if args.quick:  # a smoke run, as --compute-bound --quick
            args.shapes, args.budget, args.out = [(512, 512)], 0.02, args.out + "_quick"
    elif args.quick:
        args.shapes, args.m = [(4096, 4096)], [1, 32]
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
