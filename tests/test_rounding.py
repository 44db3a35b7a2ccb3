"""Rounding modes of integer codes (half_even, half_away_from_zero, floor): primitives, configs, Quark."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import affineq
from affineq import IntxWeightOnlyConfig, PerGroup, ZeroPointDomain
from affineq.primitives import fake_quantize_affine, quantize_affine
from affineq.quark import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationSpec, RoundType

TIES = torch.tensor([[-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.7, -2.7, -0.2, 0.2]])


@pytest.mark.parametrize("rounding, want", [
    ("half_even", [-2, -2, 0, 0, 2, 2, 3, -3, 0, 0]),
    ("half_away_from_zero", [-3, -2, -1, 1, 2, 3, 3, -3, 0, 0]),
    ("floor", [-3, -2, -1, 0, 1, 2, 2, -3, -1, 0]),
])
def test_ties_and_negatives(rounding, want):
    q = quantize_affine(TIES, TIES.shape, torch.tensor([1.0]), None, torch.int8,
                        zero_point_domain=ZeroPointDomain.NONE, rounding=rounding)
    assert q.tolist() == [want]


@pytest.mark.parametrize("rounding, want", [
    ("half_even", [5, 7, 6, 7]),
    ("half_away_from_zero", [6, 7, 6, 8]),
    ("floor", [5, 6, 6, 7]),
])
def test_int_domain_rounds_before_the_zero_point(rounding, want):
    # x/s = 0.5, 1.5, 1.2, 2.5 with an integer zero point 5: the mode applies to x/s, then +zp
    x = torch.tensor([[0.5, 1.5, 1.2, 2.5]])
    q = quantize_affine(x, x.shape, torch.tensor([1.0]), torch.tensor([5]), torch.uint8, rounding=rounding)
    assert q.tolist() == [want]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=32),
       st.floats(0.01, 10))
def test_rounding_modes_bracket_the_exact_value(values, scale):
    x = torch.tensor([values], dtype=torch.float32)
    s = torch.tensor([scale], dtype=torch.float32)
    exact = (x * (1.0 / s)).clamp(-128, 127)
    codes = {r: quantize_affine(x, x.shape, s, None, torch.int8, zero_point_domain=ZeroPointDomain.NONE,
                                rounding=r).float() for r in ("half_even", "half_away_from_zero", "floor")}
    assert bool((codes["floor"] <= exact + 1e-6).all()) and bool((exact - codes["floor"] < 1 + 1e-4).all())
    for r in ("half_even", "half_away_from_zero"):
        assert bool(((codes[r] - exact).abs() <= 0.5 + 1e-4).all())
    # the two nearest modes differ only on exact ties, and then by one code
    diff = (codes["half_even"] - codes["half_away_from_zero"]).abs()
    assert bool((diff <= 1).all())


def test_fake_quantize_uses_the_mode_and_float_targets_refuse():
    fq = fake_quantize_affine(TIES, TIES.shape, torch.tensor([1.0]), None, torch.int8,
                              zero_point_domain=ZeroPointDomain.NONE, rounding="floor")
    assert fq.tolist() == [[-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 2.0, -3.0, -1.0, 0.0]]
    with pytest.raises(ValueError, match="rounding='floor' applies to integer codes"):
        quantize_affine(TIES, TIES.shape, torch.tensor([1.0]), None, torch.float8_e4m3fn, rounding="floor")
    with pytest.raises(ValueError, match="rounding='up'"):
        quantize_affine(TIES, TIES.shape, torch.tensor([1.0]), None, torch.int8, rounding="up")


@pytest.mark.parametrize("rounding", ["half_even", "half_away_from_zero", "floor"])
def test_weight_config_codes_follow_the_mode(rounding):
    torch.manual_seed(0)
    lin = nn.Linear(64, 8, bias=False)
    w = lin.weight.detach().clone()
    affineq.quantize_(lin, IntxWeightOnlyConfig(torch.int4, PerGroup(32), scale_dtype=torch.float32,
                                                rounding=rounding))
    qw = lin.weight
    s = qw.scale.reshape(8, 2, 1)
    exact = (w.reshape(8, 2, 32) / s).clamp(-8, 7)
    codes = qw.codes().reshape(8, 2, 32).float()
    if rounding == "floor":
        assert bool((codes <= exact + 1e-5).all()) and bool((exact - codes < 1).all())
        assert float((exact - codes).mean()) > 0.3  # floor is biased by about half a step
    else:
        assert bool(((codes - exact).abs() <= 0.5 + 1e-5).all())


def test_config_rejects_unknown_mode():
    with pytest.raises(ValueError, match="rounding"):
        IntxWeightOnlyConfig(rounding="nearest")
    with pytest.raises(ValueError, match="rounding"):
        affineq.Int8WeightOnlyConfig(rounding="ceil")


def test_quark_round_method_reaches_the_codes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16, bias=False))
    ref = model[0].weight.detach().clone()
    spec = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, round_method=RoundType.floor)
    affineq.quantize_(model, Config(QuantizationConfig(weight=spec)))
    qw = model[0].weight
    exact = ref / qw.scale.reshape(16, 1)
    assert torch.equal(qw.codes().float(), exact.floor().clamp(-128, 127))
