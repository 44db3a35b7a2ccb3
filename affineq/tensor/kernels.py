"""Linear kernels and the one rule that picks among them.

Each kernel is one entry: the formats it reads, a precondition that returns None or the reason it cannot
run, and an implementation. `select_linear_kernel` returns the first entry whose precondition holds; when
none does, `linear` runs dequantize-then-`F.linear` and `announce_fallback` says so once per
(format, reason). `set_strict(True)` (or AFFINEQ_STRICT=1) turns every fallback into an error.
Nothing else in affineq decides which kernel runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from affineq import cpp as _cpp
from affineq.dtypes import bit_width, is_float_target
from affineq.primitives import (
    MappingType,
    ZeroPointDomain,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)
from affineq.tensor.spec import ActivationQuant, QuantSpec

log = logging.getLogger("affineq")

Check = Callable[[torch.Tensor, "torch.Tensor"], str | None]
Run = Callable[[torch.Tensor, "torch.Tensor", torch.Tensor | None], torch.Tensor]


class KernelFallbackWarning(UserWarning):
    """A quantized op ran as dequantize-then-compute (slower than a packed kernel)."""


class KernelFallbackError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


@dataclass(frozen=True)
class LinearKernel:
    name: str
    formats: tuple[str, ...]
    check: Check
    run: Run


LINEAR_KERNELS: list[LinearKernel] = []


def register_linear_kernel(name: str, formats: tuple[str, ...], check: Check, run: Run) -> None:
    """Append a kernel; earlier registrations win when several preconditions hold."""
    LINEAR_KERNELS.append(LinearKernel(name, formats, check, run))


# -- fallback announcement, strict mode, kernel recording ---------------------------------------------

_strict = os.environ.get("AFFINEQ_STRICT", "") == "1"
_announced: set[tuple[str, str]] = set()
_recorders: list[list[str]] = []


def set_strict(flag: bool) -> None:
    """Make every dequantize fallback raise `KernelFallbackError` instead of warning."""
    global _strict
    _strict = bool(flag)


@contextlib.contextmanager
def strict_kernels(flag: bool = True) -> Iterator[None]:
    """Context manager form of `set_strict`."""
    old = _strict
    set_strict(flag)
    try:
        yield
    finally:
        set_strict(old)


@contextlib.contextmanager
def record_kernels() -> Iterator[list[str]]:
    """Collect the name of every kernel that runs ("dequantize:<op>" for fallbacks) inside the block."""
    names: list[str] = []
    _recorders.append(names)
    try:
        yield names
    finally:
        _recorders.remove(names)


def _record(name: str) -> None:
    for names in _recorders:
        names.append(name)


def announce_fallback(fmt: str, reason: str, op: str = "linear") -> None:
    """Say once per (format, reason) that `op` runs as dequantize-then-compute; raise in strict mode."""
    _record(f"dequantize:{op}")
    msg = f"affineq: {op} on a {fmt!r} quantized tensor runs as dequantize-then-{op} (slower): {reason}"
    if _strict:
        raise KernelFallbackError(msg + " [strict mode: affineq.set_strict(False) to allow fallbacks]")
    key = (fmt, reason)
    if key in _announced or torch.compiler.is_compiling():
        return
    _announced.add(key)
    log.info(msg)
    warnings.warn(msg, KernelFallbackWarning, stacklevel=3)


def reset_announcements() -> None:
    """Forget which fallbacks were announced (tests use this)."""
    _announced.clear()


# -- activation quantization (the frozen description on the weight, applied here) ---------------------


def _act_block(x2: torch.Tensor, aq: ActivationQuant) -> tuple[int, int]:
    return (1, x2.shape[1]) if aq.granularity == "per_token" else tuple(x2.shape)


def quantize_activation(x2: torch.Tensor, aq: ActivationQuant):
    """Quantize a 2-D activation [M, K] as `aq` describes -> (codes, scale, zero_point, block_size)."""
    block = _act_block(x2, aq)
    domain = ZeroPointDomain.NONE if is_float_target(aq.dtype) else aq.zero_point_domain
    scale, zp = choose_qparams_affine(
        x2, aq.mapping_type, block, aq.dtype, eps=aq.eps, scale_dtype=torch.float32,
        zero_point_domain=domain,
    )
    return quantize_affine(x2, block, scale, zp, aq.dtype, zero_point_domain=domain), scale, zp, block


def fake_quantize_activation(x: torch.Tensor, aq: ActivationQuant) -> torch.Tensor:
    """dequantize(quantize(x)) with `aq`, same shape and dtype as x (the reference numerics)."""
    x2 = x.reshape(-1, x.shape[-1])
    # int8 shortcuts, bit for bit the primitives' values (tested): 18 us (symmetric) / 41 us (asymmetric)
    # instead of ~80 us through the general primitives for a 4096-wide token, paid per linear at decode
    if _is_symmetric_int8(aq):
        q, scale = _int8_activation(x2, aq.granularity == "per_token",
                                    aq.mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR, _act_eps(x, aq))
        return (q.float() * scale).to(x.dtype).view(x.shape)
    asymmetric_int = aq.mapping_type is MappingType.ASYMMETRIC and aq.zero_point_domain is ZeroPointDomain.INT
    if aq.dtype == torch.int8 and asymmetric_int:
        return _int8_asymmetric_fake_quant(x2, aq.granularity == "per_token", _act_eps(x, aq)).view(x.shape)
    q, scale, zp, block = quantize_activation(x2, aq)
    domain = ZeroPointDomain.NONE if is_float_target(aq.dtype) else aq.zero_point_domain
    out = dequantize_affine(q, block, scale, zp, aq.dtype, zero_point_domain=domain, output_dtype=x.dtype)
    return out.view(x.shape)


# -- selection and the linear entry point -------------------------------------------------------------


def select_linear_kernel(x: torch.Tensor, w) -> tuple[LinearKernel | None, list[str]]:
    """The first kernel whose precondition holds for F.linear(x, w), and the reasons the others gave."""
    reasons = []
    for k in LINEAR_KERNELS:
        if w.spec.fmt not in k.formats:
            continue
        why = k.check(x, w)
        if why is None:
            return k, reasons
        reasons.append(f"{k.name}: {why}")
    if not reasons:
        reasons.append(f"no packed kernel reads format {w.spec.fmt!r}")
    return None, reasons


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for an AffineQuantizedTensor weight w [N, K]: a packed kernel or the fallback."""
    if w.spec.transposed:
        kernel, reasons = None, ["the weight is a transposed view; kernels read the stored [N, K] layout"]
    else:
        kernel, reasons = select_linear_kernel(x, w)
    if kernel is not None:
        _record(kernel.name)
        if x.requires_grad and torch.is_grad_enabled():
            out = _KernelLinear.apply(x, w, kernel.name)
            return out if bias is None else out + bias
        return kernel.run(x, w, bias)
    announce_fallback(w.spec.fmt, "; ".join(reasons))
    return dequantize_linear(x, w, bias)


