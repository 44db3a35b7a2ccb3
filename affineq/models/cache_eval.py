"""Perplexity through the static decoder's KV cache: the model's predictions at every position of fixed windows,
teacher-forced through the same cache code that decoding uses, so that a quantized cache (int8 / int4) is measured
as ``generate``'s decode steps run it: every position reads the quantized cache (``StaticDecoder.score``), not the
float attention a prompt's prefill uses."""

from __future__ import annotations

import math

import torch
from torch import nn

from .static_decoder import StaticDecoder

__all__ = ["kv_cache_perplexity", "PROMPT_TOKENS"]

PROMPT_TOKENS = 128  # the prompt-like first write of each window


def kv_cache_perplexity(model: nn.Module, ids: torch.Tensor, window: int = 2048, *,
                        kv_cache_dtype: torch.dtype | str | None = None, kv_group_size: int | None = None,
                        max_windows: int | None = None, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """Perplexity of ``ids`` [N] (int64 token ids) over consecutive non-overlapping windows of ``window`` tokens
    (the tail shorter than a window is dropped, as llama.cpp's perplexity does). Each window starts from an empty
    cache; every token but its first is predicted from the ones before it, with attention reading the cache of
    ``kv_cache_dtype`` (None: the model dtype; "int8" / "int4": quantized, ``affineq.models.kv_cache``). Each
    window's first ``prompt_tokens`` tokens are written to the cache first, as a prompt would be (they fix an int4
    cache's key offset, so the rest of the window is scored with an offset it did not choose), then the rest.

    Returns ``{"ppl": exp(mean NLL), "nll": mean NLL, "tokens": predictions scored, "windows": n}``; ValueError
    when ``ids`` holds fewer than ``window`` tokens or ``window`` < 2.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be a 1-D int64 tensor of token ids, got {getattr(ids, 'dtype', type(ids))} "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2, got {window!r}")
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
    n = ids.numel() // window if max_windows is None else min(ids.numel() // window, max_windows)
    if n == 0:
        raise ValueError(f"ids holds {ids.numel()} tokens, fewer than one window of {window}; pass a smaller window")
    dec = StaticDecoder(model, 1, window, compile=False, kv_cache_dtype=kv_cache_dtype, kv_group_size=kv_group_size)
    total = 0.0
    for w in range(n):
        chunk = ids[w * window:(w + 1) * window]
        logits = dec.score(chunk[None], prompt_tokens)[0]  # [window, V] fp32
        total += float(torch.nn.functional.cross_entropy(logits[:-1], chunk[1:], reduction="sum"))
        del logits
    count = n * (window - 1)
    return {"ppl": math.exp(total / count), "nll": total / count, "tokens": count, "windows": n}
