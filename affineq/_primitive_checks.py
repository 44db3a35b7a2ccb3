"""Argument validation shared by the primitives: pure Python on shapes and dtypes (free under torch.compile).
The blocked view that qparams broadcast over is `affineq.blocks`."""

from __future__ import annotations

import enum
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


def _compute_dtype(qmin: float, qmax: float) -> torch.dtype:
    # float32 represents every integer up to 2**24 exactly; int32 codes need float64.
    return torch.float32 if max(abs(qmin), abs(qmax)) <= 2**24 else torch.float64
