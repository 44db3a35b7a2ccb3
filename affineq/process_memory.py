"""Giving memory back to the OS while quantizing float weights one at a time (Linux/glibc; no-ops elsewhere).

Used by quantize-on-load (`affineq.hf`) and the streaming quantizer (`affineq.streaming`): both read one float
tensor, quantize it, and must not let its pages outlive the quantization. `status_bytes` reads the process's
memory counters (VmRSS, VmHWM, RssAnon) for the peak-memory tests and benchmarks.
"""

from __future__ import annotations

import os

import torch

__all__ = ["release_float_copy", "trim_heap", "status_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Never MADV_DONTNEED (4) here: on a private (copy-on-write) file mapping, which is what safetensors' load_file
# gives, it discards the pages the user wrote to and a later read sees the file again. MADV_PAGEOUT (Linux 5.4)
# reclaims clean pages (the file still holds them) and swaps out, or leaves resident, dirty ones: never loses data.
_MADV_PAGEOUT = 21
_libc = None


def _get_libc():
    """glibc through ctypes (madvise, malloc_trim), or False where there is none."""
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util
        import sys

        _libc = False
        if sys.platform == "linux":
            try:
                _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            except (OSError, AttributeError):
                _libc = False
    return _libc


def _mapping(ptr: int) -> tuple[str, str] | None:
    """(path, range) of the file mapping that holds address `ptr` (range: its "lo-hi" field of /proc/self/maps,
    naming one mapping), or None (anonymous memory, or not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= ptr < hi:
                    return (parts[5].strip(), parts[0]) if len(parts) == 6 and parts[5].startswith("/") else None
    except OSError:
        return None
    return None


def release_float_copy(t: torch.Tensor) -> None:
    """Give back the memory of a float weight that was just quantized.

    A weight read from safetensors may be a view of the memory-mapped file, and the mapping may stay open
    (other tensors of the file keep viewing it), so every page read while quantizing would stay resident:
    reclaim those pages with MADV_PAGEOUT. It is safe whatever the caller still does with `t` (a failed call
    that keeps the float weight, an alias the user holds): the mapping is private copy-on-write, so pages the
    user edited are anonymous memory that PAGEOUT swaps out or keeps, never drops (MADV_DONTNEED would revert
    them to the file's content); clean pages are read from the file again when next touched. Kernels older than
    5.4 reject PAGEOUT (EINVAL): then nothing is released. Then return freed quantization temporaries to the OS
    (malloc_trim), which glibc would otherwise keep as heap fragments."""
    libc = _get_libc()
    if not libc or t.device.type != "cpu" or not t.is_contiguous():
        return
    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-ptr // _PAGE) * _PAGE, (ptr + n) // _PAGE * _PAGE
    where = _mapping(ptr) if hi > lo else None
    if where is not None and where[0].endswith(".safetensors") and _mapping(hi - 1) == where:
        libc.madvise(lo, hi - lo, _MADV_PAGEOUT)
    trim_heap()


def trim_heap() -> None:
    """Return the free memory at the top of glibc's heaps to the OS (malloc_trim(0))."""
    libc = _get_libc()
    if libc and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def status_bytes(field: str) -> int:
    """A memory counter of this process from /proc/self/status, in bytes ("VmRSS", "VmHWM": the resident
    high-water mark, "RssAnon"); -1 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1
