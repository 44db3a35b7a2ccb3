"""AWQ and SmoothQuant on the real models: SmolLM2-135M perplexity (calibrated on pydoc topics that are not
in the evaluation text; lm_head left float) and MiniLM embedding cosine / SQNR.

    PYTHONPATH=. python benchmarks/bench_awq_smoothquant.py [--parts awq,sq,minilm] [--n-calib 8] [--awq-bits int4,int3]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import affineq
import affineq.models as am
from affineq.algorithms import AWQConfig, SmoothQuantConfig
from affineq.primitives import MappingType


def calibration_text() -> str:
    """pydoc topics that are not in the evaluation text (sorted by key)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics) if k not in am.EVAL_TOPIC_KEYS)


def lm_batches(tok, n: int, seq_len: int = 512) -> list[torch.Tensor]:
    ids = tok(calibration_text(), add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids[: n * seq_len], dtype=torch.int64)
    return [ids[i * seq_len:(i + 1) * seq_len].unsqueeze(0) for i in range(n)]


def linears_but_head(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and "lm_head" not in fqn


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def timed(model, config, **kw):
    q = copy.deepcopy(model)
    t = time.perf_counter()
    affineq.quantize_(q, config, **kw)
    return q, time.perf_counter() - t


def smollm2(parts: set[str], n_calib: int, bits: set[str]) -> None:
    model, tok = am.load_smollm2()
    data = lm_batches(tok, n_calib)
    print(f"SmolLM2-135M, calibration {n_calib} x 512 tokens; float ppl {am.perplexity(model, tok):.3f}", flush=True)
    rows = []
    if "awq" in parts:
        for name, base in (("int4 g64", affineq.Int4WeightOnlyConfig(group_size=64)),
                           ("int3 g64", affineq.IntxWeightOnlyConfig(weight_dtype=torch.int3,
                                                                     granularity=affineq.PerGroup(64),
                                                                     mapping_type=MappingType.ASYMMETRIC))):
            if name.split()[0] not in bits:
                continue
            q, t = timed(model, base, filter_fn=linears_but_head)
            rows.append((f"RTN {name}", am.perplexity(q, tok), t))
            print(rows[-1], flush=True)
            q, t = timed(model, AWQConfig(base), filter_fn=linears_but_head, calibration_data=data)
            rows.append((f"AWQ {name}", am.perplexity(q, tok), t))
            print(rows[-1], flush=True)
    if "sq" in parts:
        base = affineq.Int8DynamicActivationInt8WeightConfig()
        q, t = timed(model, base, filter_fn=linears_but_head)
        rows.append(("W8A8 dynamic", am.perplexity(q, tok), t))
        print(rows[-1], flush=True)
        for alpha in (0.5, 0.8):
            q, t = timed(model, SmoothQuantConfig(base, alpha=alpha), filter_fn=linears_but_head,
                         calibration_data=data)
            rows.append((f"SmoothQuant a={alpha} W8A8 dynamic", am.perplexity(q, tok), t))
            print(rows[-1], flush=True)
    for name, ppl, t in rows:
        print(f"| {name} | {ppl:.3f} | {t:.1f} s |")


def minilm() -> None:
    model, tok = am.load_minilm()
    ref = am.embed(model, tok, am.SENTENCES)
    calib = [dict(tok(am.SENTENCES[i:i + 4], padding=True, return_tensors="pt")) for i in range(0, 16, 4)]
    dyn = affineq.Int8DynamicActivationInt8WeightConfig()
    static = affineq.Int8StaticActivationInt8WeightConfig(observer="mse", packing_format="plain")
    lin = lambda m, fqn: isinstance(m, nn.Linear)  # noqa: E731
    runs = [("W8A8 dynamic", dyn, None)]
    runs += [(f"SmoothQuant a={a} W8A8 dynamic", SmoothQuantConfig(dyn, alpha=a), calib) for a in (0.5, 0.8)]
    runs += [("W8A8 static (mse)", static, calib)]
    runs += [(f"SmoothQuant a={a} W8A8 static (mse)", SmoothQuantConfig(static, alpha=a), calib)
             for a in (0.5, 0.8)]
    print("MiniLM: embeddings of the 16 SENTENCES vs float (static: calibrated on the same sentences)")
    for name, cfg, data in runs:
        q, t = timed(model, cfg, filter_fn=lin, calibration_data=data)
        emb = am.embed(q, tok, am.SENTENCES)
        print(f"| {name} | cosine {am.embedding_similarity(ref, emb):.4f} | SQNR {sqnr(ref, emb):.1f} dB | "
              f"{t:.1f} s |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="awq,sq,minilm")
    p.add_argument("--n-calib", type=int, default=8)
    p.add_argument("--awq-bits", default="int4,int3", help="which of int4,int3 the awq part runs")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    torch.manual_seed(0)
    if "minilm" in parts:
        minilm()
    if parts & {"awq", "sq"}:
        smollm2(parts, a.n_calib, set(a.awq_bits.split(",")))


if __name__ == "__main__":
    main()
