"""GGUF tensor types <-> affineq tensors, exactly.

Reading (`to_tensor`): F32 / F16 / BF16 stay plain tensors of their dtype; the other supported types become
`AffineQuantizedTensor`s holding the file's own codes and scales, dequantizing bit for bit as ggml (and
`gguf.quants.dequantize`) does:

| GGUF type                   | affineq tensor                                                                |
|-----------------------------|-------------------------------------------------------------------------------|
| Q4_0 / Q5_0 / Q8_0          | `dense`, int4 / int5 / int8 codes, symmetric (no zero point), fp16 scale d      |
| Q4_1 / Q5_1                 | `dense`, uint4 / uint5, FLOAT zero point; fp16 d and m, w = d * u + m            |
| IQ4_NL                      | `dense` int8: the table value as the code, fp16 scale d                         |
| MXFP4                       | `dense` fp4_e2m1 codes with e8m0 scale bytes (OCP MX: ggml's block, as is)       |
| Q2_K / Q3_K / Q4_K / Q5_K / Q6_K | `q2_k` .. `q6_k` (`affineq.tensor.format_kquant`: the file's bytes, relaid out) |

`dense` keeps the codes bit-packed and the kernels read it, with the block's fp16 scale (and min) as stored: the
file's bits per weight (Q4_0 4.5, Q4_1 5). The k-quant formats keep the file's bytes relaid out for the same
kernels (codes bit-packed, the super-block headers as they are: Q4_K 4.5 bits per weight); `widen_kquants=True`
gives their exact `dense` widening instead (fp32 scale and offset per sub-block, about 2 more bits per weight).

Writing (`from_tensor`): a float tensor is F32 / F16 / BF16 by its dtype; a k-quant tensor is its own bytes; any
other quantized 2-D weight with groups of 32 is tried as the GGUF types of its code width (Q4_0 then Q4_1, Q5_0
then Q5_1, Q8_0, MXFP4) and written as the first whose decoded values equal the weight's `dequantize()`
exactly; none is an error naming the weight and why each type does not hold it.
"""

from __future__ import annotations

import numpy as np
import torch

from affineq.bitpack import PANEL_ROWS, pack_codes, unpack_codes
from affineq.gguf import blocks
from affineq.gguf.reader import MAX_DIMS, GGUFEntry
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.format_kquant import KQUANT_TYPES, dense_tensors, from_blocks, kquant_spec
from affineq.tensor.formats import dense_affine_map
from affineq.tensor.kquant_encode import to_blocks
from affineq.tensor.spec import QuantSpec

__all__ = ["FLOAT_TYPES", "READ_TYPES", "WRITE_TYPES", "from_tensor", "legacy_spec", "legacy_tensor", "to_tensor"]

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_KQUANTS = {name.upper(): name for name in KQUANT_TYPES}
#: legacy block type -> (code target, symmetric)
_LEGACY = {"Q4_0": ("int4", True), "Q5_0": ("int5", True), "Q8_0": ("int8", True), "IQ4_NL": ("int8", True),
           "Q4_1": ("uint4", False), "Q5_1": ("uint5", False)}
READ_TYPES = (*FLOAT_TYPES, *_LEGACY, "MXFP4", *_KQUANTS)
#: what `from_tensor` tries for a quantized weight, by code bits
_CANDIDATES = {4: ("Q4_0", "Q4_1"), 5: ("Q5_0", "Q5_1"), 8: ("Q8_0",)}
WRITE_TYPES = (*FLOAT_TYPES, "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", *_KQUANTS)


def _unsupported(entry: GGUFEntry, why: str = "") -> ValueError:
    return ValueError(f"GGUF tensor {entry.name!r} has type {entry.ggml_type}, which affineq cannot hold exactly"
                      f"{why}; supported types: {', '.join(READ_TYPES)}")


