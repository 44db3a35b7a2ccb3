"""AMD Quark-style layered configuration: `Config` -> per-layer `QuantizationConfig` -> affineq configs.

A `Config` holds a global `QuantizationConfig`, per layer-type and per layer-name overrides and `exclude`
patterns. `quantize_(model, Config(...))` resolves every layer (`Config.resolve`), maps the result to one
of affineq's configs (`Config.to_affineq`) and runs `quantize_` with the resulting `FqnToConfig`, all or
nothing. Resolution for a layer named `fqn`:

1. `fqn` matches an `exclude` fnmatch pattern: not quantized.
2. Levels, most specific first: `layer_quant_config` (exact name, else the first fnmatch pattern in
   insertion order), `layer_type_quant_config` (the exact class, else the nearest base class in the MRO;
   a string key matches a class of that name in the MRO), then `global_quant_config`.
3. Field by field (input_tensors, output_tensors, weight, bias, target_device) the first level that sets
   it (not None) wins; None at every level means that tensor is not quantized.

Example::

    w8 = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)
    w4 = QuantizationSpec(Dtype.uint4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32,
                          symmetric=False)
    cfg = Config(QuantizationConfig(weight=w8),
                 layer_quant_config={"*.mlp.*": QuantizationConfig(weight=w4)},
                 exclude=["lm_head"])
    # layers.0.attn.q_proj -> int8 per channel (global); layers.0.mlp.up -> uint4 g32; lm_head stays float

Which layers: the global config and fnmatch name patterns apply to nn.Linear layers; a layer-type key or
an exact layer name selects any module (its affineq config then says whether it can quantize it).

Activations: an `input_tensors` spec with qscheme per_channel means per token (one scale per row of the
flattened [M, K] input; its ch_axis is not used), per_tensor one scale per input.

What runs now: weight-only specs (int2/int3/int4/uint4/int8/uint8, fp8_e4m3/fp8_e5m2, fp6_e3m2/fp6_e2m3,
fp4 with float32/float16/bfloat16/float/pof2 scales: `FPxWeightOnlyConfig`; Dtype.mx with its
mx_element_dtype: `MXWeightOnlyConfig`; Dtype.mx6/mx9: `MicroexpWeightOnlyConfig`); dynamic activations in the
combinations of affineq's dynamic configs (int8 x int8, int8 x int4, fp8 x fp8, MX x MX); static (calibrated)
int8/uint8 per-tensor inputs with int8 per-channel weights,
optionally with a static int8/uint8 per-tensor output (`Int8StaticActivationInt8WeightConfig`). round_method
(half_even, round = half away from zero, floor) applies to integer weights of weight-only layers (float
formats and activations round half to even). Refused by `quantize_` with a `QuantizationError` naming what is
missing: bias specs, dynamic output specs, Dtype.bfloat16/float16. `algo_config` (GPTQ, AWQ, HQQ) or
`pre_quant_opt_config` (SmoothQuant): an algorithm template (`GPTQConfig(None, ...)`) that wraps every layer's
resolved weight config.
`observer_cls` (an affineq observer class) takes effect or is refused: on a weight-only layer's weight it is run
over the weight and its range gives the qparams (its granularity must be the spec's); static inputs calibrate
with it; dynamic inputs and the weights of layers with quantized inputs get min/max qparams, so only the min-max
observers are accepted there. From JSON, `observer_cls` resolves only among affineq's observers and classes
given to `register_observer`, and layer-type keys only among torch.nn module classes: nothing is imported.

target_device: CPU adds no constraint; weights whose affineq config has a packed CPU kernel are the ones in
the README table (Int8/Int4/Intx/Float8 weight-only, 8da8w, 8da4w); power-of-two scales, per-tensor
weights and MX6/MX9 use the announced dequantize-then-linear fallback. IPU: the rule enforced here follows Quark's
IPU/NPU (XINT8) constraints as documented for Ryzen AI: every quantized tensor must be int8 or uint8 with
power-of-two scales (scale_type=ScaleType.pof2).
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from affineq.configs import (
    QuantConfig,
)
from affineq.quantize import FqnToConfig, ModelConfig, QuantizationError
from affineq.quark_vocabulary import (
    FLOAT_DTYPES,
    INT8_DTYPES,
    MX_ELEMENTS,
    UNUSABLE_DTYPES,
    DeviceType,
    Dtype,
    QSchemeType,
    QuantizationMode,
    RoundType,
    ScaleType,
    ZeroPointType,
    layer_type_registry,
    load_class,
    load_observer,
    need_enum,
    register_observer,
)

__all__ = [
    "Config",
    "DeviceType",
    "Dtype",
    "QSchemeType",
    "QuantizationConfig",
    "QuantizationMode",
    "QuantizationSpec",
    "RoundType",
    "ScaleType",
    "ZeroPointType",
    "STATIC_ACTIVATION_MESSAGE",
    "register_observer",
]

STATIC_ACTIVATION_MESSAGE = ("output quantization is static and calibrated with a static int8 input: give "
                             "the layer static input_tensors too and set output_tensors.is_dynamic=False (or None)")


_TENSORS = ("input_tensors", "output_tensors", "weight", "bias")
_FIELDS = (*_TENSORS, "target_device")


# -- specs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizationSpec:
    """How one tensor is quantized (Quark's QuantizationSpec). `is_dynamic` None counts as static."""

    dtype: Dtype
    is_dynamic: bool | None = None
    observer_cls: type | None = None
    qscheme: QSchemeType | None = None
    ch_axis: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    round_method: RoundType | None = None
    scale_type: ScaleType | None = None
    zero_point_type: ZeroPointType | None = None
    mx_element_dtype: Dtype | None = None

    def __post_init__(self) -> None:
        o = "QuantizationSpec"
        need_enum(o, "dtype", self.dtype, Dtype, optional=False)
        for name, cls in (("qscheme", QSchemeType), ("round_method", RoundType), ("scale_type", ScaleType),
                          ("zero_point_type", ZeroPointType), ("mx_element_dtype", Dtype)):
            need_enum(o, name, getattr(self, name), cls)
        if (self.dtype is Dtype.mx) != (self.mx_element_dtype is not None):
            raise ValueError(f"{o}.mx_element_dtype={self.mx_element_dtype} with dtype={self.dtype.name}: Dtype.mx "
                             "needs mx_element_dtype (one of " + ", ".join(d.name for d in MX_ELEMENTS) + "), "
                             "other dtypes take none")
        if self.mx_element_dtype is not None and self.mx_element_dtype not in MX_ELEMENTS:
            raise ValueError(f"{o}.mx_element_dtype={self.mx_element_dtype.name} is not an OCP MX element type; use "
                             "one of " + ", ".join(d.name for d in MX_ELEMENTS))
        for name in ("is_dynamic", "symmetric"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"{o}.{name}={getattr(self, name)!r}: use True, False or None")
        for name in ("ch_axis", "group_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{o}.{name}={v!r}: use an int or None")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"{o}.group_size={self.group_size}: use a positive int such as 32 or 128")
        if self.observer_cls is not None and not isinstance(self.observer_cls, type):
            raise ValueError(f"{o}.observer_cls={self.observer_cls!r} is not a class: pass the observer class "
                             "itself (e.g. PerChannelMinMaxObserver, not PerChannelMinMaxObserver()) or None")
        if self.qscheme is QSchemeType.per_group and (self.group_size is None or self.ch_axis is None):
            raise ValueError(f"{o}.qscheme=per_group needs group_size and ch_axis: pass e.g. group_size=128, "
                             "ch_axis=1 (groups along the input features of a weight)")
        if self.group_size is not None and self.qscheme is not QSchemeType.per_group:
            raise ValueError(f"{o}.group_size={self.group_size} with qscheme={self.qscheme}: group_size needs "
                             "qscheme=QSchemeType.per_group (or drop group_size)")
        if self.dtype in FLOAT_DTYPES and self.symmetric is False:
            raise ValueError(f"{o}.symmetric=False with dtype={self.dtype.name}: float formats have no zero "
                             "point; use symmetric=True (or None)")
        if self.round_method not in (None, RoundType.half_even) and self.dtype in FLOAT_DTYPES:
            raise ValueError(f"{o}.round_method={self.round_method.name}: float formats round to the nearest "
                             "value of their grid (ties to even); use RoundType.half_even (or None)")

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.name
            elif f.name == "observer_cls" and v is not None:
                v = {"module": v.__module__, "qualname": v.__qualname__}
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> QuantizationSpec:
        if not isinstance(d, dict):
            raise ValueError(f"QuantizationSpec.from_dict expects a dict from to_dict(), got {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) - names:
            raise ValueError(f"QuantizationSpec has no fields {sorted(set(d) - names)}; use {sorted(names)}")
        if d.get("dtype") is None:
            raise ValueError("QuantizationSpec.from_dict: the dict has no 'dtype'; use one of "
                             f"{list(Dtype.__members__)}")
        kw: dict[str, Any] = dict(d)
        for name, ecls in (("dtype", Dtype), ("qscheme", QSchemeType), ("round_method", RoundType),
                           ("scale_type", ScaleType), ("zero_point_type", ZeroPointType), ("mx_element_dtype", Dtype)):
            v = kw.get(name)
            if v is not None:
                if not isinstance(v, str) or v not in ecls.__members__:
                    raise ValueError(f"QuantizationSpec.{name}={v!r}: use one of {list(ecls.__members__)}")
                kw[name] = ecls[v]
        if kw.get("observer_cls") is not None:
            kw["observer_cls"] = load_observer(kw["observer_cls"], "QuantizationSpec.observer_cls")
        return cls(**kw)


def _check_device(owner: str, qc: QuantizationConfig) -> None:
    if qc.target_device is not DeviceType.IPU:
        return
    for name in _TENSORS:
        spec = getattr(qc, name)
        if spec is None:
            continue
        if spec.dtype not in INT8_DTYPES:
            raise ValueError(f"{owner}.{name}.dtype={spec.dtype.name} with target_device=IPU: the IPU takes int8 "
                             "or uint8 only; use Dtype.int8 or Dtype.uint8 (or target_device=CPU)")
        if spec.scale_type is not ScaleType.pof2:
            raise ValueError(f"{owner}.{name}.scale_type={spec.scale_type} with target_device=IPU: the IPU needs "
                             "power-of-two scales; use scale_type=ScaleType.pof2 (or target_device=CPU)")


@dataclass(frozen=True)
class QuantizationConfig:
    """Specs of one layer's tensors; a None spec is inherited from the next level up (see module doc)."""

    input_tensors: QuantizationSpec | None = None
    output_tensors: QuantizationSpec | None = None
    weight: QuantizationSpec | None = None
    bias: QuantizationSpec | None = None
    target_device: DeviceType | None = None

    def __post_init__(self) -> None:
        for name in _TENSORS:
            v = getattr(self, name)
            if v is not None and not isinstance(v, QuantizationSpec):
                raise ValueError(f"QuantizationConfig.{name}={v!r}: use a QuantizationSpec(...) or None")
        need_enum("QuantizationConfig", "target_device", self.target_device, DeviceType)
        for name in ("input_tensors", "output_tensors"):
            s = getattr(self, name)
            if s is not None and not s.is_dynamic and s.qscheme is QSchemeType.per_group:
                raise ValueError(f"QuantizationConfig.{name}: a static (is_dynamic={s.is_dynamic}) per_group "
                                 "activation spec has no calibrated form; use is_dynamic=True or "
                                 "qscheme=per_tensor")
        _check_device("QuantizationConfig", self)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {n: None if getattr(self, n) is None else getattr(self, n).to_dict() for n in _TENSORS}
        out["target_device"] = None if self.target_device is None else self.target_device.name
        return out

    @classmethod
    def from_dict(cls, d: dict) -> QuantizationConfig:
        if not isinstance(d, dict):
            raise ValueError(f"QuantizationConfig.from_dict expects a dict with keys {list(_FIELDS)}, got "
                             f"{type(d).__name__}")
        _no_unknown_keys("QuantizationConfig", d, _FIELDS)
        kw: dict[str, Any] = {}
        for n in _TENSORS:
            try:
                kw[n] = None if d.get(n) is None else QuantizationSpec.from_dict(d[n])
            except ValueError as e:
                raise ValueError(f"QuantizationConfig.{n}: {e}") from None
        dev = d.get("target_device")
        if dev is not None and (not isinstance(dev, str) or dev not in DeviceType.__members__):
            raise ValueError(f"QuantizationConfig.target_device={dev!r}: use one of {list(DeviceType.__members__)}")
        kw["target_device"] = None if dev is None else DeviceType[dev]
        return cls(**kw)


# -- the layered config ------------------------------------------------------------------------------------


def _type_key(key) -> str | type:
    if isinstance(key, str) and key:
        return key
    if isinstance(key, type) and issubclass(key, nn.Module):
        return key
    raise ValueError(f"Config.layer_type_quant_config key {key!r}: use an nn.Module class (nn.Linear) or its "
                     "name as a string ('Linear')")


@dataclass(frozen=True)
class Config(ModelConfig):
    """Quark's top-level config (see the module docstring for resolution). `quantize_(model, Config(...))`
    quantizes what it resolves to; `to_fqn_config(model)` shows the plan as an `FqnToConfig`."""

    modules: ClassVar = (nn.Linear,)
    global_quant_config: QuantizationConfig
    layer_type_quant_config: dict = field(default_factory=dict)
    layer_quant_config: dict = field(default_factory=dict)
    exclude: tuple = ()
    algo_config: Any = None
    pre_quant_opt_config: Any = None
    quant_mode: QuantizationMode = QuantizationMode.eager_mode

    def __post_init__(self):
        super().__post_init__()
        try:
            object.__setattr__(self, "quant_mode", QuantizationMode(self.quant_mode))
        except (ValueError, TypeError):
            raise ValueError(f"Config.quant_mode={self.quant_mode!r}: use QuantizationMode.eager_mode (quantize_) or "
                             "QuantizationMode.fx_graph_mode (affineq.graph.prepare / convert)") from None
        if self.param_names is not None:
            raise ValueError("Config.param_names: Config quantizes each layer's weight; leave param_names None")
        if not isinstance(self.global_quant_config, QuantizationConfig):
            raise ValueError(f"Config.global_quant_config={self.global_quant_config!r}: use a "
                             "QuantizationConfig(...)")
        for name, check_key in (("layer_type_quant_config", _type_key), ("layer_quant_config", None)):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise ValueError(f"Config.{name} must be a dict, got {type(d).__name__}")
            for k, v in d.items():
                if check_key is not None:
                    check_key(k)
                elif not isinstance(k, str) or not k:
                    raise ValueError(f"Config.layer_quant_config key {k!r}: use a layer name or fnmatch pattern "
                                     "(str), e.g. 'lm_head' or '*.mlp.*'")
                if not isinstance(v, QuantizationConfig):
                    raise ValueError(f"Config.{name}[{k!r}]={v!r}: use a QuantizationConfig(...)")
        ex = self.exclude
        if isinstance(ex, str) or not isinstance(ex, (list, tuple)) or not all(isinstance(p, str) for p in ex):
            raise ValueError(f"Config.exclude={ex!r}: use a list of layer names / fnmatch patterns, e.g. "
                             "['lm_head', '*.gate']")
        object.__setattr__(self, "exclude", tuple(ex))
        for name, pre in (("algo_config", False), ("pre_quant_opt_config", True)):
            object.__setattr__(self, name, _algorithm_template(name, getattr(self, name), pre))
        if self.algo_config is not None and self.pre_quant_opt_config is not None:
            raise ValueError(f"Config: pre_quant_opt_config={type(self.pre_quant_opt_config).__name__} and "
                             f"algo_config={type(self.algo_config).__name__} together are not supported (one "
                             "algorithm wraps a layer's weight config); keep one of them")

    def __hash__(self):
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # -- resolution ------------------------------------------------------------------------------------

    def _name_level(self, fqn: str) -> QuantizationConfig | None:
        if fqn in self.layer_quant_config:
            return self.layer_quant_config[fqn]
        for pattern, qc in self.layer_quant_config.items():
            if fnmatch.fnmatchcase(fqn, pattern):
                return qc
        return None

    def _type_level(self, module: nn.Module) -> QuantizationConfig | None:
        for cls in type(module).__mro__:
            if cls in self.layer_type_quant_config:
                return self.layer_type_quant_config[cls]
            if cls.__name__ in self.layer_type_quant_config:
                return self.layer_type_quant_config[cls.__name__]
        return None

    def is_excluded(self, fqn: str) -> bool:
        return any(fnmatch.fnmatchcase(fqn, p) for p in self.exclude)

    def resolve(self, fqn: str, module: nn.Module) -> QuantizationConfig | None:
        """The merged QuantizationConfig of layer `fqn`, or None when it is excluded or nothing is set."""
        if self.is_excluded(fqn):
            return None
        levels = [lv for lv in (self._name_level(fqn), self._type_level(module), self.global_quant_config)
                  if lv is not None]
        merged = {n: next((getattr(lv, n) for lv in levels if getattr(lv, n) is not None), None) for n in _FIELDS}
        if all(merged[n] is None for n in _TENSORS):
            return None
        return QuantizationConfig(**merged)  # re-validates the merge (IPU rules on inherited specs)

    def _selects(self, fqn: str, module: nn.Module) -> bool:
        return (isinstance(module, nn.Linear) or fqn in self.layer_quant_config
                or self._type_level(module) is not None)

    # -- mapping to affineq configs ----------------------------------------------------------------------

    def to_affineq(self, qc: QuantizationConfig | None, module: nn.Module | None = None) -> QuantConfig | None:
        """The affineq config that quantizes exactly as `qc` says; QuantizationError names what is refused."""
        if qc is None:
            return None
        for name in _TENSORS:
            s = getattr(qc, name)
            if s is not None and s.dtype in UNUSABLE_DTYPES:
                raise QuantizationError(f"{name}: Dtype.{s.dtype.name} cannot be used yet: {UNUSABLE_DTYPES[s.dtype]}")
        o, a = qc.output_tensors, qc.input_tensors
        if o is not None and (o.is_dynamic or a is None or a.is_dynamic):
            raise QuantizationError(f"output_tensors (is_dynamic={o.is_dynamic}): {STATIC_ACTIVATION_MESSAGE}")
        if qc.bias is not None:
            raise QuantizationError("bias quantization is not supported yet (biases stay float); set bias=None")
        w, a = qc.weight, qc.input_tensors
        if w is None:
            raise QuantizationError("input_tensors without a weight spec: affineq quantizes activations through "
                                    "the quantized weight of a Linear; give this layer a weight spec")
        if w.scale_type is ScaleType.float16 and w.dtype not in FLOAT_DTYPES:
            raise QuantizationError("weight.scale_type=float16 with an integer dtype: affineq's integer configs store "
                                    "float32 or bfloat16 scales; use ScaleType.float32, ScaleType.bfloat16 or "
                                    "ScaleType.pof2 (float16 scales are available for fp8/fp6/fp4 weights)")
        if a is not None and a.round_method not in (None, RoundType.half_even):
            raise QuantizationError(f"input_tensors.round_method={a.round_method.name}: activations are rounded "
                                    "half to even by the kernels; use RoundType.half_even (or None)")
        if a is not None and w.round_method not in (None, RoundType.half_even):
            raise QuantizationError(f"weight.round_method={w.round_method.name} is available for weight-only "
                                    "layers (input_tensors=None); with quantized inputs use RoundType.half_even")
        from affineq._quark_mapping import dynamic_config, static_config, weight_only_config

        if a is not None and not a.is_dynamic:
            return static_config(a, w, o)
        return weight_only_config(w) if a is None else dynamic_config(a, w)

    def layer_config(self, fqn: str, module: nn.Module) -> QuantConfig | None:
        """The affineq config of layer `fqn` (None: not selected, excluded or nothing set), wrapped by the
        algorithm when there is one; QuantizationError / ValueError says why the layer cannot be mapped."""
        if not self._selects(fqn, module):
            return None
        cfg = self.to_affineq(self.resolve(fqn, module), module)
        algo = self.algo_config or self.pre_quant_opt_config
        if cfg is None or algo is None:
            return cfg
        why = algo.cannot_wrap(cfg)
        if why is not None:
            raise QuantizationError(f"{type(algo).__name__} cannot wrap {type(cfg).__name__} (what this layer's "
                                    f"specs resolve to): {why}; change the layer's specs or exclude it")
        return algo.with_base(cfg)

    def default_config(self) -> QuantConfig | None:
        try:
            return self.to_affineq(self.global_quant_config)
        except (QuantizationError, ValueError):
            return None

    def route_error(self, route: str) -> str | None:
        if route == "graph" and self.quant_mode is not QuantizationMode.fx_graph_mode:
            return ("affineq.graph.prepare got a Quark Config with quant_mode=eager_mode; set "
                    "quant_mode=QuantizationMode.fx_graph_mode (or use affineq.quantize_ for eager mode)")
        if route != "graph" and self.quant_mode is QuantizationMode.fx_graph_mode:
            return ("Config(quant_mode=QuantizationMode.fx_graph_mode) quantizes a traced graph: use "
                    "affineq.graph.prepare(model, config, example_inputs), calibrate, then "
                    "affineq.graph.convert(prepared); or set quant_mode=QuantizationMode.eager_mode for quantize_")
        return None

    def to_fqn_config(self, model: nn.Module) -> FqnToConfig:
        """FqnToConfig with one exact entry per selected layer (None entries are dropped: left float)."""
        why = self.route_error("eager")
        if why is not None:
            raise QuantizationError(why)
        entries, problems = {}, []
        for fqn, module in model.named_modules():
            if not fqn:
                continue
            try:
                cfg = self.layer_config(fqn, module)
            except (QuantizationError, ValueError) as e:
                problems.append(f"  - {fqn}: {e}")
                continue
            if cfg is not None:
                entries[fqn] = cfg
        if problems:
            raise QuantizationError("Config cannot quantize {} layer(s):\n{}\nNothing was quantized.".format(
                len(problems), "\n".join(problems)))
        return FqnToConfig(entries)

    # -- JSON ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        types = {}
        for k, v in self.layer_type_quant_config.items():
            if isinstance(k, type):
                if not k.__module__.startswith("torch.nn"):
                    raise ValueError(f"Config.layer_type_quant_config key {k.__qualname__}: only torch.nn classes "
                                     f"are written as classes; key it by its name {k.__name__!r} (matched by name "
                                     "in the MRO) to save it")
                key = f"class:{k.__module__}:{k.__qualname__}"
            else:
                key = k
            types[key] = v.to_dict()
        return {"type": "Config", "global_quant_config": self.global_quant_config.to_dict(),
                "layer_type_quant_config": types,
                "layer_quant_config": {k: v.to_dict() for k, v in self.layer_quant_config.items()},
                "exclude": list(self.exclude),
                "algo_config": None if self.algo_config is None else self.algo_config.to_dict(),
                "pre_quant_opt_config": None if self.pre_quant_opt_config is None
                else self.pre_quant_opt_config.to_dict(), "quant_mode": self.quant_mode.value}

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """Inverse of `to_dict`. ValueError names a missing, unknown or wrong-typed field; classes are looked up
        in allow-lists (torch.nn layer types; observers: `register_observer`), never imported."""
        if not isinstance(d, dict) or d.get("type") != "Config":
            raise ValueError(f"Config.from_dict expects the dict Config.to_dict() writes (with 'type': 'Config'), "
                             f"got {d if not isinstance(d, dict) else {'type': d.get('type')}!r}")
        _no_unknown_keys("Config", d, _CONFIG_KEYS)
        if d.get("global_quant_config") is None:
            raise ValueError("Config.from_dict: the dict has no 'global_quant_config'; every Config has one (a "
                             "QuantizationConfig dict; {} quantizes nothing unless a layer level sets specs)")
        types = {}
        for k, v in _dict_field(d, "layer_type_quant_config").items():
            if k.startswith("class:"):
                module, _, qualname = k.removeprefix("class:").partition(":")
                k = load_class({"module": module, "qualname": qualname}, f"Config.layer_type_quant_config key {k!r}",
                                layer_type_registry(), "torch.nn module classes (key other classes by name)")
            types[k] = _sub_config(f"layer_type_quant_config[{k!r}]", v)
        exclude = d.get("exclude")
        if exclude is not None and (not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude)):
            raise ValueError(f"Config.exclude={exclude!r}: use a list of layer names / fnmatch patterns, e.g. "
                             "['lm_head'] (a single name too goes in a list)")
        mode = d.get("quant_mode", QuantizationMode.eager_mode.value)
        if not isinstance(mode, str):
            raise ValueError(f"Config.quant_mode={mode!r}: use one of {[m.value for m in QuantizationMode]}")
        return cls(_sub_config("global_quant_config", d["global_quant_config"]), types,
                   {k: _sub_config(f"layer_quant_config[{k!r}]", v)
                    for k, v in _dict_field(d, "layer_quant_config").items()},
                   list(exclude or ()), _algorithm_from_dict("algo_config", d.get("algo_config")),
                   _algorithm_from_dict("pre_quant_opt_config", d.get("pre_quant_opt_config")), mode)


