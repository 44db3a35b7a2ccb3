"""`QATConfig`: the prepare / convert steps of quantization-aware training, run by `quantize_`.

    quantize_(model, QATConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), step="prepare"))
    ... train ...
    quantize_(model, QATConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), step="convert"))

prepare swaps each selected module for its fake-quantized counterpart (sharing its Parameters). With a base
config the fake-quant configs are derived from the spec and qparam options the base config gives each weight
(`weight_spec`, `qparam_options`), including the packing format whose stored qparams the forward uses, so
convert (the base config's own `quantize_weight`) stores the very codes the fake-quantized forward used.
convert swaps the fake-quantized modules back to float modules holding `AffineQuantizedTensor` weights.
MoE experts modules (3-D expert weights) are not swapped: their expert weights are parametrized with a per-expert
fake quantization (`affineq.qat.experts`), and convert stores 3-D AffineQuantizedTensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from affineq.capability import min_max_integer_rows
from affineq.configs import (
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    QuantConfig,
)
from affineq.expert_weights import expert_parameter_names, is_expert_module
from affineq.granularity import PerTensor, PerToken
from affineq.primitives import ZeroPointDomain
from affineq.qat.config import FakeQuantizeConfig, TQTThresholdInitMeth
from affineq.qat.experts import convert_experts, expert_proxies, is_prepared_experts, prepare_experts
from affineq.qat.modules import FAKE_QUANTIZED, _FakeQuantized
from affineq.quantize import FqnToConfig, ModelConfig, QuantizationError, register_quantize_module_handler
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import ActivationQuant

__all__ = ["QATConfig", "QAT_BASE_CONFIGS", "fake_quantize_configs"]

#: The built-in base configs with a QAT counterpart (their fake quantization reproduces their convert exactly);
#: any config with min/max integer qparams per row or group qualifies (`affineq.capability`), these are examples.
QAT_BASE_CONFIGS = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, Int8WeightOnlyConfig,
                    Int8DynamicActivationInt4WeightConfig, Int8DynamicActivationInt8WeightConfig)
_STEPS = ("prepare", "convert")


def fake_quantize_configs(base: QuantConfig, weight: torch.Tensor, module: nn.Module
                          ) -> tuple[FakeQuantizeConfig | None, FakeQuantizeConfig, str]:
    """(activation config or None, weight config, packing format) reproducing `base` on `weight` of `module`.

    ValueError when `base` has no QAT counterpart or its spec is not expressible (a partial code range)."""
    why = min_max_integer_rows(base)
    spec = base.weight_spec(weight, module) if why is None else None
    if spec is not None and spec.target.is_float:
        why = f"{type(base).__name__} stores {spec.target.name} codes, not integers"
    if why is not None:
        raise ValueError(f"{type(base).__name__} has no QAT counterpart: {why}. QATConfig derives fake "
                         "quantization from configs with min/max integer qparams per row or group (e.g. "
                         f"{', '.join(c.__name__ for c in QAT_BASE_CONFIGS)}, or your own). Quantize such layers "
                         "after training (without QATConfig), or pass explicit activation_config / weight_config "
                         "(FakeQuantizeConfig)")
    try:
        wcfg = FakeQuantizeConfig.from_spec(spec, base.qparam_options())
        acfg = None if spec.act_quant is None else FakeQuantizeConfig.from_activation_quant(spec.act_quant)
    except ValueError as e:
        raise ValueError(f"{type(base).__name__}: {e}") from None
    return acfg, wcfg, spec.fmt


@dataclass(frozen=True)
class _QATStep(QuantConfig):
    """One module's QAT step (what `QATConfig` plans per module through `FqnToConfig`)."""

    modules: ClassVar = tuple(FAKE_QUANTIZED)
    base_config: QuantConfig | None = None
    activation_config: FakeQuantizeConfig | None = None
    weight_config: FakeQuantizeConfig | None = None
    step: str = "prepare"
    range_learning: str | None = None
    tqt_init: TQTThresholdInitMeth = TQTThresholdInitMeth._3SD

    def check(self, module: nn.Module) -> str | None:
        if self.param_names is not None:
            return "QATConfig swaps whole modules: name the module in FqnToConfig, not its parameter"
        if self.step == "convert":
            return None  # modules that were never prepared are left as they are
        if isinstance(module, _FakeQuantized):
            return "it is already prepared for QAT; run QATConfig(..., step='convert') on it"
        if is_prepared_experts(module):
            return "its expert weights are already prepared for QAT; run QATConfig(..., step='convert') on it"
        if is_expert_module(module):
            return self._experts_problem(module)
        if type(module) not in FAKE_QUANTIZED:
            return (f"QAT swaps {', '.join(t.__name__ for t in FAKE_QUANTIZED)} modules, not "
                    f"{type(module).__name__}")
        if self.base_config is not None:
            why = self.base_config.check(module)
            if why is not None:
                return why
            try:
                self.configs_for(module)
            except ValueError as e:
                return str(e)
        elif isinstance(module, nn.Embedding) and self.activation_config is not None:
            return "an embedding's input is indices: give embeddings a QATConfig without activation_config"
        return None

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        if self.step == "prepare" and is_expert_module(module):
            return ()  # prepare keeps the expert Parameters (they move under the parametrizations), so no tie to update
        return super().parameter_names(module)

    def _experts_problem(self, module: nn.Module) -> str | None:
        """Why this step cannot prepare the expert weights of experts module `module`, or None."""
        if self.base_config is None or self.range_learning is not None:
            return (f"QAT of MoE expert weights (3-D {'/'.join(expert_parameter_names(module))} of "
                    f"{type(module).__name__}) derives a per-expert fake quantization with dynamic qparams from a "
                    "weight-only base_config (e.g. QATConfig(Int4WeightOnlyConfig(group_size=32))); explicit "
                    "activation_config / weight_config and range_learning are for nn.Linear: leave the experts out "
                    "(filter_fn=lambda m, fqn: isinstance(m, nn.Linear))")
        try:
            self.experts_configs(module)
        except ValueError as e:
            return str(e)
        return None

    def experts_configs(self, module: nn.Module) -> dict[str, tuple[FakeQuantizeConfig, str]]:
        """{expert weight name: (weight fake-quant config, packing format)} of experts module `module`, one
        expert's [N, K] weight quantized as the base config quantizes an nn.Linear; ValueError when the base
        config cannot (or quantizes activations: expert QAT fake-quantizes weights only)."""
        out = {}
        for name, (w, proxy) in expert_proxies(module).items():
            why = self.base_config.check(proxy)
            if why is not None:
                raise ValueError(why)
            act, wcfg, fmt = fake_quantize_configs(self.base_config, w, proxy)
            if act is not None:
                raise ValueError(f"{type(self.base_config).__name__} quantizes activations; QAT of MoE expert "
                                 "weights fake-quantizes weights only: give the experts a weight-only base config "
                                 "(e.g. Int4WeightOnlyConfig) through FqnToConfig")
            out[name] = (wcfg, fmt)
        return out

    def configs_for(self, module: nn.Module) -> tuple[FakeQuantizeConfig | None, FakeQuantizeConfig | None, str]:
        if self.base_config is None:
            return self.activation_config, self.weight_config, "plain"
        act, wcfg, fmt = fake_quantize_configs(self.base_config, module.weight.detach(), module)
        if self.range_learning is not None:
            wcfg = wcfg.replace(is_dynamic=False, range_learning=True, range_learning_method=self.range_learning,
                                tqt_init=self.tqt_init)
        if isinstance(module, nn.Embedding):
            act = None
        return act, wcfg, fmt


