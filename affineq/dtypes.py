"""Quantization targets: what one code means, as a hashable `QType` built from a format row.

A `QType` names an `IntFormat` (n-bit two's complement or unsigned) or a `FloatFormat` (sign + exponent +
mantissa bits). Every layer (primitives, `QuantSpec`, packing formats, kernels) keys on QTypes; wherever a
user passes a target, a torch dtype (``torch.int4``, ``torch.float8_e4m3fn``), a QType or its name
(``"fp6_e3m2"``) is turned into a QType by :func:`qtype`; the validators (`check_target_dtype`, the
primitives) take torch dtypes and QTypes, so ``qtype("fp6_e3m2")`` names a target torch has no dtype for.

Integer targets: ``int1``..``int8``, ``uint1``..``uint8``, ``int16``, ``int32`` (torch dtypes exist for all);
sub-byte codes are stored one per byte in an int8 (signed) or uint8 (unsigned) container. Float targets:
``float8_e4m3fn``, ``float8_e5m2`` (stored as themselves) and the OCP MX element types ``fp6_e2m3``,
``fp6_e3m2``, ``fp4_e2m1``, which torch has no dtype for: their codes are the format's bit patterns in a
uint8 container, rounded to nearest-even on the format's grid (`QType.encode` / `QType.decode`).
``e8m0`` (unsigned powers of two, 2**-127..2**127) is a *scale* type: `QuantSpec.scale_type` names it
when scales are restricted to powers of two and stored as exponent bytes.

A new target is one new row in ``_INT_ROWS`` / ``FLOAT_FORMATS`` plus, for a float format, its name in
``_ELEMENT_FLOATS``.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "FLOAT_FORMATS",
    "QTYPES",
    "QType",
    "qtype",
    "register_qtype",
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
    ``torch_dtype`` is the native torch dtype, or None when torch has none (then codes are bit patterns).
    ``signed=False`` drops the sign bit (``e8m0``).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    max_value: float
    min_normal: float
    torch_dtype: torch.dtype | None = None
    signed: bool = True

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits


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
        FloatFormat("e8m0", 8, 0, 2.0**127, 2.0**-127, signed=False),
    )
}

#: Float formats that are element (code) types; the rest (e8m0) only describe scales.
_ELEMENT_FLOATS = ("float8_e4m3fn", "float8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1")

_FLOAT_FORMATS: dict[torch.dtype, FloatFormat] = {
    f.torch_dtype: f for f in FLOAT_FORMATS.values() if f.torch_dtype is not None
}


@dataclass(frozen=True)
class QType:
    """A quantization target (or scale type): a name and its format row. Hashable, plain values.

    `container` stores one code per element: int8/uint8/int16/int32 for integers, the torch float8 dtype,
    or uint8 bit patterns (sign, exponent, mantissa from the top bit down) for float formats torch lacks.
    `qmin`/`qmax` are the code range: integers for integer types, +-max_value for float types.
    Pickles by name, so checkpoints hold no format rows.
    """

    name: str
    format: IntFormat | FloatFormat

    @property
    def is_float(self) -> bool:
        return isinstance(self.format, FloatFormat)

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def signed(self) -> bool:
        return self.format.signed

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with this name (torch.int4, torch.float8_e4m3fn), or None (fp6, fp4, e8m0)."""
        if isinstance(self.format, FloatFormat):
            return self.format.torch_dtype
        return getattr(torch, self.name, None)

    @property
    def container(self) -> torch.dtype:
        if isinstance(self.format, IntFormat):
            return self.format.container
        return self.format.torch_dtype or torch.uint8

    @property
    def qmin(self) -> int | float:
        f = self.format
        return f.qmin if isinstance(f, IntFormat) else (-f.max_value if f.signed else 0.0)

    @property
    def qmax(self) -> int | float:
        f = self.format
        return f.qmax if isinstance(f, IntFormat) else f.max_value

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self):
        return (qtype, (self.name,))

    # -- codes of float formats without a torch dtype ------------------------------------------------

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        """Codes in `container` for float values `v` that are already scaled, rounded to integers (integer
        types) or clamped to [qmin, qmax] (float types; rounded here to nearest-even on the grid)."""
        if not self.is_float:
            return v.to(self.container)
        if self.format.torch_dtype is not None:
            return v.to(self.format.torch_dtype)
        mags = torch.tensor(_magnitude_list(self.format), dtype=torch.float64, device=v.device)
        grid = round_to_float_format(v, self.format)
        code = torch.searchsorted(mags, grid.abs().to(mags.dtype)).to(torch.uint8)
        if self.signed:
            code = code | (torch.signbit(grid).to(torch.uint8) << (self.bits - 1))
        return code

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Real values of `codes` (as `encode` returns them) in `dtype`."""
        if not self.is_float or self.format.torch_dtype is not None:
            return codes.to(dtype)
        return torch.tensor(_value_list(self.format), dtype=dtype, device=codes.device)[codes.long()]


@functools.cache
def _magnitude_list(f: FloatFormat) -> tuple[float, ...]:
    """Non-negative values of a table float format by code (sign bit clear), ascending. Python floats: the
    tensors are built per call, as a cached tensor would be a real tensor inside a torch.compile trace."""
    bias = (1 << (f.exponent_bits - 1)) - 1
    out = []
    for c in range(1 << (f.exponent_bits + f.mantissa_bits)):
        e, m = c >> f.mantissa_bits, c & ((1 << f.mantissa_bits) - 1)
        if f.mantissa_bits == 0:  # e8m0: every code is 2**(e - bias); no zero, no subnormals
            out.append(2.0 ** (e - bias))
        elif e == 0:
            out.append(m * 2.0 ** (1 - bias - f.mantissa_bits))
        else:
            out.append((1 + m / (1 << f.mantissa_bits)) * 2.0 ** (e - bias))
    return tuple(out)


@functools.cache
def _value_list(f: FloatFormat) -> tuple[float, ...]:
    """Value of every code (sign bit included) of a table float format."""
    mags = _magnitude_list(f)
    return mags + tuple(-m for m in mags) if f.signed else mags


def round_to_float_format(v: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """Round `v` (already within +-max_value) to nearest-even on the grid of `f`, same dtype as `v`.

    Step at |v| in [2**e, 2**(e+1)) is 2**(e - mantissa_bits), and 2**(1 - bias - mantissa_bits) below
    min_normal (subnormals); rounding may carry into the next binade, whose values are still on the grid."""
    _, exp = torch.frexp(v.float())  # v = m * 2**exp, m in [0.5, 1)
    min_exp = 1 - ((1 << (f.exponent_bits - 1)) - 1)
    step_exp = torch.clamp(exp - 1, min=min_exp) - f.mantissa_bits
    step = torch.ldexp(torch.ones_like(v, dtype=torch.float32), step_exp)
    return (torch.round(v.float() / step) * step).clamp(-f.max_value, f.max_value).to(v.dtype)


_INT_ROWS: dict[str, IntFormat] = {str(d).removeprefix("torch."): f for d, f in _INT_FORMATS.items()}

#: Every known QType by name: integer targets, float targets, and scale types (e8m0).
QTYPES: dict[str, QType] = {
    **{n: QType(n, f) for n, f in _INT_ROWS.items()},
    **{n: QType(n, f) for n, f in FLOAT_FORMATS.items()},
}
_TARGET_NAMES: set[str] = {*_INT_ROWS, *_ELEMENT_FLOATS}


def register_qtype(t: QType, target: bool = True) -> QType:
    """Add a QType (a new format row); `target=False` registers a scale-only type. Returns `t`."""
    if not isinstance(t, QType):
        raise TypeError(f"register_qtype expects a QType, got {t!r}")
    if t.name in QTYPES and QTYPES[t.name] != t:
        raise ValueError(f"a different QType named {t.name!r} is already registered")
    QTYPES[t.name] = t
    if target:
        _TARGET_NAMES.add(t.name)
    return t


def qtype(target: QType | torch.dtype | str) -> QType:
    """The QType of a target given as a QType, a torch dtype (torch.int4) or a name ("fp6_e3m2")."""
    if isinstance(target, QType):
        return target
    name = str(target).removeprefix("torch.") if isinstance(target, torch.dtype) else target
    if isinstance(name, str) and name in QTYPES:
        return QTYPES[name]
    raise ValueError(f"{target!r} is not a known quantization type; known: {sorted(QTYPES)}")


SUPPORTED_TARGET_DTYPES: tuple[torch.dtype, ...] = (*_INT_FORMATS, *_FLOAT_FORMATS)


def _target_list() -> str:
    return ", ".join([str(d) for d in SUPPORTED_TARGET_DTYPES] + [n for n in sorted(_TARGET_NAMES)
                                                                  if QTYPES[n].torch_dtype is None])


def _target(dtype, param_name: str = "dtype") -> QType:
    """`qtype(dtype)` for a supported quantization target, else ValueError naming `param_name`."""
    try:  # names are for qtype() and JSON; validated targets are torch dtypes or QTypes, never bare strings
        t = qtype(dtype) if isinstance(dtype, (QType, torch.dtype)) else None
    except ValueError:
        t = None
    if t is None or t.name not in _TARGET_NAMES:
        raise ValueError(
            f"{param_name}={dtype!r} is not a supported quantization target dtype; supported: {_target_list()}"
        )
    return t


def check_target_dtype(dtype, param_name: str = "dtype"):
    """Return ``dtype`` (as given) if it is a supported target, else raise ValueError naming ``param_name``."""
    _target(dtype, param_name)
    return dtype


def is_integer_target(dtype) -> bool:
    """True for the supported integer targets (including sub-byte ``torch.intN``/``torch.uintN``)."""
    try:
        t = _target(dtype)
    except ValueError:
        return False
    return not t.is_float


def is_float_target(dtype) -> bool:
    """True for the supported float targets (float8, fp6, fp4)."""
    try:
        t = _target(dtype)
    except ValueError:
        return False
    return t.is_float


def int_format(dtype) -> IntFormat:
    """The :class:`IntFormat` row of an integer target; ValueError for anything else."""
    t = _target(dtype)
    if t.is_float:
        raise ValueError(f"{dtype} is a float target; integer code range is undefined (use float_range)")
    return t.format


def float_format(dtype) -> FloatFormat:
    """The :class:`FloatFormat` row of a float target; ValueError for anything else."""
    t = _target(dtype)
    if not t.is_float:
        raise ValueError(f"{dtype} is an integer target, not a float format (use qrange)")
    return t.format


def qrange(dtype) -> tuple[int, int]:
    """Default ``(quant_min, quant_max)`` of an integer target.

    Signed n-bit: ``(-2**(n-1), 2**(n-1) - 1)`` (so int1 is ``(-1, 0)``); unsigned n-bit: ``(0, 2**n - 1)``.
    """
    fmt = int_format(dtype)
    return fmt.qmin, fmt.qmax


def float_range(dtype) -> tuple[float, float]:
    """``(-max_value, max_value)`` of a float target, e.g. ``(-448.0, 448.0)`` for float8_e4m3fn."""
    fmt = float_format(dtype)
    return -fmt.max_value, fmt.max_value


def bit_width(dtype) -> int:
    """Bits per code: int4 -> 4, uint3 -> 3, int8 -> 8, float8_* -> 8, fp6_* -> 6."""
    return _target(dtype).bits


def container_dtype(dtype) -> torch.dtype:
    """The dtype that stores codes of ``dtype`` one per element.

    Signed sub-byte -> torch.int8, unsigned sub-byte -> torch.uint8, float formats without a torch dtype ->
    torch.uint8 (bit patterns), everything else -> itself.
    """
    return _target(dtype).container


def is_signed(dtype) -> bool:
    """Whether codes of a supported target can be negative (float targets are signed)."""
    return _target(dtype).signed


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
    _target(dtype, "target dtype")
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
