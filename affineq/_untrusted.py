"""Reading what a user downloads: file names from an index or a loader that must stay inside their checkpoint
directory, and JSON whose nesting must not exhaust the interpreter's stack.

Every path affineq resolves from a checkpoint (index entries, the files transformers hands the quantizer,
the file of a single-file checkpoint) goes through `inside`, and every JSON document it parses through
`parse_json`: a hostile file gets a `ValueError` naming the entry, never a read outside the directory or a
`RecursionError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["inside", "parse_json", "read_json"]


def _allowed_roots(root: Path) -> list[Path]:
    """`root` after resolving symlinks, plus the blob store of a Hugging Face hub cache snapshot
    (``<repo>/snapshots/<rev>/f -> ../../blobs/<hash>``: the hub's own layout, the one link that leaves)."""
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def inside(root: str | os.PathLike, name: str | os.PathLike, what: str) -> Path:
    """`root / name`, refused (ValueError naming `what` and `name`) unless it lies inside `root` after
    resolving symlinks (`..`, absolute names and links leading elsewhere are refused; a hub cache snapshot's
    links into its own ``blobs`` are allowed). Returns the unresolved path (names stay as the index wrote them)."""
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        raise ValueError(f"{what}: {name!r} is not a file name; an index must map tensors to file names in its "
                         "directory")
    base = Path(root)
    path = base / name
    real = path.resolve()
    if not any(real == r or r in real.parents for r in _allowed_roots(base)):
        raise ValueError(f"{what}: {os.fspath(name)!r} resolves to {os.fspath(real)!r}, outside the checkpoint "
                         f"directory {os.fspath(base)!r}; a checkpoint may only name files inside its own directory "
                         "(the index or a symlink was edited: download the checkpoint again)")
    return path


def parse_json(text: str | bytes, where: str) -> Any:
    """`json.loads(text)`, with every failure (bad syntax, bytes that are not UTF-8, nesting deep enough to
    exhaust the stack) a ValueError naming `where`."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise ValueError(f"{where} is not valid JSON ({e}); the file was edited or corrupted") from None
    except RecursionError:
        raise ValueError(f"{where} nests JSON arrays / objects too deeply to be a file affineq or transformers "
                         "wrote; the file was edited or corrupted") from None


def read_json(path: Path, where: str | None = None) -> Any:
    """`parse_json` of the file `path` (ValueError for unreadable bytes too)."""
    return parse_json(path.read_bytes(), where or os.fspath(path))
