"""AMD Quark-style layered configuration (affineq.quark_config): construction errors, resolution, JSON and
quantize_."""

import copy
import json
import warnings

import pytest
import torch
from torch import nn

from affineq import (
    AffineQuantizedTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MappingType,
    PerAxis,
    PerGroup,
    QuantizationError,
    ZeroPointDomain,
    config_from_dict,
    quantize_,
)
from affineq._quark_mapping import PlainWeightOnlyConfig
from affineq.configs import (
    FPxWeightOnlyConfig,
    MicroexpWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
)
from affineq.granularity import PerRow, PerTensor, PerToken
from affineq.observers import PerGroupMinMaxObserver
from affineq.quark_config import (
    STATIC_ACTIVATION_MESSAGE,
    Config,
    DeviceType,
    Dtype,
    QSchemeType,
    QuantizationConfig,
    QuantizationSpec,
    RoundType,
    ScaleType,
    ZeroPointType,
)
from tests.conftest import assert_unchanged, snapshot_model

W8 = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)
W4 = QuantizationSpec(Dtype.uint4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=False)
W2 = QuantizationSpec(Dtype.int2, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=False)
A8_DYN = QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel, symmetric=True)
A8_STATIC = QuantizationSpec(Dtype.int8, is_dynamic=False, qscheme=QSchemeType.per_tensor, symmetric=True)
POF2 = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_tensor, symmetric=True, scale_type=ScaleType.pof2)


class MyLinear(nn.Linear):
    pass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(64, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 64), MyLinear(64, 64))
        self.norm = nn.LayerNorm(64)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(64, 32)

    def forward(self, x):
        for b in self.layers:
            x = b.norm(b.mlp(b.attn(x)))
        return self.lm_head(x)


def qc(**kw):
    return QuantizationConfig(**kw)


