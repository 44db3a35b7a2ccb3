"""How a resolved Quark `QuantizationConfig` becomes an affineq config: weight-only, dynamic and static
(calibrated) activations, and `PlainWeightOnlyConfig` for what the packed configs cannot express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from affineq import observers as obs
from affineq.capability import min_max_qparams
from affineq.configs import (
    FPX_FORMATS,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MicroexpWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
    QuantConfig,
    check_choice,
    row_block,
)
from affineq.dtypes import is_signed, qtype
from affineq.granularity import Granularity, PerAxis, PerGroup, PerRow, PerTensor, get_block_size
from affineq.primitives import ROUNDING, MappingType, ZeroPointDomain
from affineq.quantize import QuantizationError
from affineq.quark_vocabulary import (
    DTYPE_TARGETS,
    FLOAT_DTYPES,
    MX_ELEMENTS,
    Dtype,
    QSchemeType,
    RoundType,
    ScaleType,
    ZeroPointType,
    load_observer,
)
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QParamOptions

if TYPE_CHECKING:
    from affineq.quark_config import QuantizationSpec

# -- a weight config for what the packed configs cannot express -------------------------------------------


@dataclass(frozen=True)
class PlainWeightOnlyConfig(QuantConfig):
    """Weight-only, `plain` packing (dequantize-then-linear): any target name (int 1-8 bit, float8, fp6,
    fp4), PerTensor / PerAxis(0) / PerGroup(g), optional power-of-two scales (scale_type="e8m0")."""

    target: str = "int8"
    granularity: Granularity = field(default_factory=lambda: PerAxis(0))
    mapping_type: MappingType = MappingType.SYMMETRIC
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.NONE
    scale_dtype: torch.dtype = torch.float32
    scale_type: str | None = None
    rounding: str = "half_even"

    def __post_init__(self):
        super().__post_init__()
        qtype(self.target)
        check_choice("rounding", self.rounding, tuple(ROUNDING))
        if not isinstance(self.granularity, (PerTensor, PerAxis, PerGroup)):
            raise ValueError(f"granularity={self.granularity!r}: use PerTensor(), PerAxis(0) or PerGroup(g)")

    def _block_size(self, shape, module):
        if isinstance(self.granularity, PerTensor):
            return get_block_size(shape, PerTensor())
        return row_block(shape, self.granularity.group_size if isinstance(self.granularity, PerGroup) else None)

    def weight_spec(self, weight, module):
        from affineq.tensor.spec import QuantSpec

        return QuantSpec.create(tuple(weight.shape), weight.dtype, self.target,
                                self._block_size(tuple(weight.shape), module), mapping_type=self.mapping_type,
                                zero_point_domain=self.zero_point_domain, packing_format="plain",
                                scale_type=self.scale_type)

    def qparam_options(self):
        return QParamOptions(scale_dtype=self.scale_dtype, rounding=self.rounding)


# -- spec -> affineq config ------------------------------------------------------------------------------

_STATIC_OBSERVERS = {obs.PerTensorMinMaxObserver: "minmax", obs.MovingAveragePerTensorMinMaxObserver: "moving_average",
                     obs.PerTensorHistogramObserver: "histogram", obs.PerTensorPercentileObserver: "percentile",
                     obs.PerTensorMSEObserver: "mse"}
#: Observers whose range of one tensor is its min / max: what dynamic activations and the weights of layers with
#: quantized inputs compute anyway, so these are honoured there as they are.
_MIN_MAX_OBSERVERS = (obs.PerTensorMinMaxObserver, obs.PerChannelMinMaxObserver, obs.PerGroupMinMaxObserver,
                      obs.MovingAveragePerTensorMinMaxObserver, obs.MovingAveragePerChannelMinMaxObserver)


def _check_observer(name: str, s: QuantizationSpec, min_max_only: bool, why: str = "") -> None:
    """QuantizationError unless `s.observer_cls` is None or an observer this layer kind runs (an accepted
    setting takes effect: none is recorded and ignored)."""
    cls = s.observer_cls
    if cls is None:
        return
    if not issubclass(cls, obs.Observer):
        raise QuantizationError(f"{name}.observer_cls={cls.__name__} is not an affineq observer; use one of "
                                "affineq.observers (PerTensorMinMaxObserver, PerTensorMSEObserver, ...), a subclass "
                                "of affineq.observers.Observer, or None")
    if min_max_only and cls not in _MIN_MAX_OBSERVERS:
        raise QuantizationError(f"{name}.observer_cls={cls.__name__}: {why} get min / max qparams; use None or a "
                                f"min-max observer ({', '.join(c.__name__ for c in _MIN_MAX_OBSERVERS)})")


@dataclass(frozen=True)
class ObservedWeightConfig(QuantConfig):
    """Quark's `observer_cls` on a weight-only layer's weight: `base_config` gives the QuantSpec (target, blocks,
    format) and rounding, the observer (run once over the weight) the range of each block, so the codes are
    `quantize_affine(w, scale, zero_point)` with the observer's qparams. The observer's granularity must be the
    spec's (a per-tensor observer on a per-tensor spec, PerChannelMinMaxObserver per channel, ...)."""

    base_config: QuantConfig = None
    observer_cls: type = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.base_config, QuantConfig):
            raise ValueError(f"ObservedWeightConfig.base_config={self.base_config!r}: use a weight config")
        if not (isinstance(self.observer_cls, type) and issubclass(self.observer_cls, obs.Observer)):
            raise ValueError(f"ObservedWeightConfig.observer_cls={self.observer_cls!r}: use an affineq observer class")
        why = min_max_qparams(self.base_config)  # asked of the config, not its class
        if why is not None:
            raise QuantizationError(f"observer_cls={self.observer_cls.__name__} with {type(self.base_config).__name__}"
                                    f": {why} (that format chooses its own scales); drop observer_cls")

    @property
    def modules(self):
        return self.base_config.modules

    def check(self, module):
        return self.base_config.check(module) or self._observer_problem(module)

    def _observer_problem(self, module) -> str | None:
        for name in self.parameter_names(module):
            w = module._parameters[name]
            spec, opts = self.weight_spec(w, module), self.qparam_options()
            if spec.scale_type is not None or not opts.preserve_zero:
                return (f"weight.observer_cls={self.observer_cls.__name__}: this weight's scales are power-of-two "
                        "(or its zero point not a code), which an observer's qparams are not; use float scales or "
                        "drop observer_cls")
            try:
                block = tuple(self._observer(spec, opts).block_size(spec.shape))
            except (TypeError, ValueError) as e:
                return f"weight.observer_cls={self.observer_cls.__name__} cannot observe this weight: {e}"
            if block != spec.block_size:
                return (f"weight.observer_cls={self.observer_cls.__name__} gives qparams per block {block}, but the "
                        f"weight spec wants blocks {spec.block_size}: give the spec the observer's granularity (a "
                        "per-tensor observer needs qscheme=per_tensor) or pick the observer of the spec's qscheme")
        return None

    def parameter_names(self, module):
        return self.base_config.parameter_names(module)

    def _block_size(self, shape, module):
        return self.base_config._block_size(shape, module)

    def weight_spec(self, weight, module):
        return self.base_config.weight_spec(weight, module)

    def qparam_options(self):
        return self.base_config.qparam_options()

    def _observer(self, spec, opts) -> obs.Observer:
        kw: dict = {}
        if issubclass(self.observer_cls, obs.PerGroupMinMaxObserver):
            kw = {"group_size": spec.block_size[-1], "ch_axis": -1}
        elif issubclass(self.observer_cls, (obs.PerChannelMinMaxObserver, obs.MovingAveragePerChannelMinMaxObserver)):
            kw = {"ch_axis": 0}
        return self.observer_cls(dtype=spec.target, mapping_type=spec.mapping_type,
                                 zero_point_domain=spec.zero_point_domain, eps=opts.eps,
                                 scale_dtype=opts.scale_dtype or torch.float32, quant_min=spec.quant_min,
                                 quant_max=spec.quant_max, **kw)

    def quantize_weight(self, weight, module):
        spec, opts = self.weight_spec(weight, module), self.qparam_options()
        observer = self._observer(spec, opts)
        observer(weight.detach())
        scale, zero_point = observer.calculate_qparams()
        return AffineQuantizedTensor.from_qparams(weight, scale, zero_point, spec, rounding=opts.rounding)

    def to_dict(self) -> dict:
        c = self.observer_cls
        return {"type": type(self).__name__, "base_config": self.base_config.to_dict(),
                "observer_cls": {"module": c.__module__, "qualname": c.__qualname__}}

    @classmethod
    def from_dict(cls, d: dict) -> ObservedWeightConfig:
        from affineq.configs import config_from_dict

        if not isinstance(d, dict) or set(d) != {"type", "base_config", "observer_cls"}:
            raise ValueError(f"ObservedWeightConfig.from_dict expects the keys type, base_config, observer_cls; got "
                             f"{d!r}")
        observer = load_observer(d["observer_cls"], "ObservedWeightConfig.observer_cls")
        return cls(config_from_dict(d["base_config"]), observer)

    def __hash__(self):
        return hash((self.base_config, self.observer_cls))


