"""Training behaviour: straight-through gradients with the clip mask from the unclamped codes, LSQ and TQT
gradients that lower a loss, TQT's power-of-two scales and threshold initialisations, torch.compile, and
state_dict round trips with weights_only=True."""

import io
import math

import pytest
import torch
from torch import nn

from affineq import Int4WeightOnlyConfig, Int8DynamicActivationInt4WeightConfig, quantize_
from affineq.granularity import PerTensor
from affineq.qat import (
    FakeQuantizeConfig,
    FakeQuantizer,
    QATConfig,
    TQTThresholdInitMeth,
    initialize_fake_quantizers,
    tqt_threshold,
)


def _static(**kw):
    return FakeQuantizeConfig(torch.int4, PerTensor(), is_dynamic=False, **kw)


def _init(fq, x):
    fq.pending_init = True
    with torch.no_grad():
        fq(x)


@pytest.mark.parametrize("learned", [False, True])
def test_ste_mask_is_one_inside_and_zero_outside(learned):
    """Calibrate on [-1, 1] (scale 1/7.5: codes -7.5..7.5 -> clamp at -8 / 7), then feed values far outside:
    the gradient is 1 exactly where the unclamped code is inside [-8, 7], 0 elsewhere. A mask computed after
    clamping would be all ones."""
    fq = FakeQuantizer(_static(range_learning=learned))
    _init(fq, torch.linspace(-1, 1, 64))
    x = torch.tensor([-3.0, -1.1, -0.5, 0.0, 0.3, 0.9, 0.95, 1.2, 4.0], requires_grad=True)
    fq(x).sum().backward()
    s = float(fq.scale if not learned else fq.quantized_qparams(x)[0])
    inside = ((torch.round(x.detach() / s) >= -8) & (torch.round(x.detach() / s) <= 7)).float()
    assert torch.equal(x.grad, inside)
    assert inside.sum() == 6 and x.grad[0] == 0 and x.grad[-1] == 0


def test_dynamic_weight_ste_passes_gradients_through():
    fq = FakeQuantizer(FakeQuantizeConfig(torch.int4, group_size=8))
    w = torch.randn(4, 16, requires_grad=True)
    fq(w).sum().backward()
    scale = fq.quantized_qparams(w)[0].repeat_interleave(8, dim=1)
    u = torch.round(w.detach() / scale)
    # symmetric int4 maps amax to 7.5, so a group's positive maximum can round to code 8 and clip
    assert torch.equal(w.grad, ((u >= -8) & (u <= 7)).float())
    assert 0.8 * w.numel() < w.grad.sum() < w.numel()


def test_lsq_scale_gets_the_lsq_gradient():
    """d out / d s = round(x/s) - x/s inside, qmin or qmax outside (times the LSQ gradient scale g)."""
    fq = FakeQuantizer(_static(range_learning=True))
    _init(fq, torch.linspace(-1, 1, 64))
    x = torch.tensor([0.31, -0.52, 2.0, -3.0])
    fq(x).sum().backward()
    s = float(fq.scale.detach())
    g = 1 / math.sqrt(x.numel() * 7)
    v = x / s
    want = torch.where(v.round() > 7, torch.tensor(7.0), torch.where(v.round() < -8, torch.tensor(-8.0),
                                                                     v.round() - v)).sum() * g
    assert fq.scale.grad.abs().item() > 0
    assert math.isclose(fq.scale.grad.item(), want.item(), rel_tol=1e-5)


@pytest.mark.parametrize("learning", ["lsq", "tqt"])
def test_range_learning_lowers_the_loss(learning):
    torch.manual_seed(0)
    teacher = nn.Linear(32, 8)
    model = nn.Sequential(nn.Linear(32, 8))
    model[0].load_state_dict(teacher.state_dict())
    x = torch.randn(256, 32)
    y = teacher(x).detach()
    base = Int8DynamicActivationInt4WeightConfig(group_size=16)
    quantize_(model, QATConfig(base, step="prepare", range_learning=learning))
    initialize_fake_quantizers(model, x[:8])
    fq = model[0].weight_fake_quantizer
    qparams = [p for n, p in model.named_parameters() if "scale" in n]
    assert qparams, "learned qparams are parameters named *scale*"
    with torch.no_grad():  # start from too small a range (1/2 LSQ, 1/4 TQT): much of each group clips
        qparams[0].sub_(2.0) if learning == "tqt" else qparams[0].mul_(0.5)
    # only the qparams train: the loss falls through range learning alone
    opt = torch.optim.Adam(qparams, lr=0.05 if learning == "tqt" else 2e-3)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert qparams[0].grad.abs().sum() > 0
    assert losses[-1] < 0.5 * losses[0], losses
    if learning == "tqt":
        scale = fq.quantized_qparams(model[0].weight)[0].float()
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # exact powers of two


