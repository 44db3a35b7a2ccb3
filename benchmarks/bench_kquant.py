"""k-quant super-blocks (`affineq.kquant_linear`, q2_k .. q6_k as llama.cpp stores them) against the int4 g32 path
(`affineq.lowbit_linear` on the `dense` format) and fp32 F.linear, at decode-size M.

    python benchmarks/bench_kquant.py                  # 4096x4096 and 11008x4096, M in 1, 4, 8, 32, 128
    python benchmarks/bench_kquant.py --quick          # 1024x1024, M = 1 only, short runs (checks the script)
    python benchmarks/bench_kquant.py --out bench_kquant_amx   # on the AMX Xeon (the Zen 5's run: bench_kquant)

Issue 33 asks the k-quant kernels to reach the int4 g32 path's speed at M = 1. The weights are random valid
blocks (every code and sub-scale drawn from its range, written by kquant_encode: the speed does not depend on
the values, and quantize_kquant of large weights takes minutes on few cores). Two int4 g32 rows, uint4
asymmetric as q4_k, on the same `dense` kernels: `int4-g32` with fp32 scale and offset per 32 (6 bits per
weight stored) and `int4-g32-bf16` with bf16 ones (5 bits per weight: what `Int4WeightOnlyConfig(group_size=32)`
stores). Candidates are timed round-robin in one process (medians; compare ratios), each with its own weight
copy so that none finds its weights left in cache by another. Columns: ms per call, "x i4" / "x i4b" =
int4-g32 / int4-g32-bf16 time over this row's time (> 1: faster), bpw = stored bits per weight, GB/s = weight
bytes streamed per second at M = 1, "GB/s vs i4b" = that over int4-g32-bf16's (per byte: > 1 streams faster).
Writes results/bench_kquant.json.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's affineq
from common import machine_line, round_robin_ms, save_json, table  # noqa: E402

KINDS = ("q4_k", "q6_k", "q5_k", "q3_k", "q2_k")


def random_blocks(kind: str, n: int, k: int) -> torch.Tensor:
    """Valid super-blocks [n, k / 256 * type_size] with random codes, sub-scales and fp16 scales in [0, 0.01),
    as a GGUF file stores them (`format_kquant.from_blocks` relays them out for the kernel)."""
    from affineq.tensor.format_kquant import KQUANT_TYPES
    from affineq.tensor.kquant_encode import encode

    t = KQUANT_TYPES[kind]
    b, nsub = n * k // 256, 256 // t.group
    u = torch.randint(0, t.quant_max - t.quant_min + 1, (b, 256), dtype=torch.uint8)
    lo, hi = {"q6_k": (-128, 127), "q3_k": (-32, 31), "q2_k": (0, 15)}.get(kind, (0, 63))
    sc = torch.randint(lo, hi + 1, (b, nsub))
    mn = None if lo < 0 else torch.randint(0, hi + 1, (b, nsub))
    return encode(kind, u, torch.rand(b) * 0.01, sc, torch.rand(b) * 0.01, mn).reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,11008x4096", help="NxK list (N = out_features, K %% 256 == 0)")
    ap.add_argument("--m", default="1,4,8,32,128", help="rows of x (k-quant paths: GEMV to 4, tile GEMM to 256)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per candidate per (shape, M)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench_kquant",
                    help="results/<out>.json (the AMX Xeon's run: bench_kquant_amx; the Zen 5's: bench_kquant)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.shapes, args.m, args.budget = "1024x1024", "1", 0.02

    import affineq.cpp as K
    from affineq.tensor.format_kquant import from_blocks

    if not K.is_available():
        sys.exit(f"affineq C++ kernels unavailable: {K.unavailable_reason()}")
    torch.manual_seed(0)
    print(machine_line())
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        w = torch.randn(n, k) * 0.02
        stored = {kind: from_blocks(kind, random_blocks(kind, n, k)) for kind in KINDS}
        u = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = torch.rand(n, k // 32) * 0.01 + 1e-3
        i4 = (K.pack_codes(u, 4), scale, -8 * scale)
        i4b = (K.pack_codes(u, 4), scale.bfloat16(), (-8 * scale).bfloat16())
        nbytes = {"int4-g32": sum(t.numel() * t.element_size() for t in i4), "fp32": 4 * n * k,
                  "int4-g32-bf16": sum(t.numel() * t.element_size() for t in i4b),
                  **{kind: sum(v.numel() * v.element_size() for v in t.values()) for kind, t in stored.items()}}
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k)
            cands = {"fp32": partial(F.linear, x, w),
                     "int4-g32": partial(torch.ops.affineq.lowbit_linear, x, *i4, 4, 32, n, k),
                     "int4-g32-bf16": partial(torch.ops.affineq.lowbit_linear, x, *i4b, 4, 32, n, k)}
            for kind, t in stored.items():
                cands[kind] = partial(torch.ops.affineq.kquant_linear, x, t["qdata"], t["scales"], t.get("mins"),
                                      t["d"], int(kind[1]), n, k)
            t = round_robin_ms(cands, budget_s=args.budget)
            gbs_i4b = nbytes["int4-g32-bf16"] / t["int4-g32-bf16"]
            for name, ms in t.items():
                rows.append({"shape": shape, "m": m, "kernel": name, "ms": round(ms, 4),
                             "x i4": round(t["int4-g32"] / ms, 2), "x i4b": round(t["int4-g32-bf16"] / ms, 2),
                             "bpw": round(nbytes[name] * 8 / (n * k), 4),
                             "GB/s": round(nbytes[name] / ms / 1e6, 1) if m == 1 else "",
                             "GB/s vs i4b": round(nbytes[name] / ms / gbs_i4b, 2) if m == 1 else ""})
    print(table(rows, ["shape", "m", "kernel", "ms", "x i4", "x i4b", "bpw", "GB/s", "GB/s vs i4b"]))
    if not args.quick:
        save_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
