"""FakeQuantizeConfig: the spellings that must compare equal, and every contradiction as a ValueError naming
both sides; QATConfig's own validation."""

import pytest
import torch

from affineq import (
    Float8WeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    MappingType,
    PerAxis,
    PerGroup,
    ZeroPointDomain,
)
from affineq.granularity import PerTensor, PerToken
from affineq.qat import FakeQuantizeConfig, QATConfig

GROUPS = [
    [lambda: FakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
     lambda: FakeQuantizeConfig(torch.int8, PerToken(), MappingType.ASYMMETRIC)],
    [lambda: FakeQuantizeConfig(torch.int4, "per_channel"),
     lambda: FakeQuantizeConfig(torch.int4, "per_channel", is_symmetric=True),
     lambda: FakeQuantizeConfig(torch.int4, PerAxis(0), MappingType.SYMMETRIC)],
    [lambda: FakeQuantizeConfig(torch.int4, group_size=32),
     lambda: FakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True),
     lambda: FakeQuantizeConfig(torch.int4, "per_group", group_size=32, is_symmetric=True),
     lambda: FakeQuantizeConfig(torch.int4, PerGroup(32), MappingType.SYMMETRIC)],
]


def test_the_nine_lines_compare_equal_within_groups_and_differ_across():
    built = [[make() for make in group] for group in GROUPS]
    for group in built:
        for cfg in group:
            assert cfg == group[0] and hash(cfg) == hash(group[0])
    firsts = [g[0] for g in built]
    for i in range(len(firsts)):
        for j in range(i + 1, len(firsts)):
            assert firsts[i] != firsts[j]
    assert built[2][0].group_size == 32 and built[1][0].group_size is None
    assert built[0][0].is_symmetric is False and built[1][0].granularity == PerAxis(0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(dtype=torch.int4, granularity="per_group"), ["per_group", "group_size"]),
    (dict(dtype=torch.int4, granularity="per_channel", group_size=32), ["group_size=32", "PerAxis"]),
    (dict(dtype=torch.int4, granularity=PerToken(), group_size=32), ["group_size=32", "PerToken"]),
    (dict(dtype=torch.int4, granularity=PerGroup(64), group_size=32), ["group_size=32", "PerGroup(group_size=64)"]),
    (dict(dtype=torch.int4, mapping_type=MappingType.ASYMMETRIC, is_symmetric=True, group_size=32),
     ["is_symmetric=True", "ASYMMETRIC"]),
    (dict(dtype=torch.int4, mapping_type=MappingType.SYMMETRIC, is_symmetric=False, group_size=32),
     ["is_symmetric=False", "SYMMETRIC"]),
    (dict(dtype=torch.int4, granularity="per_row_of_doom"), ["per_row_of_doom", "per_token"]),
    (dict(dtype=torch.int4, group_size=32, range_learning=True), ["range_learning=True", "is_dynamic=True"]),
    (dict(dtype=torch.float32, group_size=32), ["torch.float32", "torch.int1"]),
    (dict(dtype=torch.bool, group_size=32), ["torch.bool", "torch.int1"]),
    (dict(dtype=torch.int4, granularity=None), ["granularity", "group_size"]),
    (dict(dtype=torch.int4, group_size=0), ["group_size", "positive"]),
    (dict(dtype=torch.int4, group_size=32, is_symmetric=False, zero_point_domain=ZeroPointDomain.NONE),
     ["asymmetric", "NONE"]),
    (dict(dtype=torch.int4, group_size=32, is_symmetric=False, is_dynamic=False, range_learning=True,
          range_learning_method="tqt"), ["tqt", "ASYMMETRIC"]),
])
def test_contradictions_name_both_sides(kwargs, words):
    with pytest.raises(ValueError) as e:
        FakeQuantizeConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_per_tensor_and_range_learning_construct():
    c = FakeQuantizeConfig(torch.uint8, PerTensor(), is_symmetric=False, is_dynamic=False, range_learning=True)
    assert c.range_learning and not c.is_dynamic and c.mapping_type is MappingType.ASYMMETRIC
    assert c.replace(range_learning=False) != c


def test_qatconfig_validation():
    base = Int8DynamicActivationInt4WeightConfig(group_size=32)
    assert QATConfig(base, step="prepare") == QATConfig(base, step="prepare")
    with pytest.raises(ValueError, match="step='prepare' or step='convert'"):
        QATConfig(base, step="train")
    with pytest.raises(ValueError, match="not both"):
        QATConfig(base, weight_config=FakeQuantizeConfig(torch.int4, group_size=32))
    with pytest.raises(ValueError, match="needs base_config"):
        QATConfig()
    with pytest.raises(ValueError, match="Float8WeightOnlyConfig has no QAT counterpart"):
        QATConfig(Float8WeightOnlyConfig())
    with pytest.raises(ValueError, match="range_learning"):
        QATConfig(Int4WeightOnlyConfig(), range_learning="adam")


def test_static_per_token_activations_are_refused():
    from affineq.qat import FakeQuantizer

    with pytest.raises(ValueError, match="per token"):
        FakeQuantizer(FakeQuantizeConfig(torch.int8, "per_token", is_dynamic=False), activation=True)


def test_power_of_two_scales_are_refused_with_a_way_out():
    from torch import nn

    from affineq import IntxWeightOnlyConfig, PerGroup, QuantizationError, quantize_

    model = nn.Sequential(nn.Linear(64, 32))
    before = model[0].weight.detach().clone()
    cfg = IntxWeightOnlyConfig(torch.int4, PerGroup(32), scale_type="pof2")
    with pytest.raises(QuantizationError, match="power-of-two .* no QAT counterpart.*scale_type=None"):
        quantize_(model, QATConfig(cfg, step="prepare"))
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, before)