@register_quantize_module_handler(_QATStep)
def _qat_step(module: nn.Module, config: _QATStep) -> nn.Module:
    if config.step == "prepare" and is_expert_module(module):
        return prepare_experts(module, config.base_config, config.experts_configs(module))
    if config.step == "convert" and is_prepared_experts(module):
        return convert_experts(module, config.base_config or module.qat_base_config)
    if config.step == "prepare":
        act, wcfg, fmt = config.configs_for(module)
        new = FAKE_QUANTIZED[type(module)].from_float(module, act, wcfg)
        if new.weight_fake_quantizer is not None:
            new.weight_fake_quantizer.packing_format = fmt
        new.qat_base_config = config.base_config  # what convert stores (checked against convert's config)
        return new
    return _convert(module, config) if isinstance(module, _FakeQuantized) else module


def _static_act_tensors(fq) -> dict[str, torch.Tensor]:
    scale, zp = fq.quantized_qparams(torch.zeros(1, 1))
    out = {"act_scale": scale.float().reshape(1)}
    if zp is not None:
        out["act_zero_point"] = zp.to(torch.int32).reshape(1)
    return out


def _activation_quant(fq) -> ActivationQuant | None:
    """The ActivationQuant that reproduces activation fake quantizer `fq` in a converted linear."""
    if fq is None:
        return None
    c = fq.config
    per = c.granularity if isinstance(c.granularity, (PerToken, PerTensor)) else None
    static = not c.is_dynamic
    if (per is None or (static and per != PerTensor()) or c.scale_precision != torch.float32
            or not c.preserve_zero or c.rounding != "half_even"
            or (c.zero_point_domain is ZeroPointDomain.INT and c.zero_point_precision != torch.int32)):
        raise ValueError(f"the activation fake quantizer ({fq.extra_repr()}) has no converted counterpart: a "
                         "converted linear quantizes activations per token or per tensor (static: per tensor) "
                         "with float32 scales, int32 zero points and half-even rounding")
    return ActivationQuant(c.dtype, c.mapping_type, per, c.zero_point_domain, c.eps, static)


