"""Accuracy algorithms on real models: SmolLM2-135M perplexity and MiniLM embedding cosine for float,
round-to-nearest (RTN) and each algorithm in METHODS, at every weight setting in SETTINGS.

    python benchmarks/bench_algorithms.py                    # the full table (run it alone: it takes a while)
    python benchmarks/bench_algorithms.py --quick            # smoke run: small calibration and eval sets
    python benchmarks/bench_algorithms.py --methods RTN GPTQ --settings int4-g64 --models smollm2

SmolLM2 is calibrated on `calibration_text()` (32 x 512 tokens) and evaluated on the disjoint `eval_text()`
(4096 tokens); lm_head stays float so the rows compare the decoder linears. MiniLM (all encoder linears) is
calibrated on 32 x 128 tokens of the same text and scored by the mean cosine of its SENTENCES embeddings to the
float model's. Every row runs in its own subprocess, one after another (never in parallel), so its quantize time
is measured alone. Writes results/bench_algorithms.json and prints a markdown table under the machine line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, save_json  # noqa: E402

import affineq  # noqa: E402
import affineq.algorithms as A  # noqa: E402
from affineq import models as M  # noqa: E402
from affineq.calibration import Int8StaticActivationInt8WeightConfig  # noqa: E402
from affineq.configs import (  # noqa: E402
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    QuantConfig,
)
from affineq.granularity import PerGroup  # noqa: E402
from affineq.primitives import MappingType  # noqa: E402

# Weight settings (the base configs the methods wrap).
SETTINGS: dict[str, Callable[[], QuantConfig]] = {
    "int4-g64": lambda: Int4WeightOnlyConfig(group_size=64),
    "int3-g64": lambda: IntxWeightOnlyConfig(torch.int3, PerGroup(64), MappingType.ASYMMETRIC),
    "int8": lambda: Int8WeightOnlyConfig(),
    "w8a8": lambda: Int8DynamicActivationInt8WeightConfig(),
    "w8a8-static": lambda: Int8StaticActivationInt8WeightConfig(observer="mse"),
}


def _algorithm(name: str, **kwargs) -> Callable[[QuantConfig], QuantConfig | None]:
    """Factory for `affineq.algorithms.<name>`: None (row skipped) while the algorithm is not there or does not
    wrap this base config."""
    def factory(base: QuantConfig) -> QuantConfig | None:
        cls = getattr(A, name, None)
        if cls is None or cls(None, **kwargs).cannot_wrap(base) is not None:
            return None
        return cls(base, **kwargs)
    return factory


# Method name -> factory(base config) -> the config quantize_ gets, or None to skip this (method, setting).
METHODS: dict[str, Callable[[QuantConfig], QuantConfig | None]] = {
    "RTN": lambda base: base,
    "GPTQ": _algorithm("GPTQConfig"),
    "AWQ": _algorithm("AWQConfig"),
    "HQQ": _algorithm("HQQConfig"),
    "SmoothQuant": _algorithm("SmoothQuantConfig"),
    "SmoothQuant a=0.8": _algorithm("SmoothQuantConfig", alpha=0.8),
}

# (method, setting) pairs left out of the default table: AWQ at int8 (RTN is already near float there and the
# search is the slowest row); alpha 0.8 is for the static setting, where per-tensor scales need the stronger
# migration; static rows on SmolLM2 (the MiniLM rows show static vs dynamic).
SKIP = {("AWQ", "int8"), ("SmoothQuant a=0.8", "w8a8")}
SKIP_MODEL = {("smollm2", "w8a8-static")}

FULL = {"smollm2": {"n": 32, "seq_len": 512, "eval_tokens": 4096}, "minilm": {"n": 32, "seq_len": 128}}
QUICK = {"smollm2": {"n": 2, "seq_len": 128, "eval_tokens": 512}, "minilm": {"n": 4, "seq_len": 64}}


def _decoder_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn != "lm_head"


def _encoder_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn.startswith("encoder.")


def run_row(model_name: str, method: str, setting: str, quick: bool) -> dict | None:
    """Load the model, quantize it as (method, setting) asks (float: nothing), return the metrics."""
    sizes = (QUICK if quick else FULL)[model_name]
    config = None
    if method != "float":
        config = METHODS[method](SETTINGS[setting]())
        if config is None:
            return None
    torch.manual_seed(0)
    if model_name == "smollm2":
        model, tok = M.load_smollm2()
        data_fn = lambda: M.calibration_batches(tok, sizes["n"], sizes["seq_len"])  # noqa: E731
        filter_fn = _decoder_linear
    else:
        model, tok = M.load_minilm()
        data_fn = lambda: M.calibration_batches(tok, sizes["n"], sizes["seq_len"], as_dict=True)  # noqa: E731
        filter_fn = _encoder_linear
        ref = M.embed(model, tok, M.SENTENCES)
    row = {"model": model_name, "method": method, "setting": setting if config is not None else "-"}
    if config is not None:
        needs_data = getattr(config, "needs_data", False) or getattr(config, "needs_calibration", False)
        data = data_fn() if needs_data else None
        start = time.perf_counter()
        affineq.quantize_(model, config, filter_fn=filter_fn, calibration_data=data)
        row["quantize_s"] = time.perf_counter() - start
    if model_name == "smollm2":
        row["perplexity"] = M.perplexity(model, tok, max_tokens=sizes["eval_tokens"])
    else:
        row["cosine"] = M.embedding_similarity(ref, M.embed(model, tok, M.SENTENCES))
    return row


def _child(model_name: str, method: str, setting: str, quick: bool) -> dict | None:
    cmd = [sys.executable, __file__, "--one", model_name, method, setting] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = next((x for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        print(f"{model_name} {method} {setting}: failed\n{out.stderr[-3000:]}", flush=True)
        return None
    return json.loads(line[4:])


def markdown(rows: list[dict]) -> str:
    """One line per (method, setting): SmolLM2 perplexity and its change vs float, MiniLM cosine, quantize
    times."""
    base = next((r["perplexity"] for r in rows if r["model"] == "smollm2" and r["method"] == "float"), None)
    keys = list(dict.fromkeys((r["method"], r["setting"]) for r in rows))
    lines = ["| method | bits | SmolLM2 ppl | Δ% vs float | MiniLM cosine | quantize s (SmolLM2 / MiniLM) |",
             "|---|---|---:|---:|---:|---:|"]
    for method, setting in keys:
        lm = next((r for r in rows if (r["method"], r["setting"], r["model"]) == (method, setting, "smollm2")), {})
        enc = next((r for r in rows if (r["method"], r["setting"], r["model"]) == (method, setting, "minilm")), {})
        ppl = f"{lm['perplexity']:.3f}" if "perplexity" in lm else ""
        delta = f"{(lm['perplexity'] / base - 1) * 100:+.1f}%" if "perplexity" in lm and base else ""
        cos = f"{enc['cosine']:.4f}" if "cosine" in enc else ""
        times = " / ".join(f"{r['quantize_s']:.1f}" if "quantize_s" in r else "-" for r in (lm, enc) if r)
        lines.append(f"| {method} | {setting} | {ppl} | {delta} | {cos} | {times} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "minilm"], choices=["smollm2", "minilm"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--quick", action="store_true", help="smoke run: tiny calibration and eval sets, int4-g64 only")
    p.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    p.add_argument("--update", action="store_true",
                   help="replace only the rows run now in the saved results (keep the others)")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "METHOD", "SETTING"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        row = run_row(*args.one, quick=args.quick)
        print("ROW " + json.dumps(row))
        return
    settings = ["int4-g64"] if args.quick and args.settings == list(SETTINGS) else args.settings
    available = M.available_models()
    print(machine_line())
    rows: list[dict] = []
    for model_name in args.models:
        if not available.get(model_name):
            print(f"# {model_name}: not installed, skipped ({M.INSTALL_HINT})")
            continue
        plan = [("float", "-")] + [(m, s) for s in settings for m in args.methods
                                   if METHODS[m](SETTINGS[s]()) is not None and (m, s) not in SKIP
                                   and (model_name, s) not in SKIP_MODEL]
        for method, setting in plan:
            row = _child(model_name, method, setting, args.quick)
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.update and not args.quick:
        old = json.loads((Path(__file__).parent / "results" / "bench_algorithms.json").read_text())["rows"]
        new = {(r["model"], r["method"], r["setting"]): r for r in rows}
        rows = [new.pop((r["model"], r["method"], r["setting"]), r) for r in old] + list(new.values())
    table = markdown(rows)
    print()
    print(table)
    if rows and not args.no_save:
        name = "bench_algorithms_quick" if args.quick else "bench_algorithms"
        path = save_json(name, {"quick": args.quick, "rows": rows, "table": table})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
