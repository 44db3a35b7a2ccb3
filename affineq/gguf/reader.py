"""Reading a GGUF container (v2 / v3, little-endian): metadata and each tensor's raw bytes, checked.

The header is parsed here, in one pass over the memory-mapped file, with every length checked against the bytes
left before anything is read: a file cut short or with an edited header is a ValueError naming the file and the
byte, and no count read from the header allocates more than the file holds. Numeric metadata arrays stay numpy
arrays (a copy of their bytes: as much memory as the file holds), never lists of Python numbers (8 to 30 times
the bytes); arrays of strings are `StringArray`s (their bytes and an offset per string, each decoded when read),
not lists of `str` (~6 times the bytes: a vocabulary's tokens). ggml-org's `gguf` package supplies the tensor
type table (`GGMLQuantizationType`, `GGML_QUANT_SIZES`) and writes files (`affineq.gguf.files`); its own
`GGUFReader` is the tests' reference. (It is not used to load: it builds a numpy array per metadata element, which
takes seconds on a 49k-token vocabulary where this parser takes a fraction of one.)

Tensors are then checked against the file: a known ggml type, positive dims with the innermost a whole number of
blocks, and bytes inside the file.
"""

from __future__ import annotations

import operator
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

__all__ = ["GGUFEntry", "GGUFContents", "INSTALL_HINT", "MAX_DIMS", "StringArray", "read", "require_gguf"]

INSTALL_HINT = "pip install 'affineq[gguf]' (or: pip install gguf)"
_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DEPTH = 8  # nested metadata arrays
# GGUF metadata value types: scalars by id (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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


class StringArray(Sequence[str]):
    """A GGUF array of strings, held as the file stores it: each element's uint64 byte count and UTF-8 bytes,
    back to back (`data`), and where each element starts there (`offsets`, int64 [n]); an element is decoded when
    it is read. That is the array's bytes in the file plus 8 per element (at most twice them), where a list of
    `str` takes about 6 times the bytes. A read-only sequence: len, indexing (a slice gives a list), iteration,
    `==` with another StringArray or a list / tuple of str."""

    __slots__ = ("_data", "_offsets")
    __hash__ = None  # type: ignore[assignment]  # compares by value, as a list does

    def __init__(self, data: bytes, offsets: np.ndarray) -> None:
        self._data, self._offsets = data, offsets

    @classmethod
    def from_strings(cls, items: Sequence[str]) -> StringArray:
        """The array of `items` (str each)."""
        raw = [s.encode("utf-8") for s in items]
        sizes = np.array([8 + len(b) for b in raw], dtype=np.int64)
        return cls(b"".join(struct.pack("<Q", len(b)) + b for b in raw), np.cumsum(sizes) - sizes)

    def __len__(self) -> int:
        return int(self._offsets.size)

    def _at(self, off: int) -> str:
        (n,) = struct.unpack_from("<Q", self._data, off)
        return self._data[off + 8:off + 8 + n].decode("utf-8")

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._at(int(self._offsets[j])) for j in range(*i.indices(len(self)))]
        n, j = len(self), operator.index(i)
        if not -n <= j < n:
            raise IndexError(f"StringArray index {i} out of range for {n} strings")
        return self._at(int(self._offsets[j]))

    def __iter__(self) -> Iterator[str]:
        for off in self._offsets.tolist():
            yield self._at(off)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


@dataclass
class GGUFContents:
    """A parsed file: its path, `metadata` (key -> Python value; arrays of numbers as 1-D numpy arrays of the
    file's element type, arrays of strings as `StringArray`s, arrays of arrays as lists) and `tensors` in file
    order."""

    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFEntry]


