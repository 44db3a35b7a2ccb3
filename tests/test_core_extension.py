"""The core's extension points (issue #10): module swaps, named parameters, targets without a torch dtype,
activation tensors, the portable spec and `from_tensors`, per-class op tables."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import save_load as _roundtrip
from conftest import sqnr
from torch import nn

import affineq
from affineq import (
    ActivationQuant,
    AffineQuantizedTensor,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    MappingType,
    QuantizationError,
    QuantSpec,
    ZeroPointDomain,
    quantize_,
    record_kernels,
)
from affineq.dtypes import IntFormat, QType, qtype
from affineq.tensor.formats import FORMATS
from affineq.tensor.spec import QParamOptions

AQT = AffineQuantizedTensor




def _state(model: nn.Module) -> dict:
    """Every parameter and buffer object by name, and the module objects (identity, not values)."""
    return {"params": dict(model.named_parameters(remove_duplicate=False)),
            "buffers": dict(model.named_buffers()), "modules": dict(model.named_modules())}


# -- 1. handlers that swap modules, and named parameters ---------------------------------------------------


class Doubled(nn.Module):
    """A stand-in for a swapped module (an RNN, a QAT module): wraps the original and doubles its output."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def _swap_config():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class SwapConfig(affineq.QuantConfig):
        fail_on: str = ""

        def check(self, module):
            return None

    @affineq.register_quantize_module_handler(SwapConfig)
    def _swap(module, config):
        if config.fail_on and module.out_features == int(config.fail_on):
            raise RuntimeError("swap failed")
        return Doubled(module)

    return SwapConfig


def test_a_handler_that_returns_a_new_module_is_installed_under_the_same_name():
    SwapConfig = _swap_config()
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    ref = m(x)
    inner0, inner2 = m[0], m[2][0]
    quantize_(m, SwapConfig())
    assert isinstance(m[0], Doubled) and m[0].inner is inner0
    assert isinstance(m[2][0], Doubled) and m[2][0].inner is inner2
    expect = 2 * inner2(F.relu(2 * inner0(x)))
    torch.testing.assert_close(m(x), expect)
    assert not torch.allclose(m(x), ref)


def test_a_failing_swap_restores_every_earlier_swap():
    SwapConfig = _swap_config()
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    before = _state(m)
    with pytest.raises(QuantizationError, match="'2'.*left unchanged.*swap failed"):
        quantize_(m, SwapConfig(fail_on="4"))
    after = _state(m)
    assert after["modules"].keys() == before["modules"].keys()
    assert all(after["modules"][k] is v for k, v in before["modules"].items())
    assert all(after["params"][k] is v for k, v in before["params"].items())


def test_a_handler_must_return_a_module():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class NoneConfig(affineq.QuantConfig):
        pass

    @affineq.register_quantize_module_handler(NoneConfig)
    def _none(module, config):
        return None

    m = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(QuantizationError, match="must return the module"):
        quantize_(m, NoneConfig())
    assert isinstance(m[0], nn.Linear)


def test_fqn_to_config_quantizes_a_named_rnn_parameter():
    torch.manual_seed(0)
    lstm = nn.LSTM(64, 32, batch_first=True)
    model = nn.Sequential(lstm)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        ref, _ = lstm(x)
    quantize_(model, FqnToConfig({"0.weight_ih_l0": Int8WeightOnlyConfig(packing_format="plain")}))
    assert isinstance(lstm.weight_ih_l0, AQT) and lstm.weight_ih_l0.target_dtype == torch.int8
    assert not isinstance(lstm.weight_hh_l0, AQT)
    with pytest.warns(affineq.KernelFallbackWarning), torch.no_grad():
        out, _ = lstm(x)
    assert sqnr(ref, out) > 35


