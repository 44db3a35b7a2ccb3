"""What every accuracy algorithm shares: the wrapper config, the precomputed-weight config it hands back,
and the model-level run that keeps `quantize_` all-or-nothing.

An algorithm config wraps a base weight config (`GPTQConfig(Int4WeightOnlyConfig(group_size=64))`). `quantize_`
plans the layers as usual (the base config decides which modules qualify), then calls the algorithm's `run`
once with every layer it selected and the calibration items. `run` may rescale float modules (AWQ and
SmoothQuant fold scales into a norm or linear by assigning new Parameters, never in place) and returns a config
per layer; one ordinary `quantize_` then applies them. If anything fails, every module is restored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from affineq.capability import min_max_integer_rows, probe_spec
from affineq.configs import QuantConfig
from affineq.expert_weights import expert_parameter_names, is_expert_module
from affineq.model_inputs import check_calibration_items
from affineq.plan import FqnToConfig, QuantizationError, Workflow, all_or_nothing
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.format_experts import format_of
from affineq.tensor.spec import QuantSpec


def _run_algorithms(model: nn.Module, config, filter_fn, steps, calibration_data, device) -> nn.Module:
    return quantize_with_algorithms(model, steps, calibration_data, device)


#: How `quantize_` runs an AlgorithmConfig's steps (its `workflow`): the algorithm, then one final quantize_.
ALGORITHMS = Workflow("algorithms", 2, _run_algorithms)


@dataclass(frozen=True)
class AlgorithmConfig(QuantConfig):
    """Base of the algorithm wrappers. `base_config`: the weight config whose layers, spec and kernels the
    result uses; None makes a template for the layered `Config(algo_config=...)`, which fills in each layer's
    resolved weight config (`with_base`). Subclasses set `needs_data`, implement `run`, and override
    `cannot_wrap` when they need another capability of the base's spec (SmoothQuant: quantized activations)."""

    needs_data: ClassVar[bool] = True
    expert_weights: ClassVar[bool] = False  # True: `run` also takes MoE experts modules (3-D expert weights)
    pre_quant: ClassVar[bool] = False  # Quark's pre_quant_opt_config (SmoothQuant) rather than its algo_config
    workflow: ClassVar[Workflow] = ALGORITHMS
    base_config: QuantConfig = None

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        if isinstance(self.base_config, type):
            raise ValueError(f"{name}(base_config=...) must be a config instance, got the class "
                             f"{self.base_config.__name__}; call it, e.g. {self.base_config.__name__}()")
        if self.compute_dtype is not None:  # the base config builds every weight's spec
            raise ValueError(f"{name}.compute_dtype: the base config builds every weight's spec; set compute_dtype "
                             "there, e.g. GPTQConfig(Int4WeightOnlyConfig(compute_dtype="
                             "torch.bfloat16))")
        if self.base_config is None:
            return  # a template: Config(algo_config=...) supplies the base of each layer
        if not isinstance(self.base_config, QuantConfig) or isinstance(self.base_config, AlgorithmConfig):
            raise ValueError(f"{name}(base_config=...) must be a weight config (e.g. Int4WeightOnlyConfig()), got "
                             f"{self.base_config!r}")
        why = self.cannot_wrap(self.base_config)
        if why is not None:
            raise ValueError(f"{name} cannot wrap {type(self.base_config).__name__}: {why}")
        if self.param_names is not None:
            raise ValueError(f"{name} quantizes each layer's `weight`; param_names is not supported")

    # the base config decides which modules qualify and how each weight is stored
    @property
    def modules(self):  # type: ignore[override]
        return (nn.Linear,) if self.base_config is None else self.base_config.modules

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return expert_parameter_names(module) if is_expert_module(module) else ("weight",)

    def cannot_wrap(self, base: QuantConfig) -> str | None:
        """None when this algorithm can run on `base`, else why not. By capability (GPTQ, AWQ, HQQ, importance
        weighting): min/max qparams onto an integer target in row-local blocks (`affineq.capability`), and not
        8-bit weights with quantized activations (the activation error dominates there: SmoothQuantConfig is
        the algorithm for W8A8)."""
        why = min_max_integer_rows(base)
        if why is not None:
            return why
        spec = probe_spec(base)
        if spec is not None and spec.act_quant is not None and spec.target.bits >= 8:
            return (f"{type(base).__name__} quantizes activations and 8-bit weights (W8A8), where the activation "
                    "error dominates: use SmoothQuantConfig")
        return None

    def with_base(self, base_config: QuantConfig) -> AlgorithmConfig:
        """This algorithm around `base_config` (ValueError when it cannot wrap it)."""
        return dataclasses.replace(self, base_config=base_config)

    def check(self, module: nn.Module) -> str | None:
        if self.base_config is None:
            return (f"{type(self).__name__}(base_config=None) is a template for Config(algo_config=...); give it "
                    "the weight config to run, e.g. GPTQConfig(Int4WeightOnlyConfig(group_size=64))")
        if is_expert_module(module) and not self.expert_weights:
            return (f"{type(self).__name__} does not support MoE expert weights (3-D "
                    f"{'/'.join(expert_parameter_names(module))} of {type(module).__name__}) yet: quantize the experts "
                    "with a weight config or HQQConfig first (filter_fn=lambda m, fqn: fqn.endswith('experts')), then "
                    f"run {type(self).__name__} on the Linear layers (filter_fn=lambda m, fqn: isinstance(m, "
                    "nn.Linear))")
        if not isinstance(module, nn.Linear) and not is_expert_module(module):
            return f"{type(self).__name__} quantizes nn.Linear layers, not {type(module).__name__}"
        return self.base_config.check(module)

    def weight_spec(self, weight: torch.Tensor, module: nn.Module) -> QuantSpec:
        return self.base_config.weight_spec(weight, module)

    def qparam_options(self):
        return self.base_config.qparam_options()

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        """Compute the quantization of `layers` ({fqn: nn.Linear} this config selected in `model`) from the
        calibration items `data` (None when `needs_data` is False); return {fqn: config} for the final pass
        (`Precomputed`, or a base config after a folded rescale). May assign new Parameters to float modules."""
        raise NotImplementedError


