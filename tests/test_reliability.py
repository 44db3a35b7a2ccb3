"""Issue #11 "Reliability": one test per finding. Each failed on the code before the fixes it checks."""

import json
import re
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import TiedLM, assert_unchanged, snapshot_model, sqnr
from torch import nn

import affineq
from affineq import (
    AffineQuantizedTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    KernelFallbackWarning,
    MappingType,
    PerAxis,
    PerGroup,
    QuantizationError,
    ZeroPointDomain,
    config_from_dict,
    cpp,
    quantize_,
    record_kernels,
    set_strict,
    strict_kernels,
)
from affineq.granularity import PerTensor
from affineq.kernels import KernelFallbackError
from affineq.tensor import fallback
from affineq.tensor.formats import dense_code_offset
from affineq.tensor.spec import QParamOptions

AQT = AffineQuantizedTensor
JOIN_S = 30  # no thread test can hang longer than this


def _seq(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*layers)


def _expect_unchanged_failure(model, config, match=None, **kw):
    """quantize_ must raise QuantizationError and leave every parameter, buffer and module as it was."""
    snap = snapshot_model(model)
    with pytest.raises(QuantizationError, match=match) as err:
        quantize_(model, config, **kw)
    assert_unchanged(model, snap)
    return str(err.value)


# -- 1. quantize_ is all-or-nothing ---------------------------------------------------------------------------


def test_all_or_nothing_nan_in_a_later_layer():
    m = _seq(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 32))
    with torch.no_grad():
        m[3].weight[5, 7] = float("nan")
    msg = _expect_unchanged_failure(m, Int8WeightOnlyConfig(), match="'3'.*NaN")
    assert "left unchanged" in msg
    assert torch.isnan(m[3].weight[5, 7])  # the NaN itself is still there, bit for bit (checked above)


def test_all_or_nothing_int4_cpu_cannot_hold_out_features_not_divisible_by_16():
    m = _seq(nn.Linear(128, 64), nn.Linear(128, 32), nn.Linear(128, 24))
    _expect_unchanged_failure(m, Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
                              match=r"'2'.*int4_cpu.*N divisible by 16 \(got N=24\)")


def test_all_or_nothing_dense_on_a_conv():
    m = _seq(nn.Linear(16, 16), nn.Linear(16, 8), nn.Conv2d(3, 8, 3))
    _expect_unchanged_failure(m, Int8WeightOnlyConfig(packing_format="dense"), match="'2'.*dense packs 2-D",
                              filter_fn=lambda mod, fqn: isinstance(mod, (nn.Linear, nn.Conv2d)))


class _Scale2(nn.Module):
    def forward(self, w):
        return 2 * w


def test_all_or_nothing_parametrized_linear():
    m = _seq(nn.Linear(16, 16), nn.Linear(16, 16))
    torch.nn.utils.parametrize.register_parametrization(m[1], "weight", _Scale2())
    _expect_unchanged_failure(m, Int8WeightOnlyConfig(),
                              match=r"'?1'?: its weight is parametrized.*remove_parametrizations\(module, 'weight'\)")


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
def test_all_or_nothing_old_style_weight_norm_linear():
    m = _seq(nn.Linear(16, 16), torch.nn.utils.weight_norm(nn.Linear(16, 16)))
    _expect_unchanged_failure(m, Int8WeightOnlyConfig(), match=r"weight_norm.*remove_weight_norm\(module, 'weight'\)")


@pytest.mark.parametrize("shape", [(0, 8), (8, 0)], ids=["in0", "out0"])
def test_all_or_nothing_zero_size_linear(shape):
    m = _seq(nn.Linear(8, 8), nn.Linear(*shape))
    _expect_unchanged_failure(m, Int8WeightOnlyConfig(), match=r"1: its weight is empty")


