"""MX9 / MX6 / MX4 (shared microexponents): hand-computed blocks, exact storage, bits per element, SQNR, the
`microexp` packing format through AffineQuantizedTensor, save/load and torch.compile."""

import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr
from hypothesis import given, settings
from hypothesis import strategies as st

from affineq import AffineQuantizedTensor, KernelFallbackWarning, MappingType, ZeroPointDomain
from affineq.microexp import dequantize_microexp, microexp_tensor, quantize_microexp
from affineq.safetensors import load_file, save_file
from affineq.tensor.spec import QuantSpec

AQT = AffineQuantizedTensor


def _block(*head: float) -> torch.Tensor:
    """One 16-value block [1, 16]: `head` then zeros."""
    x = torch.zeros(1, 16)
    x[0, : len(head)] = torch.tensor(head)
    return x


def test_mx6_hand_computed_block_exponents_and_codes():
    # floor(log2): 1.0 -> 0, 0.75 -> -1, 0.3 -> -2, 0.2 -> -3, 0.5 -> -1; E = 0 (byte 127)
    c = quantize_microexp(_block(1.0, 0.75, 0.3, 0.2, 0.5, -0.4), "mx6")
    assert c.shared_exp.tolist() == [[127]]
    # pair 0: e_sub = 0 -> t = 0, scale 2**(0 - 0 - 3) = 1/8: 8, 6
    # pair 1: e_sub = -2 -> t = min(2, 1) = 1, scale 1/16: 0.3 * 16 = 4.8 -> 5, 0.2 * 16 = 3.2 -> 3
    # pair 2: e_sub = -1 -> t = 1, scale 1/16: 8, -0.4 * 16 = -6.4 -> -6; zero pairs: t = 1, codes 0
    assert c.micro_exp.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1]]
    assert c.codes[0, :6].tolist() == [8, 6, 5, 3, 8, -6] and not c.codes[0, 6:].any()
    assert dequantize_microexp(c, "mx6")[0, :6].tolist() == [1.0, 0.75, 5 / 16, 3 / 16, 0.5, -6 / 16]


def test_mx9_hand_computed_block():
    # E = floor(log2 3) = 1; pair (3, -1): t = 0, scale 2**(1 - 6) = 1/32 -> 96, -32;
    # pair (0.7, 0.01): e_sub = -1, t = 1, scale 1/64 -> 44.8 -> 45, 0.64 -> 1
    c = quantize_microexp(_block(3.0, -1.0, 0.7, 0.01), "mx9")
    assert c.shared_exp.tolist() == [[128]]
    assert c.micro_exp[0, :2].tolist() == [0, 1]
    assert c.codes[0, :4].tolist() == [96, -32, 45, 1]


def test_clamping_at_max_magnitude_and_ties_to_even():
    # E = 0, t = 0, scale 1/8 (mx6): 1.99 * 8 = 15.92 -> 16 -> clamped to 15
    c = quantize_microexp(_block(1.99, -1.97, 1.0, 0.3125, 1.0, 0.4375, 1.0, -0.3125), "mx6")
    assert c.micro_exp[0, :4].tolist() == [0, 0, 0, 0]
    # 0.3125 * 8 = 2.5 -> 2 (even), 0.4375 * 8 = 3.5 -> 4 (even), -2.5 -> -2
    assert c.codes[0, :8].tolist() == [15, -15, 8, 2, 8, 4, 8, -2]
    # mx9 clamps at 127: 1.999 * 64 = 127.9 -> 128 -> 127
    assert quantize_microexp(_block(1.999), "mx9").codes[0, 0].item() == 127


def test_zero_block_and_tiny_block_use_the_lowest_exponent():
    for fmt, m in (("mx9", 7), ("mx6", 4)):
        c = quantize_microexp(torch.zeros(2, 32), fmt)
        assert (c.shared_exp == m).all() and (c.micro_exp == 1).all() and not c.codes.any()
        # E_min = m - 127: the smallest pair scale is exactly 2**-127 (an e8m0 value)
        tiny = quantize_microexp(_block(2.0**-130, 2.0**-125), fmt)
        assert tiny.shared_exp.item() == m
        assert dequantize_microexp(tiny, fmt)[0, 1].item() == 2.0**-125


