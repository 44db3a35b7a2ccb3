"""The attention math of ``StaticDecoder`` over its float KV cache, for every supported attention variant.

A layer's attention is softmax(scaling * q k^T [masked]) v, optionally with a learned per-head
"sink" logit that joins the softmax denominator only (gpt-oss: ``p_t = exp(s_t) / (sum_u exp(s_u) + exp(sink))``),
and optionally over a sliding window (a query at slot p sees slots p - window < t <= p, transformers'
``sliding_window_overlay``). Shapes: q [B, H, S, D]; caches [B, KVH, T, D]; query head h reads kv head h // (H / KVH).

Three forms, chosen by ``StaticDecoder``:

* ``attend_compiled``: over all T slots under a bool mask [B, S, T] (static shapes, one graph for every position).
* ``attend_sdpa``: eager, over exactly the keys transformers' dynamic cache holds, with its sdpa call (bit for bit
  the numbers of ``model.generate`` on models whose attention implementation is sdpa).
* ``attend_eager_math``: eager, transformers' ``eager_attention_forward`` formula (matmuls, additive mask, sinks),
  for models that run with ``attn_implementation="eager"`` (gpt-oss) or have sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["AttentionSpec", "attend_compiled", "attend_sdpa", "attend_eager_math", "window_keys"]


class AttentionSpec:
    """What varies between the attentions of layers: ``scaling`` (the logit scale, D^-0.5 unless the model says
    otherwise: Gemma's ``query_pre_attn_scalar^-0.5``), ``sinks`` (per-head sink logits [H], or None), ``window``
    (sliding window in slots, or None)."""

    __slots__ = ("scaling", "sinks", "window")

    def __init__(self, scaling: float, sinks: torch.Tensor | None = None, window: int | None = None) -> None:
        self.scaling, self.sinks, self.window = scaling, sinks, window


def window_keys(end: int, s: int, window: int | None) -> int:
    """First cache slot transformers' sliding-window cache still holds when a step of ``s`` queries ends at slot
    ``end - 1``: a decode step (s = 1) sees the last ``window`` slots; a prefill keeps every key (the mask cuts)."""
    return max(end - window, 0) if window is not None and s == 1 else 0


def attend_compiled(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, keep: torch.Tensor,
                    spec: AttentionSpec) -> torch.Tensor:
    """Attention of q [B, H, S, D] over every slot of kc / vc [B, KVH, T, D] where ``keep`` [B, S, T]; a query
    with no key gives 0 (as sdpa does for a fully masked row). Broadcast products and sums, not matmuls: inductor
    fuses them into its own loops, where dozens of tiny bmm calls per token would each pay a library call."""
    b, h, s, d = q.shape
    kvh = kc.shape[1]
    g = h // kvh
    qg = q.reshape(b, kvh, g * s, d)  # query heads kv*g + i share kv head kv: rows (i, s)
    scores = (qg[:, :, :, None, :] * kc[:, :, None]).sum(-1).float() * spec.scaling
    mask = keep.repeat(1, g, 1)[:, None]  # [B, 1, g*S, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks is None:
        p = scores.softmax(-1)
    else:  # the sink joins the denominator: softmax over [scores, sink], sink column dropped
        sink = spec.sinks.float().view(kvh, g, 1, 1).expand(kvh, g, s, 1).reshape(1, kvh, g * s, 1)
        p = torch.cat([scores, sink.expand(b, -1, -1, -1)], -1).softmax(-1)[..., :-1]
    p = p.masked_fill(~mask, 0.0).to(q.dtype)
    return (p[..., None] * vc[:, :, None]).sum(-2).view(b, h, s, d)


def attend_sdpa(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor | None, gqa: bool,
                scaling: float) -> torch.Tensor:
    """transformers' sdpa attention over the keys it holds (kc / vc already cut to them, mask [B, S, keys] or
    None for plain causal attention), its GQA handling included, so eager results equal model.generate's."""
    b, h, s, d = q.shape
    end = kc.shape[2]
    if mask is None:
        return F.scaled_dot_product_attention(q, kc, vc, is_causal=s > 1, enable_gqa=gqa, scale=scaling)
    m = mask[:, None]  # [B, 1, S, end]
    g = h // kc.shape[1]
    if gqa and s == 1:  # transformers' pack_gqa: a kv head's g query heads as g query rows
        return F.scaled_dot_product_attention(q.reshape(b, h // g, g, d), kc, vc, attn_mask=m,
                                              scale=scaling).view(b, h, 1, d)
    if gqa:  # transformers' repeat_kv
        kc, vc = (t[:, :, None].expand(b, h // g, g, end, d).reshape(b, h, end, d) for t in (kc, vc))
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=m, scale=scaling)


def attend_eager_math(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor | None,
                      spec: AttentionSpec) -> torch.Tensor:
    """transformers' ``eager_attention_forward`` (gpt-oss' with sinks), term for term: repeat_kv,
    ``q @ k^T * scaling``, the additive mask (dtype min where masked), softmax in fp32 (with sinks: the
    max-subtracted softmax in the logits' dtype, sink column dropped), ``@ v``. mask [B, S, keys] or None."""
    b, h, s, d = q.shape
    g = h // kc.shape[1]
    if g > 1:
        end = kc.shape[2]
        kc, vc = (t[:, :, None].expand(b, h // g, g, end, d).reshape(b, h, end, d) for t in (kc, vc))
    w = torch.matmul(q, kc.transpose(2, 3)) * spec.scaling
    if mask is not None:  # w + dtype-min rounds to dtype-min: the same as transformers' additive mask
        w = w.masked_fill(~mask[:, None], torch.finfo(w.dtype).min)
    if spec.sinks is None:
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sinks = spec.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
        both = torch.cat([w, sinks], -1)
        both = both - both.max(dim=-1, keepdim=True).values
        p = F.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(vc.dtype)
    return torch.matmul(p, vc)
