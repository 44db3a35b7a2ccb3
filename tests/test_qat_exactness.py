"""prepare-then-convert with no training reproduces the fake-quantized forward: the same integer codes, the
same dequantized weights, each layer's output on the same input equal up to the kernels' float rounding (20
seeds, fp32 and bf16). Per layer: with int8 activations a rounding difference upstream (an exact int32 sum against
the fake path's fp32 one) can move a downstream activation code across a rounding boundary."""

import copy

import pytest
import torch
from torch import nn

from affineq import (
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MappingType,
    PerGroup,
    QuantizationError,
    quantize_,
)
from affineq.granularity import PerTensor, PerToken
from affineq.primitives import quantize_affine
from affineq.qat import (
    FakeQuantizeConfig,
    FakeQuantizedEmbedding,
    FakeQuantizedLinear,
    QATConfig,
    initialize_fake_quantizers,
)
from affineq.tensor.activation import fake_quantize_activation

BASES = {
    "8da4w": Int8DynamicActivationInt4WeightConfig(group_size=16),
    "int4_weight_only": Int4WeightOnlyConfig(group_size=16),  # uint4, FLOAT zero point, bf16 scales
    "intx_int2": IntxWeightOnlyConfig(torch.int2, PerGroup(16)),
    "intx_int3": IntxWeightOnlyConfig(torch.int3, PerGroup(16)),
    "intx_uint3_asym": IntxWeightOnlyConfig(torch.uint3, PerGroup(16), MappingType.ASYMMETRIC),
    "int8_weight_only": Int8WeightOnlyConfig(),
    "int8_dynamic": Int8DynamicActivationInt8WeightConfig(),
}
# float rounding of the outputs relative to max |y|: fp32 accumulation order; bf16 output rounding (2**-8 ulp,
# a few ulps where kernels accumulate in another order)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


def _model(dtype):
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16, bias=False)).to(dtype)


def _weight_codes(fq, w):
    spec = fq.spec(w)
    scale, zp = fq.quantized_qparams(w)
    return quantize_affine(w, spec.block_size, scale, zp, spec.target_dtype, spec.quant_min, spec.quant_max,
                           spec.zero_point_domain, rounding=fq.config.rounding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BASES))
def test_prepare_then_convert_is_exact_over_20_seeds(name, dtype):
    base = BASES[name]
    for seed in range(20):
        torch.manual_seed(seed)
        m = _model(dtype)
        x = torch.randn(2, 3, 32, dtype=dtype) * (1 + seed % 3)
        quantize_(m, QATConfig(base, step="prepare"))
        assert isinstance(m[0], FakeQuantizedLinear)
        fake = copy.deepcopy(m)
        with torch.no_grad():
            fake_w = [lin.weight_fake_quantizer(lin.weight) for lin in (m[0], m[2])]
            codes = [_weight_codes(lin.weight_fake_quantizer, lin.weight) for lin in (m[0], m[2])]
        quantize_(m, QATConfig(base, step="convert"))
        assert type(m[0]) is nn.Linear
        for layer, fw, c in zip((m[0], m[2]), fake_w, codes, strict=True):
            assert torch.equal(layer.weight.codes(), c), (name, seed)
            assert torch.equal(layer.weight.dequantize(), fw), (name, seed)
        with torch.no_grad():
            for i, inp in ((0, x), (2, fake[1](fake[0](x)))):  # each layer on its input in the fake model
                y_fake, y = fake[i](inp), m[i](inp)
                err = float((y.float() - y_fake.float()).abs().max() / y_fake.float().abs().max())
                assert err <= TOL[dtype], (name, seed, i, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["per_token", "per_tensor"])
def test_activation_fake_quant_matches_the_kernels_reference(dtype, granularity):
    """The activation side equals `fake_quantize_activation` (the reference numerics of the kernels)."""
    base = Int8DynamicActivationInt8WeightConfig(act_granularity=granularity)
    for b in (base, Int8DynamicActivationInt4WeightConfig(group_size=16)):
        m = _model(dtype)
        quantize_(m, QATConfig(b, step="prepare"))
        aq = b.weight_spec(m[0].weight, m[0]).act_quant
        for seed in range(5):
            torch.manual_seed(seed)
            x = torch.randn(4, 5, 32, dtype=dtype) * 3 + seed
            assert torch.equal(m[0].activation_fake_quantizer(x), fake_quantize_activation(x, aq))