def test_microexponent_is_zero_when_the_pair_holds_the_block_max():
    x = torch.randn(64, 256)
    c = quantize_microexp(x, "mx9")
    e = torch.frexp(x.abs())[1] - 1
    block_max = e.view(64, -1, 16).amax(-1)
    pair_max = e.view(64, -1, 2).amax(-1)
    assert torch.equal(c.shared_exp.int() - 127, block_max)
    assert torch.equal(c.micro_exp.int(), (block_max.repeat_interleave(8, -1) - pair_max).clamp(max=1))
    assert (c.micro_exp.view(64, -1, 8) == 0).any(-1).all()  # each block has a pair with t = 0


def test_axis_and_bad_input():
    x = torch.randn(48, 32)
    a = quantize_microexp(x, "mx6", axis=0)
    b = quantize_microexp(x.t().contiguous(), "mx6")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.shared_exp, b.shared_exp)
    assert torch.equal(dequantize_microexp(a, "mx6", axis=0), dequantize_microexp(b, "mx6").t())
    with pytest.raises(ValueError, match="not divisible by 16"):
        quantize_microexp(torch.randn(4, 24), "mx9")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_microexp(_block(float("nan")), "mx9")
    with pytest.raises(ValueError, match="use one of"):
        quantize_microexp(x, "mx7")


@pytest.mark.parametrize("fmt,bits", [("mx9", 9.0), ("mx6", 6.0), ("mx4", 4.0)])
def test_tensor_is_bit_exact_and_bits_per_element(fmt, bits):
    w = torch.randn(32, 128)
    c = quantize_microexp(w, fmt)
    q = microexp_tensor(w, fmt)
    assert q.packing_format == "microexp" and q.spec.scale_type.name == "e8m0"
    assert q.storage_bytes() * 8 / w.numel() == bits
    assert torch.equal(q.codes(), c.codes)
    assert torch.equal(q.dequantize(), dequantize_microexp(c, fmt))
    assert torch.equal(q.tensors["shared_exp"], c.shared_exp)
    # the same tensor in `plain` (int8 codes, e8m0 scale bytes per pair) dequantizes identically
    assert torch.equal(q.to_format("plain").dequantize(), q.dequantize())
    back = AQT.from_tensors(q.tensors, QuantSpec.from_dict(q.spec.to_dict()))
    assert torch.equal(back.dequantize(), q.dequantize())
    # from_spec (min-max pair scales rounded to the shared-microexponent form) gives the same tensor
    assert torch.equal(AQT.from_spec(w, q.spec).dequantize(), q.dequantize())


def test_sqnr_ordering_on_gaussian_data():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    s = {f: sqnr(w, microexp_tensor(w, f).dequantize()) for f in ("mx9", "mx6", "mx4")}
    # measured: mx9 46.2, mx6 28.1, mx4 15.5 dB (about 6 dB per magnitude bit)
    assert 45.0 < s["mx9"] < 47.5 and 27.0 < s["mx6"] < 29.5 and 14.5 < s["mx4"] < 16.5


