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

import functools
import threading
import warnings
from collections.abc import Callable

import torch
from torch import nn

from affineq.configs import QuantConfig
from affineq.expert_weights import is_expert_module, quantize_expert_weight
from affineq.plan import (
    FilterFn,
    FqnToConfig,
    ModelConfig,
    QuantizationError,
    Step,
    all_or_nothing,
    handler_for,
    parameter_owners,
    plan,
    raise_problems,
    register_quantize_module_handler,
    workflow_of,
)
from affineq.recurrent import quantized_twin
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["quantize_", "register_quantize_module_handler", "FqnToConfig", "ModelConfig", "QuantizationError",
           "all_or_nothing", "quantized_weights", "replace_parameters"]


@register_quantize_module_handler(QuantConfig)
def replace_parameters(module: nn.Module, config: QuantConfig) -> nn.Module:
    """The handler of every built-in config: quantize each named parameter and swap the Parameter. A float
    recurrent module (nn.LSTM, nn.GRUCell, ...) is then replaced by its quantized twin, which shares the
    Parameters and runs them through F.linear (`affineq.recurrent`)."""
    for name in config.parameter_names(module):
        weight = getattr(module, name).detach()
        if weight.dim() == 3 and is_expert_module(module) and not getattr(config, "quantizes_expert_stacks", False):
            # MoE experts: each expert as a Linear weight (an algorithm's precomputed stack is taken whole)
            qweight = quantize_expert_weight(config, weight, module)
        else:
            qweight = config.quantize_weight(weight, module)
        setattr(module, name, nn.Parameter(qweight, requires_grad=False))
    return quantized_twin(module, config)


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
    steps, problems = plan(model, config, filter_fn)
    raise_problems(config, problems)
    if not steps:  # a silent no-op hides a wrong filter or config (quantize_checkpoint raises here)
        warnings.warn(f"quantize_: {type(config).__name__} selected no module of {type(model).__name__}, so nothing "
                      "was quantized; the default filter_fn takes nn.Linear and MoE experts modules: pass filter_fn "
                      "(or name the modules in an FqnToConfig) to select others", UserWarning, stacklevel=2)
    workflow = workflow_of(steps)  # an algorithm or calibration runs first; it calls quantize_ again
    if workflow is not None:
        return workflow.run(model, config, filter_fn, steps, calibration_data, device)
    if calibration_data is not None:
        raise QuantizationError(f"calibration_data was given but {type(config).__name__} quantizes no activation "
                                "statically; drop calibration_data, or use a static config such as "
                                "Int8StaticActivationInt8WeightConfig")
    owners = parameter_owners(model)
    parents = {id(m): (parent, name) for parent in model.modules() for name, m in parent._modules.items()
               if m is not None}
    current: list[Step] = []
    with all_or_nothing(model, lambda: f"quantizing {current[-1].fqn or '<root>'!r} with "
                                       f"{type(current[-1].config).__name__}"):
        for step in steps:
            current.append(step)
            _run_step(model, step, owners, parents, device)
    return model


def _run_step(model: nn.Module, step: Step, owners, parents, device) -> None:
    module, cfg = step.module, step.config
    if device is not None:
        module.to(device)
    names = cfg.parameter_names(module)
    old = {n: module._parameters.get(n) for n in names}
    if all(isinstance(p, AffineQuantizedTensor) for p in old.values() if p is not None) and any(
            p is not None for p in old.values()):
        return  # tied parameters quantized through another module
    new = handler_for(cfg)(module, cfg)
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


def quantized_weights(model: nn.Module) -> dict[str, AffineQuantizedTensor]:
    """{parameter name: AffineQuantizedTensor} for every quantized parameter of `model`."""
    return {n: p for n, p in model.named_parameters() if isinstance(p, AffineQuantizedTensor)}
