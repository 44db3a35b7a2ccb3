"""The planner every route into a model asks: which parameter of which module gets which config.

`plan(model, config, filter_fn)` -> ([Step(fqn, module, config)], [(fqn, why it cannot be quantized)]): the
`FqnToConfig` lookup (exact module or parameter names, "re:" regexes, "_default"), the filter (every nn.Linear
by default; a module named exactly is taken whatever the filter says), each config's own check, and the tied
weights check (one config per shared Parameter). `quantize_`, calibration (`prepare_`), graph mode, the
streaming quantizer, transformers' quantize-on-load and `quantize_dynamic` all select weights through it, so
one config selects the same weights on every route.

Also here, because every route needs them: the handler registry (`register_quantize_module_handler`: how one
module is quantized), `Workflow` (how a config's steps run when they are more than one handler call each:
algorithms, calibration), `all_or_nothing` (a snapshot of every module, restored on any failure) and
`QuantizationError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from affineq.configs import QuantConfig, decode_field, encode_field
from affineq.expert_weights import is_expert_module

__all__ = ["FqnToConfig", "ModelConfig", "QuantizationError", "Step", "Workflow", "all_or_nothing", "check_tied",
           "default_config", "handler_for", "parameter_owners", "plan", "planned_weights", "raise_problems",
           "register_quantize_module_handler", "weight_config", "workflow_of"]

FilterFn = Callable[[nn.Module, str], bool]
Handler = Callable[[nn.Module, QuantConfig], nn.Module]

_HANDLERS: dict[type, Handler] = {}


class QuantizationError(ValueError):
    """A config cannot apply to some modules; the message lists them and the ways out."""


def register_quantize_module_handler(config_cls: type) -> Callable[[Handler], Handler]:
    """Register `handler(module, config) -> module` for `config_cls` (and its subclasses). The returned
    module replaces `module` in the model (return `module` itself after changing it in place)."""

    if not (isinstance(config_cls, type) and issubclass(config_cls, QuantConfig)):
        raise TypeError(f"register_quantize_module_handler(config_cls={config_cls!r}): config_cls must be a "
                        "QuantConfig subclass; define a @dataclass(frozen=True) subclass of affineq.QuantConfig")

    def register(fn: Handler) -> Handler:
        if not callable(fn):
            raise TypeError(f"a quantize handler must be a callable handler(module, config) -> module, got {fn!r}")
        _HANDLERS[config_cls] = fn
        return fn

    return register


def handler_for(config) -> Handler:
    for cls in type(config).__mro__:
        if cls in _HANDLERS:
            return _HANDLERS[cls]
    raise TypeError(f"no quantize handler registered for {type(config).__name__}; "
                    "use affineq.register_quantize_module_handler")


@dataclass(frozen=True)
class FqnToConfig(QuantConfig):
    """Per-module (or per-parameter) configs by fully qualified name.

    Keys: an exact module name ("lm_head"), an exact parameter name ("rnn.weight_ih_l0", "block.w": that
    parameter only, whatever the module), a regex prefixed "re:" matched against whole module names
    ("re:layers\\.[0-3]\\..*"), or "_default". Values: a config, or None to leave the module float.
    Precedence: exact name, then the first matching regex (in insertion order), then "_default".
    """

    fqn_to_config: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("compute_dtype", "param_names"):  # per-layer settings: they belong to the mapped configs
            if getattr(self, name) is not None:
                raise ValueError(f"FqnToConfig({name}=...): set {name} on the configs it maps to, e.g. "
                                 f"{{'_default': Int4WeightOnlyConfig({name}=...)}}; FqnToConfig only chooses them")
        if not isinstance(self.fqn_to_config, dict):
            raise ValueError(f"FqnToConfig(fqn_to_config=...) must be a dict of name -> config, got "
                             f"{type(self.fqn_to_config).__name__}")
        for key, cfg in self.fqn_to_config.items():
            if not isinstance(key, str):
                raise ValueError(f"FqnToConfig keys must be module names (str), got {key!r}")
            if cfg is not None and not isinstance(cfg, QuantConfig):
                raise ValueError(f"FqnToConfig[{key!r}] must be a config or None, got {cfg!r}")
            if isinstance(cfg, FqnToConfig):
                raise ValueError(f"FqnToConfig[{key!r}]: FqnToConfig cannot nest; put its entries in the outer "
                                 "FqnToConfig")
            if key.startswith("re:"):
                try:
                    re.compile(key[3:])
                except re.error as e:
                    raise ValueError(f"FqnToConfig key {key!r} is not a valid regex: {e}; fix the pattern after "
                                     "'re:' (it is matched with re.fullmatch), or use an exact module name") from None

    def __hash__(self):
        return hash(tuple(self.fqn_to_config.items()))

    def config_for(self, fqn: str) -> tuple[QuantConfig | None, bool]:
        """(config, whether `fqn` is named exactly) for module `fqn`.

        A module named exactly is quantized whatever `quantize_`'s filter says; regex and "_default" matches
        apply to the modules the filter selects (nn.Linear by default).
        """
        if fqn in self.fqn_to_config:
            return self.fqn_to_config[fqn], True
        for key, cfg in self.fqn_to_config.items():
            if key.startswith("re:") and re.fullmatch(key[3:], fqn):
                return cfg, False
        return self.fqn_to_config.get("_default"), False

    def to_dict(self) -> dict:
        return {"type": "FqnToConfig", "fqn_to_config": {k: encode_field(v) for k, v in self.fqn_to_config.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> FqnToConfig:
        if (not isinstance(d, dict) or not isinstance(d.get("fqn_to_config"), dict)
                or set(d) - {"type", "fqn_to_config"}):
            raise ValueError(f"FqnToConfig.from_dict expects {{'type': 'FqnToConfig', 'fqn_to_config': {{...}}}} "
                             f"and no other keys, got {d!r}")
        configs = {}
        for k, v in d["fqn_to_config"].items():
            try:
                configs[k] = None if v is None else decode_field(v)
            except ValueError as e:
                raise ValueError(f"FqnToConfig[{k!r}]: {e}") from None
        return cls(configs)


@dataclass(frozen=True)
class ModelConfig(QuantConfig):
    """A config that plans over the whole model: `quantize_` calls `to_fqn_config(model)` first and runs the
    `FqnToConfig` it returns (e.g. `affineq.quark_config.Config`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compute_dtype is not None:  # the per-layer configs it plans build every weight's spec
            raise ValueError(f"{type(self).__name__}.compute_dtype: this config plans a config per layer; set "
                             "compute_dtype on those (e.g. its base config), not on the plan")

    def to_fqn_config(self, model: nn.Module) -> FqnToConfig:
        raise NotImplementedError

    def layer_config(self, fqn: str, module: nn.Module) -> QuantConfig | None:
        """The config of layer `fqn` (`module`, or a stub of its type and shape), None when it stays float;
        QuantizationError / ValueError when the layer's settings cannot map to a config. Used by routes that
        see layers one at a time (graph mode)."""
        raise NotImplementedError(f"{type(self).__name__} does not resolve layers one at a time")

    def default_config(self) -> QuantConfig | None:
        """The config of a layer nothing else names (graph mode's shared cat / add observers), or None."""
        return None

    def route_error(self, route: str) -> str | None:
        """Why this config cannot run on `route` ("eager", "graph"), or None when it can."""
        return None


def default_filter(module: nn.Module, fqn: str) -> bool:
    """nn.Linear modules and MoE experts modules (3-D expert weights, `affineq.expert_weights`)."""
    return isinstance(module, nn.Linear) or is_expert_module(module)


@dataclass
class Step:
    fqn: str
    module: nn.Module
    config: QuantConfig


def _param_keys(model: nn.Module, config: FqnToConfig) -> dict[str, list[tuple[str, QuantConfig | None]]]:
    """FqnToConfig keys that name a parameter: module fqn -> [(parameter name, config)]."""
    modules = dict(model.named_modules())
    out: dict[str, list] = {}
    missing = []
    for key, cfg in config.fqn_to_config.items():
        if key.startswith("re:") or key == "_default" or key in modules:
            continue
        owner, _, pname = key.rpartition(".")
        if owner in modules and pname in modules[owner]._parameters:
            out.setdefault(owner, []).append((pname, cfg))
        else:
            missing.append(key)
    if missing:
        raise QuantizationError(
            f"FqnToConfig names modules or parameters the model does not have: {missing}. Use names from "
            "model.named_modules() / model.named_parameters(), or a 're:' regex key for names that may be absent. "
            "Nothing was quantized."
        )
    return out


def plan(model: nn.Module, config: QuantConfig, filter_fn: FilterFn | None):
    """[Step] to run, and [(fqn, reason)] for selected modules that cannot be quantized."""
    steps, problems = [], []
    kept_float: dict[int, str] = {}  # id(Parameter) -> name, for parameters FqnToConfig names with None
    param_keys = _param_keys(model, config) if isinstance(config, FqnToConfig) else {}
    for fqn, module in model.named_modules():
        for pname, cfg in param_keys.get(fqn, []):
            if cfg is None:
                p = module._parameters.get(pname)
                if p is not None:
                    kept_float.setdefault(id(p), f"{fqn}.{pname}" if fqn else pname)
                continue
            cfg = dataclasses.replace(cfg, param_names=(pname,))
            why = cfg.check_parameter(module, pname)
            (problems.append((f"{fqn}.{pname}", why)) if why else steps.append(Step(fqn, module, cfg)))
        cfg, explicit = config.config_for(fqn) if isinstance(config, FqnToConfig) else (config, False)
        if cfg is None:
            if explicit:
                for pname, p in module._parameters.items():
                    if p is not None:
                        kept_float.setdefault(id(p), f"{fqn}.{pname}" if fqn else pname)
            continue
        selected = filter_fn(module, fqn) if filter_fn is not None else explicit or default_filter(module, fqn)
        if not selected:
            continue
        if fqn in param_keys:  # a parameter key names its parameter more exactly than the module's config
            cfg = _without_keyed(cfg, module, {pname for pname, _ in param_keys[fqn]})
            if cfg is None:
                continue
        why = cfg.check(module)
        (problems.append((fqn or "<root>", why)) if why else steps.append(Step(fqn, module, cfg)))
    check_tied(model, steps, kept_float)
    return steps, problems


def _without_keyed(cfg: QuantConfig, module: nn.Module, keyed: set[str]) -> QuantConfig | None:
    """`cfg` less the parameters a parameter key of FqnToConfig names (None when none is left)."""
    names = cfg.parameter_names(module)
    if not keyed & set(names):
        return cfg
    rest = tuple(n for n in names if n not in keyed)
    return dataclasses.replace(cfg, param_names=rest) if rest else None


def check_tied(model: nn.Module, steps: list[Step], kept_float: dict[int, str]) -> None:
    """A parameter shared by several modules (tied weights) gets one config: raise when two differ, or when
    FqnToConfig leaves one of its names float (None) and gives another a config."""
    owner_of: dict[int, tuple[str, QuantConfig]] = {}
    for step in steps:
        for name in step.config.parameter_names(step.module):
            p = step.module._parameters.get(name)
            if p is None:
                continue
            where = f"{step.fqn}.{name}" if step.fqn else name
            if id(p) in kept_float:
                raise QuantizationError(
                    f"{kept_float[id(p)]} and {where} are the same (tied) parameter, but FqnToConfig leaves "
                    f"{kept_float[id(p)]} float (None) and gives {where} {step.config!r}. Give both names the same "
                    "config in FqnToConfig (or None to both), or untie the weights first. Nothing was quantized."
                )
            seen = owner_of.setdefault(id(p), (where, step.config))
            if seen[1] != step.config:
                raise QuantizationError(
                    f"{seen[0]} and {where} are the same (tied) parameter but are given different configs: "
                    f"{seen[1]!r} and {step.config!r}. Give both names the same config in FqnToConfig (or None "
                    "to both), or untie the weights first. Nothing was quantized."
                )


class Snapshot:
    """Every module's parameters, buffers, submodules and attributes (references, no copies), and the data
    of every parameter (a device move reassigns `param.data`). `restore()` puts all of it back."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
                        for m in model.modules()]
        self.data = [(p, p.data) for p in model.parameters()]

    def restore(self) -> None:
        for m, attrs, params, buffers, modules in self.modules:
            for name in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[name]
            m.__dict__.update(attrs)
            for d, saved in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                d.clear()
                d.update(saved)
        with torch.no_grad():
            for p, data in self.data:
                if p.data is not data:
                    p.data = data


def raise_problems(config: QuantConfig, problems: list[tuple[str, str]]) -> None:
    if problems:
        lines = "\n".join(f"  - {fqn}: {why}" for fqn, why in problems)
        raise QuantizationError(
            f"{type(config).__name__} cannot quantize {len(problems)} selected module(s):\n{lines}\n"
            "Ways out: pick a group_size that divides every in_features (or group_size=None where allowed), "
            "or pass filter_fn=lambda module, fqn: ... to skip these modules, or use FqnToConfig to give "
            "them another config (None leaves a module float). Nothing was quantized."
        )


@contextlib.contextmanager
def all_or_nothing(model: nn.Module, what: Callable[[], str]) -> Iterator[None]:
    """Run the body; on any failure restore every module of `model` exactly and raise QuantizationError
    saying `what()` failed (a QuantizationError or a BaseException such as KeyboardInterrupt passes as is)."""
    snapshot = Snapshot(model)
    try:
        yield
    except BaseException as e:
        snapshot.restore()
        if isinstance(e, QuantizationError) or not isinstance(e, Exception):
            raise
        raise QuantizationError(f"{what()} failed (the model was left unchanged): {e}") from e


def parameter_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(Parameter) -> [(module, attribute name)] of every module holding that Parameter."""
    owners: dict[int, list] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    return owners


@dataclass(frozen=True)
class Workflow:
    """How the steps of a config run when they are more than one handler call each (a config says so with a
    `workflow` attribute: `AlgorithmConfig` runs its algorithm first, a static config calibrates first).
    `run(model, config, filter_fn, steps, calibration_data, device) -> model`; when the steps of one call carry
    several workflows, the one with the highest `rank` runs them all (an algorithm's final pass calibrates)."""

    name: str
    rank: int
    run: Callable[..., nn.Module]


def workflow_of(steps: list[Step]) -> Workflow | None:
    """The workflow that runs `steps`: the highest-ranked `config.workflow` among them, or None (one handler
    call per step)."""
    found = [w for s in steps if (w := getattr(s.config, "workflow", None)) is not None]
    return max(found, key=lambda w: w.rank) if found else None


# -- one weight at a time, and the plan as weight names: for routes that do not call plan() themselves ------


def weight_config(config: QuantConfig, layer: str, module: nn.Module, param: str | None = None, *,
                  selected: bool | None = None, by_config_modules: bool = False,
                  on_stub: bool = False) -> tuple[QuantConfig | None, bool]:
    """(config, whether a key names it exactly) of one weight, by the rules of `plan`.

    `param`: the weight's full parameter name (an `FqnToConfig` parameter key names it; that config then
    quantizes `param` only); `layer`: the name module-level keys resolve (its module); `module`: that layer, or
    a stub of its type and shape. A layer named exactly is taken; otherwise `selected` (a route's filter answer)
    decides, else the default: an nn.Linear (`by_config_modules`: a module of a type the config quantizes,
    `config.modules`, as graph mode selects convs for conv configs). A `ModelConfig` resolves the layer itself
    (`layer_config`). `on_stub`: the route quantizes the weight as the `weight` of a stub module (graph mode,
    streaming without a model), so a parameter key's config is returned as written. (None, explicit) when the
    weight stays float.
    """
    if isinstance(config, ModelConfig):
        return config.layer_config(layer, module), False
    if isinstance(config, FqnToConfig):
        if param is not None and param in config.fqn_to_config:
            cfg = config.fqn_to_config[param]
            pname = param.rpartition(".")[2]
            if cfg is None or on_stub:
                return cfg, True
            return dataclasses.replace(cfg, param_names=(pname,)), True
        cfg, explicit = config.config_for(layer)
    else:
        cfg, explicit = config, False
    if cfg is None:
        return None, explicit
    if selected is None:
        selected = explicit or (isinstance(module, cfg.modules) if by_config_modules else default_filter(module, layer))
    return (cfg if selected else None), explicit


def default_config(config: QuantConfig) -> QuantConfig | None:
    """The config of a layer no key names: `FqnToConfig`'s "_default", a `ModelConfig`'s `default_config()`,
    else `config` itself."""
    if isinstance(config, FqnToConfig):
        return config.fqn_to_config.get("_default")
    if isinstance(config, ModelConfig):
        return config.default_config()
    return config


def planned_weights(model: nn.Module, config: QuantConfig, filter_fn: FilterFn | None = None
                    ) -> tuple[dict[str, QuantConfig], list[tuple[str, str]]]:
    """`plan` as {parameter name: the config of the step that quantizes it} (tied copies under every name),
    and the problems. A `ModelConfig` is planned through its `to_fqn_config(model)`."""
    if isinstance(config, ModelConfig):
        config = config.to_fqn_config(model)
    steps, problems = plan(model, config, filter_fn)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out: dict[str, QuantConfig] = {}
    for step in steps:
        for pname in step.config.parameter_names(step.module):
            p = step.module._parameters.get(pname)
            if p is not None:
                out.update(dict.fromkeys(names.get(id(p), [f"{step.fqn}.{pname}" if step.fqn else pname]), step.config))
    return out, problems
