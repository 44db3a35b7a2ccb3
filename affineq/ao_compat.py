"""torch.ao migration entry point: `quantize_dynamic` with torch.ao's signature and meaning, run by `quantize_`.

    model = affineq.quantize_dynamic(model, {nn.Linear, nn.LSTM}, dtype=torch.qint8)

`qconfig_spec` is read as torch.ao reads it: None (the default module types of `dtype`), a set of module
types (each gets `dtype`'s default qconfig), or a dict whose keys are module types or submodule names and
whose values are torch.ao qconfigs (`default_dynamic_qconfig`, `per_channel_dynamic_qconfig`,
`float_qparams_weight_only_qconfig(_4bit)`, ...), dtypes, None (leave float) or affineq configs (any config
that needs nothing but the weight: weight-only or dynamic activations, `affineq.capability.runtime_only`).
A name applies to that submodule and its children, a name beats a type, a type beats what the parent passes
down (torch.ao's `propagate_qconfig_`); a module's own `.qconfig` attribute beats both. Types match exactly
(no subclasses).

Each selected module's qconfig maps to an affineq config (`config_for_qconfig`, `config_for_dtype`):

- Linear / RNNs, qint8 weight + dynamic quint8/qint8 activation (default_dynamic_qconfig,
  per_channel_dynamic_qconfig): `Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")`
- Linear / RNNs, qint8 weight + float activation (weight only): `Int8WeightOnlyConfig()`
- Embedding / EmbeddingBag, quint8 per_channel_affine_float_qparams (float_qparams_weight_only_qconfig):
  `IntxWeightOnlyConfig(torch.uint8, PerAxis(0), ASYMMETRIC, ZeroPointDomain.FLOAT, fp32 scales)`
- the same with quint4x2 (float_qparams_weight_only_qconfig_4bit): that config with torch.uint4

affineq's int8 weights are per output channel even where torch.ao's qconfig says per tensor (at least as
accurate), and its dynamic activations are 8-bit symmetric (torch.ao's x86 default is 7-bit asymmetric,
`reduce_range`). Refused with a ValueError naming the parameter and the fix, before anything changes:
float16 (affineq stores no fp16 weights), unknown dtypes, static activation observers (use `prepare_` /
`convert_` with `Int8StaticActivationInt8WeightConfig`), keys naming types or modules the model cannot
have quantized, a custom `mapping`. The selection is torch.ao's; it becomes an `FqnToConfig` of exact
module names that `quantize_` plans (`affineq.plan`) like any other config. Unlike torch.ao (whose `convert`
never swaps the root), a root module that is itself selected is quantized too.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from affineq.capability import runtime_only
from affineq.configs import (
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    QuantConfig,
)
from affineq.granularity import PerAxis
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.quantize import FqnToConfig, QuantizationError, quantize_
from affineq.recurrent import RECURRENT_TYPES

__all__ = ["quantize_dynamic", "config_for_qconfig", "config_for_dtype"]

_LINEAR = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)
_RECURRENT = (nn.LSTM, nn.GRU, nn.LSTMCell, nn.RNNCell, nn.GRUCell)
_EMBEDDING = (nn.Embedding, nn.EmbeddingBag)
_QUANTIZABLE = (*_LINEAR, *_RECURRENT, *_EMBEDDING)  # torch.ao's default dynamic mapping, less its own classes
_DTYPE_DEFAULT_TYPES = {  # torch.ao's quantize_dynamic(qconfig_spec=None) module types per dtype
    torch.qint8: (nn.Linear, *_RECURRENT),
    torch.quint8: (nn.EmbeddingBag, nn.Embedding),
    torch.quint4x2: (nn.EmbeddingBag,),
}
_DTYPES = ("torch.qint8", "torch.quint8", "torch.quint4x2")
_FLOAT16_FIX = ("affineq stores no float16 weights. Use dtype=torch.qint8 (int8 weights, int8 dynamic "
                "activations: Int8DynamicActivationInt8WeightConfig), affineq.Float8WeightOnlyConfig() for 8-bit "
                "float weights, or model.half() for float16 weights without quantization")
_STATIC_FIX = ("quantize_dynamic quantizes activations at run time; for static activation quantization use "
               "affineq.prepare_(model, affineq.Int8StaticActivationInt8WeightConfig()), run calibration batches, "
               "then affineq.convert_(model) (or affineq.quantize_(model, Int8StaticActivationInt8WeightConfig(), "
               "calibration_data=batches))")
_SYMMETRIC_OR_AFFINE = (torch.per_tensor_symmetric, torch.per_tensor_affine, torch.per_channel_symmetric,
                        torch.per_channel_affine)


def _float_qparams(weight_dtype: torch.dtype) -> IntxWeightOnlyConfig:
    """torch.ao's per_channel_affine_float_qparams: one scale and one float offset per row, unsigned codes."""
    return IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=PerAxis(0),
                                mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                                scale_dtype=torch.float32)