# -- construction errors: each names the field and the fix -------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    (dict(dtype=Dtype.int4, qscheme=QSchemeType.per_group, ch_axis=1), ["group_size", "per_group"]),
    (dict(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32), ["ch_axis", "per_group"]),
    (dict(dtype=Dtype.int4, qscheme=QSchemeType.per_channel, ch_axis=0, group_size=32),
     ["group_size", "QSchemeType.per_group"]),
    (dict(dtype=Dtype.int4, group_size=32), ["group_size", "per_group"]),
    (dict(dtype=Dtype.fp8_e4m3, symmetric=False), ["symmetric", "fp8_e4m3", "symmetric=True"]),
    (dict(dtype=Dtype.fp4, symmetric=False), ["symmetric", "fp4"]),
    (dict(dtype=Dtype.mx), ["mx_element_dtype", "fp4"]),
    (dict(dtype=Dtype.int8, mx_element_dtype=Dtype.fp4), ["mx_element_dtype", "other dtypes take none"]),
    (dict(dtype=Dtype.mx, mx_element_dtype=Dtype.int4), ["int4", "not an OCP MX element type"]),
    (dict(dtype=Dtype.int8, observer_cls=object()), ["observer_cls", "class"]),
    (dict(dtype=Dtype.int8, observer_cls="MinMaxObserver"), ["observer_cls", "class"]),
    (dict(dtype=Dtype.fp8_e4m3, round_method=RoundType.floor), ["round_method", "half_even", "float formats"]),
    (dict(dtype=Dtype.fp4, round_method=RoundType.round), ["round_method", "half_even"]),
    (dict(dtype="int8"), ["dtype", "Dtype."]),
    (dict(dtype=Dtype.int8, qscheme="per_tensor"), ["qscheme", "QSchemeType"]),
    (dict(dtype=Dtype.int8, scale_type="pof2"), ["scale_type", "ScaleType"]),
    (dict(dtype=Dtype.int8, is_dynamic=1), ["is_dynamic"]),
    (dict(dtype=Dtype.int8, ch_axis="0"), ["ch_axis"]),
    (dict(dtype=Dtype.int8, qscheme=QSchemeType.per_group, ch_axis=1, group_size=0), ["group_size"]),
])
def test_spec_errors(kwargs, words):
    with pytest.raises(ValueError) as e:
        QuantizationSpec(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_spec_accepts():
    QuantizationSpec(Dtype.int8, round_method=RoundType.half_even, scale_type=ScaleType.pof2)
    QuantizationSpec(Dtype.fp8_e4m3, symmetric=True)
    QuantizationSpec(Dtype.mx, qscheme=QSchemeType.per_group, ch_axis=-1, group_size=32, mx_element_dtype=Dtype.fp4)
    QuantizationSpec(Dtype.int8, observer_cls=nn.Identity)


def test_static_per_group_activation_rejected():
    g = dict(dtype=Dtype.int8, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32)
    for dyn in (False, None):
        with pytest.raises(ValueError, match="input_tensors.*static.*is_dynamic=True"):
            qc(input_tensors=QuantizationSpec(**g, is_dynamic=dyn))
    qc(input_tensors=QuantizationSpec(**g, is_dynamic=True))
    qc(weight=QuantizationSpec(**g))  # weights are not activations


def test_config_field_type_errors():
    with pytest.raises(ValueError, match="QuantizationConfig.weight.*QuantizationSpec"):
        qc(weight=Dtype.int8)
    with pytest.raises(ValueError, match="target_device.*DeviceType"):
        qc(target_device="IPU")
    with pytest.raises(ValueError, match="global_quant_config.*QuantizationConfig"):
        Config(W8)
    with pytest.raises(ValueError, match="layer_type_quant_config key.*nn.Module class"):
        Config(qc(), layer_type_quant_config={3: qc()})
    with pytest.raises(ValueError, match="layer_type_quant_config key.*nn.Module class"):
        Config(qc(), layer_type_quant_config={int: qc()})
    with pytest.raises(ValueError, match=r"layer_quant_config\['x'\].*QuantizationConfig"):
        Config(qc(), layer_quant_config={"x": W8})
    with pytest.raises(ValueError, match="exclude.*list"):
        Config(qc(), exclude="lm_head")
    with pytest.raises(ValueError, match="param_names"):
        Config(qc(), param_names=("weight",))


def test_ipu_rules():
    ipu = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_tensor, symmetric=True, scale_type=ScaleType.pof2)
    qc(weight=ipu, input_tensors=QuantizationSpec(Dtype.uint8, is_dynamic=True, scale_type=ScaleType.pof2),
       target_device=DeviceType.IPU)
    with pytest.raises(ValueError, match="weight.scale_type.*IPU.*ScaleType.pof2"):
        qc(weight=W8, target_device=DeviceType.IPU)
    with pytest.raises(ValueError, match="weight.dtype=uint4.*IPU.*int8 or uint8"):
        qc(weight=W4, target_device=DeviceType.IPU)
    qc(weight=W4, target_device=DeviceType.CPU)
    # an inherited spec is checked against the device after the merge
    cfg = Config(qc(weight=W8), layer_quant_config={"lm_head": qc(target_device=DeviceType.IPU)})
    with pytest.raises(QuantizationError, match="lm_head.*IPU.*pof2"):
        quantize_(Model(), cfg)


# -- resolution ------------------------------------------------------------------------------------------


def _layered():
    return Config(
        qc(weight=W8),
        layer_type_quant_config={MyLinear: qc(weight=W2), "LayerNorm": qc(weight=W8)},
        layer_quant_config={"layers.1.attn": qc(weight=POF2), "layers.*.attn": qc(weight=W4),
                            "layers.1.*": qc(target_device=DeviceType.CPU)},
        exclude=["lm_*"],
    )


