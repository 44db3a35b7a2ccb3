"""Accuracy per bit on all-MiniLM-L6-v2 (float-trained: the honest test of a search): uniform weight configs of
the encoder's linears (round-to-nearest, importance-weighted, and with --gptq GPTQ at int3 g64 / int4 g64)
against `affineq.autoquant` at the same bits per weight (and with --gptq its plans with GPTQ around the chosen
configs, `autoquant(..., gptq=True)`), by embedding error = 1 - mean cosine similarity of the sentence
embeddings to the float model's (mean-pooled, L2-normalised: the sentence-transformers recipe,
`affineq.models.embed`).

    python benchmarks/bench_accuracy_minilm.py --gptq --budgets 3.5 4.5   # the issue's rows (minutes)
    python benchmarks/bench_accuracy_minilm.py            # every uniform size, no GPTQ
    python benchmarks/bench_accuracy_minilm.py --quick    # smoke run: 2 configs, 2 x 64 calibration tokens

Eval sentences: `M.SENTENCES` plus the first 240 sentences of `eval_text()` (held out); calibration: 16 x 128
tokens of `calibration_text()` (disjoint), as {"input_ids", "attention_mask"} items, for the importance matrix,
GPTQ and autoquant (sensitivity "mse" on 4 items by default). bpw counted from the stored tensors of the
quantized linears (the encoder's 36; the pooler, unused by the embedding, and the embeddings stay float).
"vs best uniform": the error relative to the lowest-error uniform row of at most the plan's bits per weight.
Writes results/bench_accuracy_minilm.json.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_accuracy_bpw import CONFIGS, bits_per_weight, gptq_plan, short_name  # noqa: E402
from common import machine_line, save_json  # noqa: E402

import affineq  # noqa: E402
from affineq import models as M  # noqa: E402
from affineq.algorithms import GPTQConfig, ImportanceWeightedConfig, collect_importance  # noqa: E402
from affineq.autoquant import DEFAULT_CANDIDATES, autoquant  # noqa: E402

UNIFORM = ("int2-g32", "int3-g64", "int3-g32", "int4-g64", "int4-g32")
GPTQ_UNIFORM = ("int3-g64", "int4-g64")  # the sizes of the comparison (3.5 and 4.5 bpw)
FULL = {"calib_n": 16, "calib_len": 128, "eval_sentences": 240}
QUICK = {"calib_n": 2, "calib_len": 64, "eval_sentences": 16}


def linears(m: nn.Module, fqn: str) -> bool:
    """The encoder's linears; the pooler's dense is left out: the sentence embedding (mean pooling of the last
    hidden state) never uses its output."""
    return isinstance(m, nn.Linear) and not fqn.startswith("pooler")


def eval_sentences(n: int) -> list[str]:
    text = re.sub(r"\s+", " ", M.eval_text())
    parts = [s.strip() for s in re.split(r"(?<=[.!?]) ", text) if len(s.strip()) > 20]
    return list(M.SENTENCES) + parts[:n]


def run(quick: bool, gptq: bool = False, budgets: list[float] | None = None, sensitivity: str = "mse",
        sensitivity_items: int = 4) -> list[dict]:
    sizes = QUICK if quick else FULL
    model, tok = M.load_minilm()
    sentences = eval_sentences(sizes["eval_sentences"])
    ref = M.embed(model, tok, sentences)

    def error(m: nn.Module) -> float:
        with torch.inference_mode():
            return 1.0 - M.embedding_similarity(ref, M.embed(m, tok, sentences))

    data = M.calibration_batches(tok, sizes["calib_n"], sizes["calib_len"], as_dict=True)
    importance = collect_importance(model, data, filter_fn=linears, progress_bar=False)
    rows = []
    for name in (UNIFORM[1:4:2] if quick else UNIFORM):
        base = CONFIGS[name]()
        variants = [("rtn", base), ("imatrix", ImportanceWeightedConfig(base, importance=importance, progress=False))]
        if gptq and name in GPTQ_UNIFORM:
            variants.append(("gptq", GPTQConfig(base, progress=False)))
        for kind, cfg in variants:
            q = copy.deepcopy(model)
            affineq.quantize_(q, cfg, filter_fn=linears, calibration_data=data if kind == "gptq" else None)
            bpw, n = bits_per_weight(q)
            rows.append({"config": name, "imatrix": kind == "imatrix", "gptq": kind == "gptq", "bpw": bpw,
                         "weights": n, "error": error(q)})
            print(_line(rows[-1]), flush=True)
    budgets = budgets or sorted({round(r["bpw"], 4) for r in rows})
    start = time.perf_counter()
    plans = autoquant(model, budgets, data, candidates=DEFAULT_CANDIDATES, filter_fn=linears, progress=False,
                      sensitivity=sensitivity, sensitivity_items=sensitivity_items)
    search_s = time.perf_counter() - start
    uniform = list(rows)
    for budget, plan in zip(budgets, plans, strict=True):
        for with_gptq in (False, True) if gptq else (False,):
            if with_gptq:  # the same choice, GPTQ around each chosen config (autoquant(..., gptq=True)'s plan)
                plan = gptq_plan(plan)
            q = affineq.quantize_(copy.deepcopy(model), plan, calibration_data=data if with_gptq else None)
            bpw, n = bits_per_weight(q)
            mix: dict[str, int] = {}
            for cfg in plan.fqn_to_config.values():
                mix[short_name(cfg)] = mix.get(short_name(cfg), 0) + 1
            best = min(r["error"] for r in uniform if r["bpw"] <= budget + 1e-9)
            rows.append({"config": f"autoquant@{budget:g}" + ("+gptq" if with_gptq else ""), "imatrix": True,
                         "gptq": with_gptq, "bpw": bpw, "weights": n, "error": error(q), "best_uniform_error": best,
                         "search_s": search_s, "mix": mix})
            print(_line(rows[-1]) + f"  ({rows[-1]['error'] / best - 1:+.0%} error vs the best uniform of <= its "
                  "size)", flush=True)
    return rows


def _line(r: dict) -> str:
    kind = "gptq" if r.get("gptq") else "imatrix" if r["imatrix"] else "rtn"
    return (f"{r['config']:>21} {kind:>7}  bpw {r['bpw']:6.3f}  "
            f"embedding error {r['error']:.6f}" + (f"  mix {r['mix']}" if "mix" in r else ""))


def markdown(rows: list[dict]) -> str:
    lines = ["| config | rounding | bits / weight | embedding error (1 - cos) | error vs best uniform of <= its bpw |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['error'] / r['best_uniform_error'] - 1:+.0%}" if "best_uniform_error" in r else ""
        kind = "GPTQ" if r.get("gptq") else "imatrix" if r["imatrix"] else "RTN"
        lines.append(f"| {r['config']} | {kind} | {r['bpw']:.3f} | {r['error']:.6f} | "
                     f"{vs} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 configs, tiny calibration and eval")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--budgets", nargs="*", type=float, default=None,
                   help="autoquant's budgets (default: the bits per weight of each uniform row)")
    p.add_argument("--sensitivity", default="mse", choices=["fisher", "mse", "layer"],
                   help="autoquant's sensitivity: mse (default here: each layer's measured relative error of the "
                        "last hidden state, one forward per layer; on MiniLM -7%% / -9%% error at 3.5 / 4.5 bpw "
                        "against fisher's random projection), fisher, layer")
    p.add_argument("--sensitivity-items", type=int, default=4, help="calibration items of the sensitivity passes")
    p.add_argument("--gptq", action="store_true",
                   help="also GPTQ rows: uniform int3-g64 / int4-g64, and each autoquant plan with GPTQ around its "
                        "chosen configs")
    args = p.parse_args(argv)
    if not M.available_models().get("minilm"):
        raise SystemExit(f"MiniLM is not installed: {M.INSTALL_HINT}")
    print(machine_line())
    rows = run(args.quick, args.gptq, args.budgets, args.sensitivity, args.sensitivity_items)
    table = markdown(rows)
    print()
    print(table)
    if not args.no_save:
        name = "bench_accuracy_minilm_quick" if args.quick else "bench_accuracy_minilm"
        print(f"\nwrote {save_json(name, {'quick': args.quick, 'rows': rows, 'table': table})}")


if __name__ == "__main__":
    main()
