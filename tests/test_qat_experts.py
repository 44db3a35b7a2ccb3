"""QAT of MoE expert weights (`affineq.qat.experts`): prepare parametrizes the 3-D expert weights of transformers 5
experts modules with a per-expert fake quantization, training updates the 3-D float parameters through it, and
convert stores the 3-D AffineQuantizedTensors `quantize_` makes of the trained weights (tiny random Mixtral and
gpt-oss, built in the tests)."""

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers' 3-D experts modules need transformers >= 5", allow_module_level=True)

from conftest import assert_unchanged, snapshot_model  # noqa: E402
from test_moe import _model  # noqa: E402

import affineq  # noqa: E402
from affineq import AffineQuantizedTensor as AQT  # noqa: E402
from affineq.expert_weights import is_expert_module  # noqa: E402
from affineq.qat.experts import is_prepared_experts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

ONLY_EXPERTS = lambda m, fqn: is_expert_module(m)  # noqa: E731
NAMES = ("gate_up_proj", "down_proj")
BASES = {"int4-g32": affineq.Int4WeightOnlyConfig(group_size=32),
         "int8-channel": affineq.Int8WeightOnlyConfig()}
TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))


def _experts_modules(model):
    return [layer.mlp.experts for layer in model.model.layers]


def _stored(q: AQT) -> dict[str, torch.Tensor]:
    return dict(q.tensors)


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_prepare_train_convert_expert_weights(arch, base):
    """Prepared: each expert weight reads as exactly the dequantized weight `quantize_` would store; SGD on the 3-D
    float parameters lowers the loss; convert gives 3-D AffineQuantizedTensors whose stored codes and qparams equal
    `quantize_` of the trained weights, and which dequantize to the prepared forward's weights."""
    cfg = BASES[base]
    model = _model(arch).train()
    affineq.quantize_(model, affineq.QATConfig(cfg, step="prepare"), filter_fn=ONLY_EXPERTS)
    direct = _model(arch)
    affineq.quantize_(direct, cfg, filter_fn=ONLY_EXPERTS)
    for prepared, ref in zip(_experts_modules(model), _experts_modules(direct), strict=True):
        assert is_prepared_experts(prepared)
        for n in NAMES:
            assert torch.equal(getattr(prepared, n), getattr(ref, n).dequantize())

    originals = [p for n, p in model.named_parameters() if n.endswith(".original")]
    assert len(originals) == 2 * len(model.model.layers) and all(p.dim() == 3 for p in originals)
    opt = torch.optim.SGD(originals, lr=0.5)
    losses = []
    for _ in range(4):
        loss = model(TOKENS, labels=TOKENS).loss
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in originals)
    assert losses[-1] < losses[0] - 0.01

    trained = {n.replace("parametrizations.", "").replace(".original", ""): p.detach().clone()
               for n, p in model.named_parameters()}
    fake = [{n: getattr(m, n).detach().clone() for n in NAMES} for m in _experts_modules(model)]
    affineq.quantize_(model, affineq.QATConfig(cfg, step="convert"))
    again = _model(arch)
    again.load_state_dict(trained)
    affineq.quantize_(again, cfg, filter_fn=ONLY_EXPERTS)
    assert model.config._experts_implementation == "affineq"
    for m, ref, f in zip(_experts_modules(model), _experts_modules(again), fake, strict=True):
        assert not is_prepared_experts(m) and type(m).__name__ == type(ref).__name__
        for n in NAMES:
            q = getattr(m, n)
            assert isinstance(q, AQT) and q.dim() == 3 and q.shape == getattr(ref, n).shape
            stored, want = _stored(q), _stored(getattr(ref, n))
            assert stored.keys() == want.keys() and all(torch.equal(stored[k], want[k]) for k in want)
            assert torch.equal(q.dequantize(), f[n])


def test_straight_through_gradient_of_expert_weights():
    """The gradient reaching the 3-D float parameter is the gradient of the fake-quantized weight the forward used
    (straight-through: min/max qparams leave every weight inside the range)."""
    cfg = BASES["int4-g32"]
    model = _model("mixtral")
    affineq.quantize_(model, affineq.QATConfig(cfg, step="prepare"), filter_fn=ONLY_EXPERTS)
    model(TOKENS, labels=TOKENS).loss.backward()
    ref = _model("mixtral")
    for m, r in zip(_experts_modules(model), _experts_modules(ref), strict=True):
        for n in NAMES:
            getattr(r, n).data.copy_(getattr(m, n).detach())
    ref(TOKENS, labels=TOKENS).loss.backward()
    for m, r in zip(_experts_modules(model), _experts_modules(ref), strict=True):
        for n in NAMES:
            got = m.parametrizations[n].original.grad
            torch.testing.assert_close(got, getattr(r, n).grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("make, match", [
    (lambda: affineq.QATConfig(affineq.Int8DynamicActivationInt4WeightConfig(group_size=32)), "weights only"),
    (lambda: affineq.QATConfig(affineq.Int4WeightOnlyConfig(group_size=32), range_learning="lsq"), "range_learning"),
], ids=["activations", "range-learning"])
def test_expert_qat_refusals_change_nothing(make, match):
    """What expert QAT cannot do is refused by name (the experts module), and the model is left as it was."""
    model = _model("mixtral")
    snap = snapshot_model(model)
    with pytest.raises(affineq.QuantizationError, match=rf"model\.layers\.0\.mlp\.experts: .*{match}"):
        affineq.quantize_(model, make(), filter_fn=ONLY_EXPERTS)
    assert_unchanged(model, snap)


def test_prepare_twice_is_refused():
    model = _model("mixtral")
    cfg = affineq.QATConfig(BASES["int4-g32"], step="prepare")
    affineq.quantize_(model, cfg, filter_fn=ONLY_EXPERTS)
    with pytest.raises(affineq.QuantizationError, match="already prepared"):
        affineq.quantize_(model, cfg, filter_fn=lambda m, fqn: fqn.endswith("experts"))

