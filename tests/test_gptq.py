"""GPTQ: lower layer-output error than round-to-nearest on the same inputs, exact packing of what GPTQ computed,
act-order, every base config, block-by-block on TinyLM, errors, save/load and all-or-nothing."""

import copy
import io

import pytest
import torch
from conftest import assert_unchanged, snapshot_model
from torch import nn

import affineq
from affineq.algorithms import GPTQConfig
from affineq.algorithms.gptq import Hessian, gptq_quantize
from affineq.configs import (
    Float8WeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
)
from affineq.granularity import PerAxis, PerGroup
from affineq.models import build_tiny_lm, calibration_batches
from affineq.models.evaluation import CALIBRATION_TOPIC_KEYS, EVAL_TOPIC_KEYS
from affineq.primitives import MappingType
from affineq.quantize import QuantizationError
from affineq.tensor.affine import AffineQuantizedTensor

K, N = 128, 64


def _correlated_inputs(t: int = 1024, k: int = K, seed: int = 0) -> torch.Tensor:
    """x [t, k] with strongly correlated channels of very different scales (as LLM activations are): a
    random mixing with singular values from 10 down to 0.01."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(k, k, generator=g))
    s = torch.logspace(1, -2, k)
    return torch.randn(t, k, generator=g) @ (u * s) @ torch.linalg.qr(torch.randn(k, k, generator=g))[0]


def _layer(seed: int = 1) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(K, N, bias=False)


def _output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x @ w.T - x @ q.T).norm())


def _gptq_vs_rtn(base, **kw) -> tuple[float, float, AffineQuantizedTensor, torch.Tensor]:
    layer, x = _layer(), _correlated_inputs()
    h = Hessian(K)
    h.add(x)
    w = layer.weight.detach()
    aqt, q = gptq_quantize(w, h.matrix(), base.weight_spec(w, layer), base.qparam_options(), **kw)
    rtn = base.quantize_weight(w, layer).dequantize()
    return _output_error(x, w, q), _output_error(x, w, rtn), aqt, q


# -- single layer -------------------------------------------------------------------------------------------


def test_single_layer_through_quantize_beats_rtn():
    """quantize_ on a one-layer model (no ModuleList: the whole model is one block): the output error on the
    calibration inputs is well below round-to-nearest's."""
    x = _correlated_inputs()
    model, rtn = nn.Sequential(_layer()), nn.Sequential(_layer())
    w = model[0].weight.detach().clone()
    affineq.quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=32), progress=False),
                      calibration_data=[x[:512], x[512:]])
    affineq.quantize_(rtn, Int4WeightOnlyConfig(group_size=32))
    assert isinstance(model[0].weight, AffineQuantizedTensor)
    e_gptq = _output_error(x, w, model[0].weight.dequantize())
    e_rtn = _output_error(x, w, rtn[0].weight.dequantize())
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("base", [
    Int4WeightOnlyConfig(group_size=32),
    Int4WeightOnlyConfig(group_size=64, packing_format="plain"),
    Int4WeightOnlyConfig(group_size=64, packing_format="int4_cpu"),
    Int4WeightOnlyConfig(group_size=128, scale_dtype=torch.float32),
    IntxWeightOnlyConfig(torch.int2, PerGroup(32), mapping_type=MappingType.ASYMMETRIC),
    IntxWeightOnlyConfig(torch.int3, PerGroup(64)),
    IntxWeightOnlyConfig(torch.int4, PerGroup(128), mapping_type=MappingType.ASYMMETRIC),
    IntxWeightOnlyConfig(torch.uint4, PerAxis(0)),
    IntxWeightOnlyConfig(torch.int5, PerGroup(32), scale_dtype=torch.float32),
    IntxWeightOnlyConfig(torch.int6, PerGroup(64), mapping_type=MappingType.ASYMMETRIC),
    IntxWeightOnlyConfig(torch.int8, PerGroup(32)),
    Int8WeightOnlyConfig(),
    Int8DynamicActivationInt4WeightConfig(group_size=32),
], ids=lambda b: f"{type(b).__name__}")
@pytest.mark.parametrize("act_order", [False, True])
def test_packed_tensor_is_exactly_gptq_result_and_beats_rtn(base, act_order):
    """The packed tensor dequantizes bit for bit to the weights GPTQ computed (the qparams are those the format
    stores), for every base config, with and without act-order; and GPTQ's output error is below RTN's."""
    e_gptq, e_rtn, aqt, q = _gptq_vs_rtn(base, act_order=act_order)
    assert torch.equal(aqt.dequantize(), q)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_act_order_uses_static_groups_and_keeps_the_layout():
    """With act-order the qparams of each group come from the original weights (static groups), so they are
    the same as with static_groups=True without act-order, and the group layout stays contiguous."""
    base = IntxWeightOnlyConfig(torch.int4, PerGroup(32))
    _, _, a, _ = _gptq_vs_rtn(base, act_order=True)
    _, _, s, _ = _gptq_vs_rtn(base, static_groups=True)
    rtn = base.quantize_weight(_layer().weight.detach(), _layer())
    assert torch.equal(a.scale, s.scale) and torch.equal(a.scale, rtn.scale)
    assert a.block_size == (1, 32)


