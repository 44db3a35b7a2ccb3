"""Workflows accept a config by what its spec can do, not by its class (issue #29): a config written here,
outside the package, with only `weight_spec`, runs through quantize_, QAT prepare -> convert, GPTQ, HQQ,
SmoothQuant (when it quantizes activations), torch.ao's quantize_dynamic and Quark's observer mapping."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from affineq import (
    AffineQuantizedTensor,
    FqnToConfig,
    GPTQConfig,
    HQQConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    MappingType,
    QuantConfig,
    QuantSpec,
    quantize_,
)
from affineq.algorithms import SmoothQuantConfig
from affineq.ao_compat import quantize_dynamic
from affineq.capability import min_max_integer_rows, min_max_qparams, quantizes_activations, runtime_only
from affineq.primitives import ZeroPointDomain
from affineq.qat import QATConfig
from affineq.tensor.spec import ActivationQuant


@dataclass(frozen=True)
class Uint4Groups(QuantConfig):
    """uint4, asymmetric, an integer zero point per 32 input channels: only a weight spec."""

    def weight_spec(self, weight, module):
        return QuantSpec.create(tuple(weight.shape), weight.dtype, torch.uint4, (1, 32),
                                mapping_type=MappingType.ASYMMETRIC)


@dataclass(frozen=True)
class PerTensorInt8(QuantConfig):
    def weight_spec(self, weight, module):
        return QuantSpec.create(tuple(weight.shape), weight.dtype, torch.int8, tuple(weight.shape))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))


def _tensors_equal(a: AffineQuantizedTensor, b: AffineQuantizedTensor) -> bool:
    return a.spec == b.spec and a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_quantize_uses_the_spec_alone():
    model, ref = _model(), _model()
    quantize_(model, Uint4Groups())
    for i in (0, 2):
        w = ref[i].weight.detach()
        assert _tensors_equal(model[i].weight, AffineQuantizedTensor.from_spec(w, Uint4Groups().weight_spec(w, ref[i])))


def test_qat_prepare_then_convert_gives_the_same_codes_without_training():
    model, ref = _model(), _model()
    quantize_(model, QATConfig(Uint4Groups(), step="prepare"))
    quantize_(model, QATConfig(Uint4Groups(), step="convert"))
    quantize_(ref, Uint4Groups())
    for i in (0, 2):
        assert _tensors_equal(model[i].weight, ref[i].weight)


def _output_mse(model, ref, x) -> float:
    with torch.no_grad():
        return float((model(x) - ref(x)).pow(2).mean())


def test_gptq_and_hqq_run_on_it_and_beat_round_to_nearest():
    torch.manual_seed(1)
    data = [torch.randn(4, 16, 64) for _ in range(4)]
    x = torch.cat(data)
    ref, rtn = _model(), _model()
    quantize_(rtn, Uint4Groups())
    gptq = quantize_(_model(), GPTQConfig(Uint4Groups(), progress=False), calibration_data=data)
    hqq = quantize_(_model(), HQQConfig(Uint4Groups(), progress=False))
    for model in (gptq, hqq):
        for i in (0, 2):
            assert model[i].weight.spec == rtn[i].weight.spec
    assert _output_mse(gptq, ref, x) < _output_mse(rtn, ref, x)
    for i in (0, 2):  # HQQ keeps the best of its iterations by weight MSE, starting from round-to-nearest
        err = [float((m[i].weight.dequantize() - ref[i].weight.detach()).pow(2).mean()) for m in (hqq, rtn)]
        assert err[0] <= err[1]


def test_what_a_spec_cannot_do_is_named():
    assert min_max_integer_rows(Uint4Groups()) is None
    assert "span rows" in min_max_integer_rows(PerTensorInt8())
    with pytest.raises(ValueError, match="GPTQConfig cannot wrap PerTensorInt8: .* span rows"):
        GPTQConfig(PerTensorInt8())
    with pytest.raises(ValueError, match="PerTensorInt8 has no QAT counterpart"):
        QATConfig(PerTensorInt8())


@dataclass(frozen=True)
class Int8PerTokenActivations(QuantConfig):
    """int8 per-channel weights with int8 per-token dynamic activations: only a weight spec."""

    def weight_spec(self, weight, module):
        aq = ActivationQuant(torch.int8, MappingType.SYMMETRIC, "per_token", ZeroPointDomain.NONE)
        return QuantSpec.create(tuple(weight.shape), weight.dtype, torch.int8, (1, weight.shape[1]),
                                mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE,
                                act_quant=aq)


def test_smoothquant_takes_a_config_that_quantizes_activations():
    """SmoothQuant asks the spec for quantized activations: the test config smooths exactly as the built-in
    per-token int8 config does (same codes, same pre-scales), and a weight-only config is refused by name."""
    torch.manual_seed(2)
    data = [torch.randn(4, 16, 64) * torch.linspace(0.1, 8.0, 64) for _ in range(2)]
    ours = quantize_(_model(), SmoothQuantConfig(Int8PerTokenActivations(), progress=False), calibration_data=data)
    ref = quantize_(_model(), SmoothQuantConfig(Int8DynamicActivationInt8WeightConfig(packing_format="plain"),
                                                progress=False), calibration_data=data)
    for i in (0, 2):
        a, b = ours[i].weight, ref[i].weight
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in ("qdata", "scale"))
        assert a.act_tensors.keys() == b.act_tensors.keys()
        assert all(torch.equal(a.act_tensors[k], b.act_tensors[k]) for k in a.act_tensors)
    assert quantizes_activations(Int8PerTokenActivations()) is None
    assert "weight-only" in quantizes_activations(Uint4Groups())
    with pytest.raises(ValueError, match="SmoothQuantConfig cannot wrap Uint4Groups: .*weight-only"):
        SmoothQuantConfig(Uint4Groups())


def test_quantize_dynamic_takes_a_config_that_needs_only_the_weight():
    model, ref = _model(), _model()
    quantize_dynamic(model, {"0": Uint4Groups(), "2": Int8PerTokenActivations()}, inplace=True)
    quantize_(ref, FqnToConfig({"0": Uint4Groups(), "2": Int8PerTokenActivations()}))
    for i in (0, 2):
        assert _tensors_equal(model[i].weight, ref[i].weight)
    assert runtime_only(Uint4Groups()) is None
    with pytest.raises(ValueError, match=r"qconfig_spec\['0'\]=Int8StaticActivationInt8WeightConfig.*calibration"):
        quantize_dynamic(_model(), {"0": Int8StaticActivationInt8WeightConfig()})


@dataclass(frozen=True)
class OwnCodes(Uint4Groups):
    def quantize_weight(self, weight, module):
        return super().quantize_weight(weight, module)


def test_quark_observer_needs_min_max_qparams_by_capability():
    from affineq._quark_mapping import ObservedWeightConfig
    from affineq.observers import PerChannelMinMaxObserver
    from affineq.quantize import QuantizationError

    assert min_max_qparams(Uint4Groups()) is None
    assert "overrides quantize_weight" in min_max_qparams(OwnCodes())
    ObservedWeightConfig(Uint4Groups(), PerChannelMinMaxObserver)
    with pytest.raises(QuantizationError, match="OwnCodes computes its weights itself"):
        ObservedWeightConfig(OwnCodes(), PerChannelMinMaxObserver)