def to_tensor(entry: GGUFEntry, *, widen_kquants: bool = False) -> torch.Tensor:
    """The tensor of one GGUF entry (see the module docstring); quantized ones have logical dtype float32."""
    name = entry.ggml_type
    if name in _LEGACY and len(entry.shape) == 2:
        return _legacy_chunked(entry)
    if name in _KQUANTS and len(entry.shape) == 2:
        spec = kquant_spec(_KQUANTS[name], entry.shape)
        tensors = from_blocks(spec.fmt, entry.data)  # read from the file's map a chunk of rows at a time
        if widen_kquants:
            tensors, spec = dense_tensors(tensors, spec)
        return AffineQuantizedTensor.from_tensors(tensors, spec)
    data = torch.from_numpy(np.array(entry.data))  # a copy: the result outlives the file's mapping
    if name in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[name]).reshape(entry.shape)
    if name not in READ_TYPES:
        raise _unsupported(entry)
    if len(entry.shape) != 2:
        raise _unsupported(entry, f" as a {len(entry.shape)}-D tensor {entry.shape} (quantized tensors must be 2-D)")
    if name == "MXFP4":
        return _mxfp4(entry, data)
    return legacy_tensor(name, *blocks.decode(name, data, entry.shape[1]))


_CHUNK_ELEMENTS = 1 << 21  # rows decoded at a time: the byte-per-code temporaries stay ~2 MB, not the tensor's size


