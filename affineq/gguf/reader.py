"""Reading a GGUF container with ggml-org's `gguf` package: metadata and each tensor's raw bytes, checked.

`read(path)` parses the header with `gguf.GGUFReader` (the file is memory-mapped; nothing is read twice) and checks
every tensor entry against the file before anything is built: its ggml type is known, its shape is positive with
the innermost dim a whole number of blocks, and its bytes lie inside the file. A file the parser cannot read (cut
short, an edited header) is a ValueError naming the file: no allocation follows from a header's counts, since
every array is a view of the mapped file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFEntry", "GGUFContents", "read", "require_gguf"]

INSTALL_HINT = "pip install 'affineq[gguf]' (or: pip install gguf)"


def require_gguf():
    """The `gguf` package (imported on first use), or ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError(f"reading and writing GGUF files needs ggml-org's gguf package: {INSTALL_HINT}") from e
    return gguf


@dataclass(frozen=True)
class GGUFEntry:
    """One tensor of a GGUF file: its name, ggml type name ("Q4_K"), shape in torch order (GGUF's ne[] reversed:
    [out_features, in_features]) and its bytes (a read-only uint8 view of the mapped file, [rows, row_bytes])."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass
class GGUFContents:
    """A parsed file: `tensors` in file order, and the header's key-value fields (`metadata()` decodes them)."""

    path: str
    tensors: list[GGUFEntry]
    fields: Any  # gguf ReaderField by key

    def metadata(self, *keys: str) -> dict[str, Any]:
        """Decoded metadata values (all of them, or only `keys`, skipping absent ones). Decoding the tokenizer's
        arrays takes seconds on a large vocabulary, so callers name the keys they need."""
        names = keys or tuple(k for k in self.fields if not k.startswith("GGUF."))
        out = {}
        for k in names:
            f = self.fields.get(k)
            if f is not None:
                try:
                    out[k] = f.contents()
                except Exception as e:  # noqa: BLE001 (an edited value: say which key)
                    raise ValueError(f"{self.path}: metadata key {k!r} cannot be decoded ({e})") from None
        return out


def read(path: str | os.PathLike) -> GGUFContents:
    """Parse GGUF file `path` (see the module docstring); ValueError if it is not a valid GGUF file."""
    gguf = require_gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file; pass the path of a .gguf file")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 (the parser raises many kinds on a damaged header)
        raise ValueError(f"{path}: not a readable GGUF file (truncated or edited header?): "
                         f"{type(e).__name__}: {e}") from None
    tensors = [_entry(path, size, t, gguf) for t in reader.tensors]
    return GGUFContents(path, tensors, reader.fields)


def _entry(path: str, size: int, t, gguf) -> GGUFEntry:
    name = t.name
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise ValueError(f"{path}: tensor {name!r} has ggml type {qtype.name}, whose block size the gguf package "
                         "does not know")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if not shape or any(d <= 0 for d in shape) or shape[-1] % block:
        raise ValueError(f"{path}: tensor {name!r} has shape {shape} ({qtype.name}): every dim must be positive and "
                         f"the innermost a multiple of the block size {block}; the header is damaged")
    row_bytes = shape[-1] // block * type_size
    rows = int(np.prod(shape[:-1], dtype=np.float64)) if len(shape) > 1 else 1
    nbytes = rows * row_bytes
    if t.data_offset < 0 or t.data_offset + nbytes > size or t.data.size * t.data.itemsize != nbytes:
        raise ValueError(f"{path}: tensor {name!r} ({qtype.name}, shape {shape}) needs {nbytes} bytes at offset "
                         f"{t.data_offset}, but the file has {size} bytes: it is truncated or its header was edited")
    return GGUFEntry(name, qtype.name, shape, t.data.reshape(-1).view(np.uint8).reshape(rows, row_bytes))
