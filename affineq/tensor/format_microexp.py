"""The `microexp` packing format: MX9 / MX6 / MX4 (shared microexponents, see `affineq.microexp`) stored
bit-exactly, (m + 1) + 8/16 + 1/2 bits per element: 9 (MX9), 6 (MX6), 4 (MX4).

It holds an affine tensor of a 2-D weight [N, K] (K divisible by 16) with target int8 / int5 / int3 over
[-(2**m - 1), 2**m - 1], block_size (1, 2), no zero point, `scale_type` e8m0, whose pair scales have the
shared-microexponent form 2**(E - t - (m - 1)): E shared by the 8 pairs of a 16-block, t in {0, 1}.

| stored     | shape                 | dtype | content                                                   |
|------------|-----------------------|-------|-----------------------------------------------------------|
| qdata      | [N, K * (m + 1) / 8]  | uint8 | offset codes u = q + 2**m - 1 in (m + 1) bits, `pack_codes` |
| shared_exp | [N, K / 16]           | uint8 | E + 127                                                   |
| micro_exp  | [N, K / 16]           | uint8 | t, one bit per pair (`pack_codes` with bits=1)            |

No kernel reads this format: `F.linear` on it runs the announced dequantize fallback.
"""

from __future__ import annotations

import torch

from affineq.bitpack import pack_codes, unpack_codes
from affineq.microexp import MICROEXP_FORMATS, MicroexpFormat, floor_log2, pair_scales
from affineq.primitives import ZeroPointDomain
from affineq.tensor.formats import PackingFormat, TensorLayout, register_format
from affineq.tensor.spec import QuantSpec

_BIAS = 127
_BY_BITS = {f.element_bits: f for f in MICROEXP_FORMATS.values()}


def _fmt(spec: QuantSpec) -> MicroexpFormat:
    return _BY_BITS[spec.target.bits]


def _pairs_per_block(f: MicroexpFormat) -> int:
    return f.k1 // f.k2


class Microexp(PackingFormat):
    """Shared-microexponent storage; see the module docstring."""

    name = "microexp"

    def check(self, spec):
        shapes = {f.name: f"{f.target} [{-f.qmax}, {f.qmax}]" for f in MICROEXP_FORMATS.values()}
        f = _BY_BITS.get(spec.target.bits)
        if spec.target.is_float or not spec.target.signed or f is None or (spec.quant_min, spec.quant_max) != (
                -f.qmax, f.qmax):
            return (f"microexp holds MX9/MX6/MX4 codes {shapes}, got {spec.target} [{spec.quant_min}, "
                    f"{spec.quant_max}]; build it with affineq.microexp.microexp_tensor")
        if len(spec.shape) != 2 or spec.shape[1] % f.k1:
            return f"microexp packs 2-D weights [N, K] with K divisible by {f.k1}, got shape {spec.shape}"
        if spec.block_size != (1, f.k2):
            return f"microexp has one scale per pair: block_size (1, {f.k2}), got {spec.block_size}"
        if spec.zero_point_domain is not ZeroPointDomain.NONE or spec.scale_type is None:
            return ("microexp is symmetric with power-of-two scales: zero_point_domain=ZeroPointDomain.NONE and "
                    f"scale_type='e8m0' (got {spec.zero_point_domain.name}, {spec.scale_type})")
        return None

    def layout(self, spec):
        n, k = spec.shape
        f = _fmt(spec)
        return {"qdata": TensorLayout((n, k * f.element_bits // 8), (torch.uint8,)),
                "shared_exp": TensorLayout((n, k // f.k1), (torch.uint8,)),
                "micro_exp": TensorLayout((n, k // f.k1), (torch.uint8,))}

    def represent_qparams(self, scale, zero_point, spec):
        """Min-max pair scales (amax / qmax) -> the shared-microexponent scales of the pairs' amax (equal to
        `quantize_microexp`'s except where amax / qmax * qmax rounds across a power of two)."""
        f = _fmt(spec)
        n = scale.shape[0]
        e_pair = floor_log2((scale.double() * f.qmax).float())
        big_e = e_pair.view(n, -1, _pairs_per_block(f)).amax(-1).clamp(f.min_exponent, _BIAS)
        t = (big_e.repeat_interleave(_pairs_per_block(f), dim=-1) - e_pair).clamp(max=1)
        return pair_scales(big_e, t, f), zero_point

    def _exponents(self, scale: torch.Tensor, f: MicroexpFormat) -> tuple[torch.Tensor, torch.Tensor]:
        """(E [N, K/16], t [N, K/2]) of pair scales 2**(E - t - (m - 1)); ValueError for other scales."""
        n = scale.shape[0]
        p = torch.round(torch.log2(scale.float())).to(torch.int32)
        big_e = (p.view(n, -1, _pairs_per_block(f)).amax(-1) + f.m - 1).clamp(min=f.min_exponent)
        t = big_e.repeat_interleave(_pairs_per_block(f), dim=-1) - (f.m - 1) - p
        if not torch.compiler.is_compiling():
            exact = torch.exp2(p.float()) == scale.float()
            if not bool(exact.all() & (t >= 0).all() & (t <= 1).all() & (big_e <= _BIAS).all()):
                raise ValueError(
                    f"microexp stores pair scales 2**(E - t - {f.m - 1}) with one E in [{f.min_exponent}, "
                    f"{_BIAS}] per {f.k1} values and t in {{0, 1}} per pair; these scales are not of that form "
                    "(not powers of two, or more than one binade apart within a block); build the tensor with "
                    "affineq.microexp.microexp_tensor (or from_spec / from_qparams, which round scales to it)")
        return big_e, t

    def pack(self, codes, scale, zero_point, spec):
        f = _fmt(spec)
        big_e, t = self._exponents(scale, f)
        u = (codes.to(torch.int16) + f.qmax).to(torch.uint8)
        return {"qdata": pack_codes(u, f.element_bits),
                "shared_exp": (big_e + _BIAS).to(torch.uint8),
                "micro_exp": pack_codes(t.to(torch.uint8), 1)}

    def codes(self, t, spec):
        n, k = spec.shape
        f = _fmt(spec)
        u = unpack_codes(t["qdata"], f.element_bits, n, k)
        return (u.to(torch.int16) - f.qmax).to(spec.target.container)

    def qparams(self, t, spec):
        n, k = spec.shape
        f = _fmt(spec)
        micro = unpack_codes(t["micro_exp"], 1, n, k // f.k2).to(torch.int32)
        return pair_scales(t["shared_exp"].to(torch.int32) - _BIAS, micro, f), None


register_format(Microexp())
