"""Quantized against float, token by token: perplexity and KL divergence on the same token ids, with the
definitions of llama.cpp's `perplexity --kl-divergence`.

    stats = affineq.eval.compare(quantized_model, float_model, token_ids, window=512)
    # {'ppl': 17.2, 'ppl_reference': 15.3, 'mean_kld': 0.11, 'kld_p99': 0.93, 'top1_agreement': 0.88, 'tokens': 1020}

The token ids are cut into non-overlapping windows of `window` tokens (a shorter tail is dropped, as llama.cpp
drops it). Each window is one forward of each model from an empty context; the first `context` positions of a
window only give context (llama.cpp scores the second half: context = window // 2, so every scored token has at
least window / 2 tokens before it). Position j in [context, window - 2] predicts token j + 1:

    P = softmax(reference logits[j]),  Q = softmax(model logits[j])      (over the full vocabulary, float64)
    KLD_j = sum_v P_v (log P_v - log Q_v)                                 (KL(P_ref || P_q); 0 log 0 = 0)
    ppl = exp(mean_j -log Q[token j+1]),  ppl_reference = exp(mean_j -log P[token j+1])
    mean_kld = mean_j KLD_j,  kld_p99 = the 99th percentile of KLD_j (linear interpolation between order
    statistics, as llama.cpp's KLD_99),  top1_agreement = mean_j [argmax P == argmax Q] (its "same top p").
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["compare"]


def compare(
    model: Callable,
    reference: Callable,
    token_ids: torch.Tensor | Sequence[int],
    *,
    window: int = 512,
    context: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Perplexity and KL divergence of `model` against `reference` on the same `token_ids`.

    model, reference: causal LMs called as m(ids [1, window] int64) (HF models also get use_cache=False), returning
        logits [1, window, V] or [window, V], or an output with `.logits` (or the logits first). Both must
        have the same vocabulary V. Modules in training mode are put in eval mode for the call and restored.
    token_ids: int tensor [N] or [1, N] (or a list of ints), each in [0, V).
    window: tokens per window (llama.cpp's n_ctx, 512); N // window windows are scored, the tail is dropped.
    context: leading positions of each window that are not scored (None: window // 2, llama.cpp's choice, and 0
        for window 2; 0 scores every prediction, window - 1 per window).
    progress: a tqdm bar over the windows on stderr when tqdm is installed (else none).

    Returns {"ppl", "ppl_reference", "mean_kld", "kld_p99", "top1_agreement", "tokens"} (the module
    docstring has the formulas; "tokens" is the number of scored predictions, windows x (window - 1 - context)).
    """
    for name, m in (("model", model), ("reference", reference)):
        if not callable(m):
            raise ValueError(f"compare: {name} must be a callable model (an nn.Module), got {type(m).__name__}")
    window, context = _check_window(window, context)
    ids = _check_token_ids(token_ids)
    n_windows = ids.numel() // window
    if n_windows == 0:
        raise ValueError(f"compare: token_ids has {ids.numel()} tokens, fewer than one window of {window}; pass "
                         f"more tokens or a smaller window (>= {context + 2} with context={context})")
    ids = ids[: n_windows * window].view(n_windows, window)
    max_id = int(ids.max())
    for name, m in (("model", model), ("reference", reference)):
        _check_vocab(name, _declared_vocab(m), max_id)

    nll_q, nll_ref, klds, same_top = [], [], [], []
    with eval_mode(model), eval_mode(reference), torch.inference_mode():
        for w in _progress(range(n_windows), progress):
            x = ids[w : w + 1]
            lq = _window_logits(model, "model", x, window)
            lp = _window_logits(reference, "reference", x, window)
            if lq.shape[-1] != lp.shape[-1]:
                raise ValueError(f"compare: model has a vocabulary of {lq.shape[-1]} and reference of {lp.shape[-1]}; "
                                 "compare two models with the same vocabulary")
            _check_vocab("reference", lp.shape[-1], max_id)
            target = x[0, context + 1 :].to(lp.device)
            logq = F.log_softmax(lq[context : window - 1].double(), dim=-1)
            logp = F.log_softmax(lp[context : window - 1].to(logq.device).double(), dim=-1)
            p = logp.exp()
            kld = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
            nll_q.append(-logq.gather(1, target.to(logq.device)[:, None]).squeeze(1))
            nll_ref.append(-logp.gather(1, target.to(logq.device)[:, None]).squeeze(1))
            klds.append(kld)
            same_top.append(logp.argmax(-1) == logq.argmax(-1))
    kld_all = torch.cat(klds).cpu()
    return {
        "ppl": math.exp(float(torch.cat(nll_q).mean())),
        "ppl_reference": math.exp(float(torch.cat(nll_ref).mean())),
        "mean_kld": float(kld_all.mean()),
        "kld_p99": float(torch.quantile(kld_all, 0.99, interpolation="linear")),
        "top1_agreement": float(torch.cat(same_top).double().mean()),
        "tokens": int(kld_all.numel()),
    }