def _check_static_tensor(name: str, a: QuantizationSpec) -> None:
    if a.dtype not in (Dtype.int8, Dtype.uint8) or (a.qscheme or QSchemeType.per_tensor) is not QSchemeType.per_tensor:
        raise QuantizationError(f"static {name}: only int8/uint8 per_tensor is calibrated (got {a.dtype.name}, "
                                f"{(a.qscheme or QSchemeType.per_tensor).name}); use is_dynamic=True for others")
    if a.dtype is Dtype.uint8 and a.symmetric:
        raise QuantizationError(f"static {name}: uint8 with symmetric=True has no zero point 0 code; use "
                                "Dtype.int8 for symmetric tensors, or symmetric=False")


def static_config(a: QuantizationSpec, w: QuantizationSpec, o: QuantizationSpec | None = None) -> QuantConfig:
    """A static (calibrated) int8 input with an int8 symmetric per-channel weight: Int8StaticActivationInt8Weight,
    with a static int8 output spec its `quantize_output`. A uint8 asymmetric tensor is the same grid as int8
    with its zero point shifted by 128."""
    from affineq.calibration import Int8StaticActivationInt8WeightConfig

    _check_static_tensor("input_tensors", a)
    if o is not None:
        _check_static_tensor("output_tensors", o)
        if o.observer_cls is not None and o.observer_cls is not a.observer_cls:
            raise QuantizationError(f"output_tensors.observer_cls={o.observer_cls.__name__} differs from the "
                                    "input's: one layer calibrates both with one observer kind; give both the same "
                                    "observer_cls (or leave the output's None)")
    if w.dtype is not Dtype.int8 or w.symmetric is False or (w.qscheme or QSchemeType.per_channel) is not \
            QSchemeType.per_channel:
        raise QuantizationError("static input_tensors need an int8 symmetric per_channel weight spec (the int8 x "
                                "int8 GEMM); change the weight spec or make the input dynamic")
    _check_observer("weight", w, True, "weights of layers with quantized inputs")
    observer = "minmax" if a.observer_cls is None else _STATIC_OBSERVERS.get(a.observer_cls)
    if observer is None:
        raise QuantizationError(f"static input_tensors: observer_cls={a.observer_cls.__name__} is not a per-tensor "
                                f"observer; use one of {sorted(c.__name__ for c in _STATIC_OBSERVERS)} "
                                "(affineq.observers)")
    return Int8StaticActivationInt8WeightConfig(
        activation_symmetric=bool(a.symmetric), observer=observer, quantize_output=o is not None,
        output_symmetric=None if o is None else bool(o.symmetric))