def test_format_refuses_other_specs_and_scales():
    w = torch.randn(8, 32)
    base = dict(mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE,
                packing_format="microexp", scale_type="e8m0")
    bad = [((1, 2), "int4", dict(quant_min=-7, quant_max=7), "MX9/MX6/MX4 codes"),
           ((1, 2), "int8", {}, "MX9/MX6/MX4 codes"),  # [-128, 127] is not MX9's range
           ((1, 4), "int8", dict(quant_min=-127, quant_max=127), "block_size"),
           ((1, 2), "int5", dict(quant_min=-15, quant_max=15, scale_type=None), "scale_type")]
    for block, target, extra, msg in bad:
        spec = QuantSpec.create((8, 32), torch.float32, target, block, **{**base, **extra})
        with pytest.raises(ValueError, match=msg):
            AQT.from_spec(w, spec)
    spec = QuantSpec.create((8, 24), torch.float32, "int8", (1, 2), quant_min=-127, quant_max=127, **base)
    with pytest.raises(ValueError, match="K divisible by 16"):
        AQT.from_spec(torch.randn(8, 24), spec)
    good = microexp_tensor(w, "mx9").spec
    codes = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="not of that form"):  # not powers of two
        AQT.from_codes(codes, torch.full((8, 16), 0.3), None, good)
    spread = torch.ones(8, 16)
    spread[:, 1] = 0.25  # two binades below its block's top pair: t would be 2
    with pytest.raises(ValueError, match="not of that form"):
        AQT.from_codes(codes, spread, None, good)


def test_save_load_weights_only_and_compiled_linear(tmp_path):
    torch._dynamo.reset()
    w = torch.randn(32, 64)
    q = microexp_tensor(w, "mx6")
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["w"]
    assert isinstance(back, AQT) and torch.equal(back.dequantize(), q.dequantize())
    path = tmp_path / "w.safetensors"
    save_file({"w": q}, path)
    assert torch.equal(load_file(path)["w"].dequantize(), q.dequantize())
    x = torch.randn(3, 64)
    ref = x @ q.dequantize().t()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)  # announced: no kernel reads microexp
        eager = F.linear(x, back)
        compiled = torch.compile(lambda a, b: F.linear(a, b), fullgraph=True, dynamic=False)(x, back)
    torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, ref, rtol=1e-5, atol=1e-5)


def test_linear_fallback_is_announced():
    q = microexp_tensor(torch.randn(16, 32), "mx9")
    with pytest.warns(KernelFallbackWarning, match="microexp"):
        F.linear(torch.randn(2, 32), q)


@pytest.mark.parametrize("fmt", ["mx9", "mx6"])
def test_config_through_quantize_eager_compiled_and_weights_only_load(fmt):
    from torch import nn

    from affineq import MicroexpWeightOnlyConfig, config_from_dict, quantize_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    w0 = model[0].weight.detach().clone()
    x = torch.randn(5, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        quantize_(model, MicroexpWeightOnlyConfig(fmt))
        qw = model[0].weight
        expect = microexp_tensor(w0, fmt)
        assert qw.spec == expect.spec and torch.equal(qw.dequantize(), expect.dequantize())
        assert qw.storage_bytes() * 8 / qw.numel() == {"mx9": 9.0, "mx6": 6.0}[fmt]
        with torch.no_grad():
            y = model(x)
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="aot_eager")(x), y)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        fresh = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
        fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
        fresh.requires_grad_(False)
        assert torch.equal(fresh(x), y)
    assert config_from_dict(MicroexpWeightOnlyConfig(fmt).to_dict()) == MicroexpWeightOnlyConfig(fmt)
    with pytest.raises(ValueError, match="fmt="):
        MicroexpWeightOnlyConfig("mx5")


