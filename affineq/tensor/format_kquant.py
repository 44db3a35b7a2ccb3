"""The k-quant packing formats `q2_k` .. `q6_k`: llama.cpp's super-blocks of 256 weights, exactly.

In a GGUF file a weight [N, K] (K divisible by 256) is N * K / 256 super-blocks, each `type_size` bytes. Inside a
super-block an fp16 `d` (and `dmin`) scales small integer sub-scales (4, 6 or 8 bits) of its 16 or 8 sub-blocks,
so the weights cost the file's bits per weight:

| format | target        | sub-block | bytes / 256 | bpw    | value of code u (per sub-block j)                      |
|--------|---------------|-----------|-------------|--------|--------------------------------------------------------|
| q2_k   | uint2         | 16        | 84          | 2.625  | (d * sc_j) * u - dmin * m_j     (4-bit sc, m)          |
| q3_k   | int3 [-4, 3]  | 16        | 110         | 3.4375 | (d * (sc_j - 32)) * q           (6-bit sc)             |
| q4_k   | uint4         | 32        | 144         | 4.5    | (d * sc_j) * u - dmin * m_j     (6-bit sc, m)          |
| q5_k   | uint5         | 32        | 176         | 5.5    | (d * sc_j) * u - dmin * m_j     (6-bit sc, m)          |
| q6_k   | int6 [-32, 31]| 16        | 210         | 6.5625 | (d * sc_j) * q                  (int8 sc)              |

The format stores the same values relaid out for the kernels (`from_blocks`; `kquant_encode.to_blocks` gives the
file's blocks back, byte for byte): `qdata` the codes u bit-packed as `dense` packs them (`pack_codes`, K * bits / 8
bytes per row), `scales` one byte per sub-block (q2_k: sc | m << 4 as in the file; q3_k: the 6-bit sc_j + 32;
q4_k / q5_k: sc_j; q6_k: the int8 sc_j), `mins` one byte per sub-block (m_j, q4_k / q5_k only) and `d` the fp16 d
(and dmin) of each super-block [N, K / 256 * (1 or 2)]. The unpacked 6-bit sub-scales of q3_k / q4_k / q5_k cost
1/8 bit per weight more than the file (q4_k 4.625, q5_k 5.625, q3_k 3.5625 bits per weight; q2_k and q6_k as the
file), and in exchange `affineq.kquant_linear` runs the dense kernels (the int4 g32 path for q4_k), expanding
d * sc_j per sub-block as cheaply as the dense formats load their fp32 scales.

Every product above is exact in fp32 (an fp16 significand of 11 bits times at most 8 + 6 bits), so the one
rounding is the subtraction of dmin * m_j: `dequantize` computes scale * u + offset per sub-block (scale = d * sc_j,
offset = -dmin * m_j), and q * scale for the signed types (q = u - 2**(bits-1): a zero keeps the scale's sign),
bit-identical to ggml and `gguf.quants.dequantize`. The same (scale, offset) in fp32 per sub-block are the exact
`dense` widening (`dense_tensors`).

The spec's qparams (`scale`, `zero_point`) are the sub-block scales and the FLOAT-domain zero point
offset + mid * scale (rounded in fp32: informative only; `dequantize` uses the stored bytes). A k-quant tensor is
built from GGUF bytes (`affineq.gguf.load_file`) or by `affineq.configs.kquant.quantize_kquant` (which writes the
blocks with `kquant_encode`), never packed from codes and qparams: `pack` raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from affineq.bitpack import pack_codes, unpack_code_rows, unpack_codes
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.formats import PackingFormat, TensorLayout, register_format
from affineq.tensor.spec import QuantSpec

__all__ = ["KQUANT_TYPES", "KQuantType", "SUPER_BLOCK", "dense_tensors", "from_blocks", "kquant_spec"]

SUPER_BLOCK = 256



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


QParams = tuple[torch.Tensor, torch.Tensor]  # scale, offset fp32 [B, 256 / g]
Parts = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # sub-scale bytes, min bytes or None, fp16 d


def _q2_k_codes(b: torch.Tensor) -> torch.Tensor:
    return _shifted(b[:, 16:80], 32, (0, 2, 4, 6), 3)


def _q2_k_parts(h: torch.Tensor) -> Parts:  # header: scales[16] (sc | m << 4), d, dmin
    return h[:, :16], None, h[:, 16:20].contiguous().view(torch.float16)


def _q2_k_qparams(sc: torch.Tensor, mn: torch.Tensor | None, d: torch.Tensor) -> QParams:
    d = d.float()
    return d[:, :1] * (sc & 0x0F).float(), -(d[:, 1:] * (sc >> 4).float())


def _q3_k_codes(b: torch.Tensor) -> torch.Tensor:
    # a set hmask bit means "no -4": u = q + 4 = low two bits + 4 * hmask bit
    return _shifted(b[:, 32:96], 32, (0, 2, 4, 6), 3) | (_shifted(b[:, :32], 32, tuple(range(8)), 1) << 2)


def _q3_k_parts(h: torch.Tensor) -> Parts:  # header: scales[12] (16 six-bit, bias 32), d
    low = _shifted(h[:, 0:8], 8, (0, 4), 0x0F)
    high = _shifted(h[:, 8:12], 4, (0, 2, 4, 6), 3)
    return low | (high << 4), None, h[:, 12:14].contiguous().view(torch.float16)


def _q3_k_qparams(sc: torch.Tensor, mn: torch.Tensor | None, d: torch.Tensor) -> QParams:
    scale = d.float() * (sc.to(torch.int8) - 32).float()
    return scale, -4 * scale


def _q4_k_codes(b: torch.Tensor) -> torch.Tensor:
    return _shifted(b[:, 16:144], 32, (0, 4), 0x0F)


def _q45_k_parts(h: torch.Tensor) -> Parts:  # header: d, dmin, scales[12] (8 six-bit sc, 8 m)
    sc, mn = _scale_min_k4(h[:, 4:16])
    return sc, mn, h[:, 0:4].contiguous().view(torch.float16)


def _q45_k_qparams(sc: torch.Tensor, mn: torch.Tensor | None, d: torch.Tensor) -> QParams:
    d = d.float()
    return d[:, :1] * sc.float(), -(d[:, 1:] * mn.float())


def _q5_k_codes(b: torch.Tensor) -> torch.Tensor:
    return _shifted(b[:, 48:176], 32, (0, 4), 0x0F) | (_shifted(b[:, 16:48], 32, tuple(range(8)), 1) << 4)


def _q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    low = _shifted(b[:, :128], 64, (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _shifted(b[:, 128:192], 32, (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    return (low | (high << 4)).reshape(b.shape[0], -1)


def _q6_k_parts(h: torch.Tensor) -> Parts:  # header: int8 scales[16], d
    return h[:, :16], None, h[:, 16:18].contiguous().view(torch.float16)


def _q6_k_qparams(sc: torch.Tensor, mn: torch.Tensor | None, d: torch.Tensor) -> QParams:
    scale = d.float() * sc.contiguous().view(torch.int8).float()
    return scale, -32 * scale


@dataclass(frozen=True)
class KQuantType:
    """One k-quant type: format name, bytes per super-block, sub-block size, code target and range, the byte ranges
    of its header (its non-code bytes), and its decoders: `codes` (u [B, 256] of blocks [B, type_size]), `parts`
    (a header [B, header] -> sub-scale bytes [B, J], min bytes [B, J] or None, fp16 d (and dmin) [B, 1 or 2]) and
    `qparams` (parts -> per-sub-block fp32 (scale, offset) [B, J], exact products)."""

    name: str
    type_size: int
    group: int
    target: str
    quant_min: int
    quant_max: int
    header: tuple[tuple[int, int], ...]
    codes: Callable[[torch.Tensor], torch.Tensor]
    parts: Callable[[torch.Tensor], Parts]
    qparams: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], QParams]

    @property
    def asymmetric(self) -> bool:
        return self.quant_min == 0

    @property
    def bits(self) -> int:
        return (self.quant_max - self.quant_min).bit_length()

    @property
    def has_mins(self) -> bool:
        """Whether the mins are stored apart (q4_k / q5_k; q2_k packs each with its sub-scale in one byte)."""
        return self.name in ("q4_k", "q5_k")

    @property
    def supers(self) -> int:
        """fp16 values per super-block: d, and dmin for the asymmetric kinds."""
        return 2 if self.asymmetric else 1

    def headers(self, blocks: torch.Tensor) -> torch.Tensor:
        """The header bytes [B, header] of blocks [B, type_size]."""
        return torch.cat([blocks[:, a:b] for a, b in self.header], 1)


KQUANT_TYPES: dict[str, KQuantType] = {t.name: t for t in (
    KQuantType("q2_k", 84, 16, "uint2", 0, 3, ((0, 16), (80, 84)), _q2_k_codes, _q2_k_parts, _q2_k_qparams),
    KQuantType("q3_k", 110, 16, "int3", -4, 3, ((96, 110),), _q3_k_codes, _q3_k_parts, _q3_k_qparams),
    KQuantType("q4_k", 144, 32, "uint4", 0, 15, ((0, 16),), _q4_k_codes, _q45_k_parts, _q45_k_qparams),
    KQuantType("q5_k", 176, 32, "uint5", 0, 31, ((0, 16),), _q5_k_codes, _q45_k_parts, _q45_k_qparams),
    KQuantType("q6_k", 210, 16, "int6", -32, 31, ((192, 210),), _q6_k_codes, _q6_k_parts, _q6_k_qparams),
)}

_CHUNK_ROWS = 256  # rows relaid out at a time (multiple of the 16-row panels): bounded byte-per-code temporaries


def from_blocks(name: str, blocks) -> dict[str, torch.Tensor]:
    """The stored tensors of format `name` (module docstring) for a weight's super-blocks, uint8
    [N, K / 256 * type_size] (a GGUF tensor's bytes: a tensor, or a numpy array such as the file's memory map,
    read a chunk at a time), relaid out a few panels of rows at a time."""
    t = KQUANT_TYPES[name]
    n = blocks.shape[0]
    nb = blocks.shape[1] // t.type_size
    k, j = nb * SUPER_BLOCK, SUPER_BLOCK // t.group
    out = {"qdata": torch.empty(n, k // 8 * t.bits, dtype=torch.uint8),
           "scales": torch.empty(n, nb * j, dtype=torch.uint8),
           "d": torch.empty(n, nb * t.supers, dtype=torch.float16)}
    if t.has_mins:
        out["mins"] = torch.empty(n, nb * j, dtype=torch.uint8)
    for r in range(0, n, _CHUNK_ROWS):
        chunk = blocks[r:r + _CHUNK_ROWS]
        b = (chunk if isinstance(chunk, torch.Tensor) else torch.from_numpy(chunk.copy())).reshape(-1, t.type_size)
        rows = min(_CHUNK_ROWS, n - r)
        out["qdata"][r:r + rows] = pack_codes(t.codes(b).reshape(rows, k), t.bits)
        sc, mn, d = t.parts(t.headers(b))
        out["scales"][r:r + rows] = sc.reshape(rows, -1)
        out["d"][r:r + rows] = d.reshape(rows, -1)
        if mn is not None:
            out["mins"][r:r + rows] = mn.reshape(rows, -1)
    return out


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
        t, g = self.kind, kdim // self.kind.group
        out = {"qdata": TensorLayout((n, kdim // 8 * t.bits), (torch.uint8,)),
               "scales": TensorLayout((n, g), (torch.uint8,)), "mins": TensorLayout((n, g), (torch.uint8,)),
               "d": TensorLayout((n, kdim // SUPER_BLOCK * t.supers), (torch.float16,))}
        if not t.has_mins:
            del out["mins"]
        return out

    def pack(self, codes, scale, zero_point, spec):
        raise ValueError(f"packing_format={self.name!r} holds llama.cpp super-blocks read from a GGUF file "
                         "(affineq.gguf.load_file); it cannot pack arbitrary codes and qparams: use "
                         "packing_format='dense' (or 'plain') for this tensor")

    def unpacked_codes(self, qdata: torch.Tensor, n: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The unsigned codes u uint8 [n, K] (or of `rows` only)."""
        if rows is None:
            return unpack_codes(qdata, self.kind.bits, n, k)
        return unpack_code_rows(qdata, self.kind.bits, n, k, rows)

    def stored_qparams(self, t: dict[str, torch.Tensor], n: int) -> QParams:
        """fp32 (scale, offset) [n, K / group] of the stored sub-scales, mins and super-block scales (n rows)."""
        j = SUPER_BLOCK // self.kind.group
        sc = t["scales"].reshape(-1, j)
        mn = t["mins"].reshape(-1, j) if "mins" in t else None
        scale, offset = self.kind.qparams(sc, mn, t["d"].reshape(sc.shape[0], -1))
        return scale.reshape(n, -1), offset.reshape(n, -1)

    def codes(self, t, spec):
        u = self.unpacked_codes(t["qdata"], *spec.shape)
        if self.kind.asymmetric:
            return u
        return (u.to(torch.int8) + self.kind.quant_min).to(spec.target.container)

    def qparams(self, t, spec):
        scale, offset = self.stored_qparams(t, spec.shape[0])
        if not self.kind.asymmetric:
            return scale, None
        mid = (self.kind.quant_max + self.kind.quant_min + 1) / 2
        return scale, offset + mid * scale

    def values(self, u: torch.Tensor, t: dict[str, torch.Tensor], output_dtype: torch.dtype) -> torch.Tensor:
        """fp32 weights of codes u [R, K] with the stored qparams `t` of the same R rows, in output_dtype."""
        n = u.shape[0]
        scale, offset = self.stored_qparams(t, n)
        g = self.kind.group
        if self.kind.asymmetric:
            w = u.float().view(n, -1, g).mul_(scale.unsqueeze(-1)).add_(offset.unsqueeze(-1))
        else:  # q * scale, as ggml: the sign of a zero follows the scale's
            w = u.float().add_(self.kind.quant_min).view(n, -1, g).mul_(scale.unsqueeze(-1))
        return w.view(n, -1).to(output_dtype)

    def dequantize(self, t, spec, output_dtype):
        return self.values(self.unpacked_codes(t["qdata"], *spec.shape), t, output_dtype)

    def dequantize_rows(self, t, spec, rows, output_dtype):
        qp = {name: v[rows] for name, v in t.items() if name != "qdata"}
        return self.values(self.unpacked_codes(t["qdata"], *spec.shape, rows), qp, output_dtype)


def dense_tensors(t: dict[str, torch.Tensor], spec: QuantSpec) -> tuple[dict[str, torch.Tensor], QuantSpec]:
    """The exact `dense` widening of a k-quant tensor: (stored tensors, spec) with fp32 scale and offset per
    sub-block (w = scale * u + offset, the same fp32 values bit for bit), which the dense kernels read."""
    fmt = KQUANT_FORMATS[spec.fmt]
    scale, offset = fmt.stored_qparams(t, spec.shape[0])
    tensors = {"qdata": t["qdata"], "scale": scale.contiguous(), "offset": offset.contiguous()}
    return tensors, spec.replace(fmt="dense")


KQUANT_FORMATS: dict[str, KQuant] = {name: KQuant(kind) for name, kind in KQUANT_TYPES.items()}
for _f in KQUANT_FORMATS.values():
    register_format(_f)
