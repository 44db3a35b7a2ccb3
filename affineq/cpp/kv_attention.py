"""Attention over a quantized KV cache: ``torch.ops.affineq.kv_attention`` and its PyTorch reference.

Cache formats, for keys or values x [B, KVH, T, D] cut into groups of G along D (D % G == 0; keys and values may
use different G):

* int8 (symmetric, as llama.cpp's ``-ctk q8_0``): ``scale = max|x_g| / 127``, ``code = round(x / scale)`` in
  [-127, 127] (int8 [B, KVH, T, D]), one fp32 scale per (head, slot, group): scale [B, KVH, T, D / G] float32;
  ``x ~ scale * code``. ``quantize_kv``'s default G = D (one scale per head and token); the decoder's cache uses
  groups of 32 (``affineq.models.kv_cache.INT8_GROUP``, q8_0's blocks).
* int4 (asymmetric, as llama.cpp's ``q4_1``): ``scale = (max x_g - min x_g) / 15``, ``code = round((x - min) /
  scale)`` in [0, 15], ``x ~ scale * code + min``; codes as nibbles (uint8 [B, KVH, T, D / 2]): in a group, byte
  j < G / 2 holds element j (low nibble) and j + G / 2 (high nibble), q4_1's order, so a group's low and high
  nibbles are two contiguous runs of G / 2 elements. Scale and min are float16 pairs, interleaved: "scale"
  [B, KVH, T, 2 * D / G] float16 = (scale_0, min_0, scale_1, min_1, ...); codes are rounded against the float16
  values, so the group's min and max come back to within float16 rounding.

An all-constant group has scale 0 (codes 0, the value back exactly up to the min's rounding).

``kv_attention(q, k_codes, k_scale, v_codes, v_scale, pos, valid)``: q [B, H, S, D] (float32 / bfloat16 / float16; H
a multiple of KVH, query head h reads kv head h // (H / KVH)), ``pos`` int64 [S] the cache slot of each query,
``valid`` bool [B, T]; query s of row b attends to the slots t <= pos[s] with valid[b, t], softmax(q . k / sqrt(D)),
and returns [B, H, S, D] in q's dtype (a query with no slot gives 0, as sdpa does for a fully masked row).
``kv_attention_sinks(..., valid, sinks)``: the same with sink logits (float [H]: gpt-oss' attention sinks, one logit
per query head; or [B, H, S]: one per query), each joining its softmax's denominator only, ``p_t = exp(s_t) / (sum_u
exp(s_u) + exp(sink))``; a query with no slot still gives 0. (A new argument is a new op: the schemas never change,
tests/test_op_schemas.py.) The C++ kernel (cpp/attention.cpp, attention_kernel.cpp) reads the codes directly with
fp32 products and sums: the query heads of a kv head share each decoded slot, softmax chunks of 256 slots are folded
in slot order (the result does not depend on the thread count); ``kv_attention_reference`` dequantizes and runs the
same math in PyTorch; they agree to ~1e-6 (outputs of size ~1).

``float_kv_attention(q, k, v, pos, valid, scale)`` (and ``float_kv_attention_sinks(..., scale, sinks)``): the same
kernel over a float cache (k / v [B, KVH, T, D] float32 / bfloat16 / float16, D a multiple of 16), logits ``(q . k)
* scale``; the compiled decode step's attention over ``StaticDecoder``'s float cache of ``FLOAT_KERNEL_MIN_SLOTS``
or more (it reads the slots <= pos, not all T).
"""

from __future__ import annotations

import torch

from . import is_available

__all__ = ["KV_BITS", "KV_DEFAULT_GROUP", "quantize_kv", "dequantize_kv", "kv_attention", "kv_attention_reference",
           "float_kv_attention_reference", "masked_softmax"]

#: Storage kinds and their code bits.
KV_BITS = {"int8": 8, "int4": 4}
#: Default group size of each kind (None: the whole head dimension).
KV_DEFAULT_GROUP = {"int8": None, "int4": 32}
#: int4: least-squares refinements of each group's (scale, min) after the min-max start (0: plain min-max).
INT4_REFINE_STEPS = 2


