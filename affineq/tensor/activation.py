"""What a quantized linear does to its input before the matmul: the weight's activation tensors and its
activation quantization (`ActivationQuant`, dynamic or static).

`prepare_input` is the one place activation tensors are applied (`act_pre_scale`: x -> x * pre_scale, the
AWQ / SmoothQuant input scaling); it runs before a kernel is chosen. `kernel_output` gives a kernel's result
x's shape and dtype and adds the bias; `finish_output` applies the static output quantization (`act_out_scale`)
to it. `fake_quantize_activation` is the
reference numerics of activation quantization (dequantize(quantize(x))), with calibrated qparams when the
weight's `ActivationQuant` is static; kernels that take integer activations call `quantize_activation`.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

import torch

from affineq import cpp as _cpp
from affineq.mx import fake_quantize_mx
from affineq.primitives import (
    MappingType,
    ZeroPointDomain,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)
from affineq.tensor.spec import ActivationQuant, as_key, from_key

_SYMMETRIC = (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)
_FLOAT_MAX = {d: torch.finfo(d).max for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def computes_in_other_dtype(x: torch.Tensor, w) -> bool:
    """True when the weight's spec asks float32 inputs to compute in its `compute_dtype` (bf16)."""
    return spec_computes_in_other_dtype(w.spec, x.dtype)


def spec_computes_in_other_dtype(spec, dtype: torch.dtype) -> bool:
    """`computes_in_other_dtype` for weights of `spec` and inputs of `dtype`."""
    return spec.compute_dtype is not None and dtype == torch.float32


def prepare_input(x: torch.Tensor, w) -> torch.Tensor:
    """`x` with the weight's activation tensors applied (x * act_pre_scale), or `x` itself."""
    pre = getattr(w, "_act_pre_scale", None) if "act_pre_scale" in w._names else None
    return x if pre is None else x * pre.to(x.dtype)


#: Set by `affineq.distributed` while a linear whose input channels K are sharded across ranks runs (tensor-parallel
#: rowwise): reduce(t, op) with op "min" or "max" returns t reduced elementwise over the ranks (an all-reduce).
range_reduce: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("affineq_range_reduce", default=None)


def rounding_kernel_may_quantize(w) -> bool:
    """Whether a `rounds_input` kernel may take float32 x itself for a weight with a `compute_dtype`: weight-only,
    or a dynamic int8 activation with a fused shortcut (the kernel quantizes the rounded x as it quantizes bf16 x),
    outside a K-sharded linear (whose token ranges `reduce_input_ranges` reduces across ranks first)."""
    aq = w.spec.act_quant
    return aq is None or (fused_int8_mode(aq) is not None and range_reduce.get() is None)


def reduce_input_ranges(x: torch.Tensor, w):
    """(x, w) for a kernel. Inside a K-sharded linear with dynamic per-token / per-tensor activation quantization,
    each rank holds a slice of every token: x comes back fake-quantized with the qparams of the whole token
    (min / max reduced across the ranks, then the primitives' formula, so each element is bit for bit what the
    unsharded input gives), and w as a view without activation quantization, so the kernel does not quantize x
    again. Otherwise (x, w) unchanged (MX blocks and static qparams need no reduction)."""
    reduce, aq = range_reduce.get(), w.spec.act_quant
    if reduce is None or aq is None or aq.static or aq.is_mx:
        return x, w
    x2 = x.reshape(-1, x.shape[-1])
    lo, hi = _row_range(x2.float(), aq.per_token)  # exact in float32 for every float dtype
    src = torch.cat([reduce(lo, "min"), reduce(hi, "max")], dim=1).to(x.dtype)
    scale, zp = choose_qparams_affine(src, aq.mapping_type, (1, 2), aq.dtype, eps=aq.eps, scale_dtype=torch.float32,
                                      zero_point_domain=_domain(aq))
    q, scale, zp, block = quantize_activation(x2, aq, (scale, zp))
    out = dequantize_affine(q, block, scale, zp, aq.dtype, zero_point_domain=_domain(aq), output_dtype=x.dtype)
    return out.view(x.shape), w._replace(spec=_without_act_quant(w.spec))


@functools.lru_cache(maxsize=512)
def _without_act_quant(spec):
    """One spec object per weight spec, so the kernel choice (cached by spec identity) is made once."""
    return spec.replace(act_quant=None)


