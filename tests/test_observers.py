import io

import pytest
import torch
from torch.ao import quantization as ao

from affineq.granularity import PerAxis, PerTensor, get_block_size
from affineq.observers import (
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    Observer,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorHistogramObserver,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)
from affineq.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, fake_quantize_affine

SYM, ASYM = MappingType.SYMMETRIC, MappingType.ASYMMETRIC
AO_EPS = torch.finfo(torch.float32).eps  # torch.ao observers' eps
AO_DTYPE = {torch.int8: torch.qint8, torch.uint8: torch.quint8}
AO_QSCHEME = {
    (ASYM, False): torch.per_tensor_affine,
    (SYM, False): torch.per_tensor_symmetric,
    (ASYM, True): torch.per_channel_affine,
    (SYM, True): torch.per_channel_symmetric,
}

# torch.ao observers are deprecated upstream; they remain the reference here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _batches(shape, n=5, seed=0, kind="mixed"):
    """Several batches with different scales and offsets (so running and moving-average stats differ)."""
    g = _gen(seed)
    out = []
    for i in range(n):
        x = torch.randn(*shape, generator=g) * (1 + 0.7 * i) + 0.3 * (i - 2)
        if kind == "positive":
            x = x.abs() + 0.1
        elif kind == "negative":
            x = -x.abs() - 0.5
        out.append(x)
    return out


# --------------------------------------------------------------------------------------------------------
# Bit-exact parity with torch.ao observers


PER_TENSOR_PAIRS = [
    (PerTensorMinMaxObserver, ao.MinMaxObserver, {}),
    (MovingAveragePerTensorMinMaxObserver, ao.MovingAverageMinMaxObserver, {}),
    (MovingAveragePerTensorMinMaxObserver, ao.MovingAverageMinMaxObserver, {"averaging_constant": 0.3}),
]
PER_CHANNEL_PAIRS = [
    (PerChannelMinMaxObserver, ao.PerChannelMinMaxObserver, {}),
    (MovingAveragePerChannelMinMaxObserver, ao.MovingAveragePerChannelMinMaxObserver, {}),
    (MovingAveragePerChannelMinMaxObserver, ao.MovingAveragePerChannelMinMaxObserver, {"averaging_constant": 0.25}),
]