def test_dead_columns_get_round_to_nearest_and_no_nan():
    """A column whose input is always zero (diag H = 0) is rounded to nearest, not zeroed."""
    base = IntxWeightOnlyConfig(torch.int8, PerAxis(0))
    layer, x = _layer(), _correlated_inputs()
    x[:, 3] = 0
    h = Hessian(K)
    h.add(x)
    w = layer.weight.detach()
    aqt, q = gptq_quantize(w, h.matrix(), base.weight_spec(w, layer), base.qparam_options())
    assert torch.isfinite(q).all()
    assert (q[:, 3] - w[:, 3]).abs().max() <= aqt.scale.float().max() / 2 + 1e-6
    assert q[:, 3].abs().sum() > 0


# -- a model, block by block ----------------------------------------------------------------------------------


def _anisotropic_tiny_lm() -> nn.Module:
    """TinyLM whose norm weights have a few large channels (the outlier channels of real LLMs), so the linears'
    inputs are far from isotropic: the case GPTQ is for."""
    model = build_tiny_lm(layers=2, dim=128, ffn=256, vocab=256)
    g = torch.Generator().manual_seed(3)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.RMSNorm) and name != "norm":
            mod.weight = nn.Parameter(torch.exp(torch.randn(128, generator=g) * 1.2))
    return model


def _is_block_linear(mod, fqn):
    return isinstance(mod, nn.Linear) and fqn.startswith("layers.")


@pytest.mark.parametrize("true_sequential, act_order", [(True, True), (False, False)])
def test_tiny_lm_block_by_block_beats_rtn(true_sequential, act_order):
    model = _anisotropic_tiny_lm()
    data = calibration_batches(None, n=8, seq_len=64, vocab=256)
    test = torch.cat(calibration_batches(None, n=12, seq_len=64, vocab=256)[8:])
    with torch.no_grad():
        ref = model(test)
    rtn, gptq = copy.deepcopy(model), copy.deepcopy(model)
    base = Int4WeightOnlyConfig(group_size=32)
    affineq.quantize_(rtn, base, filter_fn=_is_block_linear)
    affineq.quantize_(gptq, GPTQConfig(base, progress=False, true_sequential=true_sequential, act_order=act_order),
                      filter_fn=_is_block_linear, calibration_data=data)
    assert all(isinstance(m.weight, AffineQuantizedTensor) for f, m in gptq.named_modules()
               if _is_block_linear(m, f))
    assert not isinstance(gptq.lm_head.weight, AffineQuantizedTensor)
    with torch.no_grad():
        mse_rtn = float((rtn(test) - ref).pow(2).mean())
        mse_gptq = float((gptq(test) - ref).pow(2).mean())
    assert mse_gptq < 0.7 * mse_rtn, (mse_gptq, mse_rtn)


def test_linears_outside_the_blocks_and_8da4w_and_save_load():
    """lm_head (outside the ModuleList) is quantized by the final whole-model pass; 8da4w works end to end; the
    result saves and loads with weights_only=True and computes the same outputs."""
    model = _anisotropic_tiny_lm()
    data = calibration_batches(None, n=4, seq_len=32, vocab=256)
    affineq.quantize_(model, GPTQConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), progress=False),
                      filter_fn=lambda m, f: isinstance(m, nn.Linear), calibration_data=data)
    assert isinstance(model.lm_head.weight, AffineQuantizedTensor)
    assert model.layers[0].mlp.down_proj.weight.act_quant is not None
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = build_tiny_lm(layers=2, dim=128, ffn=256, vocab=256)
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    x = data[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


# -- errors and all-or-nothing --------------------------------------------------------------------------------


def test_no_calibration_data_is_a_clear_error():
    model = nn.Sequential(_layer())
    snap = snapshot_model(model)
    with pytest.raises(QuantizationError, match="GPTQConfig needs calibration data"):
        affineq.quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=32)))
    assert_unchanged(model, snap)