def test_precedence_branches():
    cfg, m = _layered(), Model()
    r = lambda fqn: cfg.resolve(fqn, m.get_submodule(fqn))  # noqa: E731
    assert r("lm_head") is None  # excluded
    assert r("layers.1.attn").weight == POF2  # exact name beats the earlier-matching pattern
    assert r("layers.0.attn").weight == W4  # pattern
    assert r("layers.0.mlp.1").weight == W2  # exact type beats global
    assert r("layers.0.mlp.0").weight == W8  # global
    assert r("layers.0.norm").weight == W8  # class-name string key
    # pattern order: the first matching pattern wins (layers.*.attn before layers.1.*)
    cfg2 = Config(qc(weight=W8), layer_quant_config={"layers.1.*": qc(weight=W2), "layers.*.attn": qc(weight=W4)})
    assert cfg2.resolve("layers.1.attn", m.layers[1].attn).weight == W2
    # a name match beats a type match
    assert r("layers.1.mlp.1").weight == W2  # layers.1.* sets no weight: inherited from the type level
    cfg3 = Config(qc(weight=W8), layer_type_quant_config={MyLinear: qc(weight=W2)},
                  layer_quant_config={"layers.0.mlp.1": qc(weight=W4)})
    assert cfg3.resolve("layers.0.mlp.1", m.layers[0].mlp[1]).weight == W4


def test_type_nearest_base_in_mro():
    m = Model()
    cfg = Config(qc(), layer_type_quant_config={nn.Linear: qc(weight=W8), nn.Module: qc(weight=W2)})
    assert cfg.resolve("layers.0.mlp.1", m.layers[0].mlp[1]).weight == W8  # MyLinear -> Linear
    assert cfg.resolve("layers.0.norm", m.layers[0].norm).weight == W2  # LayerNorm -> Module
    cfg = Config(qc(), layer_type_quant_config={"Linear": qc(weight=W4), MyLinear: qc(weight=W2)})
    assert cfg.resolve("layers.0.mlp.1", m.layers[0].mlp[1]).weight == W2  # exact class first
    assert cfg.resolve("layers.0.attn", m.layers[0].attn).weight == W4  # name string


def test_inheritance_field_by_field():
    m = Model()
    cfg = Config(qc(weight=W8, input_tensors=A8_DYN, target_device=DeviceType.CPU),
                 layer_type_quant_config={nn.Linear: qc(weight=W4)},
                 layer_quant_config={"lm_head": qc(input_tensors=None, bias=None)})
    r = cfg.resolve("lm_head", m.lm_head)
    assert r == qc(weight=W4, input_tensors=A8_DYN, target_device=DeviceType.CPU)
    assert Config(qc()).resolve("lm_head", m.lm_head) is None  # None at the global level: not quantized
    assert Config(qc(target_device=DeviceType.CPU)).resolve("lm_head", m.lm_head) is None


def test_exclude_patterns():
    m = Model()
    cfg = Config(qc(weight=W8), exclude=["layers.?.mlp.*", "lm_head"],
                 layer_quant_config={"lm_head": qc(weight=W4)})
    assert cfg.resolve("layers.0.mlp.0", m.layers[0].mlp[0]) is None
    assert cfg.resolve("lm_head", m.lm_head) is None  # exclude wins over an exact name
    assert cfg.resolve("layers.0.attn", m.layers[0].attn).weight == W8
    assert set(cfg.to_fqn_config(m).fqn_to_config) == {"layers.0.attn", "layers.1.attn"}


