"""affineq.autoquant: per-layer precision under a bits-per-weight budget (output-error sensitivity, in model units
by a measured KLD / relative MSE, a multiple-choice knapsack), returned as an FqnToConfig."""

import copy
import functools
import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from affineq.algorithms import AWQConfig, GPTQConfig
from affineq.algorithms.gptq import gptq_quantize
from affineq.autoquant import LayerChoice, _knapsack, autoquant
from affineq.configs import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
from affineq.granularity import PerGroup
from affineq.models import build_tiny_lm
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.quantize import FqnToConfig, quantize_, quantized_weights

ASYM = MappingType.ASYMMETRIC
CANDIDATES = (IntxWeightOnlyConfig(torch.int2, PerGroup(32), ASYM, ZeroPointDomain.FLOAT),  # 3 bpw
              Int4WeightOnlyConfig(group_size=32),  # 5 bpw
              Int8WeightOnlyConfig())  # 8.25 - 8.5 bpw (fp32 scale per row)
DATA = [torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]


@functools.cache
def tiny():
    return build_tiny_lm(vocab=96, dim=64, layers=2, heads=2, ffn=128)


@functools.cache
def measured():
    report: list[LayerChoice] = []
    autoquant(tiny(), 16.0, DATA, candidates=CANDIDATES, progress=False, report=report, sensitivity="layer")
    return report


def plan_bits(plan: FqnToConfig) -> tuple[int, int]:
    """(stored bits, weights) of the tiny model quantized with `plan`."""
    q = quantize_(copy.deepcopy(tiny()), plan)
    qw = quantized_weights(q)
    return sum(w.storage_bytes() * 8 for w in qw.values()), sum(w.numel() for w in qw.values())


@pytest.mark.parametrize("budget", [3.2, 5.5])
def test_budget_is_respected(budget):
    report = []
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = autoquant(model, budget, DATA, candidates=CANDIDATES, progress=False, report=report)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # model unchanged
    bits, n = plan_bits(plan)
    assert bits <= budget * n
    assert bits > (budget - 0.6) * n  # and uses it: the step between candidates is ~2 bits on one layer of 14
    assert set(plan.fqn_to_config) == {c.fqn for c in report} and "lm_head" not in plan.fqn_to_config
    # the plan's bits are those autoquant counted
    idx = {c.fqn: CANDIDATES.index(plan.fqn_to_config[c.fqn]) for c in report}
    assert bits == sum(c.bits[idx[c.fqn]] for c in report)


def test_a_budget_fitting_the_largest_picks_it_everywhere():
    exact = sum(c.bits[2] for c in measured()) / sum(c.numel for c in measured())  # int8 everywhere: 8.5-9 bpw
    plan = autoquant(tiny(), exact, DATA, candidates=CANDIDATES, progress=False)
    assert set(plan.fqn_to_config.values()) == {Int8WeightOnlyConfig()}
    # loss falls with bits on every layer of this model (what makes the largest the best)
    for c in measured():
        assert c.loss[0] > c.loss[1] > c.loss[2] >= 0


def test_too_small_budget_and_bad_arguments():
    with pytest.raises(ValueError, match="below the smallest plan the candidates allow"):
        autoquant(tiny(), 2.9, DATA, candidates=CANDIDATES, progress=False)
    for bad, match in ((dict(budget_bits=0), "budget_bits=0"), (dict(candidates=()), "candidates is empty"),
                       (dict(candidates=(Int8WeightOnlyConfig(), Int8WeightOnlyConfig())), "same config twice"),
                       (dict(candidates=(AWQConfig(Int4WeightOnlyConfig()),)), "must be a weight config"),
                       (dict(candidates=(Int4WeightOnlyConfig(group_size=256),)), "no candidate can quantize"),
                       (dict(calibration_data=[]), "calibration_data is empty"),
                       (dict(filter_fn=lambda m, f: False), "no nn.Linear selected")):
        kw = dict(budget_bits=4.0, calibration_data=DATA, candidates=CANDIDATES, progress=False) | bad
        with pytest.raises(ValueError, match=match):
            autoquant(tiny(), **kw)


