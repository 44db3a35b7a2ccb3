"""One decode step's attention over a long KV cache: affineq's int8 / int4 cache kernel against float caches.

    python benchmarks/bench_kv_attention.py                 # SmolLM2 / Llama-3.2-1B / Llama-3.1-8B heads, 3 contexts
    python benchmarks/bench_kv_attention.py --quick         # one shape, one context, short runs

One query token (batch 1) attends over T cached slots of one layer, with the attention-head shapes of the models
``StaticDecoder`` runs (query heads / kv heads / head size). Candidates, timed round-robin in one process (medians):
``int8`` / ``int4`` = ``torch.ops.affineq.kv_attention`` over the decoder's cache formats (int8 groups of 32; int4
keys in groups of 16, values in groups of 32, float16 scale and min), bf16 queries; ``bf16-compiled`` = the
compiled float-cache attention of earlier versions (``attend_compiled`` under ``torch.compile``, every slot of a bf16
cache); ``bf16-kernel`` = ``torch.ops.affineq.float_kv_attention`` over the bf16 cache (the decoder's compiled
float-cache attention now);
``bf16-sdpa`` / ``fp32-sdpa`` = ``F.scaled_dot_product_attention`` over a bf16 / fp32 cache (a kv head's query heads
as rows, as transformers' GQA packing). The gpt-oss-20b row has attention sinks: its kernels are the ``_sinks`` ops
and the compiled loops take the sinks; sdpa has no sink term, so it has no sdpa candidates. "x float" = the fastest
float-cache candidate's time (ours included) over the row's; GB/s = cache
bytes one step reads (codes and scales, or the float cache) over the time.
Results: results/bench_kv_attention.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_line, round_robin_ms, save_json, table  # noqa: E402

import affineq.cpp as K  # noqa: E402
from affineq.cpp import kv_attention as kva  # noqa: E402
from affineq.models.attention_variants import AttentionSpec, attend_compiled  # noqa: E402
from affineq.models.kv_cache import INT4_KEY_GROUP, INT4_VALUE_GROUP, INT8_GROUP  # noqa: E402

FLOAT = ("bf16-compiled", "bf16-kernel", "bf16-sdpa", "fp32-sdpa")  # the float-cache candidates
SHAPES = {"SmolLM2-135M": (9, 3, 64, False), "Llama-3.2-1B": (32, 8, 64, False), "Llama-3.1-8B": (32, 8, 128, False),
          "gpt-oss-20b": (64, 8, 64, True)}  # query heads, kv heads, head size, attention sinks


def rows_for(name: str, h: int, kvh: int, d: int, sinks: bool, t: int, budget: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, kvh, t, d, generator=gen), torch.randn(1, kvh, t, d, generator=gen)
    q = torch.randn(1, h, 1, d, generator=gen).bfloat16()
    pos, valid = torch.tensor([t - 1]), torch.ones(1, t, dtype=torch.bool)
    sk = torch.randn(h, generator=gen) if sinks else None
    extra = (sk,) if sinks else ()
    quant_op = torch.ops.affineq.kv_attention_sinks if sinks else torch.ops.affineq.kv_attention
    float_op = torch.ops.affineq.float_kv_attention_sinks if sinks else torch.ops.affineq.float_kv_attention
    cands, nbytes = {}, {}
    for kind, gk, gv in (("int8", INT8_GROUP, INT8_GROUP), ("int4", INT4_KEY_GROUP, INT4_VALUE_GROUP)):
        kc, ks = kva.quantize_kv(k, kind, gk)
        vc, vs = kva.quantize_kv(v, kind, gv)
        cands[kind] = lambda a=(q, kc, ks, vc, vs, pos, valid, *extra): quant_op(*a)
        nbytes[kind] = sum(x.numel() * x.element_size() for x in (kc, ks, vc, vs))
    kb, vb, kf, vf = k.bfloat16(), v.bfloat16(), k, v
    spec = AttentionSpec(scaling=d**-0.5, sinks=sk)
    keep = torch.ones(1, 1, t, dtype=torch.bool)
    compiled = torch.compile(attend_compiled, fullgraph=True)
    cands["bf16-compiled"] = lambda: compiled(q, kb, vb, keep, spec)
    qp = q.view(1, kvh, h // kvh, d)
    cands["bf16-kernel"] = lambda: float_op(q, kb, vb, pos, valid, d**-0.5, *extra)
    if not sinks:
        cands["bf16-sdpa"] = lambda: F.scaled_dot_product_attention(qp, kb, vb)
        cands["fp32-sdpa"] = lambda: F.scaled_dot_product_attention(qp.float(), kf, vf)
    nbytes["bf16-compiled"] = nbytes["bf16-kernel"] = nbytes["bf16-sdpa"] = 2 * kb.numel() * 2
    nbytes["fp32-sdpa"] = 2 * kf.numel() * 4
    ms = round_robin_ms(cands, budget_s=budget)
    best = min(ms[c] for c in FLOAT if c in ms)
    row = {"row": f"{name} H{h}/KVH{kvh}/D{d} T={t}"}
    for c, v_ms in ms.items():
        row[f"{c} ms"] = round(v_ms, 4)
        row[f"{c} x float"] = round(best / v_ms, 2)
        row[f"{c} GB/s"] = round(nbytes[c] / v_ms / 1e6, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per candidate per row")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names among " + ", ".join(SHAPES))
    ap.add_argument("--out", default="bench_kv_attention", help="results/<out>.json")
    a = ap.parse_args()
    if not K.is_available():
        sys.exit(f"the affineq C++ kernels are not available: {K.unavailable_reason()}")
    torch.set_num_threads(a.threads)
    names = ("Llama-3.2-1B", "gpt-oss-20b") if a.quick else a.shapes.split(",")
    if unknown := [n for n in names if n not in SHAPES]:
        sys.exit(f"--shapes: unknown {unknown}; choose among {', '.join(SHAPES)}")
    shapes = {n: SHAPES[n] for n in names}
    contexts = [1024] if a.quick else [int(x) for x in a.contexts.split(",")]
    rows = [rows_for(n, *s, t, 0.05 if a.quick else a.budget) for n, s in shapes.items() for t in contexts]
    print(machine_line())
    cols = ["row"] + [f"{c} {m}" for c in ("int8", "int4", *FLOAT) for m in ("ms", "x float")]
    print(table(rows, cols))
    print(table(rows, ["row"] + [f"{c} GB/s" for c in ("int8", "int4", *FLOAT)]))
    if not a.no_save and not a.quick:
        print("wrote", save_json(a.out, {"rows": rows, "args": vars(a)}))


if __name__ == "__main__":
    main()