# -- mapping to affineq configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec, want", [
    (W8, Int8WeightOnlyConfig()),
    (QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32),
     Int8WeightOnlyConfig(group_size=32)),
    (QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=False),
     IntxWeightOnlyConfig(torch.int8, PerAxis(0), MappingType.ASYMMETRIC, scale_dtype=torch.float32)),
    (W4, IntxWeightOnlyConfig(torch.uint4, PerGroup(32), MappingType.ASYMMETRIC, scale_dtype=torch.float32)),
    (QuantizationSpec(Dtype.uint4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=False,
                      scale_type=ScaleType.bfloat16, zero_point_type=ZeroPointType.float32),
     IntxWeightOnlyConfig(torch.uint4, PerGroup(32), MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT)),
    (QuantizationSpec(Dtype.int3, qscheme=QSchemeType.per_channel, ch_axis=0),
     IntxWeightOnlyConfig(torch.int3, PerAxis(0), scale_dtype=torch.float32)),
    (QuantizationSpec(Dtype.fp8_e5m2, qscheme=QSchemeType.per_channel, ch_axis=0),
     Float8WeightOnlyConfig(torch.float8_e5m2)),
    (POF2, PlainWeightOnlyConfig("int8", PerTensor(), scale_type="e8m0")),
    (QuantizationSpec(Dtype.fp4, qscheme=QSchemeType.per_group, ch_axis=-1, group_size=32,
                      scale_type=ScaleType.pof2),
     FPxWeightOnlyConfig(2, 1, 32, "pof2")),
    (QuantizationSpec(Dtype.fp4, qscheme=QSchemeType.per_tensor, scale_type=ScaleType.pof2),
     PlainWeightOnlyConfig("fp4_e2m1", PerTensor(), scale_type="e8m0")),
    (QuantizationSpec(Dtype.fp6_e3m2, qscheme=QSchemeType.per_channel, ch_axis=0),
     FPxWeightOnlyConfig(3, 2, None)),
    (QuantizationSpec(Dtype.fp6_e2m3, qscheme=QSchemeType.per_group, ch_axis=1, group_size=64,
                      scale_type=ScaleType.float16),
     FPxWeightOnlyConfig(2, 3, 64, "float16")),
    (QuantizationSpec(Dtype.fp8_e4m3, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32),
     FPxWeightOnlyConfig(4, 3, 32)),
    (QuantizationSpec(Dtype.mx, qscheme=QSchemeType.per_group, ch_axis=-1, group_size=32, mx_element_dtype=Dtype.fp4),
     MXWeightOnlyConfig("fp4_e2m1")),
    (QuantizationSpec(Dtype.mx, mx_element_dtype=Dtype.int8), MXWeightOnlyConfig(torch.int8)),
    (QuantizationSpec(Dtype.mx, mx_element_dtype=Dtype.fp6_e2m3, scale_type=ScaleType.pof2),
     MXWeightOnlyConfig("fp6_e2m3")),
    (QuantizationSpec(Dtype.mx9), MicroexpWeightOnlyConfig("mx9")),
    (QuantizationSpec(Dtype.mx6, qscheme=QSchemeType.per_group, ch_axis=-1, group_size=16),
     MicroexpWeightOnlyConfig("mx6")),
    (QuantizationSpec(Dtype.uint8, qscheme=QSchemeType.per_tensor, symmetric=False),
     PlainWeightOnlyConfig("uint8", PerTensor(), MappingType.ASYMMETRIC, ZeroPointDomain.INT)),
    (QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, round_method=RoundType.floor),
     Int8WeightOnlyConfig(rounding="floor")),
    (QuantizationSpec(Dtype.int4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32,
                      round_method=RoundType.round),
     IntxWeightOnlyConfig(torch.int4, PerGroup(32), scale_dtype=torch.float32, rounding="half_away_from_zero")),
    (QuantizationSpec(Dtype.uint8, qscheme=QSchemeType.per_tensor, symmetric=False, round_method=RoundType.floor),
     PlainWeightOnlyConfig("uint8", PerTensor(), MappingType.ASYMMETRIC, ZeroPointDomain.INT, rounding="floor")),
])
def test_weight_only_mapping(spec, want):
    assert Config(qc()).to_affineq(qc(weight=spec)) == want


@pytest.mark.parametrize("a, w, want", [
    (A8_DYN, W8, Int8DynamicActivationInt8WeightConfig()),
    (QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel, symmetric=False),
     QuantizationSpec(Dtype.int4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=64, symmetric=True),
     Int8DynamicActivationInt4WeightConfig(group_size=64, scale_dtype=torch.float32)),
    (QuantizationSpec(Dtype.fp8_e4m3, is_dynamic=True, qscheme=QSchemeType.per_channel),
     QuantizationSpec(Dtype.fp8_e4m3, qscheme=QSchemeType.per_channel, ch_axis=0),
     Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())),
    (QuantizationSpec(Dtype.fp8_e4m3, is_dynamic=True, qscheme=QSchemeType.per_tensor),
     QuantizationSpec(Dtype.fp8_e5m2, qscheme=QSchemeType.per_tensor),
     Float8DynamicActivationFloat8WeightConfig(weight_dtype=torch.float8_e5m2, granularity=PerTensor())),
])
def test_dynamic_mapping(a, w, want):
    assert Config(qc()).to_affineq(qc(input_tensors=a, weight=w)) == want


