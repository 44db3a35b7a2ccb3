"""Argument validation shared by the primitives: pure Python on shapes and dtypes (free under torch.compile),
and `_Blocks`, the blocked view of a tensor that qparams broadcast over."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from affineq.dtypes import is_float_target

if TYPE_CHECKING:  # the enum lives in affineq.primitives (its pickled path), which imports this module
    from affineq.primitives import ZeroPointDomain


def _check_enum(name: str, value, enum_cls: type[enum.Enum]) -> None:
    if not isinstance(value, enum_cls):
        valid = ", ".join(f"{enum_cls.__name__}.{m.name}" for m in enum_cls)
        raise ValueError(f"{name} must be one of {valid}, got {value!r}")


def _check_float_input(fn: str, input) -> None:
    if not isinstance(input, torch.Tensor):
        raise ValueError(f"{fn}: input must be a torch.Tensor, got {type(input).__name__}")
    if not input.dtype.is_floating_point:
        raise ValueError(
            f"{fn}: input must be a floating-point tensor (bf16/fp16/fp32), got {input.dtype}; "
            "convert it with input.float() first"
        )


def _check_block_size(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(shape)
    if not isinstance(block_size, (tuple, list, torch.Size)):
        raise ValueError(f"block_size must be a tuple of ints, one per input dim, got {block_size!r}")
    block = tuple(block_size)
    if len(block) != len(shape):
        raise ValueError(
            f"block_size {block} has {len(block)} entries but the input shape {shape} has rank {len(shape)}; "
            "give one entry per dim (affineq.granularity.get_block_size(shape, granularity) builds it)"
        )
    for i, (d, b) in enumerate(zip(shape, block, strict=True)):
        if isinstance(b, bool) or not isinstance(b, int):
            raise ValueError(
                f"block_size[{i}]={b!r} must be an int (a positive divisor of dim {i}, size {d}, of input shape "
                f"{shape}); pass block_size as a tuple of ints, e.g. {tuple(int(x) for x in shape)} per tensor"
            )
        if b < 1 or d % b != 0:
            raise ValueError(
                f"block_size[{i}]={b!r} does not divide dim {i} (size {d}) of input shape {shape}; "
                f"each entry must be a positive divisor of {d} (1 = one qparam per index, {d} = whole dim)"
            )
    return block


def _check_zero_point(fn: str, zero_point, domain: ZeroPointDomain, dtype: torch.dtype) -> None:
    if is_float_target(dtype):
        if zero_point is not None:
            raise ValueError(
                f"{fn}: zero_point must be None for float target {dtype} (no zero point); pass zero_point=None"
            )
    elif domain.name == "NONE":
        if zero_point is not None:
            raise ValueError(
                f"{fn}: zero_point was given but zero_point_domain=ZeroPointDomain.NONE; "
                "pass zero_point=None or use ZeroPointDomain.INT / FLOAT"
            )
    elif zero_point is None:
        raise ValueError(
            f"{fn}: zero_point is None but zero_point_domain={domain}; pass the zero_point returned by "
            "choose_qparams_affine, or use ZeroPointDomain.NONE for symmetric qparams without zero point"
        )


class _Blocks:
    """Reshapes between an input of ``shape`` and its blocked view ``[n0, b0, n1, b1, ...]``.

    Qparams broadcast against the blocked view as ``[n0, 1, n1, 1, ...]``; reducing the odd dims of the
    blocked view yields the reduced (qparam) shape ``[n0, n1, ...]``.
    """

    def __init__(self, shape: Sequence[int], block_size: Sequence[int]) -> None:
        self.shape = tuple(shape)
        self.block = _check_block_size(self.shape, block_size)
        self.reduced = tuple(d // b for d, b in zip(self.shape, self.block, strict=True))
        self.blocked = tuple(x for n, b in zip(self.reduced, self.block, strict=True) for x in (n, b))
        self.qparam_view = tuple(x for n in self.reduced for x in (n, 1))
        self.reduce_dims = tuple(range(1, 2 * len(self.shape), 2))

    def qparam(self, name: str, t, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``t`` (any shape with one element per block) as a ``dtype`` tensor shaped to broadcast."""
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t, device=device)
        n = math.prod(self.reduced)
        if t.numel() != n:
            raise ValueError(
                f"{name} has {t.numel()} elements (shape {tuple(t.shape)}) but block_size {self.block} on "
                f"input shape {self.shape} gives {n} blocks (qparam shape {self.reduced}); pass the {name} that "
                "choose_qparams_affine returns for this input shape and block_size"
            )
        return t.to(dtype).reshape(self.qparam_view)


def _compute_dtype(qmin: float, qmax: float) -> torch.dtype:
    # float32 represents every integer up to 2**24 exactly; int32 codes need float64.
    return torch.float32 if max(abs(qmin), abs(qmax)) <= 2**24 else torch.float64


def _midpoint(qmin: int, qmax: int) -> float:
    return (qmax + qmin + 1) / 2