def test_static_and_range_learned_weights_convert_to_the_codes_they_used():
    """LSQ / TQT weights (from a base config) store exactly the qparams and codes of the forward."""
    fp32_scales = Int8DynamicActivationInt4WeightConfig(group_size=16, scale_dtype=torch.float32)
    for learning, base in (("lsq", Int8DynamicActivationInt4WeightConfig(group_size=16)),
                           ("tqt", Int8DynamicActivationInt4WeightConfig(group_size=16)),
                           ("lsq", fp32_scales),  # fp32 scales show any ulp the forward's scale differs by
                           ("lsq", Int8WeightOnlyConfig())):
        torch.manual_seed(1)
        m = _model(torch.float32)
        x = torch.randn(4, 32)
        quantize_(m, QATConfig(base, step="prepare", range_learning=learning))
        initialize_fake_quantizers(m, x)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):  # move the learned qparams away from their initial values
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        with torch.no_grad():
            y_fake = m(x)
            fake_w = m[0].weight_fake_quantizer(m[0].weight)
        quantize_(m, QATConfig(base, step="convert"))
        assert torch.equal(m[0].weight.dequantize(), fake_w), (learning, base)
        # the model's output: the kernels sum the same codes in another order (int32 / fp32 partial sums)
        tol = 1e-5 if getattr(base, "scale_dtype", None) == torch.bfloat16 else 1e-4
        with torch.no_grad():
            assert float((m(x) - y_fake).abs().max()) <= tol * float(y_fake.abs().max()), (learning, base)


def test_learned_forward_equals_fake_quantize_affine_at_its_qparams():
    """The LSQ forward (STE formulation) computes the primitives' values, also for FLOAT zero points."""
    from affineq.primitives import fake_quantize_affine

    for base in (Int4WeightOnlyConfig(group_size=16), IntxWeightOnlyConfig(torch.uint3, PerGroup(16),
                                                                           MappingType.ASYMMETRIC)):
        m = _model(torch.float32)
        quantize_(m, QATConfig(base, step="prepare", range_learning="lsq"))
        initialize_fake_quantizers(m, torch.randn(2, 32))
        fq, w = m[0].weight_fake_quantizer, m[0].weight.detach()
        with torch.no_grad():
            fq.scale.mul_(1.07)  # not a min-max scale: some weights clip
        spec = fq.spec(w)
        scale, zp = fq.quantized_qparams(w)
        ref = fake_quantize_affine(w, spec.block_size, scale, zp, spec.target_dtype, spec.quant_min,
                                   spec.quant_max, spec.zero_point_domain)
        assert torch.equal(fq(w), ref)


def test_explicit_configs_convert_to_plain_weights_with_the_same_numerics():
    act = FakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    weight = FakeQuantizeConfig(torch.int4, group_size=16)
    m = _model(torch.float32)
    x = torch.randn(3, 32)
    quantize_(m, QATConfig(activation_config=act, weight_config=weight, step="prepare"))
    with torch.no_grad():
        y_fake = m(x)
    quantize_(m, QATConfig(activation_config=act, weight_config=weight, step="convert"))
    assert m[0].weight.spec.fmt == "plain" and m[0].weight.spec.act_quant.granularity == PerToken()
    with torch.no_grad():
        assert float((m(x) - y_fake).abs().max()) <= 1e-5 * float(y_fake.abs().max())