def _scale_dtype(s: QuantizationSpec) -> torch.dtype:
    return torch.bfloat16 if s.scale_type is ScaleType.bfloat16 else torch.float32


def _weight_granularity(w: QuantizationSpec) -> Granularity:
    scheme = w.qscheme or QSchemeType.per_tensor
    if scheme is QSchemeType.per_tensor:
        return PerTensor()
    if scheme is QSchemeType.per_channel:
        if w.ch_axis not in (None, 0):
            raise QuantizationError(f"weight per_channel with ch_axis={w.ch_axis}: affineq quantizes weights per "
                                    "output channel; use ch_axis=0")
        return PerAxis(0)
    if w.ch_axis not in (1, -1):
        raise QuantizationError(f"weight per_group with ch_axis={w.ch_axis}: groups run along the input features; "
                                "use ch_axis=1")
    return PerGroup(w.group_size)


def _mapping(w: QuantizationSpec) -> MappingType:
    return MappingType.ASYMMETRIC if w.symmetric is False else MappingType.SYMMETRIC


_ROUNDING = {None: "half_even", RoundType.half_even: "half_even", RoundType.round: "half_away_from_zero",
             RoundType.floor: "floor"}


_FPX = {name: bits for bits, name in FPX_FORMATS.items()}
_FPX_SCALES = {None: "float32", ScaleType.float32: "float32", ScaleType.float16: "float16",
               ScaleType.bfloat16: "bfloat16", ScaleType.float: "float", ScaleType.pof2: "pof2"}


