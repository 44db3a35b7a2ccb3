"""affineq.models.generate on Gemma 3 text models (issue #31): 1 + w RMSNorms, the sqrt(hidden) embedding scale,
q/k norms, sandwich norms, sliding-window local layers with their own rope base, gelu-tanh MLP, query_pre_attn_scalar
and final logit soft-capping give transformers' greedy tokens (float and quantized, eager and compiled, padded
batches); the int8 KV cache honours the sliding window; a Gemma 3 loaded from GGUF runs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import WEIGHT_ONLY, hf_greedy, random_prompt  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

import affineq  # noqa: E402
from affineq.cpp import kv_attention as kva  # noqa: E402
from affineq.models import generate  # noqa: E402
from affineq.models.kv_cache import QuantizedKVCache  # noqa: E402
from affineq.models.static_decoder import StaticDecoder  # noqa: E402

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.2, num_hidden_layers=2,
              layer_types=["sliding_attention", "full_attention"], sliding_window=6, rope_local_base_freq=100.0,
              query_pre_attn_scalar=24, tie_word_embeddings=False)  # a tied tiny Gemma repeats its last token


def _gemma(**kw) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**_SMALL, **kw})).eval()
    with torch.no_grad():  # Gemma norms scale by 1 + w: random w makes the shift and the q/k norms visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "final_softcap"])
@pytest.mark.parametrize("quant", sorted(WEIGHT_ONLY))
def test_tokens_equal_transformers_generate_eager(quant, softcap):
    model = _gemma(final_logit_softcapping=softcap)
    if WEIGHT_ONLY[quant] is not None:
        affineq.quantize_(model, WEIGHT_ONLY[quant]())
    ids = random_prompt()  # 7 + 8 tokens: the local layer's window of 6 cuts
    ref = hf_greedy(model, ids, 8)
    assert len(set(ref[0, 7:].tolist())) > 2  # a sequence, not one repeated token
    with affineq.record_kernels() as ran:
        out = generate(model, ids, 8, compile=False, ignore_eos=True)
    assert torch.equal(out, ref)
    assert not [k for k in ran if k.startswith("dequantize:")]  # no kernel fallback


def test_every_gemma_feature_is_live():
    """Each feature changes the tokens when dropped (the local layers on the global rope base, no window, the
    default query scale), so the equality above checks all of them."""
    ids = random_prompt()
    ref = generate(_gemma(), ids, 8, compile=False, ignore_eos=True)
    for change in (dict(sliding_window=64), dict(rope_local_base_freq=1e6), dict(query_pre_attn_scalar=16)):
        assert not torch.equal(generate(_gemma(**change), ids, 8, compile=False, ignore_eos=True), ref), change


def test_compiled_tokens_equal_transformers_generate():
    """Compiled prefill (a 64-slot padded prompt: both rope tables, the window mask per query) and decode step."""
    model = _gemma(final_logit_softcapping=2.0)
    affineq.quantize_(model, affineq.Int8WeightOnlyConfig())
    ids = random_prompt()
    out = generate(model, ids, 8, ignore_eos=True, compile_prefill=True, cpp_wrapper=False)
    assert torch.equal(out, hf_greedy(model, ids, 8))


def test_padded_batch_equals_transformers_generate():
    model = _gemma()
    ids, mask = random_prompt(3, 9, seed=4), torch.ones(3, 9, dtype=torch.int64)
    mask[0, :5] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    out = generate(model, ids, 8, attention_mask=mask, compile=False, ignore_eos=True)
    assert torch.equal(out, hf_greedy(model, ids, 8, mask))


def _windowed_reference(q, k, v, pos, valid, window):
    """Per query, a plain softmax attention over the slots t with pos - window < t <= pos and valid (float64)."""
    b, h, s, d = q.shape
    rep = h // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    out = torch.zeros(b, h, s, d, dtype=torch.float64)
    for i in range(b):
        for j, p in enumerate(pos.tolist()):
            keys = [t for t in range(max(p - window + 1, 0), p + 1) if valid[i, t]]
            w = (q[i, :, j, None].double() * k[i, :, keys]).sum(-1) / d**0.5  # [H, keys]
            out[i, :, j] = (w.softmax(-1)[..., None] * v[i, :, keys]).sum(1)
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_cache_sliding_window_matches_a_per_query_reference(kind):
    """Prefill (each query its own window: dequantized codes) and decode (the window cuts `valid`: the kernel)."""
    gen = torch.Generator().manual_seed(0)
    cache = QuantizedKVCache(kind, 1, (2, 2, 16, 32), None, torch.device("cpu"))
    k, v = torch.randn(2, 2, 12, 32, generator=gen), torch.randn(2, 2, 12, 32, generator=gen)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1, :3] = False  # row 1 left-padded by 3
    cache.write(0, torch.arange(12), k, v)
    kd = kva.dequantize_kv(cache.k[0], cache.k_scale[0])[:, :, :12]
    if cache.rotation is not None:  # int4 keys are stored rotated by R (R R = I): back to the query's basis
        kd = kd @ cache.rotation
    vd = kva.dequantize_kv(cache.v[0], cache.v_scale[0])[:, :, :12]
    q = torch.randn(2, 4, 12, 32, generator=gen)
    out = cache.attend(0, q, torch.arange(12), valid, 5)
    ref = _windowed_reference(q, kd, vd, torch.arange(12), valid, 5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    step = cache.attend(0, q[:, :, 11:], torch.tensor([11]), valid, 5)
    torch.testing.assert_close(step.double(), ref[:, :, 11:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(step, cache.attend(0, q[:, :, 11:], torch.tensor([11]), valid))  # the window cut


def test_int8_cache_logits_close_to_the_float_cache():
    model = _gemma()
    ids = random_prompt(2, 9)
    with torch.inference_mode():
        ref = StaticDecoder(model, 2, 128, compile=False).run_prefill(ids)
        q8 = StaticDecoder(model, 2, 128, compile=False, kv_cache_dtype="int8").run_prefill(ids)
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (q8 - ref).pow(2).sum()))
    assert sqnr > 30, sqnr
    out = generate(model, ids, 8, compile=False, ignore_eos=True, kv_cache_dtype="int8")
    assert torch.equal(out[:, :11], hf_greedy(model, ids, 8)[:, :11])  # the first tokens; a sharp random model drifts


def test_gguf_loaded_gemma3_runs_in_generate(tmp_path):
    ag = pytest.importorskip("affineq.gguf")
    pytest.importorskip("gguf")
    # llama.cpp's Gemma 3 conventions, which a GGUF file implies: every 6th layer global, local rope base 1e4
    model = _gemma(tie_word_embeddings=True, layer_types=["sliding_attention"] * 2, sliding_window=4,
                   query_pre_attn_scalar=16, rope_local_base_freq=10000.0)
    affineq.quantize_(model, affineq.IntxWeightOnlyConfig(torch.int8, affineq.PerGroup(32)))  # Q8_0
    path = tmp_path / "gemma3.gguf"
    ag.save_model(model, path)
    loaded = ag.load_model(path)
    assert loaded.config.model_type == "gemma3_text"
    ids = random_prompt()
    assert torch.equal(generate(loaded, ids, 8, compile=False, ignore_eos=True), hf_greedy(loaded, ids, 8))


def test_bfloat16_tokens_equal_transformers_generate():
    model = _gemma().to(torch.bfloat16)  # Gemma norms compute in fp32 and cast back; the embedding scale in bf16
    ids = random_prompt()
    assert torch.equal(generate(model, ids, 8, compile=False, ignore_eos=True), hf_greedy(model, ids, 8))
