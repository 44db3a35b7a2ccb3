"""The base of every config (`QuantConfig`), its JSON form (`config_from_dict`, `encode_field` /
`decode_field`) and the checks the config families share (`check_choice`, `row_block`, "auto" formats).

Configs are frozen dataclasses that validate themselves, round-trip through JSON and map to one handler each
(registered in `affineq.quantize`).

A config answers: `check(module)` (why it cannot apply, or None), `parameter_names(module)` (what it
quantizes: `weight` unless `param_names` says otherwise) and `weight_spec(weight, module)` (the `QuantSpec`
it wants for a weight, plus `qparam_options()`); the base class's `quantize_weight` does the rest
(`AffineQuantizedTensor.from_spec`). "auto" packing formats are resolved from the spec by the kernel registry
(`resolve_format` -> `affineq.tensor.kernel_registry.choose_format`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from affineq import granularity as _gran
from affineq.expert_weights import (
    expert_parameter_names,
    expert_weight_problem,
    is_expert_module,
    per_expert_shape,
)
from affineq.granularity import Granularity, PerAxis, PerGroup, get_block_size
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.recurrent import RECURRENT_TYPES, recurrent_weight_names
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.kernel_registry import choose_format
from affineq.tensor.spec import QParamOptions, QuantSpec, check_compute_dtype

__all__ = ["QuantConfig", "check_choice", "config_from_dict", "decode_field", "encode_field", "resolve_format",
           "row_block"]

_CONFIGS: dict[str, type[QuantConfig]] = {}
_POW2_SCALE_MODES = {"pof2": "rceil", "e8m0": "floor"}  # power-of-two scale types -> affineq.mx scale_mode
_ENUMS = {"MappingType": MappingType, "ZeroPointDomain": ZeroPointDomain}


# -- JSON encoding of config fields -------------------------------------------------------------------


def encode_field(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, enum.Enum):
        return {"enum": type(v).__name__, "name": v.name}
    if isinstance(v, QuantConfig):
        return v.to_dict()
    if isinstance(v, Granularity):
        return {"granularity": type(v).__name__, **dataclasses.asdict(v)}
    if isinstance(v, dict):
        return {"map": {k: encode_field(x) for k, x in v.items()}}
    if isinstance(v, tuple):
        return [encode_field(x) for x in v]
    return v


def _only_keys(v: dict, keys: tuple[str, ...]) -> None:
    extra = [k for k in v if k not in keys]
    if extra:
        raise ValueError(f"config field {v!r} has unknown keys {sorted(map(repr, extra))}; a {keys[0]!r} entry holds "
                         f"only {list(keys)} (as QuantConfig.to_dict writes it)")


def _granularities() -> dict[str, type[Granularity]]:
    return {c.__name__: c for c in vars(_gran).values()
            if isinstance(c, type) and issubclass(c, Granularity) and c is not Granularity}


#: The torch dtypes a config dict may name: looked up here, never by getattr on torch.
_TORCH_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                                         if isinstance(d, torch.dtype)}


def decode_field(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(decode_field(x) for x in v)
    if not isinstance(v, dict):
        return v
    if "type" in v:  # a config first: its fields may be named "granularity" or "dtype" too
        return config_from_dict(v)
    if "dtype" in v:
        _only_keys(v, ("dtype",))
        dtype = _TORCH_DTYPES.get(v["dtype"]) if isinstance(v["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"unknown torch dtype {v['dtype']!r}; use a torch dtype name such as 'bfloat16', "
                             "'float32' or 'int4' (as QuantConfig.to_dict writes it)")
        return dtype
    if "enum" in v:
        _only_keys(v, ("enum", "name"))
        enum_cls = _ENUMS.get(v["enum"]) if isinstance(v["enum"], str) else None
        if enum_cls is None:
            raise ValueError(f"unknown enum {v['enum']!r}; use one of {sorted(_ENUMS)}")
        members = list(enum_cls.__members__)
        if not isinstance(v.get("name"), str) or v["name"] not in members:
            raise ValueError(f"{v['enum']} has no member {v.get('name')!r}; use one of {members}")
        return enum_cls[v["name"]]
    if "granularity" in v:
        known = _granularities()
        cls = known.get(v["granularity"]) if isinstance(v["granularity"], str) else None
        if cls is None:
            raise ValueError(f"unknown granularity {v['granularity']!r}; use one of {sorted(known)}")
        kwargs = {k: decode_field(x) for k, x in v.items() if k != "granularity"}
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"{cls.__name__} cannot take fields {sorted(kwargs)} ({e}); pass the fields "
                             f"{cls.__name__} has, as QuantConfig.to_dict writes them") from None
    if "map" in v:
        _only_keys(v, ("map",))
        if not isinstance(v["map"], dict) or not all(isinstance(k, str) for k in v["map"]):
            raise ValueError(f"cannot decode config field {v!r}: 'map' must hold a dict with str keys")
        return {k: decode_field(x) for k, x in v["map"].items()}
    raise ValueError(f"cannot decode config field {v!r}; pass values as QuantConfig.to_dict writes them "
                     "(plain JSON values, or a dict with one of the keys 'type', 'dtype', 'enum', 'granularity', "
                     "'map')")


def config_from_dict(d: dict) -> QuantConfig:
    """Inverse of `QuantConfig.to_dict`: {"type": "Int4WeightOnlyConfig", "group_size": 128, ...}.

    Anything that is not such a dict raises ValueError naming the offending field."""
    if not isinstance(d, dict):
        raise ValueError(f"config_from_dict expects a dict from QuantConfig.to_dict(), got {type(d).__name__}")
    name = d.get("type")
    if not isinstance(name, str) or name not in _CONFIGS:
        raise ValueError(f"unknown config type {name!r}: 'type' must be one of {sorted(_CONFIGS)}")
    cls = _CONFIGS[name]
    if cls.from_dict.__func__ is not QuantConfig.from_dict.__func__:
        return cls.from_dict(d)  # a config with its own encoding (FqnToConfig)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known - {"type"}
    if unknown:
        raise ValueError(f"{name} has no fields {sorted(unknown)}; use its fields: {sorted(known)}")
    fields = {}
    for k, v in d.items():
        if k == "type":
            continue
        try:
            fields[k] = decode_field(v)
        except ValueError as e:
            raise ValueError(f"{name}.{k}: {e}") from None
    try:
        return cls(**fields)
    except TypeError as e:  # a field of a type its checks never expected (a list where a number goes, ...)
        raise ValueError(f"{name}: the dict's fields {sorted(fields)} do not build a {name} ({e}); pass values of "
                         "the types QuantConfig.to_dict writes") from None


# -- base -----------------------------------------------------------------------------------------------

#: Modules a quantized weight reaches through no matmul kernel (lookups, convolutions): no compute_dtype there.
_NO_MATMUL_MODULES = (nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd)


def _spec_with_compute_dtype(config, spec: QuantSpec) -> QuantSpec:
    """`spec` with `config.compute_dtype` recorded."""
    if config.compute_dtype is None or spec.compute_dtype == config.compute_dtype:
        return spec
    return spec.replace(compute_dtype=config.compute_dtype)


def _with_compute_dtype(weight_spec):
    """A config's `weight_spec` with its `compute_dtype` recorded in the spec."""
    @functools.wraps(weight_spec)
    def wrapped(self, weight, module):
        return _spec_with_compute_dtype(self, weight_spec(self, weight, module))
    return wrapped


