"""MX9 / MX6 / MX4: block formats with shared microexponents (Rouhani et al., "With Shared Microexponents,
A Little Shifting Goes a Long Way", ISCA 2023).

Definition (one block of k1 = 16 consecutive values along `axis`, sub-blocks of k2 = 2):

    e(x)   = floor(log2 |x|)                      (-inf for x = 0)
    E      = clamp(max over the block of e(x), E_min, 127)      8-bit shared exponent, byte E + 127
    t      = min(E - max over the pair of e(x), 1)              1-bit microexponent per pair (1 for a zero pair)
    scale  = 2**(E - t - (m - 1))                               one power of two per pair
    q      = min(round_half_even(|x| / scale), 2**m - 1)        m-bit magnitude, plus a sign bit
    value  = sign(x) * q * scale

| format | m | element bits | bits / element (element + 8/16 + 1/2) | code range   | affine target |
|--------|---|--------------|----------------------------------------|--------------|---------------|
| mx9    | 7 | 8            | 9                                      | [-127, 127]  | int8          |
| mx6    | 4 | 5            | 6                                      | [-15, 15]    | int5          |
| mx4    | 2 | 3            | 4                                      | [-3, 3]      | int3          |

The magnitude is a fixed-point number with one integer bit and m - 1 fraction bits (no implicit leading
one), so the block's largest value keeps m significant bits and a pair one binade below it keeps them too
(t = 1 shifts its scale down by one bit: the "little shifting").

E_min = m - 127 (not -127): it keeps every pair scale >= 2**-127, so each scale is an e8m0 value and the
tensor is exactly an `AffineQuantizedTensor` (target int8/int5/int3, block (1, 2), symmetric, no zero point,
`scale_type` e8m0). It only matters for blocks whose largest |x| is below 2**(m - 127) (~1e-36), which flush
more to zero than an unclamped exponent would. Inf and NaN are refused (the format has no encoding for them).

`quantize_microexp` / `dequantize_microexp` work on any tensor (blocks along `axis`); `microexp_tensor`
builds the `AffineQuantizedTensor` of a 2-D weight in the bit-exact `microexp` packing format
(`affineq.tensor.format_microexp`). There is no C++ kernel for it: `F.linear` on such a weight runs the
announced dequantize fallback. MX6 / MX4 values also fit the `dense` format the kernels read (`microexp_spec`,
``microexp_tensor(..., packing_format="dense")``): sign * q * 2**(E - t - (m - 1)) = (sign * q * 2**(1 - t)) *
2**(E - m), an (m + 2)-bit code with one e8m0 scale per block of 16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["DENSE_MICROEXP", "MICROEXP_FORMATS", "MicroexpCodes", "MicroexpFormat", "dequantize_microexp",
           "microexp_format", "microexp_spec", "microexp_tensor", "quantize_microexp"]

_BIAS = 127


@dataclass(frozen=True)
class MicroexpFormat:
    """One shared-microexponent format: `m` magnitude bits, blocks of `k1` sharing an 8-bit exponent,
    sub-blocks of `k2` sharing a 1-bit microexponent."""

    name: str
    m: int
    k1: int = 16
    k2: int = 2

    @property
    def qmax(self) -> int:
        return (1 << self.m) - 1

    @property
    def element_bits(self) -> int:
        return self.m + 1

    @property
    def bits_per_element(self) -> float:
        return self.element_bits + 8 / self.k1 + 1 / self.k2

    @property
    def min_exponent(self) -> int:
        """The lowest shared exponent: the smallest pair scale 2**(E_min - 1 - (m - 1)) is 2**-127."""
        return self.m - _BIAS

    @property
    def target(self) -> str:
        return f"int{self.element_bits}"


MICROEXP_FORMATS: dict[str, MicroexpFormat] = {f.name: f for f in (
    MicroexpFormat("mx9", 7), MicroexpFormat("mx6", 4), MicroexpFormat("mx4", 2))}


def microexp_format(fmt: str | MicroexpFormat) -> MicroexpFormat:
    """The `MicroexpFormat` named `fmt` ("mx9", "mx6", "mx4")."""
    if isinstance(fmt, MicroexpFormat):
        return fmt
    if fmt not in MICROEXP_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not a shared-microexponent format; use one of {list(MICROEXP_FORMATS)}")
    return MICROEXP_FORMATS[fmt]


class MicroexpCodes(NamedTuple):
    """codes: int8 sign * q, shape of x (blocked dim moved last); shared_exp: uint8 E + 127 [..., K/16];
    micro_exp: uint8 t in {0, 1} [..., K/2]."""

    codes: torch.Tensor
    shared_exp: torch.Tensor
    micro_exp: torch.Tensor


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) as int32 for a > 0 (exact, through frexp: a = f * 2**e, f in [0.5, 1)); -2**30 for 0."""
    _, e = torch.frexp(a)
    return torch.where(a > 0, e.to(torch.int32) - 1, torch.full_like(e, -(1 << 30), dtype=torch.int32))


