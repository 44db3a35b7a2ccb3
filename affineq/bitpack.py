"""The dense bit layout: 1-8 bit codes packed into panels of bit planes (`pack_codes` / `unpack_codes`).

The `dense` packing format (`affineq.tensor.formats.Dense`, and `microexp`) stores its codes this way, and the
C++ kernels in `affineq.cpp` read it. Pure PyTorch: works without a compiler. It sits below both (next to the
numerics) so the kernels' reference implementation and the formats share it without importing each other.

Packed layout (``pack_codes``; a uint8 tensor of shape ``[n, ceil(k / 8) * bits]``):

* ``k`` is zero-padded to ``k8 = ceil(k / 8) * 8``, so ``packed_nbytes = n * k8 * bits / 8``; that is exactly
  ``n * k * bits / 8`` when ``k % 8 == 0`` and at most ``7 * bits / 8`` extra bytes per row otherwise.
* Rows form panels of 16 (the last one has ``n % 16`` rows when ``n`` is not a multiple of 16). Panel ``p``
  is the byte range of rows ``[16p, 16p + 16)`` of the 2-D view, so slicing rows at multiples of 16 slices
  the packed tensor.
* A panel of ``w`` rows is a sequence of units, one per 8 consecutive ``k``; a unit is ``bits * w`` bytes.
* A unit holds bit planes: one 8-bit plane when ``bits == 8``, otherwise a 4-, 2- and 1-bit plane for each
  set bit of ``bits`` in that order, the widest plane holding the lowest code bits (7 = 4 + 2 + 1 with
  shifts 0, 4, 6; 3 = 2 + 1 with shifts 0, 2).
* A plane of width ``q`` has ``q`` slots of ``w`` bytes, byte ``j`` of a slot belonging to row ``j``; slot
  ``s`` packs the codes of ``k = 8 * unit + s * (8 // q) + t`` at bit ``t * q`` for ``t < 8 // q``.

Loading a slot gives one byte per row, which the kernels zero-extend to 16 int32 lanes (16 output rows) and
split with shifts/masks: no cross-lane shuffles, and the same layout serves AVX-512, AVX2 and scalar code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PANEL_ROWS", "check_bits", "pack_codes", "packed_nbytes", "unpack_code_rows", "unpack_codes"]

#: Rows per packed panel: rows [16p, 16p + 16) of ``pack_codes`` output are exactly panel p's bytes.
PANEL_ROWS = 16
_PANEL = PANEL_ROWS


def check_bits(bits: int) -> None:
    """ValueError unless bits is an int in [1, 8]."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in [1, 8], got {bits!r}")


def _planes(bits: int) -> list[tuple[int, int]]:
    """(plane width q, code bit shift) for each bit plane, in storage order."""
    if bits == 8:
        return [(8, 0)]
    planes, shift = [], 0
    for q in (4, 2, 1):
        if bits & q:
            planes.append((q, shift))
            shift += q
    return planes


