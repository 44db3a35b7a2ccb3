"""Static quantization: observe activations on calibration data, then quantize with the calibrated qparams.

    prepare_(model, Int8StaticActivationInt8WeightConfig())     # observers on the selected layers' inputs
    for batch in batches: model(batch)                           # calibration
    convert_(model)                                              # int8 weights + calibrated act_scale/zero point

or in one call: `quantize_(model, config, calibration_data=batches)`. A calibration item is a tensor
(`model(x)`), a tuple (`model(*x)`) or a dict (`model(**x)`). The calibrated qparams are activation tensors
of the weight (`act_scale`, `act_zero_point`), so they save, load (`weights_only=True`) and compile with it;
linears then run the int8 x int8 GEMM (`aten._int_mm:static`) or, in the `dense` format, our kernel on the
fake-quantized input; convolutions run the announced dequantize fallback on the fake-quantized input.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from affineq import observers as _obs
from affineq.configs import QuantConfig, check_choice, resolve_format, row_block
from affineq.granularity import PerTensor
from affineq.model_inputs import as_call, describe_item
from affineq.model_inputs import progress as _progress
from affineq.plan import QuantizationError, Workflow, plan, raise_problems
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import ActivationQuant

__all__ = ["CALIBRATION", "Int8StaticActivationInt8WeightConfig", "convert_", "prepare_", "quantize_with_calibration",
           "run_calibration", "unprepare_"]

#: Observer names a config may use -> the per-tensor observer classes of `affineq.observers`.
OBSERVERS: dict[str, type] = {
    "minmax": _obs.PerTensorMinMaxObserver,
    "moving_average": _obs.MovingAveragePerTensorMinMaxObserver,
    "histogram": _obs.PerTensorHistogramObserver,
    "percentile": _obs.PerTensorPercentileObserver,
    "mse": _obs.PerTensorMSEObserver,
}

_OBSERVER_ATTR = "affineq_input_observer"  # the submodule prepare_ adds (saved in the state_dict)
_OUTPUT_OBSERVER_ATTR = "affineq_output_observer"  # with quantize_output
_STATE_ATTR = "_affineq_calibration"  # ([hook handles], config) on a prepared module; gone after convert_
# While quantize_ calibrates: the ids of the modules it prepared. Observers the user attached with prepare_
# to other modules must not record quantize_'s calibration data (their calibration is the user's own).
_OBSERVING: ContextVar[frozenset[int] | None] = ContextVar("affineq_observing", default=None)


def quantize_with_calibration(model: nn.Module, config: QuantConfig, filter_fn, steps, calibration_data,
                              device=None) -> nn.Module:
    """The calibration workflow of `quantize_`: prepare_, run the calibration data, then one all-or-nothing
    quantize_ of every selected layer (static layers with their calibrated qparams). Only the layers `steps`
    selected are prepared, calibrated and converted: layers the user prepared earlier keep their observers,
    untouched (they do not record this data). Our observers never outlive the call; on failure the model is
    as before and a failing calibration forward raises QuantizationError (the model's error chained)."""
    if calibration_data is None:
        raise QuantizationError(
            f"{type(config).__name__} quantizes activations statically and needs calibration: pass "
            "calibration_data=<an iterable of model inputs>, or call affineq.prepare_(model, config), run "
            "batches, then affineq.convert_(model)"
        )
    mine = _attach_observers(config, steps)
    token = _OBSERVING.set(frozenset(id(m) for m in mine.values()))
    try:
        _calibrate(model, calibration_data, progress=True, wrap_errors=True)
        others = {s.fqn: s.config for s in steps if not _needs_calibration(s.config)}
        return _convert(model, mine, others)
    finally:
        _OBSERVING.reset(token)
        _detach_observers(mine.values())


#: How `quantize_` runs a config that `needs_calibration` (its `workflow`).
CALIBRATION = Workflow("calibration", 1, quantize_with_calibration)


@dataclass(frozen=True)
class Int8StaticActivationInt8WeightConfig(QuantConfig):
    """int8 weights (symmetric, per output channel) x int8 activations with calibrated per-tensor qparams:
    torch.ao's static quantization scheme. Needs calibration (`calibration_data=` or `prepare_`/`convert_`).

    activation_symmetric: False (default: asymmetric, an integer zero point) or True (zero point 0).
    observer: how the activation range is chosen: "minmax", "moving_average", "histogram", "percentile"
    or "mse" (`affineq.observers`). quantize_output: also calibrate the layer's output and quantize it to
    int8 with those qparams (`act_out_scale` / `act_out_zero_point`), as a quantized model that passes int8
    tensors between layers would; output_symmetric: its mapping (None: as activation_symmetric).
    packing_format: "auto" (`plain` for aten's int8 GEMM where it is fast,
    `dense` with our kernel on the fake-quantized input elsewhere; `plain` for convolutions), "plain", "dense".
    """

    experts_unsupported: ClassVar[str | None] = (
        "its activation qparams are calibrated per layer input, and each expert sees only the tokens routed to it "
        "(not supported yet); quantize the experts with a weight-only config (FqnToConfig)")

    modules: ClassVar = (nn.Linear, nn.Conv1d, nn.Conv2d)
    needs_calibration: ClassVar[bool] = True
    workflow: ClassVar[Workflow] = CALIBRATION
    recurrent_unsupported: ClassVar = ("static activation scales are calibrated on module inputs, and a recurrent "
                                       "module's hidden state changes every step; use "
                                       "Int8DynamicActivationInt8WeightConfig (per-step dynamic scales) instead")
    activation_symmetric: bool = False
    observer: str = "minmax"
    packing_format: str = "auto"
    quantize_output: bool = False
    output_symmetric: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.activation_symmetric, bool):
            raise ValueError(f"activation_symmetric={self.activation_symmetric!r} must be True or False")
        if not isinstance(self.quantize_output, bool):
            raise ValueError(f"quantize_output={self.quantize_output!r} must be True or False")
        if self.output_symmetric is not None and not isinstance(self.output_symmetric, bool):
            raise ValueError(f"output_symmetric={self.output_symmetric!r} must be True, False or None")
        if self.output_symmetric is not None and not self.quantize_output:
            raise ValueError("output_symmetric is set but quantize_output=False; pass quantize_output=True (or "
                             "drop output_symmetric)")
        check_choice("observer", self.observer, tuple(OBSERVERS))
        check_choice("packing_format", self.packing_format, ("auto", "plain", "dense"))

    def activation_quant(self) -> ActivationQuant:
        if self.activation_symmetric:
            return ActivationQuant(torch.int8, MappingType.SYMMETRIC, PerTensor(), ZeroPointDomain.NONE, static=True)
        return ActivationQuant(torch.int8, MappingType.ASYMMETRIC, PerTensor(), ZeroPointDomain.INT, static=True)

    def make_observer(self, output: bool = False) -> nn.Module:
        """The observer of the layer's input (or, with `output`, of its output)."""
        symmetric = self.activation_symmetric
        if output and self.output_symmetric is not None:
            symmetric = self.output_symmetric
        mapping = MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC
        domain = ZeroPointDomain.NONE if symmetric else ZeroPointDomain.INT
        return OBSERVERS[self.observer](dtype=torch.int8, mapping_type=mapping, zero_point_domain=domain,
                                        scale_dtype=torch.float32)

    def _block_size(self, shape, module):
        return row_block(shape, None)

    def weight_spec(self, weight, module):
        spec = self._spec(weight, module, torch.int8, MappingType.SYMMETRIC, ZeroPointDomain.NONE, "plain",
                          self.activation_quant())
        return resolve_format(self.packing_format, spec, weight, module,
                              module_is_linear=isinstance(module, nn.Linear))


