"""Static output quantization (`quantize_output=True`, Quark's static output_tensors): the layer's output is
calibrated and quantized to int8 with those qparams; cross-checked against torch.ao's static quantized Linear."""

import copy
import io

import pytest
import torch
from torch import nn

import affineq
from affineq import Int8StaticActivationInt8WeightConfig, record_kernels
from affineq.quark import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationSpec


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16)).eval()


def _calib():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 32, generator=g) * 2 for _ in range(4)]


@pytest.mark.parametrize("symmetric", [False, True])
def test_output_is_on_the_calibrated_int8_grid(symmetric):
    m = _model()
    plain = copy.deepcopy(m)
    cfg = Int8StaticActivationInt8WeightConfig(packing_format="plain", quantize_output=True,
                                               output_symmetric=symmetric)
    affineq.quantize_(m, cfg, calibration_data=_calib())
    affineq.quantize_(plain, Int8StaticActivationInt8WeightConfig(packing_format="plain"), calibration_data=_calib())
    x = _calib()[0]
    w = m[0].weight
    s = w.act_tensors["act_out_scale"]
    zp = w.act_tensors.get("act_out_zero_point")
    assert (zp is None) == symmetric
    with torch.no_grad(), record_kernels() as used:
        y = m[0](x)
        y_in = plain[0](x)  # same input qparams and weight, no output quantization
    assert set(used) == {"aten._int_mm:static"}
    zp_v = 0 if zp is None else int(zp)
    codes = torch.clamp(torch.round(y_in / s) + zp_v, -128, 127)
    torch.testing.assert_close(y, (codes - zp_v) * s, rtol=0, atol=1e-6)
    # calibrated on the same data: the output range covers what the layer produced
    assert float((y - y_in).abs().max()) <= float(s) / 2 + 1e-6


def test_matches_torch_ao_static_quantized_linear():
    # torch.ao: quint8 per-tensor affine input/output (MinMaxObserver), qint8 per-channel symmetric weights
    # fbgemm / oneDNN sum uint8 x int8 pairs in saturating int16 (vpmaddubsw) on CPUs without VNNI or AMX (the
    # reason torch.ao's x86 qconfigs use reduce_range): there torch.ao's own reference is off by up to 33 steps on
    # this layer. QNNPACK sums exactly in int32 on every CPU; the x86 engine is kept where it is exact.
    engine = "x86" if torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported() else "qnnpack"
    previous, torch.backends.quantized.engine = torch.backends.quantized.engine, engine
    try:
        _compare_with_torch_ao()
    finally:
        torch.backends.quantized.engine = previous


def _compare_with_torch_ao():
    from torch.ao.quantization import QConfig, convert, prepare
    from torch.ao.quantization.observer import MinMaxObserver, default_per_channel_weight_observer
    from torch.ao.quantization.stubs import DeQuantStub, QuantStub

    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    ao = nn.Sequential(QuantStub(), copy.deepcopy(lin), DeQuantStub()).eval()
    ao.qconfig = QConfig(activation=MinMaxObserver.with_args(dtype=torch.quint8),
                         weight=default_per_channel_weight_observer)
    ao = prepare(ao)
    calib = _calib()
    for x in calib:
        ao(x)
    ao = convert(ao)
    ours = nn.Sequential(copy.deepcopy(lin)).eval()
    affineq.quantize_(ours, Int8StaticActivationInt8WeightConfig(packing_format="plain", quantize_output=True),
                      calibration_data=calib)
    w = ours[0].weight
    assert float(w.act_tensors["act_out_scale"]) == pytest.approx(ao[1].scale, rel=1e-6)
    assert int(w.act_tensors["act_out_zero_point"]) + 128 == ao[1].zero_point  # int8 vs quint8: shifted by 128
    x = calib[2]
    with torch.no_grad():
        y, y_ao = ours(x), ao(x)
    step = ao[1].scale
    # both on the same output grid; torch.ao requantizes from int32 in float, so at most one step apart
    assert float((y - y_ao).abs().max()) <= step * 1.001
    assert float(((y - y_ao).abs() < step * 1e-3).float().mean()) > 0.97


def test_conv_output_quantized_and_state_dict_round_trip():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    calib = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    affineq.quantize_(m, Int8StaticActivationInt8WeightConfig(quantize_output=True),
                      filter_fn=lambda mod, fqn: isinstance(mod, nn.Conv2d), calibration_data=calib)
    w = m[0].weight
    s, zp = float(w.act_tensors["act_out_scale"]), int(w.act_tensors["act_out_zero_point"])
    with torch.no_grad(), pytest.warns(affineq.KernelFallbackWarning):
        y = m[0](calib[0])
    codes = y / s + zp
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-3)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    with torch.no_grad():
        assert torch.equal(fresh[0](calib[0]), y)


def test_eager_equals_compiled():
    m = _model()
    affineq.quantize_(m, Int8StaticActivationInt8WeightConfig(packing_format="plain", quantize_output=True),
                      calibration_data=_calib())
    x = _calib()[1]
    torch._dynamo.reset()
    with torch.no_grad():
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_quark_static_output_spec_calibrates_the_output():
    a = QuantizationSpec(Dtype.int8, is_dynamic=False, qscheme=QSchemeType.per_tensor, symmetric=False)
    o = QuantizationSpec(Dtype.uint8, is_dynamic=False, qscheme=QSchemeType.per_tensor, symmetric=False)
    w = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)
    cfg = Config(QuantizationConfig(input_tensors=a, output_tensors=o, weight=w))
    assert cfg.to_affineq(cfg.global_quant_config) == Int8StaticActivationInt8WeightConfig(
        quantize_output=True, output_symmetric=False)
    m = _model()
    affineq.quantize_(m, cfg, calibration_data=_calib())
    assert all("act_out_scale" in m[i].weight.act_tensors for i in (0, 2))


def test_bad_output_options():
    with pytest.raises(ValueError, match="quantize_output=True"):
        Int8StaticActivationInt8WeightConfig(output_symmetric=True)
    with pytest.raises(ValueError, match="quantize_output"):
        Int8StaticActivationInt8WeightConfig(quantize_output=1)
    qw = affineq.AffineQuantizedTensor.from_spec(torch.randn(4, 8), (1, 8), target=torch.int8,
                                                 mapping_type=affineq.MappingType.SYMMETRIC)
    with pytest.raises(ValueError, match="act_out_zero_point needs act_out_scale"):
        qw.with_act_tensors(act_out_zero_point=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="act_out_scale must be one float32"):
        qw.with_act_tensors(act_out_scale=torch.tensor([3], dtype=torch.int32))
