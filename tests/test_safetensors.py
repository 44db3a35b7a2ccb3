"""affineq.safetensors: bit-exact round trips of every format and config, validation of what is read."""

import json
import struct

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
from conftest import _bits  # noqa: E402

import affineq  # noqa: E402
from affineq import safetensors as ast  # noqa: E402
from affineq.tensor.spec import QuantSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))


F8 = torch.float8_e4m3fn
CONFIGS = {
    "int4-dense": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
    "int4-cpu": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
    "int4-plain": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="plain"),
    "int8": affineq.Int8WeightOnlyConfig(),
    "int8-plain-g32": affineq.Int8WeightOnlyConfig(group_size=32, packing_format="plain"),
    "int8-plain": affineq.Int8WeightOnlyConfig(packing_format="plain"),  # aten._weight_int8pack_mm
    "int3-g32": affineq.IntxWeightOnlyConfig(torch.int3, affineq.PerGroup(32)),
    "uint2-asym-fp32": affineq.IntxWeightOnlyConfig(torch.uint2, affineq.PerGroup(16), affineq.MappingType.ASYMMETRIC,
                                                    scale_dtype=torch.float32),
    "8da4w": affineq.Int8DynamicActivationInt4WeightConfig(group_size=16),
    "8da8w": affineq.Int8DynamicActivationInt8WeightConfig(),
    "fp8": affineq.Float8WeightOnlyConfig(),
    "fp8-plain": affineq.Float8WeightOnlyConfig(packing_format="plain"),
    "fp8-dyn": affineq.Float8DynamicActivationFloat8WeightConfig(),
    "fqn-mix": affineq.FqnToConfig({"0": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
                                    "2": affineq.Int8WeightOnlyConfig(), "4": None}),
}


def _quantized(name: str) -> nn.Module:
    m = _model()
    affineq.quantize_(m, CONFIGS[name])
    return m


def _static() -> nn.Module:
    m = _model()
    data = [torch.randn(4, 128) for _ in range(3)]
    affineq.quantize_(m, affineq.Int8StaticActivationInt8WeightConfig(quantize_output=True), calibration_data=data)
    return m


def _pre_scaled() -> nn.Module:
    m = _quantized("int4-dense")
    w = m[0].weight
    m[0].weight = nn.Parameter(w.with_act_tensors(act_pre_scale=torch.rand(128) + 0.5), requires_grad=False)
    return m


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        y = b[k]
        assert type(x) is type(y) or isinstance(x, nn.Parameter), k
        if isinstance(x, affineq.AffineQuantizedTensor):
            assert isinstance(y, affineq.AffineQuantizedTensor) and x.spec == y.spec, k
            assert list(x.tensors) == list(y.tensors), k
            for n, t in x.tensors.items():
                assert t.dtype == y.tensors[n].dtype and torch.equal(_bits(t), _bits(y.tensors[n])), f"{k}:{n}"
        else:
            assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), k


BUILDERS = {**{n: (lambda n=n: _quantized(n)) for n in CONFIGS}, "static-int8": _static, "act-pre-scale": _pre_scaled}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_round_trip_bit_exact(name, tmp_path):
    m = BUILDERS[name]()
    sd = m.state_dict()
    act = {n for v in sd.values() if isinstance(v, affineq.AffineQuantizedTensor) for n in v.act_tensors}
    assert act == {"static-int8": {"act_scale", "act_zero_point", "act_out_scale", "act_out_zero_point"},
                   "act-pre-scale": {"act_pre_scale"}}.get(name, set())
    path = tmp_path / "m.safetensors"
    ast.save_file(sd, path)
    back = ast.load_file(path)
    assert_same_state(sd, back)
    m2 = _model()
    m2.load_state_dict(back, assign=True)
    m2.requires_grad_(False)
    x = torch.randn(5, 128)
    assert torch.equal(m(x), m2(x))
    # a real safetensors file: 8-byte header length, JSON header, no pickle
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["format"] == "pt" and b"\x80\x04" not in raw[:2]


def test_int8pack_codes_are_realigned():
    """aten's _weight_int8pack_mm reads the codes with 16-byte aligned loads (safetensors aligns to 8): a view at
    another offset is copied once when the tensor is built, and the kernel op copies any other it is given."""
    w = _quantized("int8-plain")[0].weight
    buf = torch.empty(w._qdata.numel() + 8, dtype=torch.int8)
    view = buf[8:].view(w._qdata.shape)
    view.copy_(w._qdata)
    assert view.data_ptr() % 16 == 8
    back = affineq.AffineQuantizedTensor.from_tensors({**w.tensors, "qdata": view}, w.spec)
    assert back._qdata.data_ptr() % 16 == 0 and torch.equal(back._qdata, w._qdata)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    scale = w._scale.reshape(-1).to(torch.bfloat16)
    want = torch.ops.aten._weight_int8pack_mm(x, w._qdata, scale)
    assert torch.equal(torch.ops.affineq.weight_int8pack_mm(x, view, scale), want)


