"""Property-based tests of the affine primitives (hypothesis).

Random small shapes (rank 1-3), block sizes dividing them (per-tensor and per-element included), every
supported target dtype, every valid mapping / zero-point-domain combination, bf16 / fp16 / fp32 inputs and
values that include the extremes: 0, -0, subnormals, the smallest normal, the dtype's largest finite value,
constant blocks and mixed signs over the whole exponent range.

Invariants checked on every example:

- ``choose_qparams_affine`` on finite input either returns finite qparams with ``scale > 0`` (zero point
  inside ``[quant_min, quant_max]`` for the INT domain, None for NONE / float targets), or raises
  ValueError naming the dtype to change, and only where a float64 reference says the scale (or FLOAT zero
  point) really is at the edge of what ``scale_dtype`` (``zero_point_dtype``) or float32 can hold.
- Ordinary blocks (whose float32 range math does not overflow) get bit for bit the qparams of the original
  float32 formulas (a copy lives in :func:`_float32_reference`).
- Codes lie in ``[quant_min, quant_max]`` and are never NaN.
- ``dequantize(quantize(x))`` is never NaN, lies within half a step (``scale / 2``) of ``x`` for every ``x``
  inside the representable range ``[dequant(quant_min), dequant(quant_max)]`` (float8: within half a
  float8 ulp at ``x / scale``'s magnitude), saturates to the range end outside it, and, since the qparams
  were chosen from ``x`` itself, every ``x`` is covered up to the rounding of the stored scale.

Runs derandomized without an example database, so CI sees the same examples every time.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from affineq.dtypes import SUPPORTED_TARGET_DTYPES, is_float_target, qrange
from affineq.primitives import (
    MappingType,
    ZeroPointDomain,
    choose_qparams_affine,
    dequantize_affine,
    fake_quantize_affine,
    quantize_affine,
)

SYM, ASYM, NO_CLIP = MappingType.SYMMETRIC, MappingType.ASYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR
INT, FLOAT, NONE = ZeroPointDomain.INT, ZeroPointDomain.FLOAT, ZeroPointDomain.NONE
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
F32_MAX = torch.finfo(torch.float32).max

PROFILE = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp at 1.0: the largest relative rounding error of a (normal) value stored in ``dtype``."""
    return torch.finfo(dtype).eps / 2


def _compute_dtype(qmin, qmax) -> torch.dtype:
    # as documented in affineq.primitives: float64 only for codes float32 cannot hold (int32)
    return torch.float32 if max(abs(qmin), abs(qmax)) <= 2**24 else torch.float64


