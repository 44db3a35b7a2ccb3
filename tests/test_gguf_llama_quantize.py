"""benchmarks/_llama_cpp_quantize.py's torch-free wrapper, without llama.cpp: argument checks, the message when
the venv is absent, and the GGUF imatrix -> mean x^2 conversion (sums / counts, as llama-quantize normalizes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_llama_cpp_quantize.py"
_spec = importlib.util.spec_from_file_location("_llama_cpp_quantize", _PATH)
lq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lq)


def test_bad_arguments_and_missing_venv(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setenv("AFFINEQ_LLAMA_QUANT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="ftype='Q4_K_X'.*Q4_K_M"):
        lq.quantize_gguf(src, None, "Q4_K_X", llama_python=tmp_path / "none")
    with pytest.raises(ValueError, match="output_tensor_type='Q4_K_M'"):  # an ftype is not a ggml type
        lq.quantize_gguf(src, None, "Q4_K_M", output_tensor_type="Q4_K_M", llama_python=tmp_path / "none")
    with pytest.raises(ValueError, match="src="):
        lq.quantize_gguf(tmp_path / "absent.gguf", None, "Q4_0", llama_python=tmp_path / "none")
    monkeypatch.delenv("AFFINEQ_LLAMA_PYTHON", raising=False)
    monkeypatch.setattr(lq, "HERE", tmp_path)  # no .venv-llamacpp next to it
    with pytest.raises(lq.LlamaCppUnavailable, match="llama-cpp-python"):
        lq.quantize_gguf(src, None, "Q4_0")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_gguf_imatrix_becomes_mean_square_per_column(tmp_path):
    sums = np.arange(1, 9, dtype=np.float32)  # 2 experts x 4 columns
    counts = np.array([4.0, 0.0], np.float32)  # the second expert saw no tokens: llama.cpp uses ones
    w = gguf.GGUFWriter(str(tmp_path / "im.gguf"), "imatrix")
    w.add_tensor("blk.0.ffn_down.weight.in_sum2", sums.reshape(2, 4))
    w.add_tensor("blk.0.ffn_down.weight.counts", counts.reshape(2, 1))
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.full((1, 3), 6.0, np.float32))
    w.add_tensor("blk.0.attn_q.weight.counts", np.array([[3.0]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = np.load(lq._imatrix_npz(tmp_path / "im.gguf", tmp_path))
    np.testing.assert_array_equal(out["blk.0.ffn_down.weight"], [0.25, 0.5, 0.75, 1.0, 1, 1, 1, 1])
    np.testing.assert_array_equal(out["blk.0.attn_q.weight"], [2.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="legacy .dat"):
        lq._imatrix_npz(tmp_path / "im.dat", tmp_path)


def _fake_tool(path: Path, script: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_llama_tools_missing_then_fake_imatrix_and_kld(tmp_path, monkeypatch):
    """The built tools (build_llama_tools.sh's DIR/bin): absent -> LlamaCppUnavailable naming the script; then
    stand-ins that write -o / --kl-divergence-base and print llama-perplexity's statistics lines."""
    monkeypatch.setenv("AFFINEQ_LLAMA_QUANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AFFINEQ_LLAMA_TOOLS", raising=False)
    monkeypatch.setattr(lq, "HERE", tmp_path / "benchmarks")  # no .llama-tools in the "repository"
    model, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    model.write_bytes(b"GGUF")
    text.write_text("some text\n")
    with pytest.raises(lq.LlamaCppUnavailable, match="build_llama_tools.sh"):
        lq.llama_imatrix(model, text)
    with pytest.raises(lq.LlamaCppUnavailable, match="build_llama_tools.sh"):
        lq.llama_kld(model, model, text)
    tools = tmp_path / "tools"
    # writes the file after -o / --kl-divergence-base (the argument after it) and echoes its arguments
    writer = 'prev=""; for a in "$@"; do [ "$prev" = "-o" ] || [ "$prev" = "--kl-divergence-base" ] && ' \
             'out="$a"; prev="$a"; done\necho "args: $*"\n'
    _fake_tool(tools / "bin" / "llama-imatrix", writer + 'echo imatrix > "$out"\n')
    monkeypatch.setenv("AFFINEQ_LLAMA_TOOLS", str(tools))
    path, log = lq.llama_imatrix(model, text, ctx=64, chunks=2)
    assert path.read_text() == "imatrix\n" and "-c 64" in log and "--chunks 2" in log
    assert lq.llama_imatrix(model, text, ctx=64, chunks=2)[0] == path  # cached
    _fake_tool(tools / "bin" / "llama-perplexity", writer + '[ -f "$out" ] || echo logits > "$out"\n'
               'echo "Mean PPL(Q)                   :   9.410200 ±   0.1"\n'
               'echo "Mean PPL(base)                :   8.503300 ±   0.1"\n'
               'echo "Mean    KLD:   0.131200 ±   0.004"\necho "99.0%   KLD:   0.665500"\n'
               'echo "Same top p:  82.260 ± 1.2 %"\n')
    stats = lq.llama_kld(model, model, text, ctx=64, chunks=2, tools=tools)
    assert stats == {"ppl": 9.4102, "ppl_base": 8.5033, "mean_kld": 0.1312, "kld_p99": 0.6655,
                     "top1_agreement": pytest.approx(0.8226)}
