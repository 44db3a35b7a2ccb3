"""Affine quantization primitives: choose qparams, quantize, dequantize, fake-quantize.

Blocks. ``block_size`` has one entry per input dim; each entry is the extent of a block sharing one scale
(and zero point) and must divide its dim (``d``: the dim is reduced whole; ``1``: one qparam per index).
Qparams come back in the *reduced shape* ``[d // b for d, b in zip(shape, block_size)]`` (same rank as
the input; per-tensor on ``[N, K]`` gives ``[1, 1]``, block ``(1, 32)`` gives ``[N, K // 32]``) and are
accepted in any shape with that many elements. :func:`affineq.granularity.get_block_size` builds
``block_size`` from a granularity.

Codes. Integer targets clamp to ``[quant_min, quant_max]`` (default: the dtype's range) and sub-byte codes
are returned in int8 (signed) / uint8 (unsigned) containers. float8 targets are scaled, clamped to
``[quant_min, quant_max]`` (default ``±finfo.max``) and cast; they never have a zero point.

Arithmetic. All math runs in float32 whatever the input dtype (bf16 / fp16 / fp32), with
``round`` = round-half-to-even (``rounding=`` picks half-away-from-zero or floor instead) and division
done as multiplication by ``inv_scale = 1 / scale`` (computed
in float32), rounding *before* adding the zero point: the order of ``torch.fake_quantize_per_tensor_affine``
/ ``torch.fake_quantize_per_channel_affine``, which we match bit for bit (values and gradients).
``torch.quantize_per_tensor`` / ``torch.quantize_per_channel`` round ``x * inv_scale + zp`` instead, so
with a nonzero zero point their codes can differ by one where ``x * inv_scale`` is within float rounding
of a .5 tie; they agree everywhere else, and their dequantization matches exactly. int32 targets compute
in float64 because float32 cannot hold every int32 code. :func:`choose_qparams_affine` redoes a block whose
float32 range math overflows without the overflowing intermediate (float64 input: in float64).

Zero-point domains (``mid = (quant_max + quant_min + 1) / 2``):

- ``INT``:   ``q = clamp(round(x * inv_scale) + zp)``,  ``x' = (q - zp) * scale``; zp is an integer code.
- ``FLOAT``: ``zp`` is the real value that code ``mid`` stands for.
  ``min_val = zp - scale * (mid - quant_min)``, ``q = clamp(round((x - min_val) * inv_scale) + quant_min)``,
  ``x' = (q - mid) * scale + zp``.
- ``NONE``:  no zero point; ``q = clamp(round(x * inv_scale))``, ``x' = q * scale``.

None of the functions call ``.item()`` or branch on tensor values (except the eager-only NaN/Inf and
overflow checks in :func:`choose_qparams_affine`), so they work under ``torch.compile(fullgraph=True)`` and
on any device.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence

import torch

from affineq._primitive_checks import _check_enum, _check_float_input, _check_zero_point, _compute_dtype
from affineq.blocks import Blocks, midpoint
from affineq.dtypes import check_quant_range, check_target_dtype, container_dtype, is_float_target, qtype

__all__ = [
    "MappingType",
    "ZeroPointDomain",
    "choose_qparams_affine",
    "dequantize_affine",
    "fake_quantize_affine",
    "quantize_affine",
]


class MappingType(enum.Enum):
    """How the float range is mapped onto the code range.

    - ``SYMMETRIC``: ``scale = max(-min_neg, max_pos) / ((qmax - qmin) / 2)``, ``zp = (qmax + qmin + 1) // 2``
      (matches ``torch.ao`` symmetric observers).
    - ``SYMMETRIC_NO_CLIPPING_ERR``: same zero point,
      ``scale = max(min_neg / (qmin - zp), max_pos / (qmax - zp))`` (``min_neg / qmin, max_pos / qmax`` for
      signed types) so neither end of the range clips; a term whose denominator is 0 is dropped.
    - ``ASYMMETRIC``: ``scale = (max_pos - min_neg) / (qmax - qmin)``; zero point per domain.
    """

    SYMMETRIC = enum.auto()
    SYMMETRIC_NO_CLIPPING_ERR = enum.auto()
    ASYMMETRIC = enum.auto()


class ZeroPointDomain(enum.Enum):
    """Zero point as an integer code (``INT``), a float offset (``FLOAT``) or absent (``NONE``)."""

    INT = enum.auto()
    FLOAT = enum.auto()
    NONE = enum.auto()


# ---------------------------------------------------------------------------------------------------------
# choose_qparams_affine


def default_eps(scale_dtype: torch.dtype) -> float:
    # The smallest normal of the dtype the scale is stored in (the input dtype plays no part: an fp16 input
    # with float32 scales keeps float32's floor), never below float32's: the range math runs in float32,
    # where a float64 floor would round to a zero scale.
    return max(torch.finfo(scale_dtype).tiny, torch.finfo(torch.float32).tiny)


def check_eps(fn: str, eps, scale_dtype: torch.dtype) -> float:
    """`eps` as a float when it is a valid smallest scale for `scale_dtype`; ValueError naming `fn` otherwise."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(
            f"{fn}: eps must be a positive finite number (the smallest scale allowed), got {eps!r}; "
            "pass eps=None for the default torch.finfo(scale_dtype).tiny"
        )
    info = torch.finfo(scale_dtype)
    # Below scale_dtype's smallest normal a stored scale is subnormal and rounds by far more than half an ulp
    # (fp16: 2**-24 steps), so the block's extremes clip by up to tens of percent; below float32's smallest
    # normal, 1 / scale would overflow float32 in quantize_affine (0 * inf = NaN for an all-zero block).
    floor = max(info.tiny, torch.finfo(torch.float32).tiny)
    if eps < floor:
        raise ValueError(
            f"{fn}: eps={eps!r} is too small for scale_dtype={scale_dtype}: a scale below {floor:.4g} is "
            "subnormal in scale_dtype (it loses precision, so values clip) or makes 1 / scale overflow float32; "
            f"pass eps >= {floor:.4g}, or scale_dtype=torch.float32 for smaller scales (or eps=None for the "
            "default torch.finfo(scale_dtype).tiny)"
        )
    return float(eps)