def test_all_or_nothing_custom_handler_raising_on_the_third_module():
    @dataclass(frozen=True)
    class ThirdFails(Int8WeightOnlyConfig):
        pass

    calls = []

    @affineq.register_quantize_module_handler(ThirdFails)
    def _handler(module, config):
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("handler gave up on the third module")
        module.weight = nn.Parameter(config.quantize_weight(module.weight.detach(), module), requires_grad=False)
        module.register_buffer("marker", torch.ones(1))
        module.extra_attribute = "set by the handler"
        return module

    m = _seq(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    _expect_unchanged_failure(m, ThirdFails(), match="'2'.*third module")
    assert len(calls) == 3
    assert not any(hasattr(layer, "extra_attribute") or "marker" in layer._buffers for layer in m)


def test_readme_default_call_without_cpp_falls_back_to_dense_for_odd_out_features():
    m = _seq(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 40))  # N=40: not a multiple of 16
    x = torch.randn(8, 256)
    with torch.no_grad():
        ref = m(x)
    with cpp._set_disabled(True):
        quantize_(m, Int4WeightOnlyConfig(group_size=128))
        assert m[0].weight.packing_format == "int4_cpu"  # aten's layout where it can hold the weight
        assert m[2].weight.packing_format == "dense"  # ... and dense where it cannot
        with torch.no_grad(), pytest.warns(KernelFallbackWarning):
            out = m(x)
    assert sqnr(ref, out) > 18


# -- 2. a failing quantize_ to another device leaves the float weights on CPU -------------------------------------


@pytest.mark.parametrize("nan", [False, True], ids=["any-failure", "nan"])
def test_failed_quantize_to_meta_keeps_float_weights_on_cpu(nan):
    m = _seq(nn.Linear(32, 32), nn.Linear(32, 16))
    if nan:
        with torch.no_grad():
            m[1].weight[0, 0] = float("nan")
    _expect_unchanged_failure(m, Int8WeightOnlyConfig(), device="meta")
    assert all(p.device.type == "cpu" and not isinstance(p, AQT) for p in m.parameters())


# -- 3. 1-bit weights ---------------------------------------------------------------------------------------------


def test_symmetric_one_bit_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"weight_dtype=torch.int1 with mapping_type=.*SYMMETRIC.*"
                                         r"use mapping_type=MappingType.ASYMMETRIC"):
        IntxWeightOnlyConfig(torch.int1)


@pytest.mark.parametrize("dtype", [torch.int1, torch.uint1], ids=["int1", "uint1"])
def test_asymmetric_one_bit_has_two_levels_per_group(dtype):
    m = _seq(nn.Linear(128, 32, bias=False))
    w = m[0].weight.detach().clone()
    quantize_(m, IntxWeightOnlyConfig(dtype, PerGroup(32), mapping_type=MappingType.ASYMMETRIC))
    deq = m[0].weight.dequantize()
    groups = deq.view(32, 4, 32)
    assert all(g.unique().numel() <= 2 for row in groups for g in row)
    assert deq.abs().sum() > 0 and sqnr(w, deq) > 0
    x = torch.randn(3, 128)
    with torch.no_grad():
        torch.testing.assert_close(m(x), F.linear(x, deq), rtol=1e-5, atol=1e-4)


# -- 4. finite inputs whose range overflows ------------------------------------------------------------------------

_BIG_CONFIGS = {
    "int8": Int8WeightOnlyConfig(),
    "int8-plain": Int8WeightOnlyConfig(packing_format="plain"),
    "int4": Int4WeightOnlyConfig(group_size=32),
    "int4-int4_cpu": Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
    "intx-int4": IntxWeightOnlyConfig(torch.int4),
    "intx-uint4-asym": IntxWeightOnlyConfig(torch.uint4, mapping_type=MappingType.ASYMMETRIC),
    "intx-int8-plain": IntxWeightOnlyConfig(torch.int8, packing_format="plain"),
    "8da4w": Int8DynamicActivationInt4WeightConfig(),
    "fp8": Float8WeightOnlyConfig(),
}
_CLEAR_OVERFLOW_ERROR = r"(not finite|overflows).*(scale the|packing_format='plain')"