def test_dynamic_mx_mapping():
    a = QuantizationSpec(Dtype.mx, is_dynamic=True, mx_element_dtype=Dtype.fp8_e4m3)
    w = QuantizationSpec(Dtype.mx, qscheme=QSchemeType.per_group, ch_axis=-1, group_size=32,
                         mx_element_dtype=Dtype.fp4)
    want = MXDynamicActivationMXWeightConfig(torch.float8_e4m3fn, "fp4_e2m1")
    assert Config(qc()).to_affineq(qc(input_tensors=a, weight=w)) == want


def test_dynamic_per_tensor_int8_mapping():
    a = QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_tensor, symmetric=True)
    want = Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")
    assert Config(qc()).to_affineq(qc(input_tensors=a, weight=W8)) == want


@pytest.mark.parametrize("q, words", [
    (qc(weight=QuantizationSpec(Dtype.mx, mx_element_dtype=Dtype.fp4, scale_type=ScaleType.float32)),
     ["Dtype.mx", "E8M0", "pof2"]),
    (qc(weight=QuantizationSpec(Dtype.mx, mx_element_dtype=Dtype.fp4, qscheme=QSchemeType.per_channel)),
     ["Dtype.mx", "per_group", "group_size=32"]),
    (qc(weight=QuantizationSpec(Dtype.mx6, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32)),
     ["Dtype.mx6", "group_size=16"]),
    (qc(weight=QuantizationSpec(Dtype.mx, mx_element_dtype=Dtype.fp4), input_tensors=QuantizationSpec(
        Dtype.mx, is_dynamic=True, mx_element_dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_group, ch_axis=-1,
        group_size=16)), ["blocks must match", "group_size=32"]),
    (qc(weight=QuantizationSpec(Dtype.bfloat16)), ["Dtype.bfloat16", "model.to(torch.bfloat16)"]),
    (qc(weight=QuantizationSpec(Dtype.float16)), ["Dtype.float16", "model.to(torch.float16)"]),
    (qc(weight=W8, output_tensors=QuantizationSpec(Dtype.int8)), [STATIC_ACTIVATION_MESSAGE]),
    (qc(weight=W4, input_tensors=A8_STATIC), ["int8 symmetric per_channel weight"]),
    (qc(weight=W8, input_tensors=QuantizationSpec(Dtype.uint8, is_dynamic=False, symmetric=True)), ["uint8"]),
    (qc(weight=W8, output_tensors=QuantizationSpec(Dtype.int8, is_dynamic=True)), ["output_tensors"]),
    (qc(weight=W8, bias=QuantizationSpec(Dtype.int8)), ["bias"]),
    (qc(input_tensors=A8_DYN), ["weight spec"]),
    (qc(weight=W8, input_tensors=QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel,
                                                  round_method=RoundType.floor)),
     ["input_tensors.round_method=floor", "half_even"]),
    (qc(weight=QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0,
                                round_method=RoundType.round), input_tensors=A8_DYN),
     ["weight.round_method=round", "weight-only"]),
    (qc(weight=QuantizationSpec(Dtype.int8, scale_type=ScaleType.float16)), ["float16", "float32"]),
    (qc(weight=QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=1)), ["ch_axis=0"]),
    (qc(weight=QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_group, ch_axis=0, group_size=32)),
     ["ch_axis=1"]),
    (qc(weight=W4, input_tensors=A8_DYN), ["not supported", "int8 symmetric per-token or per-tensor"]),
    (qc(weight=POF2, input_tensors=A8_DYN), ["power-of-two", "e8m0", "packing"]),
    (qc(weight=W8, input_tensors=QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_group,
                                                  ch_axis=1, group_size=32)), ["per_group activations"]),
])
def test_refusals(q, words):
    with pytest.raises(QuantizationError) as e:
        Config(qc()).to_affineq(q)
    for w in words:
        assert w in str(e.value)


