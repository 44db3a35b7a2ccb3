"""The quantized KV cache of ``StaticDecoder``: int8 or int4 codes with fp32 scales, written per token and read by
attention directly (``affineq.cpp.kv_attention``), never expanded to a float copy of the cache.

``kv_cache_dtype`` options (``generate(..., kv_cache_dtype=...)``): None (the model dtype, no quantization),
``torch.int8`` / ``"int8"`` (one scale per head and token by default, as llama.cpp ``-ctk q8_0`` with a whole
head per block; ``kv_group_size=32`` gives q8_0's blocks) and ``"int4"`` (groups of ``kv_group_size`` along the
head dimension, default 32 or the head dimension if smaller, as ``q4_0``). Keys are
quantized after the rotary embedding, both on write; every attention (prefill included) reads the quantized
cache. Bytes per token and layer: int8 ``2 * KVH * (D + 4)``, int4 ``2 * KVH * (D / 2 + 4 * D / G)``.
"""

from __future__ import annotations

import torch

__all__ = ["KV_CACHE_DTYPES", "kv_cache_kind", "QuantizedKVCache"]

KV_CACHE_DTYPES = ("None (model dtype)", "torch.int8", "'int8'", "'int4'")


def kv_cache_kind(kv_cache_dtype) -> str | None:
    """None, "int8" or "int4" for a ``kv_cache_dtype`` argument; ValueError naming the options otherwise."""
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype is torch.int8 or kv_cache_dtype == "int8":
        return "int8"
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype == "int4":
        return "int4"
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


class QuantizedKVCache:
    """Per layer key and value codes [B, KVH, T, D] (int8) or [B, KVH, T, D / 2] (uint8 int4 nibbles) and fp32
    scales [B, KVH, T, D / G]; formats in ``affineq.cpp.kv_attention``."""

    def __init__(self, kind: str, layers: int, shape: tuple[int, int, int, int], group_size: int | None,
                 device: torch.device) -> None:
        from affineq import cpp
        from affineq.cpp import kv_attention as kva

        b, kvh, t, d = shape
        self.kind = kind
        self.group_size = group_size or (d if kind == "int8" else min(32, d))
        if not isinstance(self.group_size, int) or self.group_size <= 0 or d % self.group_size or (
                kind == "int4" and self.group_size % 2):
            raise ValueError(f"kv_group_size must divide the head dimension {d} and be even for an int4 KV cache, "
                             f"got {group_size}")
        code_shape = (b, kvh, t, d if kind == "int8" else d // 2)
        dtype = torch.int8 if kind == "int8" else torch.uint8
        scale_shape = (b, kvh, t, d // self.group_size)

        def zeros(s, dt):
            return [torch.zeros(s, dtype=dt, device=device) for _ in range(layers)]

        self.k, self.v = zeros(code_shape, dtype), zeros(code_shape, dtype)
        self.k_scale, self.v_scale = zeros(scale_shape, torch.float32), zeros(scale_shape, torch.float32)
        self._quantize = kva.quantize_kv
        # Chosen here, not per call: the decode step is compiled, and the op (with its fake) is what it traces.
        self._attend = torch.ops.affineq.kv_attention if cpp.is_available() else kva.kv_attention_reference

    def bytes_per_token(self) -> int:
        """Cache bytes per token of one sequence, all layers, codes and scales."""
        per_layer = sum(t[0, :, 0].numel() * t.element_size() for t in (self.k[0], self.k_scale[0]))
        return 2 * len(self.k) * per_layer

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize keys / values [B, KVH, S, D] into the slots ``pos`` [S]."""
        for x, codes, scale in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            c, s = self._quantize(x, self.kind, self.group_size)
            codes.index_copy_(2, pos, c)
            scale.index_copy_(2, pos, s)

    def attend(self, layer: int, q: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """Attention of q [B, H, S, D] at slots ``pos`` over this layer's cache (slots <= pos, ``valid``, and
        > pos - ``window`` for a sliding-window layer). A decode step's window is one more cut of ``valid``; a
        prefill whose window cuts (each query its own range) dequantizes the cache slots it covers instead."""
        args = (self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer])
        if window is None:
            return self._attend(q, *args, pos, valid)
        slots = torch.arange(valid.shape[1], device=valid.device)
        if q.shape[2] == 1:
            return self._attend(q, *args, pos, valid & (slots > pos[0] - window)[None])
        from affineq.cpp import kv_attention as kva

        k, v = kva.dequantize_kv(*args[:2]), kva.dequantize_kv(*args[2:])  # fp32 [B, KVH, T, D]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        keep = ((slots[None, :] <= pos[:, None]) & (slots[None, :] > pos[:, None] - window))[None] & valid[:, None]
        scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        p = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1).masked_fill(~keep[:, None], 0.0)
        return (p @ v).to(q.dtype)