@pytest.mark.parametrize("config", list(_BIG_CONFIGS.values()), ids=list(_BIG_CONFIGS))
def test_weights_near_the_float32_limit_quantize_finitely_or_raise_a_clear_error(config):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 16, bias=False))
    with torch.no_grad():
        m[0].weight.copy_((torch.rand(16, 64) * 2 - 1) * 3e38)
        m[0].weight[:, 0] = 3e38  # every row reaches the limit on both sides
        m[0].weight[:, 1] = -3e38
    x = torch.randn(4, 64) * 1e-4
    with torch.no_grad():
        ref = m(x)
    assert torch.isfinite(ref).all()
    snap = snapshot_model(m)
    try:
        quantize_(m, config)
    except QuantizationError as e:
        assert_unchanged(m, snap)
        assert re.search(_CLEAR_OVERFLOW_ERROR, str(e), re.S), str(e)
        return
    deq = m[0].weight.dequantize()
    with torch.no_grad():
        out = m(x)
    assert torch.isfinite(deq).all() and torch.isfinite(out).all()
    assert sqnr(ref, out) > 10


@pytest.mark.parametrize(("config", "min_db"), [
    (Int8WeightOnlyConfig(), 35), (IntxWeightOnlyConfig(torch.int8), 35), (IntxWeightOnlyConfig(torch.int4), 18),
    (IntxWeightOnlyConfig(torch.uint8, mapping_type=MappingType.ASYMMETRIC), 35),
], ids=["int8", "intx-int8", "intx-int4", "intx-uint8-asym"])
def test_fp16_weights_near_the_fp16_limit(config, min_db):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 16, bias=False)).half()
    with torch.no_grad():
        m[0].weight.copy_((torch.rand(16, 64) * 2 - 1) * 6e4)  # max - min = 1.2e5 overflows fp16
        m[0].weight[:, 0] = 6e4
        m[0].weight[:, 1] = -6e4
    w = m[0].weight.detach().float()
    x = (torch.randn(4, 64) * 1e-3).half()
    quantize_(m, config)
    deq = m[0].weight.dequantize()
    with torch.no_grad():
        out = m(x)
    assert deq.dtype == torch.float16 and torch.isfinite(deq).all() and torch.isfinite(out).all()
    assert sqnr(w, deq.float()) > min_db


# -- 5. quantized embeddings check their indices ---------------------------------------------------------------

_EMBEDDING_CONFIGS = {
    "int8": Int8WeightOnlyConfig(),
    "int8-dense": Int8WeightOnlyConfig(packing_format="dense"),
    "intx-int4": IntxWeightOnlyConfig(torch.int4, PerGroup(32)),
    "intx-int4-dense": IntxWeightOnlyConfig(torch.int4, PerGroup(32), packing_format="dense"),
}