@pytest.mark.parametrize("kwargs, match", [
    ({"blocksize": 0}, "blocksize"),
    ({"blocksize": 1.5}, "blocksize"),
    ({"percdamp": 0.0}, "percdamp"),
    ({"percdamp": 2.0}, "percdamp"),
    ({"percdamp": float("nan")}, "percdamp"),
    ({"act_order": 1}, "act_order"),
    ({"true_sequential": "yes"}, "true_sequential"),
    ({"static_groups": "auto"}, "static_groups"),
    ({"act_order": True, "static_groups": False}, "static_groups=True or None"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTQConfig(Int4WeightOnlyConfig(group_size=32), **kwargs)


def test_bad_base_configs():
    with pytest.raises(ValueError, match="cannot wrap Float8WeightOnlyConfig"):
        GPTQConfig(Float8WeightOnlyConfig())
    with pytest.raises(ValueError, match="call it"):
        GPTQConfig(Int4WeightOnlyConfig)


def test_config_round_trips_through_json():
    cfg = GPTQConfig(IntxWeightOnlyConfig(torch.int3, PerGroup(64)), act_order=True, percdamp=0.05)
    assert affineq.configs.config_from_dict(cfg.to_dict()) == cfg


def test_model_unchanged_when_gptq_fails_midway(monkeypatch):
    """A failure after some linears were quantized and swapped in leaves every Parameter as it was."""
    model = _anisotropic_tiny_lm()
    snap = snapshot_model(model)
    calls = []
    real = GPTQConfig.quantize_layer

    def failing(self, layer, h):
        calls.append(layer)
        if len(calls) == 5:
            raise RuntimeError("boom")
        return real(self, layer, h)

    monkeypatch.setattr(GPTQConfig, "quantize_layer", failing)
    with pytest.raises(QuantizationError, match="boom"):
        affineq.quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=32), progress=False),
                          filter_fn=_is_block_linear, calibration_data=calibration_batches(None, 2, 32, vocab=256))
    assert len(calls) == 5
    assert_unchanged(model, snap)


def test_bad_calibration_items_leave_the_model_unchanged():
    model = _anisotropic_tiny_lm()
    snap = snapshot_model(model)
    with pytest.raises(QuantizationError, match="calibration item 0 is a str"):
        affineq.quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=32), progress=False),
                          filter_fn=_is_block_linear, calibration_data=["not tokens"])
    assert_unchanged(model, snap)


def test_calibration_text_is_disjoint_and_batches_are_fixed():
    assert not set(CALIBRATION_TOPIC_KEYS) & set(EVAL_TOPIC_KEYS)
    a = calibration_batches(None, n=3, seq_len=16, vocab=256)
    b = calibration_batches(None, n=3, seq_len=16, vocab=256, as_dict=True)
    assert [t.shape for t in a] == [(1, 16)] * 3
    assert all(torch.equal(x, y["input_ids"]) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], a[1])
    with pytest.raises(ValueError, match="fewer than"):
        calibration_batches(None, n=10**6, seq_len=512, vocab=256)
    with pytest.raises(ValueError, match="vocab"):
        calibration_batches(None)


