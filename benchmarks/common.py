"""Shared helpers for the benchmarks: timing, machine description, memory bandwidth, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def median_ms(fn: Callable[[], object], *, min_runs: int = 5, max_runs: int = 200, budget_s: float = 1.0,
              warmup: int = 2) -> float:
    """Median wall time of fn() in ms: at least `min_runs`, then until `budget_s` or `max_runs`."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def round_robin_ms(cands: dict[str, Callable[[], object]], *, budget_s: float = 0.4, min_runs: int = 5,
                   max_runs: int = 200, warmup: int = 2, burst: int = 1) -> dict[str, float]:
    """Median ms per candidate, the candidates called in turn (A, B, C, B, C, A, C, A, B, ...) so that a noisy
    spell on the machine hits them alike and their ratios hold; `budget_s` is per candidate.

    `burst` > 1 calls each candidate that many times per turn and times only the calls after the first: what the
    other candidates read in between evicts its data, so a hot-cache measurement needs the first call to bring its
    data back (M = 1 with hot weights)."""
    for f in cands.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {name: [] for name in cands}
    end = time.perf_counter() + budget_s * len(cands)
    runs = 0
    names = list(cands)
    while runs < max_runs and (runs < min_runs or time.perf_counter() < end):
        # each round starts one candidate later, so no candidate always runs right after the same one: what the
        # previous call left in a large L3 moves the next call's time (benchmarks/README.md, seventeenth session)
        for name in names[runs % len(names):] + names[:runs % len(names)]:
            for i in range(burst):
                t = time.perf_counter()
                cands[name]()
                if i or burst == 1:
                    times[name].append(time.perf_counter() - t)
        runs += 1
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict:
    """CPU, SIMD level, threads, torch version: printed above every table and saved with the results."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "simd": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def machine_line() -> str:
    m = machine()
    return (f"# {m['cpu']}, {m['cores']} cores, {m['threads']} threads, {m['simd']}, torch {m['torch']}, "
            f"{m['date']}")


def memory_bandwidth_gbs(mib: int = 512) -> float:
    """Read bandwidth with all threads: sum over a buffer much larger than the last-level cache."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    ms = median_ms(lambda: buf.sum(), min_runs=5, budget_s=2.0)
    return buf.numel() * 4 / (ms * 1e-3) / 1e9


def stored_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors every nn.Linear weight of `model` stores (a tensor subclass's inner tensors through
    ``__tensor_flatten__``, a plain weight itself), each once."""
    out, seen = [], set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, torch.nn.Linear) or not isinstance(w, torch.Tensor) or id(w) in seen:
            continue
        seen.add(id(w))
        flatten = getattr(type(w), "__tensor_flatten__", None)
        out += [w] if flatten is None else [getattr(w, n) for n in w.__tensor_flatten__()[0]]
    return out


def weights_read_gbs(tensors: list[torch.Tensor]) -> float:
    """Read bandwidth over these tensors' own bytes (all threads): one fp32 sum over each, its bytes seen as
    float32 (a dtype's sum runs at its own speed; fp32's is memory_bandwidth_gbs'). What reading a model's
    weights once costs on their own pages (4 GB of distinct weights read slower than memory_bandwidth_gbs'
    512 MiB buffer here), against which a decode step's GB/s can be put."""
    views = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    views = [v[: v.numel() // 4 * 4].view(torch.float32) for v in views if v.numel() >= 4]
    nbytes = sum(v.numel() * 4 for v in views)
    ms = median_ms(lambda: [v.sum() for v in views], min_runs=3, max_runs=5, budget_s=0.0, warmup=1)
    return nbytes / (ms * 1e-3) / 1e9


def save_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=False))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def run_child(script: str, *args: str) -> dict:
    """Run `python script --child *args` in a fresh process (this checkout first on PYTHONPATH, the hub
    offline) and return the JSON dict its last stdout line holds; SystemExit with its stderr if it fails."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"child {args} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def reset_peak_rss(cfg, factory: Callable[[], object] | None = None) -> int:
    """Before a peak-memory measurement: load what the measured step would otherwise load first (the C++ kernels,
    through one small `cfg.quantize_weight`; torch's meta kernels, ~70 MB, through one meta-device `factory()`),
    give freed heap back, and set VmHWM to VmRSS. Returns that baseline VmRSS in bytes."""
    from affineq.process_memory import status_bytes, trim_heap

    cfg.quantize_weight(torch.randn(256, 256), torch.nn.Linear(256, 256))
    if factory is not None:
        with torch.device("meta"):
            factory()
    trim_heap()
    base = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return base
