"""Issue 28, the config / class / runtime side: what a dict or a pickle may name (allow-lists, never attribute
walks), type-checked config fields, settings that take effect or are refused, one quantize_ per model at a
time, frozen quantized weights that run inference, errors that name the calibration item / layer / field."""

import copy
import threading

import pytest
import torch
from torch import nn

import affineq
from affineq import (
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    MappingType,
    QATConfig,
    QuantizationError,
    ZeroPointDomain,
    config_from_dict,
    quantize_,
    register_quantize_module_handler,
)
from affineq.observers import (
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)
from affineq.primitives import quantize_affine
from affineq.quark import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationSpec, register_observer
from tests.conftest import assert_unchanged, snapshot_model

W8 = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)


def _config_dict(**spec) -> dict:
    return Config(QuantizationConfig(weight=QuantizationSpec(Dtype.int8, **spec))).to_dict()


# -- finding 2: classes come from allow-lists; nothing is imported or walked -------------------------------


@pytest.mark.parametrize("ref", [
    {"module": "torch.nn", "qualname": "parameter.torch.ctypes.CDLL"},  # the attribute walk of the issue
    {"module": "affineq.observers", "qualname": "torch.nn.Module"},
    {"module": "affineq.observers", "qualname": "Observer"},  # the abstract base is not an observer to run
    {"module": "os", "qualname": "system"},
    {"module": "torch.nn.modules.linear", "qualname": "Linear"},  # a class, but not an observer
    {"module": "affineq.observers", "qualname": "PerTensorMSEObserver", "extra": 1},
])
def test_observer_cls_from_json_resolves_only_registered_observers(ref):
    d = _config_dict()
    d["global_quant_config"]["weight"]["observer_cls"] = ref
    with pytest.raises(ValueError, match=r"QuantizationSpec\.observer_cls"):
        Config.from_dict(d)


def test_observer_cls_from_json_finds_affineq_observers_and_registered_ones():
    d = _config_dict(observer_cls=PerTensorMSEObserver)
    assert Config.from_dict(d).global_quant_config.weight.observer_cls is PerTensorMSEObserver

    class MyObserver(PerTensorMinMaxObserver):
        pass

    d = _config_dict(observer_cls=MyObserver)
    with pytest.raises(ValueError, match="refusing to load .*MyObserver"):
        Config.from_dict(d)
    assert register_observer(MyObserver) is MyObserver
    assert Config.from_dict(d).global_quant_config.weight.observer_cls is MyObserver
    with pytest.raises(ValueError, match="subclass of affineq.observers.Observer"):
        register_observer(nn.Linear)


def test_observed_weight_config_from_json_resolves_only_registered_observers():
    """The config a Quark weight spec with an observer becomes (what a saved plan stores) reads its observer from
    the same allow-list as QuantizationSpec, and its error names its own field."""
    from affineq._quark_mapping import ObservedWeightConfig

    c = ObservedWeightConfig(Int8WeightOnlyConfig(), PerChannelMinMaxObserver)
    d = c.to_dict()
    assert config_from_dict(d) == c
    d["observer_cls"] = {"module": "os", "qualname": "system"}
    with pytest.raises(ValueError, match=r"ObservedWeightConfig\.observer_cls: refusing to load os\.system"):
        config_from_dict(d)


def test_layer_type_keys_resolve_only_torch_nn_module_classes():
    d = Config(QuantizationConfig(), layer_type_quant_config={nn.Linear: QuantizationConfig(weight=W8)}).to_dict()
    assert Config.from_dict(d).layer_type_quant_config.keys() == {nn.Linear}
    v = d["layer_type_quant_config"].popitem()[1]
    for key in ("class:torch.nn:parameter.torch.ctypes.CDLL", "class:torch.nn.modules.linear:Linear.__init__",
                "class:torch.nn.modules.linear:F", "class:builtins:eval"):
        d["layer_type_quant_config"] = {key: v}
        with pytest.raises(ValueError, match="refusing to load .*not one of the torch.nn module classes"):
            Config.from_dict(d)