def _mx_block(s: QuantizationSpec, name: str, k: int = 32) -> int:
    """The block size of a Dtype.mx / mx6 / mx9 spec: its per_group group_size along the input features."""
    if s.qscheme not in (None, QSchemeType.per_group) or s.ch_axis not in (None, 1, -1):
        raise QuantizationError(f"{name}: Dtype.{s.dtype.name} shares scales over blocks along the input features; "
                                f"use qscheme=per_group, group_size={k}, ch_axis=-1")
    if s.scale_type not in (None, ScaleType.pof2):
        raise QuantizationError(f"{name}: Dtype.{s.dtype.name} scales are E8M0 powers of two; use "
                                "scale_type=ScaleType.pof2 (or None)")
    return s.group_size or k


def _block_format(w: QuantizationSpec) -> QuantConfig | None:
    """MX, MX6/MX9 and fp8/fp6/fp4 per-channel or per-group weights (the configs with packed kernels)."""
    if w.dtype is Dtype.mx:
        return MXWeightOnlyConfig(MX_ELEMENTS[w.mx_element_dtype], block_size=_mx_block(w, "weight"))
    if w.dtype in (Dtype.mx6, Dtype.mx9):
        if _mx_block(w, "weight", 16) != 16:
            raise QuantizationError(f"weight: Dtype.{w.dtype.name} shares an exponent over 16 values; use "
                                    "group_size=16")
        return MicroexpWeightOnlyConfig(w.dtype.name)
    name = qtype(DTYPE_TARGETS[w.dtype]).name if w.dtype in DTYPE_TARGETS else None
    if name not in _FPX or (w.qscheme or QSchemeType.per_tensor) is QSchemeType.per_tensor:
        return None
    ebits, mbits = _FPX[name]
    group = _row_group(_weight_granularity(w))
    if ebits >= 4 and group is None and w.scale_type in (None, ScaleType.float32):
        return None  # fp8 per channel with float32 scales: Float8WeightOnlyConfig (the plain grid below)
    return FPxWeightOnlyConfig(ebits, mbits, group, _FPX_SCALES[w.scale_type])


def _row_group(gran: Granularity) -> int | None:
    return gran.group_size if isinstance(gran, PerGroup) else None


def weight_only_config(w: QuantizationSpec) -> QuantConfig:
    """The weight-only config of `w`; with `w.observer_cls` its qparams come from that observer."""
    _check_observer("weight", w, False)
    base = _weight_only_config(w)
    return base if w.observer_cls is None else ObservedWeightConfig(base, w.observer_cls)


def _weight_only_config(w: QuantizationSpec) -> QuantConfig:
    rounding = _ROUNDING[w.round_method]
    block = _block_format(w)
    if block is not None:
        return block
    target = DTYPE_TARGETS[w.dtype]
    gran = _weight_granularity(w)
    is_float = w.dtype in FLOAT_DTYPES
    mapping = _mapping(w)
    if w.scale_type is ScaleType.pof2 or isinstance(gran, PerTensor) or not isinstance(target, torch.dtype):
        if is_float:
            domain = ZeroPointDomain.NONE
        elif mapping is MappingType.ASYMMETRIC:
            domain = ZeroPointDomain.FLOAT if w.zero_point_type is ZeroPointType.float32 else ZeroPointDomain.INT
        else:
            domain = ZeroPointDomain.NONE if is_signed(target) else ZeroPointDomain.INT
        return PlainWeightOnlyConfig(qtype(target).name, gran, mapping, domain, _scale_dtype(w),
                                     "e8m0" if w.scale_type is ScaleType.pof2 else None, rounding)
    if is_float:  # float8, per channel
        if isinstance(gran, PerGroup) or w.scale_type is ScaleType.bfloat16:
            return PlainWeightOnlyConfig(qtype(target).name, gran, MappingType.SYMMETRIC, ZeroPointDomain.NONE,
                                         _scale_dtype(w))
        return Float8WeightOnlyConfig(weight_dtype=target)
    if (w.dtype is Dtype.int8 and mapping is MappingType.SYMMETRIC and w.scale_type is not ScaleType.bfloat16
            and w.zero_point_type is None):
        return Int8WeightOnlyConfig(group_size=gran.group_size if isinstance(gran, PerGroup) else None,
                                    rounding=rounding)
    domain = None
    if mapping is MappingType.ASYMMETRIC and w.zero_point_type is ZeroPointType.float32:
        domain = ZeroPointDomain.FLOAT
    return IntxWeightOnlyConfig(weight_dtype=target, granularity=gran, mapping_type=mapping,
                                zero_point_domain=domain, scale_dtype=_scale_dtype(w), rounding=rounding)


