"""k-quant super-blocks written from their parts: the inverse of `format_kquant`'s decoders (ggml's byte layouts).

`encode(name, u, d, sc, dmin=None, mn=None)` -> uint8 [B, type_size] for B super-blocks of 256 weights:

| name | u (uint8 [B, 256]) | sc (per sub-block)           | mn            | d / dmin (fp16 [B]) |
|------|--------------------|------------------------------|---------------|---------------------|
| q2_k | [0, 3]             | [B, 16] in [0, 15]           | [B, 16] 0..15 | d, dmin             |
| q3_k | q + 4, q in [-4, 3]| [B, 16] in [-32, 31]         | -             | d                   |
| q4_k | [0, 15]            | [B, 8] in [0, 63]            | [B, 8] 0..63  | d, dmin             |
| q5_k | [0, 31]            | [B, 8] in [0, 63]            | [B, 8] 0..63  | d, dmin             |
| q6_k | q + 32, q in [-32, 31] | [B, 16] in [-128, 127]   | -             | d                   |

so that `format_kquant` (and `gguf.quants.dequantize`) read back w = d * sc_j * u - dmin * mn_j, or
d * sc_j * (u - 2**(bits-1)) for q3_k / q6_k. Values outside the ranges raise ValueError.

`to_blocks(tensors, spec)` gives a k-quant tensor's super-blocks back (the inverse of `format_kquant.from_blocks`:
the GGUF writer's bytes).
"""

from __future__ import annotations

import torch

from affineq.bitpack import unpack_codes
from affineq.tensor.format_kquant import KQUANT_TYPES, SUPER_BLOCK
from affineq.tensor.spec import QuantSpec

__all__ = ["encode", "to_blocks"]


def _unshifted(v: torch.Tensor, lanes: int, shifts: tuple[int, ...]) -> torch.Tensor:
    """Inverse of format_kquant's _shifted: v [B, chunks * len(shifts) * lanes] (each < 2**step) -> bytes
    [B, chunks * lanes] with element (c, s, l) at bit shifts[s] of byte (c, l)."""
    b = v.shape[0]
    s = torch.tensor(shifts, dtype=torch.int32).view(1, 1, -1, 1)
    return (v.to(torch.int32).reshape(b, -1, len(shifts), lanes) << s).sum(2).to(torch.uint8).reshape(b, -1)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).reshape(-1, 1).contiguous().view(torch.uint8)