# -- JSON ------------------------------------------------------------------------------------------------


def test_json_round_trip():
    spec = QuantizationSpec(Dtype.uint4, is_dynamic=False, observer_cls=PerGroupMinMaxObserver,
                            qscheme=QSchemeType.per_group,
                            ch_axis=1, group_size=32, symmetric=False, round_method=RoundType.half_even,
                            scale_type=ScaleType.bfloat16, zero_point_type=ZeroPointType.float32)
    cfg = Config(qc(weight=W8, input_tensors=A8_DYN, target_device=DeviceType.CPU),
                 layer_type_quant_config={nn.Linear: qc(weight=spec), "MyLinear": qc(weight=W2)},
                 layer_quant_config={"*.attn": qc(weight=POF2)}, exclude=["lm_head"])
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["global_quant_config"]["weight"]["dtype"] == "int8"  # enums by name
    assert "class:torch.nn.modules.linear:Linear" in d["layer_type_quant_config"]
    back = Config.from_dict(d)
    assert back == cfg and hash(back) == hash(cfg)
    assert config_from_dict(d) == cfg
    assert back.layer_type_quant_config[nn.Linear].weight.observer_cls is PerGroupMinMaxObserver


def test_json_refuses_unsafe_classes():
    d = Config(qc(weight=QuantizationSpec(Dtype.int8, observer_cls=nn.Identity))).to_dict()
    d["global_quant_config"]["weight"]["observer_cls"] = {"module": "os", "qualname": "system"}
    with pytest.raises(ValueError, match="refusing to load os.system: it is not one of the observers of "
                                         "affineq.observers or a class registered with"):
        Config.from_dict(d)
    with pytest.raises(ValueError, match="key it by its name 'MyLinear'"):
        Config(qc(), layer_type_quant_config={MyLinear: qc(weight=W8)}).to_dict()
    d = Config(qc(), layer_type_quant_config={nn.Linear: qc(weight=W8)}).to_dict()
    d["layer_type_quant_config"] = {"class:subprocess:Popen": d["layer_type_quant_config"].popitem()[1]}
    with pytest.raises(ValueError, match="refusing to load subprocess.Popen: it is not one of the torch.nn module"):
        Config.from_dict(d)
    bad = Config(qc(weight=W8)).to_dict()
    bad["global_quant_config"]["weight"]["dtype"] = "int9"
    with pytest.raises(ValueError, match="dtype='int9'"):
        Config.from_dict(bad)


# -- quantize_ -------------------------------------------------------------------------------------------


