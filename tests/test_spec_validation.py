"""Specs and tensors read from untrusted files are validated fully at load: a stored value of the wrong type is a
ValueError naming the field (never coerced into a different meaning), a block size that does not divide its dim
is refused, and strided stored tensors are made contiguous (the packed matmul kernels ignore strides)."""

import json

import pytest
import torch
import torch.nn.functional as F

from affineq.granularity import PerTensor
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import ActivationQuant, QParamOptions, QuantSpec

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")


def _spec_dict(**changes) -> dict:
    d = QuantSpec.create((16, 64), torch.float32, "int4", (1, 32), packing_format="dense").to_dict()
    d.update(changes)
    return d


# -- QuantSpec.from_dict: no coercion ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, [False]])
def test_from_dict_transposed_must_be_a_bool(value):
    with pytest.raises(ValueError, match="transposed"):
        QuantSpec.from_dict(_spec_dict(transposed=value))


@pytest.mark.parametrize("value", [False, True])
def test_from_dict_transposed_bools_load(value):
    assert QuantSpec.from_dict(_spec_dict(transposed=value)).transposed is value


@pytest.mark.parametrize("key", ["quant_min", "quant_max"])
@pytest.mark.parametrize("value", [None, "-8", True, [0], 1.5])
def test_from_dict_range_must_be_numbers(key, value):
    with pytest.raises(ValueError, match=key):
        QuantSpec.from_dict(_spec_dict(**{key: value}))


def test_safetensors_transposed_string_is_refused(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    import safetensors

    from affineq import safetensors as ast

    q = AffineQuantizedTensor.from_spec(torch.randn(16, 64), (1, 32), target="int4", packing_format="dense")
    path = tmp_path / "w.safetensors"
    ast.save_file({"w": q}, path)
    with safetensors.safe_open(str(path), "pt") as f:
        header, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta = json.loads(header["affineq"])
    meta["quantized"]["w"]["spec"]["transposed"] = "false"
    header["affineq"] = json.dumps(meta)
    st.save_file(tensors, str(path), metadata=header)
    with pytest.raises(ValueError, match="transposed"):
        ast.load_file(path)


# -- ActivationQuant: eps, static and unknown keys ---------------------------------------------------------


@pytest.mark.parametrize("eps", ["abc", [1], True, -5.0, 0.0, float("nan"), float("inf"), 1e-45])
def test_activation_eps_is_checked(eps):
    with pytest.raises(ValueError, match="eps"):
        ActivationQuant(eps=eps)
    with pytest.raises(ValueError, match="eps"):
        ActivationQuant.from_dict({**ActivationQuant().to_dict(), "eps": eps})


def test_activation_eps_accepts_positive_numbers():
    assert ActivationQuant.from_dict({**ActivationQuant().to_dict(), "eps": 1e-3}).eps == 1e-3
    aq = ActivationQuant(eps=1)
    assert aq.eps == 1.0 and isinstance(aq.eps, float)
    assert ActivationQuant.from_dict(ActivationQuant().to_dict()).eps is None


@pytest.mark.parametrize("static", ["yes", "false", 1, 0, None])
def test_activation_static_must_be_a_bool(static):
    d = ActivationQuant(torch.int8, MappingType.SYMMETRIC, PerTensor(), ZeroPointDomain.NONE).to_dict()
    with pytest.raises(ValueError, match="static"):
        ActivationQuant.from_dict({**d, "static": static})
    with pytest.raises(ValueError, match="static"):
        ActivationQuant(granularity=PerTensor(), static=static)


def test_activation_unknown_key_is_refused():
    with pytest.raises(ValueError, match="unknown keys"):
        ActivationQuant.from_dict({**ActivationQuant().to_dict(), "per_token": False})
    with pytest.raises(ValueError, match="static"):
        QuantSpec.from_dict(_spec_dict(act_quant={**ActivationQuant().to_dict(), "static": "no"}))


def test_activation_quant_pickle_checks_static(tmp_path):
    aq = ActivationQuant(granularity=PerTensor(), static=True)
    object.__setattr__(aq, "static", 1)  # as a tampered pickle would store it
    torch.save({"aq": aq}, tmp_path / "aq.pt")
    with pytest.raises(ValueError, match="static"):
        torch.load(tmp_path / "aq.pt", weights_only=True)


# -- block sizes must divide their dims --------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "block", "fmt", "target"), [
    ([16, 40], [1, 32], "dense", "int4"),
    ([16, 40], [1, 32], "int4_cpu", "uint4"),
    ([16, 10], [1, 3], "plain", "int8"),
    ([6, 64], [4, 64], "plain", "int8"),
])
def test_from_dict_refuses_non_dividing_blocks(shape, block, fmt, target):
    d = QuantSpec.create((16, 64), torch.float32, target, (1, 32), packing_format="plain").to_dict()
    d.update(shape=shape, block_size=block, format=fmt)
    with pytest.raises(ValueError, match="block_size"):
        QuantSpec.from_dict(d)


