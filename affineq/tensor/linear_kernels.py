"""The linear kernels: one registered entry each (formats read, precondition, implementation).

| kernel                            | format    | weight / activation                                          |
|-----------------------------------|-----------|--------------------------------------------------------------|
| affineq.int8_codes_linear (C++)   | dense     | 8-bit (any M) / 4-bit (M >= a threshold) integer weight x     |
|                                   |           | dynamic int8 activation (VNNI, exact int32 sums)             |
| affineq.dequant_linear (C++)      | dense     | M >= a per-CPU threshold: cached W blocks x torch's GEMM     |
| affineq.lowbit_linear (our C++)   | dense     | 1-8 bit, fp8/fp6/fp4 (e8m0 too); int8 activations fake-quant |
| affineq.kquant_linear (our C++)   | q2_k-q6_k | llama.cpp k-quant super-blocks read as stored, weight-only   |
| aten._weight_int4pack_mm_for_cpu  | int4_cpu  | int4 tinygemm, weight-only                                   |
| aten._weight_int4pack_mm          | int4_cuda | int4 tinygemm, weight-only                                   |
| onednn.qlinear                    | plain     | W8A8 at M >= a per-CPU threshold, VNNI / AMX: prepacked int8 |
| aten._int_mm                      | plain     | per-channel int8 weight x dynamic symmetric int8 activation  |
| onednn.qlinear:static             | plain     | the same with calibrated (static) int8 activation qparams    |
| aten._int_mm:static               | plain     | per-channel int8 weight x calibrated (static) int8 activation|
| aten._weight_int8pack_mm          | plain     | per-channel int8 weight-only                                 |
| aten._scaled_mm                   | plain     | float8 weight x dynamic float8 activation                    |

Registration order is preference order (`kernel_registry.select_linear_kernel`). A kernel runs after the
weight's activation tensors were applied to x (`activation.prepare_input`).
"""

from __future__ import annotations

import torch

from affineq import cpp as _cpp
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.activation import (
    act_eps,
    computes_in_other_dtype,
    fake_quantize_activation,
    fused_int8_mode,
    int8_activation,
    is_symmetric_int8,
    kernel_output,
    quantize_float_activation,
    spec_computes_in_other_dtype,
    static_qparams,
)
from affineq.tensor.compute_bound import (
    dequant_linear_check,
    dequant_linear_run,
    min_rows,
    qlinear_check,
    qlinear_run,
    qlinear_static_check,
    qlinear_static_run,
    rows_below,
)
from affineq.tensor.formats import dense_code_offset
from affineq.tensor.kernel_registry import Check, Run, register_linear_kernel
from affineq.tensor.kquant_kernel import kquant_linear_check, kquant_linear_run
from affineq.tensor.spec import QuantSpec

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
    if spec.target.name != "int8" or len(spec.shape) != 2:
        return f"needs a 2-D int8 weight (got {spec.target}, {len(spec.shape)}-D)"
    if spec.block_size != (1, spec.shape[1]):
        return f"needs per-channel scales, block_size (1, K); got {spec.block_size}"
    if not _is_zero_point_free(spec):
        return "needs symmetric codes (zero point 0)"
    if spec.scale_type is not None:
        return f"reads float scales, not {spec.scale_type} bytes"
    return None


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# -- kernel: affineq::lowbit_linear (our C++), dense format, any width 1-8 -----------------------------


def _lowbit_check(x, w):
    why = _common(x, w)
    if why is None and not _cpp.is_available():
        why = f"the affineq C++ kernels are unavailable ({_cpp.unavailable_reason()})"
    # Any activation quantization runs: `_lowbit_run` fake-quantizes x first (float8 / MX activations too), the
    # reference numerics, and the weight product stays exact.
    return why


def lowbit_weight_args(w) -> tuple:
    """(packed, scale, offset, bits, group_size, codes, code_offset) of a `dense` weight, as the affineq C++
    ops take them (e8m0 scales: exponent bytes, no offset tensor, see formats.Dense)."""
    offset = getattr(w, "_offset", None)
    return (w._qdata, w._scale, offset, *_lowbit_spec_args(w.spec, offset is not None))