class _KernelLinear(torch.autograd.Function):
    """A packed kernel forward with the input gradient grad_x = grad_y @ dequantize(W) (W is frozen)."""

    @staticmethod
    def forward(ctx, x, w, name):
        ctx.w = w
        return next(k for k in LINEAR_KERNELS if k.name == name).run(x, w, None)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.w.dequantize(grad.dtype), None, None


def dequantize_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference numerics: fake-quantize the activation (if any), dequantize the weight, F.linear."""
    if w.spec.act_quant is not None:
        x = fake_quantize_activation(x, w.spec.act_quant)
    return F.linear(x, w.dequantize(x.dtype), bias)


# -- preconditions shared by the CPU kernels ----------------------------------------------------------

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _common(x: torch.Tensor, w, device: str = "cpu") -> str | None:
    if x.device.type != device:
        return f"input is on {x.device.type}, kernel runs on {device}"
    if x.dtype not in _FLOATS:
        return f"input dtype {x.dtype} is not fp32/bf16/fp16"
    return None


def _is_zero_point_free(spec: QuantSpec) -> bool:
    """Codes dequantize as q * scale: symmetric int8 (zero point 0) or the NONE domain."""
    if spec.zero_point_domain is ZeroPointDomain.NONE:
        return True
    symmetric = spec.mapping_type in (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    return symmetric and (spec.quant_max + spec.quant_min + 1) // 2 == 0


def _per_channel_int8(spec: QuantSpec) -> str | None:
    if spec.target_dtype != torch.int8 or len(spec.shape) != 2:
        return f"needs a 2-D int8 weight (got {spec.target_dtype}, {len(spec.shape)}-D)"
    if spec.block_size != (1, spec.shape[1]):
        return f"needs per-channel scales, block_size (1, K); got {spec.block_size}"
    if not _is_zero_point_free(spec):
        return "needs symmetric codes (zero point 0)"
    return None


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(out2: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = out2.view(*x.shape[:-1], out2.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


# -- kernel: affineq::lowbit_linear (our C++), dense format, any width 1-8 -----------------------------


def _lowbit_check(x, w):
    why = _common(x, w)
    if why is None and not _cpp.is_available():
        why = f"the affineq C++ kernels are unavailable ({_cpp.unavailable_reason()})"
    aq = w.spec.act_quant
    if why is None and aq is not None and is_float_target(aq.dtype):
        why = "float8 activations are not supported by lowbit_linear"
    return why


def _lowbit_run(x, w, bias):
    spec = w.spec
    if spec.act_quant is not None:
        # 8da4w-style: the activation is fake-quantized per token; the weight product stays exact.
        x = fake_quantize_activation(x, spec.act_quant)
    n, k = spec.shape
    out = torch.ops.affineq.lowbit_linear(
        x, w._qdata, w._scale, w._offset, bit_width(spec.target_dtype), spec.block_size[1], n, k,
        _cpp.codes_kind(spec.target_dtype),
    )
    return out if bias is None else out + bias


register_linear_kernel("affineq.lowbit_linear", ("dense",), _lowbit_check, _lowbit_run)


# -- kernels: aten int4 tinygemm, CPU and CUDA (bf16 compute) -------------------------------------------


def _int4_tinygemm(device: str, op) -> tuple[Check, Run]:
    def check(x, w):
        return _common(x, w, device) or ("act_quant is set" if w.spec.act_quant is not None else None)

    def run(x, w, bias):
        # The CPU kernel is vectorized for bf16 only (fp32 input is 25-100x slower, see benchmarks/README.md)
        # and the CUDA one takes bf16 only, so the activation is computed in bf16.
        sz = w._scale_and_zero.to(torch.bfloat16)
        out = op(_flat(x).to(torch.bfloat16), w._qdata, w.spec.block_size[1], sz)
        return _finish(out, x, bias)

    return check, run


register_linear_kernel("aten._weight_int4pack_mm_for_cpu", ("int4_cpu",),
                       *_int4_tinygemm("cpu", torch.ops.aten._weight_int4pack_mm_for_cpu))
register_linear_kernel("aten._weight_int4pack_mm", ("int4_cuda",),
                       *_int4_tinygemm("cuda", torch.ops.aten._weight_int4pack_mm))


# -- kernel: aten int8 x int8 -> int32 (dynamic per-token activation) ----------------------------------


_SYMMETRIC = (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)


def _is_symmetric_int8(aq: ActivationQuant | None) -> bool:
    return (aq is not None and aq.dtype == torch.int8 and aq.mapping_type in _SYMMETRIC
            and aq.zero_point_domain in (ZeroPointDomain.NONE, ZeroPointDomain.INT))


def _act_eps(x: torch.Tensor, aq: ActivationQuant) -> float:
    """choose_qparams_affine's default eps for a float32 scale (whatever x.dtype is), or aq.eps."""
    return torch.finfo(torch.float32).tiny if aq.eps is None else float(aq.eps)


