"""Fuzzing every parser of a file a user downloads (issue #28): `affineq.safetensors.load_file` headers and
metadata, and the index files `quantize_checkpoint` / `load_quantized` follow. Invariants: only ValueError
(QuantizationError is one) or FileNotFoundError escapes; nothing is opened outside the checkpoint directory (an
audit hook on Python's "open" and on affineq's `OPEN_EVENT`, which every safetensors file affineq opens goes
through); a header claiming huge shapes fails before anything near that size is allocated (peak RSS). Also disk
full: `save_file` and `quantize_checkpoint` in a child process under RLIMIT_FSIZE fail with a clear OSError and
leave no file a later load accepts."""

import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
hypothesis = pytest.importorskip("hypothesis")
import safetensors.torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import affineq  # noqa: E402
from affineq import safetensors as ast  # noqa: E402
from affineq import streaming  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ALLOWED = (ValueError, FileNotFoundError)  # QuantizationError is a ValueError
ROOT = Path(__file__).resolve().parents[1]

# -- the audit hook: installed once per process, active only while `_WATCH["roots"]` is set ------------------

_WATCH: dict = {"roots": None, "outside": []}
_IGNORED = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, "/proc", "/sys", "/dev"})


def _audit(event: str, args: tuple) -> None:
    roots = _WATCH["roots"]
    if roots is None or event not in ("open", ast.OPEN_EVENT) or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(args[0]))
    if not path.startswith(_IGNORED) and not any(path == r or path.startswith(r + os.sep) for r in roots):
        _WATCH["outside"].append(path)


if not getattr(sys.modules[__name__], "_HOOKED", False):
    sys.addaudithook(_audit)
    _HOOKED = True


def _watched(fn, *roots: Path):
    """fn() with the audit window open on `roots`; returns its result or its (allowed) exception; asserts no
    file outside `roots` was opened and nothing but ValueError / FileNotFoundError escaped."""
    _WATCH["roots"], _WATCH["outside"] = [os.path.realpath(r) for r in roots], []
    try:
        return fn()
    except ALLOWED as e:
        return e
    finally:
        _WATCH["roots"] = None
        assert not _WATCH["outside"], f"opened outside the checkpoint: {_WATCH['outside']}"


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- safetensors headers and metadata ---------------------------------------------------------------------


def _valid_file() -> bytes:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 8, bias=False))
    affineq.quantize_(m, affineq.FqnToConfig({"0": affineq.Int4WeightOnlyConfig(group_size=32,
                                                                                   packing_format="plain"),
                                              "1": affineq.Int8WeightOnlyConfig()}))
    with tempfile.TemporaryDirectory() as d:
        ast.save_file(m.state_dict(), Path(d) / "m.safetensors")
        return (Path(d) / "m.safetensors").read_bytes()


BASE = _valid_file()
_N = struct.unpack("<Q", BASE[:8])[0]
HEADER = json.loads(BASE[8:8 + _N])
DATA = BASE[8 + _N:]
META = json.loads(HEADER["__metadata__"]["affineq"])
KEYS = sorted(k for k in HEADER if k != "__metadata__")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
huge_ints = st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**31, 2**40, 2**62, 2**63 - 1])
dtypes = st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "F64", "XX", ""])


def _paths(obj, prefix=()):
    """Every (path of keys / indices) inside a JSON value."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


META_PATHS = [p for p in _paths(META) if p]


def _set(obj, path, value):
    obj = json.loads(json.dumps(obj))
    target = obj
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return obj


def _encode(header: dict, data: bytes = DATA) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def edited_files(draw) -> bytes:
    kind = draw(st.sampled_from(["shape", "dtype", "offsets", "length", "meta-json", "meta-edit", "bytes",
                                 "deep"]))
    header = json.loads(json.dumps(HEADER))
    key = draw(st.sampled_from(KEYS))
    if kind == "shape":
        header[key]["shape"] = draw(st.lists(huge_ints, max_size=4))
    elif kind == "dtype":
        header[key]["dtype"] = draw(dtypes)
    elif kind == "offsets":
        header[key]["data_offsets"] = draw(st.lists(huge_ints, min_size=2, max_size=2))
    elif kind == "length":
        return struct.pack("<Q", draw(huge_ints)) + BASE[8:]
    elif kind == "meta-json":
        header["__metadata__"]["affineq"] = json.dumps(draw(json_values))
    elif kind == "meta-edit":
        meta = _set(META, draw(st.sampled_from(META_PATHS)), draw(json_values | huge_ints))
        header["__metadata__"]["affineq"] = json.dumps(meta)
    elif kind == "bytes":
        raw = bytearray(BASE)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
        return bytes(raw[:draw(st.integers(0, len(raw)))])
    else:
        depth = draw(st.integers(500, 200_000))
        header["__metadata__"]["affineq"] = "[" * depth + "]" * depth
    return _encode(header)


@FUZZ
@given(raw=edited_files(), allow_unchecked=st.booleans())
def test_load_file_fuzz(raw, allow_unchecked):
    before = _peak_rss_bytes()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        path.write_bytes(raw)
        out = _watched(lambda: ast.load_file(path, allow_unchecked=allow_unchecked), Path(d))
        if not isinstance(out, Exception):  # loaded: only mutations that do not change what a tensor means
            assert set(out) <= {"0.weight", "0.bias", "1.weight"}
    # nothing near a claimed size: peak RSS grows by less than 64 MiB (the file is a few KiB)
    assert _peak_rss_bytes() - before < 64 * 2**20


def test_load_file_fuzz_accepts_the_unedited_file(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(BASE)
    assert set(_watched(lambda: ast.load_file(tmp_path / "m.safetensors"), tmp_path)) == {"0.weight", "0.bias",
                                                                                         "1.weight"}


# -- index files ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/src: two float shards and the tensors they hold; root/outside/evil.safetensors: a readable file
    that an index entry leading out of src would reach; root/src/link.safetensors: a symlink to it."""
    root = tmp_path_factory.mktemp("tree")
    src, out = root / "src", root / "outside"
    src.mkdir()
    out.mkdir()
    torch.manual_seed(0)
    safetensors.torch.save_file({"a.weight": torch.randn(16, 32)}, str(src / "s1.safetensors"))
    safetensors.torch.save_file({"b.weight": torch.randn(16, 32)}, str(src / "s2.safetensors"))
    safetensors.torch.save_file({"evil.weight": torch.randn(16, 32)}, str(out / "evil.safetensors"))
    (src / "link.safetensors").symlink_to(out / "evil.safetensors")
    return root