def test_no_dict_parser_imports_or_getattrs_a_name(monkeypatch):
    """config_from_dict / Config.from_dict look names up in tables: a name that is an attribute path or a
    non-dtype attribute of torch never resolves."""
    for bad in ({"type": "Int4WeightOnlyConfig", "scale_dtype": {"dtype": "nn"}},
                {"type": "Int4WeightOnlyConfig", "scale_dtype": {"dtype": "float32.__class__"}},
                {"type": "IntxWeightOnlyConfig", "granularity": {"granularity": "torch"}},
                {"type": "IntxWeightOnlyConfig", "granularity": {"granularity": "Granularity"}}):
        with pytest.raises(ValueError):
            config_from_dict(bad)


# -- finding 3 and 11: field types, unknown keys, missing fields -------------------------------------------


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(exclude="head"), r"Config\.exclude='head': use a list"),
    (lambda d: d.update(exclude=["head", 3]), r"Config\.exclude=.*use a list"),
    (lambda d: d.update(layer_quant_config=["lm_head"]), r"Config\.layer_quant_config=.*use a dict"),
    (lambda d: d.update(layer_type_quant_config="Linear"), r"Config\.layer_type_quant_config=.*use a dict"),
    (lambda d: d.update(quant_mode=["eager_mode"]), r"Config\.quant_mode="),
    (lambda d: d.update(excludes=["lm_head"]), r"Config\.from_dict: unknown keys \[\"'excludes'\"\]"),
    (lambda d: d.pop("global_quant_config"), r"no 'global_quant_config'"),
    (lambda d: d["global_quant_config"].update(wieght=None), r"QuantizationConfig\.from_dict: unknown keys"),
    (lambda d: d["global_quant_config"]["weight"].update(dtype=["int8"]), r"QuantizationSpec\.dtype=\['int8'\]"),
    (lambda d: d["global_quant_config"]["weight"].pop("dtype"), r"QuantizationSpec.from_dict: .*no 'dtype'"),
    (lambda d: d["global_quant_config"].update(target_device=["CPU"]), r"QuantizationConfig\.target_device="),
    (lambda d: d["global_quant_config"].update(weight="int8"), r"global_quant_config: QuantizationConfig\.weight"),
])
def test_quark_config_from_dict_checks_every_field(change, match):
    d = _config_dict()
    change(d)
    with pytest.raises(ValueError, match=match):
        Config.from_dict(d)


def test_exclude_given_as_a_string_is_refused_not_split_into_letters():
    d = Config(QuantizationConfig(weight=W8), exclude=["head"]).to_dict()
    d["exclude"] = "head"  # before the fix: exclude ('h', 'e', 'a', 'd'), so "head" was quantized
    with pytest.raises(ValueError, match="exclude='head'"):
        Config.from_dict(d)


