"""benchmarks/bench_decode.py's bookkeeping that CI can run: the bytes a llama.cpp decode step reads from a GGUF
file (the llama.cpp row itself needs the benchmark venv)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
from affineq import gguf as ag  # noqa: E402

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode.py"
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bd = importlib.util.module_from_spec(_spec)
sys.modules["bench_decode"] = bd
_spec.loader.exec_module(bd)


def test_gguf_bytes_per_token_counts_each_read_tensor_once(tmp_path):
    # F32 tensors: 4 bytes per element. A tied file (no output.weight) reads token_embd as its output matrix; with
    # its own output.weight, token_embd is only looked up row by row and not counted.
    body = {"blk.0.attn_q.weight": torch.ones(8, 16), "output_norm.weight": torch.ones(16)}
    tied = tmp_path / "tied.gguf"
    ag.save_file({"token_embd.weight": torch.ones(32, 16), **body}, tied, arch="llama")
    assert bd._gguf_bytes_per_token(tied) == 4 * (32 * 16 + 8 * 16 + 16)
    untied = tmp_path / "untied.gguf"
    ag.save_file({"token_embd.weight": torch.ones(32, 16), "output.weight": torch.ones(32, 16), **body}, untied,
                 arch="llama")
    assert bd._gguf_bytes_per_token(untied) == 4 * (32 * 16 + 8 * 16 + 16)
