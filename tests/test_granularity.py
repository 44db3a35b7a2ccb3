import dataclasses

import pytest
import torch

from affineq.granularity import (
    PerAxis,
    PerBlock,
    PerGroup,
    PerRow,
    PerTensor,
    PerToken,
    get_block_size,
    parse_granularity,
)
from affineq.primitives import MappingType, choose_qparams_affine


@pytest.mark.parametrize(
    "shape, granularity, expected",
    [
        ((8, 64), PerTensor(), (8, 64)),
        ((64,), PerTensor(), (64,)),
        ((2, 3, 4), PerTensor(), (2, 3, 4)),
        ((8, 64), PerAxis(0), (1, 64)),
        ((8, 64), PerAxis(1), (8, 1)),
        ((8, 64), PerAxis(-1), (8, 1)),
        ((2, 3, 4, 5), PerAxis(1), (2, 1, 4, 5)),
        ((64,), PerAxis(0), (1,)),
        ((8, 64), PerGroup(32), (1, 32)),
        ((8, 64), PerGroup(64), (1, 64)),
        ((2, 3, 128), PerGroup(128), (1, 1, 128)),
        ((8, 64), PerToken(), (1, 64)),
        ((2, 5, 64), PerToken(), (1, 1, 64)),
        ((64,), PerToken(), (64,)),
        ((8, 64), PerRow(), (1, 64)),
        ((4, 6, 8), PerBlock((2, 3, 4)), (2, 3, 4)),
        ((128, 256), PerBlock([128, 128]), (128, 128)),
    ],
)
def test_get_block_size(shape, granularity, expected):
    assert get_block_size(shape, granularity) == expected
    assert get_block_size(torch.Size(shape), granularity) == expected


@pytest.mark.parametrize(
    "granularity, scale_shape",
    [(PerTensor(), (1, 1)), (PerAxis(0), (8, 1)), (PerGroup(16), (8, 4)), (PerRow(), (8, 1))],
)
def test_block_size_feeds_primitives(granularity, scale_shape):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    block = get_block_size(x.shape, granularity)
    scale, zero_point = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.uint8)
    assert scale.shape == zero_point.shape == scale_shape


def test_per_group_needs_rank_two():
    with pytest.raises(
        ValueError, match=r"group_size needs a 2-D or higher weight; use PerTensor\(\) or PerAxis\(0\)"
    ):
        get_block_size((64,), PerGroup(32))


def test_per_group_not_dividing_lists_working_sizes():
    with pytest.raises(ValueError, match=r"group_size=48 does not divide the last dim 64") as info:
        get_block_size((8, 64), PerGroup(48))
    suggested = [int(s) for s in str(info.value).split("[")[-1].rstrip("]").split(",")]
    assert suggested and all(64 % s == 0 for s in suggested)
    assert {32, 64} <= set(suggested)
    with pytest.raises(ValueError, match="group_size=256 does not divide the last dim 128"):
        get_block_size((4, 128), PerGroup(256))


@pytest.mark.parametrize("axis", [2, -3, 10])
def test_per_axis_out_of_range(axis):
    with pytest.raises(ValueError, match=rf"PerAxis\(axis={axis}\) is out of range .*valid axes: -2..1"):
        get_block_size((8, 64), PerAxis(axis))


def test_per_block_errors():
    with pytest.raises(ValueError, match="rank 2 but the tensor shape .* has rank 3"):
        get_block_size((2, 3, 4), PerBlock((1, 4)))
    with pytest.raises(ValueError, match=r"sizes\[1\]=4 does not divide dim 1 .*include \[1, 2, 5, 10\]"):
        get_block_size((2, 10, 4), PerBlock((1, 4, 2)))


def test_rank_zero_only_per_tensor():
    assert get_block_size((), PerTensor()) == ()
    for g in (PerToken(), PerRow()):
        with pytest.raises(ValueError, match="rank >= 1"):
            get_block_size((), g)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: PerGroup(0), "group_size must be >= 1"),
        (lambda: PerGroup(32.0), "group_size must be an int"),
        (lambda: PerAxis("0"), "axis must be an int"),
        (lambda: PerBlock((1, 0)), r"sizes\[1\] must be >= 1"),
    ],
)
def test_constructor_validation(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_frozen_hashable_and_distinct():
    granularities = [
        PerTensor(),
        PerAxis(0),
        PerAxis(1),
        PerGroup(32),
        PerToken(),
        PerRow(),
        PerBlock([1, 32]),
    ]
    assert len(set(granularities)) == len(granularities)
    assert PerGroup(32) == PerGroup(32) and hash(PerGroup(32)) == hash(PerGroup(32))
    assert PerBlock([1, 32]) == PerBlock((1, 32)) and isinstance(PerBlock([1, 32]).sizes, tuple)
    assert PerRow() != PerToken()
    with pytest.raises(dataclasses.FrozenInstanceError):
        PerGroup(32).group_size = 64
    for g in granularities:
        assert not any(callable(getattr(g, f.name)) for f in dataclasses.fields(g))


def test_get_block_size_rejects_non_granularity():
    with pytest.raises(ValueError, match="granularity must be one of PerTensor"):
        get_block_size((8, 64), "per_tensor")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("per_tensor", PerTensor()),
        ("per_axis:0", PerAxis(0)),
        ("per_axis:-1", PerAxis(-1)),
        ("per_group:128", PerGroup(128)),
        ("per_token", PerToken()),
        ("per_row", PerRow()),
        (" Per_Group: 32 ", PerGroup(32)),
    ],
)
def test_parse_granularity(text, expected):
    assert parse_granularity(text) == expected


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("per_channel", "unknown granularity 'per_channel'"),
        ("per_group", "needs an integer argument, e.g. 'per_group:128'"),
        ("per_group:abc", "needs an integer argument"),
        ("per_axis:", "needs an integer argument, e.g. 'per_axis:0'"),
        ("per_tensor:3", "takes no argument"),
        ("per_group:0", "group_size must be >= 1"),
    ],
)
def test_parse_granularity_errors(text, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        parse_granularity(text)
    if "group_size" not in pattern:
        for valid in ("'per_tensor'", "'per_axis:<int>'", "'per_group:<int>'", "'per_token'", "'per_row'"):
            assert valid in str(info.value)