_CONFIG_KEYS = ("type", "global_quant_config", "layer_type_quant_config", "layer_quant_config", "exclude",
                "algo_config", "pre_quant_opt_config", "quant_mode")


def _no_unknown_keys(owner: str, d: dict, known) -> None:
    unknown = [k for k in d if k not in known]
    if unknown:
        raise ValueError(f"{owner}.from_dict: unknown keys {sorted(map(repr, unknown))}; use {list(known)}")


def _dict_field(d: dict, name: str) -> dict:
    """d[name] as a dict with str keys ({} when absent or None); ValueError naming the field otherwise."""
    v = d.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and k for k in v):
        raise ValueError(f"Config.{name}={v!r}: use a dict of non-empty str keys -> QuantizationConfig dicts")
    return v


def _sub_config(field_name: str, v) -> QuantizationConfig:
    try:
        return QuantizationConfig.from_dict(v)
    except ValueError as e:
        raise ValueError(f"Config.{field_name}: {e}") from None


def _algorithm_from_dict(name: str, d):
    from affineq.configs import config_from_dict

    if isinstance(d, list):  # Quark writes a list of one
        return [_algorithm_from_dict(name, x) for x in d]
    try:
        return None if d is None else config_from_dict(d)
    except ValueError as e:
        raise ValueError(f"Config.{name}: {e}") from None


