"""The demo's table on the built-in tiny LM (fast), and its size accounting."""

import json

import torch
from torch import nn

from affineq import Int4WeightOnlyConfig, quantize_
from affineq.demo import main, model_bytes, quantized_bytes_per_param


def test_demo_runs_on_the_tiny_model_and_writes_json(tmp_path, capsys):
    out = tmp_path / "results.json"
    rows = main(["--model", "tiny", "--config", "int8", "int4-g128", "--tokens", "2", "--eval-tokens", "256",
                 "--repeats", "1", "--no-progress", "--out", str(out)])
    text = capsys.readouterr().out
    assert [r["config"] for r in rows] == ["float32", "bfloat16", "int8", "int4-g128"]
    for header in ("size MB", "B/param", "quant s", "ms/token", "speedup", "perplexity", "change"):
        assert header in text
    assert "the faster float row" in text  # speedups are over the best float path, not float32 alone
    float_mb, bf16_mb, int8_mb, int4_mb = (r["size_mb"] for r in rows)
    assert int4_mb < int8_mb < float_mb / 3 and abs(bf16_mb - float_mb / 2) < 0.01 * float_mb
    assert rows[3]["bytes_per_param"] <= 0.57 and rows[2]["bytes_per_param"] <= 1.03
    assert abs(rows[2]["metric"] - rows[0]["metric"]) / rows[0]["metric"] < 0.01  # int8 ppl within 1%
    assert json.loads(out.read_text())["rows"][3]["config"] == "int4-g128"


def test_model_bytes_counts_stored_bytes_once():
    m = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
    m[1].weight = m[0].weight
    assert model_bytes(m) == 256 * 256 * 4
    quantize_(m, Int4WeightOnlyConfig(group_size=128))
    # 0.5 B per code, bf16 scale and zero per group of 128 (2 groups per row)
    assert model_bytes(m) == m[0].weight.storage_bytes() == 256 * 256 // 2 + 256 * 2 * 4
    assert quantized_bytes_per_param(m) == 0.53125
    assert torch.equal(m[0].weight.qdata, m[1].weight.qdata)
