"""Run every ```python block of README.md, the ones marked `<!-- readme: slow -->` included, each in a fresh
namespace, a fresh temporary working directory and its own process; print pass / fail and seconds per block.

    python benchmarks/run_readme_blocks.py            # all blocks
    python benchmarks/run_readme_blocks.py --slow     # only the blocks marked slow (CI runs the others)

Exit status 1 when any block fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_blocks import README, python_blocks  # noqa: E402

# The child gets the block's text on stdin, so editing README.md during a run changes nothing.
_CHILD = """
import sys
sys.path.insert(0, {bench!r})
from readme_blocks import Block, run_block
run_block(Block({line}, "python", sys.stdin.read(), False))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow", action="store_true", help="run only the blocks marked slow")
    p.add_argument("--timeout", type=float, default=600, help="seconds per block")
    args = p.parse_args(argv)
    chosen = [b for b in python_blocks() if b.slow or not args.slow]
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's affineq, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    failed = 0
    for b in chosen:
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            code = _CHILD.format(bench=str(Path(__file__).resolve().parent), line=b.line)
            try:
                r = subprocess.run([sys.executable, "-c", code], cwd=tmp, input=b.code, capture_output=True,
                                   text=True, timeout=args.timeout, env=env)
                ok, tail = r.returncode == 0, (r.stderr or "").strip().splitlines()[-3:]
            except subprocess.TimeoutExpired:
                ok, tail = False, [f"timed out after {args.timeout:.0f} s"]
        dt = time.perf_counter() - t
        failed += not ok
        mark = "slow" if b.slow else "    "
        print(f"{'PASS' if ok else 'FAIL'}  README.md:{b.line:<4} {mark} {dt:7.1f} s", flush=True)
        if not ok:
            print("      " + "\n      ".join(tail))
    print(f"{len(chosen) - failed} passed, {failed} failed ({README})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