def pair_exponents(x: torch.Tensor, fmt: str | MicroexpFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(E int32 [..., K/16], t int32 [..., K/2]) of `x` [..., K] (blocks along the last dim)."""
    f = microexp_format(fmt)
    k = x.shape[-1]
    e = floor_log2(x.float().abs())
    e_pair = e.view(*x.shape[:-1], k // f.k2, f.k2).amax(-1)
    e_block = e_pair.view(*x.shape[:-1], k // f.k1, f.k1 // f.k2).amax(-1)
    big_e = e_block.clamp(f.min_exponent, _BIAS)
    t = (big_e.repeat_interleave(f.k1 // f.k2, dim=-1) - e_pair).clamp(max=1)
    return big_e, t


def pair_scales(big_e: torch.Tensor, t: torch.Tensor, fmt: str | MicroexpFormat) -> torch.Tensor:
    """float32 scale 2**(E - t - (m - 1)) per pair [..., K/2] from E [..., K/16] and t [..., K/2]."""
    f = microexp_format(fmt)
    p = big_e.repeat_interleave(f.k1 // f.k2, dim=-1) - t - (f.m - 1)
    return torch.exp2(p.float())


def quantize_microexp(x: torch.Tensor, fmt: str | MicroexpFormat = "mx9", axis: int = -1) -> MicroexpCodes:
    """Quantize float `x` to a shared-microexponent format along `axis` (its size divisible by 16).

    Returns `MicroexpCodes` with `axis` moved last: codes int8 (sign * q, |q| <= 2**m - 1), the shared
    exponent bytes uint8 (E + 127) and the microexponents uint8 (0 or 1), see the module docstring."""
    f = microexp_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() == 0:
        raise ValueError(f"x must be a floating-point tensor with at least one dim, got {x!r:.80}")
    x = x.movedim(axis, -1)
    if x.shape[-1] % f.k1:
        raise ValueError(f"{f.name} blocks {f.k1} values along axis={axis}; its size {x.shape[-1]} is not "
                         f"divisible by {f.k1} (pad it, or pick another axis)")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"x holds inf or NaN, which {f.name} cannot encode; replace them before quantizing")
    big_e, t = pair_exponents(x, f)
    scale = pair_scales(big_e, t, f)
    xp = x.float().reshape(*x.shape[:-1], -1, f.k2)
    q = torch.round(xp.abs() / scale.unsqueeze(-1)).clamp(max=f.qmax)  # torch.round: half to even
    codes = (torch.sign(xp) * q).to(torch.int8).reshape(x.shape)
    return MicroexpCodes(codes, (big_e + _BIAS).to(torch.uint8), t.to(torch.uint8))


def dequantize_microexp(c: MicroexpCodes, fmt: str | MicroexpFormat = "mx9", axis: int = -1,
                        output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values sign * q * 2**(E - t - (m - 1)) of `MicroexpCodes` (exact in float32), with the blocked dim put
    back at `axis`."""
    f = microexp_format(fmt)
    scale = pair_scales(c.shared_exp.to(torch.int32) - _BIAS, c.micro_exp.to(torch.int32), f)
    x = c.codes.float().reshape(*c.codes.shape[:-1], -1, f.k2) * scale.unsqueeze(-1)
    return x.reshape(c.codes.shape).movedim(-1, axis).to(output_dtype)


#: The formats whose values `dense` holds: codes doubled where t = 0 need m + 2 bits, at most 8.
DENSE_MICROEXP = ("mx6", "mx4")


def microexp_spec(shape: tuple[int, ...], dtype: torch.dtype, fmt: str | MicroexpFormat,
                  packing_format: str = "microexp"):
    """The `QuantSpec` of a `microexp_tensor` [N, K] in `packing_format`: "microexp" (the format itself: int(m + 1)
    codes with a scale per pair) or "dense" (mx6 / mx4 only: the same values as int(m + 2) codes with one e8m0
    scale 2**(E - m) per 16-block, code = sign * q * 2**(1 - t), which `affineq.lowbit_linear` reads)."""
    from affineq.primitives import MappingType, ZeroPointDomain
    from affineq.tensor.spec import QuantSpec

    f = microexp_format(fmt)
    if packing_format == "dense":
        if f.name not in DENSE_MICROEXP:
            raise ValueError(f"packing_format='dense' holds {' / '.join(DENSE_MICROEXP)} only: {f.name}'s codes "
                             f"doubled where the micro-exponent is 0 need {f.m + 2} bits, more than the kernels' 8; "
                             "use packing_format='microexp' (dequantize fallback) or MXWeightOnlyConfig('int8')")
        qmax = 2 * f.qmax
        return QuantSpec.create(tuple(shape), dtype, f"int{f.m + 2}", (1, f.k1), mapping_type=MappingType.SYMMETRIC,
                                zero_point_domain=ZeroPointDomain.NONE, quant_min=-qmax, quant_max=qmax,
                                packing_format="dense", scale_type="e8m0")
    if packing_format != "microexp":
        raise ValueError(f"packing_format={packing_format!r}: use 'microexp' or 'dense'")
    return QuantSpec.create(tuple(shape), dtype, f.target, (1, f.k2), mapping_type=MappingType.SYMMETRIC,
                            zero_point_domain=ZeroPointDomain.NONE, quant_min=-f.qmax, quant_max=f.qmax,
                            packing_format="microexp", scale_type="e8m0")


def microexp_tensor(weight: torch.Tensor, fmt: str | MicroexpFormat = "mx9", packing_format: str = "microexp"):
    """An `AffineQuantizedTensor` of 2-D `weight` [N, K] (K divisible by 16) in MX9/MX6/MX4, blocks along K.

    "microexp": stored bit-exactly (9 / 6 / 4 bits per element); its codes, scales and dequantization equal
    `quantize_microexp(weight, fmt)` exactly, and linear on it runs the announced dequantize fallback (no kernel
    reads `microexp`). "dense" (mx6 / mx4): the same values (`microexp_spec`) in 6.5 / 4.5 bits per element, which
    the C++ kernels read."""
    from affineq.tensor.affine import AffineQuantizedTensor

    f = microexp_format(fmt)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [N, K], got {getattr(weight, 'shape', type(weight))}")
    spec = microexp_spec(tuple(weight.shape), weight.dtype, f, packing_format)
    c = quantize_microexp(weight, f)
    if packing_format == "dense":  # sign q 2**(E - t - (m - 1)) = (sign q 2**(1 - t)) 2**(E - m)
        t = c.micro_exp.to(torch.int32).repeat_interleave(f.k2, dim=-1)
        codes = (c.codes.to(torch.int32) << (1 - t)).to(torch.int8)
        scale = torch.exp2((c.shared_exp.to(torch.int32) - _BIAS - f.m).float())  # [N, K / 16], powers of two
        return AffineQuantizedTensor.from_codes(codes, scale, None, spec)
    scale = pair_scales(c.shared_exp.to(torch.int32) - _BIAS, c.micro_exp.to(torch.int32), f)
    return AffineQuantizedTensor.from_codes(c.codes, scale, None, spec)
