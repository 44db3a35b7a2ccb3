"""benchmarks/make_synthetic.py: the real bodies' shapes (parameter counts against transformers' own models),
and a tiny checkpoint written streamed: shards, dtypes, index, config, loads in transformers, and a GGUF of the
same tensors in llama.cpp's names and layout."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "make_synthetic.py"
_spec = importlib.util.spec_from_file_location("make_synthetic", _PATH)
ms = importlib.util.module_from_spec(_spec)
sys.modules["make_synthetic"] = ms
_spec.loader.exec_module(ms)


@pytest.mark.parametrize("body,vocab,params", [
    ("llama-3.2-1b", 128256, 1_235_814_400),  # the published parameter counts, with each model's own vocabulary
    ("qwen2.5-1.5b", 151936, 1_543_714_304),
    ("llama-3.1-8b", 128256, 8_030_261_248),
])
def test_bodies_have_the_real_shapes(body, vocab, params):
    specs = ms.tensor_specs(ms.SHAPES[body], vocab)
    assert sum(math.prod(s) for _, s, _ in specs) == params
    cfg = transformers.AutoConfig.for_model(**ms.hf_config(ms.SHAPES[body], vocab))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    # The transformers model of the written config.json has exactly these tensors and shapes.
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert expected == {n: s for n, s, _ in specs}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    summary = ms.make("tiny-llama", out, vocab=256, seed=3, shard_gb=40_000 / 2**30, gguf_type="bf16",
                      tokenizer=False)
    return out, summary


def test_tiny_checkpoint_files_and_transformers_load(tiny):
    out, summary = tiny
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert summary["shards"] == len(shards) > 1 and not list(out.glob(".*.part"))
    specs = {n: (s, init) for n, s, init in ms.tensor_specs(ms.SHAPES["tiny-llama"], 256)}
    seen, total = {}, 0
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert index["weight_map"][name] == shard
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == specs[name][0], name
                seen[name] = t
                total += t.numel() * 2
    assert set(seen) == set(specs) and total == index["metadata"]["total_size"] == summary["bytes"]
    emb = seen["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002  # N(0, initializer_range)
    assert torch.equal(seen["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    # Values depend on (seed, name) only: the same tensor from a fresh draw.
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(seen[name], ms.full_tensor(name, specs[name][0], "normal", 3))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.rope_scaling["rope_type"] == "llama3"
    for name, t in model.state_dict().items():
        assert torch.equal(t, seen[name]), name
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_tiny_gguf_holds_the_same_tensors_in_llama_cpp_layout(tiny):
    gguf = pytest.importorskip("gguf")
    out, summary = tiny
    reader = gguf.GGUFReader(summary["gguf"])
    tensors = {t.name: t for t in reader.tensors}
    body = ms.SHAPES["tiny-llama"]
    names = {ms.gguf_name(n) for n, _, _ in ms.tensor_specs(body, 256)} | {"rope_freqs.weight"}
    assert set(tensors) == names
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32

    def bf16(name):
        return torch.from_numpy(tensors[name].data.copy().view("int16")).view(torch.bfloat16)

    with safe_open(out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][
            "model.layers.0.self_attn.k_proj.weight"], "pt") as f:
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    # llama.cpp's interleaved rotary rows: per kv head, rows (0, d/2, 1, d/2 + 1, ...) of transformers' layout.
    d = body.head_dim
    order = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], 1).reshape(-1)
    perm = torch.cat([h * d + order for h in range(body.kv_heads)])
    assert torch.equal(bf16("blk.0.attn_k.weight").reshape(k.shape), k[perm])
    fields = reader.fields
    assert int(fields["llama.block_count"].parts[-1][0]) == 2
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == 2
    # llama3 rope factors: 1 for the high frequencies, `factor` for the lowest ones.
    freqs = torch.from_numpy(tensors["rope_freqs.weight"].data.copy())
    assert freqs.shape == (d // 2,) and freqs[0] == 1.0 and freqs[-1] == 8.0


def test_moe_body_has_qwen3_30b_a3b_shapes():
    """The MoE body: transformers 5's Qwen3-MoE tensors (3-D experts) and Qwen3-30B-A3B's 30.5 B parameters."""
    shape = ms.MOE_SHAPES["qwen3-30b-a3b"]
    specs = ms.moe_tensor_specs(shape, shape.vocab)
    assert sum(math.prod(s) for _, s, _ in specs) == 30_532_122_624
    cfg = transformers.AutoConfig.for_model(**ms.moe_hf_config(shape, shape.vocab))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {n: s for n, s, _ in specs}


def test_tiny_moe_checkpoint_loads_in_transformers(tmp_path):
    """A tiny MoE body with --layers: the written 3-D expert tensors load as they are and the model runs."""
    summary = ms.make("tiny-qwen3-moe", tmp_path, layers=1, shard_gb=20_000 / 2**30)
    assert summary["shards"] > 1 and json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(model.state_dict()[name], ms.full_tensor(name, (8, 64, 64), "normal", 0))
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    with pytest.raises(ValueError, match="--layers"):
        ms.make("tiny-qwen3-moe", tmp_path / "x", layers=0)


def test_gguf_only_writes_the_same_gguf_and_nothing_else(tiny, tmp_path):
    out, summary = tiny
    again = ms.make("tiny-llama", tmp_path, vocab=256, seed=3, gguf_type="bf16", gguf_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-bf16.gguf"]
    assert Path(again["gguf"]).read_bytes() == Path(summary["gguf"]).read_bytes()
    with pytest.raises(ValueError, match="--gguf-only needs --gguf"):
        ms.make("tiny-llama", tmp_path, gguf_only=True)


def test_gguf_with_smollm2_vocabulary_carries_its_tokenizer(tmp_path):
    # The 1B / 8B bodies' GGUFs (bench_scale --prepare) take SmolLM2's tokenizer keys from the shipped file as
    # affineq's reader reads them (string arrays, numpy token types); llama.cpp tokenizes with them.
    gguf = pytest.importorskip("gguf")
    from affineq.models import smollm2_path

    ms.make("tiny-llama", tmp_path, seed=3, gguf_type="f16", gguf_only=True)
    ours, ref = gguf.GGUFReader(tmp_path / "model-f16.gguf"), gguf.GGUFReader(smollm2_path())
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        a, b = ours.fields[key], ref.fields[key]
        assert a.types == b.types and a.contents() == b.contents(), key
    assert ours.fields["llama.vocab_size"].contents() == ms.SMOLLM2_VOCAB