def _quantizing_with_compute_dtype(quantize_weight):
    """A config's own `quantize_weight` (one that builds its tensor without `weight_spec`: k-quants, GGUF blocks,
    shared micro-exponents) whose result carries the config's `compute_dtype` too."""
    @functools.wraps(quantize_weight)
    def wrapped(self, weight, module):
        w = quantize_weight(self, weight, module)
        spec = _spec_with_compute_dtype(self, w.spec)
        return w if spec is w.spec else AffineQuantizedTensor.from_tensors(w.tensors, spec)
    return wrapped

# Field name -> the type every config field of that name must have (checked at construction).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "mapping_type": (MappingType,),
    "zero_point_domain": (ZeroPointDomain, type(None)),
    "packing_format": (str,),
    "preserve_zero": (bool,),
    "scale_dtype": (torch.dtype,),
    "weight_dtype": (torch.dtype,),
    "activation_dtype": (torch.dtype,),
    "granularity": (Granularity,),
    "compute_dtype": (torch.dtype, type(None)),
}
# What a right value looks like, for the error message of a wrong-typed field.
_FIELD_EXAMPLES: dict[str, str] = {
    "mapping_type": "MappingType.ASYMMETRIC, not 'ASYMMETRIC'",
    "zero_point_domain": "ZeroPointDomain.FLOAT or None, not 'FLOAT'",
    "packing_format": "'auto' or 'dense'",
    "preserve_zero": "True or False, not 1",
    "scale_dtype": "torch.bfloat16, not 'bf16'",
    "weight_dtype": "torch.int4, not 'int4'",
    "activation_dtype": "torch.float8_e4m3fn, not 'float8_e4m3fn'",
    "granularity": "PerGroup(32) or PerAxis(0), not 'per_group:32' (affineq.parse_granularity reads strings)",
    "compute_dtype": "torch.bfloat16 or None, not 'bf16'",
}