def test_captured_kv_caches_are_dropped():
    """A decoder layer handed a key/value cache (HF passes a DynamicCache) would append to it on every re-run
    of the block; the captured inputs carry None and use_cache=False instead."""
    from affineq.algorithms._capture import capture_inputs, run_block

    class Cache:  # duck-typed transformers Cache
        def __init__(self):
            self.seen = 0

        def update(self, k):
            self.seen += 1
            return k

        def get_seq_length(self):
            return self.seen

    class Layer(nn.Module):
        def forward(self, x, past_key_values=None, use_cache=False):
            return x + (past_key_values.update(x) if past_key_values is not None else 0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

        def forward(self, x):
            return self.layers[0](x, past_key_values=Cache(), use_cache=True)

    model = Model()
    inputs = capture_inputs(model, model.layers[0], [torch.ones(2)])
    assert inputs[0][1] == {"past_key_values": None, "use_cache": False}
    assert torch.equal(run_block(model.layers[0], inputs)[0][0][0], torch.ones(2))


@pytest.mark.parametrize("base", [Int4WeightOnlyConfig(group_size=32),
                                  IntxWeightOnlyConfig(torch.int3, PerGroup(32), MappingType.ASYMMETRIC)])
def test_clip_search_lowers_each_groups_error_and_stays_exact(base):
    # heavy-tailed weights: a shrunk range trades a few clipped outliers for a finer step everywhere else
    from affineq.algorithms.gptq import _GroupQParams

    layer, x = _layer(), _correlated_inputs()
    torch.manual_seed(3)
    with torch.no_grad():
        layer.weight.copy_(torch.distributions.StudentT(3.0).sample((N, K)) * 0.05)
    w = layer.weight.detach()
    spec, opts = base.weight_spec(w, layer), base.qparam_options()
    group = w[:, :32]
    plain, searched = _GroupQParams(spec, opts, N), _GroupQParams(spec, opts, N, clip_search=True)
    e_plain, e_search = plain._error(group, plain.choose(group)), searched._error(group, searched.choose(group))
    assert bool((e_search <= e_plain).all()) and float(e_search.sum()) < 0.98 * float(e_plain.sum())
    h = Hessian(K)
    h.add(x)
    aqt, q = gptq_quantize(w, h.matrix(), spec, opts, act_order=True, static_groups=True, clip_search=True)
    ref, _ = gptq_quantize(w, h.matrix(), spec, opts, act_order=True, static_groups=True)
    assert torch.equal(aqt.dequantize(), q)
    assert bool((aqt.scale <= ref.scale * (1 + 1e-6)).all()) and bool((aqt.scale < ref.scale).any())


def test_fqn_to_config_mixes_gptq_with_plain_configs_and_float_layers():
    model = _anisotropic_tiny_lm()
    data = calibration_batches(None, n=4, seq_len=32, vocab=256)
    gptq = GPTQConfig(Int4WeightOnlyConfig(group_size=32), progress=False)
    cfg = affineq.FqnToConfig({"re:layers\\.0\\..*": gptq, "layers.1.mlp.down_proj": None,
                               "re:layers\\.1\\..*": Int8WeightOnlyConfig(), "lm_head": None})
    affineq.quantize_(model, cfg, calibration_data=data)
    mods = dict(model.named_modules())
    assert mods["layers.0.self_attn.q_proj"].weight.target_dtype == torch.uint4
    assert mods["layers.1.self_attn.q_proj"].weight.target_dtype == torch.int8
    assert not isinstance(mods["layers.1.mlp.down_proj"].weight, AffineQuantizedTensor)
    assert not isinstance(model.lm_head.weight, AffineQuantizedTensor)
    # GPTQ's layers are not round-to-nearest: some codes differ from what the base config alone gives
    q = mods["layers.0.mlp.down_proj"]
    assert not torch.equal(q.weight.dequantize(), Int4WeightOnlyConfig(group_size=32).quantize_weight(
        _anisotropic_tiny_lm().layers[0].mlp.down_proj.weight.detach(), q).dequantize())


class _BNBlocks(nn.Module):
    """BatchNorm before and inside ModuleList blocks: GPTQ's block path (capture_inputs, run_block)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64))
                                    for _ in range(2))

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("blocks", [False, True])
def test_gptq_calibrates_in_eval_mode_and_keeps_batchnorm_statistics(blocks):
    torch.manual_seed(0)
    model = _BNBlocks() if blocks else nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64))
    modes = [m.training for m in model.modules()]  # training mode, as the user left it
    assert all(modes)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 64, generator=g) for _ in range(3)]
    cfg = GPTQConfig(Int4WeightOnlyConfig(group_size=32), progress=False)
    before = snapshot_model(model)
    with pytest.raises(QuantizationError, match="left unchanged"):
        affineq.quantize_(model, cfg, calibration_data=[*data, torch.randn(8, 65, generator=g)])
    assert_unchanged(model, before)  # running_mean / running_var / num_batches_tracked included
    assert [m.training for m in model.modules()] == modes
    affineq.quantize_(model, cfg, calibration_data=data)
    assert any("running_mean" in n for n in before["buffers"])
    for name, (_, value) in before["buffers"].items():
        assert torch.equal(model.get_buffer(name), value), name
    assert [m.training for m in model.modules()] == modes
