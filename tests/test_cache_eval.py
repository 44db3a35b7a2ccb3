"""Teacher-forced scoring through the static decoder's KV cache (``StaticDecoder.score``, ``kv_cache_perplexity``)
and the decoder's fusion rule (q/k/v and gate/up fused only while the weight copies stay small)."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from affineq.models import generate  # noqa: E402
from affineq.models import static_decoder as sd  # noqa: E402
from affineq.models.cache_eval import kv_cache_perplexity  # noqa: E402
from affineq.models.static_decoder import StaticDecoder  # noqa: E402

_SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, num_hidden_layers=2)  # head_dim 32


def _llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**_SMALL, **kw})).eval()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_score_float_cache_equals_the_model_forward():
    model = _llama()
    ids = _ids(40)[None]
    with torch.inference_mode():
        ref = model(ids).logits.float()
        out = StaticDecoder(model, 1, 64, compile=False).score(ids)
    assert out.shape == (1, 40, 128)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_score_quantized_cache_equals_decoding_step_by_step(kind):
    """Teacher forcing through the quantized cache = feeding the same tokens one decode step at a time: position t's
    logits from one score() call against the logits of step t (the cache holds the same codes either way; with
    ``first_write=1`` the first write is one token in both, so int4's key offset is the same: token 0's key)."""
    model = _llama()
    ids = _ids(24, seed=2)[None]
    with torch.inference_mode():
        every = StaticDecoder(model, 1, 64, compile=False, kv_cache_dtype=kind).score(ids, first_write=1)[0]
        dec = StaticDecoder(model, 1, 64, compile=False, kv_cache_dtype=kind)
        steps = torch.stack([dec.forward(ids[:, t:t + 1], torch.tensor([t]))[0] for t in range(24)])
        flt = StaticDecoder(model, 1, 64, compile=False).score(ids)[0]
        one = StaticDecoder(model, 1, 64, compile=False, kv_cache_dtype=kind).score(ids)[0]
    torch.testing.assert_close(every, steps.float(), rtol=1e-4, atol=1e-4)
    assert (every - flt).abs().max() > 1e-4  # the cache is really quantized: not the float cache's logits
    if kind == "int8":  # no offset: how the cache is written does not matter
        torch.testing.assert_close(one, every, rtol=1e-4, atol=1e-4)
    else:  # one write of 24 tokens: c = the mean of keys 1..23, other codes
        assert (one - every).abs().max() > 1e-4


def test_score_in_two_writes_equals_one_for_the_float_cache():
    model = _llama()
    ids = _ids(30, seed=4)[None]
    with torch.inference_mode():
        dec = StaticDecoder(model, 1, 64, compile=False)
        torch.testing.assert_close(dec.score(ids, first_write=7), dec.score(ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="first_write must be None or an int >= 1"):
        dec.score(ids, first_write=0)


def test_kv_cache_perplexity_matches_cross_entropy_of_the_forward():
    model = _llama()
    ids = _ids(100, seed=3)
    with torch.inference_mode():
        nll = sum(float(torch.nn.functional.cross_entropy(model(w[None]).logits[0, :-1].float(), w[1:],
                                                          reduction="sum")) for w in (ids[:48], ids[48:96]))
    r = kv_cache_perplexity(model, ids, 48)
    assert (r["windows"], r["tokens"]) == (2, 94)  # the 4-token tail is dropped
    assert r["ppl"] == pytest.approx(math.exp(nll / 94), rel=1e-5)
    q = kv_cache_perplexity(model, ids, 48, kv_cache_dtype="int8")
    assert q["ppl"] != r["ppl"] and q["ppl"] == pytest.approx(r["ppl"], rel=0.02)


def test_kv_cache_perplexity_refuses_bad_input():
    model = _llama()
    with pytest.raises(ValueError, match="fewer than one window of 64"):
        kv_cache_perplexity(model, _ids(10), 64)
    with pytest.raises(ValueError, match="1-D int64"):
        kv_cache_perplexity(model, _ids(100)[None], 64)
    with pytest.raises(ValueError, match="window must be an int >= 2"):
        kv_cache_perplexity(model, _ids(100), 1)
    with pytest.raises(ValueError, match="prompt_tokens must be an int >= 1"):
        kv_cache_perplexity(model, _ids(100), 64, prompt_tokens=0)
    with pytest.raises(ValueError, match=r"ids must be \[1, S\]"):
        StaticDecoder(model, 1, 16, compile=False).score(_ids(20)[None])


def test_fusion_copy_bytes_and_the_auto_rule(monkeypatch):
    model = _llama()
    # per layer: q 128x128, k 64x128, v 64x128, gate 96x128, up 96x128 fp32
    assert sd.fusion_copy_bytes(model.model.layers) == 2 * 4 * 128 * (128 + 64 + 64 + 96 + 96)
    calls = []
    real = sd._fused
    monkeypatch.setattr(sd, "_fused", lambda mods, copy: calls.append((len(mods), copy)) or real(mods, copy))
    ids = _ids(6, seed=4)[None]
    ref = generate(model, ids, 8, compile=False, ignore_eos=True, fuse_projections=False)
    assert calls == []
    StaticDecoder(model, 1, 32, compile=False)  # default: small copies -> fused, copying allowed
    assert calls == [(3, True), (2, True)] * 2
    calls.clear()
    monkeypatch.setattr(sd, "FUSE_COPY_LIMIT", sd.fusion_copy_bytes(model.model.layers) - 1)
    # default, over the limit: shared calls only (no copy), which float weights cannot make: not fused
    out = generate(model, ids, 8, compile=False, ignore_eos=True)
    assert calls == [(3, False), (2, False)] * 2 and torch.equal(out, ref)
    calls.clear()
    StaticDecoder(model, 1, 32, compile=False, fuse=True)  # forced
    assert calls == [(3, True), (2, True)] * 2


def test_int8_cache_default_groups_are_q8_0_blocks_of_32_capped_by_the_head_dim():
    from affineq.models.kv_cache import QuantizedKVCache

    def groups(d, g=None):
        c = QuantizedKVCache("int8", 1, (1, 2, 8, d), g, torch.device("cpu"))
        return c.key_group, c.value_group, c.k_scale[0].shape[-1], c.v_scale[0].shape[-1]

    assert groups(64) == (32, 32, 2, 2)  # one fp32 scale per 32 codes, as llama.cpp's q8_0
    assert groups(128) == (32, 32, 4, 4)
    assert groups(48) == (16, 16, 3, 3)  # the largest divisor of the head dimension under the default
    assert groups(64, 64) == (64, 64, 1, 1)  # kv_group_size = D: one scale per head and token


def test_int4_cache_default_groups_keys_16_values_32_capped_by_the_head_dim():
    from affineq.models.kv_cache import QuantizedKVCache

    def groups(d, g=None):
        c = QuantizedKVCache("int4", 1, (1, 2, 8, d), g, torch.device("cpu"))
        return c.key_group, c.value_group, c.k_scale[0].shape[-1], c.v_scale[0].shape[-1]

    assert groups(16) == (16, 16, 2, 2)
    assert groups(64) == (16, 32, 8, 4)  # (scale, min) pairs: 2 words per group
    assert groups(24) == (8, 8, 6, 6)  # the largest divisor of the head dimension under the default
    assert groups(64, 64) == (64, 64, 2, 2)  # kv_group_size sets both
    with pytest.raises(ValueError, match="kv_group_size must divide the head dimension 64"):
        groups(64, 48)
