"""torch.save / torch.load(weights_only=True), load_state_dict(assign=True), and torch.compile per config."""

import copy

import pytest
import torch
from conftest import needs_int8_codes_kernel
from conftest import save_load as _roundtrip
from test_quantize import CASES, make_mlp

import affineq
from affineq import AffineQuantizedTensor, Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip_is_bit_exact(name):
    config = CASES[name][0]
    model = quantize_(make_mlp(), config)
    sd = _roundtrip(model.state_dict())
    w = sd["0.weight"]
    assert isinstance(w, AffineQuantizedTensor) and torch.equal(w, model[0].weight)
    restored = make_mlp()
    restored.load_state_dict(sd, assign=True)
    assert isinstance(restored[0].weight, AffineQuantizedTensor)
    x = torch.randn(4, 256)
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))


def test_load_into_a_model_quantized_with_the_same_config():
    model = quantize_(make_mlp(), Int8WeightOnlyConfig())
    sd = _roundtrip(model.state_dict())
    other = quantize_(make_mlp(), Int8WeightOnlyConfig())
    other[0].weight.data  # noqa: B018  (a Parameter wrapper stays usable)
    other.load_state_dict(sd)
    assert torch.equal(other[0].weight, model[0].weight)


def test_whole_model_save():
    model = quantize_(make_mlp(), Int4WeightOnlyConfig(group_size=64))
    back = _roundtrip(model, weights_only=False)
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_mismatched_checkpoint_names_the_module():
    sd = quantize_(make_mlp(), Int4WeightOnlyConfig(group_size=64)).state_dict()
    target = quantize_(make_mlp(), Int8WeightOnlyConfig())
    with pytest.raises(RuntimeError, match='parameter named "0.weight".*different config'):
        target.load_state_dict(sd)
    with pytest.raises(RuntimeError, match='"0.weight".*assign=True'):
        make_mlp().load_state_dict(sd)


def test_safe_globals_registered_on_import():
    names = {getattr(g, "__name__", str(g)) for g in torch.serialization.get_safe_globals()}
    assert {"AffineQuantizedTensor", "QuantSpec", "MappingType", "ZeroPointDomain"} <= names
    assert affineq.AffineQuantizedTensor is AffineQuantizedTensor


# -- torch.compile (kept small: inductor compiles C++ slowly on 2 cores) ---------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_compile_fullgraph_matches_eager(name):
    torch._dynamo.reset()
    model = quantize_(make_mlp(), copy.deepcopy(CASES[name][0]))
    with torch.no_grad():
        for m in (1, 5):  # M = 1 once produced garbage from inductor's own _int_mm lowering
            x = torch.randn(m, 256)
            eager = model(x)
            explained = torch._dynamo.explain(model)(x)
            assert explained.graph_break_count == 0
            compiled = torch.compile(model, fullgraph=True, dynamic=False)(x)
            torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)


def test_compile_bf16_int4():
    torch._dynamo.reset()
    model = quantize_(make_mlp(torch.bfloat16), Int4WeightOnlyConfig(group_size=128))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x), rtol=2e-2, atol=2e-2)


def test_compile_and_export_bf16_8da4w_run_the_fused_op():
    # 8da4w on bf16 x is one op (affineq::lowbit_linear_int8_act: x quantized inside the GEMM where it can be, or
    # the int8-codes kernel); compiled and exported graphs call it too, with eager's values exactly
    from affineq import Int8DynamicActivationInt4WeightConfig
    if not affineq.cpp.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {affineq.cpp.unavailable_reason()}")
    torch._dynamo.reset()
    model = quantize_(make_mlp(torch.bfloat16), Int8DynamicActivationInt4WeightConfig(group_size=32))
    with torch.no_grad():
        for m in (3, 40):  # the GEMV's rows, then the GEMM's (on AMX: quantized as it packs)
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            eager = model(x)
            assert torch.equal(torch.compile(model, fullgraph=True, dynamic=False)(x), eager)
        with affineq.record_kernels() as used:
            model(x)
        program = torch.export.export(model, (x,))
        # where the int8-codes kernel takes bf16 x (AVX-512 without AMX) the graph holds it instead
        op = "lowbit_linear_int8_act" if "affineq.lowbit_linear" in used else "int8_codes_linear"
        assert f"affineq.{op}" in str(program.graph), (used, program.graph)
        assert torch.equal(program.module()(x), eager)


_BF16_MLP_CONFIGS = ["int4-g32", "int8", "w8a8", "8da4w", "q4_k", "float8-row", "float8-tensor", "mxfp8", "mxfp4"]


def _bf16_mlp_config(name: str):
    from affineq import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt4WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        MXDynamicActivationMXWeightConfig,
    )
    from affineq.configs import KQuantConfig
    from affineq.granularity import PerTensor

    return {"int4-g32": lambda: Int4WeightOnlyConfig(group_size=32),
            "int8": lambda: Int8WeightOnlyConfig(),
            "w8a8": lambda: Int8DynamicActivationInt8WeightConfig(),
            "8da4w": lambda: Int8DynamicActivationInt4WeightConfig(group_size=32),
            "q4_k": lambda: KQuantConfig("q4_k"),
            "float8-row": lambda: Float8DynamicActivationFloat8WeightConfig(),
            "float8-tensor": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
            "mxfp8": lambda: MXDynamicActivationMXWeightConfig("mxfp8_e4m3"),
            "mxfp4": lambda: MXDynamicActivationMXWeightConfig()}[name]()


@pytest.mark.parametrize("config", _BF16_MLP_CONFIGS)
def test_compiled_bf16_mlp_equals_eager_after_a_gelu(config):
    # A traced graph keeps eager's roundings to bf16 between a quantized linear and the GELU before it. Inlined,
    # inductor fused the float8 / MX activation quantization with the GELU and skipped the GELU's rounding to bf16
    # (codes near a boundary moved: 1.4% / 2.7% of the output); they are opaque ops in traced graphs
    # (quantize_float_activation, fake_quantize_mx_activation), as int8's C++ ops are. No biases: inductor fuses a
    # bias add with the next op unrounded, for every quantized linear (README, Limits: torch.compile and bf16).
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.GELU(), nn.Linear(256, 64, bias=False))  # q4_k: 256 | K
    model = quantize_(model.to(torch.bfloat16).eval(), _bf16_mlp_config(config))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for m in (3, 40):  # the GEMV's rows, then the GEMM's
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), model(x)), m


@pytest.mark.parametrize("config", ["w8a8", "8da4w"])
def test_compiled_bf16_mlp_with_biases_equals_eager_where_the_op_adds_them(config):
    # The int8-codes kernel adds a bias as it stores y (affineq::int8_codes_linear_biased, eager's values), so
    # nothing is left for inductor to fuse unrounded: biased W8A8 / 8da4w MLPs compile bit-equal to eager too.
    from torch import nn

    needs_int8_codes_kernel()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    model = quantize_(model.to(torch.bfloat16).eval(), _bf16_mlp_config(config))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for m in (3, 40):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            with affineq.record_kernels() as used:
                eager = model(x)
            if set(used) != {"affineq.int8_codes_linear"}:  # e.g. the AMX Xeon's tiles from 16 rows
                pytest.skip(f"external: this CPU runs {sorted(set(used))} at {m} rows, which add the bias after the op")
            assert torch.equal(compiled(x), eager), m