def packed_nbytes(n: int, k: int, bits: int) -> int:
    """Bytes of ``pack_codes`` output for an ``[n, k]`` code matrix: ``n * ceil(k / 8) * bits``."""
    check_bits(bits)
    if n < 0 or k < 0:
        raise ValueError(f"n and k must be >= 0, got n={n}, k={k}")
    return n * ((k + 7) // 8) * bits


def _pack_panels(c: torch.Tensor, bits: int, w: int) -> torch.Tensor:
    """c: uint8 [P * w, k8] -> flat bytes of P panels of w rows."""
    rows, k8 = c.shape
    p, u = rows // w, k8 // 8
    c = c.reshape(p, w, u, 8)
    planes = []
    for q, shift in _planes(bits):
        v = c >> shift if shift else c
        if q < 8:
            v = v & ((1 << q) - 1)
        v = v.reshape(p, w, u, q, 8 // q)  # k = s * (8 // q) + t
        byte = v[..., 0].clone()
        for t in range(1, 8 // q):
            byte |= v[..., t] << (t * q)
        planes.append(byte.permute(0, 2, 3, 1))  # [P, U, q slots, w rows]
    return torch.cat(planes, dim=2).reshape(-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[n, k]`` (values in ``[0, 2**bits)``) into the kernel layout.

    Returns a contiguous uint8 tensor of shape ``[n, ceil(k / 8) * bits]`` (see the module docstring).
    """
    check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2:
        desc = f"{codes.dtype} tensor of shape {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes)
        raise ValueError(f"pack_codes: codes must be a 2-D uint8 tensor [n, k], got {desc}")
    n, k = codes.shape
    if bits < 8 and codes.numel() > 0 and int(codes.max()) >= 1 << bits:
        raise ValueError(f"pack_codes: codes must be < 2**bits = {1 << bits}, got max {int(codes.max())}")
    codes = codes.detach().cpu()
    k8 = (k + 7) // 8 * 8
    if k8 != k:
        codes = F.pad(codes, (0, k8 - k))
    nfull = n // _PANEL * _PANEL
    parts = []
    if nfull:
        parts.append(_pack_panels(codes[:nfull], bits, _PANEL))
    if n > nfull:
        parts.append(_pack_panels(codes[nfull:], bits, n - nfull))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat.view(n, (k8 // 8) * bits)


def _unpack_panels(data: torch.Tensor, bits: int, p: int, w: int, u: int) -> torch.Tensor:
    """Flat bytes of p panels of w rows -> uint8 codes [p * w, 8 * u]."""
    d = data.view(p, u, bits, w)
    out = None
    s0 = 0
    for q, shift in _planes(bits):
        b = d[:, :, s0 : s0 + q, :]
        s0 += q
        mask = (1 << q) - 1
        fields = [b >> (t * q) & mask if q < 8 else b for t in range(8 // q)]
        v = torch.stack(fields, dim=-1)  # [P, U, q, w, 8 // q]
        v = v.permute(0, 3, 1, 2, 4).reshape(p * w, u * 8)
        v = v << shift if shift else v
        out = v if out is None else out | v
    assert out is not None
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 codes ``[n, k]`` (exact)."""
    check_bits(bits)
    expected = packed_nbytes(n, k, bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.numel() != expected:
        got = f"{packed.dtype} with {packed.numel()} elements" if isinstance(packed, torch.Tensor) else type(packed)
        raise ValueError(f"unpack_codes: packed must be uint8 with {expected} elements for n={n}, k={k}, "
                         f"bits={bits}, got {got}")
    flat = packed.detach().cpu().reshape(-1)
    u = (k + 7) // 8
    nfull = n // _PANEL * _PANEL
    split = nfull * u * bits
    parts = []
    if nfull:
        parts.append(_unpack_panels(flat[:split], bits, nfull // _PANEL, _PANEL, u))
    if n > nfull:
        parts.append(_unpack_panels(flat[split:], bits, 1, n - nfull, u))
    if not parts:
        return torch.empty(0, k, dtype=torch.uint8)
    return torch.cat(parts)[:, :k].contiguous()


def unpack_code_rows(packed: torch.Tensor, bits: int, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64 [R]) of ``unpack_codes(packed, bits, n, k)``: uint8 [R, k], unpacking only the 16-row
    panels that hold them (embedding lookups). Compiled, a panel per row (no dedupe: torch.unique's
    data-dependent size does not fit a fullgraph dynamic compile)."""
    if n % _PANEL:
        return unpack_codes(packed, bits, n, k)[rows]
    if torch.compiler.is_compiling():
        panels, inverse = rows // _PANEL, torch.arange(rows.numel(), device=rows.device)
    else:
        panels, inverse = torch.unique(rows // _PANEL, return_inverse=True)
    sel = packed.view(n // _PANEL, -1)[panels]
    u = unpack_codes(sel.view(panels.numel() * _PANEL, -1), bits, panels.numel() * _PANEL, k)
    return u.view(-1, _PANEL, k)[inverse, rows % _PANEL]
