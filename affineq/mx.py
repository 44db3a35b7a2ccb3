"""OCP Microscaling (MX) v1.0 numerics: blocks of k elements sharing one E8M0 power-of-two scale.

A block of ``k`` (32) consecutive values along the reduction axis is stored as one shared scale
``X = 2**e`` (an E8M0 byte ``e + 127``; byte 0xFF is NaN) and ``k`` element codes ``P_i`` of an element type:
``v_i = X * P_i``. Element types (``emax_elem`` = exponent of the element's largest normal):

| name       | element dtype             | max      | emax_elem |
|------------|---------------------------|----------|-----------|
| MXFP8 E4M3 | torch.float8_e4m3fn       | 448      | 8         |
| MXFP8 E5M2 | torch.float8_e5m2         | 57344    | 15        |
| MXFP6 E2M3 | "fp6_e2m3"                | 7.5      | 2         |
| MXFP6 E3M2 | "fp6_e3m2"                | 28       | 4         |
| MXFP4 E2M1 | "fp4_e2m1"                | 6        | 2         |
| MXINT8     | torch.int8 (codes +-127)  | 127/64   | 0         |

MXINT8 elements are 8-bit two's complement with an implicit scale 2**-6 (value ``P * 2**-6``). Internally
every element type is a *code range* whose largest code is ``qmax`` (6 for fp4, 127 for int8) with
``emax_code = floor(log2(qmax))``, and the *code scale* is ``2**E`` with ``v = 2**E * code``. For float
elements ``E = e``; for MXINT8 ``E = e - 6``: the element's 2**-6 is folded into the exponent that
`AffineQuantizedTensor` stores (its e8m0 byte is ``E + 127``), while `quantize_mx` returns the OCP byte
``e + 127``. The two differ only where the OCP exponent is below -121 (amax < 2**-121), where the stored
code exponent clamps at -127.

Shared exponent of a block with ``amax = max |x_i|`` (``scale_mode``):

- ``"floor"`` (the OCP default): ``e = floor(log2(amax)) - emax_elem``. Values above ``elem_max * X``
  (amax's binade can exceed the element max) saturate to +-elem_max.
- ``"ceil"``: ``e = ceil(log2(amax)) - emax_elem``.
- ``"even"``: amax first rounded to nearest-even at the element's mantissa width (mbits; for integer codes
  ``emax_code`` fractional bits, 6 for MXINT8), then ``floor(log2(.)) - emax_elem``.
- ``"rceil"``: ``e = ceil(log2(amax / elem_max))``: the smallest power of two that never clips.

``e`` clamps to [-127, 127]; an all-zero block gets ``e = -127`` (codes 0); a block with a NaN or Inf gets
scale byte 0xFF and decodes to all NaN. Elements are ``x_i / X`` clamped to +-elem_max and rounded to nearest
even on the element grid (subnormals included). All exponent arithmetic is exact (frexp, float64).
"""

from __future__ import annotations

import math

import torch

from affineq.dtypes import QType, qtype

__all__ = [
    "MX_ELEMENT_DTYPES",
    "SCALE_MODES",
    "dequantize_mx",
    "e8m0_to_torch",
    "fp4_from_torch",
    "fp4_to_torch",
    "fake_quantize_mx",
    "mx_bits_per_element",
    "mx_element",
    "pow2_scale_exponent",
    "quantize_mx",
]

#: How a block's shared power-of-two exponent is chosen (see the module docstring).
SCALE_MODES = ("floor", "ceil", "even", "rceil")