def test_quantize_layered_model():
    m = Model()
    x = torch.randn(3, 64)
    ref = m(x)
    w4_sym = QuantizationSpec(Dtype.int4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=True)
    a8_asym = QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel, symmetric=False)
    cfg = Config(qc(weight=W8),
                 layer_type_quant_config={MyLinear: qc(weight=w4_sym, input_tensors=a8_asym)},
                 layer_quant_config={"layers.1.attn": qc(weight=POF2), "layers.*.attn": qc(weight=W4)},
                 exclude=["lm_head"])
    plan = cfg.to_fqn_config(m)
    assert isinstance(plan, FqnToConfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert quantize_(m, cfg) is m
        out = m(x)
    specs = {n: p.spec for n, p in m.named_parameters() if isinstance(p, AffineQuantizedTensor)}
    assert set(specs) == {f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("attn", "mlp.0", "mlp.1")}
    s = specs["layers.0.attn.weight"]
    assert s.target.name == "uint4" and s.block_size == (1, 32) and s.mapping_type is MappingType.ASYMMETRIC
    s = specs["layers.1.attn.weight"]
    assert s.target.name == "int8" and s.block_size == (64, 64) and s.scale_type.name == "e8m0"
    assert s.fmt == "plain"
    s = specs["layers.0.mlp.0.weight"]
    assert s.target.name == "int8" and s.block_size == (1, 64) and s.act_quant is None
    s = specs["layers.1.mlp.1.weight"]
    assert s.target.name == "int4" and s.block_size == (1, 32)
    assert s.act_quant.dtype.name == "int8" and s.act_quant.granularity == PerToken()
    assert s.act_quant.mapping_type is MappingType.ASYMMETRIC and not s.act_quant.static
    assert type(m.lm_head.weight) is nn.Parameter and not isinstance(m.layers[0].norm.weight, AffineQuantizedTensor)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.3 * ref.abs().max()


def test_quantize_filter_fn_still_applies():
    m = Model()
    quantize_(m, Config(qc(weight=W8)), filter_fn=lambda mod, fqn: fqn.endswith("attn"))
    assert {n for n, p in m.named_parameters() if isinstance(p, AffineQuantizedTensor)} == {
        "layers.0.attn.weight", "layers.1.attn.weight"}


def test_static_input_needs_calibration_and_then_runs_the_int8_gemm():
    from affineq import Int8StaticActivationInt8WeightConfig

    m = Model()
    snap = snapshot_model(m)
    cfg = Config(qc(weight=W8), layer_quant_config={"layers.1.attn": qc(input_tensors=A8_STATIC)})
    assert cfg.to_affineq(cfg.resolve("layers.1.attn", m.layers[1].attn)) == Int8StaticActivationInt8WeightConfig(
        activation_symmetric=True, observer="minmax")
    with pytest.raises(QuantizationError, match="needs calibration: pass calibration_data"):
        quantize_(m, cfg)
    assert_unchanged(m, snap)
    x = torch.randn(2, m.layers[0].attn.in_features)
    quantize_(m, cfg, calibration_data=[torch.randn(4, x.shape[1]) for _ in range(3)])
    w = m.layers[1].attn.weight
    assert w.act_quant.static and w.act_tensors["act_scale"].numel() == 1 and "act_zero_point" not in w.act_tensors
    assert m.layers[0].attn.weight.act_quant is None  # the global spec: weight-only


@pytest.mark.parametrize("kwargs, words", [
    (dict(algo_config={"name": "awq"}), ["algo_config", "GPTQConfig"]),
    (dict(pre_quant_opt_config=[{"name": "smooth"}]), ["pre_quant_opt_config", "SmoothQuantConfig"]),
])
def test_algorithm_fields_take_algorithm_templates(kwargs, words):
    with pytest.raises(ValueError) as e:
        Config(qc(weight=W8), **kwargs)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("cfg, words", [
    (Config(qc(weight=QuantizationSpec(Dtype.bfloat16))), ["Dtype.bfloat16"]),
    # an exactly named non-Linear module is selected and its config's check refuses it
    (Config(qc(weight=W8), layer_quant_config={"layers.0.norm": qc(weight=W4)}), ["layers.0.norm", "LayerNorm"]),
])
def test_quantize_refusals_leave_model_unchanged(cfg, words):
    m = Model()
    snap = snapshot_model(m)
    with pytest.raises(QuantizationError) as e:
        quantize_(m, cfg)
    for w in words:
        assert w in str(e.value)
    assert_unchanged(m, snap)


def test_global_config_skips_non_linear_and_type_key_selects():
    m = Model()
    assert "layers.0.norm" not in Config(qc(weight=W8)).to_fqn_config(m).fqn_to_config
    emb = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 4))
    cfg = Config(qc(), layer_type_quant_config={nn.Embedding: qc(weight=W8)})
    quantize_(emb, cfg)
    assert isinstance(emb[0].weight, AffineQuantizedTensor) and type(emb[1].weight) is nn.Parameter


