"""Grouped linear for mixture-of-experts weights: each row of x times the weight of the expert it was routed to.

``grouped_linear(x, expert_ids, weight, bias)``: x [T, K], expert_ids [T] (integers in [0, E), any order; one row
per (token, chosen expert) pair), weight [E, N, K], bias [E, N] or None::

    y[t] = x[t] @ weight[expert_ids[t]].T + bias[expert_ids[t]]        -> [T, N], x.dtype

weight is either

* a 3-D `AffineQuantizedTensor` (spec.shape (E, N, K), blocks along K): in the `dense` format on CPU, one call of
  ``torch.ops.affineq.grouped_lowbit_linear`` (`affineq.cpp.grouped_ops`: rows bucketed by expert, each expert's
  rows through the kernel ``affineq.lowbit_linear`` runs, only the routed experts' bytes read), recorded by
  `record_kernels()` as ``affineq.grouped_lowbit_linear``; any other format, device or input dtype, or without the
  C++ kernels: each routed expert dequantized and multiplied (``dequantize:grouped_linear``, announced once per
  format and reason like every dequantize fallback, an error in strict mode);
* a float tensor [E, N, K]: ``F.linear`` per routed expert.

The weight's activation handling is the 2-D linear's: ``act_pre_scale`` and activation quantization applied to x
first (row-local ones only: per-token, per-block (MX) or static; a dynamic per-tensor scale would mix the rows of
different experts), static output quantization on y. The quantized experts are frozen; an input that requires
grad gets grad_x[t] = grad_y[t] @ dequantize(W[e_t]) (LoRA-style training on top of quantized experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from affineq import cpp as _cpp
from affineq.cpp import grouped_ops
from affineq.granularity import PerTensor
from affineq.tensor import fallback
from affineq.tensor.activation import (
    computes_in_other_dtype,
    fake_quantize_activation,
    finish_output,
    prepare_input,
)
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.dispatch import check_frozen, guard_frozen_output
from affineq.tensor.formats import dense_code_offset
from affineq.tensor.spec import QuantSpec, as_key, from_key

__all__ = ["GROUPED_KERNEL", "grouped_linear", "grouped_weight_args"]

#: The name `record_kernels()` lists when the C++ grouped kernel ran.
GROUPED_KERNEL = "affineq.grouped_lowbit_linear"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def grouped_weight_args(w: AffineQuantizedTensor) -> tuple:
    """(packed [E, N, Kp], scale [E, N, G], offset [E, N, G] or None, bits, group_size, codes, code_offset) of a
    3-D `dense` weight, as ``torch.ops.affineq.grouped_lowbit_linear`` takes them (`lowbit_weight_args` with a
    leading expert dim)."""
    spec = w.spec
    offset = getattr(w, "_offset", None)
    return (w._qdata, w._scale, offset, spec.target.bits, spec.block_size[-1], _cpp.codes_kind(spec.target),
            dense_code_offset(spec, offset is not None))


def _check_inputs(x: torch.Tensor, expert_ids: torch.Tensor, shape: tuple[int, ...], bias: torch.Tensor | None):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"grouped_linear: x must be a float tensor [T, K], got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}; flatten the tokens first")
    if len(shape) != 3:
        raise ValueError(f"grouped_linear: weight must be 3-D [E, N, K] (one [N, K] matrix per expert), got shape "
                         f"{tuple(shape)}")
    e, n, k = shape
    if x.shape[1] != k:
        raise ValueError(f"grouped_linear: x has {x.shape[1]} columns but the experts' in_features is {k}; pass x "
                         f"of shape [T, {k}]")
    if (not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 1 or expert_ids.dtype.is_floating_point
            or expert_ids.dtype == torch.bool or expert_ids.shape[0] != x.shape[0]):
        raise ValueError(f"grouped_linear: expert_ids must be an integer tensor [T] = [{x.shape[0]}] (the expert of "
                         f"each row of x), got {getattr(expert_ids, 'dtype', type(expert_ids))} "
                         f"{tuple(getattr(expert_ids, 'shape', ()))}")
    if expert_ids.device != x.device:
        raise ValueError(f"grouped_linear: expert_ids is on {expert_ids.device} but x on {x.device}; move them to "
                         "one device")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (e, n)):
        raise ValueError(f"grouped_linear: bias must be [E, N] = [{e}, {n}] (one bias row per expert) or None, got "
                         f"{tuple(getattr(bias, 'shape', ()))}")


def _check_ids_range(expert_ids: torch.Tensor, num_experts: int) -> None:
    """ValueError unless every id is in [0, num_experts). Reads the data, so only the paths without the C++
    kernel call it, in eager mode: the kernel checks the ids itself while sorting them (ValueError too)."""
    if not torch.compiler.is_compiling() and expert_ids.numel():
        lo, hi = torch.aminmax(expert_ids)
        if int(lo) < 0 or int(hi) >= num_experts:
            raise ValueError(f"grouped_linear: expert_ids must be in [0, {num_experts}) (E = {num_experts} experts), "
                             f"got values in [{int(lo)}, {int(hi)}]")


def grouped_linear(x: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = x[t] @ weight[expert_ids[t]].T (+ bias[expert_ids[t]]): x [T, K], expert_ids [T], weight [E, N, K]
    (a 3-D AffineQuantizedTensor or a float tensor), bias [E, N] -> [T, N] in x.dtype. See the module docstring
    for which kernel runs."""
    if isinstance(weight, AffineQuantizedTensor):
        shape = _logical_shape(weight.spec)
    elif isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
        shape = tuple(weight.shape)
    else:
        raise TypeError(f"grouped_linear: weight must be a 3-D AffineQuantizedTensor or a float tensor [E, N, K], got "
                        f"{type(weight).__name__} {getattr(weight, 'dtype', '')}")
    _check_inputs(x, expert_ids, shape, bias)
    ids = expert_ids if expert_ids.dtype == torch.int64 else expert_ids.long()
    if isinstance(weight, AffineQuantizedTensor):
        out = guard_frozen_output(_quantized(x, ids, weight), weight)
    elif torch.compiler.is_compiling():  # the loop's row counts are data: one opaque node in a graph
        out = _grouped_float_linear(x, ids, weight)
    else:  # eager: plain F.linear calls, so float experts that require grad get their gradients
        _check_ids_range(ids, shape[0])
        out = _per_expert(x, ids, shape[0], lambda e: weight[e].to(x.dtype))
    return out if bias is None else out + bias.index_select(0, ids).to(out.dtype)


