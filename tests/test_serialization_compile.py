"""torch.save / torch.load(weights_only=True), load_state_dict(assign=True), and torch.compile per config."""

import copy

import pytest
import torch
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


@pytest.mark.parametrize("config", ["float8-row", "float8-tensor", "mxfp8", "mxfp4"])
def test_compiled_float8_and_mx_activations_equal_eager_after_a_gelu(config):
    # Their activation quantization is one opaque op in traced graphs (as int8's C++ ops): inlined, inductor fused
    # it with the GELU before and skipped the GELU's rounding to bf16, and codes near a boundary moved (1.4% / 2.7%
    # of the output). No biases: inductor also fuses a bias add with the next op unrounded, for every quantized
    # linear (README, Limits: torch.compile and bf16).
    from torch import nn

    from affineq import Float8DynamicActivationFloat8WeightConfig, MXDynamicActivationMXWeightConfig, PerTensor

    cfg = {"float8-row": Float8DynamicActivationFloat8WeightConfig(),
           "float8-tensor": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
           "mxfp8": MXDynamicActivationMXWeightConfig("mxfp8_e4m3"),
           "mxfp4": MXDynamicActivationMXWeightConfig()}[config]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    model = quantize_(model.to(torch.bfloat16).eval(), cfg)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for m in (3, 8):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), model(x)), m
