"""How long quantize_ takes on a stack of linears holding about one billion parameters.

    python benchmarks/bench_quantize.py [--layers 60] [--configs int4-g128 int8]

60 layers of 4096 x 4096 = 1.007e9 parameters (4 GB in fp32). Prints seconds per config and the
resulting weight bytes; writes results/bench_quantize.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_linear import CONFIGS  # noqa: E402
from common import machine_line, save_json, table  # noqa: E402

from affineq import quantize_, quantized_weights  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--configs", nargs="+", default=["int4-g128", "int8", "int4-g128-aten"],
                   choices=list(CONFIGS))
    args = p.parse_args(argv)
    print(machine_line())
    rows, out = [], {}
    for name in args.configs:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
        model = model.to_empty(device="cpu")
        for m in model:
            nn.init.normal_(m.weight, std=0.02)
        params = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        quantize_(model, CONFIGS[name])
        seconds = time.perf_counter() - t0
        nbytes = sum(w.storage_bytes() for w in quantized_weights(model).values())
        rows.append({"config": name, "params": f"{params / 1e9:.3f}e9", "seconds": f"{seconds:.1f}",
                     "GB after": f"{nbytes / 1e9:.2f}", "GB fp32": f"{params * 4 / 1e9:.2f}"})
        out[name] = {"params": params, "seconds": seconds, "bytes": nbytes}
        print(rows[-1], flush=True)
        del model
    print(table(rows, list(rows[0])))
    save_json("bench_quantize", {"results": out})


if __name__ == "__main__":
    main()