def _logical_shape(spec: QuantSpec) -> tuple[int, ...]:
    """[E, N, K] as the caller sees a weight of `spec`: the stored shape, its last two dims swapped for a
    transposed view."""
    shape = tuple(spec.shape)
    return (*shape[:-2], shape[-1], shape[-2]) if spec.transposed else shape


def _grouped_check(x: torch.Tensor, w: AffineQuantizedTensor) -> str | None:
    """None when the C++ grouped kernel reads (x, w), else the reason it cannot."""
    spec = w.spec
    if spec.fmt != "dense":
        return f"the grouped kernel reads the 'dense' format, not {spec.fmt!r}"
    if spec.transposed:
        return "the weight is a transposed view; the kernel reads the stored [E, N, K] layout"
    if x.device.type != "cpu":
        return f"input is on {x.device.type}, the grouped kernel runs on cpu"
    if x.dtype not in _FLOATS:
        return f"input dtype {x.dtype} is not fp32/bf16/fp16"
    if any(b != 1 for b in spec.block_size[:-1]):
        return f"needs blocks along K only (block_size (1, 1, group_size)), got {spec.block_size}"
    if not _cpp.is_available():
        return f"the affineq C++ kernels are unavailable ({_cpp.unavailable_reason()})"
    return None


def _quantized(x: torch.Tensor, ids: torch.Tensor, w: AffineQuantizedTensor) -> torch.Tensor:
    check_frozen(w)
    if computes_in_other_dtype(x, w):  # as kernel_registry.linear: float32 x rounded to bf16 once
        return _quantized(x.to(w.spec.compute_dtype), ids, w).to(x.dtype)
    aq = w.spec.act_quant
    if aq is not None and not aq.static and isinstance(aq.granularity, PerTensor):
        raise ValueError("grouped_linear: a dynamic per-tensor activation scale would be shared by the rows of "
                         "different experts; quantize the experts with per-token (or static) activation quantization")
    x = prepare_input(x, w)
    if aq is not None:
        x = fake_quantize_activation(x, aq, w)
    why = _grouped_check(x, w)
    e, n, k = _logical_shape(w.spec)
    if why is None:
        if not torch.compiler.is_compiling():  # dynamo cannot read the recorders' ContextVar; eager calls record
            fallback.record(GROUPED_KERNEL)
        packed, scale, offset, bits, group_size, codes, code_offset = grouped_weight_args(w)
        args = (packed, scale, offset, bits, group_size, n, k, codes, code_offset)
        if x.requires_grad and torch.is_grad_enabled():
            return finish_output(_GroupedKernelLinear.apply(x, ids, args), w)
        return finish_output(torch.ops.affineq.grouped_lowbit_linear(x, ids, *args), w)
    fallback.announce_fallback(w.spec.fmt, why, op="grouped_linear")  # traced: strict mode raises, nothing else
    if torch.compiler.is_compiling():  # the routed experts are data: one opaque op (_grouped_dequantized_op)
        names = ",".join(w.tensors)
        out = torch.ops.affineq.grouped_dequantized_linear(x, ids, list(w.tensors.values()), names,
                                                           as_key(w.spec))
    else:
        out = _grouped_dequantized(x, ids, w)
    return finish_output(out, w)


