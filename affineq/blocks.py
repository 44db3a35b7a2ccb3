"""The blocked view of a tensor that qparams broadcast over, and the rounding midpoint of a code range: the
numerics helpers shared by the primitives, the tensor subclass, the observers and QAT's fake quantizers (all of
which sit above this module)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["Blocks", "check_block_size", "midpoint"]


def check_block_size(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    """`block_size` as a tuple after checking it has one positive divisor of each dim of `shape`; ValueError
    naming the entry and the fix otherwise."""
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


class Blocks:
    """Reshapes between an input of ``shape`` and its blocked view ``[n0, b0, n1, b1, ...]``.

    Qparams broadcast against the blocked view as ``[n0, 1, n1, 1, ...]``; reducing the odd dims of the
    blocked view yields the reduced (qparam) shape ``[n0, n1, ...]``.
    """

    def __init__(self, shape: Sequence[int], block_size: Sequence[int]) -> None:
        self.shape = tuple(shape)
        self.block = check_block_size(self.shape, block_size)
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


def midpoint(qmin: int, qmax: int) -> float:
    """(qmin + qmax + 1) / 2: the code range's centre that float zero points (ZeroPointDomain.FLOAT) offset from."""
    return (qmax + qmin + 1) / 2
