"""The float / block-scaled configs through quantize_: FPxWeightOnlyConfig, MXWeightOnlyConfig,
MXDynamicActivationMXWeightConfig, power-of-two scales for IntxWeightOnlyConfig, and E5M2 in the float8 configs:
exactness, scale types, rounding modes, eager / torch.compile(fullgraph=True) / torch.save(weights_only=True)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import save_load as _roundtrip
from torch import nn

import affineq
from affineq import cpp as _cpp
from affineq.configs import (
    FPX_FORMATS,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    IntxWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
    config_from_dict,
)
from affineq.dtypes import qtype
from affineq.granularity import PerGroup
from affineq.mx import dequantize_mx, fake_quantize_mx, quantize_mx
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.formats import get_format
from affineq.tensor.spec import ActivationQuant, QuantSpec


def _model(k=64, n=32, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, 16)).to(dtype)


def _grid_weight(element: str, n: int, k: int, group: int, with_max: bool) -> torch.Tensor:
    """Representable values of `element` times a power of two per group (2**-6 .. 2**5); with_max puts +-max in
    every group (so amax / max is that power of two)."""
    t = qtype(element)
    g = torch.Generator().manual_seed(3)
    if t.torch_dtype is None:
        values = t.decode(torch.arange(2**t.bits, dtype=torch.uint8))
    else:
        values = torch.arange(256, dtype=torch.uint8).view(t.torch_dtype).float()
        values = values[torch.isfinite(values)]
    w = values[torch.randint(0, values.numel(), (n, k), generator=g)].view(n, k // group, group)
    if with_max:
        w[:, :, 0], w[:, :, 1] = t.qmax, -t.qmax
    else:  # amax in (max / 2, max]: the pof2 scale is the group's power of two
        w[:, :, 0] = t.qmax
    exps = torch.randint(-6, 6, (n, k // group, 1), generator=g).float()
    return (w * torch.exp2(exps)).view(n, k)


@pytest.mark.parametrize("ebits,mbits", list(FPX_FORMATS))
@pytest.mark.parametrize("scale_type", ["float32", "e8m0", "pof2", "bfloat16"])
def test_representable_weights_survive_exactly(ebits, mbits, scale_type):
    element = FPX_FORMATS[(ebits, mbits)]
    w = _grid_weight(element, 8, 64, 32, with_max=scale_type in ("float32", "bfloat16", "e8m0"))
    m = nn.Sequential(nn.Linear(64, 8, bias=False))
    m[0].weight.data = w.clone()
    affineq.quantize_(m, FPxWeightOnlyConfig(ebits, mbits, scale_type=scale_type))
    assert torch.equal(m[0].weight.dequantize(), w)


@pytest.mark.parametrize("scale_type,dtype", [("float32", torch.float32), ("float16", torch.float16),
                                              ("bfloat16", torch.bfloat16), ("float", torch.bfloat16)])
def test_float_scale_types_store_amax_over_max(scale_type, dtype):
    torch.manual_seed(1)
    w = torch.randn(4, 64).to(dtype)
    m = nn.Sequential(nn.Linear(64, 4)).to(dtype)
    m[0].weight.data = w.clone()
    affineq.quantize_(m, FPxWeightOnlyConfig(2, 1, packing_format="plain", scale_type=scale_type))
    want_dtype = dtype if scale_type == "float" else getattr(torch, scale_type)
    scale = m[0].weight.tensors["scale"]
    assert scale.dtype == want_dtype
    amax = w.float().abs().view(4, 2, 32).amax(-1)
    assert torch.equal(scale, (amax / 6.0).to(want_dtype))


@pytest.mark.parametrize("cfg", [FPxWeightOnlyConfig(2, 3, scale_type="e8m0"),
                                 FPxWeightOnlyConfig(3, 2, scale_type="pof2"),
                                 MXWeightOnlyConfig("mxfp4", scale_mode="even"),
                                 IntxWeightOnlyConfig(torch.int4, scale_type="pof2"),
                                 IntxWeightOnlyConfig(torch.int8, PerGroup(32), scale_type="e8m0")])
def test_pow2_scales_are_exact_powers_of_two_stored_as_e8m0(cfg):
    m = affineq.quantize_(_model(), cfg)
    w = m[0].weight
    assert w.spec.scale_type == qtype("e8m0") and w.tensors["scale"].dtype == torch.uint8
    s = w.scale
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    if cfg.__dict__.get("scale_type") == "pof2":  # rounded up: nothing clips
        amax = _model()[0].weight.detach().abs().view(32, 2, 32).amax(-1)
        assert bool((amax <= s * w.quant_max).all())


def test_mx_weight_config_equals_quantize_mx():
    w = _model()[0].weight.detach()
    for element in ("mxfp4", "mxfp6_e3m2", torch.float8_e4m3fn, "mxint8"):
        m = affineq.quantize_(_model(), MXWeightOnlyConfig(element))
        codes, scales = quantize_mx(w, element)
        assert torch.equal(m[0].weight.dequantize(), dequantize_mx(codes, scales, element))


@pytest.mark.parametrize("rounding,expected", [("half_even", [2, -2, 0, 0, 4, -4]),
                                               ("half_away_from_zero", [3, -3, 1, -1, 4, -4]),
                                               ("floor", [2, -3, 0, -1, 3, -4])])
def test_rounding_modes_on_ties_and_negatives_with_pof2_scales(rounding, expected):
    w = torch.zeros(1, 32)
    w[0, :7] = torch.tensor([2.5, -2.5, 0.5, -0.5, 3.5, -3.5, 7.0])  # amax 7 -> pof2 scale 1 for int4 (qmax 7)
    m = nn.Sequential(nn.Linear(32, 1, bias=False))
    m[0].weight.data = w
    affineq.quantize_(m, IntxWeightOnlyConfig(torch.int4, PerGroup(32), scale_type="pof2", rounding=rounding))
    assert m[0].weight.scale.item() == 1.0
    assert m[0].weight.codes()[0, :6].tolist() == expected


def test_mx_dynamic_activation_numerics_and_kernel_choice():
    torch.manual_seed(4)
    m = affineq.quantize_(_model(), MXDynamicActivationMXWeightConfig("mxfp4", "mxfp6_e2m3"))
    w = m[0].weight
    assert w.spec.act_quant == ActivationQuant("fp4_e2m1", granularity="per_block", block_size=32,
                                               scale_mode="floor", zero_point_domain=ZeroPointDomain.NONE)
    x = torch.randn(3, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = m[0](x)
    assert torch.equal(y, F.linear(fake_quantize_mx(x, "fp4_e2m1"), w.dequantize(), m[0].bias))


@pytest.mark.skipif(not _cpp.is_available(), reason="C++ kernels not built")
def test_lowbit_kernel_accepts_mx_activations():
    torch.manual_seed(5)
    w = torch.randn(32, 64)
    aq = ActivationQuant("mxint8", granularity="per_block", block_size=32, scale_mode="floor",
                         zero_point_domain=ZeroPointDomain.NONE)
    spec = QuantSpec.create((32, 64), torch.float32, torch.float8_e4m3fn, (1, 32), mapping_type=MappingType.SYMMETRIC,
                            packing_format="dense", act_quant=aq)
    qw = AffineQuantizedTensor.from_spec(w, spec)
    x = torch.randn(4, 64)
    with affineq.record_kernels() as used:
        y = F.linear(x, qw)
    assert used == ["affineq.lowbit_linear"]
    ref = F.linear(fake_quantize_mx(x, torch.int8), qw.dequantize())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_auto_stores_dense_for_cpu_linears():
    """"auto" = kernel_registry.auto_format("float_codes"): `dense` (our kernel's layout, and the compact one even
    without a compiler) for 2-D CPU nn.Linear weights."""
    for cfg in (FPxWeightOnlyConfig(2, 1), FPxWeightOnlyConfig(4, 3), MXWeightOnlyConfig("mxfp8_e4m3"),
                MXWeightOnlyConfig("mxint8"), FPxWeightOnlyConfig(3, 2, scale_type="pof2")):
        spec = affineq.quantize_(_model(), cfg)[0].weight.spec
        assert spec.fmt == "dense" and get_format("dense").check(spec) is None, cfg


# -- every new config: eager, compiled, saved and loaded ------------------------------------------------------

CONFIGS = {
    "fp4": FPxWeightOnlyConfig(2, 1),
    "fp6_e3m2_plain": FPxWeightOnlyConfig(3, 2, packing_format="plain"),
    "fp8_e5m2_bf16": FPxWeightOnlyConfig(5, 2, scale_type="bfloat16"),
    "mxfp4": MXWeightOnlyConfig("mxfp4"),
    "mxfp6_rceil": MXWeightOnlyConfig("fp6_e2m3", scale_mode="rceil"),
    "mxint8": MXWeightOnlyConfig(torch.int8),
    "mx_dynamic": MXDynamicActivationMXWeightConfig("mxfp8_e4m3", "mxfp4"),
    "int4_pof2": IntxWeightOnlyConfig(torch.int4, scale_type="pof2"),
    "float8_e5m2_wo": Float8WeightOnlyConfig(torch.float8_e5m2),
    "float8_e5m2_dyn": Float8DynamicActivationFloat8WeightConfig(torch.float8_e5m2, torch.float8_e5m2),
}
SQNR_MIN = {"fp4": 12, "fp6_e3m2_plain": 20, "fp8_e5m2_bf16": 20, "mxfp4": 10, "mxfp6_rceil": 20, "mxint8": 30,
            "mx_dynamic": 10, "int4_pof2": 12, "float8_e5m2_wo": 20, "float8_e5m2_dyn": 15}




@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_eager_compiled_saved(name):
    cfg = CONFIGS[name]
    assert config_from_dict(cfg.to_dict()) == cfg
    ref_model = _model()
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = ref_model(x)
        model = affineq.quantize_(_model(), cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = model(x)
            sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum()))
            assert sqnr > SQNR_MIN[name], sqnr
            restored = _model()
            restored.load_state_dict(_roundtrip(model.state_dict()), assign=True)
            assert isinstance(restored[0].weight, AffineQuantizedTensor)
            assert torch.equal(restored(x), y)
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, y, rtol=1e-5, atol=1e-5)


# -- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,words", [
    (lambda: FPxWeightOnlyConfig(3, 3), r"\(ebits, mbits\)=\(3, 3\).*\(2, 1\) fp4_e2m1"),
    (lambda: FPxWeightOnlyConfig(2, 1, scale_type="fp8"), "scale_type='fp8' is not one of"),
    (lambda: FPxWeightOnlyConfig(2, 1, group_size=3), "group_size=3 must be an even int"),
    (lambda: MXWeightOnlyConfig("mx9"), "micro-exponents"),
    (lambda: MXWeightOnlyConfig("fp4_e2m1", block_size=31), "block_size=31"),
    (lambda: MXWeightOnlyConfig("fp4_e2m1", scale_mode="round"), "scale_mode='round'"),
    (lambda: MXDynamicActivationMXWeightConfig(torch.int4), "activation_dtype=torch.int4"),
    (lambda: IntxWeightOnlyConfig(torch.uint4, scale_type="pof2"), "needs mapping_type=MappingType.SYMMETRIC, a sig"),
    (lambda: IntxWeightOnlyConfig(torch.int4, scale_type="pow2"), "scale_type='pow2' is not one of"),
    (lambda: ActivationQuant("fp4_e2m1", granularity="per_block", scale_mode="floor"), "block_size=None"),
    (lambda: ActivationQuant(torch.int8, block_size=32), "per_block"),
])
def test_bad_config(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_k_not_divisible_is_reported_by_quantize():
    with pytest.raises(Exception, match="group_size|divide"):
        affineq.quantize_(nn.Sequential(nn.Linear(48, 8)), MXWeightOnlyConfig("mxfp4"))


def test_mx_dynamic_inductor_fullgraph_is_bit_exact():
    torch._dynamo.reset()
    model = affineq.quantize_(_model(), MXDynamicActivationMXWeightConfig("mxfp4", "mxfp6_e3m2"))
    x = torch.randn(4, 64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, fullgraph=True)(x)  # traced before any eager decode ran
        assert torch.equal(compiled, model(x))


def test_mx_activation_spec_json_round_trip():
    spec = affineq.quantize_(_model(), CONFIGS["mx_dynamic"])[0].weight.spec
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["act_quant"]["block_size"] == 32
    plain = ActivationQuant(torch.int8).to_dict()
    assert "block_size" not in plain and ActivationQuant.from_dict(plain) == ActivationQuant(torch.int8)


def test_integer_pof2_scales_run_our_kernel_in_dense_and_equal_plain():
    for wd in (torch.int4, torch.int8, torch.int3):
        cfg = dict(weight_dtype=wd, granularity=affineq.PerGroup(32), scale_type="pof2")
        dense = affineq.quantize_(_model(), affineq.IntxWeightOnlyConfig(**cfg))[0].weight
        plain = affineq.quantize_(_model(), affineq.IntxWeightOnlyConfig(**cfg, packing_format="plain"))[0].weight
        assert dense.spec.fmt == "dense" and plain.spec.fmt == "plain"
        assert torch.equal(dense.dequantize(), plain.dequantize())
        if _cpp.is_available():
            x = torch.randn(3, 64)
            with affineq.record_kernels() as used:
                y = F.linear(x, dense)
            assert used == ["affineq.lowbit_linear"]
            torch.testing.assert_close(y, F.linear(x, plain.dequantize()), rtol=1e-5, atol=1e-5)
