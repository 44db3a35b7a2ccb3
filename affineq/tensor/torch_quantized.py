"""Interop with torch's quantized tensors (`torch.quantize_per_tensor` / `quantize_per_channel`, torch.ao).

    AffineQuantizedTensor.from_torch_quantized(qt) -> AffineQuantizedTensor        (plain format)
    aqt.to_torch_quantized() -> torch quantized tensor

| torch qscheme                               | affineq block_size              | scale stored     | zero point |
|---------------------------------------------|---------------------------------|------------------|------------|
| per_tensor_affine / per_tensor_symmetric    | the whole shape                 | float32 [1, ...] | int32      |
| per_channel_affine / per_channel_symmetric  | 1 on `axis`, full size elsewhere | float64 [C on axis] | int64   |

dtypes: qint8 <-> int8, quint8 <-> uint8, qint32 <-> int32; ZeroPointDomain.INT, x = (q - zp) * scale.
`int_repr()` and the codes are equal, and so is `dequantize()` bit for bit, because each side stores the
qparams torch computes with: torch dequantizes per-tensor tensors in float32 with float32(scale) (so the
affine scale is float32(q_scale())), and per-channel tensors in float64 with the float64 scales (so they
are kept in float64, and the `plain` format dequantizes float64 scales as torch does: float32(q) - zero_point
in float32, times the scale in float64). One exception: per-tensor qint32 codes with |q - zero_point| >=
2**24, which torch rounds to float32 before scaling (affineq's int32 math is float64), may differ in the
last bit.

Other qschemes (per_channel_affine_float_qparams), dtypes (quint4x2, quint2x4) and tensors torch cannot
hold (group-wise blocks, float targets, FLOAT zero points, sub-byte or int16 targets, activation
quantization) raise ValueError naming what is unsupported and what to do instead.
"""

from __future__ import annotations

import torch

from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.spec import QuantSpec

__all__ = ["from_torch_quantized", "to_torch_quantized"]

_TO_AFFINE = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}
_TO_TORCH = {"int8": torch.qint8, "uint8": torch.quint8, "int32": torch.qint32}
_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_symmetric)
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)


def from_torch_quantized(qt: torch.Tensor, cls):
    """The `cls` (an `AffineQuantizedTensor` class; plain format, float32 logical dtype) holding `qt`'s codes and
    qparams. Called as `AffineQuantizedTensor.from_torch_quantized(qt)`."""
    if not isinstance(qt, torch.Tensor) or not qt.is_quantized:
        raise ValueError(f"qt must be a torch quantized tensor (torch.quantize_per_tensor / quantize_per_channel), "
                         f"got {type(qt).__name__ if not isinstance(qt, torch.Tensor) else qt.dtype}")
    if qt.dtype not in _TO_AFFINE:
        raise ValueError(f"qt.dtype={qt.dtype} has no affineq target; supported: {list(_TO_AFFINE)} (dequantize() "
                         "it and quantize with affineq for other widths)")
    scheme = qt.qscheme()
    shape = tuple(qt.shape)
    if scheme in _PER_TENSOR:
        block = shape
        scale = torch.tensor(qt.q_scale(), dtype=torch.float64).float()  # torch's math uses float(scale)
        zero_point = torch.tensor(qt.q_zero_point(), dtype=torch.int32)
    elif scheme in _PER_CHANNEL:
        axis = qt.q_per_channel_axis()
        block = tuple(1 if d == axis else s for d, s in enumerate(shape))
        scale = qt.q_per_channel_scales().to(torch.float64)  # torch's per-channel math is float64
        zero_point = qt.q_per_channel_zero_points().to(torch.int64)
    else:
        raise ValueError(
            f"qscheme {scheme} is not supported: from_torch_quantized reads per_tensor_affine, per_tensor_symmetric, "
            "per_channel_affine and per_channel_symmetric (per_channel_affine_float_qparams has float zero points, "
            "x = (q - zp) * scale with a float zp); dequantize() it and quantize with affineq instead")
    spec = QuantSpec.create(shape, torch.float32, _TO_AFFINE[qt.dtype], block,
                            mapping_type=MappingType.SYMMETRIC if scheme in _SYMMETRIC else MappingType.ASYMMETRIC,
                            zero_point_domain=ZeroPointDomain.INT)
    return cls.from_codes(qt.int_repr(), scale, zero_point, spec)