@dataclass(frozen=True)
class Calibrated(QuantConfig):
    """A static config with the qparams calibration found (plain floats: hashable, comparable)."""

    modules: ClassVar = (nn.Linear, nn.Conv1d, nn.Conv2d)
    base: QuantConfig = None
    act_scale: float = 1.0
    act_zero_point: int | None = None
    out_scale: float | None = None
    out_zero_point: int | None = None

    def check(self, module):
        return self.base.check(module)

    def quantize_weight(self, weight, module) -> AffineQuantizedTensor:
        return self.attach(self.base.quantize_weight(weight, module))

    def attach(self, qw: AffineQuantizedTensor) -> AffineQuantizedTensor:
        """`qw` (the base config's weight) carrying these calibrated qparams as its activation tensors (the
        stored codes are shared, not copied)."""
        def f32(v):
            return None if v is None else torch.tensor([v], dtype=torch.float32)

        def i32(v):
            return None if v is None else torch.tensor([v], dtype=torch.int32)

        return qw.with_act_tensors(act_scale=f32(self.act_scale), act_zero_point=i32(self.act_zero_point),
                                   act_out_scale=f32(self.out_scale), act_out_zero_point=i32(self.out_zero_point))


def _needs_calibration(cfg) -> bool:
    return bool(getattr(cfg, "needs_calibration", False))