_ALIASES = {
    "mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2", "mxfp6_e2m3": "fp6_e2m3",
    "mxfp6_e3m2": "fp6_e3m2", "mxfp4": "fp4_e2m1", "mxfp4_e2m1": "fp4_e2m1", "mxint8": "int8",
}
#: The OCP MX element types by QType name (aliases "mxfp4", "mxfp6_e2m3", "mxint8", ... also accepted).
MX_ELEMENT_DTYPES = ("float8_e4m3fn", "float8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "int8")
_INT8_FOLD = 6  # MXINT8's implicit element scale 2**-6
_BIAS = 127
_NAN_BYTE = 255


def mx_element(element_dtype, param: str = "element_dtype") -> QType:
    """The QType of an OCP MX element type given as a torch dtype, QType, name or alias ("mxfp4")."""
    name = element_dtype.name if isinstance(element_dtype, QType) else (
        str(element_dtype).removeprefix("torch.") if isinstance(element_dtype, torch.dtype) else element_dtype)
    if isinstance(name, str) and name.lower() in ("mx6", "mx9"):
        raise ValueError(f"{param}={element_dtype!r}: MX6/MX9 share micro-exponents (Rouhani et al. 2023), they are "
                         "not OCP MX element types; use affineq.MicroexpWeightOnlyConfig(fmt='mx9') (or 'mx6')")
    name = _ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in MX_ELEMENT_DTYPES:
        raise ValueError(f"{param}={element_dtype!r} is not an OCP MX element type; use one of "
                         f"{list(MX_ELEMENT_DTYPES)} (as torch dtypes or names) or {sorted(_ALIASES)}")
    return qtype(name)


def _check_mode(scale_mode) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r}: use one of {list(SCALE_MODES)} ('floor' is the OCP rule)")


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2(v)) exactly for positive finite float64 v (frexp: v = m * 2**k, m in [0.5, 1))."""
    _, k = torch.frexp(v)
    return k - 1


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    m, k = torch.frexp(v)
    return torch.where(m == 0.5, k - 1, k)


def _code_params(t: QType, quant_max: float | None) -> tuple[float, int, int]:
    """(qmax, emax_code, mbits) of a code type: the largest code, floor(log2(qmax)), and the mantissa width
    "even" rounds amax to (a float's mantissa bits; emax_code for integers: their fractional bits)."""
    qmax = float(t.qmax if quant_max is None else quant_max)
    emax = math.frexp(qmax)[1] - 1  # floor(log2(qmax)), exact
    mbits = t.format.mantissa_bits if t.is_float else emax
    return qmax, emax, mbits


def pow2_scale_exponent(amax: torch.Tensor, element, scale_mode: str = "floor",
                        quant_max: float | None = None) -> torch.Tensor:
    """Exponent E (int32, same shape as `amax`) of the power-of-two *code* scale 2**E of blocks with maxima
    `amax` (>= 0, finite), for codes of `element` up to `quant_max` (default: the type's max), by `scale_mode`.

    E is clamped to [-127, 127]; amax == 0 gives -127. For floats E is the OCP shared exponent; for integer
    codes (MXINT8) it includes the element scale (OCP e = E + 6). This is the one scale rule of the product:
    `AffineQuantizedTensor.from_spec` uses it for e8m0 scales with `QParamOptions.scale_mode`."""
    _check_mode(scale_mode)
    t = element if isinstance(element, QType) else qtype(element)
    qmax, emax, mbits = _code_params(t, quant_max)
    a = amax.double()
    safe = torch.where(a > 0, a, torch.ones_like(a))
    if scale_mode == "floor":
        e = floor_log2(safe) - emax
    elif scale_mode == "ceil":
        e = _ceil_log2(safe) - emax
    elif scale_mode == "even":
        step = torch.ldexp(torch.ones_like(safe), floor_log2(safe) - mbits)
        e = floor_log2(torch.round(safe / step) * step) - emax  # exact: step is a power of two
    else:
        e = _ceil_log2(safe / qmax)
        e = torch.where(safe > torch.ldexp(torch.full_like(safe, qmax), e), e + 1, e)  # a rounded-down quotient
    e = torch.where(a > 0, e, torch.full_like(e, -_BIAS))
    return e.clamp(-_BIAS, _BIAS).to(torch.int32)


def _fold(t: QType) -> int:
    return 0 if t.is_float else _INT8_FOLD


def _blocked(x: torch.Tensor, block_size: int, axis: int, name: str) -> tuple[torch.Tensor, int]:
    """x moved so `axis` is last and split into [..., K / block_size, block_size]; and the normalized axis."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (32 for OCP MX), got {block_size!r}")
    if x.dim() == 0:
        raise ValueError(f"{name}: x must have at least one dim, got a 0-d tensor")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis={axis} is out of range for a {x.dim()}-D tensor; use the reduction dim (-1)")
    axis = axis % x.dim()
    k = x.shape[axis]
    if k % block_size:
        raise ValueError(f"{name}: the size {k} of axis {axis} is not divisible by block_size={block_size}; pad that "
                         "dim to a multiple of block_size or pick a block_size that divides it")
    xm = x.movedim(axis, -1)
    return xm.reshape(*xm.shape[:-1], k // block_size, block_size), axis


def _unblocked(b: torch.Tensor, axis: int) -> torch.Tensor:
    return b.reshape(*b.shape[:-2], -1).movedim(-1, axis)


def quantize_mx(x: torch.Tensor, element_dtype, block_size: int = 32, scale_mode: str = "floor",
                axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization of float `x` -> (codes, scale_bytes).

    codes: shape of x, in the element's container (torch float8 dtypes, uint8 bit patterns for fp6/fp4,
    int8 in [-127, 127] for MXINT8). scale_bytes: uint8 E8M0 (e + 127; 255 = NaN block), shape of x with
    `axis` divided by `block_size`. See the module docstring for the rules."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_mx: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    t = mx_element(element_dtype)
    _check_mode(scale_mode)
    xb, axis = _blocked(x, block_size, axis, "quantize_mx")
    xf = xb.float() if x.dtype != torch.float64 else xb
    finite = torch.isfinite(xf).all(-1, keepdim=True)
    xf = torch.where(finite, xf, torch.zeros_like(xf))
    amax = xf.abs().amax(-1, keepdim=True)
    qmax, fold = float(t.qmax if t.is_float else 127), _fold(t)
    e_ocp = (pow2_scale_exponent(amax, t, scale_mode, qmax) + fold).clamp(-_BIAS, _BIAS)
    codes = _encode(xf, e_ocp - fold, t, qmax)
    scale_bytes = torch.where(finite, e_ocp + _BIAS, torch.full_like(e_ocp, _NAN_BYTE)).to(torch.uint8)
    return _unblocked(codes, axis), _unblocked(scale_bytes, axis)


def _encode(xf: torch.Tensor, e_code: torch.Tensor, t: QType, qmax: float) -> torch.Tensor:
    """Codes of xf [..., B, k] with code exponents e_code [..., B, 1]: clamp(x * 2**-E) rounded on the grid."""
    y = torch.ldexp(xf, (-e_code).to(xf.dtype)).float().clamp(-qmax, qmax)
    if not t.is_float:
        return torch.round(y).to(torch.int8)
    return t.encode(y)


def dequantize_mx(codes: torch.Tensor, scale_bytes: torch.Tensor, element_dtype, block_size: int = 32,
                  axis: int = -1, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of MX `codes` with E8M0 `scale_bytes` (as `quantize_mx` returns them): decode(P) * 2**(byte - 127)
    (times 2**-6 for MXINT8), NaN where the byte is 255; computed in float32, saturated to `output_dtype`."""
    t = mx_element(element_dtype)
    if not isinstance(scale_bytes, torch.Tensor) or scale_bytes.dtype != torch.uint8:
        raise ValueError(f"scale_bytes must be a uint8 tensor of E8M0 exponents (as quantize_mx returns), got "
                         f"{getattr(scale_bytes, 'dtype', type(scale_bytes))}")
    cb, axis = _blocked(codes, block_size, axis, "dequantize_mx")
    want = tuple(cb.shape[:-1])
    sb = scale_bytes.movedim(axis, -1)
    if tuple(sb.shape) != want:
        raise ValueError(f"scale_bytes has shape {tuple(scale_bytes.shape)}; codes of shape {tuple(codes.shape)} "
                         f"with block_size={block_size} along axis {axis} need one byte per block")
    e = sb.unsqueeze(-1).to(torch.int32) - _BIAS - _fold(t)
    v = torch.ldexp(t.decode(cb, torch.float32), e.float())
    v = torch.where(sb.unsqueeze(-1) == _NAN_BYTE, torch.full_like(v, float("nan")), v)
    limit = torch.finfo(output_dtype).max
    return _unblocked(v.clamp(-limit, limit), axis).to(output_dtype)


def fake_quantize_mx(x: torch.Tensor, element_dtype, block_size: int = 32, scale_mode: str = "floor",
                     axis: int = -1) -> torch.Tensor:
    """dequantize_mx(quantize_mx(x)) in x's dtype and shape (the MX activation numerics)."""
    codes, scales = quantize_mx(x, element_dtype, block_size, scale_mode, axis)
    return dequantize_mx(codes, scales, element_dtype, block_size, axis, x.dtype)


def e8m0_to_torch(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes viewed as torch.float8_e8m0fnu (no copy), for torch's MX kernels and `_scaled_mm`."""
    if scale_bytes.dtype != torch.uint8:
        raise ValueError(f"scale_bytes must be uint8 E8M0 bytes, got {scale_bytes.dtype}")
    return scale_bytes.view(torch.float8_e8m0fnu)


def fp4_to_torch(codes: torch.Tensor) -> torch.Tensor:
    """fp4 E2M1 codes [..., K] (uint8, one per byte, as `quantize_mx` returns them; K even) packed two per byte
    as torch.float4_e2m1fn_x2 [..., K / 2]: element 2i in the low nibble, 2i + 1 in the high one (the layout
    c10::Float4_e2m1fn_x2 documents), for torch's MXFP4 kernels."""
    if codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes must be uint8 fp4 codes with an even last dim, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("codes hold values above 15: they are not fp4 E2M1 codes (use quantize_mx(x, 'fp4_e2m1'))")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.float4_e2m1fn_x2)


def fp4_from_torch(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `fp4_to_torch`: torch.float4_e2m1fn_x2 [..., K / 2] -> uint8 fp4 codes [..., K]."""
    if packed.dtype != torch.float4_e2m1fn_x2:
        raise ValueError(f"packed must be torch.float4_e2m1fn_x2, got {packed.dtype}")
    b = packed.view(torch.uint8)
    return torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)


def mx_bits_per_element(element_dtype, block_size: int = 32) -> float:
    """Storage bits per element of an MX tensor packed densely: element bits + 8 / block_size (MXFP4 4.25)."""
    return mx_element(element_dtype).bits + 8 / block_size
