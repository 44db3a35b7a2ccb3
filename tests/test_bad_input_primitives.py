"""A catalogue of bad inputs to the primitives and the granularity / range helpers.

Every case must raise the given exception type with a message that names the offending parameter (``param``,
a regex) and says what to do (``fix``, a regex; by default one of the imperative words in ``FIX_WORDS``,
or the list of valid values the message spells out). The overflow cases of choose_qparams_affine (finite
input whose scale or zero point no dtype at hand can hold) are in the catalogue too; the regressions they
replace (inf scales, NaN outputs) are pinned down after it. Last, `BAD_CALLS`: calls whose ValueError must read
exactly as given.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from affineq.dtypes import check_quant_range
from affineq.granularity import (
    PerAxis,
    PerBlock,
    PerGroup,
    PerTensor,
    PerToken,
    get_block_size,
    parse_granularity,
)
from affineq.primitives import (
    MappingType,
    ZeroPointDomain,
    choose_qparams_affine,
    dequantize_affine,
    fake_quantize_affine,
    quantize_affine,
)

SYM, ASYM, NO_CLIP = MappingType.SYMMETRIC, MappingType.ASYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR
INT, FLOAT, NONE = ZeroPointDomain.INT, ZeroPointDomain.FLOAT, ZeroPointDomain.NONE

FIX_WORDS = r"\b(use|must|pass|choose|give|convert|clean|divide)\b"
# Messages from affineq.dtypes / affineq.granularity that state the valid values instead of an imperative.
VALID_VALUES = r"(supported: |valid( axes)?: |which is \[|would work include)"

X = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
S, Z = choose_qparams_affine(X, ASYM, (1, 32), torch.uint8)
Q = quantize_affine(X, (1, 32), S, Z, torch.uint8)
BIG = torch.tensor([[3e38, -3e38, 1.0, 0.0]])


@dataclass(frozen=True)
class Bad:
    call: Callable[[], object]
    param: str
    fix: str = FIX_WORDS
    exc: type[Exception] = ValueError


CATALOGUE: dict[str, Bad] = {
    # ---- choose_qparams_affine: types and dtypes
    "choose: integer input": Bad(lambda: choose_qparams_affine(Q, ASYM, (1, 32), torch.uint8), r"\binput\b"),
    "choose: list input": Bad(lambda: choose_qparams_affine([[1.0]], ASYM, (1, 1), torch.uint8), r"\binput\b"),
    "choose: mapping_type str": Bad(
        lambda: choose_qparams_affine(X, "asymmetric", (1, 32), torch.uint8), "mapping_type"
    ),
    "choose: zero_point_domain str": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, zero_point_domain="int"), "zero_point_domain"
    ),
    "choose: target_dtype float16": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.float16), "target_dtype", VALID_VALUES
    ),
    "choose: target_dtype str": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), "int8"), "target_dtype", VALID_VALUES
    ),
    "choose: scale_dtype int": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, scale_dtype=torch.int32), "scale_dtype"
    ),
    "choose: scale_dtype str": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, scale_dtype="float32"), "scale_dtype"
    ),
    "choose: zero_point_dtype int for FLOAT": Bad(
        lambda: choose_qparams_affine(
            X, ASYM, (1, 32), torch.uint4, zero_point_dtype=torch.int32, zero_point_domain=FLOAT
        ),
        "zero_point_dtype",
    ),
    "choose: zero_point_dtype too narrow": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, zero_point_dtype=torch.int8),
        "zero_point_dtype",
    ),
    "choose: zero_point_dtype bool": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, zero_point_dtype=torch.bool),
        "zero_point_dtype",
    ),
    # ---- choose_qparams_affine: block_size
    "choose: block_size rank": Bad(lambda: choose_qparams_affine(X, ASYM, (32,), torch.uint8), "block_size"),
    "choose: block_size not dividing": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 48), torch.uint8), r"block_size\[1\]"
    ),
    "choose: block_size zero": Bad(lambda: choose_qparams_affine(X, ASYM, (0, 64), torch.uint8), r"block_size\[0\]"),
    "choose: block_size negative": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, -32), torch.uint8), r"block_size\[1\]"
    ),
    "choose: block_size int": Bad(lambda: choose_qparams_affine(X, ASYM, 32, torch.uint8), "block_size"),
    "choose: block_size float entry": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32.0), torch.uint8), r"block_size\[1\]"
    ),
    # ---- choose_qparams_affine: code range
    "choose: quant_min > quant_max": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, 200, 100), "quant_min"
    ),
    "choose: quant_min == quant_max": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, 3, 3), "quant_min"
    ),
    "choose: quant_max outside int4": Bad(
        lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int4, quant_max=8), "quant_max", VALID_VALUES
    ),
    "choose: quant_min not an int": Bad(
        lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, quant_min=-1.5), "quant_min"
    ),
    "choose: quant_max outside float8": Bad(
        lambda: choose_qparams_affine(X, SYM, (1, 32), torch.float8_e4m3fn, quant_max=500.0),
        "quant_max",
        VALID_VALUES,
    ),
    # ---- choose_qparams_affine: mapping / domain combinations
    "choose: float8 asymmetric": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.float8_e5m2), "mapping_type"
    ),
    "choose: asymmetric without zero point": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.int8, zero_point_domain=NONE), "zero_point_domain"
    ),
    "choose: asymmetric INT without preserve_zero": Bad(
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint4, preserve_zero=False), "preserve_zero"
    ),
    "choose: NONE domain on unsigned codes": Bad(
        lambda: choose_qparams_affine(X, SYM, (1, 32), torch.uint4, zero_point_domain=NONE), "zero_point_domain"
    ),
    "choose: NONE domain on off-centre range": Bad(
        lambda: choose_qparams_affine(X, NO_CLIP, (1, 32), torch.int8, -3, 5, zero_point_domain=NONE),
        "zero_point_domain",
    ),
    # ---- choose_qparams_affine: eps
    "choose: eps zero": Bad(lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, eps=0.0), r"\beps\b"),
    "choose: eps negative": Bad(lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, eps=-1e-3), r"\beps\b"),
    "choose: eps nan": Bad(lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, eps=float("nan")), r"\beps\b"),
    "choose: eps bool": Bad(lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, eps=True), r"\beps\b"),
    "choose: eps below float16 scale": Bad(
        lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, eps=1e-9, scale_dtype=torch.float16), r"\beps\b"
    ),
    # found by hypothesis 6.170: an fp16 subnormal scale rounds ~12% low and the block's maximum clips
    "choose: eps subnormal in float16 scale": Bad(
        lambda: choose_qparams_affine(X.half(), SYM, (1, 32), torch.float8_e4m3fn, eps=2.0**-23), r"\beps\b.*subnormal"
    ),
    "choose: eps below float32 normal": Bad(
        lambda: choose_qparams_affine(X, SYM, (1, 32), torch.int8, eps=1e-40), r"\beps\b"
    ),
    # ---- choose_qparams_affine: data
    "choose: NaN input": Bad(
        lambda: choose_qparams_affine(torch.tensor([[1.0, float("nan")]]), SYM, (1, 2), torch.int8), r"\binput\b"
    ),
    "choose: -Inf input": Bad(
        lambda: choose_qparams_affine(torch.tensor([[1.0, -float("inf")]]), ASYM, (1, 2), torch.uint8),
        r"\binput\b",
    ),
    "choose: +Inf input, min side only": Bad(
        # int1 no-clipping drops the max side: the scale would not see the inf
        lambda: choose_qparams_affine(torch.tensor([[-1.0, float("inf")]]), NO_CLIP, (1, 2), torch.int1),
        r"\binput\b",
    ),
    # ---- choose_qparams_affine: finite input whose qparams no dtype at hand can hold
    "choose: float16 scale past 65504": Bad(
        lambda: choose_qparams_affine(torch.tensor([[1e7, -2.0]]), SYM, (1, 2), torch.int8, scale_dtype=torch.float16),
        r"scale_dtype=torch\.float16",
        r"use scale_dtype=torch\.float32",
    ),
    "choose: float16 input, 1-bit codes": Bad(
        lambda: choose_qparams_affine(torch.tensor([[6e4, -6e4]], dtype=torch.float16), ASYM, (1, 2), torch.uint1),
        r"scale_dtype=torch\.float16",
        r"use scale_dtype=torch\.float32",
    ),
    "choose: float32 scale past float32 max": Bad(
        lambda: choose_qparams_affine(BIG, SYM, (1, 4), torch.int1), r"scale_dtype|quant_max", r"divide .*wider code"
    ),
    "choose: float8 quant_max too small": Bad(
        lambda: choose_qparams_affine(
            torch.tensor([[1e38, 1.0]]), SYM, (1, 2), torch.float8_e4m3fn, quant_max=0.25
        ),
        "quant_max",
        "divide",
    ),
    "choose: float64 input past float32": Bad(
        lambda: choose_qparams_affine(
            torch.tensor([[1e300, 1.0]], dtype=torch.float64), SYM, (1, 2), torch.int8
        ),
        r"scale_dtype",
        "divide",
    ),
    "choose: float16 FLOAT zero point": Bad(
        lambda: choose_qparams_affine(
            torch.tensor([[1e5, 2e5]]), ASYM, (1, 2), torch.uint8, scale_dtype=torch.float16,
            zero_point_domain=FLOAT, preserve_zero=False,
        ),
        r"zero_point_dtype=torch\.float16",
        r"use zero_point_dtype=torch\.float32",
    ),
    # ---- quantize_affine
    "quantize: output_dtype int64": Bad(
        lambda: quantize_affine(X, (1, 32), S, Z, torch.int64), "output_dtype", VALID_VALUES
    ),
    "quantize: integer input": Bad(lambda: quantize_affine(Q, (1, 32), S, Z, torch.uint8), r"\binput\b"),
    "quantize: zero_point with NONE": Bad(
        lambda: quantize_affine(X, (1, 32), S, Z, torch.uint8, zero_point_domain=NONE), "zero_point"
    ),
    "quantize: zero_point for float8": Bad(
        lambda: quantize_affine(X, (1, 32), S, Z, torch.float8_e4m3fn), "zero_point"
    ),
    "quantize: zero_point missing": Bad(lambda: quantize_affine(X, (1, 32), S, None, torch.uint8), "zero_point"),
    "quantize: scale numel": Bad(lambda: quantize_affine(X, (1, 32), S[:, :1], Z, torch.uint8), r"\bscale\b"),
    "quantize: zero_point numel": Bad(lambda: quantize_affine(X, (1, 64), S[:, :1], Z, torch.uint8), "zero_point"),
    "quantize: block_size rank": Bad(lambda: quantize_affine(X, (1, 1, 32), S, Z, torch.uint8), "block_size"),
    "quantize: quant_max outside": Bad(
        lambda: quantize_affine(X, (1, 32), S, Z, torch.int4, quant_max=8), "quant_max", VALID_VALUES
    ),
    "quantize: zero_point_domain str": Bad(
        lambda: quantize_affine(X, (1, 32), S, Z, torch.uint8, zero_point_domain="int"), "zero_point_domain"
    ),
    # ---- dequantize_affine
    "dequantize: input_dtype uint16": Bad(
        lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint16), "input_dtype", VALID_VALUES
    ),
    "dequantize: wrong container": Bad(lambda: dequantize_affine(Q.int(), (1, 32), S, Z, torch.uint4), "input_dtype"),
    "dequantize: integer output_dtype": Bad(
        lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint8, output_dtype=torch.int32), "output_dtype"
    ),
    "dequantize: list input": Bad(lambda: dequantize_affine([[1]], (1, 1), S, Z, torch.uint8), "input"),
    "dequantize: quant_min outside": Bad(
        lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint8, quant_min=-1), "quant_min", VALID_VALUES
    ),
    "dequantize: block_size not dividing": Bad(
        lambda: dequantize_affine(Q, (3, 32), S, Z, torch.uint8), r"block_size\[0\]"
    ),
    # ---- fake_quantize_affine
    "fake_quantize: quant_dtype bool": Bad(
        lambda: fake_quantize_affine(X, (1, 32), S, Z, torch.bool), "quant_dtype", VALID_VALUES
    ),
    "fake_quantize: integer input": Bad(lambda: fake_quantize_affine(Q, (1, 32), S, Z, torch.uint8), r"\binput\b"),
    "fake_quantize: zero_point missing": Bad(
        lambda: fake_quantize_affine(X, (1, 32), S, None, torch.uint8), "zero_point"
    ),
    # ---- get_block_size
    "get_block_size: axis out of range": Bad(lambda: get_block_size((4, 64), PerAxis(2)), "axis", VALID_VALUES),
    "get_block_size: group_size not dividing": Bad(
        lambda: get_block_size((4, 64), PerGroup(48)), "group_size", VALID_VALUES
    ),
    "get_block_size: group on 1-D": Bad(lambda: get_block_size((64,), PerGroup(32)), "group_size"),
    "get_block_size: PerBlock rank": Bad(lambda: get_block_size((4, 64), PerBlock((2,))), "sizes"),
    "get_block_size: PerBlock not dividing": Bad(
        lambda: get_block_size((4, 64), PerBlock((3, 64))), r"sizes\[0\]", VALID_VALUES
    ),
    "get_block_size: not a granularity": Bad(lambda: get_block_size((4, 64), "per_tensor"), "granularity"),
    "get_block_size: PerToken on a scalar": Bad(lambda: get_block_size((), PerToken()), "PerToken", r"use PerTensor"),
    "get_block_size: PerGroup(0)": Bad(lambda: get_block_size((4, 64), PerGroup(0)), "group_size"),
    "get_block_size: PerAxis(1.5)": Bad(lambda: get_block_size((4, 64), PerAxis(1.5)), "axis"),
    # ---- parse_granularity
    "parse_granularity: unknown": Bad(lambda: parse_granularity("per_channel"), "granularity", VALID_VALUES),
    "parse_granularity: extra argument": Bad(lambda: parse_granularity("per_tensor:3"), "granularity", VALID_VALUES),
    "parse_granularity: non-integer argument": Bad(
        lambda: parse_granularity("per_group:x"), "granularity", r"e\.g\. 'per_group:128'"
    ),
    "parse_granularity: not a str": Bad(lambda: parse_granularity(PerTensor()), "granularity"),
    "parse_granularity: group 0": Bad(lambda: parse_granularity("per_group:0"), "group_size"),
    # ---- affineq.dtypes.check_quant_range
    "check_quant_range: unsupported dtype": Bad(
        lambda: check_quant_range(torch.float32), "target dtype", VALID_VALUES
    ),
    "check_quant_range: min > max": Bad(lambda: check_quant_range(torch.int8, 5, -5), "quant_min"),
    "check_quant_range: max outside": Bad(lambda: check_quant_range(torch.uint4, None, 16), "quant_max", VALID_VALUES),
    "check_quant_range: float bound for int": Bad(lambda: check_quant_range(torch.int8, 0.5), "quant_min"),
    "check_quant_range: bool bound": Bad(lambda: check_quant_range(torch.int8, None, True), "quant_max"),
    "check_quant_range: float8 bound outside": Bad(
        lambda: check_quant_range(torch.float8_e5m2, -1e5), "quant_min", VALID_VALUES
    ),
}


@pytest.mark.parametrize("case", CATALOGUE)
def test_bad_input_is_rejected_with_a_helpful_message(case):
    bad = CATALOGUE[case]
    with pytest.raises(bad.exc) as info:
        bad.call()
    message = str(info.value)
    assert re.search(bad.param, message), f"message does not name {bad.param!r}: {message}"
    assert re.search(bad.fix, message), f"message does not say what to do ({bad.fix!r}): {message}"


def test_catalogue_size():
    assert len(CATALOGUE) >= 25


# ---------------------------------------------------------------------------------------------------------
# Regressions: finite input that overflowed the range math (issue #11). Each gave an inf scale (or zero
# point) and NaN codes / values before.


def _round_trip(x, mapping, block, dtype, domain=INT, **kwargs):
    scale, zp = choose_qparams_affine(x, mapping, block, dtype, zero_point_domain=domain, **kwargs)
    dom = NONE if zp is None else domain
    q = quantize_affine(x, block, scale, zp, dtype, zero_point_domain=dom)
    return scale, zp, q, dequantize_affine(q, block, scale, zp, dtype, zero_point_domain=dom)


@pytest.mark.parametrize(
    "domain, extra", [(INT, {}), (FLOAT, {"preserve_zero": False}), (FLOAT, {"preserve_zero": True})]
)
def test_asymmetric_range_past_float32_max_gets_finite_qparams(domain, extra):
    x = torch.tensor([[3e38, -3e38, 1e30, 0.0], [1.0, 2.0, 3.0, -4.0]])
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 4), torch.int8, domain, **extra)
    assert torch.isfinite(scale).all() and torch.isfinite(zp.float()).all()
    assert scale[0, 0].item() == pytest.approx(6e38 / 255, rel=1e-6)
    assert q[0].tolist()[:2] == [127, -128]
    assert torch.isfinite(dq).all() and not dq.isnan().any()
    # the ordinary block is untouched by the overflow handling of its neighbour
    s1, z1 = choose_qparams_affine(x[1:], ASYM, (1, 4), torch.int8, zero_point_domain=domain, **extra)
    assert torch.equal(scale[1:], s1) and torch.equal(zp[1:], z1)


def test_two_bit_float_zero_point_does_not_overflow():
    # scale 2e38 is finite but scale * (mid - quant_min) = 4e38 was not: the zero point came back inf
    x = torch.tensor([[-3e38, 3e38]])
    scale, zp = choose_qparams_affine(x, ASYM, (1, 2), torch.uint2, zero_point_domain=FLOAT)
    assert scale.item() == pytest.approx(2e38, rel=1e-6) and zp.item() == pytest.approx(1e38, rel=1e-6)


def test_float64_input_past_float32_range():
    x = torch.tensor([[1e39, -1e39, 1.0], [1.0, 2.0, -3.0]], dtype=torch.float64)
    scale, zp = choose_qparams_affine(x, ASYM, (1, 3), torch.uint8, scale_dtype=torch.float32)
    assert torch.isfinite(scale).all()
    assert scale[0, 0].item() == pytest.approx(2e39 / 255, rel=1e-6)
    assert zp[0, 0].item() in (127, 128)  # -round(-1e39 / scale) = round(127.5)
    q = quantize_affine(x, (1, 3), scale, zp, torch.uint8)
    assert q[0].tolist() == [255, 0, zp[0, 0].item()]
    # float64 scales for float64 input: same values, not rounded to float32 first where it overflowed
    s64, _ = choose_qparams_affine(x, SYM, (1, 3), torch.int8)
    assert s64.dtype == torch.float64 and s64[0, 0].item() == pytest.approx(1e39 / 127.5, rel=1e-12)


def test_float64_all_zero_block_scale_is_not_zero():
    # the default eps was float64's tiny, which the float32 math rounded to 0: scale 0, NaN codes
    x = torch.zeros(2, 4, dtype=torch.float64)
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 4), torch.uint8)
    assert (scale == torch.finfo(torch.float32).tiny).all()
    assert torch.equal(dq, torch.zeros(2, 4))


def test_unrepresentable_scale_raises_in_eager_and_names_the_fix():
    x = torch.tensor([[1e7, -2.0]])
    with pytest.raises(ValueError, match=r"scale_dtype=torch\.float16 cannot hold the scale 7\.84e\+04"):
        choose_qparams_affine(x, SYM, (1, 2), torch.int8, scale_dtype=torch.float16)
    scale, _ = choose_qparams_affine(x, SYM, (1, 2), torch.int8, scale_dtype=torch.bfloat16)
    assert torch.isfinite(scale).all()


def test_symmetric_none_domain_on_unsigned_codes_raised_instead_of_dropping_negatives():
    # the scale assumed zero point 128, NONE applied 0: every negative value quantized to 0
    with pytest.raises(ValueError, match="centred on 8"):
        choose_qparams_affine(torch.tensor([[-1.0, 1.0]]), SYM, (1, 2), torch.uint4, zero_point_domain=NONE)


# ---------------------------------------------------------------------------------------------------------
# Regressions: the default eps follows scale_dtype, not input.dtype (issue #11). fp16 input with float32
# scales was floored at fp16's tiny (6.1e-5), far above the int8 scale of small weights.


def _per_channel_int8_error(w: torch.Tensor, **kwargs) -> float:
    block = (1, w.shape[1])
    scale, zp = choose_qparams_affine(w, SYM, block, torch.int8, **kwargs)
    q = quantize_affine(w, block, scale, zp, torch.int8)
    dq = dequantize_affine(q, block, scale, zp, torch.int8)
    return ((dq - w.float()).norm() / w.float().norm()).item()


def test_small_fp16_weights_keep_int8_precision_with_float32_scales():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 1e-4
    ref = _per_channel_int8_error(w)  # float32 input: ~0.0074 (was the same before)
    assert ref < 0.01
    for dtype, scale_dtype in [(torch.float16, torch.float32), (torch.float16, torch.bfloat16)]:
        err = _per_channel_int8_error(w.to(dtype), scale_dtype=scale_dtype)
        assert err < 1.02 * ref, (dtype, scale_dtype, err)  # was 0.18: every scale floored at 6.1e-5
    assert _per_channel_int8_error(w.bfloat16()) < 1.02 * ref


@pytest.mark.parametrize(
    "input_dtype, scale_dtype, eps",
    [
        (torch.float32, None, torch.finfo(torch.float32).tiny),
        (torch.bfloat16, None, torch.finfo(torch.bfloat16).tiny),
        (torch.float16, None, torch.finfo(torch.float16).tiny),
        (torch.float32, torch.float16, torch.finfo(torch.float16).tiny),
        (torch.bfloat16, torch.float32, torch.finfo(torch.float32).tiny),
        (torch.float16, torch.float32, torch.finfo(torch.float32).tiny),  # was float16's tiny
        (torch.float16, torch.bfloat16, torch.finfo(torch.bfloat16).tiny),  # was float16's tiny
        (torch.float64, None, torch.finfo(torch.float32).tiny),  # was float64's tiny: a zero scale
    ],
)
def test_default_eps_follows_scale_dtype(input_dtype, scale_dtype, eps):
    x = torch.zeros(2, 8, dtype=input_dtype)
    scale, _ = choose_qparams_affine(x, SYM, (1, 8), torch.int8, scale_dtype=scale_dtype)
    assert scale.dtype == (scale_dtype or input_dtype)
    assert (scale.double() == torch.tensor(eps, dtype=scale.dtype).double()).all()


# --------------------------------------------------------------------------------------------------------
# Exact messages (moved from test_primitives.py): each call raises ValueError with this text


BAD_CALLS = {
    "block_size rank": (
        lambda: choose_qparams_affine(X, ASYM, (32,), torch.uint8),
        r"block_size \(32,\) has 1 entries but the input shape \(4, 64\) has rank 2",
    ),
    "block_size divides": (
        lambda: quantize_affine(X, (1, 48), S, Z, torch.uint8),
        r"block_size\[1\]=48 does not divide dim 1 \(size 64\)",
    ),
    "block_size zero": (lambda: choose_qparams_affine(X, ASYM, (0, 64), torch.uint8), r"block_size\[0\]=0"),
    "block_size type": (lambda: dequantize_affine(Q, 32, S, Z, torch.uint8), "block_size must be a tuple"),
    "quant_min > quant_max": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, 200, 100),
        "quant_min=200 is greater than quant_max=100",
    ),
    "quant_max outside dtype": (
        lambda: quantize_affine(X, (1, 32), S, Z, torch.int4, quant_max=8),
        r"quant_max=8 is outside the range of torch.int4, which is \[-8, 7\]",
    ),
    "quant_min outside dtype": (
        lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint8, quant_min=-1),
        r"quant_min=-1 is outside the range of torch.uint8",
    ),
    "quant_min == quant_max": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, 3, 3),
        "quant_min=3 must be smaller than quant_max=3",
    ),
    "target dtype": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.float16),
        r"target_dtype=torch.float16 is not a supported .*torch.int4",
    ),
    "output dtype": (lambda: quantize_affine(X, (1, 32), S, Z, torch.int64), "output_dtype=torch.int64"),
    "input dtype": (lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint16), "input_dtype=torch.uint16"),
    "quant dtype": (lambda: fake_quantize_affine(X, (1, 32), S, Z, torch.bool), "quant_dtype=torch.bool"),
    "integer input": (
        lambda: choose_qparams_affine(Q, ASYM, (1, 32), torch.uint8),
        "input must be a floating-point tensor .* got torch.uint8",
    ),
    "integer quantize input": (lambda: quantize_affine(Q, (1, 32), S, Z, torch.uint8), "floating-point"),
    "zero_point with NONE": (
        lambda: quantize_affine(X, (1, 32), S, Z, torch.uint8, zero_point_domain=NONE),
        "zero_point was given but zero_point_domain=ZeroPointDomain.NONE",
    ),
    "zero_point with NONE deq": (
        lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint8, zero_point_domain=NONE),
        "pass zero_point=None",
    ),
    "missing zero_point": (
        lambda: dequantize_affine(Q, (1, 32), S, None, torch.uint8),
        "zero_point is None but zero_point_domain=ZeroPointDomain.INT",
    ),
    "float8 zero_point": (
        lambda: quantize_affine(X, (1, 32), S, Z, torch.float8_e4m3fn),
        "zero_point must be None for float target",
    ),
    "float8 asymmetric": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.float8_e5m2),
        "use MappingType.SYMMETRIC",
    ),
    "asymmetric NONE": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.int8, zero_point_domain=NONE),
        "ASYMMETRIC needs a zero point",
    ),
    "preserve_zero INT": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint4, preserve_zero=False),
        "preserve_zero=False with ASYMMETRIC mapping needs zero_point_domain",
    ),
    "NaN": (
        lambda: choose_qparams_affine(torch.tensor([[1.0, float("nan")]]), SYM, (1, 2), torch.int8),
        "NaN or Inf",
    ),
    "Inf": (
        lambda: choose_qparams_affine(torch.tensor([[1.0, -float("inf")]]), SYM, (1, 2), torch.int8),
        "NaN or Inf",
    ),
    "scale numel": (
        lambda: quantize_affine(X, (1, 32), S[:, :1], Z, torch.uint8),
        r"scale has 4 elements \(shape \(4, 1\)\) but block_size \(1, 32\) .* gives 8 blocks",
    ),
    "zero_point numel": (
        lambda: quantize_affine(X, (1, 64), S[:, :1], Z, torch.uint8),
        r"zero_point has 8 elements",
    ),
    "container": (
        lambda: dequantize_affine(Q.int(), (1, 32), S, Z, torch.uint4),
        "codes of input_dtype=torch.uint4 must be stored as torch.uint8, got input of torch.int32",
    ),
    "output_dtype int": (
        lambda: dequantize_affine(Q, (1, 32), S, Z, torch.uint8, output_dtype=torch.int32),
        "output_dtype must be a floating-point",
    ),
    "mapping type": (
        lambda: choose_qparams_affine(X, "asymmetric", (1, 32), torch.uint8),
        "mapping_type must be one of MappingType.SYMMETRIC",
    ),
    "domain": (
        lambda: quantize_affine(X, (1, 32), S, Z, torch.uint8, zero_point_domain="int"),
        "zero_point_domain must be one of ZeroPointDomain.INT",
    ),
    "scale_dtype": (
        lambda: choose_qparams_affine(X, ASYM, (1, 32), torch.uint8, scale_dtype=torch.int32),
        "scale_dtype must be a floating-point",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_raises_value_error(case):
    call, pattern = BAD_CALLS[case]
    with pytest.raises(ValueError, match=pattern):
        call()
