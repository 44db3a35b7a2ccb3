"""The linear-kernel registry and the rules that decide which kernel runs, and which format "auto" stores.

Each kernel is one entry (`affineq.tensor.linear_kernels`): the formats it reads, a precondition that returns
None or the reason it cannot run, and an implementation. `linear` applies the weight's activation tensors
(`activation.prepare_input`), then `select_linear_kernel` returns the first entry whose precondition holds;
when none does, `dequantize_linear` runs and `fallback.announce_fallback` says so once per (format, reason).

A config's `packing_format="auto"` is resolved here too (`choose_format`: the first format the spec fits that
an available kernel reads), from the same facts the kernels' preconditions test (device, whether our C++
kernels built, whether aten's int8 matmul is fast here), so the stored format is the one the fastest
available kernel reads. Nothing else in affineq decides either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from affineq import compile_cache
from affineq import cpp as _cpp
from affineq.tensor import fallback
from affineq.tensor.activation import (
    fake_quantize_activation,
    finish_output,
    fused_int8_mode,
    prepare_input,
    reduce_input_ranges,
    rounding_kernel_may_quantize,
    spec_computes_in_other_dtype,
)
from affineq.tensor.dispatch import check_frozen, guard_frozen_output

Check = Callable[[torch.Tensor, "torch.Tensor"], str | None]
Run = Callable[[torch.Tensor, "torch.Tensor", torch.Tensor | None], torch.Tensor]
Bind = Callable[[Any, torch.dtype], Run]


@dataclass(frozen=True)
class LinearKernel:
    name: str
    formats: tuple[str, ...]
    check: Check
    run: Run
    #: run also takes float32 x for a weight with a `compute_dtype` and returns, in float32, exactly its result
    #: for x.to(compute_dtype) (reading x rounded and writing y widened itself: no copies of x and y around it)
    rounds_input: bool = False
    #: bind(spec, dtype): `run` for weights of `spec` and inputs of `dtype`, with what it derives from those two
    #: computed once (eager F.linear pays it per selection, not per call); None: `run` itself
    bind: Bind | None = None

    def runner(self, spec, dtype: torch.dtype) -> Run:
        """`run`, or `bind(spec, dtype)`: the same results."""
        return self.run if self.bind is None else self.bind(spec, dtype)


LINEAR_KERNELS: list[LinearKernel] = []


def register_linear_kernel(name: str, formats: tuple[str, ...], check: Check, run: Run,
                           rounds_input: bool = False, bind: Bind | None = None) -> None:
    """Append a kernel; earlier registrations win when several preconditions hold. `check(x, w)` returns None or
    the reason it cannot run; `run(x, w, bias)` computes F.linear; `rounds_input`: see `LinearKernel`;
    `bind(spec, dtype)`, optional, returns a `run` for weights of `spec` and inputs of `dtype` (what it derives
    from them computed once: eager calls cache it with the kernel choice)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_linear_kernel: name must be a non-empty str, got {name!r}")
    if isinstance(formats, str) or not isinstance(formats, (tuple, list)) or not formats \
            or not all(isinstance(f, str) for f in formats):
        raise TypeError(f"register_linear_kernel({name!r}): formats must be a tuple of packing format names, e.g. "
                        f"('dense',), got {formats!r}")
    for arg, fn in (("check", check), ("run", run), ("bind", run if bind is None else bind)):
        if not callable(fn):
            raise TypeError(f"register_linear_kernel({name!r}): {arg} must be callable, got {fn!r}")
    if any(k.name == name for k in LINEAR_KERNELS):
        raise ValueError(f"a linear kernel named {name!r} is already registered")
    LINEAR_KERNELS.append(LinearKernel(name, tuple(formats), check, run, rounds_input, bind))
    _selected.clear()


# (id(spec), device type, dtype chosen for, input dtype, C++ kernels available, rows bucket) -> (spec, kernel,
# reasons, run). The preconditions read only these (M only against power-of-two thresholds,
# `compute_bound.MIN_ROWS`), so eager F.linear pays the selection, and the kernel's `bind`, once per weight and
# bucket of M, not per call.
# Keyed by identity (hashing a spec costs as much as selecting); the entry holds the spec, so its id stays unique.
_selected: dict[tuple, tuple] = {}


