"""Accuracy per bit on all-MiniLM-L6-v2 (float-trained: the honest test of a search): uniform weight configs of
the encoder's linears, plain round-to-nearest and importance-weighted, against `affineq.autoquant` at the same
bits per weight, by embedding error = 1 - mean cosine similarity of the sentence embeddings to the float
model's (mean-pooled, L2-normalised: the sentence-transformers recipe, `affineq.models.embed`).

    python benchmarks/bench_accuracy_minilm.py            # the table (minutes)
    python benchmarks/bench_accuracy_minilm.py --quick    # smoke run: 2 configs, 2 x 64 calibration tokens

Eval sentences: `M.SENTENCES` plus the first 240 sentences of `eval_text()`; calibration: 16 x 128 tokens of
`calibration_text()` (disjoint), as {"input_ids", "attention_mask"} items. bpw counted from the stored tensors
of the quantized linears (the encoder's 36; the pooler, unused by the embedding, and the embeddings stay
float). Writes
results/bench_accuracy_minilm.json.
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
from bench_accuracy_bpw import CONFIGS, _short, bits_per_weight  # noqa: E402
from common import machine_line, save_json  # noqa: E402

import affineq  # noqa: E402
from affineq import models as M  # noqa: E402
from affineq.algorithms import ImportanceWeightedConfig, collect_importance  # noqa: E402
from affineq.autoquant import DEFAULT_CANDIDATES, autoquant  # noqa: E402

UNIFORM = ("int2-g32", "int3-g64", "int3-g32", "int4-g64", "int4-g32")
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


def run(quick: bool) -> list[dict]:
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
        for weighted, cfg in ((False, base), (True, ImportanceWeightedConfig(base, importance=importance,
                                                                              progress=False))):
            q = copy.deepcopy(model)
            affineq.quantize_(q, cfg, filter_fn=linears)
            bpw, n = bits_per_weight(q)
            rows.append({"config": name, "imatrix": weighted, "bpw": bpw, "weights": n, "error": error(q)})
            print(_line(rows[-1]), flush=True)
    budgets = sorted({round(r["bpw"], 4) for r in rows})
    start = time.perf_counter()
    plans = autoquant(model, budgets, data, candidates=DEFAULT_CANDIDATES, filter_fn=linears, progress=False)
    search_s = time.perf_counter() - start
    for budget, plan in zip(budgets, plans, strict=True):
        q = affineq.quantize_(copy.deepcopy(model), plan)
        bpw, n = bits_per_weight(q)
        mix: dict[str, int] = {}
        for cfg in plan.fqn_to_config.values():
            key = _short(getattr(cfg, "base_config", cfg)) + ("+imatrix" if isinstance(cfg, ImportanceWeightedConfig)
                                                             else "")
            mix[key] = mix.get(key, 0) + 1
        best = min(r["error"] for r in rows if "mix" not in r and r["bpw"] <= budget + 1e-9)
        rows.append({"config": f"autoquant@{budget:g}", "imatrix": True, "bpw": bpw, "weights": n,
                     "error": error(q), "best_uniform_error": best, "search_s": search_s, "mix": mix})
        print(_line(rows[-1]) + f"  ({1 - rows[-1]['error'] / best:+.0%} vs the best uniform of <= its size)",
              flush=True)
    return rows


def _line(r: dict) -> str:
    return (f"{r['config']:>16} {'imatrix' if r['imatrix'] else 'rtn':>7}  bpw {r['bpw']:6.3f}  "
            f"embedding error {r['error']:.6f}" + (f"  mix {r['mix']}" if "mix" in r else ""))


def markdown(rows: list[dict]) -> str:
    lines = ["| config | imatrix | bits / weight | embedding error (1 - cos) | vs best uniform |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        vs = f"{1 - r['error'] / r['best_uniform_error']:+.0%}" if "best_uniform_error" in r else ""
        lines.append(f"| {r['config']} | {'yes' if r['imatrix'] else 'no'} | {r['bpw']:.3f} | {r['error']:.6f} | "
                     f"{vs} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 configs, tiny calibration and eval")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args(argv)
    if not M.available_models().get("minilm"):
        raise SystemExit(f"MiniLM is not installed: {M.INSTALL_HINT}")
    print(machine_line())
    rows = run(args.quick)
    table = markdown(rows)
    print()
    print(table)
    if not args.no_save:
        name = "bench_accuracy_minilm_quick" if args.quick else "bench_accuracy_minilm"
        print(f"\nwrote {save_json(name, {'quick': args.quick, 'rows': rows, 'table': table})}")


if __name__ == "__main__":
    main()
