"""The demo's table on the built-in tiny LM (fast), and its size accounting."""

import json
from types import SimpleNamespace

import torch
from torch import nn

from affineq import Int4WeightOnlyConfig, quantize_
from affineq.demo import KERNEL_WORK, explain_kernels, format_table, main, model_bytes, quantized_bytes_per_param


def test_demo_runs_on_the_tiny_model_and_writes_json(tmp_path, capsys):
    out = tmp_path / "results.json"
    rows = main(["--model", "tiny", "--config", "int8", "int4-g128", "8da4w", "--tokens", "2", "--eval-tokens", "256",
                 "--repeats", "1", "--no-progress", "--out", str(out)])
    text = capsys.readouterr().out
    assert [r["config"] for r in rows] == ["float32", "bfloat16", "int8", "int4-g128", "8da4w"]
    # whether a row quantizes activations is read from the quantized model, for the explanations
    assert [r["activation_quant"] for r in rows] == [False, False, False, False, True]
    assert all(r["kernels"] for r in rows[2:])
    for header in ("size MB", "B/param", "quant s", "ms/token", "speedup", "perplexity", "change"):
        assert header in text
    assert "the faster float row" in text  # speedups are over the best float path, not float32 alone
    float_mb, bf16_mb, int8_mb, int4_mb = (r["size_mb"] for r in rows[:4])
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


def _row(config, latency, kernels=None, activation_quant=False):
    return {"config": config, "size_mb": 1.0, "bytes_per_param": None if kernels is None else 0.5,
            "quantize_s": 0.0, "latency_ms": latency, "metric": 10.0, "kernels": kernels or {},
            "fallbacks": [], "activation_quant": activation_quant}


def test_slower_rows_are_explained_by_the_kernels_they_recorded():
    work = SimpleNamespace(latency_unit="ms/token", metric_name="perplexity", kernels_note="")
    rows = [_row("float32", 2.0), _row("bfloat16", 1.0),
            _row("int4-g128", 1.5, {"affineq.lowbit_linear": 7}),
            _row("8da4w", 1.6, {"affineq.lowbit_linear": 7}, activation_quant=True),
            _row("int8-dyn", 1.7, {"aten._int_mm": 7}),
            _row("int8", 0.5, {"affineq.lowbit_linear": 7})]
    text = format_table(rows, work)
    why = {line.split()[1]: line for line in text.splitlines() if line.startswith("  ! ")}
    assert set(why) == {"int4-g128", "8da4w", "int8-dyn"}  # int8 is faster than bfloat16: no explanation
    assert "unpacks the low-bit weight codes" in why["int4-g128"] and "activation" not in why["int4-g128"]
    assert "fake-quantizes the activation to int8 and unpacks" in why["8da4w"]
    assert "aten._int_mm quantizes the activation to int8" in why["int8-dyn"]
    assert "e.g." not in text


def test_explanations_name_fallbacks_and_every_recorded_kernel():
    fallback = "dequantize:linear dequantizes the whole weight (fallback)"
    assert explain_kernels({"dequantize:linear": 3}, False) == fallback
    assert explain_kernels({}, False) == "no quantized kernel was recorded"
    assert set(KERNEL_WORK) >= {"affineq.lowbit_linear", "aten._int_mm", "aten._scaled_mm", "onednn.qlinear"}

