"""quantize_ and the configs: numerics per config and dtype, kernel pinning, filters, FqnToConfig, errors."""

import copy
import gc
import json
import warnings
import weakref

import pytest
import torch
from conftest import sqnr
from torch import nn

import affineq
from affineq import (
    AffineQuantizedTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    KernelFallbackWarning,
    PerAxis,
    PerGroup,
    QuantizationError,
    config_from_dict,
    cpp,
    quantize_,
    record_kernels,
)
from affineq.granularity import PerTensor
from affineq.tensor.kernel_registry import int_mm_is_fast as _int_mm_is_fast
from affineq.tensor.spec import QParamOptions

# (config, min weight SQNR dB, min output SQNR dB, kernel on CPU)
LOWBIT = "affineq.lowbit_linear"
CASES = {
    "int4_g128": (Int4WeightOnlyConfig(group_size=128), 20, 18, LOWBIT),
    "int4_g128_aten": (Int4WeightOnlyConfig(group_size=128, packing_format="int4_cpu"), 20, 18,
                       "aten._weight_int4pack_mm_for_cpu"),
    "int8": (Int8WeightOnlyConfig(), 35, 35, LOWBIT),
    "int8_aten": (Int8WeightOnlyConfig(packing_format="plain"), 35, 35, "aten._weight_int8pack_mm"),
    "int8_dyn": (Int8DynamicActivationInt8WeightConfig(), 35, 30, "aten._int_mm"),
    "int8_dyn_dense": (Int8DynamicActivationInt8WeightConfig(packing_format="dense"), 35, 30, LOWBIT),
    "8da4w": (Int8DynamicActivationInt4WeightConfig(group_size=32), 20, 18, LOWBIT),
    "int3_g32": (IntxWeightOnlyConfig(torch.int3, PerGroup(32)), 12, 10, LOWBIT),
    "uint2_axis": (IntxWeightOnlyConfig(torch.uint2, PerAxis(0), affineq.MappingType.ASYMMETRIC), 4, 3,
                   LOWBIT),
    "fp8_weight": (Float8WeightOnlyConfig(), 28, 26, LOWBIT),
    "fp8_e5m2_weight": (Float8WeightOnlyConfig(torch.float8_e5m2), 22, 20, LOWBIT),
    "fp8_dyn_row": (Float8DynamicActivationFloat8WeightConfig(), 28, 24, "aten._scaled_mm"),
    "fp8_dyn_tensor": (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), 25, 22,
                       "aten._scaled_mm"),
}


def make_mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(dtype)


# Without a C++ compiler "auto" picks the aten layouts for int4/int8 and keeps bit-packed `dense` storage
# (dequantize fallback, announced) for the other widths.
WITHOUT_CPP = {"int4_g128": "aten._weight_int4pack_mm_for_cpu", "int8": "aten._weight_int8pack_mm"}


def _expected_kernel(name, kernel, dtype=torch.float32):
    from affineq.tensor.compute_bound import min_rows
    from affineq.tensor.kernel_registry import int8_codes_preferred

    dense = name == "int8_dyn_dense" or (name == "int8_dyn" and cpp.is_available() and (
        not _int_mm_is_fast() or int8_codes_preferred((256, 256))))  # "auto": dense where faster here
    if dense and cpp.int8_codes_built():
        return "affineq.int8_codes_linear"  # exact int32 code products where the build has VNNI + VBMI
    if name == "8da4w" and cpp.int8_codes_built() and min_rows("affineq.int8_codes_linear:int4", dtype) is not None:
        return "affineq.int8_codes_linear"  # 4-bit weights too, where MIN_ROWS has a threshold for this CPU
    if dense:
        return LOWBIT
    if kernel == LOWBIT and not cpp.is_available():
        return WITHOUT_CPP.get(name, "dequantize:linear")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_config_numerics_kernel_and_size(name, dtype):
    config, w_db, out_db, kernel = CASES[name]
    model = make_mlp(dtype)
    x = torch.randn(8, 256, dtype=dtype)
    ref_w = model[0].weight.detach().clone()
    with torch.no_grad():
        ref = model(x)
        quantize_(model, config)
        w = model[0].weight
        assert isinstance(w, AffineQuantizedTensor) and isinstance(w, nn.Parameter)
        assert not w.requires_grad and w.dtype == dtype and w.shape == ref_w.shape
        assert sqnr(ref_w, w.dequantize()) > w_db
        with record_kernels() as used:
            out = model(x)
    assert out.dtype == dtype
    assert sqnr(ref, out) > out_db
    assert used == [_expected_kernel(name, kernel, dtype)] * 2