def test_param_names_quantize_a_bare_parameter_and_in_proj_weight():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 64))

        def forward(self, x):
            return F.linear(x, self.w)

    blk = Block()
    x = torch.randn(4, 64)
    ref = blk(x)
    quantize_(blk, Int8WeightOnlyConfig(param_names=("w",)), filter_fn=lambda m, fqn: fqn == "")
    assert isinstance(blk.w, AQT)
    assert sqnr(ref, blk(x)) > 35

    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    q = torch.randn(2, 3, 64)
    ref, _ = mha(q, q, q)
    cfg = Int8WeightOnlyConfig(param_names=("in_proj_weight",), packing_format="plain")
    quantize_(mha, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.MultiheadAttention))
    assert isinstance(mha.in_proj_weight, AQT)
    with torch.no_grad():
        out, _ = mha(q, q, q)
    assert sqnr(ref, out) > 35


def test_unknown_parameter_names_are_reported_and_nothing_changes():
    m = nn.Sequential(nn.Linear(8, 8))
    before = _state(m)
    with pytest.raises(QuantizationError, match="no parameter 'weight_ih'"):
        quantize_(m, Int8WeightOnlyConfig(param_names=("weight_ih",)))
    with pytest.raises(QuantizationError, match="does not have.*'0.nope'"):
        quantize_(m, FqnToConfig({"0.nope": Int8WeightOnlyConfig()}))
    with pytest.raises(ValueError, match="param_names"):
        Int8WeightOnlyConfig(param_names="weight")
    assert all(_state(m)["params"][k] is v for k, v in before["params"].items())


# -- 2. targets without a torch dtype ------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1"])
def test_float_target_without_torch_dtype_through_spec_pack_dequantize_save_load(target):
    t = qtype(target)
    assert t.torch_dtype is None and t.container == torch.uint8
    w = torch.randn(16, 64)
    qw = AQT.from_spec(w, (1, 32), target=t, mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE)
    assert qw.target is t and qw.target_dtype is t and qw.codes().dtype == torch.uint8
    assert int(qw.codes().max()) < 2 ** t.bits
    # dequantized = scale * the value of the code, and that value is the format's nearest to w / scale
    grid = t.decode(qw.codes()).view(16, 2, 32)
    torch.testing.assert_close(qw.dequantize().view(16, 2, 32), grid * qw.scale.view(16, 2, 1), rtol=0, atol=0)
    values = t.decode(torch.arange(2 ** t.bits, dtype=torch.uint8))
    scaled = (w.view(16, 2, 32) * (1 / qw.scale.view(16, 2, 1))).clamp(-t.qmax, t.qmax)
    nearest = (values.view(1, 1, 1, -1) - scaled.unsqueeze(-1)).abs().min(-1).values
    torch.testing.assert_close((grid - scaled).abs(), nearest, rtol=0, atol=1e-6)
    back = _roundtrip({"w": qw})["w"]
    assert torch.equal(back, qw) and back.spec == qw.spec and back.spec.target is t
    assert QuantSpec.from_dict(json.loads(json.dumps(qw.spec.to_dict()))) == qw.spec
    # `dense` bit-packs the codes (the C++ kernel's layout, tests/test_cpp_float_codes.py) and dequantizes alike
    dense = AQT.from_spec(w, (1, 32), target=t, mapping_type=MappingType.SYMMETRIC,
                          zero_point_domain=ZeroPointDomain.NONE, packing_format="dense")
    assert torch.equal(dense.dequantize(), qw.dequantize())


def test_a_registered_integer_target_without_torch_dtype():
    int12 = affineq.dtypes.register_qtype(QType("int12", IntFormat(12, True, torch.int16)))
    assert qtype("int12") is int12 and int12.torch_dtype is None
    w = torch.randn(8, 32)
    qw = AQT.from_spec(w, (1, 32), target=int12, mapping_type=MappingType.SYMMETRIC,
                       zero_point_domain=ZeroPointDomain.NONE)
    assert qw.codes().dtype == torch.int16 and int(qw.codes().abs().max()) <= 2047
    assert sqnr(w, qw.dequantize()) > 65
    back = _roundtrip({"w": qw})["w"]
    assert torch.equal(back.dequantize(), qw.dequantize()) and back.spec.target is int12
    with pytest.raises(ValueError, match="already registered"):
        affineq.dtypes.register_qtype(QType("int12", IntFormat(12, False, torch.int16)))