def _convert(module: nn.Module, config: _QATStep) -> nn.Module:
    """The float module with an AffineQuantizedTensor weight holding the codes the fake-quantized forward used."""
    new = module.to_float()
    w = module.weight.detach()
    wq, aq = module.weight_fake_quantizer, module.activation_fake_quantizer
    if wq is None:
        if aq is not None:
            raise ValueError("an activation-only fake-quantized module cannot be converted (a converted module "
                             "quantizes activations through its quantized weight); give it a weight_config")
        return new
    if config.base_config is not None:
        base = config.base_config
        if aq is not None and not aq.config.is_dynamic:
            raise ValueError(f"{type(base).__name__} quantizes activations dynamically, but this module's "
                             "activation quantizer is static / range-learned")
        if wq.config.is_dynamic:
            qweight = base.quantize_weight(w, new)
        else:
            scale, zp = wq.quantized_qparams(w)
            qweight = AffineQuantizedTensor.from_qparams(w, scale, zp, base.weight_spec(w, new),
                                                         rounding=base.qparam_options().rounding)
    else:
        act = _activation_quant(aq)
        spec = wq.spec(w).replace(act_quant=act)
        scale, zp = wq.quantized_qparams(w)
        qweight = AffineQuantizedTensor.from_qparams(w, scale, zp, spec, rounding=wq.config.rounding)
        if act is not None and act.static:
            qweight = qweight.with_act_tensors(**_static_act_tensors(aq))
    new.weight = nn.Parameter(qweight, requires_grad=False)
    return new