def test_json_round_trip_applies_the_same_plan():
    plan = autoquant(tiny(), 4.0, DATA, candidates=CANDIDATES, progress=False)
    back = FqnToConfig.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    a = quantized_weights(quantize_(copy.deepcopy(tiny()), plan))
    b = quantized_weights(quantize_(copy.deepcopy(tiny()), back))
    assert a.keys() == b.keys() and all(torch.equal(a[k].dequantize(), b[k].dequantize()) for k in a)


def test_calibration_free_algorithms_are_candidates():
    from affineq.algorithms import HQQConfig, ImportanceWeightedConfig, collect_importance

    imp = collect_importance(tiny(), DATA, progress_bar=False)
    base = Int4WeightOnlyConfig(group_size=32)
    cands = (CANDIDATES[0], base, HQQConfig(base, progress=False),
             ImportanceWeightedConfig(base, importance=imp, progress=False))
    report = []
    plan = autoquant(tiny(), 4.5, DATA, candidates=cands, progress=False, report=report)
    for c in report:  # the algorithms store the base config's format: the same bits
        assert c.bits[1] == c.bits[2] == c.bits[3]
    bits, n = plan_bits(plan)
    assert bits <= 4.5 * n
    assert any(isinstance(v, (HQQConfig, ImportanceWeightedConfig)) for v in plan.fqn_to_config.values())


def test_a_candidate_that_cannot_take_a_layer_is_no_choice_there():
    # group 128 divides only down_proj's 128 columns (the others have 64)
    cands = (CANDIDATES[0], Int4WeightOnlyConfig(group_size=128))
    report = []
    plan = autoquant(tiny(), 16.0, DATA, candidates=cands, progress=False, report=report)
    for c in report:
        assert (c.bits[1] is None) == (not c.fqn.endswith("down_proj")), c.fqn
        assert plan.fqn_to_config[c.fqn] == cands[1 if c.fqn.endswith("down_proj") else 0]


def _layer_inputs(model, layer) -> torch.Tensor:
    """The rows [T, in_features] `layer` receives over DATA, in float64."""
    xs = []
    handle = layer.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for item in DATA:
            model(item)
    handle.remove()
    return torch.cat(xs).double()


def test_loss_is_the_layer_output_error():
    model, fqn = tiny(), "layers.1.mlp.down_proj"
    layer = model.get_submodule(fqn)
    x = _layer_inputs(model, layer)
    c = next(c for c in measured() if c.fqn == fqn)
    for cand, loss in zip(CANDIDATES, c.loss, strict=True):
        w = layer.weight.detach()
        d = w.double() - cand.quantize_weight(w, layer).dequantize(torch.float64)
        want = float((x @ d.T).pow(2).sum(1).mean())
        assert loss == pytest.approx(want, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(st.lists(st.tuples(st.integers(1, 40), st.floats(0, 10)), min_size=1, max_size=3),
                       min_size=1, max_size=4),
       slack=st.floats(0, 1), resolution=st.sampled_from([16, 64, 1024]))
def test_knapsack_against_brute_force(layers, slack, resolution):
    choices = [LayerChoice(f"l{i}", 1, tuple(b for b, _ in opts), tuple(x for _, x in opts))
               for i, opts in enumerate(layers)]
    low = sum(min(c.bits) for c in choices)
    high = sum(max(c.bits) for c in choices)
    capacity = low + slack * (high - low)
    picks = _knapsack(choices, capacity / len(choices), resolution)
    bits = sum(c.bits[i] for c, i in zip(choices, picks, strict=True))
    loss = sum(c.loss[i] for c, i in zip(choices, picks, strict=True))
    assert bits <= capacity + 1e-9
    # at least as good as the best plan under the budget less one step per layer (the round-up's cost)
    step = (capacity - low) / resolution
    best = min((sum(c.loss[i] for c, i in zip(choices, p, strict=True))
                for p in itertools.product(*(range(len(c.bits)) for c in choices))
                if sum(c.bits[i] for c, i in zip(choices, p, strict=True)) <= capacity - len(choices) * step),
               default=None)
    if best is not None:
        assert loss <= best + 1e-9