def _int_mm_check(x, w):
    aq = w.spec.act_quant
    if aq is None or aq.dtype != torch.int8:
        return "needs int8 dynamic activation quantization"
    if not _is_symmetric_int8(aq):
        return "needs symmetric activation codes (zero point 0: domain NONE or INT)"
    return _common(x, w, x.device.type) or _per_channel_int8(w.spec)


def _row_range(xf: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of xf [M, K] per row ([M, 1] each) or over the whole tensor ([1, 1] each)."""
    if per_token:
        return xf.amin(1, keepdim=True), xf.amax(1, keepdim=True)
    return xf.amin().view(1, 1), xf.amax().view(1, 1)


def _int8_activation(x2: torch.Tensor, per_token: bool, no_clipping: bool, eps: float):
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
    the primitives' float32 ops in their order: scale = (max - min) / 255, zp = clamp(-128 - round(min /
    scale)), q = clamp(round(x / scale) + zp), out = (q - zp) * scale."""
    xf = x2.float()
    lo, hi = _row_range(xf, per_token)
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = ((hi - lo) / 255.0).clamp(min=eps)
    zp = (-128.0 - torch.round(lo / scale)).clamp(-128, 127)
    q = (torch.round(xf * (1.0 / scale)) + zp).clamp(-128, 127)
    return ((q - zp) * scale).to(x2.dtype)


@torch.library.custom_op("affineq::int8_dynamic_linear", mutates_args=())
def _int8_dynamic_linear(
    x2: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, per_token: bool, no_clipping: bool, eps: float
) -> torch.Tensor:
    """x2 [M, K] float -> int8 activation codes (symmetric, per token or per tensor) @ w_codes [N, K].T with
    torch._int_mm, rescaled by both scales -> [M, N] in x2.dtype.

    One opaque op for the whole linear so torch.compile sees one call per linear: traced, the activation
    quantization and rescale are ~25 aten nodes per linear, and inductor lowering and codegen of those
    (dynamic shapes) cost ~11 s per SmolLM2 layer on 2 cores (>6 min for the 30-layer model). Being opaque
    also keeps _int_mm away from inductor 2.13's own lowering, which passes a one-row input with row stride
    0 to the CPU kernel (garbage sums at M = 1). Eager and compiled run this same code."""
    xq, x_scale = _int8_activation(x2, per_token, no_clipping, eps)
    acc = torch._int_mm(xq, w_codes.t())
    return (acc.float() * x_scale * w_scale.float().reshape(1, -1)).to(x2.dtype)


@_int8_dynamic_linear.register_fake
def _(x2, w_codes, w_scale, per_token, no_clipping, eps):
    return x2.new_empty(x2.shape[0], w_codes.shape[0])


def _int_mm_run(x, w, bias):
    aq = w.spec.act_quant
    out = _int8_dynamic_linear(
        _flat(x), w._qdata, w._scale, aq.granularity == "per_token",
        aq.mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR, _act_eps(x, aq),
    )
    return _finish(out, x, bias)


register_linear_kernel("aten._int_mm", ("plain",), _int_mm_check, _int_mm_run)


# -- kernel: aten int8 weight-only --------------------------------------------------------------------


def _int8pack_check(x, w):
    if w.spec.act_quant is not None:
        return "act_quant is set"
    return _common(x, w, x.device.type) or _per_channel_int8(w.spec)


@torch.library.custom_op("affineq::weight_int8pack_mm", mutates_args=())
def _weight_int8pack_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """aten._weight_int8pack_mm behind an opaque op: inductor's own lowering of it rejects fused inputs."""
    return torch.ops.aten._weight_int8pack_mm(x, w, scale)


@_weight_int8pack_mm.register_fake
def _(x, w, scale):
    return x.new_empty(x.shape[0], w.shape[0])


def _int8pack_run(x, w, bias):
    # On CPU the aten kernel is vectorized for bf16 only; fp32/fp16 inputs are computed in bf16.
    cdt = torch.bfloat16 if x.device.type == "cpu" else x.dtype
    out = _weight_int8pack_mm(_flat(x).to(cdt), w._qdata, w._scale.reshape(-1).to(cdt))
    return _finish(out, x, bias)


register_linear_kernel("aten._weight_int8pack_mm", ("plain",), _int8pack_check, _int8pack_run)


# -- kernel: aten float8 scaled matmul (dynamic float8 activation) --------------------------------------


def _scaled_mm_check(x, w):
    aq = w.spec.act_quant
    if aq is None or not is_float_target(aq.dtype):
        return "needs float8 dynamic activation quantization"
    if not is_float_target(w.spec.target_dtype) or len(w.spec.shape) != 2:
        return "needs a 2-D float8 weight"
    n, k = w.spec.shape
    if w.spec.block_size not in ((n, k), (1, k)):
        return f"needs per-tensor or per-row weight scales, got block_size {w.spec.block_size}"
    if (w.spec.block_size == (1, k)) != (aq.granularity == "per_token"):
        return "needs per-row weight scales with per-token activations, or per-tensor with per-tensor"
    if k % 16 or n % 16:
        return f"_scaled_mm needs K and N divisible by 16 (got K={k}, N={n})"
    return _common(x, w, x.device.type)


def _scaled_mm_run(x, w, bias):
    x2 = _flat(x)
    xq, x_scale, _, _ = quantize_activation(x2, w.spec.act_quant)
    n = w.spec.shape[0]
    w_scale = w._scale.float().reshape(1, -1)
    per_row = w_scale.numel() == n
    out = torch._scaled_mm(
        xq, w._qdata.t(),
        scale_a=x_scale.float().reshape(-1, 1) if per_row else x_scale.float().reshape(()),
        scale_b=w_scale if per_row else w_scale.reshape(()),
        out_dtype=torch.bfloat16 if x.dtype == torch.float16 else x.dtype,
    )
    return _finish(out, x, bias)


register_linear_kernel("aten._scaled_mm", ("plain",), _scaled_mm_check, _scaled_mm_run)
