"""affineq.gguf.quantize_blocks / GGUFBlockConfig: ggml's legacy block quantizers, byte for byte against the
`gguf` package's (`gguf.quants.quantize`, a port of ggml's reference code), and models that save to GGUF as
those types exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import affineq
from affineq import gguf as ag
from affineq.gguf import types
from affineq.tensor.affine import AffineQuantizedTensor

gguf = pytest.importorskip("gguf")
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def _weights() -> np.ndarray:
    g = np.random.default_rng(3)
    w = (g.standard_normal((16, 128)) * g.uniform(0.001, 3.0, (16, 1))).astype(np.float32)
    w[0, :32] = 0.0  # d = 0
    w[1, 32:64] = 0.5  # min = max
    w[2, :32] = -2.0
    w[2, 7] = 2.0  # the first largest magnitude is negative, then a positive tie
    w[3, :32] = np.linspace(-1, 1, 32) / 127 * 63.5  # halves for Q8_0's round-half-away
    return w


@pytest.mark.parametrize("kind", TYPES)
def test_bytes_equal_gguf_quantize(kind):
    w = _weights()
    q = ag.quantize_blocks(torch.from_numpy(w), kind)
    assert isinstance(q, AffineQuantizedTensor) and q.spec.fmt == "dense"
    written, data, shape = types.from_tensor("w", q)
    assert written == kind and shape == w.shape
    np.testing.assert_array_equal(data, gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]))
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(q.dequantize().numpy().view(np.uint32), ref.view(np.uint32))


def test_logical_dtype_follows_the_weight():
    q = ag.quantize_blocks(torch.from_numpy(_weights()).bfloat16(), "Q4_1")
    assert q.dtype == torch.bfloat16 and q.dequantize().dtype == torch.bfloat16


def test_bad_input():
    with pytest.raises(ValueError, match="ggml_type='Q4_K'"):
        ag.quantize_blocks(torch.zeros(4, 32), "Q4_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        ag.quantize_blocks(torch.zeros(4, 48), "Q4_0")
    with pytest.raises(TypeError, match="floating point"):
        ag.quantize_blocks(torch.zeros(4, 32, dtype=torch.int32), "Q4_0")
    with pytest.raises(ValueError, match="overflows fp16"):
        ag.quantize_blocks(torch.full((1, 32), 1e30), "Q8_0")
    with pytest.raises(ValueError, match="NaN"):
        ag.quantize_blocks(torch.full((1, 32), float("nan")), "Q8_0")
    with pytest.raises(ValueError, match="ggml_type='Q41'"):
        ag.GGUFBlockConfig("Q41")


def test_config_model_saves_as_that_type_bit_identical(tmp_path):
    """A Llama quantized with GGUFBlockConfig("Q4_1") (asymmetric: fp16 scale and min) -> save_model: every
    weight Q4_1; load_model gives the same values back; a layer of width 48 is left alone with a reason."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    affineq.quantize_(model, ag.GGUFBlockConfig("Q4_1"))
    params = dict(model.named_parameters())
    assert all(isinstance(p, AffineQuantizedTensor) for n, p in params.items() if n.endswith("proj.weight"))
    path = tmp_path / "m.gguf"
    ag.save_model(model, path)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {k for n, k in kinds.items() if "norm" not in n and "embd" not in n} == {"Q4_1"}  # quantize_: Linear
    back = dict(ag.load_model(path).named_parameters())
    for name, p in params.items():
        a = p.dequantize() if isinstance(p, AffineQuantizedTensor) else p.detach()
        b = back[name].dequantize() if isinstance(back[name], AffineQuantizedTensor) else back[name].detach()
        assert torch.equal(a.float().view(torch.int32), b.float().view(torch.int32)), name
    assert ag.GGUFBlockConfig("Q8_0").check(torch.nn.Linear(48, 8)) is not None


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q8_0"])
def test_chunked_load_equals_one_shot(monkeypatch, kind):
    """load_file decodes legacy tensors a few panels of rows at a time (small temporaries): three chunks and a
    ragged tail give the same stored tensors as decoding at once, and gguf's values."""
    from affineq.gguf import blocks
    from affineq.gguf.reader import GGUFEntry

    w = np.random.default_rng(5).standard_normal((37, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    monkeypatch.setattr(types, "_CHUNK_ELEMENTS", 64)  # 16 rows per chunk: 16 + 16 + 5
    got = types.to_tensor(GGUFEntry("w", kind, (37, 64), raw))
    want = types.legacy_tensor(kind, *blocks.decode(kind, torch.from_numpy(raw.copy()), 64))
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name], t), name
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(got.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
