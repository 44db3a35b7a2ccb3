"""The quantized KV cache of ``StaticDecoder``: int8 or int4 codes with their scales, written per token and read
by attention directly (``affineq.cpp.kv_attention``), never expanded to a float copy of the cache.

``kv_cache_dtype`` options (``generate(..., kv_cache_dtype=...)``): None (the model dtype, no quantization),
``torch.int8`` / ``"int8"`` (symmetric, one fp32 scale per 32 elements of a head and token by default: llama.cpp
``-ctk q8_0``'s blocks; ``kv_group_size=D`` keeps one scale per head and token) and ``"int4"``. Why groups of 32
(SmolLM2, the benchmark prompt): greedy decoding of 64 tokens through the int8 cache equals the float cache's with
groups of 32 (and of 16 or 8), while one scale per head first differs at token 13 (a near-tie, top-2 margin 0.022);
the cost is 4 bytes per 32 codes (+6% cache bytes at D = 64).

int4 (4-bit codes, asymmetric groups with float16 scale and min, as ``q4_1``): keys in groups of 16 along the head
dimension, values in groups of 32 (``kv_group_size`` sets both), and the keys rotated first: ``k' = k R`` with R
an orthonormal Hadamard matrix (``hadamard_rotation``), and every query ``q' = q R``, so ``q' . k' = q . k`` in
exact arithmetic. Why (SmolLM2-135M, perplexity over 2048-token windows against the float cache): the loss is
the keys' (values at 4 bits cost +0.1%, keys +18% with symmetric per-token groups of 32), because a few channels
of every key carry a large, nearly constant offset that sets the scale of their whole group; the rotation spreads
them over every channel, the asymmetric groups take a per-group offset, and groups of 16 halve each step. Values
need neither the rotation nor the smaller groups. Keys are quantized after the rotary embedding.

int4 keys also lose a per-(layer, sequence, kv head, channel) offset c before the rotation: ``k' = (k - c) R``.
Every key a query sees has the same c, so ``q . (k - c) = q . k - q . c`` shifts all of that query's logits by
one constant and the softmax is unchanged in exact arithmetic: attention reads the codes as they are (a model
with attention sinks, gpt-oss, has each query's sink logit moved by the same -q . c, ``attend``). c is the
mean of the keys of the sequence's first write (a prompt's tokens; the first token, often an attention sink with
unusual keys, is left out when the write has more than one real token; left padding and compiled prefill's pad
tail are left out too: ``write``'s ``real``), fixed from then on (the codes already written depend on it). It
takes away the large, nearly constant channels that otherwise set their groups' scale. Overhead: 4 * D bytes
per layer, kv head and sequence (fp32), none per token.

A prompt (``StaticDecoder`` prefill from slot 0) attends over its own float keys and values, as with a float
cache, and writes their codes; decode steps and teacher-forced scoring (``StaticDecoder.score``) read the codes.

Bytes per token and layer, for KVH kv heads of dimension D: int8 ``2 * KVH * (D + 4 * D / G)`` (G = 32: ``2 * KVH
* 1.125 * D``); int4 ``KVH * (D + 4 * D / Gk + 4 * D / Gv)`` (Gk = 16, Gv = 32: ``KVH * 1.375 * D``).
"""

from __future__ import annotations

import math
from functools import partial

import torch

__all__ = ["KV_CACHE_DTYPES", "INT8_GROUP", "INT4_KEY_GROUP", "INT4_VALUE_GROUP", "kv_cache_kind",
           "check_kv_group_size", "hadamard_rotation", "QuantizedKVCache"]

KV_CACHE_DTYPES = ("None (model dtype)", "torch.int8", "'int8'", "'int4'")
#: Default group sizes along the head dimension (capped at the largest common divisor with it): int8 keys and
#: values, int4 keys, int4 values.
INT8_GROUP = 32
INT4_KEY_GROUP, INT4_VALUE_GROUP = 16, 32