def test_int8_codes_kernel_equals_the_fake_quant_route():
    # dense int8 x dynamic int8 on fp32 input: affineq.int8_codes_linear (int32 code sums) computes what
    # affineq.lowbit_linear computes on the fake-quantized input (fp32 sums), per token and per tensor, with the
    # same input gradient; bf16 input runs it on x widened to fp32
    if not cpp.int8_codes_built():
        pytest.skip("the int8-codes kernel needs a C++ build with AVX512-VNNI and VBMI")
    from affineq.tensor.kernel_registry import LINEAR_KERNELS

    for gran in ("per_token", "per_tensor"):
        model = quantize_(make_mlp(), Int8DynamicActivationInt8WeightConfig(packing_format="dense",
                                                                            act_granularity=gran))
        x = torch.randn(37, 256)
        with torch.no_grad(), record_kernels() as used:
            out = model(x)
        assert used == ["affineq.int8_codes_linear"] * 2
        lowbit = next(k for k in LINEAR_KERNELS if k.name == LOWBIT)
        with torch.no_grad():
            h = torch.relu(lowbit.run(x, model[0].weight, model[0].bias))
            ref = lowbit.run(h, model[2].weight, model[2].bias)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        xg = x.clone().requires_grad_()
        with record_kernels() as used:
            model(xg).sum().backward()
        assert used == ["affineq.int8_codes_linear"] * 2
        w1, w2 = model[0].weight.dequantize(), model[2].weight.dequantize()  # grad_x = grad_y @ W per layer
        torch.testing.assert_close(xg.grad, ((torch.ones(37, 256) @ w2) * (h > 0)) @ w1)
        # bf16 x: the same kernel on x widened to fp32 (its codes and scale are computed in fp32 either way): the
        # fp32 model's output up to the bf16 roundings of each layer's output (which can move a hidden code)
        with torch.no_grad(), record_kernels() as used:
            out16 = model.bfloat16()(x.bfloat16())
        assert used == ["affineq.int8_codes_linear"] * 2 and out16.dtype == torch.bfloat16
        with torch.no_grad():
            ref16 = model.float()(x.bfloat16().float())
        torch.testing.assert_close(out16.float(), ref16, rtol=2**-7, atol=2**-6 * ref16.abs().max().item())


def test_bytes_per_parameter():
    # low-bit: codes + 2 x 2 B (bf16 scale, zero) per group, symmetric codes 2 B (a bf16 scale alone); int8/fp8
    # and fp32 options: codes + 2 x 4 B
    for config, expected in [(Int4WeightOnlyConfig(group_size=128), 0.53125), (Int8WeightOnlyConfig(), 1 + 8 / 4096),
                             (Int4WeightOnlyConfig(group_size=64), 0.5625),
                             (Int4WeightOnlyConfig(group_size=64, scale_dtype=torch.float32), 0.625),
                             (Int4WeightOnlyConfig(group_size=128, packing_format="int4_cpu"), 0.53125),
                             (IntxWeightOnlyConfig(torch.int2, PerGroup(64)), 0.25 + 2 / 64),
                             (IntxWeightOnlyConfig(torch.int2, PerGroup(32)), 0.25 + 2 / 32),
                             (IntxWeightOnlyConfig(torch.int3, PerGroup(32)), 0.375 + 2 / 32),
                             (IntxWeightOnlyConfig(torch.int2, PerGroup(64), scale_dtype=torch.float32), 0.25 + 8 / 64),
                             (Int8DynamicActivationInt4WeightConfig(group_size=32), 0.5 + 2 / 32),
                             (Float8WeightOnlyConfig(), 1 + 8 / 4096)]:
        m = nn.Sequential(nn.Linear(4096, 1024, bias=False))
        quantize_(m, config)
        if m[0].weight.packing_format in ("dense", "int4_cpu"):
            assert m[0].weight.storage_bytes() / m[0].weight.numel() == expected, config


