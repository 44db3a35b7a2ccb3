"""Quantization configs: frozen dataclasses that validate themselves, round-trip through JSON and map to
one handler each (registered in `affineq.quantize`).

A config answers two questions about a module: `check(module)` (why it cannot apply, or None) and
`quantize_weight(weight)` (the AffineQuantizedTensor that replaces it).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from affineq import cpp as _cpp
from affineq import granularity as _gran
from affineq.dtypes import check_target_dtype, is_float_target, is_integer_target
from affineq.granularity import Granularity, PerAxis, PerGroup, PerRow, PerTensor, get_block_size
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import ActivationQuant

__all__ = [
    "QuantConfig",
    "Int4WeightOnlyConfig",
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8DynamicActivationInt4WeightConfig",
    "IntxWeightOnlyConfig",
    "Float8WeightOnlyConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "config_from_dict",
]

_CONFIGS: dict[str, type[QuantConfig]] = {}
_ENUMS = {"MappingType": MappingType, "ZeroPointDomain": ZeroPointDomain}


# -- JSON encoding of config fields -------------------------------------------------------------------


def _encode(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, enum.Enum):
        return {"enum": type(v).__name__, "name": v.name}
    if isinstance(v, QuantConfig):
        return v.to_dict()
    if isinstance(v, Granularity):
        return {"granularity": type(v).__name__, **dataclasses.asdict(v)}
    if isinstance(v, dict):
        return {"map": {k: _encode(x) for k, x in v.items()}}
    if isinstance(v, tuple):
        return [_encode(x) for x in v]
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_decode(x) for x in v)
    if not isinstance(v, dict):
        return v
    if "dtype" in v:
        return getattr(torch, v["dtype"])
    if "enum" in v:
        return _ENUMS[v["enum"]][v["name"]]
    if "granularity" in v:
        args = {k: _decode(x) for k, x in v.items() if k != "granularity"}
        return getattr(_gran, v["granularity"])(**args)
    if "map" in v:
        return {k: _decode(x) for k, x in v["map"].items()}
    if "type" in v:
        return config_from_dict(v)
    raise ValueError(f"cannot decode config field {v!r}")


def config_from_dict(d: dict) -> QuantConfig:
    """Inverse of `QuantConfig.to_dict`: {"type": "Int4WeightOnlyConfig", "group_size": 128, ...}."""
    name = d.get("type")
    if name not in _CONFIGS:
        raise ValueError(f"unknown config type {name!r}; known: {sorted(_CONFIGS)}")
    return _CONFIGS[name](**{k: _decode(v) for k, v in d.items() if k != "type"})


# -- base -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """Base of all configs. Subclasses list the module types they quantize in `modules`."""

    modules: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _CONFIGS[cls.__name__] = cls

    def to_dict(self) -> dict:
        out = {"type": type(self).__name__}
        for f in dataclasses.fields(self):
            out[f.name] = _encode(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        cfg = config_from_dict(d)
        if not isinstance(cfg, cls):
            raise ValueError(f"{cls.__name__}.from_dict got a {type(cfg).__name__} dict")
        return cfg

    def check(self, module: nn.Module) -> str | None:
        """Why this config cannot quantize `module.weight` (a sentence), or None."""
        if not isinstance(module, self.modules):
            names = ", ".join(m.__name__ for m in self.modules)
            return f"{type(self).__name__} quantizes {names} modules, not {type(module).__name__}"
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or isinstance(w, AffineQuantizedTensor):
            return "it has no float weight (already quantized?)"
        if not w.dtype.is_floating_point:
            return f"its weight is {w.dtype}, not floating point"
        try:
            self._block_size(tuple(w.shape), module)
        except ValueError as e:
            return str(e)
        return None

    def _block_size(self, shape: tuple[int, ...], module: nn.Module) -> tuple[int, ...]:
        raise NotImplementedError

    def quantize_weight(self, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
        raise NotImplementedError


def _check_group_size(group_size: int | None, param: str = "group_size") -> None:
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{param} must be a positive int or None (per channel), got {group_size!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")


def _row_block(shape: tuple[int, ...], group_size: int | None) -> tuple[int, ...]:
    """Per-row (group None) or per-group block over the last dim of a 2-D weight; conv: per out channel."""
    if group_size is None:
        return get_block_size(shape, PerAxis(0))
    if len(shape) != 2:
        raise ValueError(f"group_size applies to 2-D weights; this weight is {len(shape)}-D {shape}: use "
                         "group_size=None (per channel)")
    return get_block_size(shape, PerGroup(group_size))


def _auto_lowbit_format(fmt: str, weight: torch.Tensor, cpu_fallback: str = "dense") -> str:
    """Resolve "auto": the C++ kernel's `dense` layout for 2-D CPU weights when the kernels build, else
    `cpu_fallback` (a layout an aten kernel reads); "plain" for other shapes and devices."""
    if fmt != "auto":
        return fmt
    if weight.device.type == "cpu" and weight.dim() == 2:
        return "dense" if _cpp.is_available() else cpu_fallback
    return "plain"


# -- weight-only integer configs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Int4WeightOnlyConfig(QuantConfig):
    """4-bit weights, one scale and zero point per `group_size` input channels; activations stay float.

    Default: asymmetric uint4 with a float zero point (the tinygemm scheme, preserve_zero=False).
    packing_format: "auto" (C++ `dense` kernel on CPU, else aten `int4_cpu`; `int4_cuda` on GPU),
    "dense", "int4_cpu", "int4_cuda" or "plain".
    scale_dtype: dtype of the scales and float zero points, bf16 by default (0.0625 B/param at group 64;
    its 2^-9 rounding is ~1/100 of the int4 step) or fp32; the aten int4 layouts need bf16.
    """

    group_size: int = 128
    packing_format: str = "auto"
    mapping_type: MappingType = MappingType.ASYMMETRIC
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.FLOAT
    preserve_zero: bool = False
    scale_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        _check_group_size(self.group_size)
        if self.group_size is None:
            raise ValueError("Int4WeightOnlyConfig needs a group_size (32, 64, 128 or 256 are typical)")
        _check_choice("packing_format", self.packing_format, ("auto", "dense", "int4_cpu", "int4_cuda", "plain"))
        if self.packing_format.startswith("int4_") and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"packing_format={self.packing_format!r} needs group_size 32, 64, 128 or 256")
        _check_choice("scale_dtype", self.scale_dtype, (torch.bfloat16, torch.float32))
        if self.packing_format.startswith("int4_") and self.scale_dtype != torch.bfloat16:
            raise ValueError(f"packing_format={self.packing_format!r} stores bf16 scales: use "
                             "scale_dtype=torch.bfloat16 (or packing_format='dense' for fp32 scales)")

    def _block_size(self, shape, module):
        return _row_block(shape, self.group_size)

    def quantize_weight(self, weight, module):
        fmt = self.packing_format
        if fmt == "auto":
            fmt = "int4_cuda" if weight.device.type == "cuda" else _auto_lowbit_format(fmt, weight, "int4_cpu")
            if fmt.startswith("int4_") and self.scale_dtype != torch.bfloat16:
                fmt = "plain" if weight.device.type == "cuda" else "dense"
        signed = self.mapping_type is not MappingType.ASYMMETRIC
        return AffineQuantizedTensor.from_float(
            weight, self.mapping_type, self._block_size(tuple(weight.shape), module),
            torch.int4 if signed else torch.uint4,
            scale_dtype=self.scale_dtype, zero_point_dtype=None, preserve_zero=self.preserve_zero,
            zero_point_domain=ZeroPointDomain.NONE if signed else self.zero_point_domain,
            packing_format=fmt,
        )


@dataclass(frozen=True)
class IntxWeightOnlyConfig(QuantConfig):
    """1-8 bit weights (`weight_dtype` torch.int1..torch.int8 or torch.uint1..torch.uint8).

    granularity: PerGroup(g) (groups along in_features) or PerAxis(0) (one scale per output channel).
    Also quantizes nn.Embedding (per row / per group of the embedding dim).
    """

    modules: ClassVar = (nn.Linear, nn.Embedding)
    weight_dtype: torch.dtype = torch.int8
    granularity: Granularity = field(default_factory=lambda: PerGroup(32))
    mapping_type: MappingType = MappingType.SYMMETRIC
    zero_point_domain: ZeroPointDomain | None = None
    packing_format: str = "auto"

    def __post_init__(self):
        check_target_dtype(self.weight_dtype, "weight_dtype")
        if not is_integer_target(self.weight_dtype) or self.weight_dtype in (torch.int16, torch.int32):
            raise ValueError(f"weight_dtype={self.weight_dtype}: use an integer dtype of 1-8 bits "
                             "(torch.int1..torch.int8, torch.uint1..torch.uint8)")
        if not isinstance(self.granularity, (PerGroup, PerAxis)):
            raise ValueError(f"granularity={self.granularity!r}: use PerGroup(group_size) or PerAxis(0)")
        if isinstance(self.granularity, PerAxis) and self.granularity.axis != 0:
            raise ValueError("granularity=PerAxis(axis) must use axis=0 (one scale per output channel)")
        _check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _domain(self) -> ZeroPointDomain:
        if self.zero_point_domain is not None:
            return self.zero_point_domain
        return ZeroPointDomain.INT if self.mapping_type is MappingType.ASYMMETRIC else ZeroPointDomain.NONE

    def _block_size(self, shape, module):
        if isinstance(self.granularity, PerAxis):
            return _row_block(shape, None)
        return _row_block(shape, self.granularity.group_size)

    def quantize_weight(self, weight, module):
        fmt = _auto_lowbit_format(self.packing_format, weight)
        if isinstance(module, nn.Embedding):
            fmt = "plain" if self.packing_format == "auto" else fmt
        return AffineQuantizedTensor.from_float(
            weight, self.mapping_type, self._block_size(tuple(weight.shape), module), self.weight_dtype,
            scale_dtype=torch.float32, zero_point_domain=self._domain(), packing_format=fmt,
        )


@dataclass(frozen=True)
class Int8WeightOnlyConfig(QuantConfig):
    """Symmetric int8 weights, per output channel (group_size=None) or per group; activations stay float.

    Also quantizes nn.Embedding and nn.Conv1d/2d (per output channel). packing_format: "auto" (C++ `dense`
    kernel on CPU when it builds, else `plain`, which the aten int8 kernels read), "dense" or "plain".
    """

    modules: ClassVar = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    group_size: int | None = None
    packing_format: str = "auto"

    def __post_init__(self):
        _check_group_size(self.group_size)
        _check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return _row_block(shape, self.group_size)

    def quantize_weight(self, weight, module):
        fmt = _auto_lowbit_format(self.packing_format, weight, "plain")
        if not isinstance(module, nn.Linear) and self.packing_format == "auto":
            fmt = "plain"
        return AffineQuantizedTensor.from_float(
            weight, MappingType.SYMMETRIC, self._block_size(tuple(weight.shape), module), torch.int8,
            scale_dtype=torch.float32, zero_point_domain=ZeroPointDomain.NONE, packing_format=fmt,
        )


# -- dynamic activation configs ----------------------------------------------------------------------


def _int_mm_is_fast() -> bool:
    """Whether aten's int8 x int8 -> int32 matmul runs on oneDNN here. Without VNNI (an AVX2-only CPU) it runs
    scalar loops: 430 ms for a 32 x 4096 x 4096 product where fp32 `F.linear` takes 24 ms (measured in
    issue #4; 167 ms vs 10 ms here with oneDNN switched off)."""
    has_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and (has_vnni is None or has_vnni()))