def _algorithm_template(name: str, value, pre_quant: bool):
    """`value` as one algorithm template (an AlgorithmConfig with base_config=None; a one-element list, as
    Quark writes them, is accepted), or None. ValueError names the field and the fix."""
    from affineq.algorithms import AlgorithmConfig

    if isinstance(value, (list, tuple)):
        if len(value) > 1:
            raise ValueError(f"Config.{name} holds {len(value)} algorithms; affineq runs one per layer: pass one")
        value = value[0] if value else None
    if value is None:
        return None
    kind = "SmoothQuantConfig" if pre_quant else "GPTQConfig, AWQConfig or HQQConfig"
    if not isinstance(value, AlgorithmConfig):
        raise ValueError(f"Config.{name}={value!r}: use an affineq algorithm config without a base ({kind}, e.g. "
                         f"{kind.split(',')[0]}(None)); each layer's resolved weight config becomes its base")
    if value.base_config is not None:
        raise ValueError(f"Config.{name}={type(value).__name__}(base_config={value.base_config!r}): inside Config "
                         f"leave base_config=None; each layer's resolved weight config becomes its base")
    if bool(getattr(value, "pre_quant", False)) != pre_quant:
        where = "pre_quant_opt_config" if getattr(value, "pre_quant", False) else "algo_config"
        raise ValueError(f"Config.{name}={type(value).__name__}: it belongs in Config.{where} ({kind} go in "
                         f"Config.{name})")
    return value