def finish_output(y: torch.Tensor, w) -> torch.Tensor:
    """`y` quantized to int8 and back with the weight's calibrated output qparams (`act_out_scale`, optional
    `act_out_zero_point`: static output quantization), or `y` itself when the weight has none."""
    if "act_out_scale" not in w._names:
        return y
    zp = w._act_out_zero_point if "act_out_zero_point" in w._names else None
    domain = ZeroPointDomain.NONE if zp is None else ZeroPointDomain.INT
    y2 = y.reshape(-1, y.shape[-1]) if y.dim() > 1 else y.reshape(1, -1)
    # One scale for the tensor, as one per row of (1, N) blocks: int block sizes with a symbolic batch dim.
    block = (1, y2.shape[1])
    scale, zp = _per_row(w._act_out_scale, y2.shape[0]), _per_row(zp, y2.shape[0])
    q = quantize_affine(y2, block, scale, zp, torch.int8, zero_point_domain=domain)
    return dequantize_affine(q, block, scale, zp, torch.int8, zero_point_domain=domain,
                             output_dtype=y.dtype).view(y.shape)


def kernel_output(out2: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A kernel's [M, N] result as F.linear(x, W, bias) returns it: x's leading dims, x's dtype, plus bias."""
    out = out2.view(*x.shape[:-1], out2.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


def _domain(aq: ActivationQuant) -> ZeroPointDomain:
    return ZeroPointDomain.NONE if aq.dtype.is_float else aq.zero_point_domain


def _per_row(t: torch.Tensor | None, rows) -> torch.Tensor | None:
    """A per-tensor qparam (one element) as a [rows, 1] view: one entry per row of a (1, K) block."""
    return None if t is None else t.reshape(1, 1).expand(rows, 1)


def static_qparams(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The calibrated (act_scale, act_zero_point or None) a static `ActivationQuant` weight carries."""
    zp = w._act_zero_point if "act_zero_point" in w._names else None
    return w._act_scale, zp


def quantize_activation(x2: torch.Tensor, aq: ActivationQuant, qparams=None):
    """Quantize a 2-D activation [M, K] as `aq` describes -> (codes, scale, zero_point, block_size).

    block_size is (1, K) for per-token and per-tensor alike (per tensor, the one scale / zero point is returned
    as a [M, 1] expanded view): the primitives take int block sizes, and M is symbolic under torch.export with
    a dynamic batch dim. `qparams`: (scale, zero_point) of a static `aq` (see `static_qparams`); None computes
    them from x2."""
    block = (1, x2.shape[1])
    domain = _domain(aq)
    per_tensor = not aq.per_token
    if qparams is None:
        # Per tensor: the qparams read only the block's min and max, so those of the [1, 2] tensor
        # (min(x2), max(x2)) are bit for bit those of block x2.shape.
        src = torch.stack([x2.amin(), x2.amax()]).view(1, 2) if per_tensor else x2
        scale, zp = choose_qparams_affine(
            src, aq.mapping_type, (1, 2) if per_tensor else block, aq.dtype, eps=aq.eps,
            scale_dtype=torch.float32, zero_point_domain=domain,
        )
    else:
        scale, zp = qparams
    if per_tensor:
        scale, zp = _per_row(scale, x2.shape[0]), _per_row(zp, x2.shape[0])
    return quantize_affine(x2, block, scale, zp, aq.dtype, zero_point_domain=domain), scale, zp, block


def quantize_float_activation(x2: torch.Tensor, aq: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes [M, K], float32 scale [M, 1]) of a 2-D activation for a dynamic float8 `aq` (per token, or per
    tensor: one scale repeated), `quantize_activation`'s values; traced, one opaque op (see below)."""
    if torch.compiler.is_compiling():
        return torch.ops.affineq.quantize_float_activation(x2, as_key(aq))
    return _quantize_float_activation(x2, aq)


def _quantize_float_activation(x2: torch.Tensor, aq: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, _, _ = quantize_activation(x2, aq)
    return q, scale.contiguous()


# The float8 and MX activation quantizations are opaque ops in traced graphs, as the int8 ones are (C++ ops).
# Traced inline, inductor fused them with the op that produced x and skipped that op's rounding to x's dtype: on a
# bf16 MLP with GELU between two such linears (no bias) codes near a boundary moved and the output came out 1.4%
# (float8) / 2.7% (MXFP8) away from eager. As ops, x is stored in its dtype first and the eager code quantizes it.
# `aq`: the ActivationQuant as `as_key` writes it.
@torch.library.custom_op("affineq::quantize_float_activation", mutates_args=())
def _quantize_float_activation_op(x2: torch.Tensor, aq: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_float_activation(x2, from_key(ActivationQuant, aq))


@_quantize_float_activation_op.register_fake
def _(x2, aq):
    codes = x2.new_empty(x2.shape, dtype=from_key(ActivationQuant, aq).dtype.torch_dtype)
    return codes, x2.new_empty((x2.shape[0], 1), dtype=torch.float32)


def _fake_quantize_mx_activation(x: torch.Tensor, aq: ActivationQuant) -> torch.Tensor:
    return fake_quantize_mx(x, aq.dtype, aq.block_size, aq.scale_mode, axis=-1)


@torch.library.custom_op("affineq::fake_quantize_mx_activation", mutates_args=())
def _fake_quantize_mx_op(x: torch.Tensor, aq: str) -> torch.Tensor:
    return _fake_quantize_mx_activation(x, from_key(ActivationQuant, aq))


@_fake_quantize_mx_op.register_fake
def _(x, aq):
    return torch.empty_like(x)


def fake_quantize_activation(x: torch.Tensor, aq: ActivationQuant, w=None) -> torch.Tensor:
    """dequantize(quantize(x)) with `aq`, same shape and dtype as x (the reference numerics). A static `aq`
    reads its calibrated qparams from the weight `w`."""
    if aq.is_mx:  # OCP MX: shared E8M0 scale per block of K
        if torch.compiler.is_compiling():  # one opaque op, as eager computes it (see quantize_float_activation)
            return torch.ops.affineq.fake_quantize_mx_activation(x, as_key(aq))
        return _fake_quantize_mx_activation(x, aq)
    if aq.static:
        return fake_quantize_static(x, aq, *static_qparams(w))
    x2 = x.reshape(-1, x.shape[-1])
    # int8 shortcuts, bit for bit the primitives' values (tested), several times faster than the general
    # primitives (benchmarks/README.md), paid per linear at decode: one C++ pass where it is built, else a few
    # eager ops.
    mode = fused_int8_mode(aq)
    if mode is not None and x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and _cpp.is_available():
        out = torch.ops.affineq.int8_fake_quant(x2, aq.per_token, mode, act_eps(x, aq))
        return out.view(x.shape)
    if is_symmetric_int8(aq):
        q, scale = int8_activation(x2, aq.per_token,
                                   aq.mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR, act_eps(x, aq))
        out = q.float() * scale
        return (_saturate(out, x.dtype) if _may_overflow(scale, x.dtype, 128) else out.to(x.dtype)).view(x.shape)
    asymmetric_int = aq.mapping_type is MappingType.ASYMMETRIC and aq.zero_point_domain is ZeroPointDomain.INT
    if aq.dtype.name == "int8" and asymmetric_int:
        return _int8_asymmetric_fake_quant(x2, aq.per_token, act_eps(x, aq)).view(x.shape)
    q, scale, zp, block = quantize_activation(x2, aq)
    out = dequantize_affine(q, block, scale, zp, aq.dtype, zero_point_domain=_domain(aq), output_dtype=x.dtype)
    return out.view(x.shape)


def fake_quantize_static(x: torch.Tensor, aq: ActivationQuant, scale: torch.Tensor,
                         zero_point: torch.Tensor | None) -> torch.Tensor:
    """dequantize(quantize(x)) with calibrated per-tensor qparams (one-element `scale`, `zero_point` or None):
    what a static `aq` weight does to its input, and what graph mode's quantize/dequantize nodes do."""
    x2 = x.reshape(-1, x.shape[-1])
    q, scale, zp, block = quantize_activation(x2, aq, (scale, zero_point))
    return dequantize_affine(q, block, scale, zp, aq.dtype, zero_point_domain=_domain(aq),
                             output_dtype=x.dtype).view(x.shape)


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_int8_mode(aq: ActivationQuant) -> int | None:
    """The `affineq::int8_fake_quant` mode of a dynamic int8 `aq` with a shortcut (0 symmetric, 1 symmetric
    without clipping, 2 asymmetric with an integer zero point), or None."""
    if is_symmetric_int8(aq):
        return 1 if aq.mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR else 0
    asymmetric_int = aq.mapping_type is MappingType.ASYMMETRIC and aq.zero_point_domain is ZeroPointDomain.INT
    return 2 if (not aq.static and aq.dtype.name == "int8" and asymmetric_int) else None


def is_symmetric_int8(aq: ActivationQuant | None) -> bool:
    return (aq is not None and not aq.static and not aq.is_mx and aq.dtype.name == "int8"
            and aq.mapping_type in _SYMMETRIC
            and aq.zero_point_domain in (ZeroPointDomain.NONE, ZeroPointDomain.INT))


def act_eps(x: torch.Tensor, aq: ActivationQuant) -> float:
    """choose_qparams_affine's default eps for a float32 scale (whatever x.dtype is), or aq.eps."""
    return torch.finfo(torch.float32).tiny if aq.eps is None else float(aq.eps)


def _saturate(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`v` cast to `dtype`, clamped to its finite range first (as dequantize_affine does)."""
    limit = torch.finfo(dtype).max
    return v.clamp(-limit, limit).to(dtype)


def _may_overflow(scale: torch.Tensor, dtype: torch.dtype, codes: int) -> bool:
    """Whether `codes` * scale can pass `dtype`'s finite range (or the scale itself overflowed): then the
    shortcuts take their overflow-safe steps. Under torch.compile always (no host sync in a graph; inductor
    fuses the extra ops); eagerly one comparison, as the safe steps cost more than it on every call."""
    if torch.compiler.is_compiling():
        return True
    largest = scale.item() if scale.numel() == 1 else float(scale.max())  # one token: a plain read
    return not largest <= _FLOAT_MAX[dtype] / codes  # `not <=`: a NaN scale takes the safe steps too


def _row_range(xf: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of xf [M, K] per row ([M, 1] each) or over the whole tensor ([1, 1] each)."""
    if per_token:
        return xf.amin(1, keepdim=True), xf.amax(1, keepdim=True)
    return xf.amin().view(1, 1), xf.amax().view(1, 1)


def int8_activation(x2: torch.Tensor, per_token: bool, no_clipping: bool, eps: float):
    """`quantize_activation` for symmetric int8 (zero point 0) in a few eager ops -> (codes, float32 scale
    [M or 1, 1]). Bit-identical: max(-min_neg, max_pos) is amax(|x|), and the rest is the same float32 ops
    in the same order (scale / 127.5 or the no-clipping max, clamp to eps, round(x * (1 / scale)), clamp)."""
    xf = x2.float()
    if no_clipping:
        lo, hi = _row_range(xf, per_token)
        scale = torch.maximum(lo.clamp(max=0.0) / -128.0, hi.clamp(min=0.0) / 127.0)
    else:
        amax = xf.abs().amax(1, keepdim=True) if per_token else xf.abs().amax().view(1, 1)
        scale = amax / 127.5
    scale = scale.clamp(min=eps)
    return torch.round(xf * (1.0 / scale)).clamp(-128, 127).to(torch.int8), scale


def _int8_asymmetric_fake_quant(x2: torch.Tensor, per_token: bool, eps: float) -> torch.Tensor:
    """dequantize(quantize(x2)) for asymmetric int8 with an integer zero point (range widened to include 0),
    the primitives' float32 ops in their order: scale = (max - min) / 255 (halves where that overflows), zp =
    clamp(-128 - round(min / scale)), q = clamp(round(x / scale) + zp), out = (q - zp) * scale saturated."""
    xf = x2.float()
    lo, hi = _row_range(xf, per_token)
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = ((hi - lo) / 255.0).clamp(min=eps)
    careful = _may_overflow(scale, x2.dtype, 256)
    if careful:  # hi - lo overflows float32 past +-1.7e38: the primitives then take the halves (no overflow)
        scale = torch.where(torch.isfinite(scale), scale, ((hi * 0.5 - lo * 0.5) / 127.5).clamp(min=eps))
    zp = (-128.0 - torch.round(lo / scale)).clamp(-128, 127)
    q = (torch.round(xf * (1.0 / scale)) + zp).clamp(-128, 127)
    out = (q - zp) * scale
    return _saturate(out, x2.dtype) if careful else out.to(x2.dtype)