def test_gaussian_weight_sqnr_thresholds_of_the_issue():
    w = torch.randn(1024, 4096)
    m = nn.Sequential(nn.Linear(4096, 1024, bias=False))
    m[0].weight.data.copy_(w)
    m8 = quantize_(copy.deepcopy(m), Int8WeightOnlyConfig())
    m4 = quantize_(copy.deepcopy(m), Int4WeightOnlyConfig(group_size=128))
    assert sqnr(w, m8[0].weight.dequantize()) > 35
    assert sqnr(w, m4[0].weight.dequantize()) > 20


def test_fallback_for_fp8_weight_only_is_announced():
    model = quantize_(make_mlp(), Float8WeightOnlyConfig(packing_format="plain"))
    with pytest.warns(KernelFallbackWarning, match="dequantize-then-linear"):
        model(torch.randn(2, 256))


def test_autograd_flows_to_inputs_through_packed_kernels():
    model = quantize_(make_mlp(), Int4WeightOnlyConfig(group_size=128, packing_format="int4_cpu"))
    x = torch.randn(4, 256, requires_grad=True)
    with record_kernels() as used:
        model(x).sum().backward()
    assert used == ["aten._weight_int4pack_mm_for_cpu"] * 2
    xr = x.detach().clone().requires_grad_()
    dq = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    dq[0].weight = nn.Parameter(model[0].weight.dequantize())
    dq[2].weight = nn.Parameter(model[2].weight.dequantize())
    dq[0].bias, dq[2].bias = model[0].bias, model[2].bias
    dq(xr).sum().backward()
    assert sqnr(xr.grad, x.grad) > 40


# -- quantize_ behaviour --------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(576, 576)
        self.up = nn.Linear(576, 1536)
        self.down = nn.Linear(1536, 576)
        self.odd = nn.Linear(100, 576)
        self.norm = nn.LayerNorm(576)
        self.emb = nn.Embedding(50, 576)


def test_default_filter_quantizes_every_linear_only():
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Embedding(10, 64), nn.Linear(64, 32))
    quantize_(m, Int8WeightOnlyConfig())
    assert [type(p).__name__ for p in (m[0].weight, m[1].weight, m[2].weight, m[3].weight)] == [
        "AffineQuantizedTensor", "Parameter", "Parameter", "AffineQuantizedTensor"]


def test_group_size_that_does_not_divide_lists_every_layer_and_changes_nothing():
    m = Block()
    before = {n: p for n, p in m.named_parameters()}
    with pytest.raises(QuantizationError) as err:
        quantize_(m, Int4WeightOnlyConfig(group_size=128))
    msg = str(err.value)
    for layer in ("q_proj", "up", "odd"):
        assert f"  - {layer}:" in msg
    assert "  - down:" not in msg  # 1536 = 12 * 128 divides
    assert "576" in msg and "filter_fn" in msg and "group_size" in msg
    assert all(p is before[n] for n, p in m.named_parameters())  # nothing was quantized


def test_filter_fn_and_fqn_to_config():
    m = Block()
    quantize_(m, Int4WeightOnlyConfig(group_size=64), filter_fn=lambda mod, fqn: fqn in ("q_proj", "up"))
    assert isinstance(m.q_proj.weight, AffineQuantizedTensor) and not isinstance(m.down.weight,
                                                                                    AffineQuantizedTensor)
    m = Block()
    cfg = FqnToConfig({"re:(up|down)": Int4WeightOnlyConfig(group_size=64), "odd": None,
                       "emb": IntxWeightOnlyConfig(torch.int4, PerGroup(64)), "_default": Int8WeightOnlyConfig()})
    quantize_(m, cfg)
    assert m.up.weight.target_dtype == torch.uint4 and m.down.weight.target_dtype == torch.uint4
    assert m.q_proj.weight.target_dtype == torch.int8
    assert not isinstance(m.odd.weight, AffineQuantizedTensor)
    assert m.emb.weight.target_dtype == torch.int4  # named exactly: quantized although not a Linear
    assert not isinstance(m.norm.weight, AffineQuantizedTensor)
    with pytest.raises(QuantizationError, match="does not have.*'lm_head'"):
        quantize_(Block(), FqnToConfig({"lm_head": None}))
    with pytest.raises(ValueError, match="not a valid regex"):
        FqnToConfig({"re:(": Int8WeightOnlyConfig()})


