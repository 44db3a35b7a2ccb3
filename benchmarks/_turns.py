"""Two benchmark processes taking turns, so that paired rows see the same machine (bench_scale's decode rows).

Plain Python (no torch): the llama-cpp-python venv's row script imports it too. Role 0 and role 1 share a
directory; ``wait()`` blocks until the partner has passed the turn with ``give()`` (a file ``turn<role>``). Role 1
starts the game once it has loaded (``start()``), so each side's loading and compiling is never timed against the
other's work: the timed runs alternate 0, 1, 0, 1, ... and only one process runs at a time.
"""

from __future__ import annotations

import os
import time


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped by its parent) still answers kill(0): read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Turns:
    def __init__(self, directory: str, role: int, timeout_s: float = 3600.0, partner: int | None = None) -> None:
        """``partner``: the other process's pid where known; ``wait`` fails at once when it has exited."""
        if role not in (0, 1):
            raise ValueError(f"role must be 0 or 1, got {role!r}")
        self.dir, self.role, self.timeout_s, self.partner = directory, role, timeout_s, partner

    def _file(self, role: int) -> str:
        return os.path.join(self.dir, f"turn{role}")

    def start(self) -> None:
        """Role 1, once loaded: lets role 0 take the first turn."""
        if self.role == 1:
            self.give()

    def wait(self) -> None:
        """Blocks (sleeping) until it is this role's turn; TimeoutError when the partner never passes it."""
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self._file(self.role)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"role {self.role}: no turn from the partner in {self.timeout_s:.0f} s")
            if self.partner is not None and not _alive(self.partner):
                raise RuntimeError(f"role {self.role}: the partner process {self.partner} has exited")
            time.sleep(0.02)
        os.remove(self._file(self.role))

    def give(self) -> None:
        """Passes the turn to the partner."""
        open(self._file(1 - self.role), "w").close()
