"""affineq.streaming: quantize_checkpoint / load_quantized are bit-identical to quantize_ on the float model in
memory, and quantize a checkpoint larger than the memory they use."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
import safetensors.torch  # noqa: E402
from conftest import _bits  # noqa: E402

import affineq  # noqa: E402
from affineq import streaming  # noqa: E402
from affineq.models.tiny import TinyLM, TinyLMConfig, build_tiny_lm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab=96, dim=64, layers=2, heads=2, ffn=128)
CONFIGS = {
    "int4": affineq.Int4WeightOnlyConfig(group_size=32),
    "int4-cpu": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
    "int8": affineq.Int8WeightOnlyConfig(),
    "int3-e8m0": affineq.IntxWeightOnlyConfig(torch.int3, affineq.PerGroup(16), scale_type="e8m0"),
    "fp8-per-tensor": affineq.Float8DynamicActivationFloat8WeightConfig(granularity=affineq.granularity.PerTensor()),
    "8da4w": affineq.Int8DynamicActivationInt4WeightConfig(group_size=16),
    "fqn-mix": affineq.FqnToConfig({"embed_tokens": affineq.IntxWeightOnlyConfig(torch.int4),
                                    r"re:layers\.0\..*": affineq.Int8WeightOnlyConfig(),
                                    "_default": affineq.Int4WeightOnlyConfig(group_size=32), "lm_head": None}),
}


def _write_checkpoint(state: dict[str, torch.Tensor], d: Path, shards: int) -> Path:
    """`state` as a transformers-style float checkpoint of `shards` files plus model.safetensors.index.json."""
    d.mkdir(parents=True)
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[i::shards]}
        safetensors.torch.save_file(part, d / name)
        weight_map.update({k: name for k in part})
    (d / streaming.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _float_checkpoint(d: Path, tied: bool = False) -> Path:
    state = build_tiny_lm(**TINY, tied=tied).state_dict()
    if tied:
        del state["lm_head.weight"]  # as save_pretrained stores tied weights: once
    return _write_checkpoint(state, d, 3)


def _meta_model(tied: bool = False) -> TinyLM:
    cfg = TinyLMConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=128, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = TinyLM(cfg)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _assert_same(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every parameter and buffer bit-identical (quantized ones: spec and every stored tensor), same logits."""
    got = dict(model.named_parameters(remove_duplicate=False))
    for name, p in ref.named_parameters(remove_duplicate=False):
        q = got[name]
        assert type(q) is type(p), name
        if isinstance(p, affineq.AffineQuantizedTensor):
            assert q.spec == p.spec, name
            assert q.tensors.keys() == p.tensors.keys(), name
            for inner, t in p.tensors.items():
                assert torch.equal(_bits(q.tensors[inner]), _bits(t)), f"{name}:{inner}"
        else:
            assert torch.equal(_bits(q), _bits(p)), name
    ids = torch.randint(0, TINY["vocab"], (2, 9))
    with torch.no_grad():
        out, want = model(ids), ref(ids)
        assert torch.equal(getattr(out, "logits", out), getattr(want, "logits", want))


def test_meta_model_is_the_tiny_lm():
    assert _meta_model().config == build_tiny_lm(**TINY).config


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(streaming, "CHUNK_ELEMENTS", 1000)  # 15 rows of 64: every weight goes by row chunks


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantize_checkpoint_matches_quantize_(tmp_path, name):
    cfg = CONFIGS[name]
    src = _float_checkpoint(tmp_path / "float")
    info = affineq.quantize_checkpoint(src, tmp_path / "q", cfg, model=_meta_model, max_shard_bytes=40_000)
    ref = build_tiny_lm(**TINY)
    affineq.quantize_(ref, cfg)
    quantized = sorted(affineq.quantized_weights(ref))
    assert sorted(info.quantized) == quantized
    assert len(info.files) > 1 and (tmp_path / "q" / streaming.INDEX_FILE).is_file()
    assert info.quantized_bytes == sum(p.storage_bytes() for p in affineq.quantized_weights(ref).values())
    _assert_same(affineq.load_quantized(_meta_model(), tmp_path / "q"), ref)
    # each output shard is a plain affineq.safetensors file: together they are the quantized state_dict
    merged = {}
    for f in info.files:
        merged.update(affineq.safetensors.load_file(f))
    assert merged.keys() == ref.state_dict().keys()
    assert sorted(k for k, v in merged.items() if isinstance(v, affineq.AffineQuantizedTensor)) == quantized