def test_module_left_untouched_when_its_quantization_fails():
    class Exploding(Int8WeightOnlyConfig):
        def quantize_weight(self, weight, module):
            if weight.shape[0] == 32:
                raise RuntimeError("boom")
            return super().quantize_weight(weight, module)

    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    original = m[1].weight
    with pytest.raises(QuantizationError, match="'1'.*left unchanged.*boom"):
        quantize_(m, Exploding())
    assert m[1].weight is original


def test_no_global_state_change_and_no_float_copy_kept():
    m = make_mlp()
    ref = weakref.ref(m[0].weight)
    precision, default_dtype, grad = (torch.get_float32_matmul_precision(), torch.get_default_dtype(),
                                      torch.is_grad_enabled())
    quantize_(m, Int4WeightOnlyConfig(group_size=128))
    gc.collect()
    assert ref() is None
    assert (torch.get_float32_matmul_precision(), torch.get_default_dtype(), torch.is_grad_enabled()) == (
        precision, default_dtype, grad)


def test_tied_weights_stay_tied():
    m = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    m[1].weight = m[0].weight
    quantize_(m, Int8WeightOnlyConfig())
    assert m[0].weight is m[1].weight


@pytest.mark.parametrize("vocab", [100, 128])  # 128: whole 16-row panels of the dense layout
@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(group_size=32), Int8WeightOnlyConfig()],
                         ids=["int4", "int8"])
def test_tied_embedding_and_head_share_the_quantized_weight(config, vocab):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, 64)
            self.head = nn.Linear(64, vocab, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    lm = LM()
    ids = torch.tensor([[3, 97, 50, 3]])
    quantize_(lm, config)
    assert lm.embed.weight is lm.head.weight and isinstance(lm.embed.weight, AffineQuantizedTensor)
    deq = lm.head.weight.dequantize()
    torch.testing.assert_close(lm.embed(ids), deq[ids], rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), deq[ids] @ deq.t(), rtol=1e-4, atol=1e-4)


def test_custom_config_plugs_in_through_the_registry():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class HalfConfig(affineq.QuantConfig):
        pass

    calls = []

    @affineq.register_quantize_module_handler(HalfConfig)
    def _half(module, config):
        calls.append(module)
        module.weight.data = module.weight.data.half().float()
        return module

    m = nn.Sequential(nn.Linear(8, 8))
    HalfConfig.check = lambda self, module: None
    quantize_(m, HalfConfig())
    assert calls == [m[0]]


def test_device_argument_moves_modules():
    m = quantize_(make_mlp(), Int8WeightOnlyConfig(), device="cpu")
    assert m[0].weight.device.type == "cpu"


# -- configs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_config_json_round_trip(name):
    config = CASES[name][0]
    assert config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert type(config).from_dict(config.to_dict()) == config


def test_fqn_to_config_json_round_trip():
    cfg = FqnToConfig({"re:layers\\.[0-3]\\..*": Int4WeightOnlyConfig(), "lm_head": None,
                       "_default": Int8WeightOnlyConfig()})
    back = FqnToConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back.fqn_to_config == cfg.fqn_to_config


@pytest.mark.parametrize(("make", "words"), [
    (lambda: Int4WeightOnlyConfig(group_size=0), "group_size must be a positive int"),
    (lambda: Int4WeightOnlyConfig(packing_format="int4_cpu", group_size=16), "group_size 32, 64, 128 or 256"),
    (lambda: Int4WeightOnlyConfig(packing_format="magic"), "packing_format='magic'"),
    (lambda: Int8DynamicActivationInt8WeightConfig(packing_format="int4_cpu"), "packing_format='int4_cpu'"),
    (lambda: IntxWeightOnlyConfig(torch.int16), "weight_dtype=torch.int16"),
    (lambda: IntxWeightOnlyConfig(torch.float32), "weight_dtype"),
    (lambda: IntxWeightOnlyConfig(torch.int4, PerTensor()), "granularity=PerTensor"),
    (lambda: Float8WeightOnlyConfig(torch.int8), "weight_dtype=torch.int8"),
    (lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerGroup(32)), "granularity"),
])
def test_config_validation(make, words):
    with pytest.raises(ValueError, match=words.replace("(", "\\(").replace(")", "\\)")):
        make()


