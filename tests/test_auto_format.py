"""packing_format="auto": the first format the spec fits that a kernel available here reads (issue #29),
named for a few specs on this CPU, and the same choice the scheme rules (`auto_format`) made."""

import pytest
import torch
from torch import nn

import affineq
from affineq import cpp
from affineq.tensor.kernel_registry import auto_format, choose_format, int_mm_is_fast
from affineq.tensor.spec import QuantSpec

DENSE_IF_CPP = "dense" if cpp.is_available() else None


def _fmt(config, module=None) -> str:
    module = module if module is not None else nn.Linear(64, 32)
    return config.weight_spec(module.weight.detach(), module).fmt


def test_the_choice_on_this_cpu():
    # W8A8 dynamic: our int8-codes kernel where it is faster than oneDNN's int8 (AVX-512 without AMX), else aten's
    # _int_mm where that is fast; static activations keep plain wherever _int_mm is fast
    from affineq.tensor.kernel_registry import int8_codes_preferred

    int8_static = "plain" if int_mm_is_fast() else (DENSE_IF_CPP or "plain")
    int8_dyn = "dense" if int8_codes_preferred((32, 64)) else int8_static
    expected = {
        "int4 (bf16 scales)": (affineq.Int4WeightOnlyConfig(group_size=32), DENSE_IF_CPP or "int4_cpu"),
        "int4 (fp32 scales)": (affineq.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.float32), "dense"),
        "int8 weight-only": (affineq.Int8WeightOnlyConfig(), DENSE_IF_CPP or "plain"),
        "W8A8": (affineq.Int8DynamicActivationInt8WeightConfig(), int8_dyn),
        "W8A8 static": (affineq.Int8StaticActivationInt8WeightConfig(), int8_static),
        "int2 (sub-byte: compact even without a reader)": (affineq.IntxWeightOnlyConfig(torch.int2), "dense"),
        "fp4 (float codes)": (affineq.FPxWeightOnlyConfig(2, 1, 32), "dense"),
        "float8 weight-only": (affineq.Float8WeightOnlyConfig(), DENSE_IF_CPP or "plain"),
    }
    got = {name: _fmt(cfg) for name, (cfg, _) in expected.items()}
    assert got == {name: fmt for name, (_, fmt) in expected.items()}
    # not an F.linear weight: aten's kernels read plain (the format every spec fits)
    assert _fmt(affineq.Int8WeightOnlyConfig(), nn.Embedding(32, 64)) == "plain"
    # an explicit format is kept as given
    assert _fmt(affineq.Int8WeightOnlyConfig(packing_format="plain")) == "plain"


def test_choose_format_by_device_and_scale_dtype():
    spec = QuantSpec.create((32, 64), torch.bfloat16, torch.uint4, (1, 32))
    assert choose_format(spec, "cuda", scale_dtype=torch.bfloat16) == "int4_cuda"  # aten's int4 kernel on CUDA
    assert choose_format(spec, "cuda", scale_dtype=torch.float32) == "plain"  # its layout needs bf16 scales
    assert choose_format(spec, "cpu", module_is_linear=False) == "plain"
    conv = QuantSpec.create((8, 4, 3, 3), torch.float32, torch.int8, (1, 4, 3, 3))
    assert choose_format(conv, "cpu") == "plain"  # 4-D: no packed kernel


@pytest.mark.parametrize("make, scheme", [
    (lambda: affineq.Int8WeightOnlyConfig(), "byte"),
    (lambda: affineq.Float8WeightOnlyConfig(), "byte"),
    (lambda: affineq.IntxWeightOnlyConfig(torch.int3), "subbyte"),
    (lambda: affineq.Int8DynamicActivationInt4WeightConfig(group_size=32), "subbyte"),
    (lambda: affineq.Int8DynamicActivationInt8WeightConfig(), "int8_dynamic"),
    (lambda: affineq.FPxWeightOnlyConfig(3, 2, 32), "float_codes"),
])
@pytest.mark.parametrize("module", [nn.Linear(64, 32), nn.Embedding(32, 64), nn.LSTM(64, 8)])
def test_the_same_choice_as_the_scheme_rules(make, scheme, module):
    cfg = make()
    if cfg.check(module) is not None:
        pytest.skip(f"{type(cfg).__name__} does not take {type(module).__name__}")
    name = "weight_ih_l0" if isinstance(module, nn.LSTM) else "weight"
    w = getattr(module, name).detach()
    linear = isinstance(module, (nn.Linear, nn.LSTM))
    assert cfg.weight_spec(w, module).fmt == auto_format(scheme, w, linear)