@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """int8 x int8 matmul: activations quantized per token (symmetric) at run time, weights per channel.

    packing_format: "plain" (torch._int_mm on the codes), "dense" (the C++ kernel on the int8 weight with
    the activation fake-quantized: the same products in fp32) or "auto": plain, except on a CPU whose
    `_int_mm` is slow (no VNNI), where dense keeps int8 dynamic faster than fp32.
    """

    packing_format: str = "auto"

    def __post_init__(self):
        _check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return _row_block(shape, None)

    def _format(self, weight: torch.Tensor) -> str:
        if self.packing_format != "auto":
            return self.packing_format
        if weight.device.type == "cpu" and not _int_mm_is_fast():
            return _auto_lowbit_format("auto", weight, cpu_fallback="plain")
        return "plain"

    def quantize_weight(self, weight, module):
        return AffineQuantizedTensor.from_float(
            weight, MappingType.SYMMETRIC, self._block_size(tuple(weight.shape), module), torch.int8,
            scale_dtype=torch.float32, zero_point_domain=ZeroPointDomain.NONE, packing_format=self._format(weight),
            act_quant=ActivationQuant(torch.int8, MappingType.SYMMETRIC, "per_token", ZeroPointDomain.NONE),
        )


@dataclass(frozen=True)
class Int8DynamicActivationInt4WeightConfig(QuantConfig):
    """The 8da4w scheme of edge runtimes: int8 asymmetric per-token activations, int4 symmetric per-group
    weights. Numerics: y = F.linear(fake_quant_int8(x), dequant(w))."""

    group_size: int = 32
    packing_format: str = "auto"

    def __post_init__(self):
        _check_group_size(self.group_size)
        if self.group_size is None:
            raise ValueError("Int8DynamicActivationInt4WeightConfig needs a group_size (e.g. 32)")
        _check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return _row_block(shape, self.group_size)

    def quantize_weight(self, weight, module):
        return AffineQuantizedTensor.from_float(
            weight, MappingType.SYMMETRIC, self._block_size(tuple(weight.shape), module), torch.int4,
            scale_dtype=torch.float32, zero_point_domain=ZeroPointDomain.NONE,
            packing_format=_auto_lowbit_format(self.packing_format, weight),
            act_quant=ActivationQuant(torch.int8, MappingType.ASYMMETRIC, "per_token", ZeroPointDomain.INT),
        )


