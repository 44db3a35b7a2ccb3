"""The README's code blocks, shared by tests/test_readme.py and benchmarks/run_readme_blocks.py.

A block is a ```python fence in README.md; an HTML comment line `<!-- readme: slow -->` right before the fence
marks it too slow for CI (run only by run_readme_blocks.py). Each block runs as written, in a fresh namespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SLOW_MARK = "<!-- readme: slow -->"
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    slow: bool


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of `path`, in order; an unclosed fence is a ValueError naming its line."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{start + 1}: code fence never closed")
        slow = start > 0 and lines[start - 1].strip() == SLOW_MARK
        out.append(Block(start + 1, m.group(1), "\n".join(lines[start + 1:j]) + "\n", slow))
        i = j + 1
    return out


def python_blocks(path: Path = README) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python"]


def run_block(block: Block) -> dict:
    """Execute one block in a fresh namespace (the caller picks the working directory)."""
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
    return namespace
