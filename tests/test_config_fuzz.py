"""Hypothesis fuzzing of every config parser that reads untrusted dicts (a checkpoint's config.json, a Quark
JSON): `config_from_dict`, Quark `Config.from_dict` / `QuantizationSpec.from_dict`, `QuantSpec.from_dict` and the
transformers `AffineqConfig.from_dict`. Inputs are valid dicts with random edits (values replaced by junk, keys
added or dropped, at any depth) and pure junk. Invariants: only ValueError (QuantizationError is one) escapes;
every class in a result is on an allow-list; no module is imported while parsing."""

import json
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from affineq import (
    FqnToConfig,
    GPTQConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    IntxWeightOnlyConfig,
    PerGroup,
    config_from_dict,
)
from affineq.configs import _CONFIGS
from affineq.observers import PerTensorMSEObserver
from affineq.quark import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationSpec
from affineq.quark_vocabulary import layer_type_registry, observer_registry
from affineq.tensor.spec import QuantSpec

FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NAMES = ["int8", "int4", "uint4", "float32", "bfloat16", "Linear", "os", "system", "torch.nn", "torch",
         "parameter.torch.ctypes.CDLL", "class:torch.nn:parameter.torch.ctypes.CDLL", "class:builtins:eval",
         "Int4WeightOnlyConfig", "FqnToConfig", "Config", "GPTQConfig", "MappingType", "SYMMETRIC", "PerGroup",
         "Granularity", "per_tensor", "per_channel", "eager_mode", "head", "affineq.observers",
         "PerTensorMSEObserver", "Observer", "__class__", "__subclasses__", "CPU", "IPU", "plain", "dense", "auto",
         "re:(a+)+", "_default", "e8m0"]
KEYS = ["type", "dtype", "enum", "name", "granularity", "map", "module", "qualname", "observer_cls", "weight",
        "input_tensors", "global_quant_config", "exclude", "group_size", "fqn_to_config", "quant_config",
        "quant_method", "version", "shape", "block_size", "target", "act_quant", "format"]

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(NAMES) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=3), inner,
                                                               max_size=3),
    max_leaves=8)


@st.composite
def edited(draw, obj, depth: int = 0):
    """`obj` (a JSON-like value) with random edits at random depths."""
    if isinstance(obj, dict) and obj and depth < 6:
        keys = list(obj)
        action = draw(st.sampled_from(["recurse", "recurse", "replace", "drop", "add", "keep"]))
        out = dict(obj)
        key = draw(st.sampled_from(keys))
        if action == "recurse":
            out[key] = draw(edited(obj[key], depth + 1))
        elif action == "replace":
            out[key] = draw(junk)
        elif action == "drop":
            del out[key]
        elif action == "add":
            out[draw(st.sampled_from(KEYS) | st.text(max_size=3))] = draw(junk)
        return out
    if isinstance(obj, list) and obj and depth < 6:
        i = draw(st.integers(0, len(obj) - 1))
        out = list(obj)
        out[i] = draw(edited(obj[i], depth + 1) | junk)
        return out
    return draw(st.just(obj) | junk)


W4 = QuantizationSpec(Dtype.uint4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=False,
                      observer_cls=PerTensorMSEObserver)
W8 = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)
QUARK = json.loads(json.dumps(Config(
    QuantizationConfig(weight=W8, input_tensors=QuantizationSpec(Dtype.int8, is_dynamic=True,
                                                                 qscheme=QSchemeType.per_channel, symmetric=True)),
    layer_type_quant_config={nn.Linear: QuantizationConfig(weight=W4), "MyLinear": QuantizationConfig(weight=W8)},
    layer_quant_config={"*.mlp.*": QuantizationConfig(weight=W4)}, exclude=["lm_head"],
    algo_config=GPTQConfig(None)).to_dict()))
AFFINEQ = [json.loads(json.dumps(c.to_dict())) for c in (
    Int4WeightOnlyConfig(group_size=64),
    IntxWeightOnlyConfig(weight_dtype=torch.int3, granularity=PerGroup(32)),
    FqnToConfig({"re:layers\\.0\\..*": Int8DynamicActivationInt8WeightConfig(), "lm_head": None,
                 "_default": IntxWeightOnlyConfig()}),
    GPTQConfig(Int4WeightOnlyConfig(group_size=32)),
)]
SPEC = nn.Linear(64, 32).weight
QSPEC = json.loads(json.dumps(QuantSpec.create((32, 64), torch.float32, torch.int4, (1, 32)).to_dict()))