def _check_kind(kind: str, d: int, group_size: int) -> None:
    if kind not in KV_BITS:
        raise ValueError(f"kind must be one of {sorted(KV_BITS)}, got {kind!r}")
    if not isinstance(group_size, int) or group_size <= 0 or d % group_size or (kind == "int4" and group_size % 2):
        raise ValueError(f"group_size must divide the head dimension {d} (and be even for int4), got {group_size!r}")


def quantize_kv(x: torch.Tensor, kind: str, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of x [..., D] (any float dtype): int8 codes [..., D] with fp32 scales [..., D / G], or
    uint8 int4 nibbles [..., D / 2] with float16 (scale, min) pairs [..., 2 * D / G] (G = group_size, default D for
    int8, 32 for int4). int4's pair starts at (range / 15, min) and is refitted by least squares to the group's
    codes `INT4_REFINE_STEPS` times (each fit and re-rounding lowers the squared error; "min" is then the
    offset of code 0, not necessarily the group's minimum). Traceable (no data-dependent Python), so it runs
    inside the compiled decode step."""
    d = x.shape[-1]
    g = group_size or (d if kind == "int8" else KV_DEFAULT_GROUP[kind])
    _check_kind(kind, d, g)
    xg = x.float().unflatten(-1, (d // g, g))
    if kind == "int8":
        scale = xg.abs().amax(-1, keepdim=True) / 127
        q = (xg / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127)
        return q.to(torch.int8).flatten(-2), scale.squeeze(-1)
    lo = xg.amin(-1, keepdim=True)
    scale = (xg.amax(-1, keepdim=True) - lo) / 15
    xm = xg.mean(-1, keepdim=True)
    dx = xg - xm
    for _ in range(INT4_REFINE_STEPS):
        # Least squares: the (scale, min) that fit the group best for its current codes, then the codes nearest
        # under them. Each half-step lowers the group's squared error (min-max is only the first guess).
        u = ((xg - lo) / torch.where(scale > 0, scale, 1.0)).round().clamp(0, 15)
        um = u.mean(-1, keepdim=True)
        du = u - um
        var = (du * du).sum(-1, keepdim=True)
        fit = torch.where(var > 0, (du * dx).sum(-1, keepdim=True) / torch.where(var > 0, var, 1.0), scale)
        scale = torch.where(fit > 0, fit, scale)
        lo = xm - scale * um
    lo, scale = lo.half(), scale.half()  # stored in float16: codes are rounded against what is stored
    sf = scale.float()
    u = ((xg - lo.float()) / torch.where(sf > 0, sf, 1.0)).round().clamp(0, 15).to(torch.uint8)
    packed = u[..., : g // 2] | (u[..., g // 2 :] << 4)
    return packed.flatten(-2), torch.cat([scale, lo], -1).flatten(-2)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., D] from ``quantize_kv``'s codes and scales (int8 codes, or uint8 int4 nibbles with their
    float16 (scale, min) pairs)."""
    if codes.dtype == torch.int8:
        ng = scale.shape[-1]
        return (codes.float().unflatten(-1, (ng, -1)) * scale[..., None]).flatten(-2)
    pairs = scale.float().unflatten(-1, (-1, 2))  # [..., ng, 2]
    c = codes.unflatten(-1, (pairs.shape[-2], -1))
    vals = torch.cat([(c & 15), (c >> 4)], -1).float()  # low nibbles are the group's first half
    return (vals * pairs[..., :1] + pairs[..., 1:]).flatten(-2)


def kv_attention_reference(q, k_codes, k_scale, v_codes, v_scale, pos, valid, sinks=None) -> torch.Tensor:
    """PyTorch ``kv_attention``: dequantize the cache to fp32, then ``float_kv_attention_reference`` (scale
    D^-0.5)."""
    k, v = dequantize_kv(k_codes, k_scale), dequantize_kv(v_codes, v_scale)
    return float_kv_attention_reference(q, k, v, pos, valid, q.shape[-1] ** -0.5, sinks)


def masked_softmax(scores: torch.Tensor, keep: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax of fp32 scores [B, H, S, T] over the slots where keep [B, 1, S, T] (others 0; a row with none: all
    0), with the sink logits (sinks [H] per head, [B, H, S] per query, or None) joining the denominator only."""
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        col = (sinks.float().view(1, -1, 1) if sinks.dim() == 1 else sinks.float())[..., None]
        col = col.expand(*scores.shape[:-1], 1)
        return torch.cat([scores, col], -1).softmax(-1)[..., :-1].masked_fill(~keep, 0.0)
    return scores.softmax(-1).masked_fill(~keep, 0.0)


def float_kv_attention_reference(q, k, v, pos, valid, scale: float, sinks=None) -> torch.Tensor:
    """PyTorch ``float_kv_attention``: the same masked softmax attention over a float cache k / v [B, KVH, T, D]
    (logits (q . k) * scale, sinks as ``kv_attention``'s), in fp32, returned in q's dtype."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    keep = (torch.arange(k.shape[2], device=q.device)[None, None, :] <= pos[None, :, None]) & valid[:, None, :]
    p = masked_softmax((q.float() * scale) @ k.transpose(-1, -2), keep[:, None], sinks)
    return (p @ v).to(q.dtype)


def kv_attention(q, k_codes, k_scale, v_codes, v_scale, pos, valid, sinks=None) -> torch.Tensor:
    """The C++ kernel where the affineq kernels build (``kv_attention_sinks`` with sinks), else the reference (same
    numbers to ~1e-6)."""
    if not is_available():
        return kv_attention_reference(q, k_codes, k_scale, v_codes, v_scale, pos, valid, sinks)
    if sinks is None:
        return torch.ops.affineq.kv_attention(q, k_codes, k_scale, v_codes, v_scale, pos, valid)
    return torch.ops.affineq.kv_attention_sinks(q, k_codes, k_scale, v_codes, v_scale, pos, valid, sinks)


_lib = torch.library.Library("affineq", "FRAGMENT")
_lib.define("kv_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, Tensor pos, "
            "Tensor valid) -> Tensor")
_lib.define("kv_attention_sinks(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, "
            "Tensor pos, Tensor valid, Tensor sinks) -> Tensor")


@torch.library.register_fake("affineq::kv_attention", lib=_lib)
def _kv_attention_fake(q, k_codes, k_scale, v_codes, v_scale, pos, valid):
    return q.new_empty(q.shape)


@torch.library.register_fake("affineq::kv_attention_sinks", lib=_lib)
def _kv_attention_sinks_fake(q, k_codes, k_scale, v_codes, v_scale, pos, valid, sinks):
    return q.new_empty(q.shape)


# float_kv_attention(q, k, v, pos, valid, scale): the same attention over a float cache (k / v [B, KVH, T, D]
# float32 / bfloat16 / float16, D % 16 == 0 for the C++ kernel), logits (q . k) * scale: the compiled decode step's
# float-cache attention (reads slots <= pos only, where the compiled PyTorch loops read all T); with sink logits:
# float_kv_attention_sinks.
_lib.define("float_kv_attention(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor valid, float scale) -> Tensor")
_lib.define("float_kv_attention_sinks(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor valid, float scale, "
            "Tensor sinks) -> Tensor")


@torch.library.register_fake("affineq::float_kv_attention", lib=_lib)
def _float_kv_attention_fake(q, k, v, pos, valid, scale):
    return q.new_empty(q.shape)


@torch.library.register_fake("affineq::float_kv_attention_sinks", lib=_lib)
def _float_kv_attention_sinks_fake(q, k, v, pos, valid, scale, sinks):
    return q.new_empty(q.shape)


# Run only until the C++ library registers its CPU kernels (then those win the dispatch).
_lib.impl("kv_attention", kv_attention_reference, "CompositeExplicitAutograd")
_lib.impl("kv_attention_sinks", kv_attention_reference, "CompositeExplicitAutograd")
_lib.impl("float_kv_attention", float_kv_attention_reference, "CompositeExplicitAutograd")
_lib.impl("float_kv_attention_sinks", float_kv_attention_reference, "CompositeExplicitAutograd")