def _type_name(t: type) -> str:
    return f"nn.{t.__name__}" if t.__module__.startswith("torch.nn.modules") else t.__qualname__


def _observer(factory, what: str, where: str):
    """The observer instance of a qconfig field (torch.ao stores a factory: a class or a `with_args` partial)."""
    if factory is None:
        return None
    if not callable(factory):
        raise ValueError(f"{where}: qconfig.{what}={factory!r} is not an observer factory; pass a torch.ao "
                         "QConfig such as torch.ao.quantization.default_dynamic_qconfig, or a dtype")
    return factory()


def config_for_qconfig(qconfig, module_type: type[nn.Module] = nn.Linear, where: str = "qconfig") -> QuantConfig:
    """The affineq config that quantizes a `module_type` module as torch.ao `qconfig` (QConfig /
    QConfigDynamic) says. Reads the dtype / qscheme / ch_axis of `qconfig.weight()` and the dtype and
    `is_dynamic` of `qconfig.activation()`. Raises ValueError (naming `where`) for what affineq cannot match."""
    if not (hasattr(qconfig, "weight") and hasattr(qconfig, "activation")):
        raise ValueError(f"{where}={qconfig!r} is not a torch.ao qconfig: pass a QConfig / QConfigDynamic (e.g. "
                         "torch.ao.quantization.default_dynamic_qconfig), a dtype such as torch.qint8, or None "
                         "to leave the module float")
    weight = _observer(qconfig.weight, "weight", where)
    act = _observer(qconfig.activation, "activation", where)
    w_dtype = getattr(weight, "dtype", None)
    qscheme = getattr(weight, "qscheme", None)
    a_dtype = getattr(act, "dtype", torch.float32)
    dynamic = bool(getattr(act, "is_dynamic", False))
    name = _type_name(module_type)
    if w_dtype == torch.float16 or a_dtype == torch.float16:
        raise ValueError(f"{where}: a float16 qconfig (float16_dynamic_qconfig) for {name}: {_FLOAT16_FIX}")
    if module_type in _EMBEDDING:
        if w_dtype in (torch.quint8, torch.quint4x2) and qscheme == torch.per_channel_affine_float_qparams:
            if getattr(weight, "ch_axis", 0) != 0:
                raise ValueError(f"{where}: {name} weights are quantized per row; use ch_axis=0 "
                                 "(float_qparams_weight_only_qconfig)")
            return _float_qparams(torch.uint8 if w_dtype == torch.quint8 else torch.uint4)
        raise ValueError(f"{where}: {name} takes weight-only per-row qparams (weight dtype {w_dtype}, qscheme "
                         f"{qscheme} given); use torch.ao.quantization.float_qparams_weight_only_qconfig (uint8) or "
                         "float_qparams_weight_only_qconfig_4bit (4-bit), or dtype=torch.quint8 / torch.quint4x2, "
                         "as torch.ao also requires")
    if module_type not in (*_LINEAR, *_RECURRENT):
        raise ValueError(f"{where}: quantize_dynamic cannot quantize {name} modules; it quantizes "
                         f"{sorted(_type_name(t) for t in _QUANTIZABLE)}. Use affineq.quantize_ with a config "
                         "for other modules (e.g. Int8WeightOnlyConfig for nn.Conv2d)")
    if w_dtype != torch.qint8 or qscheme not in _SYMMETRIC_OR_AFFINE:
        raise ValueError(f"{where}: {name} weights must be torch.qint8 per tensor or per channel (got dtype "
                         f"{w_dtype}, qscheme {qscheme}); use default_dynamic_qconfig / per_channel_dynamic_qconfig "
                         "or dtype=torch.qint8")
    if qscheme in (torch.per_channel_symmetric, torch.per_channel_affine) and getattr(weight, "ch_axis", 0) != 0:
        raise ValueError(f"{where}: per-channel weights need ch_axis=0 (one scale per output channel), got "
                         f"ch_axis={weight.ch_axis}")
    if a_dtype in (torch.quint8, torch.qint8):
        if not dynamic:
            raise ValueError(f"{where}: the activation observer {type(act).__name__} is static (is_dynamic=False). "
                             f"{_STATIC_FIX}")
        return Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")
    if a_dtype in (torch.float32, torch.float, None):
        return Int8WeightOnlyConfig()
    raise ValueError(f"{where}: activation dtype {a_dtype} has no affineq match; use a dynamic quint8/qint8 "
                     "activation (default_dynamic_qconfig) or a float one (weight-only int8)")