def test_static_per_tensor_activation_converts_to_calibrated_act_tensors():
    act = FakeQuantizeConfig(torch.int8, PerTensor(), is_symmetric=False, is_dynamic=False)
    weight = FakeQuantizeConfig(torch.int8, "per_channel")
    m = _model(torch.float32)
    x = torch.randn(8, 32)
    quantize_(m, QATConfig(activation_config=act, weight_config=weight, step="prepare"))
    with pytest.raises(RuntimeError, match="initialize_fake_quantizers"):
        m(x)
    initialize_fake_quantizers(m, x)
    with torch.no_grad():
        y_fake = m(x * 1.5)  # values past the calibrated range clip the same way in both
    quantize_(m, QATConfig(activation_config=act, weight_config=weight, step="convert"))
    assert m[0].weight.spec.act_quant.static and "act_scale" in m[0].weight.act_tensors
    with torch.no_grad():
        assert float((m(x * 1.5) - y_fake).abs().max()) <= 1e-5 * float(y_fake.abs().max())


def test_fqn_to_config_inside_qatconfig_and_embeddings():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 32)
            self.a = nn.Linear(32, 32)
            self.b = nn.Linear(32, 16)

        def forward(self, i):
            return self.b(self.a(self.emb(i)))

    net = Net()
    fqn = FqnToConfig({"emb": IntxWeightOnlyConfig(torch.int4, PerGroup(16)),
                       "a": Int8DynamicActivationInt4WeightConfig(group_size=16), "b": None})
    i = torch.randint(0, 40, (2, 7))
    quantize_(net, QATConfig(fqn, step="prepare"))
    assert isinstance(net.emb, FakeQuantizedEmbedding) and isinstance(net.a, FakeQuantizedLinear)
    assert type(net.b) is nn.Linear
    with torch.no_grad():
        y_fake = net(i)
        fake_table = net.emb.weight_fake_quantizer(net.emb.weight)
    quantize_(net, QATConfig(fqn, step="convert"))
    assert type(net.emb) is nn.Embedding and torch.equal(net.emb.weight.dequantize(), fake_table)
    with torch.no_grad():
        assert float((net(i) - y_fake).abs().max()) <= 1e-5 * float(y_fake.abs().max())


def test_conv2d_int8_weight_only_is_exact():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    filt = lambda mod, fqn: isinstance(mod, nn.Conv2d)  # noqa: E731
    quantize_(m, QATConfig(Int8WeightOnlyConfig(), step="prepare"), filter_fn=filt)
    with torch.no_grad():
        y_fake = m(x)
        fw = m[0].weight_fake_quantizer(m[0].weight)
    quantize_(m, QATConfig(Int8WeightOnlyConfig(), step="convert"), filter_fn=filt)
    assert torch.equal(m[0].weight.dequantize(), fw)
    with torch.no_grad():
        assert float((m(x) - y_fake).abs().max()) <= 1e-5 * float(y_fake.abs().max())


def test_unsupported_modules_and_bases_are_clear_errors():
    m = _model(torch.float32)
    with pytest.raises(QuantizationError, match="group_size"):
        quantize_(m, QATConfig(Int4WeightOnlyConfig(group_size=64), step="prepare"))
    assert type(m[0]) is nn.Linear  # all or nothing
    quantize_(m, QATConfig(Int4WeightOnlyConfig(group_size=16), step="prepare"))
    with pytest.raises(QuantizationError, match="already prepared"):
        quantize_(m, QATConfig(Int4WeightOnlyConfig(group_size=16), step="prepare"))


def test_convert_finds_every_prepared_module_and_refuses_another_base():
    net = nn.Sequential(nn.Embedding(40, 32), nn.Linear(32, 16))
    base = IntxWeightOnlyConfig(torch.int4, PerGroup(16))
    quantize_(net, QATConfig(base, step="prepare"), filter_fn=lambda m, fqn: isinstance(m, (nn.Linear, nn.Embedding)))
    with pytest.raises(QuantizationError, match="was prepared with"):
        quantize_(net, QATConfig(IntxWeightOnlyConfig(torch.int3, PerGroup(16)), step="convert"))
    assert isinstance(net[0], FakeQuantizedEmbedding)  # nothing converted
    quantize_(net, QATConfig(base, step="convert"))  # no filter_fn: the embedding is converted too
    assert type(net[0]) is nn.Embedding and type(net[1]) is nn.Linear
    assert net[0].weight.spec.target_dtype == torch.int4