def _assert_same_qparams(ours, ref, shape):
    scale, zp = ours.calculate_qparams()
    ref_scale, ref_zp = ref.calculate_qparams()
    reduced = tuple(d // b for d, b in zip(shape, ours.block_size(shape), strict=True))
    assert scale.shape == zp.shape == reduced
    assert scale.dtype == torch.float32 and zp.dtype == torch.int32
    assert torch.equal(scale.flatten(), ref_scale.flatten())
    assert torch.equal(zp.flatten().long(), ref_zp.flatten().long())


@pytest.mark.parametrize("kind", ["mixed", "positive", "negative"])
@pytest.mark.parametrize("mapping", [ASYM, SYM])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("ours_cls, ref_cls, kwargs", PER_TENSOR_PAIRS)
def test_per_tensor_observers_match_torch_ao_bit_for_bit(ours_cls, ref_cls, kwargs, dtype, mapping, kind):
    ours = ours_cls(dtype=dtype, mapping_type=mapping, eps=AO_EPS, **kwargs)
    ref = ref_cls(dtype=AO_DTYPE[dtype], qscheme=AO_QSCHEME[mapping, False], **kwargs)
    for i, x in enumerate(_batches((12, 40), kind=kind)):
        assert ours(x) is x
        ref(x)
        if i in (0, 4):  # after the first batch and after all of them
            _assert_same_qparams(ours, ref, x.shape)
            assert torch.equal(ours.min_val, ref.min_val.reshape(1))
            assert torch.equal(ours.max_val, ref.max_val.reshape(1))


@pytest.mark.parametrize("shape, ch_axis", [((12, 40), 0), ((12, 40), 1), ((4, 6, 10), 1), ((4, 6, 10), 2),
                                            ((4, 6, 10), -1)])
@pytest.mark.parametrize("mapping", [ASYM, SYM])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("ours_cls, ref_cls, kwargs", PER_CHANNEL_PAIRS)
def test_per_channel_observers_match_torch_ao_bit_for_bit(ours_cls, ref_cls, kwargs, dtype, mapping, shape, ch_axis):
    ours = ours_cls(ch_axis=ch_axis, dtype=dtype, mapping_type=mapping, eps=AO_EPS, **kwargs)
    ref = ref_cls(ch_axis=ch_axis, dtype=AO_DTYPE[dtype], qscheme=AO_QSCHEME[mapping, True], **kwargs)
    batches = _batches(shape, seed=1)
    batches[2] = batches[2].index_fill(ch_axis % len(shape), torch.tensor([0]), 0.0)  # a zero channel: eps clamp
    batches[3] = batches[3].index_fill(ch_axis % len(shape), torch.tensor([1]), 2.5)  # a positive one
    for x in batches:
        ours(x)
        ref(x)
    _assert_same_qparams(ours, ref, shape)


def test_first_batch_of_zeros_gives_eps_scale_like_torch_ao():
    ours = MovingAveragePerTensorMinMaxObserver(dtype=torch.uint8, eps=AO_EPS)
    ref = ao.MovingAverageMinMaxObserver(dtype=torch.quint8)
    x = torch.zeros(3, 5)
    ours(x)
    ref(x)
    _assert_same_qparams(ours, ref, x.shape)
    assert ours.calculate_qparams()[0].item() == AO_EPS


# --------------------------------------------------------------------------------------------------------
# Shapes and granularities


@pytest.mark.parametrize("mapping", [ASYM, SYM])
@pytest.mark.parametrize(
    "obs_fn, granularity",
    [
        (lambda **k: PerTensorMinMaxObserver(**k), PerTensor()),
        (lambda **k: PerChannelMinMaxObserver(ch_axis=1, **k), PerAxis(1)),
        (lambda **k: PerChannelMinMaxObserver(ch_axis=-1, **k), PerAxis(-1)),
    ],
)
def test_single_batch_equals_the_primitive_on_that_batch(obs_fn, granularity, mapping):
    x = _batches((3, 8, 16), n=1)[0]
    obs = obs_fn(mapping_type=mapping, dtype=torch.int4)
    obs(x)
    block = get_block_size(x.shape, granularity)
    assert obs.block_size(x.shape) == block
    scale, zp = obs.calculate_qparams()
    ref_scale, ref_zp = choose_qparams_affine(x, mapping, block, torch.int4, scale_dtype=torch.float32)
    assert scale.shape == ref_scale.shape and torch.equal(scale, ref_scale) and torch.equal(zp, ref_zp)


@pytest.mark.parametrize("mapping", [ASYM, SYM])
@pytest.mark.parametrize(
    "shape, group_size, ch_axis, reduced",
    [((6, 16), 4, -1, (6, 4)), ((2, 3, 32), 8, -1, (2, 3, 4)), ((16, 6), 4, 0, (4, 6)), ((6, 16), 16, 1, (6, 1))],
)
def test_per_group_qparams_over_several_batches(shape, group_size, ch_axis, reduced, mapping):
    batches = _batches(shape, n=3, seed=2)
    obs = PerGroupMinMaxObserver(group_size, ch_axis=ch_axis, mapping_type=mapping, dtype=torch.uint4)
    for x in batches:
        obs(x)
    block = obs.block_size(shape)
    assert block == tuple(group_size if i == ch_axis % len(shape) else 1 for i in range(len(shape)))
    scale, zp = obs.calculate_qparams()
    assert scale.shape == zp.shape == reduced
    # Reference: every batch's slice of a group concatenated into one block along the grouped dim.
    axis = ch_axis % len(shape)
    moved = [x.movedim(axis, -1) for x in batches]
    lead = moved[0].shape[:-1]
    stacked = torch.cat([m.reshape(*lead, -1, group_size) for m in moved], dim=-1)  # [..., groups, n * g]
    stacked = stacked.reshape(*lead, -1)
    ref_block = (1,) * len(lead) + (group_size * len(batches),)
    ref_scale, ref_zp = choose_qparams_affine(stacked, mapping, ref_block, torch.uint4)
    assert torch.equal(scale, ref_scale.reshape(*lead, -1).movedim(-1, axis))
    assert torch.equal(zp, ref_zp.reshape(*lead, -1).movedim(-1, axis))


def test_default_group_observer_uses_affineq_per_group_blocks():
    from affineq.granularity import PerGroup

    obs = PerGroupMinMaxObserver(32)
    assert obs.block_size((4, 128)) == get_block_size((4, 128), PerGroup(32))


def test_per_tensor_observer_accepts_any_shape_and_reports_the_last():
    obs = PerTensorMinMaxObserver()
    obs(torch.randn(4, 8))
    obs(torch.randn(2, 3, 5) * 10)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == zp.shape == (1, 1, 1)


def test_per_channel_other_dims_may_change():
    obs = PerChannelMinMaxObserver(ch_axis=-1)
    obs(torch.randn(4, 8))
    obs(torch.randn(7, 8))  # a new batch size, same channels
    assert obs.calculate_qparams()[0].shape == (1, 8)


def test_zero_point_domain_none_and_float_targets():
    x = torch.randn(4, 32)
    obs = PerTensorMinMaxObserver(dtype=torch.int8, mapping_type=SYM, zero_point_domain=ZeroPointDomain.NONE)
    obs(x)
    scale, zp = obs.calculate_qparams()
    assert zp is None and torch.equal(scale, x.abs().max().reshape(1, 1) / 127.5)
    f8 = PerChannelMinMaxObserver(dtype=torch.float8_e4m3fn, mapping_type=SYM)
    f8(x)
    scale, zp = f8.calculate_qparams()
    assert zp is None and torch.equal(scale, choose_qparams_affine(x, SYM, (1, 32), torch.float8_e4m3fn)[0])


def test_forward_returns_input_untouched_and_keeps_no_graph():
    x = torch.randn(4, 8, requires_grad=True)
    obs = PerChannelMinMaxObserver()
    y = obs(x * 2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    for b in obs.buffers():
        assert not b.requires_grad and b.grad_fn is None
    obs16 = PerTensorMinMaxObserver()
    x16 = torch.randn(4, 8, dtype=torch.bfloat16)
    assert obs16(x16) is x16 and obs16.min_val.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------
# reset and state_dict


ALL_OBSERVERS = [
    lambda: PerTensorMinMaxObserver(),
    lambda: PerChannelMinMaxObserver(ch_axis=1, mapping_type=SYM),
    lambda: PerGroupMinMaxObserver(8),
    lambda: MovingAveragePerTensorMinMaxObserver(dtype=torch.uint8),
    lambda: MovingAveragePerChannelMinMaxObserver(ch_axis=0),
    lambda: PerTensorHistogramObserver(bins=256),
    lambda: PerTensorHistogramObserver(bins=256, mapping_type=SYM),
    lambda: PerTensorPercentileObserver(99.0, max_samples=100),
    lambda: PerTensorMSEObserver(num_candidates=20, max_samples=100),
]


@pytest.mark.parametrize("make", ALL_OBSERVERS)
def test_state_dict_round_trip_and_reset(make):
    obs = make()
    for x in _batches((6, 32), n=3, seed=3):
        obs(x)
    expected = obs.calculate_qparams()
    buf = io.BytesIO()
    torch.save(obs.state_dict(), buf)
    buf.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    got = fresh.calculate_qparams()
    for e, g in zip(expected, got, strict=True):
        assert (e is None and g is None) or torch.equal(e, g)
    assert int(fresh.num_batches) == 3

    obs.reset()
    assert int(obs.num_batches) == 0
    with pytest.raises(ValueError, match="before any data"):
        obs.calculate_qparams()
    y = torch.randn(3, 16)  # a new shape is fine after reset
    obs(y)
    assert obs.calculate_qparams()[0].numel() in (1, 3, 16, 6)


# --------------------------------------------------------------------------------------------------------
# Error messages


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: PerTensorMinMaxObserver(dtype=torch.float8_e4m3fn, mapping_type=ASYM),
         r"float target.*mapping_type=MappingType.SYMMETRIC"),
        (lambda: PerTensorMinMaxObserver(dtype=torch.float32), r"dtype=torch.float32 is not a supported"),
        (lambda: PerTensorMinMaxObserver(mapping_type="symmetric"), r"mapping_type must be a MappingType"),
        (lambda: PerTensorMinMaxObserver(dtype=torch.uint8, mapping_type=SYM,
                                         zero_point_domain=ZeroPointDomain.NONE),
         r"invalid configuration.*ZeroPointDomain.INT"),
        (lambda: PerTensorMinMaxObserver(mapping_type=ASYM, zero_point_domain=ZeroPointDomain.NONE),
         r"invalid configuration.*needs a zero point"),
        (lambda: PerTensorMinMaxObserver(eps=0.0), r"eps must be a positive"),
        (lambda: PerTensorMinMaxObserver(eps=1e-10, scale_dtype=torch.float16), r"eps=1e-10 is too small"),
        (lambda: PerTensorMinMaxObserver(quant_min=0, quant_max=300, dtype=torch.uint8), r"quant_max=300"),
        (lambda: MovingAveragePerTensorMinMaxObserver(averaging_constant=0), r"averaging_constant must be"),
        (lambda: PerChannelMinMaxObserver(ch_axis=1.0), r"ch_axis must be an int"),
        (lambda: PerGroupMinMaxObserver(0), r"group_size must be a positive int"),
        (lambda: PerTensorHistogramObserver(dtype=torch.float8_e4m3fn, mapping_type=SYM), r"use an integer dtype"),
        (lambda: PerTensorHistogramObserver(bins=1), r"bins must be an int >= 2"),
        (lambda: PerTensorPercentileObserver(40), r"percentile must be a number in \(50, 100\]"),
        (lambda: PerTensorMSEObserver(num_candidates=0), r"num_candidates must be a positive int"),
        (lambda: PerTensorMSEObserver(max_samples=0), r"max_samples must be a positive int"),
    ],
)
def test_bad_configuration_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make", ALL_OBSERVERS)
def test_calculate_before_data_says_what_to_do(make):
    with pytest.raises(ValueError, match=r"calculate_qparams\(\) was called before any data.*obs\(x\)"):
        make().calculate_qparams()