def test_layer_choice_bits_match_the_stored_tensors():
    model = tiny()
    for c in measured():
        layer = model.get_submodule(c.fqn)
        for cand, bits in zip(CANDIDATES, c.bits, strict=True):
            assert bits == cand.quantize_weight(layer.weight.detach(), layer).storage_bytes() * 8


class Amplified(torch.nn.Module):
    """y = head(10 * a(x) + 0.1 * b(x)), b's weight a row permutation of a's: the same output error alone
    (trace(D H D^T) is invariant under permuting D's rows), but a's reaches y 100x larger than b's."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(64, 64, bias=False)
        self.b = torch.nn.Linear(64, 64, bias=False)
        self.head = torch.nn.Linear(64, 48, bias=False)
        with torch.no_grad():
            w = torch.randn(64, 64, generator=g) * 0.1
            self.a.weight.copy_(w)
            self.b.weight.copy_(w.flip(0))
            self.head.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(10 * self.a(x) + 0.1 * self.b(x))


AMP_DATA = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _kld(ref: torch.Tensor, out: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(out.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("sensitivity", ["kld", "mse", "fisher"])
def test_model_sensitivity_weighs_a_layer_by_its_effect_on_the_output(sensitivity):
    model = Amplified()
    keep = lambda m, fqn: fqn in ("a", "b")  # noqa: E731
    local, scaled = [], []
    autoquant(model, 16.0, AMP_DATA, candidates=CANDIDATES, filter_fn=keep, progress=False, report=local,
              sensitivity="layer")
    # layer-local losses tie (to rounding), so the layer rule cannot tell a from b
    la, lb = (c.loss for c in local)
    assert all(abs(x - y) <= 1e-6 * max(x, y) for x, y in zip(la, lb, strict=True))
    # room for exactly one layer at 8 bits and the other at 2 (the bits autoquant counted)
    budget = (local[0].bits[2] + local[1].bits[0]) / (local[0].numel + local[1].numel)
    plan = autoquant(model, budget, AMP_DATA, candidates=CANDIDATES, filter_fn=keep, progress=False, report=scaled,
                     sensitivity=sensitivity)
    assert plan.fqn_to_config["a"] is CANDIDATES[2] and plan.fqn_to_config["b"] is CANDIDATES[0]
    sa, sb = (c.loss for c in scaled)
    assert all(x > 100 * y for x, y in zip(sa, sb, strict=True))
    # the smallest candidate's scaled loss is the divergence measured with the real quantized layer alone (the
    # Fisher estimate of the relative MSE, from one random projection of 2 x 16 rows of 48 outputs: within 25%)
    for c in scaled:
        q = quantize_(copy.deepcopy(model), FqnToConfig({c.fqn: CANDIDATES[0]}))
        with torch.no_grad():
            divs = [(_kld(model(x), q(x)) if sensitivity == "kld" else
                     float(((q(x) - model(x)).double() ** 2).sum() / (model(x).double() ** 2).sum()))
                    for x in AMP_DATA]
        assert c.loss[0] == pytest.approx(sum(divs) / len(divs), rel=0.25 if sensitivity == "fisher" else 1e-3)


def test_fisher_orders_layers_as_the_measured_divergence_and_leaves_the_model_alone():
    model, measured_kld, fisher = tiny(), [], []
    autoquant(model, 16.0, DATA, candidates=CANDIDATES, progress=False, report=measured_kld, sensitivity="kld")
    flags = [p.requires_grad for p in model.parameters()]
    autoquant(model, 16.0, DATA, candidates=CANDIDATES, progress=False, report=fisher, sensitivity="fisher")
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    # the layers' losses span ~4 decades (q/k far below v/o); the Fisher proxy drops the cross-token terms, so its
    # scale differs (here 50-100x), but per layer within a factor 2 of one common scale
    ratio = torch.tensor([m.loss[0] / f.loss[0] for m, f in zip(measured_kld, fisher, strict=True)])
    assert float(ratio.max() / ratio.min()) < 2.0
    spread = max(m.loss[0] for m in measured_kld) / min(m.loss[0] for m in measured_kld)
    assert spread > 1000


def test_sensitivity_is_checked():
    with pytest.raises(ValueError, match="sensitivity='hessian' must be 'fisher'"):
        autoquant(tiny(), 4.0, DATA, candidates=CANDIDATES, progress=False, sensitivity="hessian")
    with pytest.raises(ValueError, match="sensitivity_items=0 must be an int >= 1"):
        autoquant(tiny(), 4.0, DATA, candidates=CANDIDATES, progress=False, sensitivity_items=0)


def test_replayed_blocks_give_the_divergence_of_a_full_forward():
    # the sensitivity pass runs only the blocks from the layer's on (the earlier ones replay cached outputs);
    # its scaled loss at the smallest candidate must be the KLD of a whole forward with that layer alone quantized
    model, scaled = tiny(), []
    autoquant(model, 16.0, DATA, candidates=CANDIDATES, progress=False, report=scaled, sensitivity="kld")
    assert any(c.fqn.startswith("layers.1.") for c in scaled)  # a layer whose block 0 is replayed
    for c in scaled:
        q = quantize_(copy.deepcopy(model), FqnToConfig({c.fqn: CANDIDATES[0]}))
        with torch.no_grad():
            divs = [_kld(model(x), q(x)) for x in DATA]
        assert c.loss[0] == pytest.approx(sum(divs) / len(divs), rel=1e-3), c.fqn


def test_importance_comes_from_the_calibration_data_when_not_given():
    from affineq.algorithms import ImportanceWeightedConfig, collect_importance

    base = Int4WeightOnlyConfig(group_size=32)
    imp = collect_importance(tiny(), DATA, progress_bar=False)  # the same matrix, from its own pass
    given, filled = [], []
    autoquant(tiny(), 4.5, DATA, candidates=(CANDIDATES[0], ImportanceWeightedConfig(base, importance=imp,
              progress=False)), progress=False, report=given, sensitivity="layer")
    plan = autoquant(tiny(), 4.5, DATA, candidates=(CANDIDATES[0], ImportanceWeightedConfig(base, progress=False)),
                     progress=False, report=filled, sensitivity="layer")
    for a, b in zip(given, filled, strict=True):
        assert a.bits == b.bits and a.loss == pytest.approx(b.loss, rel=1e-4)
    # the plan holds the filled-in matrix (it applies without calibration data) and fits the budget
    weighted = [v for v in plan.fqn_to_config.values() if isinstance(v, ImportanceWeightedConfig)]
    assert weighted and all(v.importance is not None for v in weighted)
    bits, n = plan_bits(plan)
    assert bits <= 4.5 * n


def test_several_budgets_share_one_measurement():
    plans = autoquant(tiny(), [3.2, 5.5], DATA, candidates=CANDIDATES, progress=False)
    assert plans == [autoquant(tiny(), b, DATA, candidates=CANDIDATES, progress=False) for b in (3.2, 5.5)]
    with pytest.raises(ValueError, match="budget_bits=-1"):
        autoquant(tiny(), [4.0, -1], DATA, candidates=CANDIDATES, progress=False)


def test_gptq_candidates_are_measured_on_the_float_inputs_and_apply_with_calibration_data():
    base = CANDIDATES[0]  # int2 g32: where GPTQ's error feedback matters most
    gptq = GPTQConfig(base, progress=False)
    cands = (base, gptq, CANDIDATES[1])
    report = []
    model = tiny()
    plan = autoquant(model, 4.0, DATA, candidates=cands, progress=False, report=report, sensitivity="layer")
    # the loss of the GPTQ candidate is trace(D H D^T) of GPTQ run on the layer alone with H = 2 X^T X / T of the
    # float model's inputs (X: the rows it receives), as gptq_quantize computes it independently here
    fqn = "layers.1.mlp.down_proj"
    layer = model.get_submodule(fqn)
    x = _layer_inputs(model, layer)
    w = layer.weight.detach()
    aqt, _ = gptq_quantize(w, 2 * x.T @ x / x.shape[0], base.weight_spec(w, layer), base.qparam_options(),
                           act_order=True, static_groups=True, clip_search=True)
    d = w.double() - aqt.dequantize(torch.float64)
    c = next(c for c in report if c.fqn == fqn)
    assert c.loss[1] == pytest.approx(float((x @ d.T).pow(2).sum(1).mean()), rel=1e-5)
    # same format, same bits; GPTQ's error below round-to-nearest's on every layer (what it minimises)
    for c in report:
        assert c.bits[1] == c.bits[0] and c.loss[1] < c.loss[0], c.fqn
    assert gptq in plan.fqn_to_config.values()
    # the plan applies with calibration data (GPTQ then runs block by block on its layers) within the budget
    q = quantize_(copy.deepcopy(model), plan, calibration_data=DATA)
    qw = quantized_weights(q)
    assert sum(v.storage_bytes() * 8 for v in qw.values()) <= 4.0 * sum(v.numel() for v in qw.values())
    assert FqnToConfig.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # the measured sensitivity applies a layer's smallest candidate without data: a plain one, not GPTQ
    with pytest.raises(ValueError, match="only GPTQConfig candidates can quantize"):
        autoquant(model, 4.0, DATA, candidates=(gptq,), progress=False, sensitivity="kld")
    scaled = []
    autoquant(model, 4.0, DATA, candidates=cands, progress=False, report=scaled, sensitivity="kld")
    assert all(s.loss[1] < s.loss[0] for s in scaled)


def test_default_candidates_step_int3_between_3_and_4_bits():
    from affineq.algorithms import ImportanceWeightedConfig
    from affineq.autoquant import DEFAULT_CANDIDATES, FAST_RATIOS

    int3 = [c for c in DEFAULT_CANDIDATES if isinstance(c, IntxWeightOnlyConfig) and c.weight_dtype == torch.int3]
    assert sorted(c.granularity.group_size for c in int3) == [32, 64, 96, 128, 192]
    weighted = [c for c in DEFAULT_CANDIDATES if isinstance(c, ImportanceWeightedConfig)]
    assert all(c.importance is None and c.ratios == FAST_RATIOS for c in weighted)
    # every plain candidate below 5 bits has an importance-weighted twin (int4 g32 and up: plain only)
    assert {c.base_config for c in weighted} == {c for c in DEFAULT_CANDIDATES if not isinstance(
        c, ImportanceWeightedConfig) and (c in int3 or getattr(c, "weight_dtype", None) == torch.int2 or (
            isinstance(c, Int4WeightOnlyConfig) and c.group_size > 32))}
    assert len(set(DEFAULT_CANDIDATES)) == len(DEFAULT_CANDIDATES)
    # on the tiny model (widths 64 and 128) a group that does not divide the width is no choice; the others store
    # 3 bits a weight plus 32 bits (bf16 scale and zero point) a group
    report = []
    plan = autoquant(tiny(), 3.5, DATA, progress=False, report=report)
    for c in report:
        k = tiny().get_submodule(c.fqn).in_features
        for cand, bits in zip(DEFAULT_CANDIDATES, c.bits, strict=True):
            if cand in int3:
                g = cand.granularity.group_size
                assert bits == (None if k % g else c.numel * 3 + c.numel // g * 32), (c.fqn, g)
    bits, n = plan_bits(plan)
    assert 3.3 * n < bits <= 3.5 * n


def test_gptq_true_wraps_the_chosen_configs_in_gptq():
    from affineq.algorithms import ImportanceWeightedConfig

    cands = (CANDIDATES[0], ImportanceWeightedConfig(CANDIDATES[1], progress=False), CANDIDATES[2])
    plain = autoquant(tiny(), 4.0, DATA, candidates=cands, progress=False, sensitivity="layer")
    wrapped = autoquant(tiny(), 4.0, DATA, candidates=cands, progress=False, sensitivity="layer", gptq=True)
    assert plain.fqn_to_config.keys() == wrapped.fqn_to_config.keys()
    for fqn, c in plain.fqn_to_config.items():  # the same choice, GPTQ around the format it stores
        assert wrapped.fqn_to_config[fqn] == GPTQConfig(getattr(c, "base_config", c), progress=False)
    a = quantized_weights(quantize_(copy.deepcopy(tiny()), plain))
    b = quantized_weights(quantize_(copy.deepcopy(tiny()), wrapped, calibration_data=DATA))
    assert {k: v.storage_bytes() for k, v in a.items()} == {k: v.storage_bytes() for k, v in b.items()}
    with pytest.raises(ValueError, match="gptq=1 must be True or False"):
        autoquant(tiny(), 4.0, DATA, candidates=cands, progress=False, gptq=1)


def _mlp(training: bool = True) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 64)).train(
        training)


def _flags(model: torch.nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("sensitivity", ["fisher", "mse", "layer"])
def test_a_model_in_training_mode_is_left_exactly_as_it_was(sensitivity):
    """autoquant used to run the model in training mode: BatchNorm's running stats moved with every pass."""
    model = _mlp()
    model[2].eval()  # mixed flags: each is restored as it was
    before, flags = copy.deepcopy(model.state_dict()), _flags(model)
    data = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) * 3 + 1 for i in range(3)]
    autoquant(model, 6.0, data, candidates=CANDIDATES, progress=False, sensitivity=sensitivity)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert _flags(model) == flags


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_calibration_data_is_named(value):
    """NaN / inf calibration data used to give a plan built on NaN losses."""
    model = _mlp()
    data = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    data[1][2, 5] = value  # stacked with the others into one forward: the item is still named
    before, flags = copy.deepcopy(model.state_dict()), _flags(model)
    with pytest.raises(ValueError, match=r"calibration item 1 gives layer '0' non-finite inputs \(NaN or inf"):
        autoquant(model, 6.0, data, candidates=CANDIDATES, progress=False)
    assert _flags(model) == flags and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class _Overflow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e39  # past float32's range: +-inf