# -- algorithms inside the layered Config ----------------------------------------------------------------


def test_algo_config_wraps_each_resolved_layer_config():
    from affineq.algorithms import HQQConfig

    torch.manual_seed(0)
    m = Model()
    ref = copy.deepcopy(m)
    cfg = Config(qc(weight=W4), layer_quant_config={"layers.1.*": qc(weight=W2)}, exclude=["lm_head"],
                 algo_config=[HQQConfig(None, iters=5)])
    plan = cfg.to_fqn_config(m).fqn_to_config
    assert plan["layers.0.attn"] == HQQConfig(Config(qc()).to_affineq(qc(weight=W4)), iters=5)
    assert plan["layers.1.mlp.0"] == HQQConfig(Config(qc()).to_affineq(qc(weight=W2)), iters=5)
    assert "lm_head" not in plan
    quantize_(m, cfg)
    quantize_(ref, FqnToConfig({k: v.base_config for k, v in plan.items()}))
    torch.manual_seed(0)  # the same float weights again: HQQ reconstructs them better than round-to-nearest
    float_w = {n: mod.weight.detach() for n, mod in Model().named_modules() if n in plan}
    mods, rmods = dict(m.named_modules()), dict(ref.named_modules())
    err = sum(float((mods[n].weight.dequantize() - float_w[n]).pow(2).sum()) for n in plan)
    rtn = sum(float((rmods[n].weight.dequantize() - float_w[n]).pow(2).sum()) for n in plan)
    assert err < 0.97 * rtn
    back = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and hash(back) == hash(cfg)


def test_algo_config_refusals():
    from affineq.algorithms import HQQConfig

    with pytest.raises(ValueError, match="leave base_config=None"):
        Config(qc(weight=W8), algo_config=HQQConfig(Int8WeightOnlyConfig()))
    with pytest.raises(ValueError, match="holds 2 algorithms"):
        Config(qc(weight=W8), algo_config=[HQQConfig(None), HQQConfig(None)])
    m = Model()
    snap = snapshot_model(m)
    cfg = Config(qc(weight=POF2), algo_config=HQQConfig(None))  # pof2 per-tensor -> PlainWeightOnlyConfig
    with pytest.raises(QuantizationError, match="HQQConfig cannot wrap PlainWeightOnlyConfig"):
        quantize_(m, cfg)
    assert_unchanged(m, snap)
    with pytest.raises(QuantizationError, match="template"):
        quantize_(m, HQQConfig(None))
    assert_unchanged(m, snap)


def test_pre_quant_opt_config_smoothquant_before_static_int8():
    from affineq import Int8StaticActivationInt8WeightConfig
    from affineq.algorithms import SmoothQuantConfig

    with pytest.raises(ValueError, match="belongs in Config.pre_quant_opt_config"):
        Config(qc(weight=W8), algo_config=SmoothQuantConfig(None))
    with pytest.raises(ValueError, match="together are not supported"):
        from affineq.algorithms import HQQConfig

        Config(qc(weight=W8), algo_config=HQQConfig(None), pre_quant_opt_config=SmoothQuantConfig(None))
    from affineq.models.tiny import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    m = TinyLM(TinyLMConfig()).eval()
    cfg = Config(qc(weight=W8, input_tensors=A8_STATIC), exclude=["lm_head"],
                 pre_quant_opt_config=SmoothQuantConfig(None, alpha=0.5, progress=False))
    plan = cfg.to_fqn_config(m).fqn_to_config
    assert plan["layers.0.self_attn.q_proj"] == SmoothQuantConfig(
        Int8StaticActivationInt8WeightConfig(activation_symmetric=True, observer="minmax"), alpha=0.5, progress=False)
    quantize_(m, cfg, calibration_data=[torch.randint(0, 100, (2, 16)) for _ in range(3)])
    w = m.layers[0].self_attn.q_proj.weight
    assert w.act_quant.static and "act_scale" in w.act_tensors
    assert not isinstance(m.lm_head.weight, AffineQuantizedTensor)