@pytest.mark.parametrize(("d", "match"), [
    ({"type": "Int4WeightOnlyConfig", "group_size": 32, "groupsize": 32}, r"no fields \['groupsize'\]"),
    ({"type": "Int4WeightOnlyConfig", "scale_dtype": {"dtype": "float32", "x": 1}}, r"unknown keys"),
    ({"type": "Int4WeightOnlyConfig", "mapping_type": {"enum": "MappingType", "name": "SYMMETRIC", "x": 1}},
     r"unknown keys"),
    ({"type": "Int4WeightOnlyConfig", "mapping_type": {"enum": "MappingType", "name": ["SYMMETRIC"]}},
     r"MappingType has no member"),
    ({"type": "FqnToConfig", "fqn_to_config": {}, "extra": 1}, r"no other keys"),
    ({"type": "FqnToConfig", "fqn_to_config": {"a": {"map": {}, "x": 1}}}, r"unknown keys"),
    ({"type": "Int4WeightOnlyConfig", "param_names": "weight"}, r"param_names='weight' must be a non-empty tuple"),
    ({"type": "Int4WeightOnlyConfig", "group_size": [32]}, r"group_size"),
])
def test_config_from_dict_checks_keys_and_types(d, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(d)


def test_affineq_config_from_dict_refuses_unknown_keys():
    from affineq.hf import AffineqConfig

    good = AffineqConfig(Int8WeightOnlyConfig()).to_dict()
    assert AffineqConfig.from_dict(good).quant_config == Int8WeightOnlyConfig()
    with pytest.raises(ValueError, match=r"unknown keys \[\"'modules_to_not_quantize'\"\]"):
        AffineqConfig.from_dict({**good, "modules_to_not_quantize": ["lm_head"]})
    with pytest.raises(ValueError, match="modules_to_not_convert must be a list"):
        AffineqConfig.from_dict({**good, "modules_to_not_convert": "lm_head"})


# -- finding 7: QAT convert without prepare ------------------------------------------------------------------


def test_qat_convert_of_a_model_never_prepared_raises_and_changes_nothing():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    snap = snapshot_model(model)
    with pytest.raises(QuantizationError, match=r"no fake-quantized module.*run the prepare step first.*"
                                                r"step='prepare'"):
        quantize_(model, QATConfig(Int8WeightOnlyConfig(), step="convert"))
    assert_unchanged(model, snap)


# -- finding 8: a weight's observer_cls takes effect -----------------------------------------------------------


def _outlier_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(16, 64, generator=g) * 2 - 1) * 0.125  # nn.Linear(64, 16)'s init range
    w[3, 5] = 2.0
    return w


def _quantize_int4_per_tensor(w: torch.Tensor, observer_cls) -> affineq.AffineQuantizedTensor:
    model = nn.Sequential(nn.Linear(64, 16, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
    spec = QuantizationSpec(Dtype.int4, qscheme=QSchemeType.per_tensor, symmetric=True, observer_cls=observer_cls)
    quantize_(model, Config(QuantizationConfig(weight=spec)))
    return model[0].weight


@pytest.mark.parametrize("observer_cls", [PerTensorMSEObserver, PerTensorPercentileObserver])
def test_weight_observer_is_run_over_the_weight(observer_cls):
    w = _outlier_weight()
    q = _quantize_int4_per_tensor(w, observer_cls)
    by_hand = observer_cls(dtype=torch.int4, mapping_type=MappingType.SYMMETRIC,
                           zero_point_domain=ZeroPointDomain.NONE)
    by_hand(w)
    scale, zp = by_hand.calculate_qparams()
    want = quantize_affine(w, (16, 64), scale, zp, torch.int4, -8, 7, ZeroPointDomain.NONE)
    assert torch.equal(q.codes(), want)
    assert torch.equal(q.scale.reshape(()), scale.reshape(()))
    min_max = _quantize_int4_per_tensor(w, None)
    assert not torch.equal(q.codes(), min_max.codes())  # before the fix: identical (observer ignored)
    if observer_cls is PerTensorMSEObserver:  # its whole point: a lower error than min / max
        err = ((q.dequantize() - w) ** 2).mean()
        err_min_max = ((min_max.dequantize() - w) ** 2).mean()
        assert err < 0.6 * err_min_max, (err, err_min_max)


def test_min_max_observer_gives_min_max_codes():
    w = _outlier_weight()
    assert torch.equal(_quantize_int4_per_tensor(w, PerTensorMinMaxObserver).codes(),
                       _quantize_int4_per_tensor(w, None).codes())


@pytest.mark.parametrize(("kw", "observer_cls"), [
    (dict(dtype=Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True), PerChannelMinMaxObserver),
    (dict(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=False),
     PerGroupMinMaxObserver),
])
def test_per_channel_and_per_group_min_max_observers_run_on_packed_weights(kw, observer_cls):
    model = nn.Sequential(nn.Linear(64, 16))
    plain = quantize_(copy.deepcopy(model), Config(QuantizationConfig(weight=QuantizationSpec(**kw))))[0].weight
    observed = quantize_(model, Config(QuantizationConfig(weight=QuantizationSpec(**kw, observer_cls=observer_cls))))
    observed = observed[0].weight
    assert observed.spec == plain.spec  # same packed format (the C++ kernel's), same blocks
    assert torch.equal(observed.codes(), plain.codes()) and torch.equal(observed.scale, plain.scale)


@pytest.mark.parametrize(("qc", "match"), [
    (QuantizationConfig(weight=QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0,
                                                observer_cls=PerTensorMSEObserver)),
     r"weight.*PerTensorMSEObserver gives qparams per block \(16, 64\), but the weight spec wants blocks \(1, 64\)"),
    (QuantizationConfig(weight=QuantizationSpec(Dtype.int8, observer_cls=nn.Identity)),
     r"weight\.observer_cls=Identity is not an affineq observer"),
    (QuantizationConfig(weight=QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0,
                                                symmetric=True, observer_cls=PerTensorMSEObserver),
                        input_tensors=QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel,
                                                       symmetric=True)),
     r"weight\.observer_cls=PerTensorMSEObserver: weights of layers with quantized inputs get min / max"),
    (QuantizationConfig(weight=W8, input_tensors=QuantizationSpec(
        Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel, symmetric=True,
        observer_cls=PerTensorPercentileObserver)),
     r"input_tensors\.observer_cls=PerTensorPercentileObserver: dynamic activations"),
])
def test_observers_that_cannot_take_effect_are_refused(qc, match):
    model = nn.Sequential(nn.Linear(64, 16))
    snap = snapshot_model(model)
    with pytest.raises(QuantizationError, match=match):
        quantize_(model, Config(qc))
    assert_unchanged(model, snap)


