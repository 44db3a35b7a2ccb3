"""torch.compile's on-disk caches keyed on affineq's dispatch state too.

AOTAutograd caches what a graph expands to, keyed on the dynamo graph: for a quantized model that graph holds
`F.linear` calls on `AffineQuantizedTensor` inputs, and the kernel each one runs is chosen later, while the
subclass is expanded. Two processes with the same model but another choice (a row threshold changed with
`set_min_rows`, the C++ kernels disabled, strict mode, another CPU kind, another build of the C++ kernels or
another affineq source tree) got the same key, so the second ran what the first had traced: the setting was
silently ignored.

`torch.compiler.config.cache_key_tag` is part of every compile cache key. affineq appends its part to it,
"|affineq:<digest>", a digest of what the kernel choice reads: the package's sources (path, size, mtime of each
.py / .cpp / .h file) and each registered state (`track`). Modules that own such state register it and call
`refresh()` after changing it. A user's own tag stays in front. Graphs already compiled in this process keep their
kernels (dynamo's in-memory cache does not see these settings); `torch._dynamo.reset()` recompiles them.
The kernel choice refreshes the tag while a graph is traced (`refresh_while_tracing`), before its key is
computed, so the state keyed is the one the trace read. The tag is process-wide: graphs without quantized tensors
are keyed on it too (after an affineq upgrade they compile once more, never to a wrong graph).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from affineq._version import __version__

__all__ = ["refresh", "refresh_while_tracing", "state_digest", "traced_in_this_process", "track"]

_PREFIX = "|affineq:"
_providers: dict[str, Callable[[], object]] = {}
_suffix = ""  # the part of cache_key_tag this module set last
_traced = False  # whether a graph with quantized linears was traced in this process


@functools.cache
def _sources_digest() -> str:
    """The package's version and its source files' (path, size, mtime_ns): a changed or upgraded tree differs."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256(__version__.encode())
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def state_digest() -> str:
    """A digest of the sources and of every tracked state, as they are now (16 hex digits)."""
    state = {"sources": _sources_digest(), **{name: provider() for name, provider in _providers.items()}}
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def refresh() -> None:
    """Set affineq's part of torch.compiler.config.cache_key_tag to the current `state_digest()`."""
    global _suffix
    tag = torch.compiler.config.cache_key_tag
    base = tag[: -len(_suffix)] if _suffix and tag.endswith(_suffix) else tag
    _suffix = _PREFIX + state_digest()
    torch.compiler.config.cache_key_tag = base + _suffix


def track(name: str, provider: Callable[[], object]) -> None:
    """Key the compile caches on provider() too (a JSON-able value the kernel choice reads), from now on."""
    _providers[name] = provider
    refresh()


@torch.compiler.assume_constant_result  # dynamo runs it once, as it traces, instead of tracing hashlib and json
def refresh_while_tracing() -> bool:
    """`refresh()` from code dynamo traces (the kernel choice): the graph is then keyed on the state as it is
    while it is traced (this thread's strict mode, an environment variable changed since, a cache_key_tag the
    user set since), not as it was at the last setter call."""
    global _traced
    _traced = True
    refresh()
    return True


def traced_in_this_process() -> bool:
    """Whether a graph with quantized linears was traced in this process: a setting changed now does not reach
    it (dynamo's in-memory cache keeps its kernels until `torch._dynamo.reset()`)."""
    return _traced