def _select_cached(x: torch.Tensor, w, dtype: torch.dtype | None = None) -> tuple[LinearKernel | None, list[str],
                                                                                  Run | None]:
    """(kernel, reasons) of select_linear_kernel(x, w), cached, and the kernel's runner for w.spec and x's dtype;
    dtype: the choice for x.to(dtype) (without converting x: the `rounds_input` kernels take x as it is)."""
    x_dtype = x.dtype
    if torch.compiler.is_compiling():  # traced once anyway; keep dynamo away from the dict
        compile_cache.refresh_while_tracing()  # the graph's cache key reads the state this choice reads
        return _select(x, w, x_dtype if dtype is None else dtype)
    spec = w.spec
    # `x.is_cpu` first: x.device builds a torch.device per call (this runs on every eager linear call)
    key = (id(spec), "cpu" if x.is_cpu else x.device.type, dtype, x_dtype, _cpp.is_available(), rows_bucket(x))
    hit = _selected.get(key)
    if hit is None or hit[0] is not spec:
        if len(_selected) > 4096:
            _selected.clear()
        hit = _selected[key] = (spec, *_select(x, w, x_dtype if dtype is None else dtype))
    return hit[1], hit[2], hit[3]


def _select(x: torch.Tensor, w, dtype: torch.dtype) -> tuple[LinearKernel | None, list[str], Run | None]:
    probe = x if dtype == x.dtype else x.new_empty(x.shape, dtype=dtype)  # the checks read only dtype and shape
    kernel, reasons = select_linear_kernel(probe, w)
    return kernel, reasons, None if kernel is None else kernel.runner(w.spec, x.dtype)


def clear_selection_cache() -> None:
    """Forget the cached kernel choices (after a precondition's inputs changed, e.g. a row threshold)."""
    _selected.clear()


def rows_bucket(x: torch.Tensor) -> int:
    """The power-of-two bucket of x's row count M (floor(log2(M)) + 1, 0 for M = 0): every M of one bucket
    passes or fails the same power-of-two row threshold."""
    shape = x.shape
    cols = shape[-1] if shape else 1
    return (x.numel() // cols if cols else 0).bit_length()


def select_linear_kernel(x: torch.Tensor, w) -> tuple[LinearKernel | None, list[str]]:
    """The first kernel whose precondition holds for F.linear(x, w), and the reasons the others gave."""
    if not isinstance(x, torch.Tensor) or not hasattr(w, "spec"):
        raise TypeError(f"select_linear_kernel(x, w): x must be a tensor and w an AffineQuantizedTensor, got "
                        f"{type(x).__name__} and {type(w).__name__}")
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
    """F.linear(x, w, bias) for an AffineQuantizedTensor weight w [N, K]: a packed kernel or the fallback.
    A weight with requires_grad=True runs too; a backward that needs its gradient raises (`check_frozen`)."""
    return guard_frozen_output(_linear(x, w, bias), w)


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    check_frozen(w)
    spec = w.spec
    shape = spec.logical_shape  # not w.shape: a property read on the subclass re-enters __torch_function__
    x_shape, dtype = x.shape, x.dtype
    if not x_shape or x_shape[-1] != shape[-1]:
        raise RuntimeError(
            f"linear: input of shape {tuple(x.shape)} cannot be multiplied by the quantized weight of shape "
            f"{shape}: the input's last dim must be in_features={shape[-1]}; pass an input of shape "
            f"[..., {shape[-1]}]"
        )
    if bias is not None and len(shape) == 2 and bias.shape != shape[:1]:
        raise RuntimeError(f"linear: bias of shape {tuple(bias.shape)} does not fit the quantized weight of shape "
                           f"{shape}: pass a bias of shape ({shape[0]},) (out_features) or None")
    if not dtype.is_floating_point:  # dequantizing to an integer dtype would truncate every weight to 0 / +-1
        raise TypeError(f"linear: the input of a quantized weight must be floating point, got {dtype}; pass "
                        f"x.float() (or x.bfloat16() / x.half())")
    if spec_computes_in_other_dtype(spec, dtype):  # float32 x, bf16 compute: x rounded once, the bf16 result widened
        kernel, run = _rounding_kernel(x, w)
        if kernel is not None:  # it rounds x and widens y itself
            fallback.record(kernel.name)
            return run(x, w, bias)
        out = _linear(x.to(w.spec.compute_dtype), w, None).to(x.dtype)
        return out if bias is None else out + bias
    x, w = reduce_input_ranges(prepare_input(x, w), w)
    if w.spec.transposed:
        kernel, reasons, run = None, ["the weight is a transposed view; kernels read the stored [N, K] layout"], None
    else:
        kernel, reasons, run = _select_cached(x, w)
    if kernel is not None:
        fallback.record(kernel.name)
        if x.requires_grad and torch.is_grad_enabled():
            out = _KernelLinear.apply(x, w, kernel.name)
            return finish_output(out if bias is None else out + bias, w)
        return finish_output(run(x, w, bias), w)
    fallback.announce_fallback(w.spec.fmt, "; ".join(reasons))
    return finish_output(dequantize_linear(x, w, bias), w)


def _rounding_kernel(x: torch.Tensor, w) -> tuple[LinearKernel | None, Run | None]:
    """The kernel x.to(w.spec.compute_dtype) selects, where it takes the float32 x itself (`rounds_input`) and
    nothing else touches x or y in the compute dtype: no activation tensors, no activation quantization but the
    kernel's own (`rounding_kernel_may_quantize`), no autograd, not traced (a graph fuses the casts into its
    neighbours)."""
    if (torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()) or w.spec.transposed
            or "act_pre_scale" in w._names or "act_out_scale" in w._names or not rounding_kernel_may_quantize(w)):
        return None, None
    kernel, _, run = _select_cached(x, w, w.spec.compute_dtype)
    return (kernel, run) if kernel is not None and kernel.rounds_input else (None, None)


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
    """Reference numerics: fake-quantize the activation (if any), dequantize the weight, F.linear. `x` has
    the activation tensors applied already (`prepare_input`)."""
    if w.spec.act_quant is not None:
        x = fake_quantize_activation(x, w.spec.act_quant, w)
    return F.linear(x, w.dequantize(x.dtype), bias)


