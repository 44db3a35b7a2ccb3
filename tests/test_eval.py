"""affineq.eval.compare: perplexity and KL divergence against a reference model, as llama.cpp's
`perplexity --kl-divergence` defines them (second half of each window scored, KL(P_ref || P_q) over the full
vocabulary, the 99th percentile by linear interpolation, "same top p")."""

import copy
import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from affineq import eval as aeval
from affineq.configs import Int4WeightOnlyConfig
from affineq.models import build_tiny_lm
from affineq.quantize import quantize_


@functools.cache
def tiny_pair(seed: int = 0):
    """A small TinyLM with sharp output distributions (lm_head scaled up) and an int4 g32 copy of it."""
    ref = build_tiny_lm(seed, vocab=96, dim=64, layers=2, heads=2, ffn=128)
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)
    q = quantize_(copy.deepcopy(ref), Int4WeightOnlyConfig(group_size=32))
    return q, ref


def direct(model, reference, ids: torch.Tensor, window: int, context: int) -> dict:
    """The same statistics written out with other torch ops: KL through F.kl_div, NLL through
    F.cross_entropy, the percentile through numpy."""
    n = ids.numel() // window
    kl, nq, nr, top = [], [], [], []
    with torch.no_grad():
        for w in range(n):
            x = ids[w * window:(w + 1) * window].unsqueeze(0)
            lq, lp = model(x)[0].double(), reference(x)[0].double()
            rows = slice(context, window - 1)
            tgt = x[0, context + 1:]
            kl.append(F.kl_div(F.log_softmax(lq[rows], -1), F.log_softmax(lp[rows], -1), log_target=True,
                               reduction="none").sum(-1))
            nq.append(F.cross_entropy(lq[rows], tgt, reduction="none"))
            nr.append(F.cross_entropy(lp[rows], tgt, reduction="none"))
            top.append(lq[rows].argmax(-1) == lp[rows].argmax(-1))
    kl = torch.cat(kl)
    return {"ppl": math.exp(torch.cat(nq).mean()), "ppl_reference": math.exp(torch.cat(nr).mean()),
            "mean_kld": float(kl.mean()), "kld_p99": float(np.percentile(kl.numpy(), 99)),
            "top1_agreement": float(torch.cat(top).double().mean()), "tokens": kl.numel()}


def test_compare_matches_a_direct_computation():
    q, ref = tiny_pair()
    ids = torch.randint(0, 96, (3 * 64 + 17,), generator=torch.Generator().manual_seed(1))
    got = aeval.compare(q, ref, ids, window=64, progress=False)
    want = direct(q, ref, ids, 64, 32)
    assert got.keys() == want.keys()
    assert got["tokens"] == want["tokens"] == 3 * 31  # the 17-token tail is dropped; 31 scored per window
    for k in ("ppl", "ppl_reference", "mean_kld", "kld_p99", "top1_agreement"):
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    assert got["mean_kld"] > 1e-3 and got["top1_agreement"] < 1.0  # the int4 copy does differ
    # context=0 scores every prediction (window - 1 per window)
    got0 = aeval.compare(q, ref, ids, window=64, context=0, progress=False)
    want0 = direct(q, ref, ids, 64, 0)
    assert got0["tokens"] == 3 * 63
    assert got0["mean_kld"] == pytest.approx(want0["mean_kld"], rel=1e-9)
    assert got0["ppl"] == pytest.approx(want0["ppl"], rel=1e-9)


def test_identical_models_give_zero_kld():
    _, ref = tiny_pair()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2)).reshape(1, -1)
    out = aeval.compare(ref, ref, ids, window=40, progress=False)
    assert out["mean_kld"] == 0.0 and out["kld_p99"] == 0.0
    assert out["top1_agreement"] == 1.0
    assert out["ppl"] == out["ppl_reference"]
    twin = copy.deepcopy(ref)
    assert aeval.compare(twin, ref, ids, window=40, progress=False) == out


def test_the_default_context_fits_every_window():
    """window // 2 leaves nothing to score at window 2: the default context is 0 there (it raised on a context
    the caller never passed)."""
    _, ref = tiny_pair()
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))
    out = aeval.compare(ref, ref, ids, window=2, progress=False)
    assert out["tokens"] == 20 and out["mean_kld"] == 0.0


class FixedLogits(nn.Module):
    """Ignores the ids: logits [1, T, 2] whose softmax at position t is (p_t, 1 - p_t)."""

    def __init__(self, probs: torch.Tensor):
        super().__init__()
        self.register_buffer("probs", probs.double())

    def forward(self, ids):
        p = self.probs[: ids.shape[1]]
        return torch.stack([p.log(), (1 - p).log()], -1).unsqueeze(0)


