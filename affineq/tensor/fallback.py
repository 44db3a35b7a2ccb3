"""Announced fallbacks, strict mode and kernel recording.

When no packed kernel can run an op, affineq runs it on the dequantized tensors and says so once per
(format, reason) (`announce_fallback`); in strict mode that is an error instead. `record_kernels()` lists
the kernels that ran. Strict mode and recording are per thread (and per asyncio task): they live in
`contextvars`, so one thread's `strict_kernels()` or `record_kernels()` never sees another thread's work.
A new thread starts with strict mode off, or on when the process has AFFINEQ_STRICT=1.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import warnings
from collections.abc import Iterator

import torch

from affineq import compile_cache

__all__ = [
    "KernelFallbackError",
    "KernelFallbackWarning",
    "announce_fallback",
    "record",
    "record_kernels",
    "reset_announcements",
    "set_strict",
    "strict_kernels",
]

log = logging.getLogger("affineq")


class KernelFallbackWarning(UserWarning):
    """A quantized op ran as dequantize-then-compute (slower than a packed kernel)."""


class KernelFallbackError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


_strict: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "affineq_strict", default=os.environ.get("AFFINEQ_STRICT", "") == "1"
)
compile_cache.track("strict", _strict.get)  # a strict compile must trace (and raise), not reuse a lenient graph
_recorders: contextvars.ContextVar[tuple[list[str], ...]] = contextvars.ContextVar("affineq_recorders", default=())
_announced: set[tuple[str, str]] = set()
_announced_lock = threading.Lock()


def _check_flag(flag) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"strict flag must be True or False, got {flag!r} ({type(flag).__name__}); "
                        "a string such as 'False' would read as true")
    return flag


def set_strict(flag: bool) -> None:
    """Make every dequantize fallback in this thread raise `KernelFallbackError` instead of warning."""
    _strict.set(_check_flag(flag))
    compile_cache.refresh()


@torch.compiler.assume_constant_result  # dynamo cannot read a ContextVar: it calls this once, when it traces
def is_strict() -> bool:
    """Whether strict mode is on in this thread."""
    return _strict.get()


@contextlib.contextmanager
def strict_kernels(flag: bool = True) -> Iterator[None]:
    """Strict mode (`set_strict`) inside the block, for this thread only."""
    token = _strict.set(_check_flag(flag))
    compile_cache.refresh()
    try:
        yield
    finally:
        _strict.reset(token)
        compile_cache.refresh()


@contextlib.contextmanager
def record_kernels() -> Iterator[list[str]]:
    """Collect the name of every kernel that runs in this thread inside the block ("dequantize:<op>" for
    fallbacks). Nested blocks each see everything that runs inside them."""
    names: list[str] = []
    token = _recorders.set(_recorders.get() + (names,))
    try:
        yield names
    finally:
        _recorders.reset(token)


def record(name: str) -> None:
    """Add `name` to every active `record_kernels()` list of this thread."""
    for names in _recorders.get():
        names.append(name)


def announce_fallback(fmt: str, reason: str, op: str = "linear") -> None:
    """Say once per (format, reason) that `op` runs as dequantize-then-compute; raise in strict mode. Called
    while dynamo traces Python (grouped_linear's experts), it only raises, in strict mode as set then."""
    msg = f"affineq: {op} on a {fmt!r} quantized tensor runs as dequantize-then-{op} (slower): {reason}"
    tracing = torch.compiler.is_dynamo_compiling()  # no ContextVar for dynamo: no recording either
    if not tracing:
        record(f"dequantize:{op}")
    if is_strict() if tracing else _strict.get():
        raise KernelFallbackError(msg + " [strict mode: affineq.set_strict(False) to allow fallbacks]")
    key = (fmt, reason)
    if tracing or torch.compiler.is_compiling():
        return
    with _announced_lock:
        if key in _announced:
            return
        _announced.add(key)
    log.info(msg)
    warnings.warn(msg, KernelFallbackWarning, stacklevel=3)


def reset_announcements() -> None:
    """Forget which fallbacks were announced (tests use this)."""
    with _announced_lock:
        _announced.clear()