def test_group_size_on_a_1d_or_conv_weight_is_explained():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3))
    with pytest.raises(QuantizationError, match="group_size applies to 2-D weights.*group_size=None"):
        quantize_(conv, Int8WeightOnlyConfig(group_size=32), filter_fn=lambda m, n: isinstance(m, nn.Conv2d))
    quantize_(conv, Int8WeightOnlyConfig(), filter_fn=lambda m, n: isinstance(m, nn.Conv2d))
    assert conv[0].weight.block_size == (1, 3, 3, 3)


def test_unsupported_module_type_is_reported():
    m = nn.Sequential(nn.LayerNorm(8))
    with pytest.raises(QuantizationError, match="quantizes Linear modules, not LayerNorm"):
        quantize_(m, Int4WeightOnlyConfig(), filter_fn=lambda mod, fqn: fqn == "0")


def test_without_the_cpp_kernels_auto_picks_aten_layouts_and_dense_falls_back_once():
    import warnings

    x = torch.randn(4, 256)
    with cpp._set_disabled(True):
        assert not cpp.is_available() and "disabled" in cpp.unavailable_reason()
        m4 = quantize_(make_mlp(), Int4WeightOnlyConfig(group_size=128))
        m8 = quantize_(make_mlp(), Int8WeightOnlyConfig())
        m3 = quantize_(make_mlp(), IntxWeightOnlyConfig(torch.int3, PerGroup(32)))
        assert (m4[0].weight.packing_format, m8[0].weight.packing_format) == ("int4_cpu", "plain")
        assert m3[0].weight.packing_format == "dense"  # bit-packed storage does not need the compiler
        with torch.no_grad():
            with pytest.warns(KernelFallbackWarning, match=r"slower.*C\+\+ kernels are unavailable \(disabled"):
                fallback = m3(x)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                m3(x)  # said once only
    with torch.no_grad(), record_kernels() as used:
        fast = m3(x)
    assert used == [_expected_kernel("int3_g32", LOWBIT)] * 2
    torch.testing.assert_close(fast, fallback, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a GPU")
@pytest.mark.parametrize(("config", "kernel"), [
    (Int4WeightOnlyConfig(group_size=128), "aten._weight_int4pack_mm"),
    (Int8DynamicActivationInt8WeightConfig(), "aten._int_mm"),
    (Float8DynamicActivationFloat8WeightConfig(), "aten._scaled_mm"),
])
def test_cuda_kernels(config, kernel):
    model = make_mlp(torch.bfloat16).cuda()
    x = torch.randn(32, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref = model(x)
        quantize_(model, config)
        with record_kernels() as used:
            out = model(x)
    assert used == [kernel] * 2
    assert sqnr(ref, out) > 18


def test_int8_dynamic_dense_matches_int_mm(monkeypatch):
    # Same int8 weights and activation codes: _int_mm sums exact int32 products, as does the C++ int8-codes
    # kernel where built (else lowbit_linear: fp32 products of the fake-quantized activation and the
    # dequantized weight); "auto" takes dense where _int_mm is slow.
    if not cpp.is_available():
        pytest.skip(f"C++ kernels unavailable: {cpp.unavailable_reason()}")
    from affineq.tensor import kernel_registry

    model = make_mlp()
    x = torch.randn(33, 256)
    plain = quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig(packing_format="plain"))
    monkeypatch.setattr(kernel_registry, "int_mm_is_fast", lambda: False)
    auto = quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig())
    assert auto[0].weight.packing_format == "dense"
    assert torch.equal(auto[0].weight.codes(), plain[0].weight.codes())
    with torch.no_grad(), record_kernels() as used:
        y_dense = auto(x)
    y_plain = plain(x)
    assert used == ["affineq.int8_codes_linear" if cpp.int8_codes_built() else LOWBIT] * 2
    torch.testing.assert_close(y_dense, y_plain, rtol=1e-5, atol=1e-5 * y_plain.abs().max().item())
    monkeypatch.setattr(kernel_registry, "int_mm_is_fast", lambda: True)
    fmt = quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig())[0].weight.packing_format
    assert fmt == ("dense" if kernel_registry.int8_codes_preferred((256, 256)) else "plain")
    monkeypatch.setattr(kernel_registry, "int8_codes_preferred", lambda shape: False)
    assert quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig())[0].weight.packing_format == "plain"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("domain", [affineq.ZeroPointDomain.NONE, affineq.ZeroPointDomain.INT])