@pytest.mark.parametrize(
    "make, first, second, match",
    [
        (lambda: PerChannelMinMaxObserver(ch_axis=0), (4, 8), (5, 8), r"shape \(5, 8\) after .*\(4, 8\).*4 channels"),
        (lambda: PerChannelMinMaxObserver(ch_axis=1), (4, 8), (4, 8, 2), r"same rank.*call reset\(\)|Call reset"),
        (lambda: MovingAveragePerChannelMinMaxObserver(), (4, 8), (3, 8), r"4 channels along ch_axis=0"),
        (lambda: PerGroupMinMaxObserver(4), (2, 8), (3, 8), r"every input must have the same shape.*reset\(\)"),
        (lambda: PerGroupMinMaxObserver(4), (2, 8), (2, 6), r"group_size=4 does not divide dim 1 \(size 6\)"),
        (lambda: PerChannelMinMaxObserver(ch_axis=2), (4, 8), (4, 8), r"PerAxis\(axis=2\) is out of range"),
    ],
)
def test_shape_errors(make, first, second, match):
    obs = make()
    if first != second:
        obs(torch.randn(first))
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        obs(torch.randn(second))
    after = obs.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # a rejected batch leaves the stats alone


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.tensor([1.0, float("nan")]), r"NaN or Inf.*nan_to_num"),
        (torch.tensor([1.0, float("inf")]), r"NaN or Inf"),
        (torch.tensor([1, 2]), r"floating-point tensor, got torch.int64"),
        (torch.zeros(0, 3), r"empty"),
    ],
)
def test_bad_input_errors(x, match):
    obs = PerTensorMinMaxObserver()
    with pytest.raises(ValueError, match=match):
        obs(x)
    assert int(obs.num_batches) == 0