@pytest.mark.parametrize("config", list(_EMBEDDING_CONFIGS.values()), ids=list(_EMBEDDING_CONFIGS))
def test_quantized_embedding_raises_index_error_like_the_float_one(config):
    emb = _seq(nn.Embedding(50, 64))
    float_emb = nn.Embedding(50, 64)
    quantize_(emb, config, filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    q = emb[0]
    assert isinstance(q.weight, AQT)
    if config.packing_format == "dense":
        assert q.weight.packing_format == "dense"
    ok = torch.tensor([[0, 49, 7]])
    torch.testing.assert_close(q(ok), q.weight.dequantize()[ok], rtol=0, atol=1e-6)
    for bad in (torch.tensor([1, -1]), torch.tensor([[0, 50]]), torch.tensor([-51]), torch.tensor([10**6])):
        with pytest.raises(IndexError, match="out of range"):
            float_emb(bad)
        with pytest.raises(IndexError, match=r"index -?\d+ is out of range.*valid: 0\.\.49"):
            q(bad)


# -- 6. tied weights under FqnToConfig ----------------------------------------------------------------------------


def test_tied_weights_with_two_configs_are_refused_and_nothing_changes():
    lm = TiedLM()
    cfg = FqnToConfig({"embed": Int8WeightOnlyConfig(), "head": IntxWeightOnlyConfig(torch.int4)})
    msg = _expect_unchanged_failure(lm, cfg)
    assert "embed.weight" in msg and "head.weight" in msg and "tied" in msg
    assert "Int8WeightOnlyConfig" in msg and "IntxWeightOnlyConfig" in msg
    assert "same config" in msg and "untie" in msg
    assert lm.embed.weight is lm.head.weight


def test_tied_weights_left_float_by_one_name_and_quantized_by_the_other_are_refused():
    lm = TiedLM()
    msg = _expect_unchanged_failure(lm, FqnToConfig({"embed": None, "head": Int8WeightOnlyConfig()}))
    assert "embed.weight" in msg and "head.weight" in msg and "None" in msg


@pytest.mark.parametrize("config", [Int8WeightOnlyConfig(), IntxWeightOnlyConfig(torch.int4)], ids=["int8", "int4"])
def test_tied_weights_with_one_config_stay_tied(config):
    lm = TiedLM()
    ids = torch.tensor([[1, 5, 63]])
    quantize_(lm, FqnToConfig({"embed": config, "head": config}))
    assert lm.embed.weight is lm.head.weight and isinstance(lm.head.weight, AQT)
    deq = lm.head.weight.dequantize()
    torch.testing.assert_close(lm.embed(ids), deq[ids], rtol=0, atol=1e-6)
    with torch.no_grad():
        assert sqnr(deq[ids].double() @ deq.double().t(), lm(ids)) > 40  # aten's int8 kernel computes in bf16


# -- 7. fp16 models: small weights --------------------------------------------------------------------------------


def test_fp16_int8_error_on_small_weights_is_that_of_bf16_and_fp32():
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 1e-4
    errors = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = nn.Sequential(nn.Linear(512, 256, bias=False)).to(dtype)
        with torch.no_grad():
            m[0].weight.copy_(w)
        ref = m[0].weight.detach().double()
        quantize_(m, Int8WeightOnlyConfig())
        deq = m[0].weight.dequantize().double()
        errors[dtype] = float((deq - ref).norm() / ref.norm())
    assert errors[torch.float32] < 0.01 and errors[torch.bfloat16] < 0.01
    assert errors[torch.float16] <= 2 * min(errors[torch.float32], errors[torch.bfloat16]), errors


# -- 8. strict mode and kernel recording are per thread ----------------------------------------------------------


def _int8_model() -> nn.Sequential:
    return quantize_(_seq(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)), Int8WeightOnlyConfig())


def _fallback_model() -> nn.Sequential:
    return quantize_(_seq(nn.Linear(64, 32)), Float8WeightOnlyConfig(packing_format="plain"))