def test_tqt_threshold_init_methods_on_known_data():
    torch.manual_seed(0)
    x = torch.randn(4, 4096) * torch.tensor([[0.5], [1.0], [2.0], [3.0]]) + 0.25
    t = tqt_threshold(x, (1, 4096), TQTThresholdInitMeth._3SD, -128, 127)
    want = x.mean(1).abs() + 3 * x.std(1, correction=0)
    assert t.shape == (4, 1) and torch.allclose(t.reshape(-1), want, rtol=1e-6)
    # uniform data on [-1, 1]: 2**0 loses nothing to clipping and keeps the finest grid that covers it; 0.5
    # clips half the mass and 2 doubles the step, so the KL-J choice is exactly 1.0 (8 and 4 bits)
    u = torch.rand(2, 8192) * 2 - 1
    for qmin, qmax in ((-128, 127), (-8, 7)):
        assert torch.equal(tqt_threshold(u, (1, 8192), TQTThresholdInitMeth._LL_J, qmin, qmax), torch.ones(2, 1))
    # a Gaussian with one huge outlier: 3SD ignores it; LL_J clips it (a threshold far below the outlier)
    g = torch.randn(1, 8192)
    g[0, 0] = 1000.0
    t3 = tqt_threshold(g, (1, 8192), TQTThresholdInitMeth._3SD, -128, 127)
    tj = tqt_threshold(g, (1, 8192), TQTThresholdInitMeth._LL_J, -128, 127)
    assert t3.item() < 50 and tj.item() <= 256 and math.log2(tj.item()).is_integer()


def test_tqt_scales_are_powers_of_two_with_both_inits():
    for meth in TQTThresholdInitMeth:
        cfg = FakeQuantizeConfig(torch.int8, "per_channel", is_dynamic=False, range_learning=True,
                                 range_learning_method="tqt", tqt_init=meth)
        fq = FakeQuantizer(cfg)
        w = torch.randn(8, 64) * torch.rand(8, 1) * 4
        _init(fq, w)
        scale = fq.quantized_qparams(w)[0]
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        assert torch.all(fq(w) / scale.reshape(8, 1) == torch.round(fq(w) / scale.reshape(8, 1)))


def _tiny_lm():
    from affineq.models.tiny import TinyLM, TinyLMConfig

    return TinyLM(TinyLMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=128))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def test_torch_compile_of_a_prepared_model_trains_without_graph_breaks():
    """No graph break in the forward of a prepared TinyLM (dynamic 8da4w); a small prepared MLP (dynamic and
    LSQ quantizers) trains under torch.compile(fullgraph=True) (aot_eager: the autograd graph without inductor's
    slow C++ compile on 2 cores)."""
    torch._dynamo.reset()
    model = _tiny_lm()
    quantize_(model, QATConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), step="prepare"))
    explain = torch._dynamo.explain(model)(torch.randint(0, 64, (2, 16)))
    assert explain.graph_break_count == 0, explain.break_reasons
    for learning in (None, "lsq"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        quantize_(mlp, QATConfig(Int8DynamicActivationInt4WeightConfig(group_size=16), step="prepare",
                                 range_learning=learning))
        x, y = torch.randn(64, 32), torch.randn(64, 8)
        initialize_fake_quantizers(mlp, x)
        compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
        opt = torch.optim.Adam(mlp.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = (compiled(x) - y).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (learning, losses)


def test_prepared_state_dict_loads_with_weights_only():
    base = Int4WeightOnlyConfig(group_size=32)
    model = _tiny_lm()
    quantize_(model, QATConfig(base, step="prepare", range_learning="lsq"))
    ids = torch.randint(0, 64, (1, 8))
    initialize_fake_quantizers(model, ids)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert any(k.endswith("weight_fake_quantizer.scale") for k in state)
    fresh = _tiny_lm()
    quantize_(fresh, QATConfig(base, step="prepare", range_learning="lsq"))
    fresh.load_state_dict(state)  # uninitialised qparams take the saved shapes
    with torch.no_grad():
        assert torch.equal(_logits(fresh(ids)), _logits(model(ids)))