def test_int8_fake_quant_shortcuts_are_the_primitives(dtype, domain):
    # fake_quantize_activation takes few-op routes for int8 (symmetric; asymmetric with an integer zero point):
    # bit for bit the primitives' result
    from affineq.primitives import dequantize_affine
    from affineq.tensor.activation import fake_quantize_activation, quantize_activation

    torch.manual_seed(0)
    mappings = [affineq.MappingType.SYMMETRIC, affineq.MappingType.SYMMETRIC_NO_CLIPPING_ERR]
    if domain is affineq.ZeroPointDomain.INT:
        mappings.append(affineq.MappingType.ASYMMETRIC)
    for mapping in mappings:
        for granularity in ("per_token", "per_tensor"):
            aq = affineq.ActivationQuant(torch.int8, mapping, granularity, domain)
            for x in (torch.randn(7, 96) * 3, torch.randn(7, 96) + 5, -torch.rand(3, 64) - 1, torch.zeros(2, 96),
                      torch.full((2, 8), 2.5), torch.randn(3, 1, 500) * 1e-3):
                x = x.to(dtype)
                x2 = x.reshape(-1, x.shape[-1])
                q, scale, zp, block = quantize_activation(x2, aq)
                ref = dequantize_affine(q, block, scale, zp, torch.int8, zero_point_domain=domain, output_dtype=dtype)
                assert torch.equal(fake_quantize_activation(x, aq), ref.view(x.shape)), (mapping, granularity)


@pytest.mark.parametrize("mapping", [affineq.MappingType.SYMMETRIC, affineq.MappingType.SYMMETRIC_NO_CLIPPING_ERR])
@pytest.mark.parametrize("granularity", ["per_token", "per_tensor"])
def test_int8_dynamic_kernel_matches_the_primitives(mapping, granularity):
    # the opaque int8 x int8 op quantizes x with its own few ops: its codes must be those of the primitives
    from affineq import ActivationQuant
    from affineq.primitives import choose_qparams_affine, quantize_affine

    torch.manual_seed(0)
    w = torch.randn(48, 64)
    aq = ActivationQuant(torch.int8, mapping, granularity, affineq.ZeroPointDomain.NONE)
    qw = AffineQuantizedTensor.from_spec(w, (1, 64), QParamOptions(scale_dtype=torch.float32), target=torch.int8,
                                         mapping_type=affineq.MappingType.SYMMETRIC,
                                         zero_point_domain=affineq.ZeroPointDomain.NONE, act_quant=aq)
    for x in (torch.randn(5, 64) * 3, torch.randn(1, 64), torch.zeros(2, 64)):
        block = (1, 64) if granularity == "per_token" else tuple(x.shape)
        sx, _ = choose_qparams_affine(x, mapping, block, torch.int8, scale_dtype=torch.float32,
                                      zero_point_domain=affineq.ZeroPointDomain.NONE)
        xq = quantize_affine(x, block, sx, None, torch.int8, zero_point_domain=affineq.ZeroPointDomain.NONE)
        acc = xq.long() @ qw.codes().long().T
        expected = acc.double() * sx.double().reshape(-1, 1) * qw.scale.double().reshape(1, -1)
        with record_kernels() as used:
            out = torch.nn.functional.linear(x, qw)
        assert used == ["aten._int_mm"]
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_selecting_nothing_warns_and_changes_nothing():
    """A config or filter that selects no module used to return silently (quantize_checkpoint raises there)."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    before = {n: p for n, p in m.named_parameters()}
    with pytest.warns(UserWarning, match=r"Int8WeightOnlyConfig selected no module of Sequential, so nothing was "
                                         r"quantized.*pass filter_fn"):
        quantize_(m, Int8WeightOnlyConfig())
    assert all(p is before[n] for n, p in m.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a call that selects something says nothing
        quantize_(nn.Sequential(nn.Linear(64, 64)), Int8WeightOnlyConfig())