@dataclass(frozen=True)
class Precomputed(QuantConfig):
    """A weight an algorithm already quantized: `quantize_weight` returns `weight` (checked against the
    module's parameter). `base` is the config it was computed for (its `modules` and `check` apply)."""

    modules: ClassVar = (nn.Linear,)
    quantizes_expert_stacks: ClassVar[bool] = True  # `weight` may be a whole 3-D expert weight
    base: QuantConfig = None
    weight: AffineQuantizedTensor = field(default=None, compare=False, hash=False, repr=False)

    def check(self, module: nn.Module) -> str | None:
        return self.base.check(module)

    def quantize_weight(self, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
        if tuple(self.weight.shape) != tuple(weight.shape):
            raise ValueError(f"precomputed weight has shape {tuple(self.weight.shape)}, the layer's weight "
                             f"{tuple(weight.shape)}")
        return self.weight


def represent_qparams(spec: QuantSpec, scale: torch.Tensor, zero_point: torch.Tensor | None):
    """The qparams as `spec`'s format stores them (e.g. bf16-rounded scales), shaped [n_blocks...]: compute
    codes with these so the saved tensor dequantizes to exactly what the algorithm computed."""
    n = spec.num_blocks
    return format_of(spec).represent_qparams(
        scale.reshape(n), None if zero_point is None else zero_point.reshape(n), spec)


def group_by_config(steps) -> dict[AlgorithmConfig, dict[str, nn.Module]]:
    """{algorithm config: {fqn: module}} for the steps whose config is an AlgorithmConfig."""
    groups: dict[AlgorithmConfig, dict[str, nn.Module]] = {}
    for s in steps:
        if isinstance(s.config, AlgorithmConfig):
            groups.setdefault(s.config, {})[s.fqn] = s.module
    return groups


def quantize_with_algorithms(model: nn.Module, steps, calibration_data, device) -> nn.Module:
    """Run every algorithm config of `steps`, then one `quantize_` with the configs they return (and the
    plain configs of the other steps). All or nothing."""
    from affineq.quantize import quantize_

    groups = group_by_config(steps)
    needing = [type(c).__name__ for c in groups if c.needs_data]
    if needing and calibration_data is None:
        raise QuantizationError(f"{needing[0]} needs calibration data: pass calibration_data=<an iterable of "
                                "model inputs> (tensor: model(x), tuple: model(*x), dict: model(**x)), e.g. 32 "
                                "token sequences; HQQConfig needs none")
    if calibration_data is not None and not needing and not any(
            getattr(s.config, "needs_calibration", False) or getattr(getattr(s.config, "base_config", None),
                                                                       "needs_calibration", False) for s in steps):
        raise QuantizationError(f"calibration_data was given but {type(next(iter(groups))).__name__} needs none "
                                "(it is calibration-free); drop calibration_data")
    data = None if calibration_data is None else list(calibration_data)
    if data is not None and not data:
        raise QuantizationError("calibration_data is empty: pass at least one model input")
    if data is not None:
        try:
            check_calibration_items(data)
        except ValueError as e:
            raise QuantizationError(f"{e}. Nothing was quantized.") from None
    final: dict[str, QuantConfig] = {}
    for s in steps:
        if not isinstance(s.config, AlgorithmConfig):
            if s.fqn in final:
                raise QuantizationError(f"{s.fqn!r} is given two configs; give each module one")
            final[s.fqn] = s.config
    with all_or_nothing(model, lambda: "running the quantization algorithm"):
        if device is not None:
            for s in steps:
                s.module.to(device)
        for cfg, layers in groups.items():
            final.update(cfg.run(model, layers, data))
        static = any(getattr(c, "needs_calibration", False) for c in final.values())
        quantize_(model, FqnToConfig(final), filter_fn=lambda m, fqn: fqn in final,
                  calibration_data=data if static else None)
    return model


__all__ = ["ALGORITHMS", "AlgorithmConfig", "Precomputed", "quantize_with_algorithms", "represent_qparams"]
