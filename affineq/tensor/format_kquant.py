"""The k-quant packing formats `q2_k` .. `q6_k`: llama.cpp's super-blocks of 256 weights, stored byte for byte.

A weight [N, K] (K divisible by 256) is N * K / 256 super-blocks, each `type_size` bytes, one row of blocks per
output row (`qdata` uint8 [N, K / 256 * type_size], exactly the GGUF tensor's bytes). Inside a super-block an fp16
`d` (and `dmin`) scales small integer sub-scales (4, 6 or 8 bits) of its 16 or 8 sub-blocks, so the weights cost
the file's bits per weight:

| format | target        | sub-block | bytes / 256 | bpw    | value of code u (per sub-block j)                      |
|--------|---------------|-----------|-------------|--------|--------------------------------------------------------|
| q2_k   | uint2         | 16        | 84          | 2.625  | (d * sc_j) * u - dmin * m_j     (4-bit sc, m)          |
| q3_k   | int3 [-4, 3]  | 16        | 110         | 3.4375 | (d * (sc_j - 32)) * q           (6-bit sc)             |
| q4_k   | uint4         | 32        | 144         | 4.5    | (d * sc_j) * u - dmin * m_j     (6-bit sc, m)          |
| q5_k   | uint5         | 32        | 176         | 5.5    | (d * sc_j) * u - dmin * m_j     (6-bit sc, m)          |
| q6_k   | int6 [-32, 31]| 16        | 210         | 6.5625 | (d * sc_j) * q                  (int8 sc)              |

Every product above is exact in fp32 (an fp16 significand of 11 bits times at most 8 + 6 bits), so the one
rounding is the subtraction of dmin * m_j: `dequantize` computes scale * u + offset per sub-block (scale = d * sc_j,
offset = -dmin * m_j), and q * scale for the signed types (q = u - 2**(bits-1): a zero keeps the scale's sign),
bit-identical to ggml and `gguf.quants.dequantize`. The same (scale, offset) in fp32 per sub-block are the exact
`dense` widening (`dense_tensors`: 2 fp32 per sub-block instead of the packed sub-scales, but the `dense` kernels
read it).

The spec's qparams (`scale`, `zero_point`) are the sub-block scales and the FLOAT-domain zero point
offset + mid * scale (rounded in fp32: informative only; `dequantize` uses the stored bytes). A k-quant tensor is
built from GGUF bytes (`affineq.gguf.load_file`) or by `affineq.configs.kquant.quantize_kquant` (which writes the
bytes with `kquant_encode`), never packed from codes: `pack` raises. `F.linear` on them runs the C++ kernel
`affineq.kquant_linear` (`kquant_kernel`), which reads the super-blocks as stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from affineq.bitpack import pack_codes
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.formats import PackingFormat, TensorLayout, register_format
from affineq.tensor.spec import QuantSpec

__all__ = ["KQUANT_TYPES", "KQuantType", "SUPER_BLOCK", "dense_tensors", "kquant_spec"]

SUPER_BLOCK = 256

Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # u uint8 [B, 256], scale, offset fp32 [B, 256 / g]


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, widened to fp32: [B, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _shifted(b: torch.Tensor, lanes: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """(b viewed [B, -1, 1, lanes] >> each shift) & mask, flattened to [B, -1]: ggml's bit-plane order."""
    s = torch.tensor(shifts, dtype=torch.uint8).view(1, 1, -1, 1)
    return ((b.reshape(b.shape[0], -1, 1, lanes) >> s) & mask).reshape(b.shape[0], -1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit sub-scales and 8 six-bit mins (uint8 [B, 8] each)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _q2_k(b: torch.Tensor) -> Decoded:
    sc = b[:, :16]
    u = _shifted(b[:, 16:80], 32, (0, 2, 4, 6), 3)
    scale = _f16(b, 80) * (sc & 0x0F).float()
    return u, scale, -(_f16(b, 82) * (sc >> 4).float())


def _q3_k(b: torch.Tensor) -> Decoded:
    low = _shifted(b[:, 96:104], 8, (0, 4), 0x0F)
    high = _shifted(b[:, 104:108], 4, (0, 2, 4, 6), 3)
    sc = (low | (high << 4)).to(torch.int8) - 32
    scale = _f16(b, 108) * sc.float()
    # a set hmask bit means "no -4": u = q + 4 = low two bits + 4 * hmask bit
    u = _shifted(b[:, 32:96], 32, (0, 2, 4, 6), 3) | (_shifted(b[:, :32], 32, tuple(range(8)), 1) << 2)
    return u, scale, -4 * scale


def _q4_k(b: torch.Tensor) -> Decoded:
    sc, mn = _scale_min_k4(b[:, 4:16])
    u = _shifted(b[:, 16:144], 32, (0, 4), 0x0F)
    return u, _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _q5_k(b: torch.Tensor) -> Decoded:
    sc, mn = _scale_min_k4(b[:, 4:16])
    u = _shifted(b[:, 48:176], 32, (0, 4), 0x0F) | (_shifted(b[:, 16:48], 32, tuple(range(8)), 1) << 4)
    return u, _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _q6_k(b: torch.Tensor) -> Decoded:
    low = _shifted(b[:, :128], 64, (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _shifted(b[:, 128:192], 32, (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    u = (low | (high << 4)).reshape(b.shape[0], -1)
    scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return u, scale, -32 * scale


@dataclass(frozen=True)
class KQuantType:
    """One k-quant type: format name, bytes per super-block, sub-block size, code target and range, decoder."""

    name: str
    type_size: int
    group: int
    target: str
    quant_min: int
    quant_max: int
    decode: Callable[[torch.Tensor], Decoded]

    @property
    def asymmetric(self) -> bool:
        return self.quant_min == 0


KQUANT_TYPES: dict[str, KQuantType] = {t.name: t for t in (
    KQuantType("q2_k", 84, 16, "uint2", 0, 3, _q2_k),
    KQuantType("q3_k", 110, 16, "int3", -4, 3, _q3_k),
    KQuantType("q4_k", 144, 32, "uint4", 0, 15, _q4_k),
    KQuantType("q5_k", 176, 32, "uint5", 0, 31, _q5_k),
    KQuantType("q6_k", 210, 16, "int6", -32, 31, _q6_k),
)}


def kquant_spec(name: str, shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> QuantSpec:
    """The spec of a k-quant weight [N, K] of format `name` ("q2_k" .. "q6_k")."""
    t = KQUANT_TYPES[name]
    return QuantSpec.create(
        tuple(shape), dtype, t.target, (1, t.group), quant_min=t.quant_min, quant_max=t.quant_max,
        mapping_type=MappingType.ASYMMETRIC if t.asymmetric else MappingType.SYMMETRIC,
        zero_point_domain=ZeroPointDomain.FLOAT if t.asymmetric else ZeroPointDomain.NONE, packing_format=name,
    )


class KQuant(PackingFormat):
    """A k-quant super-block layout; see the module docstring."""

    def __init__(self, kind: KQuantType):
        self.kind = kind
        self.name = kind.name

    def check(self, spec):
        k = self.kind
        if len(spec.shape) != 2 or spec.shape[1] % SUPER_BLOCK:
            return f"{k.name} packs 2-D weights [N, K] with K divisible by {SUPER_BLOCK}, got shape {spec.shape}"
        if spec.block_size != (1, k.group):
            return f"{k.name} has one sub-scale per {k.group} weights: block_size (1, {k.group}), got {spec.block_size}"
        if (spec.target.name, spec.quant_min, spec.quant_max) != (k.target, k.quant_min, k.quant_max):
            return (f"{k.name} holds {k.target} codes [{k.quant_min}, {k.quant_max}], got {spec.target} "
                    f"[{spec.quant_min}, {spec.quant_max}]; build the spec with kquant_spec({k.name!r}, shape)")
        if spec.scale_type is not None:
            return f"{k.name} stores fp16 super-block scales, not scale_type={spec.scale_type}"
        return None

    def layout(self, spec):
        n, kdim = spec.shape
        return {"qdata": TensorLayout((n, kdim // SUPER_BLOCK * self.kind.type_size), (torch.uint8,))}

    def pack(self, codes, scale, zero_point, spec):
        raise ValueError(f"packing_format={self.name!r} holds llama.cpp super-blocks read from a GGUF file "
                         "(affineq.gguf.load_file); it cannot pack arbitrary codes and qparams: use "
                         "packing_format='dense' (or 'plain') for this tensor")

    def _decode(self, qdata: torch.Tensor) -> Decoded:
        return self.kind.decode(qdata.reshape(-1, self.kind.type_size))

    def _rows_decoded(self, qdata: torch.Tensor, n: int) -> Decoded:
        """(u [n, K], scale [n, K/g], offset [n, K/g]) of `qdata`'s n rows."""
        u, scale, offset = self._decode(qdata)
        return u.reshape(n, -1), scale.reshape(n, -1), offset.reshape(n, -1)

    def codes(self, t, spec):
        u, _, _ = self._rows_decoded(t["qdata"], spec.shape[0])
        if self.kind.asymmetric:
            return u
        return (u.to(torch.int8) + self.kind.quant_min).to(spec.target.container)

    def qparams(self, t, spec):
        _, scale, offset = self._rows_decoded(t["qdata"], spec.shape[0])
        if not self.kind.asymmetric:
            return scale, None
        mid = (self.kind.quant_max + self.kind.quant_min + 1) / 2
        return scale, offset + mid * scale

    def _values(self, qdata: torch.Tensor, n: int, output_dtype: torch.dtype) -> torch.Tensor:
        u, scale, offset = self._rows_decoded(qdata, n)
        g = self.kind.group
        if self.kind.asymmetric:
            w = u.float().view(n, -1, g).mul_(scale.unsqueeze(-1)).add_(offset.unsqueeze(-1))
        else:  # q * scale, as ggml: the sign of a zero follows the scale's
            w = u.float().add_(self.kind.quant_min).view(n, -1, g).mul_(scale.unsqueeze(-1))
        return w.view(n, -1).to(output_dtype)

    def dequantize(self, t, spec, output_dtype):
        return self._values(t["qdata"], spec.shape[0], output_dtype)

    def dequantize_rows(self, t, spec, rows, output_dtype):
        return self._values(t["qdata"][rows], rows.numel(), output_dtype)


def dense_tensors(t: dict[str, torch.Tensor], spec: QuantSpec) -> tuple[dict[str, torch.Tensor], QuantSpec]:
    """The exact `dense` widening of a k-quant tensor: (stored tensors, spec) with fp32 scale and offset per
    sub-block (w = scale * u + offset, the same fp32 values bit for bit), which the dense kernels read."""
    fmt = KQUANT_FORMATS[spec.fmt]
    u, scale, offset = fmt._rows_decoded(t["qdata"], spec.shape[0])
    tensors = {"qdata": pack_codes(u.contiguous(), spec.target.bits), "scale": scale.contiguous(),
               "offset": offset.contiguous()}
    return tensors, spec.replace(fmt="dense")


KQUANT_FORMATS: dict[str, KQuant] = {name: KQuant(kind) for name, kind in KQUANT_TYPES.items()}
for _f in KQUANT_FORMATS.values():
    register_format(_f)