def config_for_dtype(dtype: torch.dtype, module_type: type[nn.Module] = nn.Linear,
                     where: str = "dtype") -> QuantConfig:
    """The affineq config for torch.ao's default qconfig of `dtype` on a `module_type` module: qint8 ->
    default_dynamic_qconfig, quint8 -> float_qparams_weight_only_qconfig, quint4x2 -> its 4-bit variant."""
    if dtype == torch.float16:
        raise ValueError(f"{where}=torch.float16: {_FLOAT16_FIX}")
    name = _type_name(module_type)
    if dtype == torch.qint8:
        if module_type in (*_LINEAR, *_RECURRENT):
            return Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")
        if module_type in _EMBEDDING:
            raise ValueError(f"{where}=torch.qint8 for {name}: embeddings take per-row weight-only qparams; use "
                             "torch.quint8 (8-bit) or torch.quint4x2 (4-bit), as torch.ao also requires")
    elif dtype in (torch.quint8, torch.quint4x2):
        if module_type in _EMBEDDING:
            return _float_qparams(torch.uint8 if dtype == torch.quint8 else torch.uint4)
        if module_type in (*_LINEAR, *_RECURRENT):
            raise ValueError(f"{where}={dtype} for {name}: {dtype} is torch.ao's embedding weight type; use "
                             "torch.qint8 for Linear and recurrent modules")
    else:
        raise ValueError(f"{where}={dtype!r} is not a quantize_dynamic dtype; use one of {', '.join(_DTYPES)} "
                         "(torch.float16 is refused: affineq stores no float16 weights)")
    raise ValueError(f"{where}: quantize_dynamic cannot quantize {name} modules; it quantizes "
                     f"{sorted(_type_name(t) for t in _QUANTIZABLE)}. Use affineq.quantize_ with a config for "
                     "other modules")


