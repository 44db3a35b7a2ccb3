"""Benchmark torch.ops.affineq.lowbit_linear against the float paths and aten's int4 CPU kernel.

    python benchmarks/bench_kernels.py                 # full table (3 shapes x M in 1, 8, 32, 128 x 3 dtypes)
    python benchmarks/bench_kernels.py --quick         # 4096x4096 only, fewer repetitions

All candidates of one (shape, M) are timed round-robin in one process (A, B, C, A, B, C, ...) and reported as
medians, so machine noise hits them alike; compare ratios. Between two calls of one candidate the others
stream 30-90 MB of weights, so the low-bit weights are not L3-resident: M=1 numbers are DRAM-bound, as in a
real model whose layers do not fit in cache.

Columns: fp32 / bf16 = F.linear with fp32 / bf16 weights (x cast to that dtype); aten-i4 = _weight_int4pack_mm
_for_cpu (bf16 x, group 128); i4-g128 / i8-pc = this kernel, int4 group 128 / int8 per-channel, x in the row's
dtype; "x fp32" = speed-up over fp32 F.linear; "x best" = over min(fp32, bf16 F.linear); GB/s = weight bytes
(codes + scale + offset) per second at M=1. Row "fp32*": fp32 x with AFFINEQ_KERNELS_INT16_X=1 (x rounded to
16-bit fixed point on VNNI CPUs for M >= 3, ~80 dB instead of fp32-exact); plain fp32 rows keep fp32 products.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import round_robin_ms  # noqa: E402

import affineq.cpp as K  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def machine_line() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "unknown CPU", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    info = K.kernel_info()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{model} | flags: {' '.join(isa) or 'n/a'} | torch {torch.__version__} | threads "
            f"{torch.get_num_threads()} | affineq kernels: {info['isa']} (built in {info['build_seconds']:.1f}s "
            f"this run) | load avg {load:.1f}")


def quantized_weights(n: int, k: int, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // group_size) * 0.01 + 0.001
    offset = -scale * 2 ** (bits - 1)
    return K.pack_codes(codes, bits), scale, offset


def with_int16_x(f: Callable[[], object]) -> Callable[[], object]:
    """f with AFFINEQ_KERNELS_INT16_X=1 (read by the C++ op on every call)."""

    def g() -> object:
        os.environ["AFFINEQ_KERNELS_INT16_X"] = "1"
        try:
            return f()
        finally:
            del os.environ["AFFINEQ_KERNELS_INT16_X"]

    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008", help="NxK list (N = out_features)")
    ap.add_argument("--m", default="1,8,32,128", help="rows of x")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--min-time", type=float, default=0.25, help="seconds per candidate per (shape, M)")
    ap.add_argument("--max-reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="4096x4096 only, shorter runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--no-int16-row", action="store_true", help="skip the fp32* (AFFINEQ_KERNELS_INT16_X=1) row")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.shapes, args.min_time, args.max_reps = "4096x4096", 0.1, 15
    if not K.is_available():
        sys.exit(f"affineq C++ kernels unavailable: {K.unavailable_reason()}")
    torch.manual_seed(0)
    op = torch.ops.affineq.lowbit_linear
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    os.environ.pop("AFFINEQ_KERNELS_INT16_X", None)
    variants = [(SHORT[d], d, False) for d in dtypes]  # (label, x dtype, int16 x allowed for fp32)
    if torch.float32 in dtypes and not args.no_int16_row:
        variants.insert(1, ("fp32*", torch.float32, True))
    print(machine_line())
    hdr = (f"{'shape NxK':>11} {'M':>4} {'x':>5} | {'fp32':>7} {'bf16':>7} {'aten-i4':>7} {'i4-g128':>7} "
           f"{'i8-pc':>7} | {'i4 x fp32':>9} {'i8 x fp32':>9} {'i4 x best':>9} {'i8 x best':>9} | "
           f"{'GB/s fp32':>9} {'i4':>5} {'i8':>5}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        w32 = torch.randn(n, k) * 0.02
        w16 = w32.bfloat16()
        # one copy per x dtype, so that no call finds its weights in cache left there by a sibling candidate
        i4 = {v[0]: quantized_weights(n, k, 4, 128) for v in variants}
        i8 = {v[0]: quantized_weights(n, k, 8, k) for v in variants}
        a4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        a4_sz = torch.randn(k // 128, n, 2).bfloat16() * 0.01
        nbytes = {name: sum(t.numel() * t.element_size() for t in w[variants[0][0]])
                  for name, w in (("i4", i4), ("i8", i8))}
        for m in (int(v) for v in args.m.split(",")):
            x32 = torch.randn(m, k)
            xs = {d: x32.to(d) for d in dtypes}
            xb = x32.bfloat16()
            cands: dict[str, Callable[[], object]] = {
                "fp32": partial(F.linear, x32, w32),
                "bf16": partial(F.linear, xb, w16),
                "aten-i4": partial(torch.ops.aten._weight_int4pack_mm_for_cpu, xb, a4, 128, a4_sz),
            }
            for label, d, int16 in variants:
                wrap = with_int16_x if int16 else (lambda f: f)
                cands[f"i4/{label}"] = wrap(partial(op, xs[d], *i4[label], 4, 128, n, k))
                cands[f"i8/{label}"] = wrap(partial(op, xs[d], *i8[label], 8, k, n, k))
            t = round_robin_ms(cands, budget_s=args.min_time, max_runs=args.max_reps)
            best = min(t["fp32"], t["bf16"])
            for label, _, _ in variants:
                t4, t8 = t[f"i4/{label}"], t[f"i8/{label}"]
                row = {"n": n, "k": k, "m": m, "x": label, "fp32_ms": t["fp32"],
                       "bf16_ms": t["bf16"], "aten_int4_bf16_ms": t["aten-i4"], "int4_g128_ms": t4, "int8_pc_ms": t8}
                rows.append(row)
                gbs = ""
                if m == 1:
                    gbs = (f"{4 * n * k / t['fp32'] / 1e6:9.1f} {nbytes['i4'] / t4 / 1e6:5.1f} "
                           f"{nbytes['i8'] / t8 / 1e6:5.1f}")
                print(f"{shape:>11} {m:>4} {row['x']:>5} | {t['fp32']:7.3f} {t['bf16']:7.3f} {t['aten-i4']:7.3f} "
                      f"{t4:7.3f} {t8:7.3f} | {t['fp32'] / t4:9.2f} {t['fp32'] / t8:9.2f} {best / t4:9.2f} "
                      f"{best / t8:9.2f} | {gbs}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