def _expand(qparam: torch.Tensor, block_size, shape) -> torch.Tensor:
    """Reduced-shape qparam repeated to the input shape, in float64."""
    t = qparam.double().reshape([d // b for d, b in zip(shape, block_size, strict=True)])
    for dim, b in enumerate(block_size):
        t = t.repeat_interleave(b, dim=dim)
    return t


def _block_extremes(x: torch.Tensor, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    blocked = [v for d, b in zip(x.shape, block_size, strict=True) for v in (d // b, b)]
    dims = tuple(range(1, 2 * x.dim(), 2))
    xb = x.double().reshape(blocked)
    return xb.amin(dim=dims), xb.amax(dim=dims)


# ---------------------------------------------------------------------------------------------------------
# strategies


def _values(dtype: torch.dtype):
    """Finite values of ``dtype`` (as Python floats, exactly representable after the cast)."""
    info = torch.finfo(dtype)
    big, tiny, sub = info.max, info.tiny, info.tiny * info.eps
    specials = st.sampled_from(
        [0.0, -0.0, sub, -sub, 3 * sub, tiny, -tiny, big, -big, big / 2, -big * 0.75, 1.0, -1.0, 0.5]
    )
    width = 16 if dtype == torch.float16 else 32
    plain = st.floats(-big, big, allow_nan=False, allow_infinity=False, width=width)
    emin = round(math.log2(sub))
    emax = round(math.log2(big))
    log_spread = st.builds(
        lambda sign, e, m: max(-big, min(big, sign * m * 2.0**e)),
        st.sampled_from([-1.0, 1.0]),
        st.integers(emin, emax),
        st.floats(1.0, 2.0),
    )
    return st.one_of(specials, plain, log_spread)


@st.composite
def _layouts(draw):
    """(shape, block_size)."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    kind = draw(st.sampled_from(["tensor", "element", "any"]))
    if kind == "tensor":
        return shape, shape
    if kind == "element":
        return shape, (1,) * len(shape)
    return shape, tuple(draw(st.sampled_from(_divisors(d))) for d in shape)


@st.composite
def _inputs(draw, dtype, shape, block_size, values=None):
    values = _values(dtype) if values is None else values
    n = math.prod(shape)
    pattern = draw(st.sampled_from(["free", "free", "constant", "block_constant", "extreme"]))
    if pattern == "constant":
        flat = [draw(values)] * n
    elif pattern == "block_constant":
        reduced = [d // b for d, b in zip(shape, block_size, strict=True)]
        n_blocks = math.prod(reduced)
        x = torch.tensor(draw(st.lists(values, min_size=n_blocks, max_size=n_blocks)), dtype=torch.float64)
        x = x.reshape(reduced)
        for dim, b in enumerate(block_size):
            x = x.repeat_interleave(b, dim=dim)
        return x.to(dtype)
    elif pattern == "extreme":
        big = torch.finfo(dtype).max
        extremes = st.sampled_from([0.0, big, -big, big * 0.99, -big * 0.51, big / 3, 1.0])
        flat = draw(st.lists(st.one_of(extremes, values), min_size=n, max_size=n))
    else:
        flat = draw(st.lists(values, min_size=n, max_size=n))
    x = torch.tensor(flat, dtype=torch.float64).reshape(shape).to(dtype)
    assert torch.isfinite(x).all()
    return x


@st.composite
def _configs(draw):
    """Keyword arguments of one valid choose_qparams_affine call (plus the input)."""
    dtype = draw(st.sampled_from(INPUT_DTYPES))
    shape, block_size = draw(_layouts())
    target = draw(st.sampled_from(SUPPORTED_TARGET_DTYPES))
    quant_min = quant_max = None
    if is_float_target(target):
        mapping = draw(st.sampled_from([SYM, NO_CLIP]))
        domain = draw(st.sampled_from([INT, FLOAT, NONE]))  # ignored for float targets
        preserve_zero = draw(st.booleans())
    else:
        mapping, domain = draw(
            st.sampled_from(
                [(SYM, INT), (SYM, FLOAT), (SYM, NONE), (NO_CLIP, INT), (NO_CLIP, FLOAT), (NO_CLIP, NONE)]
                + [(ASYM, INT), (ASYM, FLOAT)]
            )
        )
        preserve_zero = True if (mapping, domain) == (ASYM, INT) else draw(st.booleans())
        if draw(st.integers(0, 4)) == 0:  # a custom code range now and then
            lo, hi = qrange(target)
            quant_min = draw(st.integers(lo, hi - 1))
            quant_max = draw(st.integers(quant_min + 1, hi))
        qmin, qmax = qrange(target)
        qmin, qmax = (qmin if quant_min is None else quant_min), (qmax if quant_max is None else quant_max)
        if domain is NONE and (qmax + qmin + 1) // 2 != 0:
            domain = INT  # NONE means zero point 0: only for ranges centred on 0 (else ValueError)
    x = draw(_inputs(dtype, shape, block_size))
    scale_dtype = draw(st.sampled_from([None, None, torch.float32, torch.bfloat16, torch.float16]))
    # an explicit eps must be a normal number of the scale dtype (smaller ones are refused): torch.ao's
    # float32 eps where that holds
    ao_eps = torch.finfo(torch.float32).eps
    eps = draw(st.sampled_from([None, None, None, ao_eps]))
    if eps is not None and eps < torch.finfo(scale_dtype or dtype).tiny:
        eps = None
    return {
        "input": x,
        "mapping_type": mapping,
        "block_size": block_size,
        "target_dtype": target,
        "quant_min": quant_min,
        "quant_max": quant_max,
        "eps": eps,
        "scale_dtype": scale_dtype,
        "preserve_zero": preserve_zero,
        "zero_point_domain": domain,
    }


# ---------------------------------------------------------------------------------------------------------
# references


def _float32_reference(cfg) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The original (pre-overflow-handling) float32 formulas of choose_qparams_affine, op for op."""
    x, target = cfg["input"], cfg["target_dtype"]
    qmin, qmax = _range(cfg)
    float_target = is_float_target(target)
    domain = NONE if float_target else cfg["zero_point_domain"]
    scale_dtype = cfg["scale_dtype"] or x.dtype
    eps = cfg["eps"] or _default_eps(x.dtype, scale_dtype)
    shape, block = x.shape, cfg["block_size"]
    blocked = [v for d, b in zip(shape, block, strict=True) for v in (d // b, b)]
    dims = tuple(range(1, 2 * len(shape), 2))
    xf = x.to(torch.float32).reshape(blocked)
    min_val, max_val = torch.amin(xf, dim=dims), torch.amax(xf, dim=dims)
    if cfg["preserve_zero"]:
        min_val, max_val = torch.clamp(min_val, max=0.0), torch.clamp(max_val, min=0.0)
    zp_sym = (qmax + qmin + 1) // 2
    mapping = cfg["mapping_type"]
    if mapping is ASYM:
        scale = (max_val - min_val) / float(qmax - qmin)
    elif mapping is SYM and not float_target:
        scale = torch.maximum(-min_val, max_val) / (float(qmax - qmin) / 2)
    else:
        lo, hi = (qmin, qmax) if float_target else (qmin - zp_sym, qmax - zp_sym)
        sides = [v / float(d) for v, d in ((min_val, lo), (max_val, hi)) if d != 0]
        scale = sides[0] if len(sides) == 1 else torch.maximum(*sides)
    scale = torch.clamp(scale, min=eps).to(scale_dtype)
    if domain is NONE:
        return scale, None
    s = scale.to(torch.float32)
    mid = (qmax + qmin + 1) / 2
    if domain is INT:
        # int32 codes: in float64, the precision their quantize / dequantize use (float32 has no 2**31 - 1: the
        # float32 formula clamped to 2**31 and wrapped to -2**31, and rounded qmin + 1 to qmin)
        wide = _compute_dtype(qmin, qmax)
        zp = (torch.clamp(qmin - torch.round(min_val.to(wide) / s.to(wide)), qmin, qmax) if mapping is ASYM
              else torch.full_like(s, zp_sym))
        return scale, zp.to(torch.int32)
    zp = min_val + s * (mid - qmin) if mapping is ASYM else s * (mid - zp_sym)
    return scale, zp.to(scale_dtype)


def _default_eps(input_dtype, scale_dtype) -> float:
    # follows the dtype the scale is stored in, never below float32's (the input dtype plays no part)
    return max(torch.finfo(scale_dtype).tiny, torch.finfo(torch.float32).tiny)


def _range(cfg):
    target = cfg["target_dtype"]
    if is_float_target(target):
        m = torch.finfo(target).max
        return -m, m
    lo, hi = qrange(target)
    qmin = lo if cfg["quant_min"] is None else cfg["quant_min"]
    return qmin, (hi if cfg["quant_max"] is None else cfg["quant_max"])


def _needed_qparams64(cfg) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact (float64) scale per block before the eps clamp and, for the FLOAT domain, the zero point."""
    x, target = cfg["input"], cfg["target_dtype"]
    qmin, qmax = _range(cfg)
    mn, mx = _block_extremes(x, cfg["block_size"])
    if cfg["preserve_zero"]:
        mn, mx = mn.clamp(max=0.0), mx.clamp(min=0.0)
    float_target = is_float_target(target)
    zp_sym = (qmax + qmin + 1) // 2
    if cfg["mapping_type"] is ASYM:
        scale = (mx - mn) / (qmax - qmin)
    elif cfg["mapping_type"] is SYM and not float_target:
        scale = torch.maximum(-mn, mx) / ((qmax - qmin) / 2)
    else:
        lo, hi = (qmin, qmax) if float_target else (qmin - zp_sym, qmax - zp_sym)
        sides = [v / d for v, d in ((mn, lo), (mx, hi)) if d != 0]
        scale = sides[0] if len(sides) == 1 else torch.maximum(*sides)
    zp = None
    if not float_target and cfg["zero_point_domain"] is FLOAT:
        mid = (qmax + qmin + 1) / 2
        s = scale.clamp(min=cfg["eps"] or _default_eps(x.dtype, cfg["scale_dtype"] or x.dtype))
        zp = mn + s * (mid - qmin) if cfg["mapping_type"] is ASYM else s * (mid - zp_sym)
    return scale, zp


def _near_limit(cfg) -> bool:
    """Whether an exact qparam is within rounding of what scale_dtype / zero_point_dtype (= scale_dtype
    here) or the compute dtype of quantize_affine (float32; float64 for int32 codes) hold."""
    scale_dtype = cfg["scale_dtype"] or cfg["input"].dtype
    qmin, qmax = _range(cfg)
    scale, zp = _needed_qparams64(cfg)
    limit = min(torch.finfo(scale_dtype).max, torch.finfo(_compute_dtype(qmin, qmax)).max)
    if scale.max().item() > limit * (1 - 2**-6):
        return True
    if zp is not None:
        # the stored zero point adds the rounded scale times up to (qmax - qmin + 1) / 2 codes
        slack = scale.abs().clamp(min=cfg["eps"] or 0.0) * (qmax - qmin + 1) * 2**-6
        return bool(((zp.abs() + slack) > limit).any())
    return False


def _domain(cfg):
    return NONE if is_float_target(cfg["target_dtype"]) else cfg["zero_point_domain"]


# ---------------------------------------------------------------------------------------------------------
# the properties


def _choose(cfg):
    kwargs = {k: v for k, v in cfg.items() if k != "input"}
    return choose_qparams_affine(cfg["input"], **kwargs)


def _check_qparams(cfg, scale, zp):
    x, target = cfg["input"], cfg["target_dtype"]
    reduced = tuple(d // b for d, b in zip(x.shape, cfg["block_size"], strict=True))
    scale_dtype = cfg["scale_dtype"] or x.dtype
    assert scale.shape == reduced and scale.dtype == scale_dtype
    assert torch.isfinite(scale).all() and (scale > 0).all(), scale
    domain = _domain(cfg)
    if domain is NONE:
        assert zp is None
        return
    assert zp.shape == reduced and torch.isfinite(zp).all(), zp
    if domain is INT:
        qmin, qmax = _range(cfg)
        assert zp.dtype == torch.int32 and (zp >= qmin).all() and (zp <= qmax).all()
    else:
        assert zp.dtype == scale_dtype
    del target


def _check_round_trip(cfg, scale, zp):
    x, target, block = cfg["input"], cfg["target_dtype"], cfg["block_size"]
    qmin, qmax = _range(cfg)
    domain = _domain(cfg)
    ranges = {"quant_min": cfg["quant_min"], "quant_max": cfg["quant_max"]}
    q = quantize_affine(x, block, scale, zp, target, zero_point_domain=domain, **ranges)
    dq = dequantize_affine(q, block, scale, zp, target, zero_point_domain=domain, output_dtype=torch.float32, **ranges)
    dq_native = dequantize_affine(q, block, scale, zp, target, zero_point_domain=domain, output_dtype=x.dtype, **ranges)
    fq = fake_quantize_affine(x, block, scale, zp, target, zero_point_domain=domain, **ranges)
    assert torch.equal(fq, dq_native)  # one op, same values

    q64 = q.double()
    assert not q64.isnan().any()
    assert (q64 >= qmin).all() and (q64 <= qmax).all(), (q64.min(), q64.max())
    assert not dq.isnan().any() and not dq_native.isnan().any() and not fq.isnan().any()

    x64 = x.double()
    s = _expand(scale, block, x.shape)
    zpv = torch.zeros_like(s) if zp is None else _expand(zp, block, x.shape)
    skip = torch.zeros_like(x64, dtype=torch.bool)  # no element is exempt: dequantize saturates, never inf
    assert torch.isfinite(dq).all() and torch.isfinite(dq_native).all()

    err = (dq.double() - x64).abs()
    d = qmax - qmin
    if is_float_target(target):
        _check_float8_round_trip(cfg, x64, q64, dq.double(), s, skip)
        return
    if domain is INT:
        lo, hi, zp_value = (qmin - zpv) * s, (qmax - zpv) * s, zpv * s
    elif domain is FLOAT:
        mid = (qmax + qmin + 1) / 2
        lo, hi, zp_value = (qmin - mid) * s + zpv, (qmax - mid) * s + zpv, zpv
    else:
        lo, hi, zp_value = qmin * s, qmax * s, torch.zeros_like(s)
    # Rounding slack. quantize/dequantize compute in float32 (float64 for int32 codes), unit roundoff u:
    # every intermediate (x * inv_scale, x - min_val, min_val = zp - scale * (mid - qmin), (q - zp) * scale,
    # ... + zp) is at most |x| + |zero point| + scale * (qmax - qmin + 1) in magnitude and there are fewer
    # than 8 roundings, so codes and values move by at most 8 * u * that (a code may flip at a .5 tie, which
    # costs nothing beyond the half step). The float32 output adds half an ulp of |dq| <= |x| + scale.
    u = _unit_roundoff(_compute_dtype(qmin, qmax))
    slack = 8 * u * (x64.abs() + zp_value.abs() + s * (d + 1)) + 2**-23 * (x64.abs() + s)
    check = ~skip
    inside = (x64 >= lo) & (x64 <= hi) & check
    assert (err[inside] <= (s / 2 + slack)[inside]).all(), _worst(err - s / 2 - slack, inside, x64, s)
    above, below = (x64 > hi) & check, (x64 < lo) & check
    assert ((dq.double() - hi).abs()[above] <= slack[above]).all()
    assert ((dq.double() - lo).abs()[below] <= slack[below]).all()
    # Coverage: the qparams were chosen from x, so every x is within half a step of the grid, up to the
    # rounding of the stored scale to scale_dtype (relative u_s, times up to qmax - qmin + 1 steps) and, in
    # the FLOAT domain, of the stored zero point (relative u_s too: it is stored in scale_dtype), which
    # shifts the whole grid; for a block far from 0 (|zp| >> scale) that shift can be many steps.
    u_s = _unit_roundoff(cfg["scale_dtype"] or x.dtype)
    cover = s / 2 + 2 * u_s * ((d + 1) * s + (zpv.abs() if domain is FLOAT else 0)) + slack
    if cfg["mapping_type"] is NO_CLIP and qmax == (qmax + qmin + 1) // 2:
        # a one-step range (int1, uint1, ...) has no code above the zero point: the no-clipping rule drops
        # that side, so positive values are not covered (documented in MappingType)
        check = check & (x64 <= 0)
    assert (err[check] <= cover[check]).all(), _worst(err - cover, check, x64, s)
    if domain is not FLOAT and cfg["preserve_zero"]:
        assert (dq[x == 0] == 0).all()  # 0.0 is exactly representable


def _check_float8_round_trip(cfg, x64, q64, dq64, s, skip):
    target = cfg["target_dtype"]
    info = torch.finfo(target)
    mbits = round(-math.log2(info.eps))
    emin = round(math.log2(info.tiny))
    err = (dq64 - x64).abs()
    v = (x64 / s).abs()
    # half an ulp of the float8 grid at |x / scale|: spacing 2**(e - mbits) for exponent e (subnormals
    # share the smallest normal exponent)
    e = torch.floor(torch.log2(v.clamp(min=info.tiny))).clamp(min=emin)
    half_ulp = 2.0 ** (e - mbits) / 2 * s
    # x * inv_scale rounds in float32 (relative 2**-24 twice) before the float8 cast; float32 output rounding
    slack = 2**-21 * x64.abs() + 2**-23 * s
    check = ~skip
    inside = (v <= info.max) & check
    assert (err[inside] <= (half_ulp + slack)[inside]).all(), _worst(err - half_ulp - slack, inside, x64, s)
    # coverage: |x| / scale exceeds the code range only by the rounding of the stored scale
    u_s = _unit_roundoff(cfg["scale_dtype"] or cfg["input"].dtype)
    cover = half_ulp + 2 * u_s * info.max * s + slack
    assert (err[check] <= cover[check]).all(), _worst(err - cover, check, x64, s)
    if cfg["preserve_zero"]:
        assert (dq64[x64 == 0] == 0).all()
    del q64


def _worst(excess, mask, x64, s):
    excess = torch.where(mask, excess, torch.full_like(excess, -math.inf))
    i = int(excess.flatten().argmax())
    x_i, s_i = x64.flatten()[i].item(), s.flatten()[i].item()
    return f"excess {excess.flatten()[i].item():.4g} at x={x_i:.6g}, scale={s_i:.6g}"


def _run_properties(cfg):
    try:
        scale, zp = _choose(cfg)
    except ValueError as e:
        event("ValueError: qparam not representable")
        assert _near_limit(cfg), f"unexpected ValueError: {e}"
        assert "scale_dtype" in str(e) or "zero_point_dtype" in str(e), str(e)
        assert " use " in str(e) or "divide" in str(e), str(e)
        return
    _check_qparams(cfg, scale, zp)
    ref_scale, ref_zp = _float32_reference(cfg)
    ordinary = torch.isfinite(ref_scale)
    if ref_zp is not None and ref_zp.dtype.is_floating_point:
        ordinary &= torch.isfinite(ref_zp)
    event("ordinary blocks only" if ordinary.all() else "overflow path used")
    # bit-identical to the original float32 formulas wherever those did not overflow
    assert torch.equal(scale[ordinary], ref_scale[ordinary])
    if zp is not None:
        assert torch.equal(zp[ordinary], ref_zp[ordinary])
    _check_round_trip(cfg, scale, zp)


def _cfg(x, mapping, block, target, domain=INT, **kw):
    base = {"quant_min": None, "quant_max": None, "eps": None, "scale_dtype": None, "preserve_zero": True}
    return {"input": x, "mapping_type": mapping, "block_size": block, "target_dtype": target,
            "zero_point_domain": domain, **{**base, **kw}}


_F32_EXTREMES = torch.tensor([[3e38, -3e38, 1.0, 0.0]])


@PROFILE
@given(cfg=_configs())
@example(cfg=_cfg(_F32_EXTREMES, ASYM, (1, 4), torch.uint8))  # max - min overflowed: inf scale, NaN output
@example(cfg=_cfg(_F32_EXTREMES, ASYM, (1, 4), torch.int4, FLOAT, preserve_zero=False))
@example(cfg=_cfg(_F32_EXTREMES, ASYM, (1, 2), torch.uint2, FLOAT))  # s * (mid - qmin) overflowed the zero point
@example(cfg=_cfg(_F32_EXTREMES, SYM, (1, 4), torch.int1))  # scale 6e38: ValueError
@example(cfg=_cfg(torch.tensor([[65504.0, -65504.0]], dtype=torch.float16), ASYM, (1, 2), torch.uint1))
@example(cfg=_cfg(torch.tensor([[1e7, -2.0]]), SYM, (1, 2), torch.int8, scale_dtype=torch.float16))
@example(cfg=_cfg(torch.zeros(2, 3, dtype=torch.bfloat16), NO_CLIP, (1, 3), torch.float8_e5m2))
# int32 zero points: clamped to qmax in float32 (2**31) they wrapped to -2**31 (-FLT_MAX dequantized to 0); the
# float32 formula also rounded qmin + 1 to qmin
@example(cfg=_cfg(torch.tensor([-F32_MAX]), ASYM, (1,), torch.int32, INT))
@example(cfg=_cfg(torch.tensor([-torch.finfo(torch.float32).tiny]), ASYM, (1,), torch.int32, INT))
def test_choose_quantize_dequantize_properties(cfg):
    _run_properties(cfg)


@PROFILE
@given(data=st.data())
def test_properties_at_the_extremes(data):
    # every element drawn from the dtype's largest magnitudes, zeros and subnormals: the overflow paths
    dtype = data.draw(st.sampled_from(INPUT_DTYPES))
    info = torch.finfo(dtype)
    big, sub = info.max, info.tiny * info.eps
    values = st.sampled_from([big, -big, big * 0.999, -big * 0.6, big / 7, 0.0, sub, -sub, info.tiny])
    cfg = data.draw(_configs())
    cfg["input"] = data.draw(_inputs(dtype, cfg["input"].shape, cfg["block_size"], values))
    if cfg["eps"] is not None and cfg["eps"] < torch.finfo(cfg["scale_dtype"] or dtype).tiny:
        cfg["eps"] = None  # the new input dtype is the scale dtype: keep eps a normal number of it
    _run_properties(cfg)


@PROFILE
@given(data=st.data())
def test_float64_input_beyond_float32_range_gets_finite_qparams(data):
    # float64 input may exceed float32's range; its range math then runs in float64
    shape, block = data.draw(_layouts())
    target = data.draw(st.sampled_from([t for t in SUPPORTED_TARGET_DTYPES if not is_float_target(t)]))
    mapping, domain = data.draw(st.sampled_from([(SYM, INT), (NO_CLIP, NONE), (ASYM, INT), (ASYM, FLOAT)]))
    mags = st.sampled_from([0.0, 1.0, 1e30, 1e39, 1e45, 3e38])
    flat = data.draw(st.lists(st.builds(lambda m, sgn: m * sgn, mags, st.sampled_from([-1.0, 1.0])),
                              min_size=math.prod(shape), max_size=math.prod(shape)))
    x = torch.tensor(flat, dtype=torch.float64).reshape(shape)
    scale_dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    if domain is NONE and sum(qrange(target)) + 1 != 0 and sum(qrange(target)) != 0:
        domain = INT  # NONE (zero point 0) needs a code range centred on 0
    cfg = _cfg(x, mapping, block, target, domain, scale_dtype=scale_dtype)
    try:
        scale, zp = _choose(cfg)
    except ValueError as e:
        assert "exceeds" in str(e) or "cannot hold" in str(e), str(e)
        assert _near_limit(cfg), str(e)
        return
    compute_max = torch.finfo(_compute_dtype(*qrange(target))).max
    assert torch.isfinite(scale).all() and (scale > 0).all() and (scale.double() <= compute_max).all()
    assert zp is None or (zp.double().abs() <= compute_max).all()
    needed, _ = _needed_qparams64(cfg)
    expected = needed.clamp(min=torch.finfo(torch.float32).tiny)
    # the scale is the exact one, rounded to float32 (a few roundings of the halved arithmetic)
    assert torch.allclose(scale.double(), expected, rtol=2**-21, atol=0)


@pytest.mark.parametrize("mapping", [SYM, ASYM, NO_CLIP])
def test_compiled_overflow_path_matches_eager(mapping):
    x = torch.tensor([[3e38, -3e38, 1.0, 2.0], [1.0, 2.0, 3.0, -4.0]])
    domain = FLOAT if mapping is ASYM else INT

    def f(t):
        return choose_qparams_affine(t, mapping, (1, 4), torch.uint4, zero_point_domain=domain, preserve_zero=False)

    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b) and torch.isfinite(a).all()


# ---------------------------------------------------------------------------------------------------------
# Overflow regressions downstream of choose_qparams_affine: dequantize saturates, the FLOAT domain's
# intermediates are redone in float64, scales are validated, the int8 activation shortcuts follow.


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.float32, None), (torch.float16, torch.float32)])
def test_known_dequantize_overflow(dtype, scale_dtype):
    # -max / scale is exactly -127.5, which rounds (half to even) to code -128, whose value
    # -128 * max / 127.5 lies past the dtype's max; fp16 activations at the fp16 limit with the float32
    # scales of int8 dynamic quantization hit this
    big = torch.finfo(dtype).max
    x = torch.tensor([[-big, 1.0]], dtype=dtype)
    scale, zp = choose_qparams_affine(x, SYM, x.shape, torch.int8, scale_dtype=scale_dtype)
    q = quantize_affine(x, x.shape, scale, zp, torch.int8)
    assert q[0, 0].item() == -128
    dq = dequantize_affine(q, x.shape, scale, zp, torch.int8, output_dtype=dtype)
    assert torch.isfinite(dq).all(), dq


def test_known_float_domain_quantize_overflow():
    x = torch.tensor([[-3e38, 1e38, 3e38]])
    scale, zp = choose_qparams_affine(x, ASYM, x.shape, torch.uint8, zero_point_domain=FLOAT, preserve_zero=False)
    assert torch.isfinite(scale).all() and torch.isfinite(zp).all()
    q = quantize_affine(x, x.shape, scale, zp, torch.uint8, zero_point_domain=FLOAT)
    assert q.tolist() == [[0, 170, 255]], q  # (1e38 + 3e38) / (6e38 / 255) = 170.0


def test_quantize_and_dequantize_reject_non_positive_or_non_finite_scales():
    x = torch.tensor([[0.0, 1.0]])
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite and positive.*choose_qparams_affine"):
            quantize_affine(x, x.shape, torch.tensor([scale]), torch.tensor([3]), torch.uint8)
    with pytest.raises(ValueError, match="scale must be finite and positive"):
        dequantize_affine(torch.zeros(1, 2, dtype=torch.uint8), (1, 2), torch.tensor([0.0]), torch.tensor([3]),
                          torch.uint8)


def test_int8_activation_shortcuts_do_not_overflow():
    from affineq import ActivationQuant
    from affineq.tensor.activation import fake_quantize_activation

    x = torch.tensor([[3e38, -3e38, 1.0, 0.0]])
    aq = ActivationQuant(torch.int8, ASYM, "per_token", INT)
    out = fake_quantize_activation(x, aq)
    scale, zp = choose_qparams_affine(x, ASYM, (1, 4), torch.int8, scale_dtype=torch.float32)
    ref = fake_quantize_affine(x, (1, 4), scale, zp, torch.int8)
    assert torch.isfinite(out).all() and torch.equal(out, ref)
    h = torch.tensor([[-65504.0, 1.0]], dtype=torch.float16)
    assert torch.isfinite(fake_quantize_activation(h, ActivationQuant(torch.int8, SYM, "per_token"))).all()
