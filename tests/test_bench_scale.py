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
