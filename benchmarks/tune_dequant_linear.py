"""Tuning run for `affineq.dequant_linear` (issue 30): its output layout and block size against the float GEMM.

    python benchmarks/tune_dequant_linear.py [--threads 2] [--quick]

`affineq::dequant_linear` dequantizes blocks of output rows (AFFINEQ_DQ_BLOCK_KB of weight each), as W^T
(AFFINEQ_DQ_WT=1, the default: no transpose) or W (=0), and multiplies each with x by torch's GEMM, writing either a
contiguous row slice of y^T (AFFINEQ_DQ_TRANSPOSED=1, the default) or a strided column slice of y (=0). The knobs are
read once per process, so each variant runs in a child process; every child times bf16 / fp32 `F.linear` beside the
kernel, round-robin, so the ratios in one row are side by side. The last column family is the whole weight dequantized
to bf16 at once and then `F.linear` (the upper bound of an unfused design), then the fused kernel
(`affineq.lowbit_linear`) on the same weight. Writes results/tune_dequant_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, round_robin_ms, save_json, table  # noqa: E402

# name: (AFFINEQ_DQ_TRANSPOSED, AFFINEQ_DQ_BLOCK_KB, AFFINEQ_DQ_WT)
VARIANTS = {"WT-1024": ("1", "1024", "1"), "W-1024": ("1", "1024", "0"), "WT-slice-1024": ("0", "1024", "1"),
            "W-slice-1024": ("0", "1024", "0"), "WT-256": ("1", "256", "1"), "WT-4096": ("1", "4096", "1"),
            "WT-16384": ("1", "16384", "1")}


def _fused(x: torch.Tensor, w) -> torch.Tensor:
    """The fused kernel (`affineq.lowbit_linear`) on the same weight, whatever the row thresholds say."""
    from affineq.tensor.linear_kernels import lowbit_weight_args

    packed, scale, offset, bits, group_size, codes, code_offset = lowbit_weight_args(w)
    n, k = w.shape
    return torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset)


def child(args) -> dict:
    from affineq import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_, record_kernels
    from affineq.tensor import compute_bound

    torch.set_num_threads(args.threads)
    for dt in ("bf16", "fp32"):
        compute_bound.set_min_rows("affineq.dequant_linear", dt, 1)
    shapes = [(1024, 1024)] if args.quick else [(4096, 4096), (11008, 4096)]
    out = {}
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        for cname, cfg in (("int4-g128", Int4WeightOnlyConfig(group_size=128)), ("int8", Int8WeightOnlyConfig())):
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight.data.copy_(w)
            quantize_(lin, cfg)
            wb = w.bfloat16()
            for m in ([32] if args.quick else [32, 128, 512]):
                for dt in [{"bf16": torch.bfloat16, "fp32": torch.float32}[d] for d in args.dtypes.split(",")]:
                    x = torch.randn(m, k, dtype=dt)
                    with torch.no_grad(), record_kernels() as used:
                        lin(x)
                    cands = {"bf16 F.linear": lambda x=x, wb=wb: F.linear(x.bfloat16(), wb),
                             "fp32 F.linear": lambda x=x, w=w: F.linear(x.float(), w),
                             "dequant_linear": lambda x=x, lin=lin: lin(x),
                             "fused lowbit_linear": lambda x=x, lin=lin: _fused(x, lin.weight),
                             "dequantize+F.linear": lambda x=x, lin=lin: F.linear(
                                 x.bfloat16(), lin.weight.dequantize(torch.bfloat16))}
                    with torch.no_grad():
                        ms = round_robin_ms(cands, budget_s=args.budget)
                    out[f"{n}x{k} {cname} M={m} {str(dt)[6:]}"] = {**ms, "kernel": used[0] if used else "?"}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--dtypes", default="bf16,fp32", help="input dtypes: bf16, fp32 or both")
    p.add_argument("--out", default="tune_dequant_linear", help="results/<out>.json")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    print("#", machine_line())
    results = {}
    for name in args.variants.split(","):
        tr, kb, wt = VARIANTS[name]
        env = {**os.environ, "AFFINEQ_DQ_TRANSPOSED": tr, "AFFINEQ_DQ_BLOCK_KB": kb, "AFFINEQ_DQ_WT": wt}
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--budget", str(args.budget),
               "--dtypes", args.dtypes]
        r = subprocess.run(cmd + (["--quick"] if args.quick else []), env=env, capture_output=True, text=True)
        if r.returncode:
            print(f"{name}: failed\n{r.stderr[-2000:]}")
            continue
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
    rows = []
    for case in next(iter(results.values()), {}):
        row = {"case": case}
        for name, res in results.items():
            c = res[case]
            best = min(c["bf16 F.linear"], c["fp32 F.linear"])
            row[name] = f"{c['dequant_linear']:.2f} ({best / c['dequant_linear']:.2f}x)"
        c = next(iter(results.values()))[case]
        best = min(c["bf16 F.linear"], c["fp32 F.linear"])
        row["bf16 / fp32 F.linear"] = f"{c['bf16 F.linear']:.2f} / {c['fp32 F.linear']:.2f}"
        row["dequantize+F.linear"] = f"{c['dequantize+F.linear']:.2f} ({best / c['dequantize+F.linear']:.2f}x)"
        row["fused lowbit_linear"] = f"{c['fused lowbit_linear']:.2f} ({best / c['fused lowbit_linear']:.2f}x)"
        row["kernel"] = c["kernel"]
        rows.append(row)
    cols = ["case", "bf16 / fp32 F.linear", *results, "dequantize+F.linear", "fused lowbit_linear", "kernel"]
    print(table(rows, cols))
    save_json(args.out, {"threads": args.threads, "variants": VARIANTS, "results": results})


if __name__ == "__main__":
    main()