def test_without_a_model_by_name_and_shape(tmp_path):
    """No model: every 2-D *.weight except the embedding (by name) -- quantize_'s nn.Linear choice here."""
    cfg = CONFIGS["int4"]
    src = _float_checkpoint(tmp_path / "float")
    info = affineq.quantize_checkpoint(src, tmp_path / "q", cfg)
    ref = build_tiny_lm(**TINY)
    affineq.quantize_(ref, cfg)
    assert sorted(info.quantized) == sorted(affineq.quantized_weights(ref))
    assert "embed_tokens.weight" not in info.quantized and "lm_head.weight" in info.quantized
    assert [Path(f).name for f in info.files] == ["model.safetensors"]  # fits the default shard size
    _assert_same(affineq.load_quantized(_meta_model(), tmp_path / "q"), ref)
    # filter_fn(name, shape) replaces the default choice
    info = affineq.quantize_checkpoint(src, tmp_path / "q2", cfg, filter_fn=lambda n, s: "mlp" in n)
    assert sorted(info.quantized) == sorted(n for n in affineq.quantized_weights(ref) if "mlp" in n)
    assert streaming.is_linear_weight("model.layers.0.q_proj.weight", (8, 8))
    assert not streaming.is_linear_weight("model.embed_tokens.weight", (8, 8))
    assert not streaming.is_linear_weight("transformer.wte.weight", (8, 8))
    assert not streaming.is_linear_weight("norm.weight", (8,))


def test_tied_weights_follow_quantize_(tmp_path):
    """A tied embedding / lm_head stored once is quantized as quantize_ does it (through lm_head, an nn.Linear)
    and fills both names on load."""
    cfg = CONFIGS["int4"]
    src = _float_checkpoint(tmp_path / "float", tied=True)
    info = affineq.quantize_checkpoint(src, tmp_path / "q", cfg, model=lambda: _meta_model(tied=True))
    assert "embed_tokens.weight" in info.quantized
    ref = build_tiny_lm(**TINY, tied=True)
    affineq.quantize_(ref, cfg)
    model = affineq.load_quantized(_meta_model(tied=True), tmp_path / "q")
    assert model.lm_head.weight is model.embed_tokens.weight
    _assert_same(model, ref)


def test_load_quantized_from_the_float_checkpoint(tmp_path):
    """Quantize while filling a meta model: the float weights are never all held."""
    cfg = CONFIGS["fqn-mix"]
    src = _float_checkpoint(tmp_path / "float")
    ref = build_tiny_lm(**TINY)
    affineq.quantize_(ref, cfg)
    _assert_same(affineq.load_quantized(_meta_model(), src, cfg), ref)


def test_transformers_loads_the_output(tmp_path):
    """A transformers checkpoint in, a transformers checkpoint out: from_pretrained(dst) (pre-quantized, per-shard
    metadata merged) equals from_pretrained(src) + quantize_, and the tokenizer-side files are copied."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = affineq.Int4WeightOnlyConfig(group_size=32)
    hf_cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "float", max_shard_size="40KB")
    (tmp_path / "float" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "float" / "model-f16.gguf").write_bytes(b"GGUF")  # the same weights for llama.cpp: not copied
    assert len(list((tmp_path / "float").glob("*.safetensors"))) > 1
    info = affineq.quantize_checkpoint(tmp_path / "float", tmp_path / "q", cfg, max_shard_bytes=20_000)
    assert len(info.files) > 1 and (tmp_path / "q" / "tokenizer_config.json").read_text() == "{}"
    assert not (tmp_path / "q" / "model-f16.gguf").exists()
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "affineq"
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    affineq.quantize_(ref, cfg)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    assert sorted(affineq.quantized_weights(got)) == sorted(affineq.quantized_weights(ref)) == sorted(info.quantized)
    _assert_same(got, ref)
    # a float-looking checkpoint whose config.json says another method quantized it is refused
    shutil.copytree(tmp_path / "float", tmp_path / "gptq")
    hf = json.loads((tmp_path / "gptq" / "config.json").read_text())
    (tmp_path / "gptq" / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="already quantized \\(quant_method 'gptq'\\)"):
        affineq.quantize_checkpoint(tmp_path / "gptq", tmp_path / "again", cfg)
    assert transformers and not (tmp_path / "again").exists()


def test_bad_input(tmp_path):
    src = _float_checkpoint(tmp_path / "float")
    cfg = CONFIGS["int4"]
    with pytest.raises(affineq.QuantizationError, match=r"(?s)layers\.0\.self_attn\.q_proj.*group_size"):
        affineq.quantize_checkpoint(src, tmp_path / "bad", affineq.Int4WeightOnlyConfig(group_size=48))
    assert not (tmp_path / "bad").exists()  # checked from the headers, before anything was written
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        affineq.quantize_checkpoint(tmp_path, tmp_path / "x", cfg)
    with pytest.raises(ValueError, match="does not exist"):
        affineq.quantize_checkpoint(tmp_path / "nope", tmp_path / "x", cfg)
    with pytest.raises(TypeError, match="config instance"):
        affineq.quantize_checkpoint(src, tmp_path / "x", affineq.Int4WeightOnlyConfig)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        affineq.quantize_checkpoint(src, tmp_path / "x", cfg, max_shard_bytes=0)
    with pytest.raises(affineq.QuantizationError, match="calibration"):
        affineq.quantize_checkpoint(src, tmp_path / "x", affineq.GPTQConfig(cfg))
    with pytest.raises(ValueError, match="pass model="):
        affineq.quantize_checkpoint(src, tmp_path / "x", _Plan())
    with pytest.raises(ValueError, match=r"model= does not match the checkpoint.*\(64, 64\) in the file"):
        affineq.quantize_checkpoint(src, tmp_path / "x", cfg, model=lambda: TinyLM(TinyLMConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)))
    with pytest.raises(ValueError, match="shares no parameter name"):
        affineq.quantize_checkpoint(src, tmp_path / "x", cfg, model=lambda: torch.nn.Sequential(_meta_model()))
    with pytest.raises(affineq.QuantizationError, match="selects no weight"):
        affineq.quantize_checkpoint(src, tmp_path / "x", cfg, filter_fn=lambda name, shape: False)
    assert not (tmp_path / "x").exists()
    affineq.quantize_checkpoint(src, tmp_path / "q", cfg)
    with pytest.raises(ValueError, match="already holds a safetensors checkpoint"):
        affineq.quantize_checkpoint(src, tmp_path / "q", cfg)
    with pytest.raises(ValueError, match="already an affineq-quantized checkpoint"):
        affineq.quantize_checkpoint(tmp_path / "q", tmp_path / "y", cfg)
    other = build_tiny_lm(**{**TINY, "layers": 3})
    with torch.device("meta"):
        other = TinyLM(other.config)
    with pytest.raises(ValueError, match=r"does not match the model.*layers\.2\."):
        affineq.load_quantized(other, tmp_path / "q")
    assert all(p.is_meta for p in other.parameters())  # checked before anything was placed


class _Plan(affineq.plan.ModelConfig):
    """A whole-model config: it needs the model's modules."""

    def to_fqn_config(self, model):
        return affineq.FqnToConfig({"_default": CONFIGS["int4"]})