def _check_window(window: Any, context: Any) -> tuple[int, int]:
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"compare: window={window!r} must be an int >= 2 (tokens per window; llama.cpp uses 512)")
    if context is None:
        context = min(window // 2, window - 2)  # window 2: no context (window // 2 would leave nothing scored)
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= window - 2:
        raise ValueError(f"compare: context={context!r} must be an int in [0, window - 2] = [0, {window - 2}] "
                         "(leading positions of a window that are not scored), or None for min(window // 2, "
                         "window - 2)")
    return window, context


def _check_token_ids(token_ids: Any) -> torch.Tensor:
    """token_ids as int64 [N] on the CPU (ValueError for anything else)."""
    if isinstance(token_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("compare: token_ids as a list must hold ints (token ids)")
        token_ids = torch.tensor(token_ids, dtype=torch.int64)
    if not isinstance(token_ids, torch.Tensor):
        raise ValueError(f"compare: token_ids must be an int tensor [N] or [1, N], got {type(token_ids).__name__}")
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype is torch.bool:
        raise ValueError(f"compare: token_ids must hold integer token ids, got dtype {token_ids.dtype}; tokenize "
                         "the text first (e.g. tokenizer(text)['input_ids'])")
    if token_ids.dim() == 2 and token_ids.shape[0] == 1:
        token_ids = token_ids[0]
    if token_ids.dim() != 1:
        raise ValueError(f"compare: token_ids must be [N] or [1, N] (one stream, cut into windows), got shape "
                         f"{tuple(token_ids.shape)}")
    ids = token_ids.detach().to("cpu", torch.int64)
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"compare: token_ids holds a negative id ({int(ids.min())}); token ids are >= 0")
    return ids


def _declared_vocab(m: Callable) -> int | None:
    """The vocabulary size a model declares (config.vocab_size), or None."""
    v = getattr(getattr(m, "config", None), "vocab_size", None)
    return v if isinstance(v, int) else None


def _check_vocab(name: str, vocab: int | None, max_id: int) -> None:
    if vocab is not None and max_id >= vocab:
        raise ValueError(f"compare: token_ids holds id {max_id}, outside the vocabulary of {name} ({vocab} ids); "
                         "tokenize with the models' tokenizer")


def _window_logits(m: Callable, name: str, x: torch.Tensor, window: int) -> torch.Tensor:
    """Logits [window, V] of `m` on ids x [1, window], float32 (float64 kept)."""
    device = _device(m)
    x = x.to(device)
    out = m(x, use_cache=False) if _is_hf(m) else m(x)
    if not isinstance(out, torch.Tensor):
        out = out.logits if hasattr(out, "logits") else out[0]
    if out.dim() == 3 and out.shape[0] == 1:
        out = out[0]
    if out.dim() != 2 or out.shape[0] != window:
        raise ValueError(f"compare: {name} returned logits of shape {tuple(out.shape)} for ids [1, {window}]; a "
                         "causal LM must return [1, T, V] (or an output whose .logits is)")
    if not bool(torch.isfinite(out).all()):  # inf as much as NaN: either makes every statistic NaN or inf
        kind = "NaN" if bool(torch.isnan(out).any()) else "infinite"
        raise ValueError(f"compare: {name} returned {kind} logits; its weights or kernels are broken (check it "
                         "with a float forward)")
    return out if out.dtype == torch.float64 else out.float()


def _device(m: Callable) -> torch.device:
    p = next(iter(m.parameters()), None) if isinstance(m, nn.Module) else None
    return p.device if p is not None else torch.device("cpu")


def _is_hf(m: Callable) -> bool:
    # duck-typed so transformers is never imported: an HF model has a config with a model_type and generate()
    return hasattr(getattr(m, "config", None), "model_type") and callable(getattr(m, "generate", None))


@contextlib.contextmanager
def eval_mode(m: Callable) -> Iterator[None]:
    """`m` (an nn.Module; any other callable is left alone) in eval mode for the block, every submodule's own
    training flag given back after, also when the block raises. Measuring or calibrating forwards must see
    inference behaviour and leave the model as it was: in training mode BatchNorm updates its running
    statistics and dropout randomises the outputs (calibration, GPTQ, importance matrices, autoquant use it)."""
    if not isinstance(m, nn.Module):
        yield
        return
    flags = [(mod, mod.training) for mod in m.modules()]
    m.eval()
    try:
        yield
    finally:
        for mod, flag in flags:
            mod.training = flag


def _progress(items: Iterable, enabled: bool) -> Iterable:
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # an optional extra: no bar without it
        return items
    return tqdm(items, desc="compare", unit="window", file=sys.stderr, leave=False)
