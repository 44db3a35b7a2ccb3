"""affineq.hf: quantize on load, save_pretrained -> from_pretrained round trips, on tiny random Llama and BERT
models built locally (no downloads)."""

import json
import os

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("affineq.hf needs transformers >= 5", allow_module_level=True)

from conftest import _bits  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import affineq  # noqa: E402
from affineq.hf import AffineqConfig, set_quantization_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")


def _llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _bert() -> BertModel:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=64)
    return BertModel(cfg).eval()


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    out = {}
    for name, model in (("llama", _llama()), ("llama-untied", _llama(tied=False)), ("bert", _bert())):
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _load(path, auto=AutoModelForCausalLM, **kw):
    return auto.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".safetensors")


def assert_same_model(a: nn.Module, b: nn.Module) -> int:
    """Every parameter bit-identical (quantized: same spec and inner tensors); returns #quantized."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    n = 0
    for k, x in pa.items():
        y = pb[k]
        if isinstance(x, affineq.AffineQuantizedTensor):
            assert isinstance(y, affineq.AffineQuantizedTensor) and x.spec == y.spec, k
            assert list(x.tensors) == list(y.tensors), k
            for name, t in x.tensors.items():
                assert t.dtype == y.tensors[name].dtype and torch.equal(_bits(t), _bits(y.tensors[name])), (k, name)
            n += 1
        else:
            assert not isinstance(y, affineq.AffineQuantizedTensor) and torch.equal(_bits(x), _bits(y)), k
    return n


TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))

CONFIGS = {
    "int4": affineq.Int4WeightOnlyConfig(group_size=32),
    "int4-dense": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
    "int4-cpu": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
    "int4-plain": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="plain"),
    "int8": affineq.Int8WeightOnlyConfig(),
    "int3-g32": affineq.IntxWeightOnlyConfig(torch.int3, affineq.PerGroup(32)),
    "8da4w": affineq.Int8DynamicActivationInt4WeightConfig(group_size=32),
    "8da8w": affineq.Int8DynamicActivationInt8WeightConfig(),
    "fp8": affineq.Float8WeightOnlyConfig(),
    "fp8-dyn": affineq.Float8DynamicActivationFloat8WeightConfig(),
    "fqn-mix": affineq.FqnToConfig({"re:.*mlp.*": affineq.Int8WeightOnlyConfig(),
                                    "model.layers.1.self_attn.o_proj": None,
                                    "_default": affineq.Int4WeightOnlyConfig(group_size=32)}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_quantize_on_load_and_round_trip(name, float_dirs, tmp_path):
    cfg = CONFIGS[name]
    q = _load(float_dirs["llama"], quantization_config=AffineqConfig(cfg))
    # quantize on load == quantize_ on the float model (lm_head / tied embeddings stay float by default)
    ref = _load(float_dirs["llama"])
    affineq.quantize_(ref, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    n = assert_same_model(q, ref)
    assert n == (13 if name == "fqn-mix" else 14)
    assert not isinstance(q.lm_head.weight, affineq.AffineQuantizedTensor)
    with torch.no_grad():
        want = q(TOKENS).logits
    # save_pretrained -> from_pretrained: exact, safetensors only, smaller than float, nothing re-quantized
    q.save_pretrained(tmp_path / "q")
    files = sorted(f.name for f in (tmp_path / "q").iterdir())
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert "model.safetensors" in files
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "affineq" and affineq.config_from_dict(qc["quant_config"]) == cfg
    assert _dir_bytes(tmp_path / "q") < _dir_bytes(float_dirs["llama"])
    r = _load(tmp_path / "q")
    assert assert_same_model(q, r) == n
    with torch.no_grad():
        assert torch.equal(r(TOKENS).logits, want)


def test_untied_head_named_in_fqn_config_is_quantized(float_dirs, tmp_path):
    cfg = affineq.FqnToConfig({"lm_head": affineq.Int8WeightOnlyConfig(),
                               "_default": affineq.Int4WeightOnlyConfig(group_size=32)})
    q = _load(float_dirs["llama-untied"], quantization_config=AffineqConfig(cfg))
    assert q.lm_head.weight.target_dtype == torch.int8
    ref = _load(float_dirs["llama-untied"])
    affineq.quantize_(ref, cfg)
    assert assert_same_model(q, ref) == 15
    q.save_pretrained(tmp_path / "q", max_shard_size="20KB")  # sharded: several files and an index
    shards = [f for f in (tmp_path / "q").iterdir() if f.suffix == ".safetensors"]
    assert len(shards) > 1 and (tmp_path / "q" / "model.safetensors.index.json").exists()
    assert assert_same_model(q, _load(tmp_path / "q")) == 15


def test_modules_to_not_convert(float_dirs):
    q = _load(float_dirs["llama"], quantization_config=AffineqConfig(affineq.Int8WeightOnlyConfig(),
                                                                     modules_to_not_convert=["model.layers.0"]))
    assert not isinstance(q.model.layers[0].mlp.up_proj.weight, affineq.AffineQuantizedTensor)
    assert isinstance(q.model.layers[1].mlp.up_proj.weight, affineq.AffineQuantizedTensor)


def test_bert_encoder(float_dirs, tmp_path):
    cfg = affineq.Int4WeightOnlyConfig(group_size=32)
    q = _load(float_dirs["bert"], AutoModel, quantization_config=AffineqConfig(cfg))
    skipped = q.hf_quantizer._default_skips  # transformers' default: the last module (the pooler) stays float
    ref = _load(float_dirs["bert"], AutoModel)
    affineq.quantize_(ref, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn not in skipped)
    n = assert_same_model(q, ref)
    assert n >= 12
    ids = TOKENS
    with torch.no_grad():
        want = q(input_ids=ids).last_hidden_state
    q.save_pretrained(tmp_path / "q")
    r = _load(tmp_path / "q", AutoModel)
    assert assert_same_model(q, r) == n
    with torch.no_grad():
        assert torch.equal(r(input_ids=ids).last_hidden_state, want)
    assert _dir_bytes(tmp_path / "q") < _dir_bytes(float_dirs["bert"])


def _calibrated_static(path):
    m = _load(path)
    data = [TOKENS[:1], TOKENS[1:]]
    affineq.quantize_(m, affineq.Int8StaticActivationInt8WeightConfig(),
                      filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "lm_head",
                      calibration_data=data)
    return m


def test_static_and_pre_scaled_weights_round_trip(float_dirs, tmp_path):
    m = _calibrated_static(float_dirs["llama"])
    w = m.model.layers[0].mlp.down_proj.weight
    assert "act_scale" in w.act_tensors
    # an AWQ-style input pre-scale on one weight
    m.model.layers[1].self_attn.q_proj.weight = nn.Parameter(
        m.model.layers[1].self_attn.q_proj.weight.with_act_tensors(act_pre_scale=torch.rand(64) + 0.5),
        requires_grad=False)
    with pytest.raises(ValueError, match="no quantized weights"):
        set_quantization_config(_load(float_dirs["llama"]), affineq.Int8WeightOnlyConfig())
    set_quantization_config(m, affineq.Int8StaticActivationInt8WeightConfig())
    with torch.no_grad():
        want = m(TOKENS).logits
    m.save_pretrained(tmp_path / "q")
    r = _load(tmp_path / "q")
    assert assert_same_model(m, r) == 14
    assert "act_pre_scale" in r.model.layers[1].self_attn.q_proj.weight.act_tensors
    with torch.no_grad():
        assert torch.equal(r(TOKENS).logits, want)
    # model.dequantize(): float weights (pre-scale folded in), no quantization config left
    x = torch.randn(3, 64)
    with torch.no_grad():
        y = torch.nn.functional.linear(x * r.model.layers[1].self_attn.q_proj.weight.act_tensors["act_pre_scale"],
                                       r.model.layers[1].self_attn.q_proj.weight.dequantize())
    r.dequantize()
    assert not any(isinstance(p, affineq.AffineQuantizedTensor) for p in r.parameters())
    assert not getattr(r.config, "quantization_config", None)
    torch.testing.assert_close(r.model.layers[1].self_attn.q_proj(x), y)


def test_tied_quantized_embedding_saved_once(float_dirs, tmp_path):
    # quantize_ on the whole model quantizes the tied lm_head / embedding pair once; it stays tied on reload
    m = _load(float_dirs["llama"])
    cfg = affineq.FqnToConfig({"lm_head": affineq.Int8WeightOnlyConfig(),
                               "_default": affineq.Int4WeightOnlyConfig(group_size=32)})
    affineq.quantize_(m, cfg)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    set_quantization_config(m, cfg)
    m.save_pretrained(tmp_path / "q")
    r = _load(tmp_path / "q")
    assert r.lm_head.weight is r.model.embed_tokens.weight
    assert isinstance(r.lm_head.weight, affineq.AffineQuantizedTensor)
    assert assert_same_model(m, r) == 15


# -- errors ---------------------------------------------------------------------------------------------


def test_config_errors(float_dirs):
    with pytest.raises(ValueError, match="affineq config"):
        AffineqConfig("int4")
    with pytest.raises(ValueError, match="unknown config type"):
        AffineqConfig({"type": "NoSuchConfig"})
    with pytest.raises(ValueError, match="calibration"):
        _load(float_dirs["llama"], quantization_config=AffineqConfig(affineq.Int8StaticActivationInt8WeightConfig()))
    with pytest.raises(affineq.QuantizationError, match="cannot quantize these weights on load"):
        _load(float_dirs["llama"], quantization_config=AffineqConfig(affineq.Int4WeightOnlyConfig(group_size=256)))
    with pytest.raises(affineq.QuantizationError, match="tied to model.embed_tokens.weight"):
        _load(float_dirs["llama"], quantization_config=AffineqConfig(affineq.FqnToConfig(
            {"lm_head": affineq.Int8WeightOnlyConfig()})))
    d = AffineqConfig(CONFIGS["fqn-mix"], modules_to_not_convert=["x"]).to_dict()
    back = AffineqConfig.from_dict(json.loads(json.dumps(d)))
    assert back.quant_config == CONFIGS["fqn-mix"] and back.modules_to_not_convert == ["x"]


@pytest.fixture(scope="module")
def saved_int4(float_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "int4"
    _load(float_dirs["llama"], quantization_config=AffineqConfig(CONFIGS["int4-plain"])).save_pretrained(out)
    return out


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_pre_quantized_weights_take_the_dtype_given_to_from_pretrained(saved_int4):
    # dtype=bf16 makes every float parameter bf16; the quantized ones take it as their logical dtype (codes and
    # qparams as stored), so the model computes, dequantizes and reports one dtype
    f32, b16 = _load(saved_int4), AutoModelForCausalLM.from_pretrained(saved_int4, dtype=torch.bfloat16).eval()
    quantized = {k: p for k, p in f32.named_parameters() if isinstance(p, affineq.AffineQuantizedTensor)}
    assert len(quantized) == 14
    params = dict(b16.named_parameters())
    for k, p in quantized.items():
        q = params[k]
        assert isinstance(q, affineq.AffineQuantizedTensor) and q.dtype == torch.bfloat16, k
        assert q.spec == p.spec.replace(dtype=torch.bfloat16), k
        for name, t in p.tensors.items():
            assert torch.equal(_bits(t), _bits(q.tensors[name])), (k, name)
    assert {p.dtype for p in b16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert b16(TOKENS).logits.dtype == torch.bfloat16
        b16.dequantize()
        assert {p.dtype for p in b16.parameters()} == {torch.bfloat16}
        assert b16(TOKENS).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("case, match", [
    ("truncated", "truncated or corrupted"),
    ("flipped byte", "checksum"),
    ("no metadata", "no affineq metadata"),
    ("newer version", "upgrade affineq"),
    ("config type", "unknown config type"),
])
def test_corrupted_checkpoints_fail_cleanly(saved_int4, tmp_path, case, match):
    d = _copy(saved_int4, tmp_path / "c")
    st = d / "model.safetensors"
    raw = bytearray(st.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    if case == "truncated":
        st.write_bytes(bytes(raw[: len(raw) // 2]))
    elif case == "flipped byte":
        key = next(k for k in header if k.endswith(":qdata"))
        start = 8 + n + header[key]["data_offsets"][0]
        raw[start] ^= 0x01
        st.write_bytes(bytes(raw))
    elif case in ("no metadata", "newer version"):
        meta = header["__metadata__"]
        if case == "no metadata":
            del meta["affineq"]
        else:
            m = json.loads(meta["affineq"])
            m["version"] = 99
            meta["affineq"] = json.dumps(m)
        new = json.dumps(header).encode()
        new += b" " * (-len(new) % 8)
        st.write_bytes(len(new).to_bytes(8, "little") + new + bytes(raw[8 + n:]))
    elif case == "config type":
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["quant_config"]["type"] = "FancyConfig"
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        _load(d)


# -- real models (skipped when not installed) ----------------------------------------------------------


def _need_minilm():
    from affineq import models

    if not models.available_models()["minilm"]:
        pytest.skip("all-MiniLM-L6-v2 is not installed")
    return models


def test_minilm_quantize_on_load():
    models = _need_minilm()
    q = _load(models.minilm_path(), AutoModel, quantization_config=AffineqConfig(affineq.Int8WeightOnlyConfig()))
    assert sum(isinstance(p, affineq.AffineQuantizedTensor) for p in q.parameters()) == 37
    ref, tok = models.load_minilm()
    with torch.no_grad():
        sim = models.embedding_similarity(models.embed(ref, tok, models.SENTENCES),
                                          models.embed(q, tok, models.SENTENCES))
    assert sim > 0.999


def test_demo_save_and_load_minilm(tmp_path, capsys):
    from affineq.demo import main

    _need_minilm()
    main(["--model", "minilm", "--save", str(tmp_path / "m"), "--config", "int8", "--no-progress"])
    assert "model.safetensors" in capsys.readouterr().out
    row = main(["--load", str(tmp_path / "m"), "--no-progress"])[0]
    assert row["quantized_weights"] == 37 and row["similar_pair_cos"] > 0.5  # demo --save: quantize_, all 37
    with pytest.raises(SystemExit, match="not a transformers model"):
        main(["--model", "tiny", "--save", str(tmp_path / "t")])


def test_install_registers_when_transformers_is_imported_later():
    import subprocess
    import sys

    code = ("import sys, affineq; from affineq._hf_register import install; install(); "
            "assert 'transformers' not in sys.modules; import transformers; "
            "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as m; "
            "assert m['affineq'].__name__ == 'AffineqConfig'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]


def test_set_quantization_config_on_a_plain_module_is_a_value_error_naming_the_way_out():
    m = nn.Sequential(nn.Linear(64, 64))
    affineq.quantize_(m, affineq.Int8WeightOnlyConfig())
    before = dict(vars(m))
    with pytest.raises(ValueError, match=r"model is a Sequential, not a transformers PreTrainedModel.*save_file"):
        set_quantization_config(m, affineq.Int8WeightOnlyConfig())
    assert dict(vars(m)) == before and not hasattr(m, "hf_quantizer")  # nothing was set