@dataclass(frozen=True)
class QATConfig(ModelConfig):
    """Quantization-aware training through `quantize_`: step="prepare" swaps the selected modules (nn.Linear
    by default; embeddings and conv2d through filter_fn or FqnToConfig) for fake-quantized ones, step="convert"
    swaps them back with quantized weights.

    base_config: a config in `QAT_BASE_CONFIGS` (the fake quantization is derived from it), or an
    `FqnToConfig` of such configs (None values leave modules float). activation_config / weight_config:
    explicit `FakeQuantizeConfig`s instead of a base config (convert then stores `plain` weights with the
    matching activation quantization). range_learning: None (dynamic weight qparams, the default), "lsq" or
    "tqt": the weight qparams derived from base_config become learned parameters (call
    `initialize_fake_quantizers` after prepare); tqt_init picks TQT's threshold initialisation.
    convert converts every fake-quantized module of the model (whatever filter_fn says) with the base config
    it was prepared with; a different base_config given to convert is a QuantizationError.
    """

    base_config: QuantConfig | None = None
    activation_config: FakeQuantizeConfig | None = None
    weight_config: FakeQuantizeConfig | None = None
    step: str = field(default="prepare", kw_only=True)
    range_learning: str | None = field(default=None, kw_only=True)
    tqt_init: TQTThresholdInitMeth = field(default=TQTThresholdInitMeth._3SD, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if self.step not in _STEPS:
            raise ValueError(f"QATConfig(step={self.step!r}): use step='prepare' or step='convert'")
        explicit = self.activation_config is not None or self.weight_config is not None
        if self.base_config is not None and explicit:
            raise ValueError("QATConfig takes base_config or activation_config / weight_config, not both: the "
                             "fake quantization is derived from base_config (use range_learning='lsq' / 'tqt' "
                             "for learned weight qparams)")
        if self.base_config is None and not explicit:
            raise ValueError("QATConfig needs base_config (e.g. Int8DynamicActivationInt4WeightConfig(group_size="
                             "32)) or activation_config / weight_config")
        if self.base_config is not None and not isinstance(self.base_config, QuantConfig):
            raise ValueError(f"base_config={self.base_config!r} must be a config instance such as "
                             "Int4WeightOnlyConfig(group_size=64)")
        bases = (self.base_config.fqn_to_config.values() if isinstance(self.base_config, FqnToConfig)
                 else [self.base_config] if self.base_config is not None else [])
        for b in bases:
            if b is not None and min_max_integer_rows(b) is not None:
                fake_quantize_configs(b, torch.zeros(1, 1), nn.Linear(1, 1))  # raises the explanation
        for name in ("activation_config", "weight_config"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, FakeQuantizeConfig):
                raise ValueError(f"QATConfig({name}={v!r}) must be a FakeQuantizeConfig or None")
        if self.range_learning not in (None, "lsq", "tqt"):
            raise ValueError(f"QATConfig(range_learning={self.range_learning!r}): use None, 'lsq' or 'tqt'")
        if self.range_learning is not None and self.base_config is None:
            raise ValueError("QATConfig(range_learning=...) applies to the qparams derived from base_config; with "
                             "explicit configs set FakeQuantizeConfig(is_dynamic=False, range_learning=True)")

    def _prepared_base(self, fqn: str, module: nn.Module) -> QuantConfig | None:
        """The base config `module` was prepared with; QuantizationError if convert names another one."""
        prepared = getattr(module, "qat_base_config", None)
        given = self.base_config
        if isinstance(given, FqnToConfig) or given is None or prepared is None:
            return prepared if prepared is not None else (None if isinstance(given, FqnToConfig) else given)
        if given != prepared:
            raise QuantizationError(f"{fqn} was prepared with {prepared!r} but convert was given {given!r}; pass "
                                    "the base_config used at prepare to QATConfig(..., step='convert'). Nothing was "
                                    "converted.")
        return given

    def _step(self, base: QuantConfig | None) -> _QATStep:
        return _QATStep(base, self.activation_config, self.weight_config, self.step, self.range_learning,
                        self.tqt_init)

    def to_fqn_config(self, model: nn.Module) -> FqnToConfig:
        if self.step == "convert":  # every fake-quantized module, by name (whatever filter_fn says)
            entries = {fqn: self._step(self._prepared_base(fqn, m)) for fqn, m in model.named_modules()
                       if isinstance(m, _FakeQuantized) or is_prepared_experts(m)}
            if not entries:
                raise QuantizationError(
                    f"QATConfig(step='convert'): {type(model).__name__} has no fake-quantized module, so there is "
                    "nothing to convert; run the prepare step first (quantize_(model, QATConfig(base, "
                    "step='prepare'))), train, then convert. Nothing was changed.")
            return FqnToConfig(entries)
        if isinstance(self.base_config, FqnToConfig):
            return FqnToConfig({k: None if v is None else self._step(v)
                                for k, v in self.base_config.fqn_to_config.items()})
        return FqnToConfig({"_default": self._step(self.base_config)})