def _scales_k4(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """8 six-bit sub-scales and mins -> Q4_K / Q5_K's 12 bytes (inverse of format_kquant._scale_min_k4)."""
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return torch.cat([lo, mid, hi], 1).to(torch.uint8)


def _check_range(what: str, name: str, t: torch.Tensor | None, lo: int, hi: int, shape: tuple[int, int]) -> None:
    if t is None:
        raise ValueError(f"encode({name!r}): {what} is required for {name}")
    if tuple(t.shape) != shape:
        raise ValueError(f"encode({name!r}): {what} must have shape {list(shape)}, got {list(t.shape)}")
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(f"encode({name!r}): {what} must lie in [{lo}, {hi}], got [{int(t.min())}, {int(t.max())}]")


def encode(name: str, u: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None = None,
           mn: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [B, type_size] super-blocks of format `name` from their parts (module docstring)."""
    if name not in KQUANT_TYPES:
        raise ValueError(f"encode: name must be one of {sorted(KQUANT_TYPES)}, got {name!r}")
    t = KQUANT_TYPES[name]
    nb = u.shape[0] if u.dim() == 2 else -1
    _check_range("u", name, u, 0, t.quant_max - t.quant_min, (nb, SUPER_BLOCK))
    nsub = SUPER_BLOCK // t.group
    if name == "q6_k":
        _check_range("sc", name, sc, -128, 127, (nb, nsub))
    elif name == "q3_k":
        _check_range("sc", name, sc, -32, 31, (nb, nsub))
    else:
        smax = 15 if name == "q2_k" else 63
        _check_range("sc", name, sc, 0, smax, (nb, nsub))
        _check_range("mn", name, mn, 0, smax, (nb, nsub))
        if dmin is None:
            raise ValueError(f"encode({name!r}): dmin is required for {name}")
    return _assemble(name, u, _header(name, d, sc, dmin, mn))


def _header(name: str, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None, mn: torch.Tensor | None
            ) -> torch.Tensor:
    """Header bytes [B, header] (`KQuantType.header`) of checked parts: fp16 d (dmin) [B], integer sc (mn) [B, J]."""
    nb = sc.shape[0]
    sc = sc.to(torch.int32)
    if name == "q6_k":
        parts = [sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)]
    elif name == "q3_k":
        s6 = sc + 32
        parts = [_unshifted(s6 & 15, 8, (0, 4)), _unshifted((s6 >> 4) & 3, 4, (0, 2, 4, 6)), _f16_bytes(d)]
    elif name == "q2_k":
        parts = [(sc | (mn.to(torch.int32) << 4)).to(torch.uint8), _f16_bytes(d), _f16_bytes(dmin)]
    else:
        parts = [_f16_bytes(d), _f16_bytes(dmin), _scales_k4(sc, mn)]
    return torch.cat([p.reshape(nb, -1) for p in parts], 1)


def _code_bytes(name: str, u: torch.Tensor) -> list[torch.Tensor]:
    """The code bytes of blocks with codes u [B, 256], in block order (each part [B, bytes])."""
    u = u.to(torch.int32)
    if name == "q6_k":
        return [_unshifted(u & 15, 64, (0, 4)), _unshifted(u >> 4, 32, (0, 2, 4, 6))]
    if name == "q3_k":
        return [_unshifted((u >> 2) & 1, 32, tuple(range(8))), _unshifted(u & 3, 32, (0, 2, 4, 6))]
    if name == "q2_k":
        return [_unshifted(u, 32, (0, 2, 4, 6))]
    if name == "q4_k":
        return [_unshifted(u & 15, 32, (0, 4))]
    return [_unshifted(u >> 4, 32, tuple(range(8))), _unshifted(u & 15, 32, (0, 4))]  # q5_k


def _assemble(name: str, u: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """Blocks uint8 [B, type_size] from codes u [B, 256] and header bytes [B, header_size]: the header's byte
    ranges (`KQuantType.header`) hold the header, the rest the code bytes in order."""
    t = KQUANT_TYPES[name]
    out = torch.empty(u.shape[0], t.type_size, dtype=torch.uint8)
    is_header = torch.zeros(t.type_size, dtype=torch.bool)
    at = 0
    for a, b in t.header:
        out[:, a:b] = header[:, at:at + b - a]
        is_header[a:b] = True
        at += b - a
    out[:, ~is_header] = torch.cat(_code_bytes(name, u), 1)
    return out


def to_blocks(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """A k-quant tensor's super-blocks uint8 [N, K / 256 * type_size] (GGUF's bytes) from its stored tensors."""
    t = KQUANT_TYPES[spec.fmt]
    n, k = spec.shape
    j = SUPER_BLOCK // t.group
    u = unpack_codes(tensors["qdata"], t.bits, n, k).reshape(-1, SUPER_BLOCK)
    b = tensors["scales"].reshape(-1, j)
    d = tensors["d"].reshape(b.shape[0], -1)
    dmin = d[:, 1] if t.supers == 2 else None
    if spec.fmt == "q2_k":
        sc, mn = b & 0x0F, b >> 4
    elif spec.fmt == "q3_k":
        sc, mn = b.to(torch.int32) - 32, None
    elif spec.fmt == "q6_k":
        sc, mn = b.view(torch.int8), None
    else:
        sc, mn = b, tensors["mins"].reshape(-1, j)
    return _assemble(spec.fmt, u, _header(spec.fmt, d[:, 0], sc, dmin, mn)).reshape(n, -1)
