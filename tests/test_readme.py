"""Every ```python block of README.md runs as written, alone, in a fresh namespace and an empty working
directory; the README has exactly the two set-up commands, and its test command is CI's."""

import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from readme_blocks import blocks, python_blocks, run_block  # noqa: E402

SETUP_PREFIX = "pip install torch==2.13.0"
FAST = [b for b in python_blocks() if not b.slow]


@pytest.mark.parametrize("block", FAST, ids=[f"line{b.line}" for b in FAST])
def test_readme_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"affineq\.\w+ moved to")  # the README uses the new spellings
        run_block(block)


def test_readme_has_python_blocks_and_few_slow_ones():
    all_blocks = python_blocks()
    assert len(all_blocks) >= 10
    assert sum(b.slow for b in all_blocks) <= 2


def _ci_test_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if "README test command" in line)
    return lines[i + 1].strip()


def test_readme_has_exactly_the_two_setup_commands_and_the_ci_test_command():
    setup = [b.code.strip() for b in blocks() if b.lang == "bash" and b.code.startswith(SETUP_PREFIX)]
    assert len(setup) == 2
    demo, tests = setup
    assert demo.endswith("python -m affineq.demo") and "\n" not in demo
    assert tests == _ci_test_command()


def test_block_parser_marks_slow_blocks_and_refuses_an_unclosed_fence(tmp_path):
    md = tmp_path / "r.md"
    md.write_text("text\n```python\na = 1\n```\n<!-- readme: slow -->\n```python\nb = 2\n```\n```bash\nls\n```\n")
    got = [(b.line, b.lang, b.code, b.slow) for b in blocks(md)]
    assert got == [(2, "python", "a = 1\n", False), (6, "python", "b = 2\n", True), (9, "bash", "ls\n", False)]
    assert run_block(python_blocks(md)[1])["b"] == 2
    md.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match=r"r.md:1: code fence never closed"):
        blocks(md)