@pytest.mark.parametrize("sensitivity, match", [
    ("fisher", r"sensitivity='fisher' got NaN or inf gradients at layer '0' from calibration items 0..1"),
    ("mse", r"sensitivity='mse' measured a non-finite divergence \(nan\) with layer '0' quantized"),
], ids=["fisher", "mse"])
def test_a_non_finite_model_output_is_named(sensitivity, match):
    """Finite layer inputs, but an output that overflows: the sensitivity passes used to give NaN losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), _Overflow())
    data = [torch.randn(8, 64) for _ in range(2)]
    with pytest.raises(ValueError, match=match):
        autoquant(model, 6.0, data, candidates=CANDIDATES, progress=False, sensitivity=sensitivity)


def test_a_loss_overflowing_float32_is_named():
    model = _mlp(training=False)
    with torch.no_grad():
        model[2].weight.mul_(1e30)  # finite, but its quantization error squared is not in float32
    with pytest.raises(ValueError, match=r"layer '2' gets a non-finite loss \((nan|inf)\) with candidate"):
        autoquant(model, 6.0, [torch.randn(8, 64)], candidates=CANDIDATES, progress=False, sensitivity="layer")


def test_calibration_data_of_the_wrong_width_is_named():
    """Inputs of another width used to fail with a raw shape error from inside autoquant's own hook."""
    model = _mlp()
    with pytest.raises(ValueError, match=r"calibration item 2 gives layer '0' inputs of width 32, expected "
                                         r"in_features=64"):
        autoquant(model, 6.0, [torch.randn(8, 64), torch.randn(8, 64), torch.randn(8, 32)], candidates=CANDIDATES,
                  progress=False)
    # a layer deeper in the model, behind a module that changes the width: named where its input arrives
    deep = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"calibration item 0 gives layer '1' inputs of width 48, expected "
                                         r"in_features=64"):
        autoquant(deep, 6.0, [torch.randn(8, 64)], candidates=CANDIDATES, progress=False)