def dynamic_config(a: QuantizationSpec, w: QuantizationSpec) -> QuantConfig:
    _check_observer("input_tensors", a, True, "dynamic activations are quantized at run time from each input's "
                    "min / max and")
    _check_observer("weight", w, True, "weights of layers with quantized inputs")
    combo = (f"dynamic input {a.dtype.name} {a.qscheme and a.qscheme.name} symmetric={a.symmetric} with weight "
             f"{w.dtype.name} {w.qscheme and w.qscheme.name} symmetric={w.symmetric}")
    if a.dtype is Dtype.mx and w.dtype is Dtype.mx:
        block = _mx_block(w, "weight")
        if _mx_block(a, "input_tensors") != block:
            raise QuantizationError(f"{combo}: MX input and weight blocks must match along K; give both "
                                    f"group_size={block}")
        return MXDynamicActivationMXWeightConfig(MX_ELEMENTS[a.mx_element_dtype], MX_ELEMENTS[w.mx_element_dtype],
                                                 block_size=block)
    if a.scale_type is ScaleType.pof2 or w.scale_type is ScaleType.pof2:
        raise QuantizationError(f"{combo}: power-of-two scales with dynamic activations need a packing that stores "
                                "e8m0 scales for them (only weight-only 'plain' does); use scale_type=float32")
    if a.qscheme is QSchemeType.per_group:
        raise QuantizationError(f"{combo}: per_group activations are not supported; use per_channel (per token) "
                                "or per_tensor")
    per_token = a.qscheme is QSchemeType.per_channel
    wg = _weight_granularity(w)
    if (a.dtype is Dtype.int8 and a.symmetric is not False and w.dtype is Dtype.int8 and isinstance(wg, PerAxis)
            and w.symmetric is not False and w.scale_type is not ScaleType.bfloat16):
        return Int8DynamicActivationInt8WeightConfig(act_granularity="per_token" if per_token else "per_tensor")
    if a.dtype is Dtype.int8 and per_token:
        if (a.symmetric is False and w.dtype is Dtype.int4 and isinstance(wg, PerGroup)
                and w.symmetric is not False):
            return Int8DynamicActivationInt4WeightConfig(group_size=wg.group_size, scale_dtype=_scale_dtype(w))
    if a.dtype in (Dtype.fp8_e4m3, Dtype.fp8_e5m2) and w.dtype in (Dtype.fp8_e4m3, Dtype.fp8_e5m2):
        if per_token and isinstance(wg, PerAxis) and w.scale_type is not ScaleType.bfloat16:
            return Float8DynamicActivationFloat8WeightConfig(DTYPE_TARGETS[a.dtype], DTYPE_TARGETS[w.dtype], PerRow())
        if not per_token and isinstance(wg, PerTensor) and w.scale_type is not ScaleType.bfloat16:
            return Float8DynamicActivationFloat8WeightConfig(DTYPE_TARGETS[a.dtype], DTYPE_TARGETS[w.dtype],
                                                             PerTensor())
    raise QuantizationError(
        f"{combo} is not supported; affineq's dynamic configs are: int8 symmetric per-token or per-tensor input x "
        "int8 symmetric per-channel weight; int8 asymmetric per-token input x int4 symmetric per-group weight; "
        "fp8 per-token x fp8 per-channel, or fp8 per-tensor x fp8 per-tensor (float32 scales)")
