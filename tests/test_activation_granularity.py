"""Activation granularity is a `Granularity` (issue #29): old names still load (to_dict, pickles), and
`FakeQuantizeConfig.from_spec` builds the QAT fake quantization that gives a spec's exact codes."""

import io
import pickle

import pytest
import torch

from affineq import AffineQuantizedTensor, MappingType, QuantSpec
from affineq.granularity import PerGroup, PerTensor, PerToken
from affineq.primitives import ZeroPointDomain, quantize_affine
from affineq.qat import FakeQuantizeConfig
from affineq.qat.fake_quantizer import FakeQuantizer
from affineq.tensor.spec import ActivationQuant, QParamOptions


@pytest.mark.parametrize("name, kwargs, granularity", [
    ("per_token", {}, PerToken()),
    ("per_tensor", {"static": True}, PerTensor()),
    ("per_block", {"block_size": 32, "scale_mode": "floor"}, PerGroup(32)),
])
def test_names_convert_to_granularities_and_serialize_as_before(name, kwargs, granularity):
    dtype = "mxfp8_e4m3" if name == "per_block" else torch.int8
    old = ActivationQuant(dtype, MappingType.SYMMETRIC, name, ZeroPointDomain.NONE, **kwargs)
    new = ActivationQuant(dtype, MappingType.SYMMETRIC, granularity, ZeroPointDomain.NONE,
                          **{k: v for k, v in kwargs.items() if k != "block_size"})
    assert old == new and old.granularity == granularity and new.granularity_name == name
    assert new.block_size == kwargs.get("block_size")
    d = new.to_dict()
    assert d["granularity"] == name  # the stored form is unchanged: files written before still load, and after
    assert ActivationQuant.from_dict(d) == new
    buf = pickle.dumps(new)
    assert name.encode() in buf and b"PerToken" not in buf and b"PerGroup" not in buf  # pickles keep the name
    assert pickle.loads(buf) == new
    spec = QuantSpec.create((8, 64), torch.float32, torch.int8, (1, 64), act_quant=new)
    f = io.BytesIO()
    torch.save(spec, f)
    f.seek(0)
    assert torch.load(f, weights_only=True) == spec


def test_bad_granularity_names_the_fix():
    with pytest.raises(ValueError, match=r"granularity=PerGroup\(group_size=32\) and block_size=16 differ"):
        ActivationQuant("mxfp8_e4m3", MappingType.SYMMETRIC, PerGroup(32), ZeroPointDomain.NONE, block_size=16,
                        scale_mode="floor")
    with pytest.raises(ValueError, match=r"granularity='per_row'.*PerToken\(\), PerTensor\(\) or PerGroup"):
        ActivationQuant(granularity="per_row")
    with pytest.raises(ValueError, match=r"static=True\) needs granularity=PerTensor\(\)"):
        ActivationQuant(granularity=PerToken(), static=True)


@pytest.mark.parametrize("target, block, mapping, domain, options", [
    (torch.int4, (1, 32), MappingType.SYMMETRIC, ZeroPointDomain.NONE, QParamOptions()),
    (torch.uint4, (1, 16), MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT,
     QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False)),
    (torch.int8, (1, 64), MappingType.SYMMETRIC, ZeroPointDomain.NONE, QParamOptions(eps=1e-6)),
    (torch.uint3, (1, 16), MappingType.ASYMMETRIC, ZeroPointDomain.INT, QParamOptions()),
])
def test_fake_quantize_config_from_spec_gives_identical_codes(target, block, mapping, domain, options):
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.linspace(0.2, 3.0, 64)
    spec = QuantSpec.create(tuple(w.shape), w.dtype, target, block, mapping_type=mapping, zero_point_domain=domain)
    ref = AffineQuantizedTensor.from_spec(w, spec, options)
    fq = FakeQuantizer(FakeQuantizeConfig.from_spec(spec, options))
    with torch.no_grad():
        fake = fq(w)
        scale, zp = fq.quantized_qparams(w)
    s = fq.spec(w)
    codes = quantize_affine(w, s.block_size, scale, zp, s.target_dtype, s.quant_min, s.quant_max,
                            s.zero_point_domain, rounding=fq.config.rounding)
    assert torch.equal(codes, ref.codes())
    assert torch.equal(fake, ref.dequantize())


def test_fake_quantize_config_from_spec_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match="float8_e4m3fn has no FakeQuantizeConfig"):
        FakeQuantizeConfig.from_spec(QuantSpec.create((8, 32), torch.float32, torch.float8_e4m3fn, (1, 32)))
    with pytest.raises(ValueError, match="full integer ranges only"):
        FakeQuantizeConfig.from_spec(QuantSpec.create((8, 32), torch.float32, torch.int8, (1, 32), quant_min=-127))
    aq = ActivationQuant(torch.int8, MappingType.ASYMMETRIC, PerToken(), ZeroPointDomain.INT)
    assert FakeQuantizeConfig.from_activation_quant(aq) == FakeQuantizeConfig(
        torch.int8, PerToken(), MappingType.ASYMMETRIC, torch.float32, torch.int32, ZeroPointDomain.INT)
    with pytest.raises(ValueError, match="no QAT counterpart"):
        FakeQuantizeConfig.from_activation_quant(ActivationQuant(granularity=PerTensor(), static=True))


def test_int8_dynamic_config_takes_granularity_objects():
    from affineq import Int8DynamicActivationInt8WeightConfig as W8A8

    assert W8A8(act_granularity=PerTensor()) == W8A8(act_granularity="per_tensor")
    assert W8A8(act_granularity=PerTensor()).to_dict() == W8A8(act_granularity="per_tensor").to_dict()
    spec = W8A8(act_granularity=PerTensor()).weight_spec(torch.randn(16, 64), torch.nn.Linear(64, 16))
    assert spec.act_quant.granularity == PerTensor()