def _grouped_dequantized(x: torch.Tensor, ids: torch.Tensor, w: AffineQuantizedTensor) -> torch.Tensor:
    """The fallback of `_quantized`: only the routed experts dequantized and multiplied."""
    e, n, k = _logical_shape(w.spec)
    if w.spec.fmt == "dense" and x.device.type == "cpu" and x.dtype in _FLOATS and not w.spec.transposed:
        # the numerics of the kernel's reference
        packed, scale, offset, bits, group_size, codes, code_offset = grouped_weight_args(w)
        return grouped_ops.grouped_lowbit_linear_reference(x, ids, packed, scale, offset, bits, group_size, n, k,
                                                           codes, code_offset)
    _check_ids_range(ids, e)
    return _per_expert(x, ids, e, lambda i: w[i].dequantize(x.dtype))  # a routed expert's slice alone


# Traced, the fallback reads which experts were routed (data): dynamo cannot trace that into one graph (fullgraph
# failed on a data-dependent size), so the whole fallback is one opaque op on the weight's stored tensors and its
# spec (`as_key`), rebuilt into the weight inside.
@torch.library.custom_op("affineq::grouped_dequantized_linear", mutates_args=())
def _grouped_dequantized_op(x: torch.Tensor, expert_ids: torch.Tensor, tensors: list[torch.Tensor], names: str,
                            spec: str) -> torch.Tensor:
    w = AffineQuantizedTensor(dict(zip(names.split(","), tensors, strict=True)), from_key(QuantSpec, spec))
    return _grouped_dequantized(x, expert_ids, w)


@_grouped_dequantized_op.register_fake
def _(x, expert_ids, tensors, names, spec):
    return x.new_empty((x.shape[0], _logical_shape(from_key(QuantSpec, spec))[1]))


class _GroupedKernelLinear(torch.autograd.Function):
    """The grouped kernel forward with the input gradient grad_x[t] = grad_y[t] @ dequantize(W[e_t]) (W is frozen:
    only the routed experts are dequantized, by ``affineq::lowbit_dequantize``)."""

    @staticmethod
    def forward(ctx, x, ids, args):
        ctx.save_for_backward(ids)
        ctx.args, ctx.x_dtype = args, x.dtype
        return torch.ops.affineq.grouped_lowbit_linear(x, ids, *args)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        packed, scale, offset, bits, group_size, n, k, codes, code_offset = ctx.args
        gx = grad.new_zeros((grad.shape[0], k), dtype=torch.float32)
        for e in torch.unique(ids).tolist():
            rows = (ids == e).nonzero().squeeze(1)
            w = torch.ops.affineq.lowbit_dequantize(packed[e], scale[e], None if offset is None else offset[e], bits,
                                                    group_size, n, k, codes, code_offset)
            gx[rows] = grad[rows].float() @ w
        return gx.to(ctx.x_dtype), None, None


def _per_expert(x: torch.Tensor, ids: torch.Tensor, num_experts: int, weight_of) -> torch.Tensor:
    """F.linear of each routed expert's rows (weight_of(e) -> [N, K] in x.dtype); other experts untouched."""
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_experts).tolist()
    out = None
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = order[start:start + c]
        start += c
        y = F.linear(x.index_select(0, rows), weight_of(e))
        if out is None:
            out = x.new_empty((x.shape[0], y.shape[1]), dtype=y.dtype)
        out.index_copy_(0, rows, y)
    if out is None:  # no rows
        n = weight_of(0).shape[0]
        out = x.new_empty((0, n))
    return out


@torch.library.custom_op("affineq::grouped_float_linear", mutates_args=())
def _grouped_float_linear(x: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K], expert_ids [T] int64, float weight [E, N, K] -> [T, N]: `_per_expert` with F.linear."""
    return _per_expert(x, expert_ids, weight.shape[0], lambda e: weight[e].to(x.dtype))


@_grouped_float_linear.register_fake
def _(x, expert_ids, weight):
    return x.new_empty((x.shape[0], weight.shape[1]))
