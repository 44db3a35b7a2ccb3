"""A minimal GGUF (v2/v3) reader: metadata, and tensors dequantized to float32 with torch.

Why not the ``gguf`` package / transformers' GGUF loader: both parse metadata arrays element by
element in Python (SmolLM2's 49k-token vocabulary and 49k merges take tens of seconds on 2 cores,
and transformers re-reads the file several times), while this reader walks the file once and
dequantizes with vectorized torch ops. Only the tensor types SmolLM2's file uses are supported
(F32, F16, Q8_0, Q4_0, Q4_1); anything else raises.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALAR = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9

# ggml tensor types used here: (name, elements per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first): GGUF's ne[] reversed, e.g. [out, in]
    ggml_type: str
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            # Numeric arrays in one numpy call instead of `count` struct calls.
            dt = np.dtype(_SCALAR[etype][1:]).newbyteorder("<")
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return arr.tolist()
        return self.scalar(_SCALAR[vtype])


class GGUFFile:
    """Parsed GGUF file: ``metadata`` (dict) and ``tensors`` (name -> GGUFTensor); tensors load on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # np.memmap (read-only) keeps the ~100 MB of tensor data out of memory until dequantized.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.buf[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, tuple(reversed(ne)), cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, t, off in infos:
            if t not in GGML_TYPES:
                raise ValueError(f"tensor {name}: ggml type {t} not supported by this reader")
            tname, block, block_bytes = GGML_TYPES[t]
            n = int(np.prod(shape))
            self.tensors[name] = GGUFTensor(name, shape, tname, data_start + off, n // block * block_bytes)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [nbytes] (a copy, so the file can be closed)."""
        t = self.tensors[name]
        return torch.from_numpy(np.array(self._map[t.offset : t.offset + t.nbytes]))

    def load(self, name: str) -> torch.Tensor:
        """Dequantized float32 tensor of shape ``tensors[name].shape``, computed as ggml does (fp16 scales
        widened to float32, then d*q (+ m))."""
        t = self.tensors[name]
        return dequantize(self.raw(name), t.ggml_type, t.shape)


def dequantize(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 [nbytes] ggml data -> float32 ``shape``. Blocks run along the innermost dim (in_features)."""
    if ggml_type == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if ggml_type == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    _, block, block_bytes = next(v for v in GGML_TYPES.values() if v[0] == ggml_type)
    b = raw.view(-1, block_bytes)
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # [nblocks, 1]
    # In-place mul then add (never a fused multiply-add) so results are bit-identical to ggml/gguf-py.
    if ggml_type == "Q8_0":  # x = d * q, q int8
        return b[:, 2:].view(torch.int8).float().mul_(d).reshape(shape)
    q = _unpack_nibbles(b[:, -16:]).float()  # low nibbles hold elements 0-15, high nibbles 16-31
    if ggml_type == "Q4_1":  # x = d * q + m, q in 0..15
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        return q.mul_(d).add_(m).reshape(shape)
    if ggml_type == "Q4_0":  # x = d * (q - 8)
        return q.sub_(8.0).mul_(d).reshape(shape)
    raise ValueError(f"cannot dequantize ggml type {ggml_type}")


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] packed pairs -> uint8 [n, 32]: low nibbles first, then high nibbles."""
    q = torch.empty(qs.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=q[:, :16])
    torch.bitwise_right_shift(qs, 4, out=q[:, 16:])
    return q


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of q/k projection rows [n_head*head_dim, in].

    llama.cpp stores rotary pairs interleaved (GPT-J style); HF Llama rotates the two halves of each
    head, so the rows of every head are reordered back from (dim/2, 2) to (2, dim/2).
    """
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
