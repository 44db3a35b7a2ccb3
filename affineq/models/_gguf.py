"""SmolLM2's GGUF as float32 tensors: `GGUFFile` (the file parsed and checked by `affineq.gguf.reader`) and
`dequantize` (one tensor's blocks to float32 with vectorized torch ops, bit-identical to ggml's).

The float path of `load_smollm2`: the demo quantizes the float model again. `affineq.gguf.load_model` keeps the
file's codes instead. Only the tensor types SmolLM2's file uses dequantize here (F32, F16, Q8_0, Q4_0, Q4_1);
anything else raises.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from affineq.gguf import reader

# ggml tensor types dequantized here: name -> (elements per block, bytes per block).
GGML_TYPES = {"F32": (1, 4), "F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}


class GGUFFile:
    """A parsed GGUF file: `metadata` (`affineq.gguf.reader`'s values) and `tensors` (name -> `GGUFEntry`: its
    ggml type name, torch-order shape and bytes, mapped); `load` dequantizes one on demand. A damaged file is a
    ValueError naming it (the reader's checks)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        contents = reader.read(self.path)
        self.metadata = contents.metadata
        self.tensors = {e.name: e for e in contents.tensors}

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [nbytes] (a copy, so the file can be closed)."""
        return torch.from_numpy(np.array(self.tensors[name].data).reshape(-1))

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
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"cannot dequantize ggml type {ggml_type} here (F32, F16, Q8_0, Q4_0, Q4_1); "
                         "affineq.gguf.load_file reads every type")
    block, block_bytes = GGML_TYPES[ggml_type]
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
