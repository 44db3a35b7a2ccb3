"""AWQ: output error below round-to-nearest on layers with outlier input channels (int4 and int3, folded and
pre-scaled), the search's fake quantization equals the stored tensor, end to end on TinyLM, errors,
save/load."""

import copy
import io

import pytest
import torch
from conftest import outlier_tiny_lm
from torch import nn

import affineq
from affineq.algorithms import AWQConfig
from affineq.algorithms.awq import fake_quant, qparams
from affineq.primitives import MappingType
from affineq.quantize import QuantizationError

INT4 = affineq.Int4WeightOnlyConfig(group_size=64)
INT3 = affineq.IntxWeightOnlyConfig(weight_dtype=torch.int3, granularity=affineq.PerGroup(64),
                                    mapping_type=MappingType.ASYMMETRIC)


def _outlier_inputs(n, seed, d=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, d, generator=g)
    x[..., :8] *= 25.0  # a few input channels carry large activations
    return x


class _NormLinear(nn.Module):
    """An RMSNorm (outlier channels in its weight) feeding one linear: the fold path."""

    def __init__(self, d=256, out=256):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.proj = nn.Linear(d, out, bias=False)
        with torch.no_grad():
            self.norm.weight[:8] = 25.0

    def forward(self, x):
        return self.proj(self.norm(x))


def _single_linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256)).eval()


def _rel(ref, out):
    return float((out - ref).detach().norm() / ref.detach().norm())


def _only_linears(module, fqn):
    return isinstance(module, nn.Linear) and "lm_head" not in fqn


@pytest.mark.parametrize("make", [_single_linear, _NormLinear], ids=["prescale", "fold"])
@pytest.mark.parametrize("base, bound", [(INT4, 0.85), (INT3, 0.9)], ids=["int4", "int3"])
def test_awq_beats_round_to_nearest_on_outlier_channels(make, base, bound):
    torch.manual_seed(0)
    model = make().eval()
    calib = [_outlier_inputs(2, i) for i in range(4)]
    x = _outlier_inputs(4, 99)
    ref = model(x)
    rtn = affineq.quantize_(copy.deepcopy(model), base, filter_fn=_only_linears)
    awq = affineq.quantize_(copy.deepcopy(model), AWQConfig(base, progress=False), filter_fn=_only_linears,
                            calibration_data=calib)
    w = next(m for m in awq.modules() if isinstance(m, nn.Linear)).weight
    assert ("act_pre_scale" in w.act_tensors) == (make is _single_linear)  # no producer: pre-scale
    # measured ratios: int4 0.71 (fold) / 0.76 (pre-scale), int3 0.79 / 0.82; alpha = 0 (RTN) would give 1
    assert _rel(ref, awq(x)) < bound * _rel(ref, rtn(x))


def test_awq_end_to_end_on_tiny_lm_folds_and_beats_rtn():
    model = outlier_tiny_lm()
    calib = [torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(9))
    ref = model(x)
    base = affineq.Int4WeightOnlyConfig(group_size=32)
    rtn = affineq.quantize_(copy.deepcopy(model), base, filter_fn=_only_linears)
    awq = affineq.quantize_(copy.deepcopy(model), AWQConfig(base, n_grid=10, progress=False),
                            filter_fn=_only_linears, calibration_data=calib)
    linears = [m for n, m in awq.named_modules() if _only_linears(m, n)]
    assert len(linears) == 14 and not any("act_pre_scale" in m.weight.act_tensors for m in linears)  # all folded
    assert _rel(ref, awq(x)) < 0.9 * _rel(ref, rtn(x))


@pytest.mark.parametrize("base", [INT4, INT3, affineq.Int8WeightOnlyConfig(),
                                  affineq.Int8DynamicActivationInt4WeightConfig(group_size=32)],
                         ids=["int4", "int3", "int8", "8da4w"])
def test_search_fake_quant_is_the_stored_dequantization(base):
    lin = nn.Linear(128, 64)
    w = lin.weight.detach()
    spec, opts = base.weight_spec(w, lin), base.qparam_options()
    ratio = torch.full((64, 128 // spec.block_size[-1]), 0.8)
    for r in (None, ratio):
        scale, zp = qparams(w, spec, opts, r)
        stored = affineq.AffineQuantizedTensor.from_qparams(w, scale, zp, spec).dequantize()
        assert torch.equal(fake_quant(w, spec, opts, r), stored)


def test_other_bases_and_options_run_and_do_not_lose_to_rtn():
    torch.manual_seed(0)
    model = _NormLinear(d=128, out=64).eval()
    calib = [_outlier_inputs(2, i, 128) for i in range(2)]
    x = _outlier_inputs(2, 99, 128)
    ref = model(x)
    for base, kw in ((affineq.Int8WeightOnlyConfig(), {}),
                     (affineq.Int8DynamicActivationInt4WeightConfig(group_size=32), {}),
                     (INT4, {"duo_scaling": False, "clip": False, "n_grid": 5})):
        rtn = affineq.quantize_(copy.deepcopy(model), base, filter_fn=_only_linears)
        awq = affineq.quantize_(copy.deepcopy(model), AWQConfig(base, progress=False, **kw),
                                filter_fn=_only_linears, calibration_data=calib)
        assert _rel(ref, awq(x)) <= 1.01 * _rel(ref, rtn(x)), type(base).__name__


def test_save_load_weights_only_with_a_pre_scale():
    model = _single_linear()
    q = affineq.quantize_(copy.deepcopy(model), AWQConfig(INT4, progress=False), filter_fn=_only_linears,
                          calibration_data=[_outlier_inputs(2, 0)])
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    fresh = copy.deepcopy(model).requires_grad_(False)
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    x = _outlier_inputs(1, 5)
    assert "act_pre_scale" in fresh[0].weight.act_tensors
    assert torch.equal(fresh(x), q(x))


def test_errors():
    model = _single_linear()
    before = model[0].weight.detach().clone()
    with pytest.raises(QuantizationError, match="AWQConfig needs calibration data"):
        affineq.quantize_(model, AWQConfig(INT4), filter_fn=_only_linears)
    assert isinstance(model[0].weight, nn.Parameter) and torch.equal(model[0].weight, before)
    with pytest.raises(ValueError, match="cannot wrap Int8DynamicActivationInt8WeightConfig"):
        AWQConfig(affineq.Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(ValueError, match="n_grid"):
        AWQConfig(INT4, n_grid=0)
    with pytest.raises(ValueError, match="max_shrink"):
        AWQConfig(INT4, max_shrink=1.0)
    with pytest.raises(ValueError, match="clip"):
        AWQConfig(INT4, clip="yes")