def prepare_(model: nn.Module, config: QuantConfig, filter_fn=None) -> nn.Module:
    """Attach an input observer (submodule `affineq_input_observer`, forward pre-hook) to every layer that
    `config` (or, in an FqnToConfig, its per-layer config) quantizes statically; returns `model`. Raises
    QuantizationError, changing nothing, when a selected layer cannot be quantized."""
    steps, problems = plan(model, config, filter_fn)
    raise_problems(config, problems)
    _attach_observers(config, steps)
    return model


def _attach_observers(config: QuantConfig, steps) -> dict[str, nn.Module]:
    """prepare_ of the static layers among `steps`: {fqn: module} of the layers it prepared. Checks all of them
    before changing any."""
    static = [s for s in steps if _needs_calibration(s.config)]
    if not static:
        raise QuantizationError(f"{type(config).__name__} quantizes no layer statically: nothing to calibrate; "
                                "use quantize_(model, config) directly")
    for step in static:
        if hasattr(step.module, _STATE_ATTR):
            raise QuantizationError(f"{step.fqn!r} is already prepared; call convert_(model) first")
    for step in static:
        step.module.add_module(_OBSERVER_ATTR, step.config.make_observer())
        handles = [step.module.register_forward_pre_hook(_observe_input)]
        if getattr(step.config, "quantize_output", False):
            step.module.add_module(_OUTPUT_OBSERVER_ATTR, step.config.make_observer(output=True))
            handles.append(step.module.register_forward_hook(_observe_output))
        setattr(step.module, _STATE_ATTR, (handles, step.config))
    return {s.fqn: s.module for s in static}


def _observing(module: nn.Module) -> bool:
    only = _OBSERVING.get()
    return only is None or id(module) in only


def _observe_input(module: nn.Module, args) -> None:
    if args and isinstance(args[0], torch.Tensor) and _observing(module):
        getattr(module, _OBSERVER_ATTR)(args[0])


def _observe_output(module: nn.Module, args, out) -> None:
    if isinstance(out, torch.Tensor) and _observing(module):
        getattr(module, _OUTPUT_OBSERVER_ATTR)(out)


def first_value(t: torch.Tensor | None):
    return None if t is None else t.reshape(-1)[0].item()


def run_calibration(model: nn.Module, data: Iterable, progress: bool = True) -> int:
    """Run `model` on every item of `data` (tensor: model(x); tuple: model(*x); dict: model(**x)) without
    gradients and in eval mode (every module's training flag is restored afterwards, also on errors: the
    observers calibrate inference behaviour, and BatchNorm running statistics stay as they are); returns the
    number of items. All or nothing: when an item fails (its error is raised), every observer is as it was before
    the call, so no layer keeps a partial item or a count of batches the others lack. Shows a progress bar when
    tqdm is installed and `progress`."""
    # (quantize_'s own calibration needs no copies: its observers are removed whatever happens)
    saved = [(m, attr, copy.deepcopy(m._modules[attr])) for m in model.modules() if hasattr(m, _STATE_ATTR)
             for attr in (_OBSERVER_ATTR, _OUTPUT_OBSERVER_ATTR) if attr in m._modules]
    try:
        return _calibrate(model, data, progress=progress, wrap_errors=False)
    except BaseException:
        for module, attr, obs in saved:  # the hooks look the observer up per call: the copies take over
            module._modules[attr] = obs
        raise


