"""Compile and cache the affineq C++ kernel library (private to affineq.cpp).

The library is built on first use for the machine it runs on (``-march=native``) and cached under
``$AFFINEQ_CACHE_DIR`` (default ``~/.cache/affineq/kernels``). The cache key hashes the sources, the compiler
(path and version), every flag, the CPU model/flags and the torch version, so a different CPU, compiler or torch
gets its own build. Concurrent first builds are serialized with a file lock and the result is published by an
atomic rename, so readers never see a half-written library.

Private knobs (tests/benchmarks): ``CXX`` picks the compiler, ``AFFINEQ_CPP_MARCH`` replaces ``native``
(e.g. ``x86-64-v3`` to exercise the AVX2 path, ``x86-64`` for the portable one), ``AFFINEQ_CPP_OPT`` replaces
``-O3`` (the other-ISA tests build with ``-O1``: same IEEE results, faster to compile).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent


def _sources(*suffixes: str) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in _HERE.iterdir() if p.suffix in suffixes and not p.name.startswith(".")))


# Both lists come from the directory, so a new file can never be left out. _UNITS: every .cpp is one translation
# unit with its own compiler process, all started at once (each kernel path is its own file, see dispatch.cpp,
# so the compilers share the cores instead of one long serial compile). _FILES: what the cache key hashes.
_UNITS = _sources(".cpp")
_FILES = _sources(".cpp", ".h")
# Units compiled as several objects, -DAQ_PART=i -DAQ_PARTS=n for i < n, each instantiating its share of the
# templates: gemv.cpp holds the GEMV's tiles for each of the 13 code widths, alone half of the build's CPU time
# and, in one process, its longest compile by far (the unit checks that n is its number of widths).
_PARTS = {"gemv.cpp": 13}

#: Seconds spent compiling in this process (0.0 when the cached library was reused).
last_build_seconds = 0.0


class CompilerNotFoundError(RuntimeError):
    """No C++ compiler on PATH (or $CXX points nowhere)."""


class BuildError(RuntimeError):
    """The compiler ran and failed; the message carries the tail of its output."""


def find_compiler(env: Mapping[str, str] | None = None) -> str | None:
    """Absolute path of the C++ compiler to use ($CXX, else c++/g++/clang++ on PATH), or None."""
    env = os.environ if env is None else env
    path = env.get("PATH", "")
    cxx = env.get("CXX")
    for cand in [cxx] if cxx else ["c++", "g++", "clang++"]:
        found = shutil.which(cand, path=path)
        if found:
            return found
    return None


def cache_dir() -> Path:
    root = os.environ.get("AFFINEQ_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "affineq" / "kernels"


def _cpu_id() -> str:
    """Model + feature flags: what -march=native resolves from, so it belongs in the cache key."""
    try:
        model = flags = ""
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not model:
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = val.strip()
                if model and flags:
                    break
        return f"{platform.machine()}|{model}|{flags}"
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _flags() -> tuple[list[str], list[str]]:
    tdir = Path(torch.__file__).resolve().parent
    march = os.environ.get("AFFINEQ_CPP_MARCH", "native")
    cflags = [
        os.environ.get("AFFINEQ_CPP_OPT", "-O3"),
        f"-march={march}",
        "-std=c++20",
        "-fPIC",
        "-fopenmp",  # at::parallel_for is OpenMP in torch's CPU wheels; shares torch's libgomp at runtime
        "-fvisibility=hidden",
        "-DNDEBUG",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{tdir / 'include'}",
        f"-I{tdir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    lib = tdir / "lib"
    ldflags = ["-shared", "-fopenmp", f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}"]
    return cflags, ldflags


def _objects() -> list[tuple[str, int | None]]:
    """(source, part) for each object file: part None for a whole unit, 0 .. n - 1 for the parts of a split one."""
    return [(src, part) for src in _UNITS for part in (range(_PARTS[src]) if src in _PARTS else (None,))]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def build(verbose: bool = False) -> str:
    """Return the path of the compiled library, building it if the cache has none.

    Raises CompilerNotFoundError or BuildError.
    """
    global last_build_seconds
    cxx = find_compiler()
    if cxx is None:
        raise CompilerNotFoundError("no C++ compiler found (install g++ or set $CXX)")
    cflags, ldflags = _flags()
    h = hashlib.sha256()
    for name in _FILES:
        h.update(name.encode())
        h.update((_HERE / name).read_bytes())
    h.update(repr((_UNITS, _PARTS)).encode())
    for part in (cxx, _compiler_version(cxx), " ".join(cflags + ldflags), _cpu_id(), torch.__version__,
                 sys.version):
        h.update(part.encode())
    key = h.hexdigest()[:20]
    out_dir = cache_dir()
    target = out_dir / f"affineq_kernels_{key}.so"
    if target.exists():
        return str(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _FileLock(out_dir / f"{key}.lock"):
        if target.exists():  # another process finished while we waited
            return str(target)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=out_dir, prefix="build-") as tmp:
            objs, procs = [], []
            for src, part in _objects():  # one compiler process per object, all in parallel
                obj = Path(tmp) / f"{Path(src).stem}{'' if part is None else f'.{part}'}.o"
                objs.append(str(obj))
                defs = [] if part is None else [f"-DAQ_PART={part}", f"-DAQ_PARTS={_PARTS[src]}"]
                cmd = [cxx, *cflags, *defs, "-c", str(_HERE / src), "-o", str(obj)]
                procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True)))
            failures = []
            for cmd, proc in procs:
                out, _ = proc.communicate()
                if proc.returncode != 0:
                    failures.append(f"$ {' '.join(cmd)}\n{out}")
            if not failures:
                tmp_so = Path(tmp) / "lib.so"
                cmd = [cxx, *objs, *ldflags, "-o", str(tmp_so)]
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if proc.returncode != 0:
                    failures.append(f"$ {' '.join(cmd)}\n{proc.stdout}")
            if failures:
                log = out_dir / f"{key}.log"
                log.write_text("\n\n".join(failures))
                raise BuildError(f"compiling the C++ kernels failed (full log: {log}):\n{_tail(failures[0])}")
            os.replace(tmp_so, target)  # atomic publish
        last_build_seconds = time.perf_counter() - t0
        if verbose:
            print(f"affineq: built {target.name} in {last_build_seconds:.1f}s", file=sys.stderr)
    return str(target)


class _FileLock:
    """Exclusive advisory lock (fcntl); a no-op where fcntl is missing (the atomic rename still holds)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def __enter__(self) -> _FileLock:
        try:
            import fcntl
        except ImportError:
            return self
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
