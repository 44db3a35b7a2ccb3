import itertools

import expecttest
import pytest
import torch
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

from affineq.dtypes import container_dtype, qrange
from affineq.granularity import PerAxis, get_block_size
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
OBSERVER_EPS = torch.finfo(torch.float32).eps
TORCH_QDTYPE = {torch.int8: torch.qint8, torch.uint8: torch.quint8}

# torch.quantize_per_* and observers are deprecated upstream; they remain the reference here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _expand(qparam: torch.Tensor, block_size, shape) -> torch.Tensor:
    """Reduced-shape qparam repeated to the input shape (reference for per-element checks)."""
    reduced = [d // b for d, b in zip(shape, block_size, strict=True)]
    t = qparam.reshape(reduced)
    for dim, b in enumerate(block_size):
        t = t.repeat_interleave(b, dim=dim)
    return t


def _round_trip(x, mapping, block, dtype, domain=INT, **kwargs):
    scale, zp = choose_qparams_affine(x, mapping, block, dtype, zero_point_domain=domain, **kwargs)
    qmin_qmax = {k: kwargs[k] for k in ("quant_min", "quant_max") if k in kwargs}
    q = quantize_affine(x, block, scale, zp, dtype, zero_point_domain=domain, **qmin_qmax)
    dq = dequantize_affine(
        q, block, scale, zp, dtype, zero_point_domain=domain, output_dtype=x.dtype, **qmin_qmax
    )
    return scale, zp, q, dq


def _sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return (10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum())).item()


def _assert_error_within_half_scale(x, dq, scale, block):
    bound = _expand(scale.float(), block, x.shape) * (0.5 + 1e-5)
    err = (dq.float() - x.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


# --------------------------------------------------------------------------------------------------------
# Bit-exact agreement with PyTorch's reference ops


OBSERVER_CONFIGS = [
    (torch.per_tensor_affine, torch.per_channel_affine, ASYM),
    (torch.per_tensor_symmetric, torch.per_channel_symmetric, SYM),
]
DATA = {
    "mixed": lambda: _randn(16, 64) * 3 + 0.5,
    "positive": lambda: _randn(16, 64).abs() + 0.25,
    "negative": lambda: -_randn(16, 64).abs() - 2.0,
}


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("qscheme, _, mapping", OBSERVER_CONFIGS)
def test_qparams_match_min_max_observer(qscheme, _, mapping, dtype, data):
    x = DATA[data]()
    obs = MinMaxObserver(dtype=TORCH_QDTYPE[dtype], qscheme=qscheme)
    obs(x)
    ref_scale, ref_zp = obs.calculate_qparams()
    scale, zp = choose_qparams_affine(x, mapping, x.shape, dtype, eps=OBSERVER_EPS)
    assert scale.shape == zp.shape == (1, 1)
    assert torch.equal(scale.flatten(), ref_scale)
    assert torch.equal(zp.flatten().long(), ref_zp.long())


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("_, qscheme, mapping", OBSERVER_CONFIGS)
def test_qparams_match_per_channel_observer(_, qscheme, mapping, dtype, axis):
    x = _randn(16, 64) * _randn(16, 1, seed=1).abs()
    x[3] = 0.0  # an all-zero channel exercises the eps clamp
    obs = PerChannelMinMaxObserver(ch_axis=axis, dtype=TORCH_QDTYPE[dtype], qscheme=qscheme)
    obs(x)
    ref_scale, ref_zp = obs.calculate_qparams()
    scale, zp = choose_qparams_affine(
        x, mapping, get_block_size(x.shape, PerAxis(axis)), dtype, eps=OBSERVER_EPS
    )
    assert torch.equal(scale.flatten(), ref_scale)
    assert torch.equal(zp.flatten().long(), ref_zp.long())


@pytest.mark.parametrize(
    "qscheme, mapping, dtype, qrange_",
    [
        (torch.per_tensor_affine, ASYM, torch.uint8, (0, 127)),
        (torch.per_tensor_affine, ASYM, torch.int8, (-64, 63)),
        (torch.per_tensor_symmetric, SYM, torch.int8, (-64, 63)),
    ],
)
def test_qparams_match_observer_reduce_range(qscheme, mapping, dtype, qrange_):
    x = _randn(16, 64) * 2 - 0.3
    obs = MinMaxObserver(dtype=TORCH_QDTYPE[dtype], qscheme=qscheme, reduce_range=True)
    obs(x)
    assert (obs.quant_min, obs.quant_max) == qrange_
    ref_scale, ref_zp = obs.calculate_qparams()
    qmin, qmax = qrange_
    scale, zp = choose_qparams_affine(x, mapping, x.shape, dtype, qmin, qmax, eps=OBSERVER_EPS)
    assert torch.equal(scale.flatten(), ref_scale) and torch.equal(zp.flatten().long(), ref_zp.long())


def test_symmetric_uint8_custom_range_zero_point_differs_from_observer_by_design():
    # Observers round the midpoint of a customized quint8 range down ((qmin + qmax) // 2); we always use
    # (qmax + qmin + 1) // 2, which is also what the observer uses for the full range (128).
    x = _randn(16, 64)
    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric, quant_min=0, quant_max=127)
    obs(x)
    ref_scale, ref_zp = obs.calculate_qparams()
    scale, zp = choose_qparams_affine(x, SYM, x.shape, torch.uint8, 0, 127, eps=OBSERVER_EPS)
    assert torch.equal(scale.flatten(), ref_scale)
    assert (ref_zp.item(), zp.item()) == (63, 64)