def _why_not(aqt) -> str | None:
    s = aqt.spec
    if s.target.name not in _TO_TORCH:
        return (f"target {s.target} has no torch quantized dtype (torch holds int8 as qint8, uint8 as quint8, int32 "
                "as qint32); quantize to one of those")
    if s.zero_point_domain is ZeroPointDomain.FLOAT:
        return ("zero_point_domain=FLOAT (x = (q - mid) * scale + zp) has no torch qscheme; use "
                "ZeroPointDomain.INT or NONE")
    if s.act_quant is not None or aqt.act_tensors:
        return "torch quantized tensors carry no activation quantization (act_quant / act_* tensors); drop them first"
    return None


def _channel_axis(shape: tuple[int, ...], block: tuple[int, ...]) -> int | None:
    """The per-channel axis of `block` (-1: one block for the whole tensor), or None when it is neither."""
    partial = [d for d, (s, b) in enumerate(zip(shape, block, strict=True)) if b != s]
    if not partial:
        return -1
    if len(partial) == 1 and block[partial[0]] == 1:
        return partial[0]
    return None


def to_torch_quantized(aqt) -> torch.Tensor:
    """A torch quantized tensor with `aqt`'s codes (`int_repr()`) and the same `dequantize()` bit for bit.

    One block over the whole tensor with a float32 (or 16-bit) scale -> per_tensor_affine; one block per
    index of one dim, or a float64 scale -> per_channel_affine on that dim (a single block: the first dim of
    size 1, else dim 0 with the scale repeated). NONE zero points become 0. int32 codes: exact while
    |q - zero_point| < 2**24 (torch rounds q to float32 first)."""
    why = _why_not(aqt)
    s = aqt.spec
    codes, scale, zp = aqt.codes(), aqt.scale, aqt.zero_point
    shape, block = s.shape, s.block_size
    if s.transposed:  # torch has no free transpose of per-channel tensors: materialize the logical layout
        codes, scale = codes.t(), scale.t()
        zp = None if zp is None else zp.t()
        shape, block = shape[::-1], block[::-1]
    axis = _channel_axis(shape, block)
    if why is None and axis is None:
        why = (f"block_size {s.block_size} of shape {s.shape} is group-wise; torch holds one qparam per tensor or per "
               "index of one dim (block_size 1 on that dim, full elsewhere)")
    if why is not None:
        raise ValueError(f"to_torch_quantized: {why}")
    if zp is None:
        zp = torch.zeros_like(scale, dtype=torch.int64)
    elif zp.is_floating_point() and not bool((zp == zp.round()).all()):
        raise ValueError("to_torch_quantized: the zero points are not integers; torch's qschemes hold integer zero "
                         "points (per_channel_affine_float_qparams is not produced)")
    codes = codes.contiguous()
    if axis == -1 and scale.dtype != torch.float64:
        return torch._make_per_tensor_quantized_tensor(codes, float(scale.reshape(())), int(zp.reshape(())))
    if axis == -1:  # a float64 scale: torch's float64 per-channel math on a 1-channel dim (else dim 0, repeated)
        axis = next((d for d, n in enumerate(shape) if n == 1), 0)
    n = shape[axis] if len(shape) else 1
    scales = scale.reshape(-1).to(torch.float64).expand(n).contiguous()
    zps = zp.reshape(-1).to(torch.int64).expand(n).contiguous()
    if not len(shape):
        raise ValueError("to_torch_quantized: a 0-dim tensor with a float64 scale has no per-channel form; cast "
                         "its scale to float32 first")
    return torch._make_per_channel_quantized_tensor(codes, scales, zps, axis)