# -- float8 configs ---------------------------------------------------------------------------------------


def _check_float8(name: str, dtype: torch.dtype) -> None:
    if not is_float_target(dtype):
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
        _check_float8("weight_dtype", self.weight_dtype)
        _check_choice("packing_format", self.packing_format, ("auto", "dense", "plain"))

    def _block_size(self, shape, module):
        return get_block_size(shape, PerRow())

    def quantize_weight(self, weight, module):
        return AffineQuantizedTensor.from_float(
            weight, MappingType.SYMMETRIC, self._block_size(tuple(weight.shape), module), self.weight_dtype,
            scale_dtype=torch.float32, zero_point_domain=ZeroPointDomain.NONE,
            packing_format=_auto_lowbit_format(self.packing_format, weight, "plain"),
        )


@dataclass(frozen=True)
class Float8DynamicActivationFloat8WeightConfig(QuantConfig):
    """float8 x float8 `_scaled_mm`: activations quantized at run time per tensor or per token (PerRow),
    weights per tensor or per row, matching `granularity`."""

    activation_dtype: torch.dtype = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    granularity: Granularity = field(default_factory=PerRow)

    def __post_init__(self):
        _check_float8("activation_dtype", self.activation_dtype)
        _check_float8("weight_dtype", self.weight_dtype)
        if not isinstance(self.granularity, (PerTensor, PerRow)):
            raise ValueError(f"granularity={self.granularity!r}: use PerTensor() or PerRow()")

    def _block_size(self, shape, module):
        return get_block_size(shape, self.granularity)

    def quantize_weight(self, weight, module):
        per_row = isinstance(self.granularity, PerRow)
        aq = ActivationQuant(self.activation_dtype, MappingType.SYMMETRIC,
                             "per_token" if per_row else "per_tensor", ZeroPointDomain.NONE)
        return AffineQuantizedTensor.from_float(
            weight, MappingType.SYMMETRIC, self._block_size(tuple(weight.shape), module), self.weight_dtype,
            scale_dtype=torch.float32, zero_point_domain=ZeroPointDomain.NONE, act_quant=aq,
        )

