"""Integer weight configs: weight-only (int4, int8, intx) and integer dynamic activations (W8A8, 8da4w)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from affineq.configs.base import (
    _POW2_SCALE_MODES,
    QuantConfig,
    _check_group_size,
    check_choice,
    resolve_format,
    row_block,
)
from affineq.dtypes import check_target_dtype, is_integer_target, is_signed, qtype
from affineq.granularity import Granularity, PerAxis, PerGroup, PerTensor, PerToken
from affineq.primitives import ROUNDING, MappingType, ZeroPointDomain
from affineq.tensor.spec import ActivationQuant, QParamOptions

__all__ = ["Int4WeightOnlyConfig", "Int8DynamicActivationInt4WeightConfig", "Int8DynamicActivationInt8WeightConfig",
           "Int8WeightOnlyConfig", "IntxWeightOnlyConfig"]


# -- weight-only integer configs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Int4WeightOnlyConfig(QuantConfig):
    """4-bit weights, one scale and zero point per `group_size` input channels; activations stay float.

    Default: asymmetric uint4 with a float zero point (the tinygemm scheme, preserve_zero=False).
    packing_format: "auto" (C++ `dense` kernel on CPU, else aten `int4_cpu`; `int4_cuda` on GPU),
    "dense", "int4_cpu", "int4_cuda" or "plain".
    scale_dtype: dtype of the scales and float zero points, bf16 by default (0.0625 B/param at group 64;
    its 2^-9 rounding is ~1/100 of the int4 step) or fp32; the aten int4 layouts need bf16.
    rounding: how weights round to codes, "half_even" (default), "half_away_from_zero" or "floor".
    """

    group_size: int = 128
    packing_format: str = "auto"
    mapping_type: MappingType = MappingType.ASYMMETRIC
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.FLOAT
    preserve_zero: bool = False
    scale_dtype: torch.dtype = torch.bfloat16
    rounding: str = "half_even"

    def __post_init__(self):
        super().__post_init__()
        check_choice("rounding", self.rounding, tuple(ROUNDING))
        if self.group_size is None:
            raise ValueError("Int4WeightOnlyConfig needs a group_size: pass group_size=32, 64, 128 or 256")
        _check_group_size(self.group_size, allow_none=False)
        check_choice("packing_format", self.packing_format, ("auto", "dense", "int4_cpu", "int4_cuda", "plain"))
        if self.packing_format.startswith("int4_") and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"packing_format={self.packing_format!r} needs group_size 32, 64, 128 or 256")
        check_choice("scale_dtype", self.scale_dtype, (torch.bfloat16, torch.float32))
        if self.packing_format.startswith("int4_") and self.scale_dtype != torch.bfloat16:
            raise ValueError(f"packing_format={self.packing_format!r} stores bf16 scales: use "
                             "scale_dtype=torch.bfloat16 (or packing_format='dense' for fp32 scales)")

    def _block_size(self, shape, module):
        return row_block(shape, self.group_size)

    def weight_spec(self, weight, module):
        signed = self.mapping_type is not MappingType.ASYMMETRIC
        spec = self._spec(weight, module, torch.int4 if signed else torch.uint4, self.mapping_type,
                          ZeroPointDomain.NONE if signed else self.zero_point_domain, "plain")
        return resolve_format(self.packing_format, spec, weight, module, module_is_linear=True,
                              scale_dtype=self.scale_dtype)

    def qparam_options(self):
        return QParamOptions(scale_dtype=self.scale_dtype, preserve_zero=self.preserve_zero, rounding=self.rounding)


@dataclass(frozen=True)
class IntxWeightOnlyConfig(QuantConfig):
    """1-8 bit weights (`weight_dtype` torch.int1..torch.int8 or torch.uint1..torch.uint8).

    granularity: PerGroup(g) (groups along in_features) or PerAxis(0) (one scale per output channel).
    Also quantizes nn.Embedding and nn.EmbeddingBag (per row / per group of the embedding dim). 1-bit codes need
    MappingType.ASYMMETRIC (a symmetric 1-bit range {-1, 0} cannot represent positive weights).
    scale_dtype: bf16 by default (16-bit qparams: int2 g32 stores 0.375 B/param, int3 g32 0.5) or fp32;
    an integer zero point (ASYMMETRIC with the INT domain) keeps its qparams in fp32 in `dense`, where a bf16
    offset could not hold it exactly (use zero_point_domain=ZeroPointDomain.FLOAT for 16-bit qparams).
    rounding: how weights round to codes, "half_even" (default), "half_away_from_zero" or "floor".
    scale_type: None (float scales of `scale_dtype`), "pof2" (power-of-two scales rounded up from amax / qmax:
    never clip) or "e8m0" (the OCP MX rule, floor(log2(amax)) - floor(log2(qmax)): may saturate); both are stored
    as E8M0 bytes in `plain` and need a symmetric mapping of a signed dtype.
    """

    modules: ClassVar = (nn.Linear, nn.Embedding, nn.EmbeddingBag)
    weight_dtype: torch.dtype = torch.int8
    granularity: Granularity = field(default_factory=lambda: PerGroup(32))
    mapping_type: MappingType = MappingType.SYMMETRIC
    zero_point_domain: ZeroPointDomain | None = None
    packing_format: str = "auto"
    scale_dtype: torch.dtype = torch.bfloat16
    rounding: str = "half_even"
    scale_type: str | None = None

    def __post_init__(self):
        super().__post_init__()
        check_choice("scale_dtype", self.scale_dtype, (torch.bfloat16, torch.float32))
        check_choice("rounding", self.rounding, tuple(ROUNDING))
        try:
            check_target_dtype(self.weight_dtype, "weight_dtype")
            supported = is_integer_target(self.weight_dtype) and self.weight_dtype not in (torch.int16, torch.int32)
        except ValueError:
            supported = False
        if not supported:
            raise ValueError(f"weight_dtype={self.weight_dtype}: use an integer dtype of 1-8 bits "
                             "(torch.int1..torch.int8, torch.uint1..torch.uint8)")
        if self.weight_dtype in (torch.int1, torch.uint1) and self.mapping_type is not MappingType.ASYMMETRIC:
            raise ValueError(f"weight_dtype={self.weight_dtype} with mapping_type={self.mapping_type}: one bit "
                             "has two codes, so a symmetric range maps every weight to 0 or -scale; use "
                             "mapping_type=MappingType.ASYMMETRIC (two levels per group)")
        if not isinstance(self.granularity, (PerGroup, PerAxis)):
            raise ValueError(f"granularity={self.granularity!r}: use PerGroup(group_size) or PerAxis(0)")
        if isinstance(self.granularity, PerAxis) and self.granularity.axis != 0:
            raise ValueError("granularity=PerAxis(axis) must use axis=0 (one scale per output channel)")
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))
        check_choice("scale_type", self.scale_type, (None, *_POW2_SCALE_MODES))
        if self.scale_type is not None and (self.mapping_type is not MappingType.SYMMETRIC
                                            or not is_signed(self.weight_dtype) or self.packing_format == "dense"):
            raise ValueError(f"scale_type={self.scale_type!r} needs mapping_type=MappingType.SYMMETRIC, a signed "
                             "weight_dtype (torch.int2..torch.int8) and packing_format 'auto' or 'plain'")

    def _domain(self) -> ZeroPointDomain:
        """The zero-point domain: as given, else INT for asymmetric mappings and unsigned codes (a symmetric
        uint4 range [0, 15] is centred on the integer zero point 8), NONE for symmetric signed codes."""
        if self.zero_point_domain is not None:
            return self.zero_point_domain
        unsigned = not is_signed(self.weight_dtype)
        return ZeroPointDomain.INT if self.mapping_type is MappingType.ASYMMETRIC or unsigned else ZeroPointDomain.NONE

    def _block_size(self, shape, module):
        if isinstance(self.granularity, PerAxis):
            return row_block(shape, None)
        return row_block(shape, self.granularity.group_size)

    def weight_spec(self, weight, module):
        if self.scale_type is not None:  # e8m0 bytes: dense (our kernel) where it holds them, else plain
            spec = self._spec(weight, module, self.weight_dtype, self.mapping_type, ZeroPointDomain.NONE, "plain")
            return resolve_format(self.packing_format, spec.replace(scale_type=qtype("e8m0")), weight, module)
        spec = self._spec(weight, module, self.weight_dtype, self.mapping_type, self._domain(), "plain")
        return resolve_format(self.packing_format, spec, weight, module)

    def qparam_options(self):
        mode = None if self.scale_type is None else _POW2_SCALE_MODES[self.scale_type]
        return QParamOptions(scale_dtype=self.scale_dtype, rounding=self.rounding, scale_mode=mode)


@dataclass(frozen=True)
class Int8WeightOnlyConfig(QuantConfig):
    """Symmetric int8 weights, per output channel (group_size=None) or per group; activations stay float.

    Also quantizes nn.Embedding and nn.Conv1d/2d (per output channel). packing_format: "auto" (C++ `dense`
    kernel on CPU when it builds, else `plain`, which the aten int8 kernels read), "dense" or "plain".
    rounding: how weights round to codes, "half_even" (default), "half_away_from_zero" or "floor".
    """

    modules: ClassVar = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    group_size: int | None = None
    packing_format: str = "auto"
    rounding: str = "half_even"

    def __post_init__(self):
        super().__post_init__()
        _check_group_size(self.group_size)
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))
        check_choice("rounding", self.rounding, tuple(ROUNDING))

    def _block_size(self, shape, module):
        return row_block(shape, self.group_size)

    def weight_spec(self, weight, module):
        spec = self._spec(weight, module, torch.int8, MappingType.SYMMETRIC, ZeroPointDomain.NONE, "plain")
        return resolve_format(self.packing_format, spec, weight, module)

    def qparam_options(self):
        return QParamOptions(scale_dtype=torch.float32, rounding=self.rounding)


# -- dynamic activation configs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """int8 x int8 matmul: activations quantized (symmetric) at run time, weights per channel.

    act_granularity: "per_token" (default: one scale per row of the flattened input) or "per_tensor" (one
    scale per call: torch.ao's dynamic scheme, without its 7-bit reduce_range); PerToken() / PerTensor() are
    accepted and stored by these names (serialized configs keep their form).

    packing_format: "plain" (torch._int_mm on the codes), "dense" (the C++ kernel on the int8 weight with
    the activation fake-quantized: the same products in fp32) or "auto": plain, except on a CPU whose
    `_int_mm` is slow (no VNNI), where dense keeps int8 dynamic faster than fp32.
    """

    packing_format: str = "auto"
    act_granularity: str = "per_token"

    def __post_init__(self):
        super().__post_init__()
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))
        if isinstance(self.act_granularity, (PerToken, PerTensor)):
            object.__setattr__(self, "act_granularity",
                               "per_token" if isinstance(self.act_granularity, PerToken) else "per_tensor")
        check_choice("act_granularity", self.act_granularity, ("per_token", "per_tensor"))

    def _block_size(self, shape, module):
        return row_block(shape, None)

    def weight_spec(self, weight, module):
        aq = ActivationQuant(torch.int8, MappingType.SYMMETRIC, self.act_granularity, ZeroPointDomain.NONE)
        spec = self._spec(weight, module, torch.int8, MappingType.SYMMETRIC, ZeroPointDomain.NONE, "plain", aq)
        return resolve_format(self.packing_format, spec, weight, module)


@dataclass(frozen=True)
class Int8DynamicActivationInt4WeightConfig(QuantConfig):
    """The 8da4w scheme of edge runtimes: int8 asymmetric per-token activations, int4 symmetric per-group
    weights. Numerics: y = F.linear(fake_quant_int8(x), dequant(w)). scale_dtype: bf16 (default, 16-bit
    weight scales) or fp32."""

    group_size: int = 32
    packing_format: str = "auto"
    scale_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        super().__post_init__()
        check_choice("scale_dtype", self.scale_dtype, (torch.bfloat16, torch.float32))
        if self.group_size is None:
            raise ValueError("Int8DynamicActivationInt4WeightConfig needs a group_size: pass e.g. group_size=32")
        _check_group_size(self.group_size, allow_none=False)
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return row_block(shape, self.group_size)

    def weight_spec(self, weight, module):
        aq = ActivationQuant(torch.int8, MappingType.ASYMMETRIC, PerToken(), ZeroPointDomain.INT)
        spec = self._spec(weight, module, torch.int4, MappingType.SYMMETRIC, ZeroPointDomain.NONE, "plain", aq)
        return resolve_format(self.packing_format, spec, weight, module)

    def qparam_options(self):
        return QParamOptions(scale_dtype=self.scale_dtype)