def _calibrate(model: nn.Module, data: Iterable, *, progress: bool, wrap_errors: bool) -> int:
    """run_calibration; `wrap_errors`: a failing forward raises QuantizationError naming the item (quantize_'s
    convention for failures; an item that is no tensor / tuple / dict still raises TypeError)."""
    from affineq.eval import eval_mode

    n = 0
    with torch.no_grad(), eval_mode(model):
        for item in _progress(data, "calibrating", progress, unit="batch"):
            args, kwargs = as_call(item, n)
            try:
                model(*args, **kwargs)
            except Exception as e:
                if not wrap_errors:
                    raise
                raise QuantizationError(
                    f"calibrating on {describe_item(item, n)} failed in {type(model).__name__} (the model was left "
                    f"unchanged): {type(e).__name__}: {e}; pass the inputs the model takes") from e
            n += 1
    return n


def convert_(model: nn.Module, *, others: dict[str, QuantConfig] | None = None) -> nn.Module:
    """Quantize every prepared layer with its observer's calibrated qparams and remove the observers; returns
    `model`. All or nothing (one `quantize_`, with `others`: more layers by name and their configs); a
    layer whose observer saw no data raises QuantizationError naming it, and the model stays prepared."""
    prepared = {fqn: m for fqn, m in model.named_modules() if hasattr(m, _STATE_ATTR)}
    if not prepared:
        raise QuantizationError("convert_: no prepared layer in this model; call prepare_(model, config) first")
    return _convert(model, prepared, others)


def _convert(model: nn.Module, prepared: dict[str, nn.Module], others: dict[str, QuantConfig] | None
             ) -> nn.Module:
    """convert_ of the prepared layers `prepared` ({fqn: module}) only: other prepared layers keep their
    observers."""
    from affineq.quantize import FqnToConfig, quantize_

    configs = dict(others or {})
    for fqn, m in prepared.items():
        obs = getattr(m, _OBSERVER_ATTR)
        if int(obs.num_batches) == 0:
            raise QuantizationError(f"convert_: the observer of {fqn!r} saw no data; run calibration batches "
                                    "through the model (the layer must be reached by them) before convert_")
        scale, zp = obs.calculate_qparams()
        out_scale = out_zp = None
        if _OUTPUT_OBSERVER_ATTR in m._modules:
            out_scale, out_zp = getattr(m, _OUTPUT_OBSERVER_ATTR).calculate_qparams()
        configs[fqn] = Calibrated(base=getattr(m, _STATE_ATTR)[1], act_scale=first_value(scale),
                                   act_zero_point=first_value(zp), out_scale=first_value(out_scale),
                                   out_zero_point=first_value(out_zp))
    quantize_(model, FqnToConfig(configs), filter_fn=lambda module, fqn: fqn in configs)
    _detach_observers(prepared.values())
    return model


def unprepare_(model: nn.Module) -> nn.Module:
    """Remove every observer and hook `prepare_` added to `model` (nothing else changes)."""
    _detach_observers(model.modules())
    return model


def _detach_observers(modules: Iterable[nn.Module]) -> None:
    """Remove the observers and hooks prepare_ added to each of `modules`."""
    for m in modules:
        state = m.__dict__.pop(_STATE_ATTR, None)
        for handle in state[0] if state is not None else ():
            handle.remove()
        for attr in (_OBSERVER_ATTR, _OUTPUT_OBSERVER_ATTR):
            if attr in m._modules:
                delattr(m, attr)