class _Cursor:
    """Reads little-endian values from `buf`, never past its end (ValueError naming the file and the offset)."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: {what} at byte {self.pos} needs {n} bytes, but the file ends at byte "
                             f"{len(self.buf)}: it is truncated or its header was edited")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        return self.text(n, what)

    def text(self, n: int, what: str) -> str:
        """The next `n` bytes as UTF-8 text (ValueError if they are not)."""
        try:
            out = str(self.buf[self.pos:self.pos + n], "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: {what} at byte {self.pos} is not UTF-8 text; the file is damaged") \
                from None
        self.pos += n
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype != _ARRAY or depth >= _MAX_DEPTH:
            raise ValueError(f"{self.path}: {what} has value type {vtype}, which GGUF does not define (or arrays "
                             f"nested deeper than {_MAX_DEPTH}); the header is damaged")
        etype, count = self.scalar("<I", what), self.scalar("<Q", what)
        if etype in _SCALARS:  # numeric arrays in one numpy call, kept numpy: as many bytes as the file's
            dt = np.dtype(_SCALARS[etype])
            self.need(count * dt.itemsize, what)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return arr.astype(dt.newbyteorder("="))  # a native-order copy: no view keeps the file mapped
        self.need(count * 8, what)  # every string or array element takes at least 8 bytes: bounds the loop
        if etype == _STRING:
            return self.strings(count, what)
        return [self.value(etype, what, depth + 1) for _ in range(count)]

    def strings(self, count: int, what: str) -> StringArray:
        """`count` strings as one StringArray (their bytes copied once), each checked to be UTF-8 as `string`
        checks it."""
        first = self.pos
        offsets = np.empty(count, dtype=np.int64)
        for i in range(count):
            offsets[i] = self.pos - first
            self.string(what)  # checked, then dropped: the array keeps the bytes
        return StringArray(bytes(self.buf[first:self.pos]), offsets)


def read(path: str | os.PathLike) -> GGUFContents:
    """Parse GGUF file `path` (see the module docstring); ValueError if it is not a valid GGUF file."""
    gguf = require_gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file; pass the path of a .gguf file")
    if os.path.getsize(path) < 24:
        raise ValueError(f"{path}: {os.path.getsize(path)} bytes is too short for a GGUF header (24 bytes at least)")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped), path)
    if bytes(cur.buf[:4]) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it does not start with b'GGUF')")
    cur.pos = 4
    version = cur.scalar("<I", "the version")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q", "the tensor count"), cur.scalar("<Q", "the metadata count")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        metadata[key] = cur.value(cur.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}")
        n_dims = cur.scalar("<I", f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{path}: tensor {name!r} has {n_dims} dims (GGUF allows 1 to {MAX_DIMS}); the header "
                             "is damaged")
        ne = [cur.scalar("<Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
        infos.append((name, tuple(reversed(ne)), cur.scalar("<I", f"the type of {name!r}"),
                      cur.scalar("<Q", f"the offset of {name!r}")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment={align!r} is not a positive power of two")
    start = (cur.pos + align - 1) // align * align
    tensors = [_entry(path, mapped, start, *info, gguf) for info in infos]
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError(f"{path}: a tensor name appears twice; the header is damaged")
    return GGUFContents(path, metadata, tensors)


def _entry(path: str, mapped: np.ndarray, start: int, name: str, shape: tuple[int, ...], type_id: int,
           offset: int, gguf) -> GGUFEntry:
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has ggml type id {type_id}, which the gguf package does not "
                         "know (a newer file, or a damaged header)") from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise ValueError(f"{path}: tensor {name!r} has ggml type {qtype.name}, whose block size is unknown")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if any(d <= 0 for d in shape) or shape[-1] % block:
        raise ValueError(f"{path}: tensor {name!r} has shape {shape} ({qtype.name}): every dim must be positive and "
                         f"the innermost a multiple of the block size {block}; the header is damaged")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    row_bytes = shape[-1] // block * type_size
    begin = start + offset
    if begin + rows * row_bytes > mapped.size:
        raise ValueError(f"{path}: tensor {name!r} ({qtype.name}, shape {shape}) needs {rows * row_bytes} bytes at "
                         f"byte {begin}, but the file has {mapped.size} bytes: it is truncated or its header was "
                         "edited")
    data = mapped[begin:begin + rows * row_bytes].reshape(rows, row_bytes)
    return GGUFEntry(name, qtype.name, shape, data)
