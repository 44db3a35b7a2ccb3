"""`quantize_`: replace module weights in place with AffineQuantizedTensors, driven by a config.

Each config type maps to one handler (`register_quantize_module_handler`), so a new config plugs in without
touching `quantize_`. `FqnToConfig` picks a config per module name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from affineq.configs import QuantConfig, _decode, _encode
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["quantize_", "register_quantize_module_handler", "FqnToConfig", "QuantizationError"]

FilterFn = Callable[[nn.Module, str], bool]
Handler = Callable[[nn.Module, QuantConfig], nn.Module]

_HANDLERS: dict[type, Handler] = {}


class QuantizationError(ValueError):
    """A config cannot apply to some modules; the message lists them and the ways out."""


def register_quantize_module_handler(config_cls: type) -> Callable[[Handler], Handler]:
    """Register `handler(module, config) -> module` for `config_cls` (and its subclasses)."""

    def register(fn: Handler) -> Handler:
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
def _replace_weight(module: nn.Module, config: QuantConfig) -> nn.Module:
    """The handler of every built-in config: quantize `module.weight` and swap the Parameter."""
    qweight = config.quantize_weight(module.weight.detach(), module)
    module.weight = nn.Parameter(qweight, requires_grad=False)
    return module


@dataclass(frozen=True)
class FqnToConfig(QuantConfig):
    """Per-module configs by fully qualified name.

    Keys: an exact module name ("lm_head"), a regex prefixed "re:" matched against the whole name
    ("re:layers\\.[0-3]\\..*"), or "_default". Values: a config, or None to leave the module float.
    Precedence: exact name, then the first matching regex (in insertion order), then "_default".
    """

    fqn_to_config: dict = field(default_factory=dict)

    def __post_init__(self):
        for key, cfg in self.fqn_to_config.items():
            if cfg is not None and not isinstance(cfg, QuantConfig):
                raise ValueError(f"FqnToConfig[{key!r}] must be a config or None, got {cfg!r}")
            if isinstance(cfg, FqnToConfig):
                raise ValueError(f"FqnToConfig[{key!r}]: FqnToConfig cannot nest")
            if key.startswith("re:"):
                try:
                    re.compile(key[3:])
                except re.error as e:
                    raise ValueError(f"FqnToConfig key {key!r} is not a valid regex: {e}") from None

    def __hash__(self):
        return hash(tuple(self.fqn_to_config.items()))

    def config_for(self, fqn: str) -> tuple[QuantConfig | None, bool]:
        """(config, whether `fqn` is named exactly) for module `fqn`.

        A module named exactly is quantized whatever its type; regex and "_default" matches apply to the
        modules `quantize_`'s filter selects (nn.Linear by default).
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
        return cls({k: (None if v is None else _decode(v)) for k, v in d["fqn_to_config"].items()})


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def _plan(model: nn.Module, config: QuantConfig, filter_fn: FilterFn | None):
    """[(fqn, module, config)] to quantize, and [(fqn, reason)] for selected modules that cannot be."""
    plan, problems = [], []
    if isinstance(config, FqnToConfig):
        names = {n for n, _ in model.named_modules()}
        missing = [k for k in config.fqn_to_config if not k.startswith("re:") and k != "_default"
                   and k not in names]
        if missing:
            raise QuantizationError(f"FqnToConfig names modules the model does not have: {missing}")
    for fqn, module in model.named_modules():
        cfg, explicit = config.config_for(fqn) if isinstance(config, FqnToConfig) else (config, False)
        if cfg is None:
            continue
        if filter_fn is not None:
            selected = filter_fn(module, fqn)
        else:
            selected = explicit or _default_filter(module, fqn)
        if not selected:
            continue
        why = cfg.check(module)
        if why is None:
            plan.append((fqn, module, cfg))
        else:
            problems.append((fqn or "<root>", why))
    return plan, problems


def quantize_(
    model: nn.Module,
    config: QuantConfig,
    filter_fn: FilterFn | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Quantize the weights of `model` in place and return it.

    Selects modules with `filter_fn(module, fqn)` (default: every nn.Linear), checks them all first and
    raises `QuantizationError` listing every module the config cannot apply to (nothing is changed then),
    then replaces each selected module's `weight` with a frozen AffineQuantizedTensor Parameter, one module
    at a time (peak memory: the float model plus one layer). `device` moves each module there before
    quantizing (quantize on GPU, for instance). Global torch state is not touched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ expects an nn.Module, got {type(model).__name__}")
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an affineq config (e.g. Int4WeightOnlyConfig()), got {config!r}")
    plan, problems = _plan(model, config, filter_fn)
    if problems:
        lines = "\n".join(f"  - {fqn}: {why}" for fqn, why in problems)
        raise QuantizationError(
            f"{type(config).__name__} cannot quantize {len(problems)} selected module(s):\n{lines}\n"
            "Ways out: pick a group_size that divides every in_features (or group_size=None where allowed), "
            "or pass filter_fn=lambda module, fqn: ... to skip these modules, or use FqnToConfig to give "
            "them another config (None leaves a module float). Nothing was quantized."
        )
    owners = _weight_owners(model)
    for fqn, module, cfg in plan:
        if device is not None:
            module.to(device)
        old = module.weight
        if isinstance(old, AffineQuantizedTensor):  # a tied weight quantized through another module
            continue
        try:
            _handler_for(cfg)(module, cfg)
        except Exception as e:
            raise QuantizationError(f"quantizing {fqn!r} with {type(cfg).__name__} failed (the module was "
                                    f"left unchanged): {e}") from e
        # Tied weights stay tied (e.g. an embedding and lm_head): every owner gets the quantized Parameter,
        # so the float copy is freed; embeddings then gather and dequantize only the rows they look up.
        for owner in owners.get(id(old), []):
            owner.weight = module.weight
    return model


def _weight_owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(weight Parameter) -> modules whose `weight` is that Parameter."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        w = m._parameters.get("weight")
        if w is not None:
            owners.setdefault(id(w), []).append(m)
    return owners


def quantized_weights(model: nn.Module) -> dict[str, AffineQuantizedTensor]:
    """{parameter name: AffineQuantizedTensor} for every quantized weight of `model`."""
    return {n: p for n, p in model.named_parameters() if isinstance(p, AffineQuantizedTensor)}