def _run_threads(*targets, barrier: threading.Barrier | None = None) -> list[BaseException]:
    """Run each target in its own thread; return what they raised. A failing thread breaks `barrier`, so
    the others stop waiting at once; every join is bounded."""
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported to the main thread
                errors.append(e)
                if barrier is not None:
                    barrier.abort()
        return run

    threads = [threading.Thread(target=guard(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
        assert not t.is_alive(), "a thread did not finish"
    return errors


def test_record_kernels_does_not_see_another_threads_kernels():
    model, x = _int8_model(), torch.randn(2, 64)
    barrier = threading.Barrier(2, timeout=JOIN_S)
    seen = {}

    def recorder():
        with record_kernels() as used:
            barrier.wait()  # B runs its model now, while A records
            barrier.wait()
        seen["A"] = list(used)

    def worker():
        barrier.wait()
        with torch.no_grad(), record_kernels() as used:
            model(x)
        seen["B"] = list(used)
        barrier.wait()

    assert _run_threads(recorder, worker, barrier=barrier) == []
    assert seen["A"] == [] and len(seen["B"]) == 2 and not seen["B"][0].startswith("dequantize")


def test_strict_kernels_in_one_thread_does_not_make_another_thread_raise():
    model, x = _fallback_model(), torch.randn(2, 64)
    barrier = threading.Barrier(2, timeout=JOIN_S)
    raised = {}

    def strict_thread():
        with strict_kernels():
            barrier.wait()
            barrier.wait()  # the other thread has run its fallback
            try:
                with torch.no_grad():
                    model(x)
            except KernelFallbackError:
                raised["A"] = True

    def lenient_thread():
        barrier.wait()
        with torch.no_grad(), record_kernels() as used:
            model(x)  # a fallback: must only warn here
        raised["B_ran"] = used == ["dequantize:linear"]
        barrier.wait()

    assert _run_threads(strict_thread, lenient_thread, barrier=barrier) == []
    assert raised == {"A": True, "B_ran": True}


def test_set_strict_in_a_thread_does_not_leak():
    model, x = _fallback_model(), torch.randn(2, 64)
    seen = {}

    def child():
        seen["child_strict"] = fallback.is_strict()
        with torch.no_grad():
            model(x)  # must not raise

    def parent():
        set_strict(True)
        seen["parent_strict"] = fallback.is_strict()
        assert _run_threads(child) == []

    assert _run_threads(parent) == []
    assert seen == {"parent_strict": True, "child_strict": False}
    assert not fallback.is_strict()
    with torch.no_grad():
        model(x)  # the main thread is not strict either


def test_strict_mode_still_raises_in_the_main_thread():
    model, x = _fallback_model(), torch.randn(2, 64)
    with strict_kernels(), pytest.raises(KernelFallbackError, match="strict mode"), torch.no_grad():
        model(x)
    set_strict(True)
    with pytest.raises(KernelFallbackError, match="strict mode"), torch.no_grad():
        model(x)


def test_record_kernels_with_compiled_and_eager_runs():
    torch._dynamo.reset()
    model, x = _int8_model(), torch.randn(2, 64)
    with torch.no_grad(), record_kernels() as before:
        eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), record_kernels() as during:
        out = compiled(x)  # traced: the kernels are recorded while tracing, not inside the graph
    torch.testing.assert_close(out, eager)
    assert set(during) <= set(before)
    with torch.no_grad(), record_kernels() as after:
        model(x)  # eager re-run after compiling
    assert after == before and len(before) == 2
    torch._dynamo.reset()


# -- 9. smaller findings --------------------------------------------------------------------------------------


def test_a_quantized_weight_that_requires_grad_runs_and_raises_at_backward():
    m = _int8_model()
    x = torch.randn(2, 64)
    with torch.no_grad():
        want = m(x)
    m[0].weight.requires_grad_(True)
    y = m(x)  # inference works as for a float model
    assert torch.equal(y.detach(), want) and y.requires_grad
    with pytest.raises(RuntimeError, match=r"requires_grad=True.*requires_grad_\(False\)"):
        y.sum().backward()


@pytest.mark.parametrize(("field", "value"), [("mapping_type", "ASYMMETRIC"), ("scale_dtype", "bf16"),
                                              ("preserve_zero", 1), ("zero_point_domain", "FLOAT")])
def test_configs_reject_wrong_typed_fields(field, value):
    with pytest.raises(ValueError, match=rf"Int4WeightOnlyConfig\.{field}=.*must be a .*use e\.g\."):
        Int4WeightOnlyConfig(**{field: value})


def test_fqn_to_config_round_trips_through_config_from_dict():
    cfg = FqnToConfig({
        "re:layers\\.[0-3]\\..*": Int4WeightOnlyConfig(group_size=64),
        "lm_head": None,
        "embed": IntxWeightOnlyConfig(torch.int3, PerAxis(0)),  # a config with a field named "granularity"
        "block.w": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
        "_default": Int8WeightOnlyConfig(param_names=("weight",)),
    })
    back = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.fqn_to_config == cfg.fqn_to_config


@pytest.mark.parametrize("junk", [
    {}, {"type": "Nope"}, {"type": "Int4WeightOnlyConfig", "group_sise": 3},
    {"type": "Int4WeightOnlyConfig", "scale_dtype": {"dtype": "nope"}}, [], ["Int4WeightOnlyConfig"],
    {"type": ["Int4WeightOnlyConfig"]}, {"type": "IntxWeightOnlyConfig", "mapping_type": {"enum": "MappingType"}},
    {"type": "IntxWeightOnlyConfig", "mapping_type": {"enum": "Colour", "name": "RED"}},
    {"type": "IntxWeightOnlyConfig", "granularity": {"granularity": "PerGroup", "size": 3}},
    {"type": "IntxWeightOnlyConfig", "granularity": {"granularity": "__class__"}},
    {"type": "Int4WeightOnlyConfig", "group_size": {"weird": 1}},
    {"type": "FqnToConfig"}, {"type": "FqnToConfig", "fqn_to_config": {"a": {"type": "Nope"}}},
    {"type": "FqnToConfig", "fqn_to_config": {"a": 3}},
], ids=lambda d: json.dumps(d)[:40])
def test_junk_config_dicts_raise_value_error(junk):
    with pytest.raises(ValueError):
        config_from_dict(junk)


def test_set_strict_takes_a_bool_only():
    with pytest.raises(TypeError, match="True or False.*'False'"):
        set_strict("False")
    assert not fallback.is_strict()


def _dense(target, mapping, domain, scale_dtype, group):
    torch.manual_seed(0)
    return AQT.from_spec(torch.randn(64, 256), (1, group),
                         QParamOptions(scale_dtype=scale_dtype, preserve_zero=domain is not ZeroPointDomain.FLOAT),
                         target=target, mapping_type=mapping, zero_point_domain=domain, packing_format="dense")


# Found: the C++ lowbit_dequantize fused scale * u + offset into one multiply-add for some elements (GCC contracts
# at -O3 -march=native) where the PyTorch fallback rounded the product first; with fp32 qparams they differed in the
# last bits of ~half the weights, and a code equal to an integer zero point dequantized to ~1e-7, not 0. Now
# both round once (std::fma; float64 in PyTorch), and dense's dequantize() uses the primitives' rounding.
_DENSE = {
    "uint4-bf16-float-zero": (torch.uint4, MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT, torch.bfloat16, 128),
    "int4-fp32": (torch.int4, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.float32, 128),
    "uint4-int-zero": (torch.uint4, MappingType.ASYMMETRIC, ZeroPointDomain.INT, torch.float32, 32),
    "int3-bf16": (torch.int3, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.bfloat16, 32),
    "int3-fp32": (torch.int3, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.float32, 32),
    "fp8": (torch.float8_e4m3fn, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.float32, 256),
}
_DENSE_PARAMS = list(_DENSE)


def _needs_cpp():
    if not cpp.is_available():
        pytest.skip(f"C++ kernels unavailable: {cpp.unavailable_reason()}")


@pytest.mark.parametrize("case", _DENSE_PARAMS)
def test_dense_dequantize_is_the_same_with_and_without_the_cpp_library(case):
    _needs_cpp()
    qw = _dense(*_DENSE[case])
    t, spec = qw.tensors, qw.spec
    # (a bf16 scale of symmetric codes is stored alone: offset = scale * quant_min)
    args = (t["qdata"], t["scale"], t.get("offset"), spec.target.bits, spec.block_size[1], *spec.shape,
            cpp.codes_kind(spec.target), dense_code_offset(spec, "offset" in t))
    # the op: the C++ kernel and the PyTorch implementation that runs where the library is not built
    op = torch.ops.affineq.lowbit_dequantize(*args)
    assert torch.equal(op.view(torch.int32), cpp._dequantize(*args).view(torch.int32))
    # dequantize(): the primitives' values whichever format "auto" picked (dense with C++, plain without)
    assert torch.equal(qw.dequantize().view(torch.int32), qw.to_format("plain").dequantize().view(torch.int32))


def test_dense_int_zero_point_keeps_zero_exact_with_the_cpp_library():
    # preserve_zero: a weight of exactly 0 has a code whose dequantized value is exactly 0 (plain and the
    # PyTorch dense path give 0; the fused C++ path leaves scale * zp - round(scale * zp), ~1e-7)
    _needs_cpp()
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    w[:, ::7] = 0
    qw = AQT.from_spec(w, (1, 32), QParamOptions(scale_dtype=torch.float32), target=torch.uint4,
                       mapping_type=MappingType.ASYMMETRIC, packing_format="dense")
    plain = AQT.from_spec(w, (1, 32), target=torch.uint4, mapping_type=MappingType.ASYMMETRIC)
    assert torch.equal(plain.dequantize()[w == 0], w[w == 0])
    assert (qw.dequantize()[w == 0] == 0).all()


# -- 10. low-bit storage ----------------------------------------------------------------------------------------


def _quantized_linear(config, n=256, k=512):
    m = _seq(nn.Linear(k, n, bias=False))
    w = m[0].weight.detach().clone()
    quantize_(m, config)
    return m, w


def _bytes_per_weight(config) -> float:
    qw = _quantized_linear(config)[0][0].weight
    return qw.storage_bytes() / qw.numel()


def test_low_bit_storage_per_weight():
    int2 = _bytes_per_weight(IntxWeightOnlyConfig(torch.int2, PerGroup(32)))
    int3 = _bytes_per_weight(IntxWeightOnlyConfig(torch.int3, PerGroup(32)))
    int4 = _bytes_per_weight(Int4WeightOnlyConfig(group_size=128))
    assert int2 <= 0.375 and int3 <= 0.5 and int2 < int4
    assert _bytes_per_weight(IntxWeightOnlyConfig(torch.int2, PerGroup(32), scale_dtype=torch.float32)) == 0.5


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.int2, torch.int3], ids=["int2", "int3"])
def test_low_bit_qparams_are_exact_and_the_kernel_matches_dequantize(dtype, scale_dtype):
    from affineq.primitives import choose_qparams_affine, dequantize_affine, quantize_affine

    m, w = _quantized_linear(IntxWeightOnlyConfig(dtype, PerGroup(32), scale_dtype=scale_dtype))
    qw = m[0].weight
    assert qw.packing_format == "dense"
    scale, _ = choose_qparams_affine(w, MappingType.SYMMETRIC, (1, 32), dtype, scale_dtype=scale_dtype,
                                     zero_point_domain=ZeroPointDomain.NONE)
    codes = quantize_affine(w, (1, 32), scale, None, dtype, zero_point_domain=ZeroPointDomain.NONE)
    assert qw.scale.dtype == scale_dtype and torch.equal(qw.scale.reshape(scale.shape), scale)
    assert torch.equal(qw.codes(), codes)
    ref = dequantize_affine(codes, (1, 32), scale, None, dtype, zero_point_domain=ZeroPointDomain.NONE,
                            output_dtype=torch.float32)
    torch.testing.assert_close(qw.dequantize(), ref, rtol=1e-6, atol=1e-7)
    x = torch.randn(5, 512)
    with torch.no_grad():
        out = m(x)
    expected = F.linear(x, qw.dequantize())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
