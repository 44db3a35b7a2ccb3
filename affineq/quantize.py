"""`quantize_`: quantize a model's parameters (or swap its modules) in place, driven by a config.

Each config type maps to one handler, `handler(module, config) -> module` (`register_quantize_module_handler`):
the built-in one replaces the module's parameters named by `config.parameter_names(module)` (default
`weight`) with AffineQuantizedTensors; a handler may instead return a new module (an RNN, a QAT module), which
`quantize_` installs under the same name. `FqnToConfig` picks a config per module or parameter name.

All or nothing: every module's state is recorded before the first change, and any failure (a config check,
a handler raising, a device move) restores every module's parameters, buffers, submodules and attributes
to exactly what they were before `QuantizationError` is raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from affineq.algorithms._base import AlgorithmConfig, quantize_with_algorithms
from affineq.configs import QuantConfig, _decode, _encode
from affineq.recurrent import quantized_twin
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["quantize_", "register_quantize_module_handler", "FqnToConfig", "ModelConfig", "QuantizationError"]

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


def _handler_for(config) -> Handler:
    for cls in type(config).__mro__:
        if cls in _HANDLERS:
            return _HANDLERS[cls]
    raise TypeError(f"no quantize handler registered for {type(config).__name__}; "
                    "use affineq.register_quantize_module_handler")


@register_quantize_module_handler(QuantConfig)
def _replace_parameters(module: nn.Module, config: QuantConfig) -> nn.Module:
    """The handler of every built-in config: quantize each named parameter and swap the Parameter. A float
    recurrent module (nn.LSTM, nn.GRUCell, ...) is then replaced by its quantized twin, which shares the
    Parameters and runs them through F.linear (`affineq.recurrent`)."""
    for name in config.parameter_names(module):
        qweight = config.quantize_weight(getattr(module, name).detach(), module)
        setattr(module, name, nn.Parameter(qweight, requires_grad=False))
    return quantized_twin(module, config)


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
        return {"type": "FqnToConfig", "fqn_to_config": {k: _encode(v) for k, v in self.fqn_to_config.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> FqnToConfig:
        if (not isinstance(d, dict) or not isinstance(d.get("fqn_to_config"), dict)
                or set(d) - {"type", "fqn_to_config"}):
            raise ValueError(f"FqnToConfig.from_dict expects {{'type': 'FqnToConfig', 'fqn_to_config': {{...}}}} "
                             f"and no other keys, got {d!r}")
        configs = {}
        for k, v in d["fqn_to_config"].items():
            try:
                configs[k] = None if v is None else _decode(v)
            except ValueError as e:
                raise ValueError(f"FqnToConfig[{k!r}]: {e}") from None
        return cls(configs)


@dataclass(frozen=True)
class ModelConfig(QuantConfig):
    """A config that plans over the whole model: `quantize_` calls `to_fqn_config(model)` first and runs the
    `FqnToConfig` it returns (e.g. `affineq.quark_config.Config`)."""

    def to_fqn_config(self, model: nn.Module) -> FqnToConfig:
        raise NotImplementedError


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


@dataclass
class _Step:
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


def _plan(model: nn.Module, config: QuantConfig, filter_fn: FilterFn | None):
    """[_Step] to run, and [(fqn, reason)] for selected modules that cannot be quantized."""
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
            (problems.append((f"{fqn}.{pname}", why)) if why else steps.append(_Step(fqn, module, cfg)))
        cfg, explicit = config.config_for(fqn) if isinstance(config, FqnToConfig) else (config, False)
        if cfg is None:
            if explicit:
                for pname, p in module._parameters.items():
                    if p is not None:
                        kept_float.setdefault(id(p), f"{fqn}.{pname}" if fqn else pname)
            continue
        selected = filter_fn(module, fqn) if filter_fn is not None else explicit or _default_filter(module, fqn)
        if not selected:
            continue
        why = cfg.check(module)
        (problems.append((fqn or "<root>", why)) if why else steps.append(_Step(fqn, module, cfg)))
    _check_tied(model, steps, kept_float)
    return steps, problems


def _check_tied(model: nn.Module, steps: list[_Step], kept_float: dict[int, str]) -> None:
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


class _Snapshot:
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


def _raise_problems(config: QuantConfig, problems: list[tuple[str, str]]) -> None:
    if problems:
        lines = "\n".join(f"  - {fqn}: {why}" for fqn, why in problems)
        raise QuantizationError(
            f"{type(config).__name__} cannot quantize {len(problems)} selected module(s):\n{lines}\n"
            "Ways out: pick a group_size that divides every in_features (or group_size=None where allowed), "
            "or pass filter_fn=lambda module, fqn: ... to skip these modules, or use FqnToConfig to give "
            "them another config (None leaves a module float). Nothing was quantized."
        )


def _quantize_with_calibration(model, config, filter_fn, steps, calibration_data) -> nn.Module:
    """prepare_, run the calibration data, then one all-or-nothing quantize_ of every selected layer (static
    layers with their calibrated qparams). Observers never outlive the call."""
    from affineq import calibration

    if calibration_data is None:
        raise QuantizationError(
            f"{type(config).__name__} quantizes activations statically and needs calibration: pass "
            "calibration_data=<an iterable of model inputs>, or call affineq.prepare_(model, config), run "
            "batches, then affineq.convert_(model)"
        )
    calibration.prepare_(model, config, filter_fn)
    try:
        calibration.run_calibration(model, calibration_data)
        others = {s.fqn: s.config for s in steps if not getattr(s.config, "needs_calibration", False)}
        return calibration.convert_(model, others=others)
    finally:
        calibration.unprepare_(model)


_BUSY: dict[int, int] = {}  # id(module) -> ident of the thread whose quantize_ is changing it
_BUSY_LOCK = threading.Lock()


def _one_call_per_model(fn):
    """Refuse (QuantizationError, nothing changed) a call on a model whose modules another thread's call is
    changing; the same thread may nest calls (calibration, transformers' per-layer quantize_)."""

    @functools.wraps(fn)
    def quantize_(model, *args, **kwargs):  # named as fn: a missing argument's TypeError names quantize_
        if not isinstance(model, nn.Module):
            return fn(model, *args, **kwargs)  # fn raises the explanation
        me, ids = threading.get_ident(), [id(m) for m in model.modules()]
        with _BUSY_LOCK:
            if any(_BUSY.get(i, me) != me for i in ids):
                raise QuantizationError(
                    f"{fn.__name__}: another thread is quantizing this {type(model).__name__} (or a module inside "
                    "it) right now; quantize_ does not wait for it: make the calls one after another (the model "
                    "was left unchanged)")
            mine = [i for i in ids if i not in _BUSY]
            _BUSY.update(dict.fromkeys(mine, me))
        try:
            return fn(model, *args, **kwargs)
        finally:
            with _BUSY_LOCK:
                for i in mine:
                    del _BUSY[i]

    return quantize_


#: Called as `hook(model, config)` after every successful `quantize_` (`affineq.hf` records a transformers
#: model's config there, so that its save_pretrained writes it). A hook must not raise.
AFTER_QUANTIZE: list[Callable[[nn.Module, QuantConfig], None]] = []


def _then_after_quantize_hooks(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    @functools.wraps(fn)
    def quantize_(model, config, *args, **kwargs):  # named as fn: a missing argument's TypeError names quantize_
        out = fn(model, config, *args, **kwargs)
        for hook in AFTER_QUANTIZE:
            hook(model, config)
        return out
    return quantize_


@_one_call_per_model
@_then_after_quantize_hooks
def quantize_(
    model: nn.Module,
    config: QuantConfig,
    filter_fn: FilterFn | None = None,
    device: torch.device | str | None = None,
    calibration_data=None,
) -> nn.Module:
    """Quantize the parameters of `model` in place (or swap its modules, as the config's handler says) and
    return it.

    Selects modules with `filter_fn(module, fqn)` (default: every nn.Linear), checks them all first and
    raises `QuantizationError` listing every module the config cannot apply to, then runs each module's
    handler, installing the module it returns. `device` moves each selected module there first (quantize
    on GPU, for instance). All or nothing: if anything fails, every module is restored exactly as it was
    and `QuantizationError` says which module failed and why. A config that quantizes activations
    statically (`Int8StaticActivationInt8WeightConfig`) needs `calibration_data`, an iterable of inputs
    (tensor: model(x), tuple: model(*x), dict: model(**x)), run once with a progress bar. Peak memory: the
    float model plus its quantized weights (the float weights are freed when the call returns). Global torch
    state is not touched.

    Threads: a call on a model that another thread's `quantize_` is changing (the same model or a module inside
    it) raises `QuantizationError` at once and changes nothing; it does not wait. Calls on different models run
    concurrently.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_(model, config): model must be an nn.Module, got {type(model).__name__}; pass "
                        "the module itself (a state_dict is quantized by loading it into its model first)")
    if isinstance(config, type) and issubclass(config, QuantConfig):
        raise TypeError(f"config must be a config instance, got the class {config.__name__}; call it: "
                        f"{config.__name__}()")
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an affineq config (e.g. Int4WeightOnlyConfig()), got {config!r}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable filter_fn(module, fqn) -> bool (or None: every nn.Linear), "
                        f"got {filter_fn!r}; e.g. filter_fn=lambda module, fqn: isinstance(module, nn.Linear)")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a torch device ({e}); pass e.g. 'cpu', 'cuda' or "
                             "torch.device('cuda:0'), or None to quantize where each module is") from None
    if isinstance(config, ModelConfig):
        config = config.to_fqn_config(model)  # raises QuantizationError before anything changes
    steps, problems = _plan(model, config, filter_fn)
    _raise_problems(config, problems)
    if any(isinstance(step.config, AlgorithmConfig) for step in steps):
        return quantize_with_algorithms(model, steps, calibration_data, device)
    if any(getattr(step.config, "needs_calibration", False) for step in steps):
        return _quantize_with_calibration(model, config, filter_fn, steps, calibration_data)
    if calibration_data is not None:
        raise QuantizationError(f"calibration_data was given but {type(config).__name__} quantizes no activation "
                                "statically; drop calibration_data, or use a static config such as "
                                "Int8StaticActivationInt8WeightConfig")
    owners = _parameter_owners(model)
    parents = {id(m): (parent, name) for parent in model.modules() for name, m in parent._modules.items()
               if m is not None}
    current: list[_Step] = []
    with all_or_nothing(model, lambda: f"quantizing {current[-1].fqn or '<root>'!r} with "
                                       f"{type(current[-1].config).__name__}"):
        for step in steps:
            current.append(step)
            _run_step(model, step, owners, parents, device)
    return model


@contextlib.contextmanager
def all_or_nothing(model: nn.Module, what: Callable[[], str]) -> Iterator[None]:
    """Run the body; on any failure restore every module of `model` exactly and raise QuantizationError
    saying `what()` failed (a QuantizationError or a BaseException such as KeyboardInterrupt passes as is)."""
    snapshot = _Snapshot(model)
    try:
        yield
    except BaseException as e:
        snapshot.restore()
        if isinstance(e, QuantizationError) or not isinstance(e, Exception):
            raise
        raise QuantizationError(f"{what()} failed (the model was left unchanged): {e}") from e


def _run_step(model: nn.Module, step: _Step, owners, parents, device) -> None:
    module, cfg = step.module, step.config
    if device is not None:
        module.to(device)
    names = cfg.parameter_names(module)
    old = {n: module._parameters.get(n) for n in names}
    if all(isinstance(p, AffineQuantizedTensor) for p in old.values() if p is not None) and any(
            p is not None for p in old.values()):
        return  # tied parameters quantized through another module
    new = _handler_for(cfg)(module, cfg)
    if not isinstance(new, nn.Module):
        raise QuantizationError(f"the handler of {type(cfg).__name__} returned {new!r} for {step.fqn!r}; a "
                                "handler must return the module to use (the same one, changed, or its replacement)")
    if new is not module:
        if module is model:
            raise QuantizationError(
                f"the handler of {type(cfg).__name__} replaces {type(module).__name__} modules with "
                f"{type(new).__name__}, and this one is the root module passed to quantize_, which works in place "
                f"(the model was left unchanged): quantize a model that contains it, e.g. "
                f"quantize_(nn.Sequential(module), config)[0], or, for a torch.ao-style copy, "
                f"affineq.quantize_dynamic(module)")
        parent, child = parents[id(module)]
        setattr(parent, child, new)
        return
    # Tied parameters stay tied (e.g. an embedding and lm_head): every owner gets the quantized Parameter, so
    # the float copy is freed; embeddings then gather and dequantize only the rows they look up.
    for name, p in old.items():
        if p is None or module._parameters.get(name) is p:
            continue
        for owner, owner_name in owners.get(id(p), []):
            owner._parameters[owner_name] = module._parameters[name]


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(Parameter) -> [(module, attribute name)] of every module holding that Parameter."""
    owners: dict[int, list] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    return owners


def quantized_weights(model: nn.Module) -> dict[str, AffineQuantizedTensor]:
    """{parameter name: AffineQuantizedTensor} for every quantized parameter of `model`."""
    return {n: p for n, p in model.named_parameters() if isinstance(p, AffineQuantizedTensor)}