def test_int4_cpu_is_stored_portably_and_repacked(tmp_path):
    m = _quantized("int4-cpu")
    path = tmp_path / "m.safetensors"
    ast.save_file(m.state_dict(), path)
    with safetensors.safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["affineq"])
    assert {"0.weight:qdata", "0.weight:scale", "0.weight:zero_point"} <= keys
    entry = meta["quantized"]["0.weight"]
    assert entry["spec"]["format"] == "plain" and entry["layout"] == "int4_cpu"
    assert ast.load_file(path)["0.weight"].packing_format == "int4_cpu"


def test_e8m0_and_plain_tensors(tmp_path):
    w = torch.randn(16, 64)
    spec = QuantSpec.create((16, 64), torch.float32, torch.float8_e4m3fn, (1, 32),
                            mapping_type=affineq.MappingType.SYMMETRIC, scale_type="e8m0")
    q = affineq.AffineQuantizedTensor.from_spec(w, spec)
    sd = {"q": q, "plain": torch.arange(6, dtype=torch.int64), "half": torch.randn(3, dtype=torch.bfloat16)}
    ast.save_file(sd, tmp_path / "x.safetensors", metadata={"note": "hi"})
    assert_same_state(sd, ast.load_file(tmp_path / "x.safetensors"))
    with safetensors.safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata()["note"] == "hi"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        ast.save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors", metadata={"affineq": "x"})
    with pytest.raises(ValueError, match="str -> str"):
        ast.save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors", metadata={"a": 1})
    q = _quantized("int8")[0].weight
    with pytest.raises(ValueError, match="rename"):
        ast.flatten_state_dict({"w": q, "w:qdata": torch.zeros(1)})
    with pytest.raises(TypeError, match="tensors only"):
        ast.save_file({"a": 3}, tmp_path / "a.safetensors")


# -- corrupted files ------------------------------------------------------------------------------------


def _saved(tmp_path, name="int4-plain"):
    path = tmp_path / "m.safetensors"
    ast.save_file(_quantized(name).state_dict(), path)
    return path


def _rewrite(path, edit_tensors=None, edit_meta=None, recrc=None):
    """Rewrite `path` through safetensors itself with its tensors and/or affineq metadata edited; `recrc`: a key
    whose checksum is recomputed after the edit, so that the check under test is the one that fails."""
    with safetensors.safe_open(str(path), "pt") as f:
        header = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["affineq"])
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    if recrc:
        meta["checksums"][recrc] = ast._crc(tensors[recrc])
    header["affineq"] = json.dumps(meta)
    safetensors.torch.save_file(tensors, str(path), metadata=header)


def test_truncated_file(tmp_path):
    path = _saved(tmp_path)
    raw = path.read_bytes()
    for cut in (len(raw) - 7, 100, 5):
        path.write_bytes(raw[:cut])
        with pytest.raises(ValueError, match="truncated or corrupted"):
            ast.load_file(path)


def test_flipped_byte_fails_checksum(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # last tensor's data
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        ast.load_file(path)


@pytest.mark.parametrize("case, match", [
    ("newer version", r"version 2.*reads versions 1\.\.1.*upgrade affineq"),
    ("spec shape", "shape"),
    ("spec field", "unknown keys"),
    ("dtype", "dtype"),
    ("missing tensor", "truncated or was edited|lacks tensors"),
    ("codes out of range", r"codes span \[0, 99\]"),
    ("nan scale", "inf or NaN"),
    ("no metadata", "no 'affineq' metadata"),
    ("bad json", "not valid JSON"),
])
def test_edited_files_fail_cleanly(tmp_path, case, match):
    path = _saved(tmp_path)
    key = "0.weight"
    if case == "no metadata":
        with safetensors.safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    elif case == "bad json":
        with safetensors.safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        safetensors.torch.save_file(tensors, str(path), metadata={"affineq": "{oops"})
    elif case == "newer version":
        _rewrite(path, edit_meta=lambda m: m.update(version=2))
    elif case == "spec shape":
        _rewrite(path, edit_meta=lambda m: m["quantized"][key]["spec"].update(shape=[64, 64]))
    elif case == "spec field":
        _rewrite(path, edit_meta=lambda m: m["quantized"][key]["spec"].update(extra=1))
    elif case == "dtype":
        def to_int(t):
            t[f"{key}:scale"] = t[f"{key}:scale"].to(torch.int32)
        _rewrite(path, to_int, recrc=f"{key}:scale")
    elif case == "missing tensor":
        _rewrite(path, lambda t: t.pop(f"{key}:scale"))
    elif case == "codes out of range":
        def bad_codes(t):
            t[f"{key}:qdata"][0, 0] = 99
        _rewrite(path, bad_codes, recrc=f"{key}:qdata")
    elif case == "nan scale":
        def nan(t):
            t[f"{key}:scale"][0, 0] = float("nan")
        _rewrite(path, nan, recrc=f"{key}:scale")
    with pytest.raises(ValueError, match=match):
        ast.load_file(path)