def test_power_of_two_scales_as_e8m0_bytes():
    w = torch.randn(8, 64) * 3
    spec = QuantSpec.create(w.shape, w.dtype, torch.float8_e4m3fn, (1, 32), mapping_type=MappingType.SYMMETRIC,
                            scale_type="e8m0")
    qw = AQT.from_spec(w, spec)
    assert qw.tensors["scale"].dtype == torch.uint8 and qw.spec.scale_type.name == "e8m0"
    s = qw.scale
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    plain = AQT.from_spec(w, (1, 32), target=torch.float8_e4m3fn, mapping_type=MappingType.SYMMETRIC)
    assert (s >= plain.scale.float()).all() and (s < 2 * plain.scale.float()).all()  # rounded up: no clipping
    assert sqnr(w, qw.dequantize()) > 25
    assert torch.equal(_roundtrip({"w": qw})["w"].dequantize(), qw.dequantize())
    with pytest.raises(ValueError, match="scale_type"):
        QuantSpec.create(w.shape, w.dtype, torch.int8, (1, 32), scale_type="float8_e4m3fn")
    dense = AQT.from_spec(w, spec.replace(fmt="dense"))  # exponent bytes, no offset (OCP MX, 8.25 bits)
    assert dense.tensors["scale"].dtype == torch.uint8 and torch.equal(dense.dequantize(), qw.dequantize())
    asymmetric = QuantSpec.create(w.shape, w.dtype, torch.int8, (1, 32), scale_type="e8m0", packing_format="dense")
    with pytest.raises(ValueError, match="packing_format='plain'"):
        AQT.from_spec(w, asymmetric)


# -- 3. activation tensors -------------------------------------------------------------------------------------


def _with_pre_scale(fmt: str):
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    pre = torch.rand(128) + 0.5
    qw = AQT.from_spec(w, (1, 128), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                       zero_point_domain=ZeroPointDomain.NONE, packing_format=fmt)
    return qw, qw.with_act_tensors(act_pre_scale=pre), pre


@pytest.mark.parametrize("fmt", ["plain", "dense"])
def test_act_pre_scale_is_applied_by_linear_before_the_kernel(fmt):
    qw, qwp, pre = _with_pre_scale(fmt)
    x = torch.randn(5, 128)
    with record_kernels() as used:
        y = F.linear(x, qwp)
    assert torch.equal(y, F.linear(x * pre, qw))
    # the packed kernel still runs (dense: our C++ kernel, which a build without a compiler lacks)
    packed = fmt == "plain" or affineq.cpp.is_available()
    assert all(not k.startswith("dequantize") for k in used) == packed, used
    assert torch.equal((x @ qwp.t()), y)  # the mm route goes through the same place


