"""Weight-only low-bit linear kernels for CPU: ``torch.ops.affineq.lowbit_linear``.

Math (format-agnostic "scale + offset over codes"): the weight ``W [n, k]`` is stored as codes
``u[n, k]`` in ``[0, 2**bits)``, ``bits`` in 1..8, with ``scale[n, g]`` and ``offset[n, g]`` (both fp32, both
fp16 or both bf16) for ``g = k // group_size``::

    W[n, k] = scale[n, k // group_size] * c(u[n, k]) + offset[n, k // group_size]
    y = x @ W.T = sum_g scale[:, g] * (x_g @ c(u_g).T) + offset[:, g] * x_g.sum(-1)

where ``c(u) = u`` for ``codes=CODES_UINT`` and, with ``bits=8``, the float8 value of the byte ``u`` for
``CODES_E4M3`` (``torch.float8_e4m3fn``) or ``CODES_E5M2`` (``torch.float8_e5m2``); with ``bits=4`` the fp4
E2M1 value of the bit pattern ``u`` for ``CODES_FP4_E2M1``, with ``bits=6`` the fp6 value for
``CODES_FP6_E2M3`` / ``CODES_FP6_E3M2`` (OCP MX element types, sign in the top bit, the codes
``qtype(...).encode`` returns). bf16 qparams (integer codes only) follow the tinygemm convention instead:
``offset`` holds the zero ``z`` and ``W = scale * (u - 2**(bits - 1)) + z``, so a bf16 float zero point is
stored exactly. Without ``offset`` (None) the offset is ``scale * code_offset``: ``W = scale * (c(u) +
code_offset)``, exact, which needs a 16-bit scale (bf16 / fp16: symmetric codes, ``code_offset = quant_min``)
or e8m0 qparams (OCP MX shared scales: ``scale`` is uint8 exponent bytes ``b``, value ``2**(b - 127)``;
``code_offset`` is ``quant_min`` for integer codes stored as ``q - quant_min``, 0 for float codes); an fp32
``scale`` without ``offset`` takes ``code_offset = 0`` (offset 0, all that float codes need).

Packed layout: ``affineq.bitpack`` (``pack_codes``; panels of 16 rows of bit planes), re-exported here.

Kernels (chosen per call; x of any float dtype is converted to fp32 first, the output is cast back):

* small m (<= 2 where the int16 path below applies, else <= 4 to 24 by width and dtype): fused GEMV, codes
  decoded into fp32 registers, scale and offset applied once per group; streams the packed weights once
  (memory-bound). 4-bit codes with bf16 x use bf16 dot products of the codes instead: exact products, fp32
  sums; so do the other widths but float8 from 3 rows of bf16 x (the decoded values, at most 8 significant
  bits, as exact bf16 pairs). One row of fp32 x against 2- to 6-bit integer codes (on AMX Xeons every such
  width, elsewhere 2 to 4 bits) takes VNNI dot products on x's exact integer digits per block instead.
* larger m: a [256 x 32] tile of W is expanded into L1 and reused by all rows of x; an fp32 FMA micro-kernel
  runs on it. fp32 products, fp32 accumulation: results match ``lowbit_linear_reference`` to ~1e-6.
* larger m, AVX512-VNNI CPUs, bf16/fp16 x (by default; integer, fp4 and fp6 codes: the latter as the exact
  integers value * 2 / 8 / 16 for e2m1 / e2m3 / e3m2): the tile holds exact int16 code pairs and
  ``vpdpwssd`` (2 MACs per lane, i.e. the bf16 ``F.linear`` rate) multiplies them with x rounded to 16-bit
  fixed point per (row, block of <= 256 columns inside a group): per element error <= 2**-16 *
  max|x_block|, ~1e-5 relative in y, far below the bf16/fp16 output rounding. ``AFFINEQ_KERNELS_INT16_X=1``
  enables it for fp32 x too (faster at larger m, ~80 dB SQNR instead of fp32-exact; see benchmarks/README.md,
  kernel design measurements), ``=0`` disables it.
* larger m, bf16 x on CPUs with AMX tiles (k a multiple of 32): the same bf16 tiles as the bf16 dot GEMM
  multiplied on AMX tiles (``tdpbf16ps``, 8x its dot products per cycle): F.linear of x on the weight
  dequantized to bf16, fp32 sums (AMX flushes subnormals to zero, as oneDNN's AMX GEMM does).

``affineq::lowbit_linear_bf16_compute`` (float32 x of a weight whose ``QuantSpec.compute_dtype`` is bf16): the
result of ``lowbit_linear(x.to(torch.bfloat16))`` cast back to float32, bit for bit; where the bf16 kernels run
(bf16 dot-product GEMM, the GEMV's bf16 tiles) they read x rounded and write the widened bf16 values themselves, with no
bf16 copy of y.

``affineq::lowbit_linear_int8_act`` (8da4w's linear on int8-quantized activations): ``lowbit_linear`` of
``int8_fake_quant(x)``, bit for bit; where the AMX GEMM runs (bf16 x) each block of x's rows is quantized as it
is packed into tiles, so no quantized copy of x is written and read back.
``affineq::lowbit_linear_int8_act_bf16_compute``: the same for ``x.to(torch.bfloat16)``, its result widened to
float32, bit for bit (a weight whose ``compute_dtype`` is bf16); the AMX GEMM writes the widened values itself.
``affineq::int8_codes_linear_bf16_compute``: ``int8_codes_linear`` likewise (W8A8 dynamic, 8da4w on the
int8-codes kernel): float32 x quantized as its bf16 values, y written as the bf16 result's values widened.

The C++ library is compiled on first use (see ``_build.py``; every ``*.cpp`` here is one translation unit):
``dispatch.cpp`` holds the entry points and the path choice (``path_for``), ``gemv.cpp``, ``gemm_f32.cpp``,
``gemm_int16.cpp``, ``gemm_bf16.cpp`` and ``gemm_amx.cpp`` one path each (``bf16_tiles.h``: the bf16 weight
tiles of the last two; ``amx.h``: the AMX permission and tile configuration), over the shared headers
``simd.h`` (SIMD shims), ``decode.h`` (code decoders) and ``common.h`` / ``common.cpp`` (scratch buffers, qparam
loading, tiling);
``activation_quant.cpp`` the int8 activation quantization, ``recurrent.cpp`` the LSTM / GRU / RNN recurrence
(``affineq::lowbit_rnn_layer``), whose dynamic int8 steps use ``gemm_int8_codes.cpp`` (int8 codes of h times
8-bit weight codes, summed exactly in int32 by VNNI ``vpdpbusd``, or AMX int8 tiles for per-channel weights
from 16 rows, the same sums; AVX512-VNNI + VBMI builds);
``lowbit_ops.cpp`` binds them to the torch ops (argument rules shared with the other bindings: ``op_checks.h``);
``grouped.cpp`` runs the same kernels per expert of a 3-D weight for mixture-of-experts layers
(``affineq::grouped_lowbit_linear``, defined with its reference in ``grouped_ops.py``); ``attention.cpp`` and
``attention_kernel.cpp`` the KV-cache attention (``affineq::kv_attention`` over int8 / int4 codes,
``affineq::float_kv_attention`` over a float cache; schemas and references in ``kv_attention.py``).
``is_available()`` says whether the build worked; callers fall back to ``lowbit_linear_reference``-style
dequantize + ``F.linear`` otherwise.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F

from affineq import compile_cache
from affineq.bitpack import PANEL_ROWS, check_bits, pack_codes, packed_nbytes, unpack_codes
from affineq.dtypes import qtype

from . import _build

__all__ = [
    "PANEL_ROWS",
    "is_available",
    "unavailable_reason",
    "pack_codes",
    "unpack_codes",
    "packed_nbytes",
    "lowbit_linear_reference",
    "CODES_UINT",
    "CODES_E4M3",
    "CODES_E5M2",
    "CODES_FP4_E2M1",
    "CODES_FP6_E2M3",
    "CODES_FP6_E3M2",
    "codes_kind",
    "code_values",
    "e8m0_values",
]

#: The ``codes`` argument of the ops: what a stored code means (integers, float8 bytes with bits=8, or the
#: bit patterns of fp4 E2M1 (bits=4) / fp6 E2M3, E3M2 (bits=6)).
CODES_UINT, CODES_E4M3, CODES_E5M2, CODES_FP4_E2M1, CODES_FP6_E2M3, CODES_FP6_E3M2 = 0, 1, 2, 3, 4, 5
_FP8_CODES = {CODES_E4M3: torch.float8_e4m3fn, CODES_E5M2: torch.float8_e5m2}
#: fp4 / fp6 kinds: (affineq target name, storage bits)
_FPX_CODES = {CODES_FP4_E2M1: ("fp4_e2m1", 4), CODES_FP6_E2M3: ("fp6_e2m3", 6), CODES_FP6_E3M2: ("fp6_e3m2", 6)}
_CODE_BITS = {CODES_E4M3: 8, CODES_E5M2: 8, **{k: b for k, (_, b) in _FPX_CODES.items()}}


#: codes kind by fp4 / fp6 target name or float8 torch dtype (`codes_kind`: two lookups on every linear call)
_KIND_OF = {**{fname: kind for kind, (fname, _) in _FPX_CODES.items()}, **{d: kind for kind, d in _FP8_CODES.items()}}


def codes_kind(dtype) -> int:
    """The ``codes`` value for codes of ``dtype`` (a torch dtype or an affineq QType): float8, fp4 and fp6 map
    to their kind, integers to CODES_UINT."""
    kind = _KIND_OF.get(getattr(dtype, "name", None))
    return kind if kind is not None else _KIND_OF.get(getattr(dtype, "torch_dtype", dtype), CODES_UINT)


def code_values(u: torch.Tensor, codes: int) -> torch.Tensor:
    """fp32 value c(u) of uint8 codes u for a codes kind (see the module docstring)."""
    if codes in _FP8_CODES:
        return u.view(_FP8_CODES[codes]).float()
    if codes in _FPX_CODES:
        return qtype(_FPX_CODES[codes][0]).decode(u, torch.float32)
    return u.float()

_ENV_DISABLE = "AFFINEQ_DISABLE_CPP_KERNELS"
_OP = "affineq::lowbit_linear"

_lock = threading.RLock()
_override: bool | None = None  # set by _set_disabled; None defers to the environment variable
_lib_path: str | None = None
_load_error: str | None = None
_load_tried = False
_int8_codes = False  # the loaded build has the int8-codes kernel (set when the library loads)
_cpp_disabled_flag: bool | None = None  # last value pushed to the C++ kill switch


# --------------------------------------------------------------------------------------------------------
# Reference implementation and argument checks
# --------------------------------------------------------------------------------------------------------
def _check_args(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                group_size: int, n: int, k: int, codes: int = CODES_UINT, code_offset: int = 0,
                compute_dtype: torch.dtype | None = None) -> None:
    """Same rules as the C++ binding (ValueError naming the offending argument)."""
    check_bits(bits)
    if compute_dtype is not None and (compute_dtype != torch.bfloat16 or x.dtype not in (torch.float32,
                                                                                         torch.bfloat16)):
        raise ValueError(f"lowbit_linear: compute_dtype must be None or torch.bfloat16 with a float32 or bfloat16 "
                         f"x, got {compute_dtype} with {x.dtype}")
    if codes != CODES_UINT and _CODE_BITS.get(codes) != bits:
        raise ValueError(f"lowbit_linear: codes must be 0 (unsigned integers), 1 (float8_e4m3fn) or 2 (float8_e5m2, "
                         f"both with bits=8), 3 (fp4_e2m1, bits=4), 4 (fp6_e2m3) or 5 (fp6_e3m2, both bits=6), got "
                         f"codes={codes}, bits={bits}")
    if n < 0 or k <= 0:
        raise ValueError(f"lowbit_linear: need n >= 0 and k > 0, got n={n}, k={k}")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"lowbit_linear: group_size must divide k, got group_size={group_size}, k={k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"lowbit_linear: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"lowbit_linear: x must have shape [..., k={k}], got {tuple(x.shape)}")
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(n, k, bits):
        raise ValueError(f"lowbit_linear: packed must be uint8 with {packed_nbytes(n, k, bits)} elements "
                         f"(pack_codes output), got {packed.dtype} with {packed.numel()}")
    g = k // group_size
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.uint8) or tuple(scale.shape) != (n, g):
        raise ValueError(f"lowbit_linear: scale must be float32, bfloat16, float16 or uint8 (e8m0 exponent bytes) of "
                         f"shape [n, k // group_size] = [{n}, {g}], got {scale.dtype} {tuple(scale.shape)}")
    if offset is not None:
        if scale.dtype == torch.uint8:
            raise ValueError("lowbit_linear: e8m0 (uint8) scales store no offset: pass offset=None and the code "
                             "offset as code_offset")
        if offset.dtype != scale.dtype or tuple(offset.shape) != (n, g):
            raise ValueError(f"lowbit_linear: offset must have scale's dtype {scale.dtype} and shape [{n}, {g}], got "
                             f"{offset.dtype} {tuple(offset.shape)}")
        if code_offset != 0:
            raise ValueError("lowbit_linear: code_offset applies without an offset tensor only; fold it into offset")
    elif code_offset != 0 and scale.dtype == torch.float32:
        raise ValueError(f"lowbit_linear: code_offset={code_offset} needs 16-bit or e8m0 scales (scale * code_offset "
                         "exact); with float32 scales pass offset = scale * code_offset")
    if abs(code_offset) > 1 << 16:
        raise ValueError(f"lowbit_linear: code_offset must be small, got {code_offset}")
    if scale.dtype == torch.bfloat16 and codes != CODES_UINT:
        raise ValueError("lowbit_linear: bfloat16 qparams (the W = scale * (u - 2**(bits-1)) + zero convention) "
                         "need integer codes")


def e8m0_values(b: torch.Tensor) -> torch.Tensor:
    """fp32 2**(b - 127) of e8m0 exponent bytes (uint8), b = 255 -> NaN, as the C++ kernels decode them."""
    return torch.where(b == 255, float("nan"), torch.exp2(b.float() - 127))


def _dequantize(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int, group_size: int,
                n: int, k: int, codes: int = CODES_UINT, code_offset: int = 0) -> torch.Tensor:
    """fp32 W [n, k] = scale * c(u) + offset (per group); bf16 qparams: scale * (u - 2**(bits-1)) + offset;
    no offset: offset = scale * code_offset (e8m0 scales: 2**(b - 127))."""
    u = unpack_codes(packed, bits, n, k).to(scale.device)
    u = code_values(u, codes).view(n, k // group_size, group_size)
    s = e8m0_values(scale) if scale.dtype == torch.uint8 else scale.float()
    if offset is None:  # scale * (c(u) + code_offset): exact, with the product's sign when it is zero
        return ((u + code_offset) * s[:, :, None]).view(n, k)
    o = offset.float()
    if scale.dtype == torch.bfloat16:
        o = o - (1 << (bits - 1)) * s
    # One rounding of s * c + o, as the C++ op's std::fma: the product of a 24-bit scale and an 8-bit code is
    # exact in float64, and so is the sum wherever o is not below 2**-29 of it (always, for stored offsets).
    w = u.double() * s.double()[:, :, None] + o.double()[:, :, None]
    return w.float().view(n, k)


def lowbit_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                            bits: int, group_size: int, n: int, k: int, codes: int = CODES_UINT,
                            code_offset: int = 0, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-PyTorch ``lowbit_linear``: unpack, dequantize to fp32, ``F.linear`` in fp32, cast to ``x.dtype``.
    compute_dtype=torch.bfloat16: the result for ``x.to(torch.bfloat16)``, cast back to ``x.dtype``."""
    _check_args(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, compute_dtype)
    w = _dequantize(packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    xc = x if compute_dtype is None else x.to(compute_dtype)
    return F.linear(xc.float(), w).to(xc.dtype).to(x.dtype)


# --------------------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------------------
#: os.environ's own bytes mapping (POSIX), kept in step with it by its setters: one dict lookup per call on the
#: linear route (`is_available`), where os.environ.get's encode / decode frames cost microseconds with cold caches.
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_DISABLE_BYTES = os.fsencode(_ENV_DISABLE)


def _env_disable_value() -> str:
    if _ENVIRON_BYTES is None:
        return os.environ.get(_ENV_DISABLE, "")
    val = _ENVIRON_BYTES.get(_ENV_DISABLE_BYTES)
    return "" if val is None else os.fsdecode(val)


def _disabled_reason() -> str | None:
    if _override is not None:
        return "disabled by affineq.cpp._set_disabled(True)" if _override else None
    val = _env_disable_value()
    if val.strip().lower() not in ("", "0", "false", "no", "off"):
        return f"disabled by {_ENV_DISABLE}={val}"
    return None


def _push_disabled(flag: bool) -> None:
    """Mirror the kill switch into the loaded C++ kernel, which otherwise stays registered."""
    global _cpp_disabled_flag
    if _lib_path is not None and _cpp_disabled_flag is not flag:
        torch.ops.affineq_cpp.set_disabled(flag)
        _cpp_disabled_flag = flag


def _load() -> str | None:
    """Build (once per process, cached on disk) and load the library; return the failure reason or None."""
    global _lib_path, _load_error, _load_tried, _int8_codes
    if _lib_path is not None:  # loaded: no lock on the per-call path
        return None
    with _lock:
        if _lib_path is None and not _load_tried:
            _load_tried = True
            try:
                path = _build.build(verbose=os.environ.get("AFFINEQ_VERBOSE_BUILD", "") not in ("", "0"))
                torch.ops.load_library(path)
                _lib_path = path
                _int8_codes = bool(torch.ops.affineq_cpp.int8_codes_built())
            except _build.CompilerNotFoundError as e:
                _load_error = str(e)
            except Exception as e:  # noqa: BLE001 - any failure means "fall back", with the reason kept
                _load_error = f"building/loading the C++ kernels failed: {e}"
        return None if _lib_path is not None else _load_error


def is_available() -> bool:
    """True if the C++ kernels are built, loaded and not disabled (builds on first call, then cached)."""
    if _lib_path is not None and _cpp_disabled_flag is False and _override is not True \
            and (_override is False or _ENVIRON_BYTES is not None and _ENV_DISABLE_BYTES not in _ENVIRON_BYTES):
        return True  # loaded, enabled in C++ and not switched off: every linear call asks, so no frames here
    reason = _disabled_reason()
    if reason is None:
        reason = _load()
    if _lib_path is not None:
        _push_disabled(reason is not None)
    return reason is None


def unavailable_reason() -> str | None:
    """Why ``is_available()`` is False, as a sentence; None when the kernels are available."""
    if is_available():
        return None
    return _disabled_reason() or _load_error


class _Restore:
    def __init__(self, prev: bool | None) -> None:
        self._prev = prev

    def __enter__(self) -> _Restore:
        return self

    def __exit__(self, *exc: object) -> None:
        _set_disabled(self._prev)


def _set_disabled(flag: bool | None) -> _Restore:
    """Force the kernels off (True), on (False) or back to the environment (None).

    Usable as a plain call or as ``with _set_disabled(True): ...`` (restores the previous setting).
    """
    global _override
    with _lock:
        prev, _override = _override, flag
        if _lib_path is not None:
            _push_disabled(_disabled_reason() is not None)
    compile_cache.refresh()
    return _Restore(prev)


compile_cache.track("cpp_disabled", _disabled_reason)  # a cached graph must not call kernels switched off here
# Another build of the kernels (the tests' other-ISA builds, AFFINEQ_CPP_MARCH in _build.py) may lack a kernel a
# graph cached with the native build calls (int8_codes_linear off AVX512-VNNI): key on the build asked for.
compile_cache.track("cpp_march", lambda: os.environ.get("AFFINEQ_CPP_MARCH", "native"))


def int8_codes_built() -> bool:
    """Whether the kernels are available and the build has `affineq::int8_codes_linear`'s kernel (AVX512-VNNI
    and VBMI)."""
    return is_available() and _int8_codes


def kernel_info() -> dict[str, Any]:
    """Diagnostics: availability, reason, library path, compiled SIMD path and build seconds."""
    ok = is_available()
    return {
        "available": ok,
        "reason": unavailable_reason(),
        "library": _lib_path,
        "isa": torch.ops.affineq_cpp.isa() if _lib_path is not None else None,
        "build_seconds": _build.last_build_seconds,
    }


# --------------------------------------------------------------------------------------------------------
# The ops: schemas + fake impls here; CPU kernels and the autograd kernel (dL/dx = dL/dy @ W) come from C++ and
# are registered when the library loads. The Python CompositeExplicitAutograd impls only run until then.
# --------------------------------------------------------------------------------------------------------
_lib = torch.library.Library("affineq", "FRAGMENT")
_lib.define(
    "lowbit_linear(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n, int k,"
    " int codes=0, int code_offset=0) -> Tensor"
)
# lowbit_linear for x.to(bfloat16), cast back to x's dtype (float32 or bfloat16): the bf16 kernels read float32 x
# rounded and write y widened themselves. A separate op, not an argument of lowbit_linear: a changed schema breaks
# the graphs torch.compile cached calling the old one (tests/test_op_schemas.py pins them).
_lib.define(
    "lowbit_linear_bf16_compute(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size,"
    " int n, int k, int codes=0, int code_offset=0) -> Tensor"
)
# lowbit_linear (bf16_compute: lowbit_linear_bf16_compute) + bias, bias [n] in x's dtype, bit for bit: the kernels
# add it as they store y (a separate add would read and write all of y again). An inference op (no derivative).
_lib.define(
    "lowbit_linear_biased(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n,"
    " int k, int codes, int code_offset, bool bf16_compute, Tensor bias) -> Tensor"
)
_lib.define(
    "lowbit_dequantize(Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n, int k,"
    " int codes=0, int code_offset=0) -> Tensor"
)
# dequantize(quantize(x)) of int8 activations [M, K]; mode 0 symmetric, 1 symmetric without clipping, 2
# asymmetric. CPU kernel only (callers check is_available()); see affineq.tensor.activation.
_lib.define("int8_fake_quant(Tensor x, bool per_token, int mode, float eps) -> Tensor")
# lowbit_linear(int8_fake_quant(x.reshape(-1, k), per_token, mode, eps), ...) for x [..., k], bit for bit (8da4w's
# linear): where the AMX GEMM runs (bf16 x) it quantizes x's rows as it packs them, no quantized copy of x.
_lib.define(
    "lowbit_linear_int8_act(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n,"
    " int k, int codes, int code_offset, bool per_token, int mode, float eps) -> Tensor"
)
# lowbit_linear_int8_act(x.to(bf16), ...).to(float32) for float32 x (a weight whose compute_dtype is bf16), bit for
# bit; where the AMX GEMM runs it writes the bf16 values as float32 itself. Its own op, as lowbit_linear_bf16_compute.
_lib.define(
    "lowbit_linear_int8_act_bf16_compute(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits,"
    " int group_size, int n, int k, int codes, int code_offset, bool per_token, int mode, float eps) -> Tensor"
)


# One direction of one recurrent layer over all timesteps (affineq.recurrent): gi [N, G*H] is the input projection
# of every step, batch_sizes the rows of each step; the recurrent weight [G*H, H] is a dense-format weight.
# cell 0 LSTM, 1 GRU, 2 RNN tanh, 3 RNN relu; act_mode -1 (float h) or an int8_fake_quant mode. Returns
# (output [N, H], h_n [B, H], c_n [B, H] for an LSTM, else an empty tensor). CPU kernel only.
_lib.define(
    "lowbit_rnn_layer(Tensor gi, int[] batch_sizes, Tensor h0, Tensor? c0, Tensor? bias_hh, Tensor packed,"
    " Tensor scale, Tensor? offset, int bits, int group_size, int codes, int code_offset, int act_mode,"
    " bool act_per_token, float act_eps, int cell, bool reverse) -> (Tensor, Tensor, Tensor)"
)
# The same for a weight computed in bf16 (QuantSpec.compute_dtype): each step's product as
# lowbit_linear_bf16_compute gives it (h rounded to bf16, y's bf16 values). Float h only (act_mode -1). Its own op:
# a schema never changes (tests/test_op_schemas.py).
_lib.define(
    "lowbit_rnn_layer_bf16_compute(Tensor gi, int[] batch_sizes, Tensor h0, Tensor? c0, Tensor? bias_hh,"
    " Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int codes, int code_offset,"
    " int act_mode, bool act_per_token, float act_eps, int cell, bool reverse) -> (Tensor, Tensor, Tensor)"
)


# int8_fake_quant(x) @ W^T with the code products summed exactly in int32 (cpp/gemm_int8_codes.cpp): x float32
# or bfloat16 [M, K] (quantized in fp32, y in x's dtype), W an 8- or 4-bit integer dense-format weight [n, k]
# (fp32 / bf16 / fp16 qparams, code_offset as lowbit_linear's); mode as int8_fake_quant. CPU kernel only, on
# builds where int8_codes_built() (AVX512-VNNI + VBMI); n % 16 == 0, group_size % 8 == 0. With fewer than
# min_rows rows of x it returns lowbit_linear(int8_fake_quant(x), ...) instead (where the fused GEMV is faster):
# one op whatever M, so a graph with a symbolic M runs what eager runs.
# int8_codes_linear_bf16_compute: the same for x.to(torch.bfloat16), its result widened to float32 (a weight
# whose compute_dtype is bf16): float32 x is read rounded and y written as its bf16 values by the kernel itself,
# bit for bit the bf16 op's result.
def _int8_codes_linear_fake(x, packed, scale, offset, group_size, n, k, per_token, mode, eps, bits=8,
                            code_offset=0, min_rows=0):
    return x.new_empty((x.shape[0], n))


for _name in ("int8_codes_linear", "int8_codes_linear_bf16_compute"):
    _lib.define(
        f"{_name}(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int group_size, int n, int k,"
        " bool per_token, int mode, float eps, int bits=8, int code_offset=0, int min_rows=0) -> Tensor"
    )
    torch.library.register_fake(f"affineq::{_name}", _int8_codes_linear_fake, lib=_lib)


# int8_codes_linear_biased: either op above (bf16_compute picks) with the bias added as y is stored: bias [n] in
# x's dtype, bit for bit the op's result + bias (bf16 y: rounded, then the sum rounded, as aten's add rounds it),
# without a separate pass over y (benchmarks/README.md, kernel design measurements).
_lib.define(
    "int8_codes_linear_biased(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int group_size, int n, int k,"
    " bool per_token, int mode, float eps, int bits, int code_offset, int min_rows, bool bf16_compute, Tensor bias)"
    " -> Tensor"
)


@torch.library.register_fake("affineq::int8_codes_linear_biased", lib=_lib)
def _int8_codes_linear_biased_fake(x, packed, scale, offset, group_size, n, k, per_token, mode, eps, bits,
                                   code_offset, min_rows, bf16_compute, bias):
    return x.new_empty((x.shape[0], n))


def _lowbit_rnn_layer_fake(gi, batch_sizes, h0, c0, bias_hh, packed, scale, offset, bits, group_size, codes,
                           code_offset, act_mode, act_per_token, act_eps, cell, reverse):
    hidden = h0.shape[1]
    c_n = h0.new_empty(h0.shape) if cell == 0 else h0.new_empty((0,))
    return gi.new_empty((gi.shape[0], hidden)), h0.new_empty(h0.shape), c_n


for _name in ("lowbit_rnn_layer", "lowbit_rnn_layer_bf16_compute"):
    torch.library.register_fake(f"affineq::{_name}", _lowbit_rnn_layer_fake, lib=_lib)


@torch.library.register_fake("affineq::int8_fake_quant", lib=_lib)
def _int8_fake_quant_fake(x, per_token, mode, eps):
    return torch.empty_like(x)


@torch.library.register_fake(_OP, lib=_lib)
def _lowbit_linear_fake(x, packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT, code_offset=0):
    _check_args(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::lowbit_linear_int8_act", lib=_lib)
def _lowbit_linear_int8_act_fake(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, per_token,
                                 mode, eps):
    _check_args(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::lowbit_linear_int8_act_bf16_compute", lib=_lib)
def _lowbit_linear_int8_act_bf16_compute_fake(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset,
                                              per_token, mode, eps):
    _check_args(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, torch.bfloat16)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::lowbit_linear_bf16_compute", lib=_lib)
def _lowbit_linear_bf16_compute_fake(x, packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT,
                                     code_offset=0):
    _check_args(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, torch.bfloat16)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::lowbit_linear_biased", lib=_lib)
def _lowbit_linear_biased_fake(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, bf16_compute,
                               bias):
    _check_args(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset,
                torch.bfloat16 if bf16_compute else None)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::lowbit_dequantize", lib=_lib)
def _lowbit_dequantize_fake(packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT, code_offset=0):
    return scale.new_empty((n, k), dtype=torch.float32)


def _lowbit_linear_fallback(x, packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT, code_offset=0,
                            compute_dtype=None):
    # Runs only while no C++ CPU kernel is registered (compute_dtype: lowbit_linear_bf16_compute's): load it,
    # then dispatch again to reach it.
    if x.device.type != "cpu":
        raise NotImplementedError(f"affineq::lowbit_linear only supports CPU tensors, got x on {x.device}")
    if not is_available():
        # Reached only by a graph compiled while the kernels were available (torch's compile caches do not key
        # on that): compute the same numbers in PyTorch, and say so as every dequantize fallback does.
        from affineq.tensor.fallback import announce_fallback

        announce_fallback("dense", f"the affineq C++ kernels are unavailable ({unavailable_reason()})")
        return lowbit_linear_reference(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset,
                                       compute_dtype)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "CPU"):
        raise RuntimeError(f"affineq: {_lib_path} loaded but did not register a CPU kernel for {_OP}")
    if compute_dtype is not None:
        return torch.ops.affineq.lowbit_linear_bf16_compute(x, packed, scale, offset, bits, group_size, n, k, codes,
                                                            code_offset)
    return torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset)


def _lowbit_dequantize_fallback(packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT, code_offset=0):
    # Pure PyTorch until (or unless) the C++ kernel is registered.
    return _dequantize(packed, scale, offset, bits, group_size, n, k, codes, code_offset)


def _lowbit_linear_biased_fallback(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, bf16_compute,
                                   bias):
    # As _lowbit_linear_fallback: the unbiased op (which loads the kernels or announces the reference), then the add.
    return _lowbit_linear_fallback(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset,
                                   torch.bfloat16 if bf16_compute else None) + bias


_lib.impl("lowbit_linear", _lowbit_linear_fallback, "CompositeExplicitAutograd")
_lib.impl("lowbit_linear_biased", _lowbit_linear_biased_fallback, "CompositeExplicitAutograd")
_lib.impl("lowbit_linear_bf16_compute", functools.partial(_lowbit_linear_fallback, compute_dtype=torch.bfloat16),
          "CompositeExplicitAutograd")

# The dense weight as float at memory speed (cpp/dequant_gemm.cpp): W [n, k] with the values of
# `formats.Dense.dequantize` bit for bit (see dense_dequantize_reference), float32 or (bf16=True) bfloat16.
_lib.define(
    "dense_dequantize(Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n, int k,"
    " int codes, int code_offset, bool canonical, bool bf16) -> Tensor"
)
# x @ W^T with W dequantized in cached row blocks and multiplied by torch's GEMM (cpp/dequant_gemm.cpp): fp32
# products of x.float() and the fp32 W, or (bf16_weight=True, bf16 x) the bf16 GEMM of x and W.to(bf16). With
# fewer than min_rows rows of x it returns lowbit_linear(x, ...) instead (the fused kernels are faster there): one
# op whatever M, so a graph with a symbolic M runs what eager runs.
_lib.define(
    "dequant_linear(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n, int k,"
    " int codes, int code_offset, bool canonical, bool bf16_weight, int min_rows=0) -> Tensor"
)


@torch.library.register_fake("affineq::dense_dequantize", lib=_lib)
def _dense_dequantize_fake(packed, scale, offset, bits, group_size, n, k, codes, code_offset, canonical, bf16):
    return scale.new_empty((n, k), dtype=torch.bfloat16 if bf16 else torch.float32)


@torch.library.register_fake("affineq::dequant_linear", lib=_lib)
def _dequant_linear_fake(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, canonical, bf16_weight,
                         min_rows=0):
    return x.new_empty((*x.shape[:-1], n))


def dense_dequantize_reference(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                               group_size: int, n: int, k: int, codes: int = CODES_UINT, code_offset: int = 0,
                               canonical: bool = False, bf16: bool = False) -> torch.Tensor:
    """Pure-PyTorch ``dense_dequantize``: ``scale * c(u) + offset`` rounded once (as ``lowbit_dequantize``), or,
    ``canonical`` (fp32 qparams of integer codes), ``(u + round(offset / scale)) * scale`` per group; without an
    offset, ``scale * (c(u) + code_offset)``."""
    if canonical and offset is not None:
        u = _dequantize(packed, torch.ones_like(scale), torch.zeros_like(offset), bits, group_size, n, k, codes)
        u = u.view(n, k // group_size, group_size)
        w = ((u + torch.round(offset / scale).unsqueeze(-1)) * scale.unsqueeze(-1)).view(n, k)
    else:
        w = _dequantize(packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    return w.to(torch.bfloat16 if bf16 else torch.float32)


def _dequant_linear_fallback(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, canonical,
                             bf16_weight, min_rows=0):
    # Runs only while no C++ CPU kernel is registered (e.g. a graph compiled while the kernels were available).
    if x.numel() // k < min_rows:
        return torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    w = dense_dequantize_reference(packed, scale, offset, bits, group_size, n, k, codes, code_offset, canonical,
                                   bf16_weight)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


_lib.impl("lowbit_dequantize", _lowbit_dequantize_fallback, "CompositeExplicitAutograd")
_lib.impl("dense_dequantize", dense_dequantize_reference, "CompositeExplicitAutograd")
_lib.impl("dequant_linear", _dequant_linear_fallback, "CompositeExplicitAutograd")

# Several dense weights on one input (q / k / v, gate / up) in one call: cat([lowbit_linear(x, packed[i],
# scale[i], offset[i], ..., n[i], ...)], -1), every weight with the same bits, group_size, codes, code_offset and
# qparam dtype. Where the fused GEMV serves them (small M), one pool of work items over all of their panels: one
# call and one thread fork for all, no weight copied. Inference only (no autograd kernel).
_lib.define(
    "lowbit_linear_multi(Tensor x, Tensor[] packed, Tensor[] scale, Tensor?[] offset, int bits, int group_size,"
    " int[] n, int k, int codes=0, int code_offset=0) -> Tensor"
)


@torch.library.register_fake("affineq::lowbit_linear_multi", lib=_lib)
def _lowbit_linear_multi_fake(x, packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT, code_offset=0):
    for p, s, o, ni in zip(packed, scale, offset, n, strict=True):
        _check_args(x, p, s, o, bits, group_size, ni, k, codes, code_offset)
    return x.new_empty((*x.shape[:-1], sum(n)))


def _lowbit_linear_multi_fallback(x, packed, scale, offset, bits, group_size, n, k, codes=CODES_UINT,
                                  code_offset=0):
    # The per-weight op (C++ where registered, else its own fallback), concatenated.
    return torch.cat([torch.ops.affineq.lowbit_linear(x, p, s, o, bits, group_size, ni, k, codes, code_offset)
                      for p, s, o, ni in zip(packed, scale, offset, n, strict=True)], -1)


_lib.impl("lowbit_linear_multi", _lowbit_linear_multi_fallback, "CompositeExplicitAutograd")