def test_observed_weight_config_round_trips():
    model = nn.Sequential(nn.Linear(64, 16))
    spec = QuantizationSpec(Dtype.int4, qscheme=QSchemeType.per_tensor, symmetric=True,
                            observer_cls=PerTensorMSEObserver)
    fqn = Config(QuantizationConfig(weight=spec)).to_fqn_config(model)
    assert config_from_dict(fqn.to_dict()) == fqn


# -- finding 9: one quantize_ per model at a time --------------------------------------------------------------


class _SlowConfig(Int8WeightOnlyConfig):
    pass


_started, _release = threading.Event(), threading.Event()


@register_quantize_module_handler(_SlowConfig)
def _slow_handler(module, config):
    _started.set()
    assert _release.wait(10)
    module.weight = nn.Parameter(config.quantize_weight(module.weight.detach(), module), requires_grad=False)
    return module


def test_a_second_thread_quantizing_the_same_model_raises_at_once():
    _started.clear()
    _release.clear()
    model = nn.Sequential(nn.Linear(64, 16), nn.Sequential(nn.Linear(16, 8)))
    results = {}

    def first():
        try:
            quantize_(model, _SlowConfig())
            results["first"] = "ok"
        except Exception as e:  # pragma: no cover - reported by the assert below
            results["first"] = e

    t = threading.Thread(target=first)
    t.start()
    try:
        assert _started.wait(10)
        snap = snapshot_model(model)
        for target in (model, model[1]):  # the model, or a module inside it
            with pytest.raises(QuantizationError, match="another thread is quantizing this .*does not wait"):
                quantize_(target, Int8WeightOnlyConfig())
        assert_unchanged(model, snap)
        other = quantize_(nn.Sequential(nn.Linear(64, 16)), Int8WeightOnlyConfig())  # other models run
        assert isinstance(other[0].weight, affineq.AffineQuantizedTensor)
    finally:
        _release.set()
        t.join(10)
    assert results["first"] == "ok"
    assert all(isinstance(m.weight, affineq.AffineQuantizedTensor) for m in (model[0], model[1][0]))
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, f: False)  # the lock was released


# -- finding 12: a quantized weight loaded with requires_grad=True runs inference ------------------------------