def _lowbit_spec_args(spec: QuantSpec, has_offset: bool) -> tuple[int, int, int, int]:
    """(bits, group_size, codes, code_offset) of `lowbit_weight_args`: what the spec decides."""
    return (spec.target.bits, spec.block_size[1], _cpp.codes_kind(spec.target),
            dense_code_offset(spec, has_offset))


# -- kernel: affineq::int8_codes_linear (our C++), dense 8-bit weight x dynamic int8 activation ----------------

_INT8_CODES_QP = (torch.float32, torch.bfloat16, torch.float16)
INT8_CODES_INT4 = "affineq.int8_codes_linear:int4"  # its row threshold (`compute_bound.MIN_ROWS`)
LOWBIT_INT8_ACT = "affineq.lowbit_linear:int8_act"  # where lowbit_linear's AMX tiles take over from it


def int8_codes_check(x, w):
    """The int8 codes of x times the 8- or 4-bit weight codes (4-bit: from `MIN_ROWS` rows, the fused GEMV on the
    fake-quantized x below them, inside the op; and below `LOWBIT_INT8_ACT`'s rows where the CPU has that
    threshold), summed exactly in int32 (VNNI), where the build has it;
    the same values as `affineq.lowbit_linear` on the fake-quantized x, whose fp32 sums it replaces. bf16 x: its
    codes and scale are computed in fp32 either way (`activation.int8_activation`): the op widens each row as it
    quantizes it, the products use the codes themselves, as `aten._int_mm`'s route does (not the bf16-rounded
    code * scale), and y is rounded to bf16 once, as it is stored."""
    spec = w.spec
    mode = None if spec.act_quant is None else fused_int8_mode(spec.act_quant)
    n, k = spec.shape
    group_size = spec.block_size[1]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return "needs a float32 or bfloat16 CPU input"
    if mode is None:
        return "needs a dynamic int8 activation quantization"
    bits = spec.target.bits
    if bits not in (8, 4) or _cpp.codes_kind(spec.target) != _cpp.CODES_UINT or w._scale.dtype not in _INT8_CODES_QP:
        return "needs 8- or 4-bit integer codes with float32 / bfloat16 / float16 qparams"
    least = min_rows(INT8_CODES_INT4, x.dtype) if bits == 4 else 0
    if least is None:
        return f"not used for 4-bit weights with {x.dtype} input on this CPU ({INT8_CODES_INT4} in MIN_ROWS)"
    if least > 1 and rows_below(x, least):  # a symbolic M: the op, which compares M itself
        return (f"fewer than {least} rows: affineq.lowbit_linear runs them itself (the values the op computes there, "
                "without its wrapper)")
    tiles_from = min_rows(LOWBIT_INT8_ACT, x.dtype) if bits == 4 else None
    if tiles_from is not None and not rows_below(x, tiles_from):  # a symbolic M: the tiles, as before
        return f"affineq.lowbit_linear's AMX tiles run 4-bit weights with {x.dtype} input from {tiles_from} rows"
    if n % 16 or group_size % 8:
        return f"needs out_features % 16 == 0 and group_size % 8 == 0 (got {n}, {group_size})"
    if not _cpp.int8_codes_built():
        return "this build has no int8-codes kernel (needs AVX512-VNNI and VBMI)"
    return None


def _int8_codes_run(x, w, bias):
    aq = w.spec.act_quant
    n, k = w.spec.shape
    packed, scale, offset, bits, group_size, _, code_offset = lowbit_weight_args(w)
    rounded = computes_in_other_dtype(x, w)  # float32 x computing in bf16: the op rounds x and widens y itself
    dtype = w.spec.compute_dtype if rounded else x.dtype
    least = min_rows(INT8_CODES_INT4, dtype) if bits == 4 else 0  # below it the op runs the fused GEMV
    args = (_flat(x), packed, scale, offset, group_size, n, k, aq.per_token, fused_int8_mode(aq), act_eps(x, aq),
            bits, code_offset, least)
    if bias is not None and bias.dtype == x.dtype and not (bias.requires_grad and torch.is_grad_enabled()):
        # added as y is stored (the values of the add after the op), not in a pass of its own
        return kernel_output(torch.ops.affineq.int8_codes_linear_biased(*args, rounded, bias), x, None)
    op = torch.ops.affineq.int8_codes_linear_bf16_compute if rounded else torch.ops.affineq.int8_codes_linear
    return kernel_output(op(*args), x, bias)


