"""Hashable metadata of a quantized tensor: what the codes mean (`QuantSpec`) and how activations are
quantized on the fly (`ActivationQuant`).

Both are frozen dataclasses of plain values (dtypes, ints, tuples, enums, strings): no callables, so
`torch.compile` guards on them cheaply and `torch.load(weights_only=True)` can rebuild them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from affineq.primitives import MappingType, ZeroPointDomain


@dataclass(frozen=True)
class ActivationQuant:
    """How `ops.linear` quantizes its input before the matmul (dynamic activation quantization).

    granularity: "per_token" (one scale per row of the flattened [M, K] input) or "per_tensor".
    For float8 targets `mapping_type` must be SYMMETRIC and `zero_point_domain` NONE.
    """

    dtype: torch.dtype = torch.int8
    mapping_type: MappingType = MappingType.SYMMETRIC
    granularity: str = "per_token"
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT
    eps: float | None = None

    def __post_init__(self) -> None:
        if self.granularity not in ("per_token", "per_tensor"):
            raise ValueError(
                f"ActivationQuant.granularity={self.granularity!r}: use 'per_token' or 'per_tensor'"
            )


@dataclass(frozen=True)
class QuantSpec:
    """Everything needed to interpret the stored tensors of an `AffineQuantizedTensor`.

    shape/dtype: the logical (float) tensor; target_dtype: the code dtype (torch.int4, torch.uint4,
    torch.int8, torch.float8_e4m3fn, ...); block_size: one entry per dim of `shape` (the untransposed
    layout); fmt: packing format name; transposed: a 2-D tensor viewed as its transpose without moving data;
    act_quant: dynamic activation quantization applied by linear, or None for weight-only.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    target_dtype: torch.dtype
    block_size: tuple[int, ...]
    quant_min: int | float
    quant_max: int | float
    zero_point_domain: ZeroPointDomain
    mapping_type: MappingType
    fmt: str
    transposed: bool = False
    act_quant: ActivationQuant | None = None

    def replace(self, **changes) -> QuantSpec:
        return dataclasses.replace(self, **changes)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """Shape the user sees: `shape`, or its transpose when `transposed`."""
        return (self.shape[1], self.shape[0]) if self.transposed else self.shape

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(s // b for s, b in zip(self.shape, self.block_size, strict=False))