@pytest.mark.parametrize("config", [Int8WeightOnlyConfig(), Int4WeightOnlyConfig(group_size=32)])
def test_load_state_dict_assign_then_inference_works_and_backward_names_the_fix(config):
    quantized = quantize_(nn.Sequential(nn.Linear(64, 32), nn.ReLU(inplace=True), nn.Linear(32, 8)), config)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(inplace=True), nn.Linear(32, 8))
    model.load_state_dict(quantized.state_dict(), assign=True)
    assert model[0].weight.requires_grad  # what torch's assign=True does
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = quantized(x)
    y = model(x)  # before the fix: RuntimeError here
    assert torch.equal(y.detach(), want)
    xg = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(model(xg).sum(), xg)  # an input gradient needs no weight gradient
    assert gx.shape == x.shape
    with pytest.raises(RuntimeError, match=r"requires_grad=True.*Call weight\.requires_grad_\(False\)"):
        model(x).sum().backward()


def test_embedding_with_requires_grad_runs_and_refuses_its_gradient():
    for module in (nn.Embedding(10, 64), nn.EmbeddingBag(10, 64)):
        model = quantize_(nn.Sequential(module), affineq.IntxWeightOnlyConfig(),
                          filter_fn=lambda m, fqn: fqn == "0")
        idx = torch.tensor([[1, 2]])
        with torch.no_grad():
            want = model(idx)
        model[0].weight.requires_grad_(True)
        y = model(idx)
        assert torch.equal(y.detach(), want)
        with pytest.raises(RuntimeError, match=r"requires_grad=True"):
            y.sum().backward()


# -- finding 11: tampered pickles fail at load; errors name the item / layer / fix ----------------------------


