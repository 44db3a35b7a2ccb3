"""Quantization target dtypes: code ranges, bit widths, storage containers and float formats.

Every answer comes from two tables, ``_INT_FORMATS`` and ``_FLOAT_FORMATS`` (keyed by torch dtype), so a
new target is one new row. ``FLOAT_FORMATS`` additionally *describes* small float formats (fp6, fp4) that
torch has no dtype for yet; they are not quantization targets until a packed container exists for them.

Integer targets: ``torch.int8``, ``torch.uint8``, ``torch.int1``..``torch.int7``, ``torch.uint1``..
``torch.uint7``, ``torch.int16``, ``torch.int32``. Sub-byte codes are stored one per byte in an int8
(signed) or uint8 (unsigned) container. Float targets: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``,
stored as themselves.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "FLOAT_FORMATS",
    "SUPPORTED_TARGET_DTYPES",
    "FloatFormat",
    "IntFormat",
    "bit_width",
    "check_quant_range",
    "check_target_dtype",
    "container_dtype",
    "float_format",
    "float_range",
    "int_format",
    "is_float_target",
    "is_integer_target",
    "is_signed",
    "qrange",
]


@dataclass(frozen=True)
class IntFormat:
    """An n-bit integer code format: two's complement when ``signed``, else unsigned.

    ``container`` is the torch dtype that stores one code per element.
    """

    bits: int
    signed: bool
    container: torch.dtype

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1


@dataclass(frozen=True)
class FloatFormat:
    """A small float format: 1 sign bit + ``exponent_bits`` + ``mantissa_bits``.

    ``max_value`` is the largest finite magnitude, ``min_normal`` the smallest positive normal.
    ``torch_dtype`` is the native torch dtype, or None for formats that are only described so far.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    max_value: float
    min_normal: float
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


_INT_FORMATS: dict[torch.dtype, IntFormat] = {
    torch.int8: IntFormat(8, True, torch.int8),
    torch.uint8: IntFormat(8, False, torch.uint8),
    **{getattr(torch, f"int{n}"): IntFormat(n, True, torch.int8) for n in range(1, 8)},
    **{getattr(torch, f"uint{n}"): IntFormat(n, False, torch.uint8) for n in range(1, 8)},
    torch.int16: IntFormat(16, True, torch.int16),
    torch.int32: IntFormat(32, True, torch.int32),
}

# Values follow the OCP 8-bit float and MX specifications ("fn" = finite, no infinities).
FLOAT_FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("float8_e4m3fn", 4, 3, 448.0, 2.0**-6, torch.float8_e4m3fn),
        FloatFormat("float8_e5m2", 5, 2, 57344.0, 2.0**-14, torch.float8_e5m2),
        FloatFormat("fp6_e2m3", 2, 3, 7.5, 1.0),
        FloatFormat("fp6_e3m2", 3, 2, 28.0, 0.25),
        FloatFormat("fp4_e2m1", 2, 1, 6.0, 1.0),
    )
}

_FLOAT_FORMATS: dict[torch.dtype, FloatFormat] = {
    f.torch_dtype: f for f in FLOAT_FORMATS.values() if f.torch_dtype is not None
}

SUPPORTED_TARGET_DTYPES: tuple[torch.dtype, ...] = (*_INT_FORMATS, *_FLOAT_FORMATS)


def _dtype_list() -> str:
    return ", ".join(str(d) for d in SUPPORTED_TARGET_DTYPES)


def check_target_dtype(dtype: torch.dtype, param_name: str = "dtype") -> torch.dtype:
    """Return ``dtype`` if it is a supported target, else raise ValueError naming ``param_name``."""
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_TARGET_DTYPES:
        raise ValueError(
            f"{param_name}={dtype!r} is not a supported quantization target dtype; supported: {_dtype_list()}"
        )
    return dtype


def is_integer_target(dtype: torch.dtype) -> bool:
    """True for the supported integer targets (including sub-byte ``torch.intN``/``torch.uintN``)."""
    return dtype in _INT_FORMATS