def _legacy_chunked(entry: GGUFEntry) -> AffineQuantizedTensor:
    """A legacy block tensor decoded a few panels of rows at a time into its final buffers (the codes unpacked to
    a byte each would otherwise briefly take 2-4x the tensor's file size), read straight from the file's map."""
    n, k = entry.shape
    spec = legacy_spec(entry.ggml_type, (n, k))
    bits, has_min = spec.target.bits, blocks.BLOCK_TYPES[entry.ggml_type].has_min
    tensors = {"qdata": torch.empty(n, -(-k // 8) * bits, dtype=torch.uint8),
               "scale": torch.empty(n, k // blocks.BLOCK, dtype=torch.float16)}
    if has_min:
        tensors["offset"] = torch.empty(n, k // blocks.BLOCK, dtype=torch.float16)
    step = max(1, _CHUNK_ELEMENTS // k // PANEL_ROWS) * PANEL_ROWS  # panel-aligned: pack_codes packs by panels
    for r in range(0, n, step):
        chunk = torch.from_numpy(np.array(entry.data[r:r + step]))
        u, d, m = blocks.decode(entry.ggml_type, chunk, k)
        tensors["qdata"][r:r + step] = pack_codes(u, bits)
        tensors["scale"][r:r + step] = d  # fp16 values: exact
        if has_min:
            tensors["offset"][r:r + step] = m
    return AffineQuantizedTensor.from_tensors(tensors, spec)


def legacy_spec(ggml_type: str, shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> QuantSpec:
    """The `dense` spec holding a legacy block type (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL) exactly."""
    target, symmetric = _LEGACY[ggml_type]
    return QuantSpec.create(
        tuple(shape), dtype, target, (1, blocks.BLOCK), packing_format="dense",
        mapping_type=MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC,
        zero_point_domain=ZeroPointDomain.NONE if symmetric else ZeroPointDomain.FLOAT,
    )


def legacy_tensor(ggml_type: str, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> AffineQuantizedTensor:
    """The `dense` tensor of decoded legacy blocks (`blocks.decode`: codes u uint8 [R, K], d and m fp32 values of
    fp16 [R, K / 32], w = d * u + m): the codes bit-packed, d (and m for the types with a min) in fp16, exactly;
    the symmetric types' m = -c * d is implied (no offset tensor)."""
    spec = legacy_spec(ggml_type, tuple(u.shape), dtype)
    tensors = {"qdata": pack_codes(u.contiguous(), spec.target.bits), "scale": d.to(torch.float16).contiguous()}
    if blocks.BLOCK_TYPES[ggml_type].has_min:
        tensors["offset"] = m.to(torch.float16).contiguous()
    return AffineQuantizedTensor.from_tensors(tensors, spec)


def _mxfp4(entry: GGUFEntry, data: torch.Tensor) -> AffineQuantizedTensor:
    n, k = entry.shape
    b = data.reshape(-1, 17)
    if bool((b[:, 0] == 255).any()):  # ggml reads 255 as 2**127, OCP MX (and affineq) as NaN
        raise _unsupported(entry, " with a scale byte 255 (ggml: 2**127, OCP MX: NaN)")
    u = torch.cat([b[:, 1:] & 0x0F, b[:, 1:] >> 4], 1).reshape(n, k)
    spec = QuantSpec.create(entry.shape, torch.float32, "fp4_e2m1", (1, blocks.BLOCK), packing_format="dense",
                            mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE,
                            scale_type="e8m0")
    tensors = {"qdata": pack_codes(u.contiguous(), 4), "scale": b[:, 0].reshape(n, -1).contiguous()}
    return AffineQuantizedTensor.from_tensors(tensors, spec)


# -- writing --------------------------------------------------------------------------------------------------


def from_tensor(name: str, t: torch.Tensor) -> tuple[str, np.ndarray, tuple[int, ...]]:
    """(GGUF type name, bytes uint8 [rows, row_bytes], torch-order shape) of tensor `t` named `name`, exactly;
    ValueError naming the tensor when no GGUF type holds it exactly, or when GGUF cannot hold its shape."""
    check_shape(name, t)
    if not isinstance(t, AffineQuantizedTensor):
        return _float_bytes(name, t)
    s = t.spec
    if s.act_quant is not None or t.act_tensors:
        raise ValueError(f"{name}: GGUF holds weights only; this weight quantizes activations too "
                         f"({s.act_quant}, {list(t.act_tensors)}): use a weight-only config")
    if s.transposed:
        t = t.t()  # the untransposed view holds the stored rows
        s = t.spec
    shape = tuple(s.shape)
    if s.fmt in KQUANT_TYPES:
        return s.fmt.upper(), to_blocks(t.tensors, s).numpy(), shape
    if len(shape) != 2 or s.block_size != (1, blocks.BLOCK):
        raise _no_type(name, t, [f"GGUF's block types have groups of {blocks.BLOCK} along the rows of a 2-D weight "
                                 f"(block_size (1, 32)); this one has shape {shape}, block_size {s.block_size}"])
    w = t.dequantize(torch.float32)
    if s.target.name == "fp4_e2m1" and s.scale_type is not None:
        return _mxfp4_bytes(name, t, w), shape
    if s.target.is_float or s.scale_type is not None or s.target.bits not in _CANDIDATES:
        raise _no_type(name, t, [f"GGUF's block types hold 4, 5 or 8-bit integer codes with float scales, or "
                                 f"fp4 with e8m0 scales (MXFP4); this weight has {s.target} codes"
                                 + (f" with {s.scale_type} scales" if s.scale_type is not None else "")])
    u = _unsigned_codes(t)
    scale, offset = _affine_map(t)
    reasons = []
    for ggml_type in _CANDIDATES[s.target.bits]:
        bt = blocks.BLOCK_TYPES[ggml_type]
        m = offset if bt.has_min else None
        d16, m16 = scale.to(torch.float16), None if m is None else m.to(torch.float16)
        back = _block_values(bt, u, d16.float(), -bt.center * d16.float() if m16 is None else m16.float())
        if torch.equal(back, w):  # the values the file's blocks decode to (tests: decode(encode) is the identity)
            return ggml_type, blocks.encode(ggml_type, u, d16, m16).numpy(), shape
        bad = int((back != w).sum())
        need = "fp16 scale d and min m (w = d * u + m)" if bt.has_min else f"fp16 scale d, w = d * (u - {bt.center})"
        reasons.append(f"{ggml_type} ({need}) differs in {bad} of {w.numel()} values")
    raise _no_type(name, t, reasons)


def _unsigned_codes(t: AffineQuantizedTensor) -> torch.Tensor:
    """u = code - quant_min, uint8 [N, K] (read straight from `dense`'s packed bits, which hold exactly u)."""
    s = t.spec
    if s.fmt == "dense":
        return unpack_codes(t.tensors["qdata"], s.target.bits, *s.shape)
    return (t.codes().to(torch.int32) - int(s.quant_min)).to(torch.uint8)


def _block_values(bt: blocks.BlockType, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """ggml's fp32 values of decoded blocks: d * (u - c), or d * u + m."""
    uf = u.float().view(u.shape[0], -1, blocks.BLOCK)
    if bt.has_min:
        w = uf * d.unsqueeze(-1) + m.unsqueeze(-1)
    else:
        w = (uf - bt.center) * d.unsqueeze(-1)
    return w.view(u.shape)


def _affine_map(t: AffineQuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scale, offset) [R, K/32] of w = scale * u + offset, u = code - quant_min."""
    s = t.spec
    if s.fmt == "dense" and t.tensors["scale"].dtype in (torch.float32, torch.float16):
        return dense_affine_map(t.tensors, s)  # as stored (a Q4_1 min stays bit-exact)
    scale = t.scale.float()
    zp = t.zero_point
    if s.zero_point_domain is ZeroPointDomain.INT:
        return scale, scale * (s.quant_min - zp.float())
    if s.zero_point_domain is ZeroPointDomain.FLOAT:
        return scale, zp.float() + scale * (s.quant_min - (s.quant_max + s.quant_min + 1) / 2)
    return scale, scale * s.quant_min


def _mxfp4_bytes(name: str, t: AffineQuantizedTensor, w: torch.Tensor) -> tuple[str, np.ndarray]:
    if t.spec.fmt != "dense":
        t = t.to_format("dense")
    n, k = t.spec.shape
    u = t.codes().view(torch.uint8)
    e = t.tensors["scale"].reshape(-1, 1)
    if bool((e == 255).any()):
        raise _no_type(name, t, ["MXFP4: a scale byte is 255 (NaN in OCP MX, 2**127 in ggml)"])
    u = u.reshape(-1, blocks.BLOCK)
    data = torch.cat([e, u[:, :16] | (u[:, 16:] << 4)], 1).reshape(n, -1)
    return "MXFP4", data.numpy()


def check_shape(name: str, t: object) -> None:
    """TypeError unless `t` is a torch.Tensor; ValueError unless it has 1 to 4 dims and at least one element:
    what a GGUF file (and llama.cpp, and `load_file`) accepts. A 0-d tensor is refused rather than written as
    shape [1]: it would not load back as it was saved."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r}: GGUF values must be torch.Tensors, got {type(t).__name__}; pass "
                        "torch.tensor(value)")
    if not 1 <= t.dim() <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {t.dim()} dims (shape {tuple(t.shape)}); GGUF tensors have 1 to "
                         f"{MAX_DIMS} dims: reshape it (a scalar as shape [1])")
    if t.numel() == 0:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, no elements; GGUF tensors have at least one "
                         "element: leave it out")


def _float_bytes(name: str, t: torch.Tensor) -> tuple[str, np.ndarray, tuple[int, ...]]:
    t = t.detach().cpu().contiguous()
    kind = next((k for k, dt in FLOAT_TYPES.items() if dt == t.dtype), None)
    if kind is None:
        raise ValueError(f"{name}: GGUF stores float tensors as float32, float16 or bfloat16, got {t.dtype}; "
                         "cast it first")
    shape = tuple(t.shape)
    return kind, t.reshape(shape).view(torch.uint8).numpy(), shape  # [*shape[:-1], row bytes]


def _no_type(name: str, t: AffineQuantizedTensor, reasons: list[str]) -> ValueError:
    s = t.spec
    return ValueError(
        f"{name}: no GGUF type holds this weight exactly ({s.target} codes [{s.quant_min}, {s.quant_max}], "
        f"block_size {s.block_size}, {s.zero_point_domain.name} zero point, format {s.fmt}): " + "; ".join(reasons)
        + ". Nearest GGUF types: Q4_0 / Q5_0 / Q8_0 (symmetric int4 / int5 / int8, groups of 32, fp16-exact "
        "scales, e.g. IntxWeightOnlyConfig(torch.int4, PerGroup(32)) with bf16 scales), Q4_1 / Q5_1 (asymmetric "
        "uint4 / uint5, groups of 32, fp16-exact scale and min); or keep the weight in float (F32 / F16 / BF16)"
    )
