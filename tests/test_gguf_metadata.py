"""GGUF metadata: the types `save_file` writes values as (read back by ggml-org's gguf), what it refuses, and how
`affineq.gguf.reader` holds metadata arrays (numeric ones as numpy, strings as `StringArray`: the file's bytes)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from affineq import gguf as ag

gguf = pytest.importorskip("gguf")

def test_save_file_metadata_types_and_refusals(tmp_path):
    """Metadata as llama.cpp's files type it (counts uint32, integer arrays int32, floats float32), read back by
    gguf.GGUFReader; a value GGUF cannot hold is a ValueError naming the key, and no file is left behind."""
    path = tmp_path / "m.gguf"
    meta = {"llama.block_count": 2, "tokenizer.ggml.token_type": [1, 3, 1], "llama.rope.freq_base": 1e4,
            "tokenizer.ggml.add_bos_token": False, "x.neg": -3, "x.names": ["a", "b"]}
    ag.save_file({"output_norm.weight": torch.ones(4)}, path, arch="llama", metadata=meta)
    fields = gguf.GGUFReader(str(path)).fields
    kinds = {k: [t.name for t in fields[k].types] for k in meta}
    assert kinds == {"llama.block_count": ["UINT32"], "tokenizer.ggml.token_type": ["ARRAY", "INT32"],
                     "llama.rope.freq_base": ["FLOAT32"], "tokenizer.ggml.add_bos_token": ["BOOL"],
                     "x.neg": ["INT32"], "x.names": ["ARRAY", "STRING"]}
    assert {k: fields[k].contents() for k in meta} == meta
    with pytest.raises(ValueError, match=r"metadata 'x.bad': cannot store dict"):
        ag.save_file({"a": torch.ones(2)}, tmp_path / "bad.gguf", arch="llama", metadata={"x.bad": {"a": 1}})
    with pytest.raises(ValueError, match=r"a: GGUF stores float tensors as float32, float16 or bfloat16"):
        ag.save_file({"a": torch.ones(2, dtype=torch.float64)}, tmp_path / "bad.gguf", arch="llama")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_save_file_refuses_what_load_file_cannot_read(tmp_path):
    """GGUF tensors have 1 to 4 dims and at least one element, and values are torch.Tensors: anything else is
    refused up front, naming the tensor, with nothing written (a 0-d tensor would load back as shape [1])."""
    path = tmp_path / "t.gguf"
    cases = [(ValueError, r"tensor 'e' has shape \(0, 32\), no elements; GGUF tensors have at least one",
              torch.ones(0, 32)),
             (ValueError, r"tensor 'e' has 5 dims .*GGUF tensors have 1 to 4 dims", torch.ones(1, 1, 1, 1, 2)),
             (ValueError, r"tensor 'e' has 0 dims .*reshape it \(a scalar as shape \[1\]\)", torch.tensor(2.0)),
             (TypeError, r"tensor 'e': GGUF values must be torch.Tensors, got list", [1, 2])]
    for error, match, value in cases:
        with pytest.raises(error, match=match):
            ag.save_file({"ok": torch.ones(4), "e": value}, path, arch="llama")
    assert list(tmp_path.iterdir()) == []
    ag.save_file({"a": torch.ones(1), "b": torch.ones(1, 2, 1, 32)}, path, arch="llama")
    assert {k: tuple(v.shape) for k, v in ag.load_file(path).items()} == {"a": (1,), "b": (1, 2, 1, 32)}


def _arrays_file(path, arrays: dict) -> None:
    """A GGUF file with no tensors and these metadata arrays (gguf's writer)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, values in arrays.items():
        w.add_array(key, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read_traced(path):
    """(metadata of `path` as reader.read gives it, peak traced allocation while reading it)."""
    tracemalloc.start()
    try:
        meta = ag.reader.read(path).metadata
        return meta, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_reader_keeps_numeric_metadata_arrays_numpy(tmp_path):
    """A numeric metadata array is read as a numpy array of the file's type (as many bytes as the file holds, not
    a list of Python numbers: 38 MiB of float32 took +422 MiB), and written back as the same type."""
    path = tmp_path / "arr.gguf"
    n = 200_000  # a list of Python floats would take 32 B each: 8x the bound below
    _arrays_file(path, {"x.floats": [0.5] * n, "x.types": [1, 3, 1]})
    meta, peak = _read_traced(path)
    floats = meta["x.floats"]
    assert isinstance(floats, np.ndarray) and floats.dtype == np.float32 and floats.shape == (n,)
    assert (floats == 0.5).all() and peak < 2 * 4 * n
    assert meta["x.types"].tolist() == [1, 3, 1]
    ag.save_file({"a": torch.ones(2)}, tmp_path / "back.gguf", arch="llama", metadata=meta)
    fields = gguf.GGUFReader(str(tmp_path / "back.gguf")).fields
    assert [t.name for t in fields["x.floats"].types] == ["ARRAY", "FLOAT32"]
    assert [t.name for t in fields["x.types"].types] == ["ARRAY", "INT32"] and fields["x.types"].contents() == [1, 3, 1]


def test_reader_keeps_string_arrays_as_their_bytes(tmp_path):
    """An array of strings is read as a StringArray: the file's bytes plus 8 per element (a list of str took ~6x:
    a vocabulary's tokens), equal to the list gguf's reader gives, and written back as an array of strings."""
    path = tmp_path / "words.gguf"
    words = [f"tok{i}" + "ü" * (i % 3) for i in range(100_000)] + ["", "a b"]
    _arrays_file(path, {"x.words": words})
    file_bytes = sum(8 + len(s.encode()) for s in words)
    meta, peak = _read_traced(path)
    got = meta["x.words"]
    assert isinstance(got, ag.reader.StringArray) and len(got) == len(words)
    assert peak < 2 * file_bytes + 2**20, (peak, file_bytes)  # the list of str took ~6x file_bytes
    assert got == words and list(got) == words and got[1:4] == words[1:4]
    assert (got[0], got[-1], got[-2], got[100_001]) == (words[0], "a b", "", "a b")
    with pytest.raises(IndexError, match="out of range"):
        got[len(words)]
    assert got == gguf.GGUFReader(str(path)).fields["x.words"].contents()
    ag.save_file({"a": torch.ones(2)}, tmp_path / "back.gguf", arch="llama", metadata=meta)
    back = gguf.GGUFReader(str(tmp_path / "back.gguf")).fields["x.words"]
    assert [t.name for t in back.types] == ["ARRAY", "STRING"] and back.contents() == words


def test_reader_refuses_a_string_array_element_that_is_not_utf8(tmp_path):
    path = tmp_path / "bad.gguf"
    _arrays_file(path, {"x.words": ["ab", "cd"]})
    data = bytearray(path.read_bytes())
    at = data.index(b"cd")
    data[at] = 0xFF  # never valid in UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"metadata 'x.words' at byte {at} is not UTF-8"):
        ag.reader.read(path)


@given(st.lists(st.text(max_size=6), max_size=12), st.integers(-14, 14), st.integers(-14, 14))
def test_string_array_behaves_as_a_list(items, a, b):
    arr = ag.reader.StringArray.from_strings(items)
    assert len(arr) == len(items) and list(arr) == items and arr == items and arr == tuple(items)
    assert arr[a:b] == items[a:b] and arr[::-1] == items[::-1]
    if -len(items) <= a < len(items):
        assert arr[a] == items[a]
    else:
        with pytest.raises(IndexError):
            arr[a]
    assert (arr == items + ["x"]) is False and arr != 3
    with pytest.raises(TypeError):
        arr["0"]