def _classes_in(obj, seen=None):
    """Every class reachable from a parsed result (dataclass fields, dicts, lists, tuples)."""
    import dataclasses

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, type):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _classes_in(k, seen)
            yield from _classes_in(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _classes_in(v, seen)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _classes_in(getattr(obj, f.name), seen)


def _parse(fn, d):
    """fn(d) must return or raise ValueError; no new module may be imported; classes come from allow-lists."""
    before = set(sys.modules)
    try:
        out = fn(d)
    except ValueError:
        out = None
    assert set(sys.modules) == before, f"parsing imported {sorted(set(sys.modules) - before)}"
    allowed = set(observer_registry().values()) | set(layer_type_registry().values())
    for cls in _classes_in(out):
        assert cls in allowed, f"{fn.__qualname__} returned the class {cls!r}"
    return out


@FUZZ
@given(edited(QUARK) | junk)
def test_quark_config_from_dict(d):
    out = _parse(Config.from_dict, d)
    if out is not None:
        assert isinstance(out, Config)
        assert isinstance(out.exclude, tuple) and all(isinstance(p, str) for p in out.exclude)


@FUZZ
@given(edited(QUARK["layer_type_quant_config"]["class:torch.nn.modules.linear:Linear"]["weight"]) | junk)
def test_quantization_spec_from_dict(d):
    out = _parse(QuantizationSpec.from_dict, d)
    assert out is None or isinstance(out, QuantizationSpec)


@FUZZ
@given(st.one_of(*(edited(d) for d in AFFINEQ), edited(QUARK), junk))
def test_config_from_dict(d):
    out = _parse(config_from_dict, d)
    assert out is None or type(out) in _CONFIGS.values()


@FUZZ
@given(edited(QSPEC) | junk)
def test_quant_spec_from_dict(d):
    out = _parse(QuantSpec.from_dict, d)
    assert out is None or isinstance(out, QuantSpec)


@pytest.fixture(scope="module")
def affineq_config():
    from affineq.hf import AffineqConfig

    return AffineqConfig


@FUZZ
@given(st.one_of(*(edited({"quant_method": "affineq", "quant_config": d, "modules_to_not_convert": ["lm_head"]})
                   for d in AFFINEQ), junk))
def test_transformers_quantization_config(affineq_config, d):
    out = _parse(affineq_config.from_dict, d)
    assert out is None or isinstance(out, affineq_config)


# -- weights_only pickles of a quantized tensor with edited attributes ---------------------------------------

_tensor_junk = st.builds(lambda shape, dt: torch.zeros(shape, dtype=dt),
                         st.lists(st.integers(0, 3), max_size=3).map(tuple),
                         st.sampled_from([torch.float32, torch.int8, torch.uint8, torch.bfloat16]))


def _spec_edit(spec, field: str, value):
    bad = object.__new__(QuantSpec)  # what an edited pickle rebuilds: no constructor runs
    bad.__dict__.update({**spec.__dict__, field: value})
    return bad


@FUZZ
@given(st.data())
def test_edited_quantized_tensor_pickle_fails_at_load_or_works(data):
    import dataclasses
    import io
    import pickle

    from affineq import AffineQuantizedTensor, Int8WeightOnlyConfig, quantize_

    w = quantize_(nn.Sequential(nn.Linear(64, 8)), Int8WeightOnlyConfig(packing_format="plain"))[0].weight
    ref = w.dequantize()
    attrs = w.__dict__
    key = data.draw(st.sampled_from(sorted(attrs)))
    action = data.draw(st.sampled_from(["drop", "junk", "tensor", "spec"]))
    if action == "drop":
        del attrs[key]
    elif action == "junk":
        attrs[key] = data.draw(junk)
    elif action == "tensor":
        attrs[key] = data.draw(_tensor_junk)
    else:
        field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(QuantSpec)]))
        attrs["spec"] = _spec_edit(w.spec, field, data.draw(junk | _tensor_junk))
    buf = io.BytesIO()
    try:
        torch.save({"w": w}, buf)
    except Exception:  # noqa: BLE001 - torch.save refusing the edit is not what is tested
        return
    try:
        out = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["w"]
    except (ValueError, pickle.UnpicklingError):
        return
    assert isinstance(out, AffineQuantizedTensor)  # loaded: then it must be whole, not fail at first use
    assert torch.equal(out.dequantize(), ref)