def kv_cache_kind(kv_cache_dtype) -> str | None:
    """None, "int8" or "int4" for a ``kv_cache_dtype`` argument; ValueError naming the options otherwise."""
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype is torch.int8 or kv_cache_dtype == "int8":
        return "int8"
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype == "int4":
        return "int4"
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def hadamard_rotation(d: int) -> torch.Tensor:
    """Orthonormal symmetric [d, d] float32 (R R = I): the Sylvester Hadamard matrix of n = the largest power of
    two dividing d, times n^-0.5, repeated along the diagonal (d / n blocks; one block when d is a power of 2)."""
    if not isinstance(d, int) or d <= 0:
        raise ValueError(f"d must be a positive int, got {d!r}")
    n = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h * n**-0.5] * (d // n))


def check_kv_group_size(kind: str | None, group_size: int | None) -> None:
    """ValueError for a ``kv_group_size`` that cannot apply: given for a float cache (``kind`` None, where it
    would be ignored), or not a positive int. Whether it divides the head dimension is ``_groups``' check."""
    if group_size is None:
        return
    if kind is None:
        raise ValueError("kv_group_size applies to a quantized KV cache (kv_cache_dtype='int8' or 'int4'); drop it "
                         f"or pass kv_cache_dtype (got kv_group_size={group_size!r} with kv_cache_dtype=None)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"kv_group_size must be a positive int dividing the head dimension (or None for the "
                         f"default groups), got {group_size!r}")


def _groups(kind: str, d: int, group_size: int | None) -> tuple[int, int]:
    """(key, value) group sizes; ValueError unless each divides d (and is even for int4)."""
    if group_size is None:
        if kind == "int8":
            gk = gv = math.gcd(d, INT8_GROUP)
        else:
            gk, gv = math.gcd(d, INT4_KEY_GROUP), math.gcd(d, INT4_VALUE_GROUP)
    else:
        check_kv_group_size(kind, group_size)  # a bool is an int to isinstance: True must not mean groups of 1
        gk = gv = group_size
    for g in (gk, gv):
        if not isinstance(g, int) or g <= 0 or d % g or (kind == "int4" and g % 2):
            raise ValueError(f"kv_group_size must divide the head dimension {d} and be even for an int4 KV cache, "
                             f"got {group_size}")
    return gk, gv


class QuantizedKVCache:
    """Per layer key and value codes [B, KVH, T, D] (int8) or [B, KVH, T, D / 2] (uint8 int4 nibbles) with their
    scales (int8: fp32 [B, KVH, T, D / G]; int4: float16 (scale, min) pairs [B, KVH, T, 2 * D / G], keys and
    values with their own G); formats in ``affineq.cpp.kv_attention``. int4 keys are stored rotated
    (``rotation``) after their offset ``k_offset`` is taken away (see the module docstring)."""

    def __init__(self, kind: str, layers: int, shape: tuple[int, int, int, int], group_size: int | None,
                 device: torch.device) -> None:
        from affineq import cpp
        from affineq.cpp import kv_attention as kva

        b, kvh, t, d = shape
        self.kind = kind
        self.key_group, self.value_group = _groups(kind, d, group_size)
        self.group_size = self.key_group  # the key group (int8: both)
        code_shape = (b, kvh, t, d if kind == "int8" else d // 2)
        dtype = torch.int8 if kind == "int8" else torch.uint8
        sdt, words = (torch.float32, 1) if kind == "int8" else (torch.float16, 2)

        def zeros(s, dt):
            return [torch.zeros(s, dtype=dt, device=device) for _ in range(layers)]

        self.k, self.v = zeros(code_shape, dtype), zeros(code_shape, dtype)
        self.k_scale = zeros((b, kvh, t, words * d // self.key_group), sdt)
        self.v_scale = zeros((b, kvh, t, words * d // self.value_group), sdt)
        self.rotation = hadamard_rotation(d).to(device) if kind == "int4" else None
        #: int4: the key offset c [B, KVH, 1, D] fp32 per layer, set by each sequence's first write (slot 0).
        self.k_offset = zeros((b, kvh, 1, d), torch.float32) if kind == "int4" else None
        self._quantize = kva.quantize_kv
        # Chosen here, not per call: the decode step is compiled, and the ops (with their fakes) are what it traces.
        self._attend = torch.ops.affineq.kv_attention if cpp.is_available() else kva.kv_attention_reference
        self._attend_sinks = torch.ops.affineq.kv_attention_sinks if cpp.is_available() else kva.kv_attention_reference

    def bytes_per_token(self) -> int:
        """Cache bytes per token of one sequence, all layers, codes and scales."""
        per_layer = sum(x[0, :, 0].numel() * x.element_size()
                        for x in (self.k[0], self.k_scale[0], self.v[0], self.v_scale[0]))
        return len(self.k) * per_layer

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              real: torch.Tensor | None = None) -> None:
        """Quantize keys / values [B, KVH, S, D] (keys after the rotary embedding) into the slots ``pos`` [S].

        int4: a write that starts at slot 0 begins a sequence and sets the key offset c of each batch row to the
        mean of its keys where ``real`` [B, S] (bool) is True; default: all S tokens but the first when S > 1 (a
        one-token write: that token). Rows with no real token get c = 0. Other writes keep c."""
        if self.rotation is not None:
            k = k.float()
            if real is None:
                real = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
                if k.shape[2] > 1:
                    real[:, 0] = False
            w = real.to(k.dtype)[:, None, :, None]  # [B, 1, S, 1]
            mean = (k * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp_min(1.0)
            off = self.k_offset[layer]
            off.copy_(torch.where(pos[:1] == 0, mean, off))  # no host sync: the compiled step traces this too
            k = (k - off) @ self.rotation
        for x, g, codes, scale in ((k, self.key_group, self.k[layer], self.k_scale[layer]),
                                   (v, self.value_group, self.v[layer], self.v_scale[layer])):
            c, s = self._quantize(x, self.kind, g)
            codes.index_copy_(2, pos, c)
            scale.index_copy_(2, pos, s)

    def attend(self, layer: int, q: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [B, H, S, D] (scaled so that the logits are q . k / sqrt(D)) at slots ``pos`` over this
        layer's cache (slots <= pos, ``valid``, and > pos - ``window`` for a sliding-window layer), with each
        head's sink logit (``sinks`` [H], gpt-oss) in the softmax's denominator (int4: moved by the key offset's
        shift of the logits); [B, H, S, D] in q's dtype. A decode step's window is one more cut of ``valid``; a
        query block whose window cuts (each query its own range) dequantizes the cache slots instead."""
        dt = q.dtype
        if self.rotation is not None:  # the keys are stored rotated: q' . k' = (q R) . (k R) = q . k
            if sinks is not None:
                # the codes' logits are q . (k - c) / sqrt(D): each query's sink moves by the same -q . c / sqrt(D)
                # (the softmax is shift-invariant only without a sink)
                c = self.k_offset[layer].repeat_interleave(q.shape[1] // self.k_offset[layer].shape[1], 1)
                sinks = sinks.float()[None, :, None] - (q.float() * c).sum(-1) * q.shape[-1] ** -0.5
            q = q.float() @ self.rotation
        args = (self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer])
        attend = self._attend if sinks is None else partial(self._attend_sinks, sinks=sinks)
        if window is None:
            return attend(q, *args, pos, valid).to(dt)
        slots = torch.arange(valid.shape[1], device=valid.device)
        if q.shape[2] == 1:
            return attend(q, *args, pos, valid & (slots > pos[0] - window)[None]).to(dt)
        from affineq.cpp import kv_attention as kva

        k, v = kva.dequantize_kv(*args[:2]), kva.dequantize_kv(*args[2:])  # fp32 [B, KVH, T, D]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        keep = ((slots[None, :] <= pos[:, None]) & (slots[None, :] > pos[:, None] - window))[None] & valid[:, None]
        p = kva.masked_softmax((q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, keep[:, None], sinks)
        return (p @ v).to(dt)