register_linear_kernel("affineq.int8_codes_linear", ("dense",), int8_codes_check, _int8_codes_run,
                       rounds_input=True)
register_linear_kernel("affineq.dequant_linear", ("dense",), dequant_linear_check, dequant_linear_run)


def _lowbit_bind(spec: QuantSpec, dtype: torch.dtype) -> Run:
    """`_lowbit_run` for weights of `spec` and inputs of `dtype`: the op and the arguments the spec fixes, chosen
    once."""
    n, k = spec.shape
    bits, group_size, codes, _ = _lowbit_spec_args(spec, False)
    code_offsets = tuple(_lowbit_spec_args(spec, o)[3] for o in (False, True))  # [whether an offset tensor]
    ops = torch.ops.affineq
    aq = spec.act_quant
    mode = None if aq is None else fused_int8_mode(aq)
    rounded = spec_computes_in_other_dtype(spec, dtype)  # float32 x computing in bf16 (`rounds_input`)
    if mode is not None and (rounded or dtype == torch.bfloat16):
        # 8da4w-style with bf16 x (or float32 x rounded to bf16 by the op): one op quantizes x and multiplies
        # (inside the AMX GEMM's packing where it runs)
        act_op = ops.lowbit_linear_int8_act_bf16_compute if rounded else ops.lowbit_linear_int8_act

        def run_int8_act(x, w, bias):
            offset = getattr(w, "_offset", None)
            out = act_op(x, w._qdata, w._scale, offset, bits, group_size, n, k, codes, code_offsets[offset is not None],
                         aq.per_token, mode, act_eps(x, aq))
            return out if bias is None else out + bias

        return run_int8_act
    # float32 x computing in bf16: the op rounds x and widens y itself (weight-only: `rounding_kernel_may_quantize`)
    op = ops.lowbit_linear_bf16_compute if rounded else ops.lowbit_linear

    def run(x, w, bias):
        if aq is not None:
            # 8da4w-style: the activation is fake-quantized (per token, or with static qparams); the weight
            # product stays exact.
            x = fake_quantize_activation(x, aq, w)
        offset = getattr(w, "_offset", None)
        args = (x, w._qdata, w._scale, offset, bits, group_size, n, k, codes, code_offsets[offset is not None])
        if bias is not None and bias.dtype == x.dtype and not (
                torch.is_grad_enabled() and (x.requires_grad or bias.requires_grad)):
            # added as y is stored (the values of the add after the op), not in a pass of its own
            return ops.lowbit_linear_biased(*args, rounded, bias)
        out = op(*args)
        return out if bias is None else out + bias

    return run


def _lowbit_run(x, w, bias):
    return _lowbit_bind(w.spec, x.dtype)(x, w, bias)


register_linear_kernel("affineq.lowbit_linear", ("dense",), _lowbit_check, _lowbit_run, rounds_input=True,
                       bind=_lowbit_bind)
register_linear_kernel("affineq.kquant_linear", ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"), kquant_linear_check,
                       kquant_linear_run)


# -- kernels: aten int4 tinygemm, CPU and CUDA (bf16 compute) -------------------------------------------


def _int4_tinygemm(device: str, op) -> tuple[Check, Run]:
    def check(x, w):
        return _common(x, w, device) or ("act_quant is set" if w.spec.act_quant is not None else None)

    def run(x, w, bias):
        # The CPU kernel is vectorized for bf16 only (fp32 input is 25-100x slower, see benchmarks/README.md)
        # and the CUDA one takes bf16 only, so the activation is computed in bf16.
        sz = w._scale_and_zero.to(torch.bfloat16)
        out = op(_flat(x).to(torch.bfloat16), w._qdata, w.spec.block_size[1], sz)
        return kernel_output(out, x, bias)

    return check, run