def is_float_target(dtype: torch.dtype) -> bool:
    """True for the supported float targets (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in _FLOAT_FORMATS


def int_format(dtype: torch.dtype) -> IntFormat:
    """The :class:`IntFormat` row of an integer target; ValueError for anything else."""
    if dtype not in _INT_FORMATS:
        check_target_dtype(dtype)
        raise ValueError(f"{dtype} is a float target; integer code range is undefined (use float_range)")
    return _INT_FORMATS[dtype]


def float_format(dtype: torch.dtype) -> FloatFormat:
    """The :class:`FloatFormat` row of a float target; ValueError for anything else."""
    if dtype not in _FLOAT_FORMATS:
        check_target_dtype(dtype)
        raise ValueError(f"{dtype} is an integer target, not a float format (use qrange)")
    return _FLOAT_FORMATS[dtype]


def qrange(dtype: torch.dtype) -> tuple[int, int]:
    """Default ``(quant_min, quant_max)`` of an integer target.

    Signed n-bit: ``(-2**(n-1), 2**(n-1) - 1)`` (so int1 is ``(-1, 0)``); unsigned n-bit: ``(0, 2**n - 1)``.
    """
    fmt = int_format(dtype)
    return fmt.qmin, fmt.qmax


def float_range(dtype: torch.dtype) -> tuple[float, float]:
    """``(-max_value, max_value)`` of a float target, e.g. ``(-448.0, 448.0)`` for float8_e4m3fn."""
    fmt = float_format(dtype)
    return -fmt.max_value, fmt.max_value


def bit_width(dtype: torch.dtype) -> int:
    """Bits per code: int4 -> 4, uint3 -> 3, int8 -> 8, float8_* -> 8."""
    if dtype in _INT_FORMATS:
        return _INT_FORMATS[dtype].bits
    return float_format(dtype).bits


def container_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that stores codes of ``dtype`` one per element.

    Signed sub-byte -> torch.int8, unsigned sub-byte -> torch.uint8, everything else -> itself.
    """
    if dtype in _INT_FORMATS:
        return _INT_FORMATS[dtype].container
    return float_format(dtype).torch_dtype


def is_signed(dtype: torch.dtype) -> bool:
    """Whether codes of a supported target can be negative (float targets are signed)."""
    if dtype in _INT_FORMATS:
        return _INT_FORMATS[dtype].signed
    float_format(dtype)
    return True


def _check_bound(name: str, value, dtype: torch.dtype, lo, hi, integral: bool):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        kind = "an int" if integral else "a number"
        raise ValueError(f"{name} must be {kind} for target dtype {dtype}, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is outside the range of {dtype}, which is [{lo}, {hi}]")
    return int(value) if integral else float(value)


def check_quant_range(
    dtype: torch.dtype, quant_min: int | float | None = None, quant_max: int | float | None = None
) -> tuple[int, int] | tuple[float, float]:
    """Fill in and validate ``(quant_min, quant_max)`` for target ``dtype``.

    None means the dtype's full range (:func:`qrange` for integer targets, :func:`float_range` for float
    targets). Integer targets return ints, float targets floats. Raises ValueError (naming
    ``quant_min``/``quant_max``, the dtype and its range) for an unsupported dtype, a bound outside the
    dtype's range, a non-integer bound for an integer target, or ``quant_min > quant_max``.
    """
    check_target_dtype(dtype, "target dtype")
    integral = is_integer_target(dtype)
    lo, hi = qrange(dtype) if integral else float_range(dtype)
    qmin = lo if quant_min is None else _check_bound("quant_min", quant_min, dtype, lo, hi, integral)
    qmax = hi if quant_max is None else _check_bound("quant_max", quant_max, dtype, lo, hi, integral)
    if qmin > qmax:
        raise ValueError(
            f"quant_min={qmin} is greater than quant_max={qmax} for {dtype}; "
            f"both must satisfy {lo} <= quant_min <= quant_max <= {hi}"
        )
    return qmin, qmax