# -- peak memory: a checkpoint larger than what quantizing it takes ----------------------------------------------

_GENERATE = textwrap.dedent("""
    import json, sys, torch, safetensors.torch
    from pathlib import Path
    d = Path(sys.argv[1]); d.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for s in range(3):  # 3 shards x 4 Linear weights [2048, 3072] fp32 (24 MiB each): 288 MiB
        part = {f"layers.{4 * s + i}.proj.weight": torch.randn(2048, 3072, generator=g) for i in range(4)}
        part[f"layers.{s}.norm.weight"] = torch.ones(3072)
        name = f"model-{s + 1:05d}-of-00003.safetensors"
        safetensors.torch.save_file(part, d / name)
        weight_map.update({k: name for k in part})
        del part
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
""")

_QUANTIZE = textwrap.dedent("""
    import gc, json, sys, torch, affineq
    from affineq.process_memory import status_bytes, trim_heap
    cfg = affineq.Int4WeightOnlyConfig(group_size=128)
    cfg.quantize_weight(torch.randn(256, 256), torch.nn.Linear(256, 256))  # load the kernels first
    gc.collect(); trim_heap()
    base = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    info = affineq.quantize_checkpoint(sys.argv[1], sys.argv[2], cfg)
    print(json.dumps({"delta": status_bytes("VmHWM") - base, "quantized": info.quantized_bytes,
                      "src": info.src_bytes, "n": len(info.quantized)}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_peak_memory_below_the_checkpoint(tmp_path):
    """Peak RSS (VmHWM, which counts the mmapped pages read) of quantize_checkpoint in a fresh process over a
    288 MiB float checkpoint stays below quantized size + 2 x the largest float tensor + 32 MiB, itself well
    below the checkpoint: the float model is never held."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    src, dst = tmp_path / "float", tmp_path / "int4"
    subprocess.run([sys.executable, "-c", _GENERATE, str(src)], check=True, env=env, timeout=120)
    res = subprocess.run([sys.executable, "-c", _QUANTIZE, str(src), str(dst)], capture_output=True, text=True,
                         env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    largest = 2048 * 3072 * 4
    bound = r["quantized"] + 2 * largest + 32 * 2**20
    assert r["n"] == 12 and r["src"] > 288 * 2**20 > 1.8 * bound
    assert r["delta"] < bound, f"peak {r['delta'] / 2**20:.0f} MiB >= bound {bound / 2**20:.0f} MiB"
    assert sum(f.stat().st_size for f in dst.glob("*.safetensors")) < r["src"] / 6