file_names = st.sampled_from(["s1.safetensors", "s2.safetensors", "../outside/evil.safetensors",
                              "link.safetensors", "./s1.safetensors", "sub/../s2.safetensors", "missing.safetensors",
                              "", ".", "..", "/", "OUTSIDE_ABS"]) | st.text(max_size=10)


@st.composite
def indexes(draw) -> str:
    kind = draw(st.sampled_from(["map", "map", "map", "json", "deep"]))
    if kind == "json":
        return json.dumps(draw(json_values))
    if kind == "deep":
        depth = draw(st.integers(500, 100_000))
        return '{"weight_map": ' + "[" * depth + "]" * depth + "}"
    keys = st.sampled_from(["a.weight", "b.weight", "evil.weight", "c.weight"]) | st.text(max_size=6)
    values = file_names | json_values
    return json.dumps({"weight_map": draw(st.dictionaries(keys, values, max_size=4))})


@settings(FUZZ, max_examples=100)
@given(index=indexes(), use_load=st.booleans())
def test_index_fuzz(tree, index, use_load):
    index = index.replace("OUTSIDE_ABS", str(tree / "outside" / "evil.safetensors"))
    src = tree / "src"
    (src / streaming.INDEX_FILE).write_text(index)
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / "dst"
        if use_load:
            with torch.device("meta"):
                model = nn.Module()
                model.a = nn.Linear(32, 16, bias=False)
            out = _watched(lambda: affineq.load_quantized(model, src, affineq.Int8WeightOnlyConfig()), src)
        else:
            out = _watched(lambda: affineq.quantize_checkpoint(src, dst, affineq.Int8WeightOnlyConfig()), src, dst)
            if not isinstance(out, Exception):
                assert "evil.weight" not in out.quantized
                written = {k.partition(":")[0] for f in out.files for k in safetensors.safe_open(f, "pt").keys()}
                assert written <= {"a.weight", "b.weight"}


# -- disk full --------------------------------------------------------------------------------------------------


CHILD = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from pathlib import Path
    import affineq
    from affineq import safetensors as ast
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit raises EFBIG instead of killing us
    root = Path(sys.argv[1])
    sd = {"w": torch.randn(256, 256), "b": torch.randn(256)}  # 257 KiB
    ast.save_file({"w": torch.ones(2)}, root / "old.safetensors")  # an earlier good file at the path
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.RLIM_INFINITY))  # per file
    out = {}
    for name, call in [("save_new", lambda: ast.save_file(sd, root / "new.safetensors")),
                       ("save_over", lambda: ast.save_file(sd, root / "old.safetensors")),
                       ("quantize", lambda: affineq.quantize_checkpoint(root / "src", root / "dst",
                                                                        affineq.Int8WeightOnlyConfig(),
                                                                        max_shard_bytes=20_000)),
                       ("quantize_existing_dst", lambda: affineq.quantize_checkpoint(
                           root / "src", root / "made", affineq.Int8WeightOnlyConfig(), max_shard_bytes=20_000))]:
        try:
            call()
            out[name] = "ok"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
""")


def test_disk_full_leaves_no_loadable_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    torch.manual_seed(0)
    safetensors.torch.save_file({f"l{i}.weight": torch.randn(256, 256) for i in range(3)},  # int8: 64 KiB each
                                str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "x"}))
    (tmp_path / "made").mkdir()
    # no C++ build in the child: its files would meet the size limit (the kernels play no part here)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "AFFINEQ_DISABLE_CPP_KERNELS": "1"}
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("save_new", "save_over"):
        assert out[name].startswith("OSError: save_file(") and "nothing was written" in out[name], out[name]
    for name in ("quantize", "quantize_existing_dst"):
        assert out[name].startswith("OSError: quantize_checkpoint: writing") and "disk full" in out[name], out[name]
    with pytest.raises(FileNotFoundError):
        ast.load_file(tmp_path / "new.safetensors")
    assert torch.equal(ast.load_file(tmp_path / "old.safetensors")["w"], torch.ones(2))  # the old file, intact
    assert not (tmp_path / "dst").exists()
    assert list((tmp_path / "made").iterdir()) == []  # no shard, part, index or config left behind
    assert sorted(f.name for f in tmp_path.iterdir()) == ["made", "old.safetensors", "src"]
    with pytest.raises(ValueError, match="does not exist|holds neither"):
        affineq.load_quantized(nn.Linear(1, 1), tmp_path / "made")


def test_the_audit_hook_sees_opens_outside_the_directory(tmp_path):
    (tmp_path / "in.txt").write_text("x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("y")
    _watched(lambda: (tmp_path / "in.txt").read_text(), tmp_path)
    with pytest.raises(AssertionError, match="opened outside the checkpoint"):
        _watched(outside.read_text, tmp_path)
    with pytest.raises(AssertionError, match="opened outside the checkpoint"):  # safetensors opens, announced
        _watched(lambda: ast.open_file(outside), tmp_path)
    outside.unlink()
