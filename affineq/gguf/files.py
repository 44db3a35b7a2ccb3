"""GGUF files <-> dicts of tensors: `load_file` and `save_file` (the container through ggml-org's `gguf`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from affineq.gguf import reader, types

__all__ = ["load_file", "save_file"]


def load_file(path: str | os.PathLike, *, widen_kquants: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of GGUF file `path` by its GGUF name, in file order, shaped in torch order
    ([out_features, in_features]).

    F32 / F16 / BF16 tensors come back as plain tensors of that dtype; quantized ones as `AffineQuantizedTensor`s
    (logical dtype float32) holding the file's codes and scales, whose `dequantize()` is bit-identical to
    `gguf.quants.dequantize` (the table in `affineq.gguf.types`). `widen_kquants=True` stores k-quant tensors in
    their exact `dense` widening (the fast kernels; about 2 more bits per weight) instead of their super-block
    bytes. A tensor type affineq cannot hold exactly, or a damaged file, is a ValueError naming it.
    """
    contents = reader.read(path)
    return {e.name: types.to_tensor(e, widen_kquants=widen_kquants) for e in contents.tensors}


def _value_type(gguf, key: str, value: Any):
    """(GGUFValueType, sub_type) of a Python metadata value."""
    vt = gguf.GGUFValueType
    if isinstance(value, bool):
        return vt.BOOL, None
    if isinstance(value, int):
        if value < 0:
            return (vt.INT32 if value >= -2**31 else vt.INT64), None
        return (vt.UINT32 if value < 2**32 else vt.UINT64), None
    if isinstance(value, float):
        return vt.FLOAT32, None
    if isinstance(value, str):
        return vt.STRING, None
    if isinstance(value, reader.StringArray) and len(value):  # an array of strings as `reader` reads it
        return vt.ARRAY, vt.STRING
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.size:  # a numeric array as `reader` reads it
        kind = {"b": vt.BOOL, "u1": vt.UINT8, "i1": vt.INT8, "u2": vt.UINT16, "i2": vt.INT16, "u4": vt.UINT32,
                "i4": vt.INT32, "u8": vt.UINT64, "i8": vt.INT64, "f4": vt.FLOAT32, "f8": vt.FLOAT64}
        sub = kind.get(value.dtype.kind + str(value.dtype.itemsize) if value.dtype.kind != "b" else "b")
        if sub is not None:
            return vt.ARRAY, sub
    if isinstance(value, (list, tuple)) and value:
        sub = {_value_type(gguf, key, v)[0] for v in value}
        if sub <= {vt.INT32, vt.UINT32}:  # integer arrays are int32 in llama.cpp's files (token types)
            sub = {vt.INT32} if all(v < 2**31 for v in value) else sub
        if vt.FLOAT32 in sub and sub <= {vt.FLOAT32, vt.UINT32, vt.INT32}:
            sub = {vt.FLOAT32}
        if len(sub) == 1 and vt.ARRAY not in sub:
            return vt.ARRAY, sub.pop()
    raise ValueError(f"metadata {key!r}: cannot store {type(value).__name__} value {value!r:.60} in GGUF; use bool, "
                     "int, float, str or a non-empty list of one of those (or a 1-D numeric numpy array)")


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, *, arch: str,
              metadata: Mapping[str, Any] | None = None, row_order: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write `tensors` (GGUF names -> float tensors or quantized weights) and `metadata` to GGUF file `path`.

    Each tensor is stored as the GGUF type that holds it exactly (`affineq.gguf.types.from_tensor`); a tensor no
    type holds, or one GGUF cannot hold (not 1 to 4 dims, or no elements; a 0-d tensor: reshape it to [1]), is a
    ValueError naming it, and a value that is not a torch.Tensor a TypeError, raised before anything is written.
    `arch` is `general.architecture`. `row_order[name]` (int64 [rows]): write row `row_order[name][i]` of that 2-D
    tensor as row i (exact for every type: a row's blocks are independent; llama.cpp's q/k permutation). The file
    appears only once completely written (a temporary file is renamed).
    """
    gguf = reader.require_gguf()
    if not isinstance(tensors, Mapping):
        raise TypeError(f"save_file(tensors, ...): tensors must be a mapping of GGUF names to torch.Tensors, got "
                        f"{type(tensors).__name__}")
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"save_file: tensor names must be str (GGUF names), got {name!r}")
    encoded = [(name, *types.from_tensor(name, t)) for name, t in tensors.items()]
    for i, (name, kind, data, shape) in enumerate(encoded):
        if row_order and name in row_order:
            encoded[i] = (name, kind, data[row_order[name].numpy()], shape)
    kv = [(k, v, *_value_type(gguf, k, v)) for k, v in (metadata or {}).items()]
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(suffix=".gguf.tmp", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)  # writes general.architecture itself
        for k, v, vtype, sub in kv:
            w.add_key_value(k, v.tolist() if isinstance(v, np.ndarray) else v, vtype, sub)
        for name, kind, data, _shape in encoded:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