def _edge_weight() -> torch.Tensor:
    """[32, 64]: gaussian rows, plus blocks that are all zero, at the lowest shared exponent, saturating, and with
    one pair a binade below the block's largest (micro-exponent 1 beside 0)."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    w[0, :16] = 0.0
    w[1, :16] = 1e-38
    w[2, :16] = 1e30
    w[3, :16] = torch.tensor([8.0, -7.5, 0.3, 0.26] + [0.0] * 12)
    return w


@pytest.mark.parametrize("fmt,bits", [("mx6", 6.5), ("mx4", 4.5)])
def test_dense_packing_holds_the_same_values_and_runs_the_kernel(fmt, bits):
    """packing_format="dense": codes sign q 2**(1 - t) with one e8m0 scale 2**(E - m) per 16 hold exactly the
    format's values; linear runs affineq.lowbit_linear (no fallback), eager == compiled, and the weight survives a
    weights-only save / load."""
    from torch import nn

    from affineq import MicroexpWeightOnlyConfig, config_from_dict, cpp, quantize_, record_kernels

    w = _edge_weight()
    ref = dequantize_microexp(quantize_microexp(w, fmt), fmt)
    q = microexp_tensor(w, fmt, "dense")
    assert torch.equal(q.dequantize(), ref)
    assert q.storage_bytes() * 8 / q.numel() == bits
    model = nn.Linear(64, 32)
    with torch.no_grad():
        model.weight.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(4)))
    expect = dequantize_microexp(quantize_microexp(model.weight.detach(), fmt), fmt)
    cfg = MicroexpWeightOnlyConfig(fmt, packing_format="dense")
    quantize_(model, cfg)
    assert torch.equal(model.weight.dequantize(), expect)
    x = torch.randn(5, 64)
    with warnings.catch_warnings(), torch.no_grad(), record_kernels() as used:
        warnings.simplefilter("error", KernelFallbackWarning)
        y = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(x)
    assert used[0] == ("affineq.lowbit_linear" if cpp.is_available() else "dequantize")
    torch.testing.assert_close(y, F.linear(x, expect, model.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, y, rtol=1e-5, atol=1e-5)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = nn.Linear(64, 32)
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    assert torch.equal(fresh.weight.dequantize(), expect)
    assert config_from_dict(cfg.to_dict()) == cfg


def test_dense_packing_refuses_mx9_and_unknown_formats():
    from affineq import MicroexpWeightOnlyConfig

    with pytest.raises(ValueError, match="packing_format='dense' holds mx6 / mx4 only: mx9's codes .* need 9 bits.*"
                                         "use packing_format='microexp'"):
        MicroexpWeightOnlyConfig("mx9", packing_format="dense")
    with pytest.raises(ValueError, match="packing_format='dense' holds mx6 / mx4 only"):
        microexp_tensor(torch.randn(16, 32), "mx9", "dense")
    with pytest.raises(ValueError, match="packing_format"):
        MicroexpWeightOnlyConfig("mx4", packing_format="plain")


@settings(max_examples=150, deadline=None)
@given(block=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32).filter(lambda v: v == 0 or abs(v) > 1e-30),
                      min_size=16, max_size=16),
       fmt=st.sampled_from(["mx9", "mx6", "mx4"]))
def test_shared_exponent_and_per_element_rounding_properties(block, fmt):
    """E is the block's largest exponent; each pair's micro-exponent is 1 exactly when the pair is a binade below
    E; every element is its value rounded to the pair's step, clamped at 2**m - 1 steps; mx6 / mx4's `dense`
    packing dequantizes to the same values."""
    from affineq.microexp import MICROEXP_FORMATS, pair_scales

    f = MICROEXP_FORMATS[fmt]
    x = torch.tensor([block], dtype=torch.float32)
    c = quantize_microexp(x, fmt)
    if fmt != "mx9":  # the `dense` packing holds the same values
        assert torch.equal(microexp_tensor(x, fmt, "dense").dequantize(), dequantize_microexp(c, fmt))
    nonzero = [abs(v) for v in block if v != 0]
    if not nonzero:
        assert int(c.codes.abs().max()) == 0
        return
    big_e = max(math.frexp(v)[1] - 1 for v in nonzero)
    assert int(c.shared_exp[0, 0]) - 127 == big_e
    for j in range(8):
        pair = [abs(v) for v in block[2 * j: 2 * j + 2] if v != 0]
        e_sub = max((math.frexp(v)[1] - 1 for v in pair), default=None)
        assert int(c.micro_exp[0, j]) == (1 if e_sub is None or e_sub < big_e else 0)
    step = pair_scales(c.shared_exp.to(torch.int32) - 127, c.micro_exp.to(torch.int32), f).repeat_interleave(2, -1)
    q = (x.double().abs() / step.double()).round()  # round half even on exact doubles
    assert torch.equal(c.codes.abs().double(), q.clamp(max=f.qmax))
    assert torch.equal(torch.sign(c.codes.double()), torch.sign(x.double()) * (q.clamp(max=f.qmax) > 0))