def _saved(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def _q8() -> affineq.AffineQuantizedTensor:
    return quantize_(nn.Sequential(nn.Linear(64, 32)), Int8WeightOnlyConfig(packing_format="plain"))[0].weight


def _tampered_spec(spec, **fields):
    bad = object.__new__(type(spec))  # what an edited pickle rebuilds: no constructor runs
    bad.__dict__.update({**spec.__dict__, **fields})
    return bad


@pytest.mark.parametrize(("tamper", "match"), [
    (lambda w: w.__dict__.pop("_scale"), r"stored tensors \['scale'\] are missing"),
    (lambda w: w.__dict__.update(_scale="junk"), r"stored tensors \['scale'\] are missing or not tensors"),
    (lambda w: w.__dict__.update(_scale=torch.ones(3, 1)), r"scale.*shape \(3, 1\)"),
    (lambda w: w.__dict__.update(_names=("qdata",)), r"stores tensors"),
    (lambda w: w.__dict__.update(spec="int8"), r"its spec is str, not a QuantSpec"),
    (lambda w: w.__dict__.update(dequantize=1), r"attributes \['dequantize'\] would replace the class's own"),
    (lambda w: w.__dict__.update(spec=_tampered_spec(w.spec, block_size=(1, 0))), r"QuantSpec\.block_size"),
    (lambda w: w.__dict__.update(spec=_tampered_spec(w.spec, quant_max=1000)), r"quant_max"),
    (lambda w: w.__dict__.update(spec=_tampered_spec(w.spec, target="int8")), r"QuantSpec\.target='int8'"),
    (lambda w: w.__dict__.update(spec=_tampered_spec(w.spec, shape=(64, 64))), r"spec describes"),
    (lambda w: w.__dict__.update(spec=_tampered_spec(w.spec, shape=(64, 32))), r"block_size=\(1, 64\): each entry "
                                                                              r"must divide its dim"),
])
def test_a_tampered_weights_only_pickle_fails_at_load(tamper, match):
    w = _q8()
    good = _load(_saved({"w": w}))["w"]  # the untouched pickle loads and runs
    assert torch.equal(good.dequantize(), w.dequantize())
    tamper(w)
    data = _saved({"w": w})
    with pytest.raises(ValueError, match=match):  # before the fix: loaded, AttributeError at first use
        _load(data)


def test_quant_spec_refuses_junk_positional_arguments():
    spec = _q8().spec
    with pytest.raises(ValueError, match=r"QuantSpec\.dtype='junk'"):
        type(spec)(spec.shape, "junk", spec.target, spec.block_size, spec.quant_min, spec.quant_max,
                   spec.zero_point_domain, spec.mapping_type, spec.fmt)
    with pytest.raises(ValueError, match=r"QuantSpec\.shape=5"):
        type(spec)(5, torch.float32, 6, 7, 8, 9, 10, 11, 12)
    with pytest.raises(ValueError, match=r"mapping_type"):
        spec.replace(mapping_type="SYMMETRIC")
    aq = affineq.ActivationQuant()
    missing = object.__new__(type(aq))  # an edited pickle: fields missing, no constructor run
    missing.__dict__.update({"dtype": aq.dtype})
    with pytest.raises(ValueError, match=r"cannot unpickle ActivationQuant: expected the fields"):
        _load(_saved(missing))
    with pytest.raises(ValueError, match=r"ActivationQuant\.granularity=None"):
        _load(_saved(_tampered_spec(aq, granularity=None)))


def test_graph_calibration_with_another_batch_size_says_to_pass_dynamic_shapes():
    from affineq.graph import prepare

    model = nn.Sequential(nn.Linear(16, 8))
    gm = prepare(model, affineq.Int8StaticActivationInt8WeightConfig(), (torch.randn(4, 16),))
    gm(torch.randn(4, 16))
    with pytest.raises(ValueError, match=r"traced with \(Guard failed.*pass dynamic_shapes to "
                                         r"affineq\.graph\.prepare"):
        gm(torch.randn(3, 16))  # before the fix: AssertionError: Guard failed
    batch = torch.export.Dim("batch")
    gm = prepare(model, affineq.Int8StaticActivationInt8WeightConfig(), (torch.randn(4, 16),),
                 dynamic_shapes=({0: batch},))
    gm(torch.randn(3, 16))  # the fix it names works


def test_dcp_load_into_other_shapes_names_each_tensor_and_loads_nothing(tmp_path):
    saved = quantize_(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)), Int8WeightOnlyConfig())
    affineq.dcp_save(saved, tmp_path)
    other = quantize_(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16)), Int8WeightOnlyConfig())
    snap = snapshot_model(other)
    with pytest.raises(ValueError, match=r"1\.weight: the checkpoint holds \(8, 32\), the model \(16, 32\)\n"
                                         r"  - 1\.bias: the checkpoint holds \(8,\), the model \(16,\)"):
        affineq.dcp_load(other, tmp_path)  # before the fix: torch's CheckpointException
    assert_unchanged(other, snap)
    same = quantize_(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)), Int8WeightOnlyConfig())
    affineq.dcp_load(same, tmp_path)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(same(x), saved(x))


@pytest.mark.parametrize(("data", "match"), [
    ([torch.randint(0, 64, (1, 2, 8))], r"calibration item 0 \(\[0\] \(1, 2, 8\)\): the integer tensor \(token ids\) "
                                        r"at \[0\] has 3 dims"),
    ([torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 0))], r"calibration item 1 .*is empty"),
    ([torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (8,))], r"calibration item 1 .*has 1 dims, item 0's has 2"),
    ([torch.randint(0, 64, (1, 8)), [1, 2]], r"calibration item 1 is a list"),
])
def test_gptq_calibration_items_are_checked_up_front(data, match):
    from affineq.models import build_tiny_lm

    model = build_tiny_lm(layers=1, dim=32, ffn=64, vocab=64)
    snap = snapshot_model(model)
    with pytest.raises(QuantizationError, match=match):
        quantize_(model, affineq.GPTQConfig(Int4WeightOnlyConfig(group_size=32)), calibration_data=data)
    assert_unchanged(model, snap)