def _away_from_ties(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elements whose x / scale is not within 1e-3 of a .5 tie (computed in float64)."""
    v = x.double() / scale.double()
    return ((v - v.floor()) - 0.5).abs() > 1e-3


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("qscheme, _, mapping", OBSERVER_CONFIGS)
def test_codes_match_quantize_per_tensor(qscheme, _, mapping, dtype):
    x = _randn(32, 128) * 4 - 1
    scale, zp = choose_qparams_affine(x, mapping, x.shape, dtype, eps=OBSERVER_EPS)
    ref = torch.quantize_per_tensor(x, scale.item(), int(zp.item()), TORCH_QDTYPE[dtype])
    q = quantize_affine(x, x.shape, scale, zp, dtype)
    assert q.dtype == dtype
    # quantize_per_tensor rounds x * inv_scale + zp in one fused step; results differ only next to ties
    # (see test_tie_rounding_convention). Away from ties the codes must be identical.
    mask = _away_from_ties(x, scale.flatten())
    assert mask.float().mean() > 0.99
    assert torch.equal(q[mask], ref.int_repr()[mask])
    assert torch.equal(dequantize_affine(ref.int_repr(), x.shape, scale, zp, dtype), ref.dequantize())


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("_, qscheme, mapping", OBSERVER_CONFIGS)
def test_codes_match_quantize_per_channel(_, qscheme, mapping, dtype):
    x = _randn(32, 128) * _randn(32, 1, seed=2).abs() * 3
    block = get_block_size(x.shape, PerAxis(0))
    scale, zp = choose_qparams_affine(x, mapping, block, dtype, eps=OBSERVER_EPS)
    ref = torch.quantize_per_channel(x, scale.flatten().double(), zp.flatten().long(), 0, TORCH_QDTYPE[dtype])
    q = quantize_affine(x, block, scale, zp, dtype)
    mask = _away_from_ties(x, scale)
    assert mask.float().mean() > 0.99
    assert torch.equal(q[mask], ref.int_repr()[mask])
    assert torch.equal(dequantize_affine(ref.int_repr(), block, scale, zp, dtype), ref.dequantize())


def test_symmetric_int8_codes_match_torch_everywhere_including_ties():
    # zero point 0: every reference op computes round(x * inv_scale) with round-half-to-even.
    scale = torch.tensor([[0.0625]])  # power of two: x * inv_scale is exact, so the ties are exact
    ties = (torch.arange(-6, 6, dtype=torch.float32) + 0.5) * 0.0625
    x = torch.cat([ties, _randn(500)]).reshape(1, -1)
    zp = torch.zeros(1, 1, dtype=torch.int32)
    q = quantize_affine(x, x.shape, scale, zp, torch.int8)
    assert q[0, :12].tolist() == [-6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6]
    ref = torch.quantize_per_tensor(x, 0.0625, 0, torch.qint8)
    assert torch.equal(q, ref.int_repr())
    ref_c = torch.quantize_per_channel(
        x, torch.tensor([0.0625], dtype=torch.float64), torch.tensor([0]), 0, torch.qint8
    )
    assert torch.equal(q, ref_c.int_repr())


def test_tie_rounding_convention():
    # We round before adding the zero point, like torch.fake_quantize_* (and torchao). torch.quantize_per_*
    # add the zero point first, so with an odd zero point an exact tie lands on a different code.
    x = torch.tensor([[0.125, 0.375, -0.125]])  # x / 0.25 = 0.5, 1.5, -0.5
    scale, zp = torch.tensor([[0.25]]), torch.tensor([[1]], dtype=torch.int32)
    q = quantize_affine(x, x.shape, scale, zp, torch.int8)
    assert q.tolist() == [[1, 3, 1]]
    fq = torch.fake_quantize_per_tensor_affine(x, 0.25, 1, -128, 127)
    assert torch.equal(fq, dequantize_affine(q, x.shape, scale, zp, torch.int8))
    assert torch.quantize_per_tensor(x, 0.25, 1, torch.qint8).int_repr().tolist() == [[2, 2, 0]]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fake_quantize_matches_torch_bit_exact_with_gradient(dtype, per_channel):
    x = _randn(16, 256) * 6
    ties = (torch.arange(-8, 8, dtype=torch.float32) + 0.5) * 0.03125
    x[:, :16] = ties
    qmin, qmax = qrange(dtype)
    if per_channel:
        block = (1, 256)
        scale = torch.rand(16, 1, generator=torch.Generator().manual_seed(3)) * 0.02 + 0.01
        scale[:4] = 0.03125
        zp = torch.randint(qmin + 40, qmax - 40, (16, 1), generator=torch.Generator().manual_seed(4))
        zp = zp.to(torch.int32)
        ref_fn = lambda t: torch.fake_quantize_per_channel_affine(
            t, scale.flatten(), zp.flatten(), 0, qmin, qmax
        )
    else:
        block = x.shape
        scale, zp = torch.tensor([[0.03125]]), torch.tensor([[qmin + 97]], dtype=torch.int32)
        ref_fn = lambda t: torch.fake_quantize_per_tensor_affine(t, 0.03125, qmin + 97, qmin, qmax)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = fake_quantize_affine(xa, block, scale, zp, dtype), ref_fn(xb)
    assert torch.equal(ours, ref)
    ours.backward(torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape))
    ref.backward(torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape))
    assert 0 < (xa.grad == 0).sum() < x.numel()  # the data really clips somewhere
    assert torch.equal(xa.grad, xb.grad)
    q = quantize_affine(x, block, scale, zp, dtype)
    assert torch.equal(dequantize_affine(q, block, scale, zp, dtype), ref)


# --------------------------------------------------------------------------------------------------------
# Low-bit per-group


LOW_BIT = [torch.int2, torch.int3, torch.int4, torch.uint4, torch.int5, torch.int6, torch.int7]


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("mapping", [SYM, ASYM, NO_CLIP])
@pytest.mark.parametrize("dtype", LOW_BIT)
def test_per_group_round_trip_error_within_half_scale(dtype, mapping, group):
    x = _randn(8, 256) * 2
    block = (1, group)
    scale, zp, q, dq = _round_trip(x, mapping, block, dtype)
    assert scale.shape == zp.shape == (8, 256 // group)
    assert q.dtype == container_dtype(dtype) and q.shape == x.shape
    qmin, qmax = qrange(dtype)
    assert qmin <= q.min().item() and q.max().item() <= qmax
    _assert_error_within_half_scale(x, dq, scale, block)


def test_per_group_sqnr_golden():
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    configs = [(d, m, INT) for d in LOW_BIT for m in (SYM, ASYM)] + [(torch.uint4, ASYM, FLOAT)]
    lines = []
    for (dtype, mapping, domain), group in itertools.product(configs, (32, 64, 128)):
        extra = {"preserve_zero": False} if domain is FLOAT else {}
        *_, dq = _round_trip(w, mapping, (1, group), dtype, domain, **extra)
        name = str(dtype).removeprefix("torch.")
        lines.append(f"{name:<6} g{group:<4} {mapping.name:<10} {domain.name:<5} {_sqnr(w, dq):6.2f}")
    expecttest.assert_expected_inline(
        "\n".join(lines),
        """\
int2   g32   SYMMETRIC  INT     6.55
int2   g64   SYMMETRIC  INT     5.84
int2   g128  SYMMETRIC  INT     5.15
int2   g32   ASYMMETRIC INT     7.80
int2   g64   ASYMMETRIC INT     6.85
int2   g128  ASYMMETRIC INT     5.96
int3   g32   SYMMETRIC  INT    13.87
int3   g64   SYMMETRIC  INT    13.14
int3   g128  SYMMETRIC  INT    12.45
int3   g32   ASYMMETRIC INT    15.25
int3   g64   ASYMMETRIC INT    14.25
int3   g128  ASYMMETRIC INT    13.33
int4   g32   SYMMETRIC  INT    20.47
int4   g64   SYMMETRIC  INT    19.75
int4   g128  SYMMETRIC  INT    19.07
int4   g32   ASYMMETRIC INT    21.83
int4   g64   ASYMMETRIC INT    20.85
int4   g128  ASYMMETRIC INT    19.95
uint4  g32   SYMMETRIC  INT    20.47
uint4  g64   SYMMETRIC  INT    19.75
uint4  g128  SYMMETRIC  INT    19.07
uint4  g32   ASYMMETRIC INT    21.83
uint4  g64   ASYMMETRIC INT    20.85
uint4  g128  ASYMMETRIC INT    19.95
int5   g32   SYMMETRIC  INT    26.82
int5   g64   SYMMETRIC  INT    26.10
int5   g128  SYMMETRIC  INT    25.40
int5   g32   ASYMMETRIC INT    28.14
int5   g64   ASYMMETRIC INT    27.18
int5   g128  ASYMMETRIC INT    26.27
int6   g32   SYMMETRIC  INT    33.00
int6   g64   SYMMETRIC  INT    32.29
int6   g128  SYMMETRIC  INT    31.55
int6   g32   ASYMMETRIC INT    34.29
int6   g64   ASYMMETRIC INT    33.32
int6   g128  ASYMMETRIC INT    32.42
int7   g32   SYMMETRIC  INT    39.03
int7   g64   SYMMETRIC  INT    38.32
int7   g128  SYMMETRIC  INT    37.61
int7   g32   ASYMMETRIC INT    40.43
int7   g64   ASYMMETRIC INT    39.46
int7   g128  ASYMMETRIC INT    38.51
uint4  g32   ASYMMETRIC FLOAT  22.12
uint4  g64   ASYMMETRIC FLOAT  20.98
uint4  g128  ASYMMETRIC FLOAT  20.03""",
    )


# --------------------------------------------------------------------------------------------------------
# Zero-point domains, float8, degenerate blocks, dtypes, ranks


def test_float_domain_round_trip_and_formula():
    x = _randn(8, 128) * 0.5 + 6  # blocks exclude 0, where the FLOAT domain pays off
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 32), torch.uint4, FLOAT, preserve_zero=False)
    assert zp.dtype == scale.dtype == torch.float32
    blocks = x.reshape(8, 4, 32)
    mn, mx = blocks.amin(-1), blocks.amax(-1)
    assert torch.equal(scale, (mx - mn) / 15.0)
    assert torch.equal(zp, mn + scale * 8.0)  # zp = min + scale * mid, mid = (15 + 0 + 1) / 2
    _assert_error_within_half_scale(x, dq, scale, (1, 32))
    # preserve_zero=False beats the INT domain's widened range on this data
    *_, dq_int = _round_trip(x, ASYM, (1, 32), torch.uint4, INT)
    assert _sqnr(x, dq) > _sqnr(x, dq_int) + 3


def test_float_domain_signed_target_uses_full_code_range():
    x = _randn(8, 128) + 4
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 32), torch.int4, FLOAT, preserve_zero=False)
    assert q.min().item() == -8 and q.max().item() == 7
    _assert_error_within_half_scale(x, dq, scale, (1, 32))


def test_float_domain_symmetric_zero_point_is_zero():
    x = _randn(4, 64)
    scale, zp, q, dq = _round_trip(x, SYM, (1, 64), torch.int4, FLOAT)
    assert torch.equal(zp, torch.zeros_like(scale))
    _, _, q_int, dq_int = _round_trip(x, SYM, (1, 64), torch.int4, INT)
    # Same grid as the INT domain; only float rounding next to .5 ties (x - min_val vs x) may differ.
    mask = _away_from_ties(x, _expand(scale, (1, 64), x.shape))
    assert torch.equal(q[mask], q_int[mask]) and (q.int() - q_int.int()).abs().max() <= 1
    _assert_error_within_half_scale(x, dq, scale, (1, 64))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int4])
def test_none_domain(dtype):
    x = _randn(4, 64)
    scale, zp, q, dq = _round_trip(x, SYM, (1, 64), dtype, NONE)
    assert zp is None
    s_int, _, q_int, dq_int = _round_trip(x, SYM, (1, 64), dtype, INT)
    assert torch.equal(scale, s_int) and torch.equal(q, q_int) and torch.equal(dq, dq_int)
    assert torch.equal(dq, q.float() * scale)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_targets(dtype):
    x = _randn(16, 64) * 10
    x[2] = 0.0
    scale, zp, q, dq = _round_trip(x, SYM, (1, 64), dtype)
    info = torch.finfo(dtype)
    assert zp is None and q.dtype == dtype and scale.shape == (16, 1)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(scale[amax != 0], (amax / info.max)[amax != 0])
    assert torch.equal(q.float().abs().amax(-1)[amax.flatten() != 0], torch.full((15,), info.max))
    # Relative error of a normal fp8 number is at most 2^-(mantissa+1); subnormals have fixed spacing.
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    bound = 2.0 ** -(mantissa + 1) * torch.maximum(x.abs(), info.tiny * scale) * (1 + 1e-6)
    assert ((dq - x).abs() <= bound).all()
    assert torch.equal(dq[2], torch.zeros(64))


def test_float8_clamps_before_cast():
    x = torch.tensor([[1000.0, -1000.0, 3.0]])
    q = quantize_affine(x, x.shape, torch.tensor(1.0), None, torch.float8_e4m3fn)
    assert q.float().tolist() == [[448.0, -448.0, 3.0]]
    q = quantize_affine(x, x.shape, torch.tensor(1.0), None, torch.float8_e4m3fn, quant_max=100.0)
    assert q.float().tolist() == [[96.0, -448.0, 3.0]]  # 100 is not an e4m3 value; it rounds to 96


ALL_ZERO_CONFIGS = [
    (SYM, torch.int8, INT, {}),
    (ASYM, torch.uint8, INT, {}),
    (NO_CLIP, torch.int4, INT, {}),
    (ASYM, torch.uint4, FLOAT, {"preserve_zero": False}),
    (SYM, torch.int4, NONE, {}),
    (SYM, torch.float8_e4m3fn, INT, {}),
]


@pytest.mark.parametrize("mapping, dtype, domain, extra", ALL_ZERO_CONFIGS)
def test_all_zero_block_gets_eps_scale(mapping, dtype, domain, extra):
    x = _randn(4, 64)
    x[1, 32:] = 0.0
    scale, zp, q, dq = _round_trip(x, mapping, (1, 32), dtype, domain, **extra)
    assert scale[1, 1].item() == torch.finfo(torch.float32).tiny
    assert torch.isfinite(dq).all() and torch.isfinite(scale).all()
    assert torch.equal(dq[1, 32:], torch.zeros(32))


def test_all_zero_eps_follows_narrow_scale_dtype():
    x = torch.zeros(2, 8)
    scale, _ = choose_qparams_affine(x, SYM, (1, 8), torch.int8, scale_dtype=torch.float16)
    assert scale.dtype == torch.float16 and (scale == torch.finfo(torch.float16).tiny).all()
    scale, _ = choose_qparams_affine(x.bfloat16(), SYM, (1, 8), torch.int8, eps=1e-3)
    assert scale.dtype == torch.bfloat16 and (scale == torch.tensor(1e-3).bfloat16()).all()


@pytest.mark.parametrize("value", [3.0, -2.5, 1e-3])
def test_constant_blocks(value):
    x = torch.full((2, 64), value)
    for mapping, dtype in [(SYM, torch.int4), (ASYM, torch.uint4), (NO_CLIP, torch.int8)]:
        scale, zp, q, dq = _round_trip(x, mapping, (1, 32), dtype)
        _assert_error_within_half_scale(x, dq, scale, (1, 32))
    # FLOAT domain without preserve_zero represents a constant block exactly
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 32), torch.uint4, FLOAT, preserve_zero=False)
    assert torch.equal(dq, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mapping, domain", [(SYM, INT), (ASYM, INT), (ASYM, FLOAT)])
def test_half_precision_inputs(dtype, mapping, domain):
    x = _randn(8, 128, dtype=dtype)
    block = (1, 32)
    scale, zp = choose_qparams_affine(x, mapping, block, torch.uint4, zero_point_domain=domain)
    assert scale.dtype == dtype
    assert zp.dtype == (torch.int32 if domain is INT else dtype)
    # the math runs in float32: same qparams (cast once) and codes as for the float32 copy
    s32, z32 = choose_qparams_affine(
        x.float(), mapping, block, torch.uint4, zero_point_domain=domain, scale_dtype=dtype
    )
    assert torch.equal(scale, s32) and torch.equal(zp, z32)
    q = quantize_affine(x, block, scale, zp, torch.uint4, zero_point_domain=domain)
    assert torch.equal(
        q, quantize_affine(x.float(), block, scale.float(), zp.float(), torch.uint4, zero_point_domain=domain)
    )
    dq = dequantize_affine(q, block, scale, zp, torch.uint4, zero_point_domain=domain, output_dtype=dtype)
    dq32 = dequantize_affine(q, block, scale, zp, torch.uint4, zero_point_domain=domain)
    assert dq.dtype == dtype and dq32.dtype == torch.float32
    assert torch.equal(dq, dq32.to(dtype))


def _blockwise_reference(x, block, qmin, qmax):
    """Asymmetric INT qparams and codes computed one block at a time by slicing."""
    reduced = [d // b for d, b in zip(x.shape, block, strict=True)]
    scale, zp, q = torch.empty(reduced), torch.empty(reduced, dtype=torch.int32), torch.empty_like(x)
    for idx in itertools.product(*(range(n) for n in reduced)):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block, strict=True))
        blk = x[sl]
        mn, mx = blk.min().clamp(max=0), blk.max().clamp(min=0)
        s = torch.clamp((mx - mn) / float(qmax - qmin), min=torch.finfo(torch.float32).tiny)
        z = torch.clamp(qmin - torch.round(mn / s), qmin, qmax)
        scale[idx], zp[idx] = s, z
        q[sl] = torch.clamp(torch.round(blk * (1.0 / s)) + z, qmin, qmax)
    return scale, zp, q


@pytest.mark.parametrize(
    "shape, block",
    [
        ((4, 6, 8), (2, 3, 4)),
        ((2, 4, 6, 8), (1, 2, 3, 8)),
        ((2, 4, 6, 8), (2, 1, 6, 2)),
        ((3, 5, 7), (3, 5, 7)),
    ],
)
def test_multi_dim_blocks_match_blockwise_reference(shape, block):
    x = _randn(*shape) * 2 + 0.3
    scale, zp, q, dq = _round_trip(x, ASYM, block, torch.uint8)
    ref_scale, ref_zp, ref_q = _blockwise_reference(x, block, 0, 255)
    assert scale.shape == tuple(d // b for d, b in zip(shape, block, strict=True))
    assert torch.equal(scale, ref_scale) and torch.equal(zp, ref_zp)
    assert torch.equal(q, ref_q.to(torch.uint8))
    _assert_error_within_half_scale(x, dq, scale, block)


def test_qparams_accepted_in_any_shape_with_right_numel():
    x = _randn(8, 128)
    scale, zp = choose_qparams_affine(x, ASYM, (1, 32), torch.uint4)
    q = quantize_affine(x, (1, 32), scale, zp, torch.uint4)
    for shape in [(32,), (32, 1), (2, 16)]:
        s, z = scale.reshape(shape), zp.reshape(shape)
        assert torch.equal(quantize_affine(x, (1, 32), s, z, torch.uint4), q)
        assert torch.equal(
            dequantize_affine(q, (1, 32), s, z, torch.uint4),
            dequantize_affine(q, (1, 32), scale, zp, torch.uint4),
        )


def test_python_scalar_qparams():
    x = torch.tensor([[0.2, -1.0, 3.0]])
    q = quantize_affine(x, x.shape, 0.5, 3, torch.uint4)
    assert q.tolist() == [[3, 1, 9]]
    assert dequantize_affine(q, x.shape, 0.5, 3, torch.uint4).tolist() == [[0.0, -1.0, 3.0]]


def test_rank_zero_input():
    x = torch.tensor(3.0)
    scale, zp, q, dq = _round_trip(x, ASYM, (), torch.uint8)
    assert scale.shape == zp.shape == q.shape == ()
    assert q.item() == 255 and torch.equal(dq, x)


@pytest.mark.parametrize(
    "dtype, container, values",
    [
        (torch.int4, torch.int8, set(range(-8, 8))),
        (torch.uint4, torch.uint8, set(range(16))),
        (torch.int2, torch.int8, {-2, -1, 0, 1}),
        (torch.int1, torch.int8, {-1, 0}),
        (torch.uint1, torch.uint8, {0, 1}),
    ],
)
def test_sub_byte_codes_live_in_byte_containers(dtype, container, values):
    x = _randn(16, 64) * 3
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 64), dtype)
    assert q.dtype == container
    assert set(q.unique().tolist()) == values  # every code is used, none outside the range
    assert torch.equal(dq, (q.float() - zp.float()) * scale)


def test_int16_and_int32_targets():
    x = _randn(4, 64) * 100
    scale, zp, q, dq = _round_trip(x, ASYM, (1, 64), torch.int16)
    assert q.dtype == torch.int16
    _assert_error_within_half_scale(x, dq, scale, (1, 64))
    # int32 codes near the range ends are exact (float32 math would overflow 2**31 - 1)
    x = torch.tensor([[1e10, -1e10, 123456789.0, -5.0, 2147483520.0]])
    q = quantize_affine(x, x.shape, torch.tensor(1.0), None, torch.int32, zero_point_domain=NONE)
    assert q.dtype == torch.int32
    assert q.tolist() == [[2**31 - 1, -(2**31), 123456792, -5, 2147483520]]


def test_dequantize_does_not_mutate_or_alias():
    x = _randn(4, 64)
    scale, zp = choose_qparams_affine(x, ASYM, (1, 32), torch.uint8)
    q = quantize_affine(x, (1, 32), scale, zp, torch.uint8)
    q_before, scale_before, zp_before = q.clone(), scale.clone(), zp.clone()
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        dq = dequantize_affine(q, (1, 32), scale, zp, torch.uint8, output_dtype=out_dtype)
        assert dq.dtype == out_dtype and dq.shape == q.shape
        assert dq.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in (q, scale, zp)}
    assert torch.equal(q, q_before) and torch.equal(scale, scale_before) and torch.equal(zp, zp_before)
    # NONE domain with a float32 scale and float8 codes: still a fresh tensor
    s8, _ = choose_qparams_affine(x, SYM, (1, 64), torch.float8_e4m3fn)
    q8 = quantize_affine(x, (1, 64), s8, None, torch.float8_e4m3fn)
    dq8 = dequantize_affine(q8, (1, 64), s8, None, torch.float8_e4m3fn)
    assert dq8.untyped_storage().data_ptr() != s8.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------------------------
# fake_quantize_affine


FAKE_QUANT_CONFIGS = [
    (SYM, torch.int4, INT, {}),
    (ASYM, torch.uint4, INT, {}),
    (ASYM, torch.uint4, FLOAT, {"preserve_zero": False}),
    (SYM, torch.int8, NONE, {}),
    (SYM, torch.float8_e4m3fn, INT, {}),
    (ASYM, torch.int5, INT, {"quant_min": -10, "quant_max": 12}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mapping, qdtype, domain, extra", FAKE_QUANT_CONFIGS)
def test_fake_quantize_equals_round_trip(mapping, qdtype, domain, extra, dtype):
    x = _randn(8, 128, dtype=dtype) * 2
    scale, zp, q, dq = _round_trip(x, mapping, (1, 32), qdtype, domain, **extra)
    ranges = {k: v for k, v in extra.items() if k.startswith("quant_")}
    fq = fake_quantize_affine(x, (1, 32), scale, zp, qdtype, zero_point_domain=domain, **ranges)
    assert fq.dtype == dtype and torch.equal(fq, dq)


def test_fake_quantize_gradient_is_clipping_mask():
    x = torch.tensor([[-9.0, -8.6, -8.4, -8.0, 0.0, 6.6, 7.0, 7.4, 7.6, 8.0]], requires_grad=True)
    scale, zp = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32)
    y = fake_quantize_affine(x, x.shape, scale, zp, torch.int4)
    assert y.tolist() == [[-8.0, -8.0, -8.0, -8.0, 0.0, 7.0, 7.0, 7.0, 7.0, 7.0]]
    y.backward(torch.full_like(y, 2.0))
    assert x.grad.tolist() == [[0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0]]


def test_fake_quantize_gradient_float_domain_and_bf16():
    x = (torch.tensor([[-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)).requires_grad_()
    # FLOAT domain uint2: min_val = zp - scale * (mid - qmin) = 2 - 1 * 2 = 0, so codes = round(x) in [0, 3]
    scale, zp = torch.tensor(1.0), torch.tensor(2.0)
    y = fake_quantize_affine(x, x.shape, scale, zp, torch.uint2, zero_point_domain=FLOAT)
    assert y.dtype == torch.bfloat16 and y.float().tolist() == [[0.0, 0.0, 1.0, 2.0, 3.0, 3.0]]
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.float().tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


# --------------------------------------------------------------------------------------------------------
# torch.compile and CUDA


def _qdq(x):
    block = (1, 32)
    scale, zp = choose_qparams_affine(x, ASYM, block, torch.uint4)
    q = quantize_affine(x, block, scale, zp, torch.uint4)
    return q, dequantize_affine(q, block, scale, zp, torch.uint4, output_dtype=x.dtype)


def test_compile_fullgraph_quantize_dequantize():
    x = _randn(4, 64)
    q, dq = torch.compile(_qdq, fullgraph=True)(x)
    q_ref, dq_ref = _qdq(x)
    assert q.dtype == torch.uint8
    assert torch.equal(q, q_ref) and torch.equal(dq, dq_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    x = _randn(16, 256) * 3
    for mapping, dtype, domain, extra in FAKE_QUANT_CONFIGS:
        ranges = {k: v for k, v in extra.items() if k.startswith("quant_")}
        cpu = _round_trip(x, mapping, (1, 32), dtype, domain, **extra)
        gpu = _round_trip(x.cuda(), mapping, (1, 32), dtype, domain, **extra)
        for a, b in zip(cpu, gpu, strict=True):
            assert (a is None and b is None) or (b.is_cuda and torch.equal(a, b.cpu()))
        fq = fake_quantize_affine(
            x.cuda(), (1, 32), gpu[0], gpu[1], dtype, zero_point_domain=domain, **ranges
        )
        assert torch.equal(fq, gpu[3])
    q, dq = torch.compile(_qdq, fullgraph=True)(x.cuda())
    assert torch.equal(q.cpu(), _qdq(x)[0])