def _check_zero_point_dtype(fn: str, dtype, domain: ZeroPointDomain, qmin: int, qmax: int) -> None:
    if not isinstance(dtype, torch.dtype) or dtype is torch.bool or dtype.is_complex:
        raise ValueError(f"{fn}: zero_point_dtype must be a real torch.dtype or None, got {dtype!r}")
    if domain is ZeroPointDomain.FLOAT and not dtype.is_floating_point:
        raise ValueError(
            f"{fn}: zero_point_dtype={dtype} cannot hold a ZeroPointDomain.FLOAT zero point (a real value); "
            "use a floating-point zero_point_dtype such as torch.float32, or None for scale_dtype"
        )
    if domain is ZeroPointDomain.INT:
        if dtype.is_floating_point:
            exact = 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)  # largest run of exact integers
            fits = max(abs(qmin), abs(qmax)) <= exact
        else:
            info = torch.iinfo(dtype)
            fits = info.min <= qmin and qmax <= info.max
        if not fits:
            raise ValueError(
                f"{fn}: zero_point_dtype={dtype} cannot hold every integer zero point in "
                f"[quant_min, quant_max] = [{qmin}, {qmax}]; use zero_point_dtype=torch.int32 (or None)"
            )


def _scale_from_range(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    mapping_type: MappingType,
    float_target: bool,
    qmin: float,
    qmax: float,
    halve: bool,
) -> torch.Tensor:
    """Per-block scale before the eps clamp. ``halve`` evaluates ``max - min`` as ``max / 2 - min / 2``,
    which cannot overflow; the other formulas divide by a code distance >= 1 (or take a max) and only
    overflow when the scale itself does."""
    if mapping_type is MappingType.ASYMMETRIC:
        if halve:
            return (max_val * 0.5 - min_val * 0.5) / (float(qmax - qmin) * 0.5)
        return (max_val - min_val) / float(qmax - qmin)
    if mapping_type is MappingType.SYMMETRIC and not float_target:
        return torch.maximum(-min_val, max_val) / (float(qmax - qmin) / 2)
    # No-clipping rule (also the float8 rule): each side of the range maps exactly onto its end code.
    zp_sym = (qmax + qmin + 1) // 2
    lo, hi = (qmin, qmax) if float_target else (qmin - zp_sym, qmax - zp_sym)
    sides = [v / float(d) for v, d in ((min_val, lo), (max_val, hi)) if d != 0]
    return sides[0] if len(sides) == 1 else torch.maximum(*sides)


