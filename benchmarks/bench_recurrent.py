"""Quantized LSTM / GRU: speed and accuracy against float (fp32 and bf16) and torch.ao's dynamic quantization.

    python benchmarks/bench_recurrent.py [--quick] [--cells lstm gru] [--layers 1]

One nn.LSTM (or nn.GRU) of `--layers` layers, input size = hidden size, seq 50, batch 1 and 16, hidden 256
and 1024, default init with a fixed seed and a standard normal input; every row runs the same model on the
same input. Times are medians of calls taken in turn (benchmarks.common.round_robin_ms), so ratios hold on a
noisy machine. SQNR is of the output sequence against the fp32 module. Rows:
  fp32 / bf16        torch's nn.LSTM (oneDNN / the aten kernels) in that dtype
  torch.ao int8 dyn  torch.ao.quantization.quantize_dynamic(..., dtype=torch.qint8) (fbgemm, per-tensor act)
  affineq int8 dyn   quantize_(Int8DynamicActivationInt8WeightConfig()): int8 per-token activations
  affineq int4 g32   quantize_(Int4WeightOnlyConfig(group_size=32)): 4-bit weights, fp32 activations
  ..., bf16 compute  Int8WeightOnlyConfig / Int4WeightOnlyConfig(group_size=32) with compute_dtype=torch.bfloat16:
                     the fp32 model's products computed in bf16 (x and each product rounded to bf16)
Writes benchmarks/results/bench_recurrent.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, machine_line, round_robin_ms, save_json, table  # noqa: E402

import affineq  # noqa: E402
from affineq import (  # noqa: E402
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    quantize_,
)
from affineq.recurrent import RECURRENT_TYPES  # noqa: E402

SEQ = 50


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _variants(model: nn.Module) -> dict[str, tuple[nn.Module, torch.dtype]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {type(model[0])}, dtype=torch.qint8)
    select = lambda m, fqn: isinstance(m, RECURRENT_TYPES)  # noqa: E731
    return {
        "fp32": (model, torch.float32),
        "bf16": (copy.deepcopy(model).bfloat16(), torch.bfloat16),
        "torch.ao int8 dyn": (ao, torch.float32),
        "affineq int8 dyn": (quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig(),
                                       filter_fn=select), torch.float32),
        "affineq int4 g32": (quantize_(copy.deepcopy(model), Int4WeightOnlyConfig(group_size=32),
                                       filter_fn=select), torch.float32),
        # the same weights computed in bf16 (float32 model and input; x and the products rounded to bf16)
        "affineq int8, bf16 compute": (quantize_(copy.deepcopy(model), Int8WeightOnlyConfig(
            compute_dtype=torch.bfloat16), filter_fn=select), torch.float32),
        "affineq int4 g32, bf16 compute": (quantize_(copy.deepcopy(model), Int4WeightOnlyConfig(
            group_size=32, compute_dtype=torch.bfloat16), filter_fn=select), torch.float32),
    }


def run(cells: list[str], layers: int, quick: bool) -> list[dict]:
    rows = []
    sizes = [(256, 1), (256, 16)] if quick else [(256, 1), (256, 16), (1024, 1), (1024, 16)]
    for cell in cells:
        for hidden, batch in sizes:
            torch.manual_seed(0)
            model = nn.Sequential({"lstm": nn.LSTM, "gru": nn.GRU}[cell](hidden, hidden, num_layers=layers)).eval()
            x = torch.randn(SEQ, batch, hidden)
            variants = _variants(model)
            with torch.inference_mode():
                ref = model(x)[0]
                sq = {name: _sqnr(ref, m(x.to(dt))[0].float()) for name, (m, dt) in variants.items()}
                inputs = {name: x.to(dt) for name, (_, dt) in variants.items()}
                ms = round_robin_ms({name: (lambda m=m, xx=inputs[name]: m(xx)) for name, (m, _) in variants.items()},
                                    budget_s=0.3 if quick else 1.0)
            best_float = min(ms["fp32"], ms["bf16"])
            for name in variants:
                rows.append({
                    "cell": cell, "hidden": hidden, "batch": batch, "row": name, "ms": round(ms[name], 3),
                    "vs torch.ao": round(ms["torch.ao int8 dyn"] / ms[name], 2),
                    "vs best float": round(best_float / ms[name], 2),
                    "SQNR dB": "exact" if name == "fp32" else round(sq[name], 1),
                })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hidden 256 only, short timing budget")
    ap.add_argument("--cells", nargs="+", default=["lstm", "gru"], choices=["lstm", "gru"])
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    print(machine_line())
    print(f"kernels: {affineq.cpp.kernel_info().get('isa', '?')}; seq {SEQ}, {args.layers} layer(s), "
          f"input size = hidden size; ms = median per forward; vs x = x's ms / this row's ms")
    rows = run(args.cells, args.layers, args.quick)
    print(table(rows, ["cell", "hidden", "batch", "row", "ms", "vs torch.ao", "vs best float", "SQNR dB"]))
    if not args.quick:
        path = save_json("bench_recurrent", {"machine": machine(), "seq": SEQ, "layers": args.layers, "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