def test_act_tensors_survive_flatten_compile_slicing_and_weights_only_load():
    qw, qwp, pre = _with_pre_scale("plain")
    names, spec = qwp.__tensor_flatten__()
    assert "_act_pre_scale" in names
    rebuilt = AQT.__tensor_unflatten__({n: getattr(qwp, n) for n in names}, spec, qwp.shape, qwp.stride())
    assert torch.equal(rebuilt.act_tensors["act_pre_scale"], pre)
    back = _roundtrip({"w": qwp})["w"]
    assert torch.equal(back.act_tensors["act_pre_scale"], pre) and torch.equal(back, qwp)
    rows = qwp[16:48]
    assert torch.equal(rows.act_tensors["act_pre_scale"], pre)
    grouped = AQT.from_spec(torch.randn(64, 128), (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                            zero_point_domain=ZeroPointDomain.NONE).with_act_tensors(act_pre_scale=pre)
    cols = grouped[:, 32:96]
    assert torch.equal(cols.act_tensors["act_pre_scale"], pre[32:96])
    x = torch.randn(3, 128)
    assert torch.equal(F.linear(x, rows), F.linear(x * pre, qw[16:48]))
    with pytest.raises(ValueError, match="mix the input channels"):
        qwp.reshape(128, 64)
    assert torch.equal(qwp.to("cpu").act_tensors["act_pre_scale"], pre)

    torch._dynamo.reset()
    lin = nn.Linear(128, 64, bias=False)
    lin.weight = nn.Parameter(qwp, requires_grad=False)
    with torch.no_grad():
        eager = lin(x)
        compiled = torch.compile(lin, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_static_activation_qparams_are_used_as_calibrated():
    torch.manual_seed(2)
    w = torch.randn(32, 64)
    aq = ActivationQuant(torch.int8, MappingType.ASYMMETRIC, "per_tensor", ZeroPointDomain.INT, static=True)
    spec = QuantSpec.create(w.shape, w.dtype, torch.int8, (1, 64), mapping_type=MappingType.SYMMETRIC,
                            zero_point_domain=ZeroPointDomain.NONE, act_quant=aq)
    qw = AQT.from_spec(w, spec, affineq.QParamOptions(scale_dtype=torch.float32))
    with pytest.raises(ValueError, match="needs a calibrated act_scale"):
        AQT.from_tensors(qw.tensors, spec)
    scale, zp = torch.tensor([0.02]), torch.tensor([-3], dtype=torch.int32)
    qw = qw.with_act_tensors(act_scale=scale, act_zero_point=zp)
    x = torch.randn(6, 64)
    xq = affineq.primitives.quantize_affine(x, (6, 64), scale, zp, torch.int8)
    x_fq = affineq.primitives.dequantize_affine(xq, (6, 64), scale, zp, torch.int8)
    with record_kernels() as used:
        y = F.linear(x, qw)
    assert "aten._int_mm" not in used
    torch.testing.assert_close(y, F.linear(x_fq, qw.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(_roundtrip({"w": qw})["w"].act_tensors["act_scale"], scale)
    with pytest.raises(ValueError, match="no static activation quantization"):
        _with_pre_scale("plain")[0].with_act_tensors(act_scale=scale)
    with pytest.raises(ValueError, match="static=True.*per_tensor"):
        ActivationQuant(torch.int8, static=True)


# -- 4. the portable spec and from_tensors ---------------------------------------------------------------------


def _examples():
    w = torch.randn(32, 128)
    yield AQT.from_spec(w, (1, 32), QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False), target=torch.uint4,
                        mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                        packing_format="int4_cpu")
    yield AQT.from_spec(w, (1, 32), QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False), target=torch.uint4,
                        mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                        packing_format="dense")
    yield AQT.from_spec(w, (1, 32), target=torch.int3, mapping_type=MappingType.SYMMETRIC,
                        zero_point_domain=ZeroPointDomain.NONE, packing_format="dense")
    yield AQT.from_spec(w, (1, 128), target=torch.int8, mapping_type=MappingType.ASYMMETRIC, packing_format="plain",
                        act_quant=ActivationQuant(torch.int8, MappingType.ASYMMETRIC))
    yield AQT.from_spec(w, (32, 128), target=torch.float8_e5m2, mapping_type=MappingType.SYMMETRIC,
                        packing_format="plain")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_spec_json_round_trip_for_every_format(fmt):
    spec = QuantSpec.create((64, 256), torch.bfloat16, torch.uint4, (1, 64), mapping_type=MappingType.ASYMMETRIC,
                            zero_point_domain=ZeroPointDomain.FLOAT, packing_format=fmt, transposed=True,
                            act_quant=ActivationQuant("float8_e4m3fn", granularity="per_tensor"))
    d = json.loads(json.dumps(spec.to_dict()))
    assert d["version"] == 1 and d["target"] == "uint4" and d["format"] == fmt and d["dtype"] == "bfloat16"
    assert QuantSpec.from_dict(d) == spec


def test_spec_from_dict_rejects_versions_and_junk():
    d = QuantSpec.create((8, 8), torch.float32, torch.int8, (1, 8)).to_dict()
    with pytest.raises(ValueError, match="version 2 is not supported.*upgrade affineq"):
        QuantSpec.from_dict({**d, "version": 2})
    with pytest.raises(ValueError, match="no integer 'version'"):
        QuantSpec.from_dict({k: v for k, v in d.items() if k != "version"})
    with pytest.raises(ValueError, match="unknown keys \\['colour'\\]"):
        QuantSpec.from_dict({**d, "colour": 1})
    with pytest.raises(ValueError, match="not a known quantization type"):
        QuantSpec.from_dict({**d, "target": "int99"})
    with pytest.raises(ValueError, match="unknown enum member"):
        QuantSpec.from_dict({**d, "mapping_type": "SIDEWAYS"})
    with pytest.raises(ValueError, match="outside the range"):
        QuantSpec.from_dict({**d, "quant_max": 1000})


@pytest.mark.parametrize("qw", list(_examples()), ids=lambda q: q.packing_format + "-" + str(q.target))
def test_from_tensors_round_trip_and_rejections(qw):
    spec = QuantSpec.from_dict(json.loads(json.dumps(qw.spec.to_dict())))
    back = AQT.from_tensors(qw.tensors, spec)
    assert torch.equal(back, qw)
    name = next(iter(qw.tensors))
    with pytest.raises(ValueError, match="stores tensors"):
        AQT.from_tensors({**qw.tensors, "extra": qw.qdata}, spec)
    with pytest.raises(ValueError, match="stores tensors"):
        AQT.from_tensors({k: v for k, v in qw.tensors.items() if k != name}, spec)
    scale_name = [n for n in qw.tensors if n != "qdata"][0]
    bad = qw.tensors[scale_name]
    with pytest.raises(ValueError, match=f"tensors\\['{scale_name}'\\] has shape"):
        AQT.from_tensors({**qw.tensors, scale_name: bad.reshape(-1)[:-1]}, spec)
    with pytest.raises(ValueError, match="tensors\\['qdata'\\] has dtype"):
        AQT.from_tensors({**qw.tensors, "qdata": qw.qdata.to(torch.float32)}, spec)
    with pytest.raises(ValueError, match="spec must be a QuantSpec"):
        AQT.from_tensors(qw.tensors, spec.to_dict())


def test_device_layouts_convert_to_a_portable_one_exactly():
    qw = next(_examples())  # int4_cpu
    portable = qw.to_portable()
    assert portable.packing_format == "plain" and torch.equal(portable.dequantize(), qw.dequantize())
    again = portable.to_format("int4_cpu")
    assert again.spec == qw.spec and all(torch.equal(a, b) for a, b in zip(again.tensors.values(),
                                                                            qw.tensors.values(), strict=True))
    dense = _examples().__next__().to_format("dense")
    assert dense.to_portable() is dense


def test_unflatten_checks_the_stored_names():
    qw = next(_examples())
    names, spec = qw.__tensor_flatten__()
    with pytest.raises(ValueError, match="stores tensors"):
        AQT.__tensor_unflatten__({"_qdata": qw.qdata}, spec, qw.shape, qw.stride())


# -- 5. per-class op tables -------------------------------------------------------------------------------------


def test_a_subclass_inherits_the_op_tables_and_overrides_one_entry():
    class Marked(AQT):
        pass

    calls = []

    @Marked.implements(torch.ops.aten.clone.default)
    def _clone(func, args, kwargs):
        calls.append(func)
        return args[0]

    w = torch.randn(16, 32)
    plain = AQT.from_spec(w, (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    marked = Marked(plain.tensors, plain.spec)
    assert marked.clone() is marked and calls == [torch.ops.aten.clone.default]
    assert plain.clone() is not plain and len(calls) == 1  # the parent's table is untouched
    sliced = marked[:8]  # inherited structural op keeps the subclass
    assert type(sliced) is Marked and torch.equal(sliced.dequantize(), plain.dequantize()[:8])
    assert Marked.op_handler(F.linear) is AQT.op_handler(F.linear)


def test_spec_factory_is_the_one_way_in():
    w = torch.randn(16, 64)
    spec = QuantSpec.create(w.shape, w.dtype, torch.uint4, (1, 32), mapping_type=MappingType.ASYMMETRIC,
                            zero_point_domain=ZeroPointDomain.FLOAT, packing_format="dense")
    a = AQT.from_spec(w, spec, affineq.QParamOptions(scale_dtype=torch.float32, preserve_zero=False))
    b = AQT.from_spec(w, (1, 32), QParamOptions(scale_dtype=torch.float32, preserve_zero=False), target=torch.uint4,
                      mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                      packing_format="dense")
    assert torch.equal(a, b)
    c = AQT.from_qparams(w, a.scale, a.zero_point, spec)
    assert torch.equal(c, a)
    assert QuantSpec.create(w.shape, w.dtype, torch.float8_e4m3fn, (1, 64)).zero_point_domain is ZeroPointDomain.NONE
    cfg = Int4WeightOnlyConfig(group_size=32)
    lin = nn.Linear(64, 16)
    assert cfg.weight_spec(lin.weight, lin).block_size == (1, 32)
    assert torch.equal(cfg.quantize_weight(lin.weight.detach(), lin),
                       AQT.from_spec(lin.weight.detach(), cfg.weight_spec(lin.weight, lin), cfg.qparam_options()))


def test_model_deepcopy_keeps_act_tensors():
    _, qwp, _ = _with_pre_scale("dense")
    lin = nn.Linear(128, 64, bias=False)
    lin.weight = nn.Parameter(qwp, requires_grad=False)
    other = copy.deepcopy(lin)
    assert torch.equal(other.weight.act_tensors["act_pre_scale"], qwp.act_tensors["act_pre_scale"])


def test_a_registered_kernel_binds_once_per_weight_and_input_dtype():
    # `bind(spec, dtype)` runs when the kernel is chosen (once per weight, input dtype and bucket of M: cached with
    # the choice) and its runner on every eager call; `run` itself is not called where `bind` is given.
    from affineq.tensor.kernel_registry import LINEAR_KERNELS, clear_selection_cache

    binds, calls = [], []

    def bind(spec, dtype):
        binds.append((spec.shape, dtype))

        def run(x, w, bias):
            calls.append(x.dtype)
            return F.linear(x, w.dequantize(x.dtype), bias)

        return run

    affineq.kernels.register_linear_kernel("test.bound", ("plain",), lambda x, w: None,
                                           lambda x, w, b: pytest.fail("bind's runner runs, not run"), bind=bind)
    LINEAR_KERNELS.insert(0, LINEAR_KERNELS.pop())  # tried first
    try:
        lin = quantize_(nn.Linear(64, 32, bias=False), Int8WeightOnlyConfig(packing_format="plain"))
        x = torch.randn(3, 64)
        with torch.no_grad(), record_kernels() as used:
            for dtype in (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16):
                y = lin(x.to(dtype))
                want = F.linear(x.to(dtype), lin.weight.dequantize(dtype))
                assert y.dtype == dtype and torch.equal(y, want)
        assert binds == [((32, 64), torch.float32), ((32, 64), torch.bfloat16)]
        assert calls == [torch.float32] * 2 + [torch.bfloat16] * 2 and used == ["test.bound"] * 4
    finally:
        LINEAR_KERNELS[:] = [k for k in LINEAR_KERNELS if k.name != "test.bound"]
        clear_selection_cache()