def _zero_point_from_range(
    min_val: torch.Tensor,
    s: torch.Tensor,
    domain: ZeroPointDomain,
    asymmetric: bool,
    qmin: int,
    qmax: int,
    halve: bool,
) -> torch.Tensor:
    """Per-block zero point (INT or FLOAT domain) from the block minimum and the stored scale ``s``."""
    zp_sym = (qmax + qmin + 1) // 2
    if domain is ZeroPointDomain.INT:
        if asymmetric:
            # int32 codes compute in float64: float32 has no 2**31 - 1, so a zero point clamped to qmax there
            # would be 2**31 and wrap to -2**31 when stored as int32 (within 2**24 the float32 formula is exact)
            if _compute_dtype(qmin, qmax) == torch.float64:
                min_val, s = min_val.double(), s.double()
            return torch.clamp(qmin - torch.round(min_val / s), qmin, qmax)
        return torch.full_like(s, zp_sym)
    mid = midpoint(qmin, qmax)
    if not asymmetric:
        return s * (mid - zp_sym)
    if halve:
        # s * (mid - qmin) can overflow (e.g. 2-bit codes over [-3e38, 3e38]) although the sum lies in
        # [min, max]: add the halves, then double.
        return (min_val * 0.5 + s * ((mid - qmin) * 0.5)) * 2.0
    return min_val + s * (mid - qmin)


def _worst_block(
    x_min: torch.Tensor, x_max: torch.Tensor, bad: torch.Tensor, preserve_zero: bool, scale_of
) -> tuple[float, float, float]:
    """(needed scale, block min, block max) of the ``bad`` block needing the largest scale, in float64 on
    the CPU (error messages only)."""
    lo, hi = x_min[bad].cpu().double(), x_max[bad].cpu().double()
    if preserve_zero:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    needed = scale_of(lo, hi)
    i = int(torch.argmax(torch.nan_to_num(needed, nan=math.inf)))
    return needed[i].item(), lo[i].item(), hi[i].item()


