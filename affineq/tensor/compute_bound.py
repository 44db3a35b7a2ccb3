"""Linear kernels for compute-bound calls (many input rows M), chosen by the CPU's kind at run time.

At large M a linear's time is its arithmetic, and torch's float GEMM (oneDNN / MKL, which pick AMX tiles,
AVX-512 or AVX2 by themselves) can run it faster than a fused dequantizing kernel. Each kernel runs from the
threshold for this CPU kind and input dtype on (`MIN_ROWS`, one small table); below it the fused kernels of
`linear_kernels`. `affineq.dequant_linear` (and 8da4w's `affineq.int8_codes_linear`) compare M inside the op
(`min_rows`), so a graph with a symbolic M runs what eager runs; `onednn.qlinear`'s precondition compares it
(`rows_check`: a symbolic M takes the fused kernels).

| kernel                 | format | what runs                                                                   |
|------------------------|--------|-----------------------------------------------------------------------------|
| affineq.dequant_linear | dense  | W dequantized in cached row blocks (C++), each block times x by at::mm       |
| onednn.qlinear         | plain  | W8A8, dynamic int8 x, per-channel int8 W: oneDNN's int8 GEMM on a weight     |
|                        |        | prepacked once (AMX int8 tiles, VNNI); exact int32 sums                      |
| onednn.qlinear:static  | plain  | the same with calibrated per-tensor activation qparams (zero point too)      |

Numerics of `affineq.dequant_linear` (cpp/dequant_gemm.cpp): the weight block holds exactly the values of
`AffineQuantizedTensor.dequantize()`. fp32 input: fp32 weight, fp32 GEMM, the same values as dequantize-then-
F.linear up to the GEMM's summation order. bf16 input on a CPU with native bf16 GEMMs (AMX, AVX512-BF16): the
weight rounded to bf16 once, the bf16 GEMM with fp32 accumulation, i.e. F.linear(x, w.dequantize(bf16)); on
other CPUs (AVX2) bf16 input is computed in fp32 (x.float() times the fp32 weight, rounded to bf16 once at
the end), as `affineq.lowbit_linear` does there. Activation quantization (8da4w and similar) fake-quantizes x
first, as the reference does.

Numerics of `onednn.qlinear`: the int8 codes of x (the same ops as `activation.int8_activation`, or the static
qparams) times the weight codes, summed exactly in int32 by oneDNN (unit scales, so its fp32 output is
float(int32 sum)), then times the activation scale and the weight scale in the order `aten._int_mm`'s route
uses: the same values as that route, bit for bit. It needs VNNI or AMX: without them oneDNN sums pairs of
u8 x s8 products in saturating int16 (vpmaddubsw), which is not exact (measured on an AVX2 EPYC), so the
kernel never runs there. The prepacked weight lives in a side cache keyed by the weight's codes tensor
(`prepacked_int8_weight`), never on the weight: torch.save, deepcopy, compile and export see the plain codes.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref

import torch

from affineq import compile_cache
from affineq import cpp as _cpp
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.activation import (
    act_eps,
    fake_quantize_activation,
    int8_activation,
    is_symmetric_int8,
    kernel_output,
    static_qparams,
)
from affineq.tensor.formats import dense_code_offset, dense_is_canonical
from affineq.tensor.kernel_registry import clear_selection_cache

#: Smallest M (input rows) at which each kernel runs, per CPU kind (`cpu_kind()`) and input dtype; None (or no
#: entry): never. Powers of two: kernel selection is cached per power-of-two bucket of M (`rows_bucket`).
#: avx2: a rough single-shot comparison on a shared AVX2 EPYC found torch's fp32 GEMM (MKL) slower than the fused
#: `lowbit_linear` fp32 GEMM at every M, and bf16 has no native GEMM there: the fused kernels stay. avx512 (Zen 5,
#: measured side by side, benchmarks/README.md): the fused bf16-dot path beats dequant_linear at M = 32 .. 512 on
#: both compute-bound shapes, so dequant_linear never runs there. amx (the AMX Xeon, side by side): lowbit_linear's
#: AMX tile GEMM (bf16 x) and its fp32 GEMM beat dequant_linear at M = 16 .. 512; `set_min_rows` turns it on.
_ANY = ("fp32", "bf16", "fp16")
MIN_ROWS: dict[str, dict[str, dict[str, int | None]]] = {
    "affineq.dequant_linear": {
        "amx": {},                         # lowbit_linear's AMX (bf16) and fp32 GEMMs are faster at every M
        "avx512": {},                      # the fused bf16-dot / fp32 paths are faster at every M
        "avx2": {},
        "scalar": {},
    },
    # 4-bit weights (8da4w) on our int8-codes kernel (VNNI, exact int32 sums; 8-bit weights take it at every M):
    # it beats the fused GEMV on the fake-quantized x from 1 row with either input dtype (bf16 x at 1 row: SmolLM2
    # decode 8% faster, single linears 0.95-1.1x; benchmarks/README.md). The op compares M itself (below the
    # threshold: the fused kernels inside it), so an exported graph runs what eager runs at every M. AMX Xeon
    # (side by side): fp32 x 1.6-2.4x faster than lowbit_linear on the fake-quantized x at M = 1-128; bf16 x
    # faster at 2-15 rows, slower than lowbit_linear's AMX tiles from 16 (the next entry); at 1 row it measured
    # faster alone but slower in SmolLM2's eager decode, so one row keeps the fused GEMV (benchmarks/README.md).
    "affineq.int8_codes_linear:int4": {
        "amx": {"fp32": 1, "bf16": 2},
        "avx512": {"fp32": 1, "bf16": 1},
        "avx2": {},
        "scalar": {},
    },
    # 4-bit weights with dynamic int8 activations on lowbit_linear's AMX tiles (path 5: x quantized as it is
    # packed): from these rows the int8-codes kernel declines in their favour (`int8_codes_check`). The tiles'
    # weight dequantization is paid once per call, the int8-codes kernel's cost grows with every row.
    "affineq.lowbit_linear:int8_act": {
        "amx": {"bf16": 16},
        "avx512": {},
        "avx2": {},
        "scalar": {},
    },
    "onednn.qlinear": {  # the activation is quantized to int8 whatever its dtype; also needs exact_int8_gemm()
        "amx": dict.fromkeys(_ANY, 16),
        "avx512": {},  # oneDNN takes a slow int8 path on the AVX-512 Zen 5 (benchmarks/README.md): aten._int_mm there
        "avx2": {},
        "scalar": {},
    },
}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def set_min_rows(kernel: str, dtype: str, rows: int | None, kind: str | None = None) -> int | None:
    """Set the row threshold of `kernel` for input `dtype` ("fp32", "bf16", "fp16") on CPU `kind` (default:
    this one), returning the previous value; rows must be a power of two, or None to never run it. Graphs
    compiled afterwards (and the compile caches' keys, `affineq.compile_cache`) follow it; graphs compiled before
    in this process keep their kernels until `torch._dynamo.reset()` (a warning says so when there are some)."""
    if kernel not in MIN_ROWS:
        raise ValueError(f"set_min_rows: unknown kernel {kernel!r}; use one of {sorted(MIN_ROWS)}")
    kind = kind or cpu_kind()
    if kind not in MIN_ROWS[kernel] or dtype not in _ANY:
        raise ValueError(f"set_min_rows: kind must be one of {sorted(MIN_ROWS[kernel])} and dtype one of {_ANY}, "
                         f"got kind={kind!r}, dtype={dtype!r}")
    if rows is not None and (not isinstance(rows, int) or rows < 1 or rows & (rows - 1)):
        raise ValueError(f"set_min_rows: rows must be a power of two (selection is cached per power-of-two bucket "
                         f"of M) or None, got {rows!r}")
    table = MIN_ROWS[kernel][kind]
    previous = table.get(dtype)
    table[dtype] = rows
    clear_selection_cache()
    compile_cache.refresh()
    if rows != previous and compile_cache.traced_in_this_process():
        warnings.warn(f"set_min_rows({kernel!r}, {dtype!r}, {rows}): graphs compiled earlier in this process keep "
                      "the kernels they traced; call torch._dynamo.reset() to recompile them with this threshold",
                      stacklevel=2)
    return previous


@functools.cache
def cpu_kind() -> str:
    """"amx" (AMX tiles: Sapphire Rapids and later Xeons), "avx512", "avx2" or "scalar": what torch's GEMMs
    (oneDNN) can use on this CPU, read once per process."""
    cpu = torch.cpu
    if cpu._is_amx_tile_supported():
        return "amx"
    if cpu._is_avx512_supported():
        return "avx512"
    if cpu._is_avx2_supported():
        return "avx2"
    return "scalar"


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether torch's bf16 GEMM runs on bf16 hardware here (AMX or AVX512-BF16); elsewhere it is emulated and
    an fp32 GEMM is faster."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


# What the kernel choice reads from this CPU and the row tables (a process on another CPU, or after set_min_rows,
# must not get a graph cached with other kernels)
compile_cache.track("cpu", lambda: (cpu_kind(), native_bf16_gemm(), torch.backends.cpu.get_cpu_capability()))
compile_cache.track("min_rows", lambda: {kernel: {d: r for d, r in table[cpu_kind()].items() if r is not None}
                                          for kernel, table in MIN_ROWS.items()})  # None: never, as absent


def input_rows(x: torch.Tensor):
    """M: the number of rows F.linear multiplies (product of all but the last dim; an int or a SymInt)."""
    return math.prod(x.shape[:-1])


def min_rows(kernel: str, dtype: torch.dtype) -> int | None:
    """The kernel's `MIN_ROWS` for this CPU kind and input `dtype` (None: never)."""
    return MIN_ROWS[kernel][cpu_kind()].get(_DTYPE_NAMES.get(dtype, str(dtype)))


def rows_check(kernel: str, x: torch.Tensor) -> str | None:
    """None when x has at least the kernel's `MIN_ROWS` for this CPU kind and x's dtype, else the reason. A
    symbolic M (torch.compile with dynamic shapes, export) passes only where it is known to, so no guard is
    added and the graph stays valid for every M: the fused kernels serve the rest."""
    kind = cpu_kind()
    dtype = _DTYPE_NAMES.get(x.dtype, str(x.dtype))
    least = MIN_ROWS[kernel][kind].get(dtype)
    if least is None:
        return f"not used for {dtype} input on a {kind} CPU (the fused kernels are faster there)"
    if not rows_at_least(x, least):
        return (f"M = {input_rows(x)} input rows < {least}, where it beats the fused kernels for {dtype} on a "
                f"{kind} CPU")
    return None


def _rows_known(x: torch.Tensor, holds) -> bool:
    """holds(M) for x's input rows M; a symbolic M (torch.compile with dynamic shapes, export) only where it is
    known to hold, so no guard is added and the graph stays valid for every M."""
    m = input_rows(x)
    if isinstance(m, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return statically_known_true(holds(m))
    return bool(holds(m))


def rows_at_least(x: torch.Tensor, least: int) -> bool:
    """Whether x has at least `least` input rows (`_rows_known`)."""
    return _rows_known(x, lambda m: m >= least)


def rows_below(x: torch.Tensor, bound: int) -> bool:
    """Whether x has fewer than `bound` input rows (`_rows_known`)."""
    return _rows_known(x, lambda m: m < bound)


# -- kernel: affineq.dequant_linear, dense format ----------------------------------------------------------


def dequant_linear_check(x: torch.Tensor, w) -> str | None:
    if x.device.type != "cpu":
        return f"input is on {x.device.type}, kernel runs on cpu"
    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"input dtype {x.dtype} is not fp32/bf16"
    if not _cpp.is_available():
        return f"the affineq C++ kernels are unavailable ({_cpp.unavailable_reason()})"
    if min_rows("affineq.dequant_linear", x.dtype) is None:  # else the op compares M itself (min_rows)
        return (f"not used for {_DTYPE_NAMES.get(x.dtype, str(x.dtype))} input on a {cpu_kind()} CPU (the fused "
                "kernels are faster there)")
    return None


def dequant_linear_run(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    spec = w.spec
    if spec.act_quant is not None:
        x = fake_quantize_activation(x, spec.act_quant, w)
    n, k = spec.shape
    offset = getattr(w, "_offset", None)
    out = torch.ops.affineq.dequant_linear(
        x, w._qdata, w._scale, offset, spec.target.bits, spec.block_size[1], n, k, _cpp.codes_kind(spec.target),
        dense_code_offset(spec, offset is not None), dense_is_canonical(w._scale, spec, offset is not None),
        x.dtype == torch.bfloat16 and native_bf16_gemm(), min_rows("affineq.dequant_linear", x.dtype) or 0,
    )
    return out if bias is None else out + bias


# -- kernel: onednn.qlinear, plain format, W8A8 ------------------------------------------------------------


@functools.cache
def exact_int8_gemm() -> bool:
    """Whether oneDNN's int8 GEMM sums exactly in int32 here: VNNI (vpdpbusd) or AMX int8 tiles."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_vnni_supported())


# id(codes tensor) -> (weak reference to it, its version counter, oneDNN's prepacked copy)
_PREPACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be changed in place)
        return -1


def prepacked_int8_weight(codes: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked copy of int8 weight codes [N, K], made on first use and kept while `codes` lives and
    is not modified in place (its version counter); a new or changed tensor is packed again."""
    key = id(codes)
    hit = _PREPACKED.get(key)
    if hit is not None and hit[0]() is codes and hit[1] == _version(codes):
        return hit[2]
    packed = torch.ops.onednn.qlinear_prepack(codes, None)
    ref = weakref.ref(codes, lambda _, key=key: _PREPACKED.pop(key, None))
    _PREPACKED[key] = (ref, _version(codes), packed)
    return packed


def _int32_sums(xq: torch.Tensor, x_zero_point: int, codes: torch.Tensor) -> torch.Tensor:
    """float32 of the exact int32 sums (xq - x_zero_point) @ codes.T [M, N] by oneDNN (unit scales)."""
    n = codes.shape[0]
    return torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, x_zero_point, prepacked_int8_weight(codes), torch.ones(n), torch.zeros(n, dtype=torch.int64),
        None, 1.0, 0, torch.float32, "none", [], "",
    )


@torch.library.custom_op("affineq::int8_dynamic_onednn_linear", mutates_args=())
def _int8_dynamic_onednn_linear(x2: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, per_token: bool,
                                no_clipping: bool, eps: float) -> torch.Tensor:
    """`affineq::int8_dynamic_linear` with oneDNN's int8 GEMM on the prepacked weight: x2 [M, K] -> symmetric
    int8 codes (per token or per tensor) -> exact int32 sums -> times both scales -> [M, N] in x2.dtype. One
    opaque op per linear (see linear_kernels._int8_dynamic_linear); the prepack cache is looked up at run time."""
    xq, x_scale = int8_activation(x2, per_token, no_clipping, eps)
    return (_int32_sums(xq, 0, w_codes) * x_scale * w_scale.float().reshape(1, -1)).to(x2.dtype)


@_int8_dynamic_onednn_linear.register_fake
def _(x2, w_codes, w_scale, per_token, no_clipping, eps):
    return x2.new_empty(x2.shape[0], w_codes.shape[0])


@torch.library.custom_op("affineq::int8_static_onednn_linear", mutates_args=())
def _int8_static_onednn_linear(x2: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor,
                               x_zero_point: torch.Tensor | None) -> torch.Tensor:
    """`affineq::int8_static_linear` with oneDNN's int8 GEMM: x2 quantized with the calibrated per-tensor
    (x_scale, x_zero_point) as quantize_affine does; oneDNN takes the zero point out of the int32 sums."""
    q = torch.round(x2.float() * (1.0 / x_scale.float()))
    zp = 0 if x_zero_point is None else int(x_zero_point.reshape(-1)[0])
    if x_zero_point is not None:
        q = q + x_zero_point.float()
    acc = _int32_sums(q.clamp(-128, 127).to(torch.int8), zp, w_codes)
    return (acc * (x_scale.float() * w_scale.float().reshape(1, -1))).to(x2.dtype)


@_int8_static_onednn_linear.register_fake
def _(x2, w_codes, w_scale, x_scale, x_zero_point):
    return x2.new_empty(x2.shape[0], w_codes.shape[0])


def _qlinear_common(x: torch.Tensor, w) -> str | None:
    """A float CPU input, a per-channel symmetric int8 `plain` weight, an exact int8 GEMM, enough rows."""
    spec = w.spec
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"needs a float CPU input, got {x.dtype} on {x.device.type}"
    n, k = spec.shape if len(spec.shape) == 2 else (0, 0)
    if spec.target.name != "int8" or spec.block_size != (1, k) or spec.scale_type is not None:
        return "needs a 2-D int8 weight with per-channel float scales"
    symmetric = spec.mapping_type in (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    if spec.zero_point_domain is not ZeroPointDomain.NONE and not (
            symmetric and (spec.quant_max + spec.quant_min + 1) // 2 == 0):
        return "needs symmetric weight codes (zero point 0)"
    if not exact_int8_gemm():
        return "oneDNN's int8 GEMM is exact only with VNNI or AMX (AVX2 sums in saturating int16)"
    return rows_check("onednn.qlinear", x)


def qlinear_check(x: torch.Tensor, w) -> str | None:
    """Dynamic symmetric int8 activations (per token or per tensor)."""
    if not is_symmetric_int8(w.spec.act_quant):
        return "needs symmetric dynamic int8 activation quantization (zero point 0)"
    return _qlinear_common(x, w)


def qlinear_static_check(x: torch.Tensor, w) -> str | None:
    """Calibrated (static) per-tensor int8 activation qparams."""
    aq = w.spec.act_quant
    if aq is None or not aq.static or aq.dtype.name != "int8":
        return "needs static int8 activation quantization (calibrated act_scale)"
    if w._act_scale.numel() != 1:
        return "needs one static activation scale (per tensor)"
    return _qlinear_common(x, w)


def qlinear_run(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    aq = w.spec.act_quant
    out = _int8_dynamic_onednn_linear(x.reshape(-1, x.shape[-1]), w._qdata, w._scale, aq.per_token,
                                      aq.mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR, act_eps(x, aq))
    return kernel_output(out, x, bias)


def qlinear_static_run(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    x_scale, x_zp = static_qparams(w)
    out = _int8_static_onednn_linear(x.reshape(-1, x.shape[-1]), w._qdata, w._scale, x_scale, x_zp)
    return kernel_output(out, x, bias)
