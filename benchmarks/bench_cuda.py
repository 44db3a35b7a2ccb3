"""CUDA rows: affineq's GPU kernels against bf16 F.linear, side by side on one GPU.

    python benchmarks/bench_cuda.py            # 4096x4096 and 11008x4096, M = 1, 32, 512
    python benchmarks/bench_cuda.py --quick    # one small shape (a smoke run)

Each (shape, M) times bf16 `F.linear` and every config's quantized linear round-robin with CUDA events
(median of the runs), checks the kernel each config ran (`record_kernels`) and its SQNR against the bf16
output. Without a CUDA device it prints a message and exits 0 (CI has no GPU). Writes results/bench_cuda.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import save_json, table  # noqa: E402

from affineq import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    quantize_,
    record_kernels,
)

CONFIGS = {
    "int4-g128": lambda: Int4WeightOnlyConfig(group_size=128),
    "int8-weight": Int8WeightOnlyConfig,
    "w8a8-dynamic": Int8DynamicActivationInt8WeightConfig,
    "fp8-dynamic": Float8DynamicActivationFloat8WeightConfig,
}


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean().clamp_min(1e-30)))


def _round_robin_ms(fns: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up (and compile of any lazy packing)
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 10)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default="bench_cuda")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; skipped (run it on a GPU machine)")
        return
    shapes = [(512, 512)] if args.quick else [(4096, 4096), (11008, 4096)]
    ms_list = [1, 32] if args.quick else [1, 32, 512]
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}")
    rows, records = [], []
    torch.manual_seed(0)
    for n, k in shapes:
        base = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
        mods = {}
        for name, make in CONFIGS.items():
            m = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
            m.weight.data.copy_(base.weight.data)
            quantize_(m, make())
            mods[name] = m
        for m_rows in ms_list:
            x = torch.randn(m_rows, k, dtype=torch.bfloat16, device="cuda")
            with torch.no_grad():
                ref = F.linear(x, base.weight)
                kernels, quality = {}, {}
                for name, mod in mods.items():
                    with record_kernels() as used:
                        out = mod(x)
                    kernels[name] = used[0] if used else "?"
                    quality[name] = _sqnr(ref, out)
                fns = {"bf16": lambda x=x, w=base.weight: F.linear(x, w)}
                fns.update({name: (lambda mod=mod, x=x: mod(x)) for name, mod in mods.items()})
                ms = _round_robin_ms(fns, args.rounds)
            for name in CONFIGS:
                ratio = ms["bf16"] / ms[name]
                rows.append({"shape": f"{n}x{k}", "M": m_rows, "bf16 ms": f"{ms['bf16']:.4f}", "config": name,
                             "ms": f"{ms[name]:.4f}", "vs bf16": f"{ratio:.2f}x", "kernel": kernels[name],
                             "SQNR dB": f"{quality[name]:.1f}"})
                records.append({"shape": [n, k], "m": m_rows, "config": name, "bf16_ms": ms["bf16"],
                                "ms": ms[name], "speedup_vs_bf16": ratio, "kernel": kernels[name],
                                "sqnr_db": quality[name]})
    print(table(rows, ["shape", "M", "bf16 ms", "config", "ms", "vs bf16", "kernel", "SQNR dB"]))
    save_json(args.out, {"gpu": gpu, "torch": torch.__version__, "rows": records})


if __name__ == "__main__":
    main()