def choose_qparams_affine(
    input: torch.Tensor,
    mapping_type: MappingType,
    block_size: Sequence[int],
    target_dtype: torch.dtype,
    quant_min: int | float | None = None,
    quant_max: int | float | None = None,
    eps: float | None = None,
    scale_dtype: torch.dtype | None = None,
    zero_point_dtype: torch.dtype | None = None,
    preserve_zero: bool = True,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point per block of ``input``, both in the reduced shape ``[d // b per dim]``.

    Per block, ``min``/``max`` are the block's extremes; with ``preserve_zero`` they are widened to include
    0 (``min_neg = min(min, 0)``, ``max_pos = max(max, 0)``) so 0.0 is exactly representable. Scale follows
    :class:`MappingType`, then ``scale = max(scale, eps)`` (an all-zero block gets ``scale = eps``).
    Zero point, with ``zp_sym = (qmax + qmin + 1) // 2`` and ``mid = (qmax + qmin + 1) / 2``:

    - INT:   symmetric ``zp = zp_sym``; asymmetric ``zp = clamp(qmin - round(min_neg / scale), qmin, qmax)``.
    - FLOAT: asymmetric ``zp = min_neg + scale * (mid - qmin)`` (``min + scale * mid`` for unsigned
      ranges); symmetric ``zp = scale * (mid - zp_sym)`` (0 for full ranges): the real value of code ``mid``.
    - NONE:  ``zero_point`` is None (symmetric mappings only).

    float8 targets: ``scale = amax / quant_max`` (``amax / finfo.max`` by default), ``zero_point`` None;
    ``zero_point_domain`` is ignored and ASYMMETRIC is rejected.

    Overflow. The formulas run in float32. A block whose float32 arithmetic overflows although its
    qparams are finite (``max - min`` or ``scale * (mid - qmin)`` past ``finfo.max``, e.g. values near
    +-3e38, or float64 input beyond the float32 range) is recomputed without the overflowing intermediate
    (``max / 2 - min / 2``; in float64 for float64 input); every other block keeps the float32 result bit
    for bit. Where the result itself cannot be stored (a scale past ``scale_dtype``'s or float32's max, a
    FLOAT zero point past ``zero_point_dtype``'s), eager calls raise ValueError saying which dtype or
    range to change, so a finite input never gets an inf / NaN / zero scale or zero point.

    Args:
        input: floating-point tensor of any rank (bf16, fp16, fp32, fp64); min/max are taken in its dtype.
        block_size: one entry per dim of ``input``, each dividing its dim.
        target_dtype: see ``affineq.dtypes.SUPPORTED_TARGET_DTYPES``.
        quant_min, quant_max: code range, default the dtype's full range; must lie inside it.
        eps: lower bound on scale. Default: the smallest normal (``finfo.tiny``) of ``scale_dtype``, the
            dtype the scale is stored in, whatever ``input.dtype`` is (float32's for a float64
            ``scale_dtype``), so the stored scale can never be 0: 1.2e-38 for float32 and bfloat16 scales,
            6.1e-5 for float16 scales. An fp16 input with float32 / bfloat16 scales thus keeps their floor
            (small fp16 weights keep int8 precision); float16 scales floor every scale at 6.1e-5, coarse
            for blocks with ``amax`` below ~8e-3 at int8: prefer float32 / bfloat16 ``scale_dtype`` there.
            Explicit values must be at least float32's ``tiny`` and the smallest normal ``scale_dtype``
            value. Pass ``torch.finfo(torch.float32).eps`` to reproduce ``torch.ao`` observers.
        scale_dtype: dtype of the returned scale, default ``input.dtype``.
        zero_point_dtype: default ``torch.int32`` for the INT domain and ``scale_dtype`` for FLOAT; must
            hold every code in ``[quant_min, quant_max]`` exactly (INT) or be floating-point (FLOAT).
        preserve_zero: widen each block's range to include 0. ASYMMETRIC with ``preserve_zero=False``
            needs the FLOAT domain (an integer zero point inside the code range implies 0 is in range).

    Raises ValueError for integer input, NaN/Inf in ``input``, a scale that ``scale_dtype`` cannot hold
    (e.g. float16 scales for values past ~8e6 with int8 codes: use float32 or bfloat16) or that exceeds
    float32 (where quantize_affine computes), a zero point that ``zero_point_dtype`` cannot hold, bad
    ``block_size``/range/dtype/``eps``, or unsupported mapping/domain combinations. The data-dependent
    checks run eagerly only: they are skipped while ``torch.compiler.is_compiling()`` so
    ``fullgraph=True`` works (a compiled call then returns inf / NaN where eager would raise).
    """
    fn = "choose_qparams_affine"
    _check_float_input(fn, input)
    _check_enum("mapping_type", mapping_type, MappingType)
    _check_enum("zero_point_domain", zero_point_domain, ZeroPointDomain)
    check_target_dtype(target_dtype, "target_dtype")
    qmin, qmax = check_quant_range(target_dtype, quant_min, quant_max)
    if qmin >= qmax:
        raise ValueError(f"{fn}: quant_min={qmin} must be smaller than quant_max={qmax} to derive a scale")
    blocks = Blocks(input.shape, block_size)
    float_target = is_float_target(target_dtype)
    asymmetric = mapping_type is MappingType.ASYMMETRIC
    if float_target and asymmetric:
        raise ValueError(
            f"{fn}: mapping_type=MappingType.ASYMMETRIC needs a zero point, which float target {target_dtype} "
            "does not have; use MappingType.SYMMETRIC, not ASYMMETRIC"
        )
    domain = ZeroPointDomain.NONE if float_target else zero_point_domain
    if asymmetric and domain is ZeroPointDomain.NONE:
        raise ValueError(
            f"{fn}: MappingType.ASYMMETRIC needs a zero point; use zero_point_domain=ZeroPointDomain.INT or "
            "FLOAT, or MappingType.SYMMETRIC with ZeroPointDomain.NONE"
        )
    if not asymmetric and domain is ZeroPointDomain.NONE and not float_target and (qmax + qmin + 1) // 2 != 0:
        raise ValueError(
            f"{fn}: zero_point_domain=ZeroPointDomain.NONE means zero point 0, but the code range "
            f"[quant_min, quant_max] = [{qmin}, {qmax}] of {target_dtype} is centred on "
            f"{(qmax + qmin + 1) // 2}, so half of it would be lost; use ZeroPointDomain.INT, or a signed "
            "target / a range centred on 0 (quant_min = -quant_max or -quant_max - 1)"
        )
    if asymmetric and domain is ZeroPointDomain.INT and not preserve_zero:
        raise ValueError(
            f"{fn}: preserve_zero=False with ASYMMETRIC mapping needs "
            "zero_point_domain=ZeroPointDomain.FLOAT (an integer zero point in [quant_min, quant_max] "
            "means 0.0 is in range); or pass preserve_zero=True"
        )
    scale_dtype = input.dtype if scale_dtype is None else scale_dtype
    if not isinstance(scale_dtype, torch.dtype) or not scale_dtype.is_floating_point:
        raise ValueError(
            f"{fn}: scale_dtype must be a floating-point torch.dtype, got {scale_dtype!r}; "
            "use torch.float32, torch.bfloat16 or torch.float16 (or None for input.dtype)"
        )
    if zero_point_dtype is None:
        zero_point_dtype = torch.int32 if domain is ZeroPointDomain.INT else scale_dtype
    elif domain is not ZeroPointDomain.NONE:
        _check_zero_point_dtype(fn, zero_point_dtype, domain, qmin, qmax)
    eps = default_eps(scale_dtype) if eps is None else check_eps(fn, eps, scale_dtype)

    # Block extremes in the input's own dtype: exact, and rounding them to float32 afterwards gives the
    # extremes of the float32-rounded input (rounding is monotonic).
    x = input.reshape(blocks.blocked)
    x_min = torch.amin(x, dim=blocks.reduce_dims)
    x_max = torch.amax(x, dim=blocks.reduce_dims)

    def range_of(work_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        min_val, max_val = x_min.to(work_dtype), x_max.to(work_dtype)
        if preserve_zero:
            min_val = torch.clamp(min_val, max=0.0)
            max_val = torch.clamp(max_val, min=0.0)
        return min_val, max_val

    def scale_of(min_val: torch.Tensor, max_val: torch.Tensor, halve: bool) -> torch.Tensor:
        return _scale_from_range(min_val, max_val, mapping_type, float_target, qmin, qmax, halve)

    def qparams(work_dtype: torch.dtype, halve: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        min_val, max_val = range_of(work_dtype)
        scale = torch.clamp(scale_of(min_val, max_val, halve), min=eps).to(scale_dtype)
        if domain is ZeroPointDomain.NONE:
            return scale, None
        zp = _zero_point_from_range(min_val, scale.to(work_dtype), domain, asymmetric, qmin, qmax, halve)
        return scale, zp.to(zero_point_dtype)

    # The float32 formulas (bit for bit torch.ao's), trusted where nothing overflowed.
    scale, zero_point = qparams(torch.float32, halve=False)
    ok = torch.isfinite(x_min.to(torch.float32)) & torch.isfinite(x_max.to(torch.float32)) & torch.isfinite(scale)
    if zero_point is not None and zero_point.dtype.is_floating_point:
        ok = ok & torch.isfinite(zero_point)
    eager = not torch.compiler.is_compiling()
    if eager and bool(ok.all()):
        return scale, zero_point
    if eager and not bool((torch.isfinite(x_min) & torch.isfinite(x_max)).all()):
        raise ValueError(
            f"{fn}: input contains NaN or Inf, which has no finite scale; clean the tensor "
            "(e.g. torch.nan_to_num) before choosing qparams"
        )
    # Overflowing blocks: the same rules without overflowing intermediates, in float64 for float64 input.
    wide_dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    wide_scale, wide_zero_point = qparams(wide_dtype, halve=True)
    scale = torch.where(ok, scale, wide_scale)
    if zero_point is not None:
        zero_point = torch.where(ok, zero_point, wide_zero_point)
    if eager:
        _check_representable(fn, scale, zero_point, x_min, x_max, preserve_zero, qmin, qmax, scale_of)
    return scale, zero_point


def _check_representable(
    fn: str,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    x_min: torch.Tensor,
    x_max: torch.Tensor,
    preserve_zero: bool,
    qmin: float,
    qmax: float,
    scale_of,
) -> None:
    """Eager only: raise ValueError naming the dtype to change where a scale or zero point is not finite."""
    compute = _compute_dtype(qmin, qmax)
    bad_scale = ~(torch.isfinite(scale) & torch.isfinite(scale.to(compute)))
    bad_zp = torch.zeros_like(bad_scale)
    if zero_point is not None and zero_point.dtype.is_floating_point:
        bad_zp = ~(torch.isfinite(zero_point) & torch.isfinite(zero_point.to(compute)))
    any_bad_scale, any_bad_zp = torch.stack([bad_scale.any(), bad_zp.any()]).tolist()
    if any_bad_scale:
        needed, lo, hi = _worst_block(x_min, x_max, bad_scale, preserve_zero, lambda a, b: scale_of(a, b, True))
        limit = torch.finfo(compute).max
        fits = [d for d in (torch.float32, torch.bfloat16) if d != scale.dtype and torch.finfo(d).max >= needed]
        if needed <= limit and fits:
            raise ValueError(
                f"{fn}: scale_dtype={scale.dtype} cannot hold the scale {needed:.3g} needed for values in "
                f"[{lo:.3g}, {hi:.3g}] (its largest finite value is {torch.finfo(scale.dtype).max:.6g}); "
                f"use scale_dtype={' or '.join(str(d) for d in fits)}"
            )
        raise ValueError(
            f"{fn}: the scale {needed:.3g} needed for values in [{lo:.3g}, {hi:.3g}] with quant_min={qmin}, "
            f"quant_max={qmax} exceeds {compute} (largest finite value {limit:.3g}), the precision "
            "quantize_affine and dequantize_affine compute in, so no scale_dtype can hold it; divide the input "
            "by a power of two before quantizing (and multiply the scale by it afterwards), or use a wider "
            "code range (quant_max - quant_min)"
        )
    if any_bad_zp:
        _, lo, hi = _worst_block(x_min, x_max, bad_zp, preserve_zero, lambda a, b: scale_of(a, b, True))
        zp_dtype = zero_point.dtype
        if torch.finfo(zp_dtype).max < torch.finfo(compute).max:
            raise ValueError(
                f"{fn}: zero_point_dtype={zp_dtype} cannot hold the zero point needed for values in "
                f"[{lo:.3g}, {hi:.3g}] (its largest finite value is {torch.finfo(zp_dtype).max:.6g}); use "
                "zero_point_dtype=torch.float32 (for ZeroPointDomain.FLOAT it defaults to scale_dtype)"
            )
        raise ValueError(
            f"{fn}: the zero point needed for values in [{lo:.3g}, {hi:.3g}] exceeds {compute}, the precision "
            "quantize_affine and dequantize_affine compute in, so no zero_point_dtype can hold it; divide the "
            "input by a power of two before quantizing (and multiply scale and zero point by it afterwards)"
        )


# ---------------------------------------------------------------------------------------------------------
# quantize / dequantize


#: Rounding modes of integer codes (Quark's RoundType: half_even, round, floor).
ROUNDING = {
    "half_even": torch.round,  # ties to the even code: torch's and the kernels' rounding
    "half_away_from_zero": lambda t: torch.sign(t) * torch.floor(t.abs() + 0.5),
    "floor": torch.floor,
}


def _check_rounding(rounding) -> None:
    if rounding not in ROUNDING:
        raise ValueError(f"rounding={rounding!r}: use one of {list(ROUNDING)}")


def _unclamped_codes(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    domain: ZeroPointDomain,
    qmin: float,
    qmax: float,
    float_target: bool,
    rounding: str = "half_even",
) -> torch.Tensor:
    """Codes before clamping, in the compute dtype of ``x`` (all operands already broadcastable)."""
    inv_scale = 1.0 / scale
    if float_target:
        return x * inv_scale
    rnd = ROUNDING[rounding]
    if domain is ZeroPointDomain.INT:
        return rnd(x * inv_scale) + zero_point
    if domain is ZeroPointDomain.FLOAT:
        min_val = zero_point - scale * (midpoint(qmin, qmax) - qmin)
        return rnd((x - min_val) * inv_scale) + qmin
    return rnd(x * inv_scale)


def fake_quantize_unchecked(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    domain: ZeroPointDomain,
    qmin: float,
    qmax: float,
    rounding: str = "half_even",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped integer codes, their values) for x with broadcastable qparams, in x's dtype: the math of
    quantize_affine / dequantize_affine without their validation and overflow widening, for the search loops
    of the algorithms (thousands of calls on weights far from float32's range)."""
    q = _unclamped_codes(x, scale, zero_point, domain, qmin, qmax, False, rounding).clamp(qmin, qmax)
    return q, _dequant_math(q, scale, zero_point, domain, qmin, qmax, False)


def _dequant_math(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    domain: ZeroPointDomain,
    qmin: float,
    qmax: float,
    float_target: bool,
) -> torch.Tensor:
    if float_target or domain is ZeroPointDomain.NONE:
        return q * scale
    if domain is ZeroPointDomain.INT:
        return (q - zero_point) * scale
    return (q - midpoint(qmin, qmax)) * scale + zero_point


class _Plan:
    """Validated arguments shared by quantize / dequantize / fake_quantize."""

    def __init__(
        self,
        fn: str,
        input: torch.Tensor,
        block_size: Sequence[int],
        scale,
        zero_point,
        dtype: torch.dtype,
        dtype_param: str,
        quant_min,
        quant_max,
        domain: ZeroPointDomain,
        rounding: str = "half_even",
    ) -> None:
        check_target_dtype(dtype, dtype_param)
        _check_rounding(rounding)
        self.rounding = rounding
        _check_enum("zero_point_domain", domain, ZeroPointDomain)
        self.qmin, self.qmax = check_quant_range(dtype, quant_min, quant_max)
        self.blocks = Blocks(input.shape, block_size)
        self.float_target = is_float_target(dtype)
        if self.float_target and rounding != "half_even":
            raise ValueError(f"{fn}: rounding={rounding!r} applies to integer codes; float targets ({dtype}) "
                             "round to the nearest value of their grid (ties to even): use rounding='half_even'")
        _check_zero_point(fn, zero_point, domain, dtype)
        self.domain = ZeroPointDomain.NONE if self.float_target else domain
        self.qtype = qtype(dtype)
        self.compute = _compute_dtype(self.qmin, self.qmax)
        self.scale = self.blocks.qparam("scale", scale, self.compute, input.device)
        self.zero_point = (
            None
            if zero_point is None
            else self.blocks.qparam("zero_point", zero_point, self.compute, input.device)
        )

    def codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(clamped codes in the container dtype, unclamped codes) for a floating input."""
        xb = x.to(self.compute).reshape(self.blocks.blocked)
        y = _unclamped_codes(xb, self.scale, self.zero_point, self.domain, self.qmin, self.qmax, self.float_target,
                             self.rounding)
        if self.domain is ZeroPointDomain.FLOAT:  # x - min_val can overflow for ranges past +-1.7e38
            y = self._widen_overflow(y, _unclamped_codes, xb)
        q = self.qtype.encode(torch.clamp(y, self.qmin, self.qmax)).reshape(self.blocks.shape)
        return q, y

    def dequant(self, q: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        """Real values of codes `q`, saturated to `output_dtype`'s finite range: a code at the end of the range
        can stand for a value just past it (e.g. -128 * amax / 127.5), which must not become +-inf."""
        qb = self.qtype.decode(q, self.compute).reshape(self.blocks.blocked)
        x = _dequant_math(qb, self.scale, self.zero_point, self.domain, self.qmin, self.qmax, self.float_target)
        if self.domain is ZeroPointDomain.FLOAT:  # (q - mid) * scale can overflow before + zero_point
            x = self._widen_overflow(x, _dequant_math, qb)
        limit = torch.finfo(output_dtype).max
        return x.clamp(-limit, limit).to(output_dtype).reshape(self.blocks.shape)

    def _widen_overflow(self, y: torch.Tensor, math, operand: torch.Tensor) -> torch.Tensor:
        """`y` with the elements whose float32 intermediates overflowed (non-finite) recomputed by `math` in
        float64: a FLOAT-domain value in range whose intermediate is not. Eager only (a host sync, paid when
        quantizing weights); the rest of `y` is untouched."""
        if torch.compiler.is_compiling():
            return y
        bad = ~torch.isfinite(y)
        if not bool(bad.any()):
            return y
        extra = (self.rounding,) if math is _unclamped_codes else ()
        wide = math(operand.double(), self.scale.double(), self.zero_point.double(), self.domain, self.qmin,
                    self.qmax, False, *extra)
        return torch.where(bad, wide.to(y.dtype), y)

    def check_values(self, fn: str) -> None:
        """ValueError unless every scale is finite and positive and every zero point finite (eager only)."""
        if torch.compiler.is_compiling():
            return
        ok = torch.isfinite(self.scale).all() & (self.scale > 0).all()
        if self.zero_point is not None:
            ok = ok & torch.isfinite(self.zero_point).all()
        if not bool(ok):
            raise ValueError(
                f"{fn}: scale must be finite and positive and zero_point finite (got scale in "
                f"[{float(self.scale.min()):.3g}, {float(self.scale.max()):.3g}]); pass the qparams "
                "choose_qparams_affine returns, or clamp your scales to a positive minimum"
            )


def quantize_affine(
    input: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    output_dtype: torch.dtype,
    quant_min: int | float | None = None,
    quant_max: int | float | None = None,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
    *,
    rounding: str = "half_even",
) -> torch.Tensor:
    """Quantize floating ``input`` to codes of ``output_dtype``, same shape as ``input``.

    INT: ``q = clamp(round(x * inv_scale) + zp)``; FLOAT: ``q = clamp(round((x - min_val) * inv_scale) +
    quant_min)`` with ``min_val = zp - scale * (mid - quant_min)``; NONE: ``q = clamp(round(x * inv_scale))``;
    float8: ``q = clamp(x * inv_scale).to(float8)``. ``inv_scale = 1 / scale`` in float32, clamp is to
    ``[quant_min, quant_max]``; ``round`` is ``rounding``: "half_even" (default, torch.round),
    "half_away_from_zero" (2.5 -> 3, -2.5 -> -3) or "floor" (integer targets only).

    Returns codes in ``affineq.dtypes.container_dtype(output_dtype)``: e.g. ``output_dtype=torch.int4``
    gives a torch.int8 tensor with values in [-8, 7]. ``scale``/``zero_point`` may have any shape with one
    element per block.
    """
    _check_float_input("quantize_affine", input)
    plan = _Plan("quantize_affine", input, block_size, scale, zero_point,
                 output_dtype, "output_dtype", quant_min, quant_max, zero_point_domain, rounding)
    plan.check_values("quantize_affine")
    return plan.codes(input)[0]


def dequantize_affine(
    input: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    input_dtype: torch.dtype,
    quant_min: int | float | None = None,
    quant_max: int | float | None = None,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
    *,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Map codes back to real values: a new ``output_dtype`` tensor of ``input``'s shape.

    INT: ``x = (q - zp) * scale``; FLOAT: ``x = (q - mid) * scale + zp``; NONE and float8: ``x = q * scale``;
    computed in float32 (float64 for int32 codes), then cast. ``input`` must be stored in
    ``container_dtype(input_dtype)`` (int8 for torch.int4, uint8 for torch.uint4, ...); it is never
    modified or aliased.
    """
    fn = "dequantize_affine"
    check_target_dtype(input_dtype, "input_dtype")
    if not isinstance(input, torch.Tensor) or input.dtype != container_dtype(input_dtype):
        got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
        raise ValueError(
            f"{fn}: codes of input_dtype={input_dtype} must be stored as {container_dtype(input_dtype)}, "
            f"got input of {got}"
        )
    if not isinstance(output_dtype, torch.dtype) or not output_dtype.is_floating_point:
        raise ValueError(f"{fn}: output_dtype must be a floating-point torch.dtype, got {output_dtype!r}")
    plan = _Plan(fn, input, block_size, scale, zero_point,
                 input_dtype, "input_dtype", quant_min, quant_max, zero_point_domain)
    plan.check_values(fn)
    return plan.dequant(input, output_dtype)


class _MaskedStraightThrough(torch.autograd.Function):
    """Forward returns the precomputed ``fake``; backward passes ``grad * mask`` to ``x``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fake: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        return fake

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad_output * mask, None, None


def fake_quantize_affine(
    input: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    quant_dtype: torch.dtype,
    quant_min: int | float | None = None,
    quant_max: int | float | None = None,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
    *,
    rounding: str = "half_even",
) -> torch.Tensor:
    """``dequantize_affine(quantize_affine(x, ...), ..., output_dtype=x.dtype)`` in one differentiable op.

    The result equals the two-step round trip exactly. Gradient w.r.t. ``input`` is the straight-through
    estimator with a clipping mask: ``grad`` where the unclamped code lies in ``[quant_min, quant_max]``,
    0 elsewhere (as ``torch.fake_quantize_per_channel_affine``). No gradient flows to scale/zero_point.
    """
    _check_float_input("fake_quantize_affine", input)
    plan = _Plan("fake_quantize_affine", input, block_size, scale, zero_point,
                 quant_dtype, "quant_dtype", quant_min, quant_max, zero_point_domain, rounding)
    plan.check_values("fake_quantize_affine")
    x = input.detach()
    q, unclamped = plan.codes(x)
    mask = ((unclamped >= plan.qmin) & (unclamped <= plan.qmax)).reshape(x.shape)
    return _MaskedStraightThrough.apply(input, plan.dequant(q, x.dtype), mask)