# --------------------------------------------------------------------------------------------------------
# Histogram observer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_range_close_to_torch_ao_on_gaussian_data(seed):
    # One batch, so both observers hold the same histogram (2048 bins over [min, max], torch.histc) and only
    # the range searches differ: torch.ao walks inwards greedily and stops at its first error increase (often
    # before clipping the longer tail) and models 256 cells of width range / 256; we search all ranges
    # (coarse grid + refinement) with the affine grid range / 255. Exact equality is therefore not expected.
    # Measured (n = 16384): ours vs torch.ao ends differ by at most 0.198 = 2.3% of the range width (seed 0:
    # lo -4.145 vs -4.343, hi 3.899 vs 3.928; seed 1: -4.102/-4.184, 3.740/3.752; seed 2: -3.607/-3.697,
    # 3.729/3.703). Asserted: each end within 4% of torch.ao's width, and our range is no worse than
    # torch.ao's under our error model (it is a global minimum over a set that includes near neighbours).
    x = torch.randn(16384, generator=_gen(seed))
    ours = PerTensorHistogramObserver(dtype=torch.uint8, eps=AO_EPS)
    ref = ao.HistogramObserver(dtype=torch.quint8)
    ours(x)
    ref(x)
    assert torch.equal(ours.histogram.float(), ref.histogram)
    lo, hi = ours.optimal_range()
    ref_lo, ref_hi = (float(v) for v in ref._non_linear_param_search())
    width = ref_hi - ref_lo
    assert abs(float(lo) - ref_lo) <= 0.04 * width and abs(float(hi) - ref_hi) <= 0.04 * width
    err, _, _ = ours._errors(torch.tensor([[float(lo), float(hi)], [ref_lo, ref_hi]]))
    assert err[0] <= err[1]
    scale, _ = ours.calculate_qparams()
    ref_scale, _ = ref.calculate_qparams()
    assert abs(scale.item() / ref_scale.item() - 1) < 0.05


