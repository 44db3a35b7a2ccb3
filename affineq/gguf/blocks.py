"""The byte layouts of ggml's 32-weight block types, both ways: bytes <-> (codes u, scale d, offset m).

Every type here is w = d * u + m per block of 32 consecutive weights of a row, with u an unsigned code:

| type   | bytes | layout                                         | u                  | m                 |
|--------|-------|------------------------------------------------|--------------------|-------------------|
| Q4_0   | 18    | fp16 d, 16 B nibbles                           | 0..15              | -8 d              |
| Q4_1   | 20    | fp16 d, fp16 m, 16 B nibbles                   | 0..15              | m                 |
| Q5_0   | 22    | fp16 d, 4 B high bits, 16 B nibbles            | 0..31              | -16 d             |
| Q5_1   | 24    | fp16 d, fp16 m, 4 B high bits, 16 B nibbles    | 0..31              | m                 |
| Q8_0   | 34    | fp16 d, 32 int8                                | q + 128            | -128 d            |
| IQ4_NL | 18    | fp16 d, 16 B nibbles indexing a 16-entry table | table value + 128  | -128 d            |

Nibbles: byte j holds element j (low) and element j + 16 (high); Q5's bit i of the little-endian uint32 is bit 4
of element i. ggml computes d * (u - c) for the symmetric types and d * u + m for the others; both are exact or
round once in fp32, as `dense` computes them (see `affineq.gguf.types`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "BlockType", "BLOCK_TYPES", "IQ4_NL_VALUES", "decode", "encode"]

BLOCK = 32

#: IQ4_NL's non-uniform 4-bit table (ggml's kvalues_iq4nl).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockType:
    """A 32-weight block type: its size in bytes, code bits, whether it stores a min (`has_min`), and the
    constant c of a symmetric type (w = d * (u - c))."""

    name: str
    type_size: int
    bits: int
    has_min: bool
    center: int = 0


BLOCK_TYPES: dict[str, BlockType] = {b.name: b for b in (
    BlockType("Q4_0", 18, 4, False, 8),
    BlockType("Q4_1", 20, 4, True),
    BlockType("Q5_0", 22, 5, False, 16),
    BlockType("Q5_1", 24, 5, True),
    BlockType("Q8_0", 34, 8, False, 128),
    BlockType("IQ4_NL", 18, 8, False, 128),
)}


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 16] -> [B, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    out = torch.empty(qs.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[:, :16])
    torch.bitwise_right_shift(qs, 4, out=out[:, 16:])
    return out


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes per block (a little-endian uint32) -> its 32 bits, element i = bit i: uint8 [B, 32]."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [B, 4, 8]: byte j, bit k = element 8j+k
    return bits.reshape(qh.shape[0], 32)


def decode(name: str, data: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of blocks uint8 [R, K / 32 * type_size] -> (u uint8 [R, K], d fp32 [R, K / 32], m fp32 [R, K / 32])."""
    t = BLOCK_TYPES[name]
    rows = data.shape[0]
    b = data.reshape(-1, t.type_size)
    d = _f16(b, 0)
    at = 4 if t.has_min else 2
    m = _f16(b, 2) if t.has_min else -t.center * d
    if name == "Q8_0":
        u = b[:, 2:] ^ 0x80  # int8 q -> q + 128
    elif name == "IQ4_NL":
        table = (torch.tensor(IQ4_NL_VALUES, dtype=torch.int16) + 128).to(torch.uint8)
        u = table[_nibbles(b[:, 2:]).long()]
    elif t.bits == 5:
        u = _nibbles(b[:, at + 4:]) | (_high_bits(b[:, at:at + 4]) << 4)
    else:
        u = _nibbles(b[:, at:])
    return u.reshape(rows, k), d.reshape(rows, -1), m.reshape(rows, -1)


def encode(name: str, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Inverse of `decode`: u uint8 [R, K], d (and m for Q4_1 / Q5_1) [R, K / 32] exactly representable in fp16
    -> uint8 [R, K / 32 * type_size]. IQ4_NL is read-only."""
    t = BLOCK_TYPES[name]
    if name == "IQ4_NL":
        raise ValueError("IQ4_NL is read, not written: write the tensor as Q8_0")
    rows = u.shape[0]
    u = u.reshape(-1, BLOCK)
    parts = [d.reshape(-1, 1).to(torch.float16).view(torch.uint8)]
    if t.has_min:
        parts.append(m.reshape(-1, 1).to(torch.float16).view(torch.uint8))
    if name == "Q8_0":
        parts.append(u ^ 0x80)
    else:
        if t.bits == 5:
            high = ((u >> 4) & 1).reshape(-1, 4, 8) << torch.arange(8, dtype=torch.uint8)
            parts.append(high.sum(-1, dtype=torch.uint8))
        low = u & 0x0F
        parts.append(low[:, :16] | (low[:, 16:] << 4))
    return torch.cat(parts, 1).reshape(rows, -1)