register_linear_kernel("aten._weight_int4pack_mm_for_cpu", ("int4_cpu",),
                       *_int4_tinygemm("cpu", torch.ops.aten._weight_int4pack_mm_for_cpu))
register_linear_kernel("aten._weight_int4pack_mm", ("int4_cuda",),
                       *_int4_tinygemm("cuda", torch.ops.aten._weight_int4pack_mm))


# -- kernel: aten int8 x int8 -> int32 (dynamic per-token activation) ----------------------------------


def _int_mm_check(x, w):
    aq = w.spec.act_quant
    if aq is None or aq.dtype.name != "int8" or aq.static:
        return "needs int8 dynamic activation quantization"
    if not is_symmetric_int8(aq):
        return "needs symmetric activation codes (zero point 0: domain NONE or INT)"
    return _common(x, w, x.device.type) or _per_channel_int8(w.spec) or _int_mm_shape(x, w)


def _int_mm_shape(x, w) -> str | None:
    """CUDA's torch._int_mm takes K and N multiples of 8 only (its row minimum is met by `_int_mm`'s padding)."""
    n, k = w.spec.shape
    if x.device.type == "cuda" and (n % 8 or k % 8):
        return f"CUDA's _int_mm needs in_features and out_features multiples of 8 (got {k}, {n})"
    return None


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(a [M, K] int8, b [K, N] int8) -> int32, exact; on CUDA, which needs M > 16, a short a is
    padded with zero rows (their sums are dropped)."""
    m = a.shape[0]
    if a.is_cuda and m <= 16:
        return torch._int_mm(torch.nn.functional.pad(a, (0, 0, 0, 17 - m)), b)[:m]
    return torch._int_mm(a, b)


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
    xq, x_scale = int8_activation(x2, per_token, no_clipping, eps)
    acc = _int_mm(xq, w_codes.t())
    return (acc.float() * x_scale * w_scale.float().reshape(1, -1)).to(x2.dtype)


@_int8_dynamic_linear.register_fake
def _(x2, w_codes, w_scale, per_token, no_clipping, eps):
    return x2.new_empty(x2.shape[0], w_codes.shape[0])


def _int_mm_run(x, w, bias):
    aq = w.spec.act_quant
    out = _int8_dynamic_linear(
        _flat(x), w._qdata, w._scale, aq.per_token,
        aq.mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR, act_eps(x, aq),
    )
    return kernel_output(out, x, bias)


register_linear_kernel("onednn.qlinear", ("plain",), qlinear_check, qlinear_run)
register_linear_kernel("aten._int_mm", ("plain",), _int_mm_check, _int_mm_run)


# -- kernel: aten int8 x int8 -> int32 with calibrated (static) activation qparams ---------------------


def _int_mm_static_check(x, w):
    aq = w.spec.act_quant
    if aq is None or not aq.static or aq.dtype.name != "int8":
        return "needs static int8 activation quantization (calibrated act_scale)"
    return _common(x, w, x.device.type) or _per_channel_int8(w.spec) or _int_mm_shape(x, w)


@torch.library.custom_op("affineq::int8_static_linear", mutates_args=())
def _int8_static_linear(x2: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor,
                        x_zero_point: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] float quantized with the calibrated per-tensor (x_scale, x_zero_point) exactly as
    quantize_affine does (clamp(round(x * (1 / s)) + zp)), times w_codes [N, K].T with torch._int_mm; the
    zero point is taken out of the int32 sums (acc - zp * sum_k w[n, k], exact), then both scales ->
    [M, N] in x2.dtype. One opaque op per linear (see `_int8_dynamic_linear`)."""
    q = torch.round(x2.float() * (1.0 / x_scale.float()))
    if x_zero_point is not None:
        q = q + x_zero_point.float()
    acc = _int_mm(q.clamp(-128, 127).to(torch.int8), w_codes.t())
    if x_zero_point is not None:
        acc = acc - x_zero_point.to(torch.int32) * w_codes.sum(1, dtype=torch.int32)
    return (acc.float() * (x_scale.float() * w_scale.float().reshape(1, -1))).to(x2.dtype)