def test_histogram_error_model_predicts_the_actual_fake_quant_error():
    # The model integrates the exact rounding + clipping error assuming uniform density inside each bin; on
    # 2**16 Gaussian values it matches the measured mean squared error of fake_quantize_affine closely.
    x = torch.randn(2**16, generator=_gen(5))
    obs = PerTensorHistogramObserver(dtype=torch.int8)
    obs(x)
    pairs = torch.tensor([[-4.0, 4.0], [-2.0, 2.5], [-1.0, 1.0], [-3.0, 0.5]])
    predicted, scale, zp = obs._errors(pairs)
    for k in range(len(pairs)):
        fq = fake_quantize_affine(x, x.shape, scale[k], zp[k], torch.int8)
        actual = (fq - x).double().pow(2).sum()
        assert abs(predicted[k] / actual - 1) < 0.03, (k, predicted[k], actual)


def test_histogram_grows_its_range_and_keeps_every_count():
    obs = PerTensorHistogramObserver(bins=512)
    batches = [torch.randn(1000, generator=_gen(i)) * (1 + i) + i for i in range(4)]
    for x in batches:
        obs(x)
    everything = torch.cat(batches)
    assert float(obs.hist_min) == everything.min().item() and float(obs.hist_max) == everything.max().item()
    assert abs(obs.histogram.sum().item() - everything.numel()) < 1e-6
    # The merged histogram stays close to one built on all the data at once (mass moved by < 1 bin).
    direct = torch.histc(everything, 512, min=everything.min().item(), max=everything.max().item()).double()
    cdf_err = (obs.histogram.cumsum(0) - direct.cumsum(0)).abs().max().item()
    assert cdf_err < 0.01 * everything.numel()


def test_histogram_constant_input():
    obs = PerTensorHistogramObserver()
    obs(torch.full((10,), 3.0))
    scale, zp = obs.calculate_qparams()
    ref = choose_qparams_affine(torch.full((10,), 3.0), ASYM, (10,), torch.int8)
    assert torch.equal(scale, ref[0]) and torch.equal(zp, ref[1])
    obs(torch.tensor([-1.0, 5.0]))  # growing from a point mass
    assert obs.histogram.sum().item() == 12 and obs.calculate_qparams()[0].item() > 0


# --------------------------------------------------------------------------------------------------------
# Percentile and MSE observers


def test_percentile_sample_is_bounded_and_100_is_min_max():
    obs = PerTensorPercentileObserver(100.0, max_samples=1000)
    mm = PerTensorMinMaxObserver()
    for x in _batches((40, 50), n=3):
        obs(x)
        mm(x)
    assert obs.sample.numel() == 1000 and obs.sample_keys.numel() == 1000
    assert torch.equal(obs.calculate_qparams()[0], mm.calculate_qparams()[0])


def test_percentile_range_matches_the_distribution():
    obs = PerTensorPercentileObserver(99.0)
    symmetric = PerTensorPercentileObserver(99.0, mapping_type=SYM)
    for i in range(4):
        x = torch.rand(2**15, generator=_gen(i)) * 10 - 2  # uniform on [-2, 8]
        obs(x)
        symmetric(x)
    lo, hi = obs._range()
    assert abs(lo.item() - (-1.9)) < 0.05 and abs(hi.item() - 7.9) < 0.05  # the 1st / 99th percentiles
    lo, hi = symmetric._range()
    assert abs(hi.item() - 7.9) < 0.05 and lo.item() == -hi.item()