def _check_mapping(mapping) -> set[type]:
    """The module types quantize_dynamic may quantize: torch.ao's default dynamic mapping, or the keys of a
    `mapping` every entry of which is a default one (affineq installs its own modules, not torch.ao's)."""
    if mapping is None:
        return set(_QUANTIZABLE)
    if not isinstance(mapping, dict):
        raise ValueError(f"mapping must be None or a dict of float module type -> torch.ao dynamic quantized type, "
                         f"got {type(mapping).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization.quantization_mappings import get_default_dynamic_quant_module_mappings
        default = get_default_dynamic_quant_module_mappings()
    custom = {k: v for k, v in mapping.items() if k not in _QUANTIZABLE or default.get(k) is not v}
    if custom:
        raise ValueError(f"mapping={custom!r}: affineq does not install torch.ao's quantized classes, so a custom "
                         "mapping cannot apply; pass mapping=None (or a subset of torch.ao's default dynamic "
                         "mapping to restrict the types), and for your own modules register an affineq handler "
                         "(affineq.register_quantize_module_handler) and call affineq.quantize_")
    return set(mapping)


def _spec_value(value, module_type: type, where: str) -> QuantConfig | None:
    if value is None:
        return None
    if isinstance(value, QuantConfig):  # an affineq config, accepted by what it needs (`runtime_only`)
        why = runtime_only(value)
        if why is not None:
            raise ValueError(f"{where}={type(value).__name__}(...): {why}, which quantize_dynamic cannot give. "
                             f"{_STATIC_FIX}")
        return value
    if isinstance(value, torch.dtype):
        return config_for_dtype(value, module_type, where)
    return config_for_qconfig(value, module_type, where)


def _normalize_spec(qconfig_spec, dtype) -> dict:
    """qconfig_spec as torch.ao's dict {type or name: qconfig / dtype / None}."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r} must be a torch dtype: one of {', '.join(_DTYPES)}")
    if dtype == torch.float16:
        raise ValueError(f"dtype=torch.float16: {_FLOAT16_FIX}")
    if dtype not in _DTYPE_DEFAULT_TYPES:
        raise ValueError(f"dtype={dtype} is not a quantize_dynamic dtype; use one of {', '.join(_DTYPES)}")
    if qconfig_spec is None:
        return dict.fromkeys(_DTYPE_DEFAULT_TYPES[dtype], dtype)
    if isinstance(qconfig_spec, (set, frozenset)):
        bad = [k for k in qconfig_spec if not isinstance(k, type)]
        if bad:
            raise ValueError(f"qconfig_spec: a set holds module types (e.g. {{nn.Linear, nn.LSTM}}), got {bad}; "
                             "use a dict {'submodule.name': qconfig} to select modules by name")
        return dict.fromkeys(qconfig_spec, dtype)
    if isinstance(qconfig_spec, dict):
        bad = [k for k in qconfig_spec if not isinstance(k, (type, str))]
        if bad:
            raise ValueError(f"qconfig_spec keys must be module types or submodule names, got {bad}")
        return dict(qconfig_spec)
    raise ValueError(f"qconfig_spec must be None, a set of module types or a dict {{type or name: qconfig}}, got "
                     f"{type(qconfig_spec).__name__} (a QConfigMapping is for prepare_fx: pass its entries as a "
                     "dict, or use affineq.FqnToConfig with affineq.quantize_)")


def _plan(model: nn.Module, spec: dict, allowed: set[type]) -> dict[str, QuantConfig]:
    """{module name: affineq config} for every module torch.ao would quantize (all checks done here)."""
    modules = dict(model.named_modules())
    missing = [k for k in spec if isinstance(k, str) and k not in modules]
    if missing:
        raise ValueError(f"qconfig_spec names submodules the model does not have: {missing}; use names from "
                         "model.named_modules()")
    # A type key outside `allowed` only makes sense for a container that passes its qconfig down to children.
    outside = [k for k in spec if isinstance(k, type) and k not in allowed and spec[k] is not None
               and not any(type_before_parametrizations(m) is k and m._modules for m in modules.values())]
    if outside:
        raise ValueError(f"qconfig_spec: quantize_dynamic cannot quantize {[_type_name(t) for t in outside]} "
                         f"(it quantizes {sorted(_type_name(t) for t in allowed)}; torch.ao would skip them "
                         "silently); drop them, or use affineq.quantize_ with a config for those modules")
    plan: dict[str, QuantConfig] = {}
    cache: dict[tuple[int, type], QuantConfig | None] = {}

    def visit(module: nn.Module, prefix: str, parent) -> None:
        mtype = type_before_parametrizations(module)  # as torch.ao: a parametrized Linear is still a Linear
        qconfig = spec.get(mtype, parent)
        qconfig = spec.get(prefix, qconfig)
        qconfig = getattr(module, "qconfig", qconfig)
        if qconfig is not None and mtype in allowed:
            key = (id(qconfig), mtype)
            if key not in cache:
                where = (f"qconfig_spec[{prefix!r}]" if prefix in spec else f"qconfig_spec[{_type_name(mtype)}]"
                         if mtype in spec else f"the qconfig of {prefix!r}")
                cache[key] = _spec_value(qconfig, mtype, where)
            plan[prefix] = cache[key]
        elif prefix in spec and qconfig is not None and not module._modules:
            raise ValueError(f"qconfig_spec[{prefix!r}]: quantize_dynamic cannot quantize {prefix!r}, a "
                             f"{_type_name(mtype)}; it quantizes {sorted(_type_name(t) for t in allowed)}")
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name, qconfig)

    visit(model, "", None)
    return plan


def quantize_dynamic(model: nn.Module, qconfig_spec=None, dtype: torch.dtype = torch.qint8, mapping=None,
                     inplace: bool = False) -> nn.Module:
    """torch.ao.quantization.quantize_dynamic, run by affineq: quantize the selected modules' weights (and
    activations at run time) with the affineq config each torch.ao qconfig maps to, in ONE all-or-nothing
    `quantize_` call (an `FqnToConfig` of exact module names), then `model.eval()` as torch.ao does.

    qconfig_spec: None (dtype's default types), a set of module types, or a dict {type or name: qconfig,
    dtype or None}. dtype: torch.qint8 (Linear / RNNs: int8 weights, dynamic int8 activations),
    torch.quint8 (Embedding / EmbeddingBag: per-row uint8, float zero point) or torch.quint4x2 (4-bit rows).
    mapping: None, or a subset of torch.ao's default dynamic mapping. inplace: False deep-copies the model
    first. Returns the quantized model; every check runs before anything changes.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise ValueError(f"inplace must be True or False, got {inplace!r}")
    spec = _normalize_spec(qconfig_spec, dtype)
    plan = _plan(model, spec, _check_mapping(mapping))
    # A recurrent module is replaced by its quantized twin; at the root that is only possible on a copy.
    recurrent_root = "" in plan and plan[""] is not None and isinstance(model, RECURRENT_TYPES)
    if recurrent_root and inplace:
        raise ValueError(f"quantize_dynamic(inplace=True) cannot quantize a {type(model).__name__} passed as the "
                         "model itself: it is replaced by a quantized module, not changed in place; pass "
                         "inplace=False and use the returned module")
    if not inplace:
        model = copy.deepcopy(model)
    if recurrent_root:
        holder = nn.Sequential(model)
        quantize_(holder, FqnToConfig({"0": plan[""]}))
        return holder[0].eval()
    if not plan:
        warnings.warn("quantize_dynamic: no module matched qconfig_spec, so nothing was quantized (torch.ao "
                      "returns the model unchanged too); check the types / names in qconfig_spec", stacklevel=2)
    else:
        try:
            quantize_(model, FqnToConfig(plan))
        except QuantizationError as e:
            raise QuantizationError(f"quantize_dynamic: {e}\nIn quantize_dynamic terms: leave those module types "
                                    "out of qconfig_spec, or map their names to None in a dict qconfig_spec "
                                    "({'name': None})") from e
    return model.eval()
