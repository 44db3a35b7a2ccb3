"""Granularities: which elements of a tensor share one scale / zero point.

A granularity is a frozen, hashable description; :func:`get_block_size` turns it into the ``block_size``
tuple the primitives take (same rank as the tensor, each entry the extent of one block along that dim).

=================  =================================  ==========================================
granularity        block_size for shape (d0, .., dn)  qparams shape (``dim // block`` per dim)
=================  =================================  ==========================================
PerTensor()        (d0, .., dn)                       (1, .., 1)
PerAxis(a)         shape with 1 at ``a``              d_a at ``a``, 1 elsewhere
PerGroup(g)        (1, .., 1, g)                      (d0, .., d(n-1), dn // g)
PerToken()         (1, .., 1, dn)                     (d0, .., d(n-1), 1)
PerRow()           (1, .., 1, dn)                     (d0, .., d(n-1), 1)
PerBlock(sizes)    sizes                              (d_i // sizes_i per dim)
=================  =================================  ==========================================

PerToken is meant for activations (one qparam per token over all leading dims), PerRow for weights (one
per output row); they produce the same blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "Granularity",
    "PerAxis",
    "PerBlock",
    "PerGroup",
    "PerRow",
    "PerTensor",
    "PerToken",
    "get_block_size",
    "parse_granularity",
]


def _check_int(name: str, value, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class Granularity:
    """Base class of all granularities."""


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One qparam for the whole tensor."""


@dataclass(frozen=True)
class PerAxis(Granularity):
    """One qparam per index along ``axis`` (negative axes count from the end)."""

    axis: int

    def __post_init__(self) -> None:
        _check_int("axis", self.axis)


@dataclass(frozen=True)
class PerGroup(Granularity):
    """One qparam per ``group_size`` consecutive elements of the last dim (tensors of rank >= 2)."""

    group_size: int

    def __post_init__(self) -> None:
        _check_int("group_size", self.group_size, minimum=1)


@dataclass(frozen=True)
class PerToken(Granularity):
    """One qparam per row of all leading dims (activations): block ``(1, .., 1, K)``."""


@dataclass(frozen=True)
class PerRow(Granularity):
    """One qparam per output row (weights): block ``(1, .., 1, K)``."""


@dataclass(frozen=True)
class PerBlock(Granularity):
    """Explicit block sizes, one per dim; each must divide its dim. Lists are stored as tuples."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        for i, s in enumerate(sizes):
            _check_int(f"sizes[{i}]", s, minimum=1)
        object.__setattr__(self, "sizes", sizes)


def _nearby_divisors(n: int, target: int, count: int = 5) -> list[int]:
    """The ``count`` divisors of ``n`` closest to ``target`` on a log scale, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = set(small) | {n // d for d in small}
    best = sorted(divisors, key=lambda d: abs(math.log(d / target)))[:count]
    return sorted(best)


def _per_tensor(shape: tuple[int, ...], g: PerTensor) -> tuple[int, ...]:
    return shape


def _per_axis(shape: tuple[int, ...], g: PerAxis) -> tuple[int, ...]:
    if not -len(shape) <= g.axis < len(shape):
        raise ValueError(
            f"PerAxis(axis={g.axis}) is out of range for a tensor of shape {shape} "
            f"(valid axes: {-len(shape)}..{len(shape) - 1})"
        )
    axis = g.axis % len(shape)
    return tuple(1 if i == axis else d for i, d in enumerate(shape))


def _per_group(shape: tuple[int, ...], g: PerGroup) -> tuple[int, ...]:
    if len(shape) < 2:
        raise ValueError(
            f"PerGroup(group_size={g.group_size}) got shape {shape}: "
            "group_size needs a 2-D or higher weight; use PerTensor() or PerAxis(0) for 1-D"
        )
    k = shape[-1]
    if k % g.group_size != 0:
        raise ValueError(
            f"group_size={g.group_size} does not divide the last dim {k} of shape {shape}; "
            f"group sizes that would work include {_nearby_divisors(k, g.group_size)}"
        )
    return (1,) * (len(shape) - 1) + (g.group_size,)


def _per_last_dim(shape: tuple[int, ...], g: PerToken | PerRow) -> tuple[int, ...]:
    if len(shape) < 1:
        raise ValueError(f"{g} needs a tensor of rank >= 1, got shape {shape}; use PerTensor()")
    return (1,) * (len(shape) - 1) + (shape[-1],)


def _per_block(shape: tuple[int, ...], g: PerBlock) -> tuple[int, ...]:
    if len(g.sizes) != len(shape):
        raise ValueError(
            f"PerBlock sizes {g.sizes} have rank {len(g.sizes)} but the tensor shape {shape} has rank "
            f"{len(shape)}; give one block extent per dim"
        )
    for i, (d, b) in enumerate(zip(shape, g.sizes, strict=True)):
        if d % b != 0:
            raise ValueError(
                f"PerBlock sizes[{i}]={b} does not divide dim {i} of shape {shape} ({d}); "
                f"sizes that would work include {_nearby_divisors(d, b)}"
            )
    return g.sizes


_BLOCK_SIZE_RULES: dict[type, Callable] = {
    PerTensor: _per_tensor,
    PerAxis: _per_axis,
    PerGroup: _per_group,
    PerToken: _per_last_dim,
    PerRow: _per_last_dim,
    PerBlock: _per_block,
}


def get_block_size(shape: Sequence[int], granularity: Granularity) -> tuple[int, ...]:
    """The ``block_size`` (a tuple with one entry per dim of ``shape``) for ``granularity``.

    Raises ValueError if the granularity does not fit the shape (see the module table).
    """
    shape = tuple(int(d) for d in shape)
    rule = _BLOCK_SIZE_RULES.get(type(granularity))
    if rule is None:
        raise ValueError(
            f"granularity must be one of {', '.join(c.__name__ for c in _BLOCK_SIZE_RULES)}, "
            f"got {granularity!r}"
        )
    return rule(shape, granularity)


# name -> (class, takes an int argument)
_PARSE_TABLE: dict[str, tuple[type, bool]] = {
    "per_tensor": (PerTensor, False),
    "per_axis": (PerAxis, True),
    "per_group": (PerGroup, True),
    "per_token": (PerToken, False),
    "per_row": (PerRow, False),
}
_VALID_STRINGS = ", ".join(f"'{n}:<int>'" if arg else f"'{n}'" for n, (_, arg) in _PARSE_TABLE.items())


def parse_granularity(spec: str) -> Granularity:
    """Parse ``"per_tensor"``, ``"per_axis:0"``, ``"per_group:128"``, ``"per_token"`` or ``"per_row"``."""
    if not isinstance(spec, str):
        raise ValueError(f"granularity string must be a str, got {spec!r}; valid: {_VALID_STRINGS}")
    name, sep, arg = spec.strip().partition(":")
    entry = _PARSE_TABLE.get(name.strip().lower())
    if entry is None:
        raise ValueError(f"unknown granularity {spec!r}; valid: {_VALID_STRINGS}")
    cls, takes_arg = entry
    if not takes_arg:
        if sep:
            raise ValueError(f"granularity {spec!r} takes no argument; valid: {_VALID_STRINGS}")
        return cls()
    try:
        value = int(arg.strip())
    except ValueError:
        raise ValueError(
            f"granularity {spec!r} needs an integer argument, e.g. '{name}:{0 if cls is PerAxis else 128}'; "
            f"valid: {_VALID_STRINGS}"
        ) from None
    return cls(value)