@dataclass(frozen=True)
class QuantConfig:
    """Base of all configs. Subclasses list the module types they quantize in `modules` and say which spec
    they want for a weight (`weight_spec`, `qparam_options`).

    param_names: the parameters of each selected module to quantize (default None: `weight`; for a
    recurrent module every `weight_ih*` / `weight_hh*` / `weight_hr*`); e.g. ("weight_ih_l0",) or a bare
    Parameter's name. `FqnToConfig` sets it for parameter-name keys.

    Recurrent modules (nn.LSTM / GRU / RNN and their cells, `affineq.recurrent`) run their weights through
    F.linear, so every config that quantizes nn.Linear takes them when `filter_fn` selects them, unless it
    sets `recurrent_unsupported` to the reason it cannot.

    MoE experts modules (3-D `gate_up_proj` / `down_proj`, `affineq.expert_weights`) are a stack of linear
    weights: every config that quantizes nn.Linear quantizes them expert by expert, unless it sets
    `experts_unsupported` to the reason it cannot.

    compute_dtype: None (default: a linear computes in its input's dtype; float32 input is exact) or
    torch.bfloat16: a float32 input is rounded to bf16 (round to nearest even) and the linear computes exactly as
    it does for that bf16 input, the bf16 result widened back to float32 and the float32 bias added. Weight-only
    configs where the bf16 kernels run (AVX512-BF16, AMX): the weight dequantized to bf16 with float32 sums, i.e.
    `F.linear(x.bfloat16(), W.bfloat16()).float() + b` (AVX2-only CPUs: W as dequantized, the product rounded to
    bf16); configs that quantize activations (8da4w, W8A8, static, float8) quantize the bf16-rounded input as they
    quantize a bf16 input. This runs the bf16 kernels (several times faster at M >= 32 than the exact float32
    path on AMX Xeons). A recurrent module's products (input and recurrent, every step) compute so too.
    Recorded in each weight's spec, so it survives save / load.
    """

    modules: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)
    recurrent_unsupported: ClassVar[str | None] = None
    experts_unsupported: ClassVar[str | None] = None
    _field_types: ClassVar[dict[str, tuple[type, ...]]] = {}  # a subclass's own overrides of _FIELD_TYPES
    param_names: tuple[str, ...] | None = field(default=None, kw_only=True)
    compute_dtype: torch.dtype | None = field(default=None, kw_only=True)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _CONFIGS[cls.__name__] = cls
        if "weight_spec" in cls.__dict__:  # every route asks weight_spec: compute_dtype reaches all of them here
            cls.weight_spec = _with_compute_dtype(cls.__dict__["weight_spec"])
        if "quantize_weight" in cls.__dict__:  # and the tensors a config builds itself
            cls.quantize_weight = _quantizing_with_compute_dtype(cls.__dict__["quantize_weight"])

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            want = self._field_types.get(f.name, _FIELD_TYPES.get(f.name))
            value = getattr(self, f.name)
            if want is not None and not isinstance(value, want):
                names = " or ".join(t.__name__ for t in want)
                raise ValueError(f"{type(self).__name__}.{f.name}={value!r} must be a {names}, not "
                                 f"{type(value).__name__}: use e.g. {_FIELD_EXAMPLES[f.name]}")
        if self.param_names is not None and (
                not isinstance(self.param_names, tuple) or not self.param_names
                or not all(isinstance(n, str) and n for n in self.param_names)):
            raise ValueError(f"param_names={self.param_names!r} must be a non-empty tuple of parameter names, "
                             "e.g. ('weight',) or ('weight_ih_l0', 'weight_hh_l0')")
        check_compute_dtype(self.compute_dtype, f"{type(self).__name__}.compute_dtype")

    def to_dict(self) -> dict:
        out = {"type": type(self).__name__}
        for f in dataclasses.fields(self):
            out[f.name] = encode_field(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        cfg = config_from_dict(d)
        if not isinstance(cfg, cls):
            raise ValueError(f"{cls.__name__}.from_dict got a {type(cfg).__name__} dict")
        return cfg

    # -- what to quantize -------------------------------------------------------------------------------

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        """Names of the parameters of `module` this config quantizes."""
        if self.param_names is None and isinstance(module, RECURRENT_TYPES):
            return recurrent_weight_names(module)
        if self.param_names is None and is_expert_module(module):
            return expert_parameter_names(module)
        return self.param_names or ("weight",)

    def check(self, module: nn.Module) -> str | None:
        """Why this config cannot quantize `module` (a sentence), or None."""
        if isinstance(module, RECURRENT_TYPES) and self.param_names is None:
            why = _recurrent_problem(self, module)
            if why is not None:
                return why
        elif is_expert_module(module) and self.param_names is None:
            why = _experts_problem(self, module)
            if why is not None:
                return why
        elif not isinstance(module, self.modules) and self.param_names is None:
            names = ", ".join(m.__name__ for m in self.modules)
            return f"{type(self).__name__} quantizes {names} modules, not {type(module).__name__}"
        if self.compute_dtype is not None and isinstance(module, _NO_MATMUL_MODULES):
            return (f"compute_dtype={self.compute_dtype} applies to linear layers (nn.Linear, recurrent, MoE "
                    f"experts); {type(module).__name__} has no packed kernel to run in it: leave compute_dtype None "
                    "for this module (FqnToConfig) or skip it with filter_fn")
        for name in self.parameter_names(module):
            why = self.check_parameter(module, name)
            if why is not None:
                return why
        return None

    def check_parameter(self, module: nn.Module, name: str) -> str | None:
        """Why parameter `name` of `module` cannot be quantized by this config, or None."""
        if _is_parametrized(module, name):
            if hasattr(module, f"{name}_g") and hasattr(module, f"{name}_v"):
                return (f"its {name} is computed by torch.nn.utils.weight_norm (from {name}_g and {name}_v); "
                        f"call torch.nn.utils.remove_weight_norm(module, {name!r}) first")
            return (f"its {name} is parametrized (torch.nn.utils.parametrize); call "
                    f"torch.nn.utils.parametrize.remove_parametrizations(module, {name!r}) first")
        w = module._parameters.get(name)
        if w is None:
            if isinstance(getattr(module, name, None), AffineQuantizedTensor):
                return _ALREADY.format(name=name)
            present = [n for n, v in module._parameters.items() if v is not None]  # a None bias is no parameter
            return f"it has no parameter {name!r} (parameters: {present})"
        if isinstance(w, AffineQuantizedTensor):
            return _ALREADY.format(name=name)
        if not w.dtype.is_floating_point:
            return f"its {name} is {w.dtype}, not floating point"
        if w.numel() == 0:
            return f"its {name} is empty (shape {tuple(w.shape)}); there is nothing to quantize"
        try:
            if w.dim() == 3 and is_expert_module(module):  # blocks inside one expert's [N, K] weight
                if self.experts_unsupported is not None:
                    return f"{type(self).__name__} cannot quantize expert weights: {self.experts_unsupported}"
                n, k = per_expert_shape(module, w)
                self._block_size((n, k), nn.Linear(k, n, bias=False, device="meta"))
            else:
                self._block_size(tuple(w.shape), module)
        except ValueError as e:
            return str(e)
        return None

    # -- how: the spec of a weight ----------------------------------------------------------------------

    def _block_size(self, shape: tuple[int, ...], module: nn.Module) -> tuple[int, ...]:
        """Block size for a weight of `shape` (ValueError explains a shape the config cannot take);
        default: the whole tensor (per-tensor qparams)."""
        return tuple(shape)

    def weight_spec(self, weight: torch.Tensor, module: nn.Module) -> QuantSpec:
        """The `QuantSpec` this config wants for `weight` (a parameter of `module`)."""
        raise NotImplementedError

    def qparam_options(self) -> QParamOptions:
        """How qparams are computed (scale dtype, eps, ...): fp32 scales unless a config says otherwise."""
        return QParamOptions(scale_dtype=torch.float32)

    def quantize_weight(self, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
        """The AffineQuantizedTensor that replaces `weight`."""
        return AffineQuantizedTensor.from_spec(weight, self.weight_spec(weight, module), self.qparam_options())

    def _spec(self, weight, module, target, mapping_type, domain, packing_format, act_quant=None) -> QuantSpec:
        return QuantSpec.create(
            tuple(weight.shape), weight.dtype, target, self._block_size(tuple(weight.shape), module),
            mapping_type=mapping_type, zero_point_domain=domain, packing_format=packing_format,
            act_quant=act_quant,
        )


def _linear_like_problem(config: QuantConfig, module: nn.Module, unsupported: str | None, what: str) -> str | None:
    """Why `config` cannot take `module`'s linear-like weights (`what`: "recurrent" / "MoE expert"): its own
    stated reason (`unsupported`), or that it does not quantize nn.Linear."""
    name = type(config).__name__
    if unsupported is not None:
        return f"{name} cannot quantize the {what} weights of {type(module).__name__}: {unsupported}"
    if nn.Linear not in config.modules:
        return f"{name} quantizes {', '.join(m.__name__ for m in config.modules)} modules, not {what} weights"
    return None


def _recurrent_problem(config: QuantConfig, module: nn.Module) -> str | None:
    why = _linear_like_problem(config, module, config.recurrent_unsupported, "recurrent")
    if why is not None:
        return why
    if type(module) not in RECURRENT_TYPES:
        base = next(t for t in RECURRENT_TYPES if isinstance(module, t))
        return (f"it is {type(module).__name__}, a subclass of {base.__name__} whose forward may differ; quantize_ "
                f"replaces exact {base.__name__} modules only: quantize the Linear layers inside it, or build it "
                f"from a plain {base.__name__}")
    return None


def _experts_problem(config: QuantConfig, module: nn.Module) -> str | None:
    name = type(config).__name__
    why = _linear_like_problem(config, module, config.experts_unsupported, "MoE expert")
    if why is not None:
        return why
    why = expert_weight_problem(module)
    if why is None:
        aq = _probe_act_quant(config, module)
        if aq is not None and not aq.static and isinstance(aq.granularity, _gran.PerTensor):
            why = (f"{name} quantizes activations dynamically per tensor, one scale that the rows routed to different "
                   "experts would share; use per-token activation quantization for the experts")
    return why


def _probe_act_quant(config: QuantConfig, module: nn.Module):
    """The activation quantization (an ActivationQuant, or None) `config` gives one expert's weight of `module`
    (a meta probe; None if it cannot tell)."""
    w = module._parameters[expert_parameter_names(module)[-1]]
    n, k = per_expert_shape(module, w)
    try:
        return config.weight_spec(torch.empty(n, k, dtype=w.dtype, device="meta"),
                                  nn.Linear(k, n, bias=False, device="meta", dtype=w.dtype)).act_quant
    except Exception:  # noqa: BLE001 - a config whose spec needs data: its own checks run at quantize time
        return None


_ALREADY = ("its {name} is already quantized; quantize_ a float model (load the float weights again), or "
            "skip quantized modules with filter_fn")


def _is_parametrized(module: nn.Module, name: str) -> bool:
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is not None and name in parametrizations:
        return True
    # torch.nn.utils.weight_norm (the hook form): `name` is recomputed from name_g and name_v
    return hasattr(module, f"{name}_g") and hasattr(module, f"{name}_v")


def _check_group_size(group_size: int | None, param: str = "group_size", allow_none: bool = True) -> None:
    if group_size is None and allow_none:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        alt = " or None (per channel)" if allow_none else " (32, 64, 128 or 256 are typical)"
        raise ValueError(f"{param} must be a positive int{alt}, got {group_size!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1) if isinstance(value, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}{hint}")


def row_block(shape: tuple[int, ...], group_size: int | None) -> tuple[int, ...]:
    """Per-row (group None) or per-group block over the last dim of a 2-D weight; conv: per out channel."""
    if group_size is None:
        return get_block_size(shape, PerAxis(0))
    if len(shape) != 2:
        raise ValueError(f"group_size applies to 2-D weights; this weight is {len(shape)}-D {shape}: use "
                         "group_size=None (per channel)")
    return get_block_size(shape, PerGroup(group_size))


def resolve_format(fmt: str, spec: QuantSpec, weight: torch.Tensor, module: nn.Module, *,
                   module_is_linear: bool | None = None, scale_dtype: torch.dtype | None = None) -> QuantSpec:
    """`spec` stored in packing format `fmt`; "auto": `choose_format`, the first format the spec fits that a
    kernel available here reads (for a weight on `weight.device`; `module_is_linear` defaults to whether
    `module` runs F.linear: nn.Linear and the recurrent modules; `scale_dtype`: the config's scale dtype,
    which aten's int4 layouts need to be bfloat16)."""
    if fmt != "auto":
        return spec.replace(fmt=fmt)
    if module_is_linear is None:
        module_is_linear = isinstance(module, (nn.Linear, *RECURRENT_TYPES))  # recurrent weights go through F.linear
    return spec.replace(fmt=choose_format(spec, weight.device, module_is_linear, scale_dtype))


def _auto_float_codes(fmt: str, spec: QuantSpec, weight: torch.Tensor, module: nn.Module) -> QuantSpec:
    """`resolve_format` under its name from before "auto" was decided from the spec (fp4 / fp6 / fp8 codes and
    e8m0 scales)."""
    return resolve_format(fmt, spec, weight, module)