def test_spec_refuses_non_dividing_blocks():
    with pytest.raises(ValueError, match="divide"):
        QuantSpec.create((16, 40), torch.float32, "int4", (1, 32), packing_format="dense")
    spec = QuantSpec.create((16, 64), torch.float32, "int8", (1, 32))
    with pytest.raises(ValueError, match="divide"):
        spec.replace(shape=(16, 40))
    assert spec.replace(shape=(0, 64)).num_blocks == (0, 2)  # an empty tensor divides


def test_pickle_refuses_non_dividing_blocks(tmp_path):
    w = AffineQuantizedTensor.from_spec(torch.randn(16, 64), (1, 32), target=torch.int8)
    spec = w.spec
    object.__setattr__(spec, "block_size", (1, 24))  # as a tampered pickle would store it
    torch.save({"w": w}, tmp_path / "w.pt")
    with pytest.raises(ValueError, match="block_size"):
        torch.load(tmp_path / "w.pt", weights_only=True)


# -- strided stored tensors --------------------------------------------------------------------------------


def _int4_cpu() -> AffineQuantizedTensor:
    torch.manual_seed(0)
    return AffineQuantizedTensor.from_spec(torch.randn(32, 64), (1, 32), QParamOptions(scale_dtype=torch.bfloat16),
                                           target=torch.uint4, zero_point_domain=ZeroPointDomain.FLOAT,
                                           packing_format="int4_cpu")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """`t` as a non-contiguous view with the same values (dim 0 and 1 swapped in memory)."""
    s = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not s.is_contiguous() and torch.equal(s, t)
    return s


def test_pickled_strided_int4_cpu_qparams_load_contiguous(tmp_path):
    w = _int4_cpu()
    x = torch.randn(3, 64)
    want = F.linear(x, w)
    w._scale_and_zero = _strided(w._scale_and_zero)
    torch.save({"w": w}, tmp_path / "nc.pt")
    r = torch.load(tmp_path / "nc.pt", weights_only=True)["w"]
    assert all(t.is_contiguous() for t in r.tensors.values())
    torch.testing.assert_close(F.linear(x, r), want, rtol=0, atol=0)


def test_from_tensors_strided_int4_cpu_qparams_made_contiguous():
    w = _int4_cpu()
    x = torch.randn(3, 64)
    t = w.tensors
    t["scale_and_zero"] = _strided(t["scale_and_zero"])
    r = AffineQuantizedTensor.from_tensors(t, w.spec)
    assert all(v.is_contiguous() for v in r.tensors.values())
    torch.testing.assert_close(F.linear(x, r), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("via", ["pickle", "from_tensors"])
def test_strided_plain_int8_codes(tmp_path, via):
    torch.manual_seed(0)
    w = AffineQuantizedTensor.from_spec(torch.randn(32, 64), (1, 64), target=torch.int8,
                                        mapping_type=MappingType.SYMMETRIC)
    x = torch.randn(3, 64)
    want = F.linear(x, w)
    if via == "pickle":
        w._qdata = _strided(w._qdata)
        torch.save({"w": w}, tmp_path / "nc.pt")
        r = torch.load(tmp_path / "nc.pt", weights_only=True)["w"]
    else:
        t = w.tensors
        t["qdata"] = _strided(t["qdata"])
        r = AffineQuantizedTensor.from_tensors(t, w.spec)
    assert r.qdata.is_contiguous()
    torch.testing.assert_close(F.linear(x, r), want, rtol=0, atol=0)
