import pytest
import torch

from affineq.dtypes import (
    FLOAT_FORMATS,
    SUPPORTED_TARGET_DTYPES,
    bit_width,
    check_quant_range,
    check_target_dtype,
    container_dtype,
    float_format,
    float_range,
    is_float_target,
    is_integer_target,
    is_signed,
    qrange,
)

SIGNED_SUB_BYTE = [getattr(torch, f"int{n}") for n in range(1, 8)]
UNSIGNED_SUB_BYTE = [getattr(torch, f"uint{n}") for n in range(1, 8)]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("n", range(1, 8))
def test_sub_byte_ranges_and_widths(n):
    signed, unsigned = getattr(torch, f"int{n}"), getattr(torch, f"uint{n}")
    assert qrange(signed) == (-(2 ** (n - 1)), 2 ** (n - 1) - 1)
    assert qrange(unsigned) == (0, 2**n - 1)
    assert bit_width(signed) == bit_width(unsigned) == n
    assert container_dtype(signed) is torch.int8
    assert container_dtype(unsigned) is torch.uint8
    assert is_signed(signed) and not is_signed(unsigned)


def test_named_ranges():
    assert qrange(torch.int1) == (-1, 0)
    assert qrange(torch.int4) == (-8, 7)
    assert qrange(torch.uint4) == (0, 15)
    assert qrange(torch.uint3) == (0, 7)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        assert qrange(dtype) == (info.min, info.max)
        assert container_dtype(dtype) is dtype
        assert bit_width(dtype) == info.bits


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_targets(dtype):
    info = torch.finfo(dtype)
    assert float_range(dtype) == (info.min, info.max)
    assert bit_width(dtype) == 8
    assert container_dtype(dtype) is dtype
    assert is_float_target(dtype) and not is_integer_target(dtype) and is_signed(dtype)
    fmt = float_format(dtype)
    assert fmt.max_value == info.max and fmt.min_normal == info.tiny
    assert fmt.bits == 8
    with pytest.raises(ValueError, match="float_range"):
        qrange(dtype)


def test_float_range_rejects_integer_target():
    with pytest.raises(ValueError, match="qrange"):
        float_range(torch.int8)


@pytest.mark.parametrize("name", ["fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
def test_described_float_formats_follow_their_bit_layout(name):
    # Formats without inf/NaN: bias = 2^(e-1) - 1, top exponent usable, max = (2 - 2^-m) * 2^(2^e - 1 - bias).
    fmt = FLOAT_FORMATS[name]
    bias = 2 ** (fmt.exponent_bits - 1) - 1
    assert fmt.max_value == (2 - 2.0**-fmt.mantissa_bits) * 2.0 ** (2**fmt.exponent_bits - 1 - bias)
    assert fmt.min_normal == 2.0 ** (1 - bias)
    assert fmt.torch_dtype is None and fmt.torch_dtype not in SUPPORTED_TARGET_DTYPES
    assert fmt.bits == int(name[2])


def test_supported_targets_and_predicates():
    expected = {
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        *SIGNED_SUB_BYTE,
        *UNSIGNED_SUB_BYTE,
        *FLOAT8,
    }
    assert set(SUPPORTED_TARGET_DTYPES) == expected
    assert len(SUPPORTED_TARGET_DTYPES) == len(expected)
    for dtype in SUPPORTED_TARGET_DTYPES:
        assert is_integer_target(dtype) != is_float_target(dtype)
        assert check_target_dtype(dtype) is dtype
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fnuz):
        assert not is_integer_target(dtype) and not is_float_target(dtype)


@pytest.mark.parametrize("bad", [torch.float32, torch.int64, torch.uint16, "int8", None])
def test_check_target_dtype_names_parameter_and_lists_supported(bad):
    with pytest.raises(ValueError, match="weight_dtype=") as info:
        check_target_dtype(bad, "weight_dtype")
    assert "torch.int4" in str(info.value) and "torch.float8_e4m3fn" in str(info.value)


@pytest.mark.parametrize("fn", [qrange, bit_width, container_dtype, is_signed, float_range])
def test_helpers_reject_unsupported_dtypes(fn):
    with pytest.raises(ValueError, match="supported"):
        fn(torch.float32)


def test_check_quant_range_defaults_and_custom():
    assert check_quant_range(torch.int4) == (-8, 7)
    assert check_quant_range(torch.uint8, 0, 127) == (0, 127)
    assert check_quant_range(torch.int8, quant_min=-127) == (-127, 127)
    assert check_quant_range(torch.float8_e4m3fn) == (-448.0, 448.0)
    assert check_quant_range(torch.float8_e5m2, -1.0, 2.0) == (-1.0, 2.0)
    assert check_quant_range(torch.int4, 3, 3) == (3, 3)


@pytest.mark.parametrize(
    "dtype, qmin, qmax, pattern",
    [
        (torch.int8, 10, -10, r"quant_min=10 is greater than quant_max=-10"),
        (torch.int8, None, 200, r"quant_max=200 is outside the range of torch.int8, which is \[-128, 127\]"),
        (torch.int4, -9, None, r"quant_min=-9 is outside the range of torch.int4, which is \[-8, 7\]"),
        (torch.uint4, None, 16, r"quant_max=16 .*torch.uint4.*\[0, 15\]"),
        (torch.int8, 0.5, None, r"quant_min must be an int"),
        (torch.int8, True, None, r"quant_min must be an int"),
        (torch.float8_e4m3fn, None, 500.0, r"quant_max=500.0 .*\[-448.0, 448.0\]"),
        (torch.float32, None, None, r"target dtype=torch.float32 is not a supported"),
    ],
)
def test_check_quant_range_errors(dtype, qmin, qmax, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_quant_range(dtype, qmin, qmax)