# -- "auto" packing formats ----------------------------------------------------------------------------


def int_mm_is_fast() -> bool:
    """Whether aten's int8 x int8 -> int32 matmul runs on oneDNN here. Without VNNI (an AVX2-only CPU) it
    runs scalar loops, many times slower than fp32 `F.linear` (benchmarks/README.md)."""
    has_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and (has_vnni is None or has_vnni()))


def int8_codes_preferred(shape) -> bool:
    """Whether a dynamic-int8 x int8 weight of `shape` [N, K] runs faster on our C++ `int8_codes_linear` (the
    `dense` format) than on aten's `_int_mm` / oneDNN (`plain`): on an AVX-512 CPU where the kernel is built
    (VNNI, VBMI; on AMX CPUs its AMX int8 tiles), for the shapes it takes (N % 16 == 0, K % 8 == 0;
    benchmarks/README.md)."""
    return (len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 8 == 0 and _cpp.is_available()
            and _cpp.int8_codes_built())


def auto_format(scheme: str, weight: torch.Tensor, module_is_linear: bool = True) -> str:
    """The packing format of the named `scheme` (the rules "auto" followed before `choose_format` read them
    from the spec; kept for code written against it, and as the reference tests/test_auto_format.py checks
    `choose_format` against).

    scheme: "int4" (our C++ kernel's `dense` on CPU when it builds, else aten's `int4_cpu`; `int4_cuda` on
    CUDA), "subbyte" (1-7 bit codes, which no aten kernel reads: `dense`, the compact layout, also when our
    kernels are unavailable), "byte" (int8 / float8 weight-only: `dense` when our kernels build, else `plain`
    for aten's kernels), "int8_dynamic" (`plain` for aten's `_int_mm`, except on a CPU where `_int_mm` is
    slow: `dense`, our kernel on the fake-quantized activation, or where our int8-codes kernel is faster:
    `int8_codes_preferred`), "float_codes" (fp4 / fp6 codes, and any
    weight with e8m0 scales (MXFP4/6/8, MXINT8): `dense`, which our kernel reads and which is the compact
    layout (4.25 bits per MXFP4 element) also when our kernels are unavailable). A weight that is not a 2-D
    nn.Linear weight on CPU gets `plain` (int4 on CUDA: `int4_cuda`)."""
    cpu2d = weight.device.type == "cpu" and weight.dim() == 2 and module_is_linear
    if scheme == "int4":
        if weight.device.type == "cuda" and weight.dim() == 2:
            return "int4_cuda"
        return ("dense" if _cpp.is_available() else "int4_cpu") if cpu2d else "plain"
    if scheme in ("subbyte", "float_codes"):
        return "dense" if cpu2d else "plain"
    if scheme == "byte":
        return "dense" if cpu2d and _cpp.is_available() else "plain"
    if scheme == "int8_dynamic":
        fast_dense = not int_mm_is_fast() or int8_codes_preferred(weight.shape)
        return "dense" if cpu2d and _cpp.is_available() and fast_dense else "plain"
    raise ValueError(f"unknown auto-format scheme {scheme!r}")