def test_hand_made_pair_with_known_kl():
    t = 16
    p = torch.linspace(0.05, 0.95, t, dtype=torch.float64)
    q = torch.full((t,), 0.5, dtype=torch.float64)
    ids = torch.zeros(2 * t, dtype=torch.int64)  # every target is token 0
    out = aeval.compare(FixedLogits(q), FixedLogits(p), ids, window=t, progress=False)
    rows = slice(t // 2, t - 1)  # positions 8..14 predict tokens 9..15
    pr, qr = p[rows], q[rows]
    kl = pr * (pr / qr).log() + (1 - pr) * ((1 - pr) / (1 - qr)).log()  # KL(P || Q), Bernoulli
    kl2 = torch.cat([kl, kl])  # two windows
    assert out["tokens"] == 14
    assert out["mean_kld"] == pytest.approx(float(kl2.mean()), rel=1e-12)
    assert out["kld_p99"] == pytest.approx(float(np.percentile(kl2.numpy(), 99)), rel=1e-12)
    assert out["ppl"] == pytest.approx(2.0, rel=1e-12)  # Q(token 0) = 0.5 everywhere
    assert out["ppl_reference"] == pytest.approx(math.exp(float(-pr.log().mean())), rel=1e-12)
    # argmax P is token 1 while p < 0.5 and token 0 after; Q ties (argmax 0): agreement where p > 0.5
    assert out["top1_agreement"] == pytest.approx(float((pr > 0.5).double().mean()), rel=1e-12)


def test_hf_llama_and_training_flags_restored():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    q = quantize_(copy.deepcopy(ref), Int4WeightOnlyConfig(group_size=32))
    ref.train()
    ids = torch.randint(0, 64, (96,), generator=torch.Generator().manual_seed(3))
    out = aeval.compare(q, ref, ids, window=32, progress=True)
    assert ref.training and all(m.training for m in ref.modules())  # put back as it was
    q.eval(), ref.eval()
    want = direct(lambda x: q(x).logits, lambda x: ref(x).logits, ids, 32, 16)
    assert out["mean_kld"] == pytest.approx(want["mean_kld"], rel=1e-9)
    assert out["ppl"] == pytest.approx(want["ppl"], rel=1e-9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(token_ids=torch.rand(64)), "integer token ids"),
    (dict(token_ids=torch.zeros(2, 64, dtype=torch.int64)), r"\[N\] or \[1, N\]"),
    (dict(token_ids=torch.zeros(10, dtype=torch.int64)), "fewer than one window"),
    (dict(token_ids=torch.full((64,), -1)), "negative id"),
    (dict(token_ids=torch.full((64,), 96)), "outside the vocabulary"),
    (dict(token_ids="hello"), "int tensor"),
    (dict(window=1), "window=1"),
    (dict(window=32.0), "window=32.0"),
    (dict(context=31), r"context=31 must be an int in \[0, window - 2\]"),
    (dict(context=-1), "context=-1"),
])
def test_bad_input(kwargs, match):
    q, ref = tiny_pair()
    args = dict(token_ids=torch.zeros(64, dtype=torch.int64), window=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        aeval.compare(q, ref, args.pop("token_ids"), progress=False, **args)


def test_bad_models():
    _, ref = tiny_pair()
    ids = torch.zeros(32, dtype=torch.int64)
    with pytest.raises(ValueError, match="same vocabulary"):
        aeval.compare(build_tiny_lm(vocab=97, dim=64, layers=1, heads=2, ffn=64), ref, ids, window=32,
                      progress=False)
    with pytest.raises(ValueError, match="callable model"):
        aeval.compare("model", ref, ids, window=32)
    broken = copy.deepcopy(ref)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="model returned NaN logits"):
        aeval.compare(broken, ref, ids, window=32, progress=False)
    with pytest.raises(ValueError, match="logits of shape"):
        aeval.compare(lambda x: torch.zeros(5), ref, ids, window=32, progress=False)


@pytest.mark.parametrize("value, kind", [(float("inf"), "infinite"), (float("-inf"), "infinite"),
                                         (float("nan"), "NaN")])
@pytest.mark.parametrize("which", ["model", "reference"])
def test_non_finite_logits_are_named(value, kind, which):
    """+-inf logits used to pass the NaN check and give NaN / inf statistics."""
    _, ref = tiny_pair()
    ids = torch.zeros(32, dtype=torch.int64)

    def broken(x):
        out = ref(x).clone()
        out[..., 5, 3] = value
        return out

    pair = (broken, ref) if which == "model" else (ref, broken)
    with pytest.raises(ValueError, match=rf"compare: {which} returned {kind} logits"):
        aeval.compare(*pair, ids, window=32, progress=False)
