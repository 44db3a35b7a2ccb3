"""Float weight configs: float8 (weight-only and with float8 dynamic activations), FPx (fp4 / fp6 / fp8 with a
chosen scale type), OCP MX weight-only, MX weights with MX activations, and microexponent formats.

Every scale is stored exactly: float scales in their dtype, power-of-two scales as E8M0 bytes (`plain`'s
scale_type e8m0), chosen by the MX rule of `affineq.mx` through `QParamOptions.scale_mode`, so `quantize_`,
`AffineQuantizedTensor.stored_qparams` (GPTQ / AWQ / HQQ / QAT) and `affineq.mx.quantize_mx` agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from affineq.configs.base import _POW2_SCALE_MODES, QuantConfig, check_choice, resolve_format, row_block
from affineq.dtypes import QType, qtype
from affineq.granularity import Granularity, PerGroup, PerRow, PerTensor, PerToken, get_block_size
from affineq.microexp import MICROEXP_FORMATS, microexp_spec, microexp_tensor
from affineq.mx import SCALE_MODES, mx_element
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.spec import ActivationQuant, QParamOptions, QuantSpec

__all__ = ["FPxWeightOnlyConfig", "Float8DynamicActivationFloat8WeightConfig", "Float8WeightOnlyConfig",
           "MXDynamicActivationMXWeightConfig", "MXWeightOnlyConfig", "MicroexpWeightOnlyConfig"]

#: (ebits, mbits) -> element type of FPxWeightOnlyConfig.
FPX_FORMATS = {(2, 1): "fp4_e2m1", (2, 3): "fp6_e2m3", (3, 2): "fp6_e3m2", (4, 3): "float8_e4m3fn",
               (5, 2): "float8_e5m2"}
#: scale_type of FPxWeightOnlyConfig -> float scale dtype (None: the weight's dtype), or the e8m0 rule.
_FLOAT_SCALES: dict[str, torch.dtype | None] = {"float": None, "float32": torch.float32, "float16": torch.float16,
                                                "bfloat16": torch.bfloat16}
_POW2_SCALES = _POW2_SCALE_MODES  # e8m0: the OCP MX rule (floor); pof2: rounded up (rceil), never clips
FPX_SCALE_TYPES = (*_FLOAT_SCALES, *_POW2_SCALES)


def _block_spec(weight: torch.Tensor, module: nn.Module, target: QType, group: int,
                scale_type: QType | None, fmt: str, act_quant: ActivationQuant | None = None) -> QuantSpec:
    """Symmetric per-row-group spec of `target` codes (no zero point), with "auto" resolved."""
    spec = QuantSpec.create(tuple(weight.shape), weight.dtype, target, row_block(tuple(weight.shape), group),
                            mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE,
                            quant_min=-127 if target.name == "int8" else None, packing_format="plain",
                            act_quant=act_quant, scale_type=scale_type)
    return resolve_format(fmt, spec, weight, module)


def _check_block(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise ValueError(f"{name}={value!r} must be an even int >= 2; OCP MX uses 32")


@dataclass(frozen=True)
class FPxWeightOnlyConfig(QuantConfig):
    """Float weights of `ebits` exponent and `mbits` mantissa bits: (2, 1) fp4 E2M1, (2, 3) fp6 E2M3, (3, 2) fp6
    E3M2, (4, 3) fp8 E4M3, (5, 2) fp8 E5M2; one scale per `group_size` input channels (None: per row).

    scale = amax / element max per group, in `scale_type`: "float32" (default), "float16", "bfloat16", "float"
    (the weight's dtype); or a power of two stored as an E8M0 byte: "e8m0" (the OCP MX rule, floor(log2(amax)) -
    emax_elem; values above the element max saturate) or "pof2" (rounded up: never clips). Codes round to
    nearest even on the element grid. packing_format: "auto" (`dense` where it holds the spec and our kernel
    is built, else `plain`), "dense" or "plain".
    """

    ebits: int = 2
    mbits: int = 1
    group_size: int | None = 32
    scale_type: str = "float32"
    packing_format: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if (self.ebits, self.mbits) not in FPX_FORMATS:
            valid = ", ".join(f"{k} {v}" for k, v in FPX_FORMATS.items())
            raise ValueError(f"(ebits, mbits)=({self.ebits!r}, {self.mbits!r}) is not a supported float format; use "
                             f"one of (ebits, mbits): {valid}")
        if self.group_size is not None:
            _check_block("group_size", self.group_size)
        check_choice("scale_type", self.scale_type, FPX_SCALE_TYPES)
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    @property
    def element(self) -> QType:
        return qtype(FPX_FORMATS[(self.ebits, self.mbits)])

    def _block_size(self, shape, module):
        return row_block(shape, self.group_size)

    def weight_spec(self, weight, module):
        pow2 = self.scale_type in _POW2_SCALES
        return _block_spec(weight, module, self.element, self.group_size, qtype("e8m0") if pow2 else None,
                           self.packing_format)

    def qparam_options(self):
        if self.scale_type in _POW2_SCALES:
            return QParamOptions(scale_dtype=torch.float32, scale_mode=_POW2_SCALES[self.scale_type])
        return QParamOptions(scale_dtype=_FLOAT_SCALES[self.scale_type])


class _MXBlocks:
    """What the MX configs share: blocks of `block_size` input channels, one E8M0 scale each, chosen by
    `scale_mode`."""

    block_size: int
    scale_mode: str
    packing_format: str

    def _check_mx(self) -> None:
        _check_block("block_size", self.block_size)
        check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return row_block(shape, self.block_size)

    def qparam_options(self):
        return QParamOptions(scale_dtype=torch.float32, scale_mode=self.scale_mode)


@dataclass(frozen=True)
class MXWeightOnlyConfig(_MXBlocks, QuantConfig):
    """OCP Microscaling weights (`affineq.mx`): blocks of `block_size` (32) input channels, one E8M0 scale each.

    element_dtype: torch.float8_e4m3fn / torch.float8_e5m2 (MXFP8), "fp6_e2m3" / "fp6_e3m2" (MXFP6),
    "fp4_e2m1" (MXFP4), torch.int8 (MXINT8), or the names "mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "mxint8", ...
    (stored as the QType name). scale_mode: "floor" (OCP), "ceil", "even" or "rceil" (see `affineq.mx`).
    block_size: 32 is OCP MX; other even sizes are an affineq extension with the same rules.
    The stored tensor dequantizes exactly to `dequantize_mx(*quantize_mx(w, ...))` (MXINT8: for |w| >= 2**-121).
    MX6 / MX9 (shared micro-exponents) are not OCP element types: `MicroexpWeightOnlyConfig`.
    """

    element_dtype: Any = "fp4_e2m1"
    block_size: int = 32
    scale_mode: str = "floor"
    packing_format: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "element_dtype", mx_element(self.element_dtype).name)
        self._check_mx()

    def weight_spec(self, weight, module):
        return _block_spec(weight, module, qtype(self.element_dtype), self.block_size, qtype("e8m0"),
                           self.packing_format)


@dataclass(frozen=True)
class MXDynamicActivationMXWeightConfig(_MXBlocks, QuantConfig):
    """MX weights (as `MXWeightOnlyConfig`, element `weight_dtype`) and MX activations: at run time the input is
    quantized per `block_size` block along K to `activation_dtype` with a shared E8M0 scale and dequantized
    (x -> dequantize_mx(quantize_mx(x))), then multiplied by the weight. Numerics:
    y = F.linear(fake_quantize_mx(x), dequantize(w)); the weight-only kernel runs on the fake-quantized x.
    Both use `scale_mode`. Element types as in `MXWeightOnlyConfig` (stored as QType names).
    """

    _field_types: ClassVar[dict] = {"activation_dtype": (str,), "weight_dtype": (str,)}

    activation_dtype: Any = "fp4_e2m1"
    weight_dtype: Any = "fp4_e2m1"
    block_size: int = 32
    scale_mode: str = "floor"
    packing_format: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "activation_dtype", mx_element(self.activation_dtype, "activation_dtype").name)
        object.__setattr__(self, "weight_dtype", mx_element(self.weight_dtype, "weight_dtype").name)
        super().__post_init__()
        self._check_mx()

    def weight_spec(self, weight, module):
        aq = ActivationQuant(self.activation_dtype, MappingType.SYMMETRIC, PerGroup(self.block_size),
                             ZeroPointDomain.NONE, scale_mode=self.scale_mode)
        return _block_spec(weight, module, qtype(self.weight_dtype), self.block_size, qtype("e8m0"),
                           self.packing_format, aq)


@dataclass(frozen=True)
class MicroexpWeightOnlyConfig(QuantConfig):
    """MX9 / MX6 / MX4 weights (shared micro-exponents, Rouhani et al. 2023; definition in `affineq.microexp`):
    blocks of 16 input channels share an 8-bit exponent, pairs a 1-bit micro-exponent, elements are sign +
    7 / 4 / 2 magnitude bits. packing_format "microexp" stores them bit-exactly (9 / 6 / 4 bits per weight), read
    by no kernel: linear runs the announced dequantize fallback. "dense" (mx6 / mx4) stores the same values as
    6- / 4-bit codes with one e8m0 scale per 16 (6.5 / 4.5 bits per weight, `affineq.microexp.microexp_spec`),
    which the C++ kernels read."""

    fmt: str = "mx9"
    packing_format: str = "microexp"

    def __post_init__(self):
        super().__post_init__()
        check_choice("fmt", self.fmt, tuple(MICROEXP_FORMATS))
        check_choice("packing_format", self.packing_format, ("microexp", "dense"))
        microexp_spec((16, 16), torch.float32, self.fmt, self.packing_format)  # mx9 + dense: the error, now

    def _block_size(self, shape, module):
        if len(shape) != 2 or shape[1] % 16:
            raise ValueError(f"{self.fmt} shares exponents over blocks of 16 input channels: the weight must be 2-D "
                             f"with in_features divisible by 16, got shape {tuple(shape)}; use MXWeightOnlyConfig or "
                             "FPxWeightOnlyConfig with group_size=None for this layer")
        return (1, 16) if self.packing_format == "dense" else (1, 2)

    def weight_spec(self, weight, module):
        self._block_size(weight.shape, module)
        return microexp_spec(tuple(weight.shape), weight.dtype, self.fmt, self.packing_format)

    def quantize_weight(self, weight, module):
        return microexp_tensor(weight, self.fmt, self.packing_format)


# -- float8 configs ---------------------------------------------------------------------------------------


def _check_float8(name: str, dtype: torch.dtype) -> None:
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}={dtype}: use torch.float8_e4m3fn or torch.float8_e5m2")


@dataclass(frozen=True)
class Float8WeightOnlyConfig(QuantConfig):
    """float8 weights with one scale per output row (scale = amax / finfo.max); activations stay float.

    packing_format: "auto" (the C++ `dense` kernel on CPU when it builds, which decodes the float8 bytes in
    registers; else `plain`), "dense" or "plain".
    """

    weight_dtype: torch.dtype = torch.float8_e4m3fn
    packing_format: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        _check_float8("weight_dtype", self.weight_dtype)
        check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return get_block_size(shape, PerRow())

    def weight_spec(self, weight, module):
        spec = self._spec(weight, module, self.weight_dtype, MappingType.SYMMETRIC, ZeroPointDomain.NONE, "plain")
        return resolve_format(self.packing_format, spec, weight, module)


@dataclass(frozen=True)
class Float8DynamicActivationFloat8WeightConfig(QuantConfig):
    """float8 x float8 `_scaled_mm`: activations quantized at run time per tensor or per token (PerRow),
    weights per tensor or per row, matching `granularity`."""

    activation_dtype: torch.dtype = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    granularity: Granularity = field(default_factory=PerRow)

    def __post_init__(self):
        super().__post_init__()
        _check_float8("activation_dtype", self.activation_dtype)
        _check_float8("weight_dtype", self.weight_dtype)
        if not isinstance(self.granularity, (PerTensor, PerRow)):
            raise ValueError(f"granularity={self.granularity!r}: use PerTensor() or PerRow()")

    def _block_size(self, shape, module):
        return get_block_size(shape, self.granularity)

    def weight_spec(self, weight, module):
        per_row = isinstance(self.granularity, PerRow)
        aq = ActivationQuant(self.activation_dtype, MappingType.SYMMETRIC,
                             PerToken() if per_row else PerTensor(), ZeroPointDomain.NONE)
        return self._spec(weight, module, self.weight_dtype, MappingType.SYMMETRIC, ZeroPointDomain.NONE,
                          "plain", aq)