def _format_preference(spec, device: torch.device, module_is_linear: bool) -> tuple[str, ...]:
    """The formats whose kernels are fastest here for `spec`, fastest first: on CUDA aten's int4 kernel, on a
    CPU (a 2-D nn.Linear weight) our C++ kernels' `dense`, then aten's `int4_cpu`, then `plain` (aten's int8 /
    float8 matmuls), except int8 x int8 where aten's `_int_mm` is fast here (oneDNN with VNNI): `plain` first,
    unless our int8-codes kernel is faster still (dynamic int8 activations, `int8_codes_preferred`). Anything
    else: `plain`."""
    if device.type == "cuda":
        return ("int4_cuda", "plain") if len(spec.shape) == 2 else ("plain",)
    if device.type != "cpu" or len(spec.shape) != 2 or not module_is_linear:
        return ("plain",)
    aq = spec.act_quant
    if aq is not None and aq.dtype.name == "int8" and spec.target.name == "int8" and int_mm_is_fast():
        dynamic = not aq.static and fused_int8_mode(aq) is not None  # what int8_codes_linear reads
        return ("dense", "plain") if dynamic and int8_codes_preferred(spec.shape) else ("plain", "dense")
    return ("dense", "int4_cpu", "plain")


#: Formats whose layout needs particular qparam dtypes (aten's int4 kernels read bfloat16 scales).
_FORMAT_SCALE_DTYPE = {"int4_cpu": torch.bfloat16, "int4_cuda": torch.bfloat16}


def _format_fits(fmt: str, spec, scale_dtype: torch.dtype | None) -> bool:
    from affineq.tensor.formats import FORMATS

    if fmt not in FORMATS or _FORMAT_SCALE_DTYPE.get(fmt, scale_dtype) != scale_dtype:
        return False
    return FORMATS[fmt].check(spec.replace(fmt=fmt)) is None


def _kernel_reads(fmt: str, spec, device: torch.device) -> bool:
    """Whether a registered kernel that runs here reads `fmt` for `spec` (from the facts the kernels'
    preconditions test: device, our C++ kernels built, aten's kernels take 8-bit codes with float scales)."""
    if not any(fmt in k.formats for k in LINEAR_KERNELS):
        return False
    if fmt == "dense":
        return device.type == "cpu" and _cpp.is_available()
    if fmt in ("int4_cpu", "int4_cuda"):
        return device.type == fmt.removeprefix("int4_")
    return spec.target.bits == 8 and spec.scale_type is None  # plain: aten's int8 / float8 matmuls


def choose_format(spec, device: torch.device | str = "cpu", module_is_linear: bool = True,
                  scale_dtype: torch.dtype | None = None) -> str:
    """The packing format "auto" stores for a weight of `spec` on `device`: the first format, in the order of
    `_format_preference`, that the spec fits (the format's `check`, and aten's int4 layouts only with
    `scale_dtype` bfloat16) and a kernel available here reads; when no available kernel reads any that fits,
    the first that fits (`dense` is the compact layout of sub-byte codes), else `plain`."""
    device = torch.device(device)
    fits = [f for f in _format_preference(spec, device, module_is_linear) if _format_fits(f, spec, scale_dtype)]
    if not fits:
        return "plain"
    return next((f for f in fits if _kernel_reads(f, spec, device)), fits[0])