def test_mse_observer_picks_the_smallest_candidate_error():
    obs = PerTensorMSEObserver(num_candidates=50, dtype=torch.int4)
    x = torch.randn(5000, generator=_gen(7))
    obs(x)
    pairs, errors = obs.candidate_errors()
    assert pairs.shape == (50, 2) and errors.shape == (50,)
    assert torch.equal(pairs[-1], torch.stack([x.min(), x.max()]))  # the last candidate is min-max
    best = int(torch.argmin(errors))
    scale, zp = obs.calculate_qparams()
    ref = choose_qparams_affine(pairs[best:best + 1], ASYM, (1, 2), torch.int4)
    assert scale.shape == (1,) and torch.equal(scale, ref[0].flatten()) and torch.equal(zp, ref[1].flatten())
    assert best < 49  # 4-bit codes on Gaussian data: clipping pays


def test_mse_observer_float8():
    obs = PerTensorMSEObserver(dtype=torch.float8_e4m3fn, mapping_type=SYM, num_candidates=10)
    obs(torch.randn(64, 64))
    scale, zp = obs.calculate_qparams()
    assert zp is None and scale.shape == (1, 1) and scale.item() > 0


def _student_t3():
    torch.manual_seed(0)
    return [torch.distributions.StudentT(3.0).sample((65536,)) for _ in range(16)]


def _int8_mse(obs, batches, everything):
    for x in batches:
        obs(x)
    scale, zp = obs.calculate_qparams()
    fq = fake_quantize_affine(everything, everything.shape, scale, zp, obs.dtype,
                              zero_point_domain=obs.zero_point_domain)
    return (fq - everything).double().pow(2).mean().item()


@pytest.mark.parametrize(
    "mapping, bounds",
    [
        # measured ratio to min-max: percentile 0.457, MSE 0.257, histogram 0.256 (min-max MSE 0.170)
        (SYM, {"percentile": 0.6, "mse": 0.35, "histogram": 0.35}),
        # measured ratio to min-max: percentile 0.939, MSE 0.397, histogram 0.388 (min-max MSE 0.0970)
        (ASYM, {"percentile": 0.98, "mse": 0.5, "histogram": 0.5}),
    ],
)
def test_heavy_tails_clipping_observers_beat_min_max(mapping, bounds):
    # Student-t with 3 degrees of freedom, 16 batches of 65536 values (2**20 in all), int8 codes. Min-max
    # stretches the grid over tails of +-60 or more; clipping them costs less than the coarse grid costs the
    # bulk. (With far fewer values, or df = 2 whose clipping error has no finite mean, clipping rarely pays at
    # int8: on 16384 t(2) values we measured percentile(99.99) at 1.11x (symmetric) / 5.9x (asymmetric)
    # min-max's error and the MSE and histogram observers at 0.94-0.96x.)
    batches = _student_t3()
    everything = torch.cat(batches)
    base = _int8_mse(PerTensorMinMaxObserver(mapping_type=mapping), batches, everything)
    observers = {
        "percentile": PerTensorPercentileObserver(99.99, mapping_type=mapping),
        "mse": PerTensorMSEObserver(mapping_type=mapping),
        "histogram": PerTensorHistogramObserver(mapping_type=mapping),
    }
    ratios = {name: _int8_mse(obs, batches, everything) / base for name, obs in observers.items()}
    for name, bound in bounds.items():
        assert ratios[name] <= bound, ratios


def test_observer_base_is_exported():
    """The observers are the `affineq.observers` namespace (second tier of the API, issue #29)."""
    import affineq

    for name in ("Observer", "PerTensorMinMaxObserver", "PerChannelMinMaxObserver", "PerGroupMinMaxObserver",
                 "MovingAveragePerTensorMinMaxObserver", "MovingAveragePerChannelMinMaxObserver",
                 "PerTensorHistogramObserver", "PerTensorPercentileObserver", "PerTensorMSEObserver"):
        assert getattr(affineq.observers, name) is not None and name in affineq.observers.__all__
    assert issubclass(affineq.observers.PerTensorMSEObserver, Observer)
