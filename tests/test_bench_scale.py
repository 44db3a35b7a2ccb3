"""benchmarks/bench_scale.py's bookkeeping: which bodies the 1B/8B rows run (--quick, --no-big, --big-only), and
how a run's rows are merged into the saved results (a --big-only run keeps the 1B rows)."""

import argparse
import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scale.py"
_spec = importlib.util.spec_from_file_location("bench_scale", _PATH)
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_scale"] = bs
_spec.loader.exec_module(bs)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"small": "s", "big": "b", "quick": False, "no_big": False, "big_only": False, **kw})


def test_bodies_for_each_flag():
    assert bs.bodies(_args()) == ["b", "s"]
    assert bs.bodies(_args(quick=True)) == ["s"]
    assert bs.bodies(_args(no_big=True)) == ["s"]
    assert bs.bodies(_args(big_only=True)) == ["b"]
    assert bs.bodies(_args(big_only=True, quick=True)) == ["b"]  # the 8B rows with the quick sizes


def test_big_only_and_no_big_exclude_each_other(capsys):
    try:
        bs.main(["--big-only", "--no-big", "--rows", "memory"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("main accepted --big-only with --no-big")
    assert "--big-only and --no-big" in capsys.readouterr().err


def test_merge_group_replaces_rows_by_name_and_keeps_the_others():
    old = {"bandwidth_gbs": 51.8, "rows": [{"row": "1b int4", "bandwidth_fraction": 0.6}, {"row": "8b int4", "x": 1}]}
    got = bs.merge_group(old, [{"row": "8b int4", "x": 2}, {"row": "8b int8", "x": 3}], {"bandwidth_gbs": 40.0})
    assert got["bandwidth_gbs"] == 40.0
    assert got["rows"] == [{"row": "1b int4", "bandwidth_fraction": 0.6, "read_bandwidth_gbs": 51.8},
                           {"row": "8b int4", "x": 2}, {"row": "8b int8", "x": 3}]
    assert bs.merge_group(None, [{"row": "a"}], {"threads": 2}) == {"threads": 2, "rows": [{"row": "a"}]}


def test_report_of_no_rows_prints_the_header(capsys):
    """A group whose rows were all skipped (nothing prepared) still reports: the table's header alone."""
    bs.report("decode", [], float("nan"))
    out = capsys.readouterr().out
    assert "## decode" in out and "decode_tok_s" in out and "bandwidth_fraction" in out


def test_rows_skip_checkpoints_that_were_not_prepared(tmp_path, capsys):
    """A row whose checkpoint --prepare did not write is skipped with the directory to prepare (it used to crash
    the whole run inside transformers), and the llama.cpp rows without a venv likewise: no subprocess starts."""
    a = _args(threads=2, repeats=1, eager_big=False, no_big=True)
    assert bs.rows_prefill(a, tmp_path, None) == []
    assert bs.rows_batch(a, tmp_path) == []
    assert bs.rows_long_context(a, tmp_path) == []
    assert bs.rows_decode(a, tmp_path, None) == []
    out = capsys.readouterr().out
    for cfg in ("int4-g32", "int8"):
        assert f"skipped s {cfg}: no {tmp_path / f's-{cfg}'} (run --prepare)" in out
    assert f"skipped s bf16: no {tmp_path / 's'} (run --prepare)" in out


def test_stored_tensors_are_the_bytes_a_decode_step_reads():
    # weights_read_gbs reads exactly the Linear weights' stored bytes (the decode row's MB per token), each
    # shared weight once; a float Linear's weight is itself.
    import torch
    from common import stored_tensors, weights_read_gbs

    import affineq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64),
                                torch.nn.Linear(64, 32))
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=32),
                      filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "3")
    model.append(model[0])  # the same weight twice: read once
    got = stored_tensors(model)
    stored = sum(t.numel() * t.element_size() for t in got)
    assert stored == model[0].weight.storage_bytes() + model[2].weight.storage_bytes() + 32 * 64 * 4
    assert all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in got) and weights_read_gbs(got) > 0


def test_report_puts_the_weights_read_fraction_beside_the_probes(capsys):
    row = {"row": "8b int4", "weight_bytes_per_token": 4e9, "ms_per_step": 100.0, "run_bandwidth_fraction": [0.5, 0.6],
           "run_read_bandwidth_gbs": [80.0, 66.0], "run_weights_read_fraction": [0.9, 0.8, 0.85],
           "run_weights_read_gbs": [44.0, 50.0, 47.0]}
    bs.report("decode", [row], bandwidth=70.0)
    assert (row["bandwidth_fraction"], row["read_bandwidth_gbs"]) == (0.55, 73.0)
    assert (row["weights_read_fraction"], row["weights_read_gbs"]) == (0.85, 47.0)
    assert "weights_read_fraction" in capsys.readouterr().out
