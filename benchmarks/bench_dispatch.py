"""Per-call latency of a quantized linear (dispatch + kernel), for comparing two affineq trees side by side.

    python benchmarks/bench_dispatch.py                       # this tree: one table
    python benchmarks/bench_dispatch.py --compare OLD_TREE    # alternate processes: this tree, OLD_TREE, ...

With --compare, each round runs this tree and OLD_TREE (a checkout of another affineq commit) in separate
processes one after the other, `--rounds` times, and the table shows the median of the per-round medians of
each and their ratio, so both see the same machine state. Shapes: SmolLM2's 576x576 (dispatch-bound at M=1)
and 4096x4096 (bandwidth-bound). Writes benchmarks/results/bench_dispatch.json (`--out NAME`: NAME.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CASES = ["int8", "int4_g64", "int8_dyn", "8da4w", "fp8"]
SHAPES = [(576, 576), (4096, 4096)]


def _measure(reps: int) -> dict[str, float]:
    """Median microseconds per F.linear call for every (config, shape) at M = 1, fp32 input."""
    import torch
    from torch import nn

    import affineq as A

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    configs = {
        "int8": A.Int8WeightOnlyConfig(), "int4_g64": A.Int4WeightOnlyConfig(group_size=64),
        "int8_dyn": A.Int8DynamicActivationInt8WeightConfig(),
        "8da4w": A.Int8DynamicActivationInt4WeightConfig(group_size=32), "fp8": A.Float8WeightOnlyConfig(),
    }
    out = {}
    with torch.inference_mode():
        for n, k in SHAPES:
            torch.manual_seed(0)
            x = torch.randn(1, k)
            for name in CASES:
                lin = nn.Sequential(nn.Linear(k, n, bias=False))
                A.quantize_(lin, configs[name])
                f = lin[0]
                for _ in range(20):
                    f(x)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        f(x)
                    times.append((time.perf_counter() - t0) / 10 * 1e6)
                out[f"{name} {n}x{k}"] = statistics.median(times)
    return out


def _run(tree: Path, reps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_dispatch as b, json; " \
           f"print(json.dumps(b._measure({reps})))"
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True,
                         check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", type=Path, help="another affineq tree to alternate with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default="bench_dispatch", help="results/<out>.json")
    args = ap.parse_args()
    import torch
    from common import machine_line  # noqa: E402

    trees = {"this": ROOT} | ({"other": args.compare.resolve()} if args.compare else {})
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            runs[label].append(_run(tree, args.reps))
    keys = list(runs["this"][0])
    med = {label: {k: statistics.median(r[k] for r in rs) for k in keys} for label, rs in runs.items()}
    print(machine_line())
    other_cols = f" {'other us':>9} {'this/other':>11}" if args.compare else ""
    print(f"{'case (M=1, fp32)':<24} {'this us':>9}" + other_cols)
    for k in keys:
        line = f"{k:<24} {med['this'][k]:>9.1f}"
        if args.compare:
            line += f" {med['other'][k]:>9.1f} {med['this'][k] / med['other'][k]:>10.3f}x"
        print(line)
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps({"machine": machine_line(), "torch": torch.__version__, "rounds": args.rounds,
                               "medians_us": med, "compare": str(args.compare) if args.compare else None},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