@_int8_static_linear.register_fake
def _(x2, w_codes, w_scale, x_scale, x_zero_point):
    return x2.new_empty(x2.shape[0], w_codes.shape[0])


def _int_mm_static_run(x, w, bias):
    x_scale, x_zp = static_qparams(w)
    return kernel_output(_int8_static_linear(_flat(x), w._qdata, w._scale, x_scale, x_zp), x, bias)


register_linear_kernel("onednn.qlinear:static", ("plain",), qlinear_static_check, qlinear_static_run)
register_linear_kernel("aten._int_mm:static", ("plain",), _int_mm_static_check, _int_mm_static_run)


# -- kernel: aten int8 weight-only --------------------------------------------------------------------


def _int8pack_check(x, w):
    if w.spec.act_quant is not None:
        return "act_quant is set"
    return _common(x, w, x.device.type) or _per_channel_int8(w.spec)


@torch.library.custom_op("affineq::weight_int8pack_mm", mutates_args=())
def _weight_int8pack_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """aten._weight_int8pack_mm behind an opaque op: inductor's own lowering of it rejects fused inputs."""
    if w.device.type == "cpu" and w.data_ptr() % 16:
        # The CPU kernel reads the codes with 16-byte aligned loads and crashes on a view at another offset
        # (safetensors aligns tensors to 8 bytes); AffineQuantizedTensor.from_tensors realigns those once.
        w = w.clone()
    return torch.ops.aten._weight_int8pack_mm(x, w, scale)


@_weight_int8pack_mm.register_fake
def _(x, w, scale):
    return x.new_empty(x.shape[0], w.shape[0])


def _int8pack_run(x, w, bias):
    # On CPU the aten kernel is vectorized for bf16 only; fp32/fp16 inputs are computed in bf16.
    cdt = torch.bfloat16 if x.device.type == "cpu" else x.dtype
    out = _weight_int8pack_mm(_flat(x).to(cdt), w._qdata, w._scale.reshape(-1).to(cdt))
    return kernel_output(out, x, bias)


register_linear_kernel("aten._weight_int8pack_mm", ("plain",), _int8pack_check, _int8pack_run)


# -- kernel: aten float8 scaled matmul (dynamic float8 activation) --------------------------------------


def _scaled_mm_check(x, w):
    aq = w.spec.act_quant
    if aq is None or aq.dtype.torch_dtype is None or not aq.dtype.is_float or aq.static:
        return "needs float8 dynamic activation quantization"
    if aq.is_mx:
        return "MX (per_block) activations need block-scaled matmul, not _scaled_mm's row / tensor scales"
    if w.spec.target.torch_dtype is None or not w.spec.target.is_float or len(w.spec.shape) != 2:
        return "needs a 2-D float8 weight"
    if w.spec.scale_type is not None:
        return f"reads float scales, not {w.spec.scale_type} bytes"
    n, k = w.spec.shape
    if w.spec.block_size not in ((n, k), (1, k)):
        return f"needs per-tensor or per-row weight scales, got block_size {w.spec.block_size}"
    if (w.spec.block_size == (1, k)) != (aq.per_token):
        return "needs per-row weight scales with per-token activations, or per-tensor with per-tensor"
    if k % 16 or n % 16:
        return f"_scaled_mm needs K and N divisible by 16 (got K={k}, N={n})"
    return _common(x, w, x.device.type)


def _scaled_mm_run(x, w, bias):
    x2 = _flat(x)
    xq, x_scale = quantize_float_activation(x2, w.spec.act_quant)
    n = w.spec.shape[0]
    w_scale = w._scale.float().reshape(1, -1)
    per_row = w_scale.numel() == n
    out = torch._scaled_mm(
        xq, w._qdata.t(),
        scale_a=x_scale.float().reshape(-1, 1) if per_row else x_scale.float()[:1].reshape(()),  # [M, 1] view
        scale_b=w_scale if per_row else w_scale.reshape(()),
        out_dtype=torch.bfloat16 if x.dtype == torch.float16 else x.dtype,
    )
    return kernel_output(out, x, bias)


register_linear_kernel("aten._scaled_mm", ("plain",), _scaled_mm_check, _scaled_mm_run)
