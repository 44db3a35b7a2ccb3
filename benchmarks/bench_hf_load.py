"""Peak memory of loading SmolLM2-135M with transformers: float, quantized on load (affineq.hf), and a
pre-quantized affineq checkpoint.

    python benchmarks/bench_hf_load.py [--config int4-g64] [--dir /tmp/affineq_hf_bench]

SmolLM2 ships as a GGUF file, so the float model is first written once as a transformers checkpoint
(`load_smollm2()` + `save_pretrained`, float32 safetensors) under --dir. Each load then runs in a fresh
subprocess, which reports (MB): `base`, the resident set after importing torch/transformers/affineq; `peak`,
the process's high-water mark (VmHWM, which also counts the checkpoint's memory-mapped file pages while they
are resident); `peak anon`, the highest anonymous (heap) memory sampled every 2 ms; and `model`, the bytes
the loaded model holds (quantized weights at their stored size). The claim to check: quantize-on-load peaks
below float load + the quantized size, i.e. no second full-precision copy is held. Peak memory does not
depend on CPU contention, unlike times (printed as rough indications only). Writes
results/bench_hf_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, run_child, save_json, table  # noqa: E402


def _status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _AnonPeak:
    """Samples RssAnon in a thread (the kernel keeps no high-water mark of anonymous memory alone)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.peak, self._stop, self._period = 0.0, False, period_s
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, _status_mb("RssAnon"))
            time.sleep(self._period)

    def stop(self) -> float:
        self._stop = True
        self._t.join()
        return max(self.peak, _status_mb("RssAnon"))


def child(mode: str, src: str, config_name: str, out: str | None) -> dict:
    """One measurement, run in its own process (`--child`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    import affineq
    import affineq.hf
    from affineq.demo import CONFIGS, model_bytes

    if mode == "save-float":
        from affineq import models

        model, tok = models.load_smollm2()
        model.save_pretrained(src)
        tok.save_pretrained(src)
        return {}
    base = _status_mb("VmRSS")
    sampler = _AnonPeak()
    base_anon = _status_mb("RssAnon")
    t0 = time.perf_counter()
    kw = {"quantization_config": affineq.hf.AffineqConfig(CONFIGS[config_name])} if mode == "quantize-on-load" else {}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
    load_s = time.perf_counter() - t0
    # Touch every weight: float weights loaded from safetensors are memory-mapped views of the file, resident
    # only once read; a model in use has them all resident.
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if not isinstance(t, affineq.AffineQuantizedTensor):  # quantized ones were built in memory
                t.float().sum()
    peak_anon = sampler.stop()
    row = {"load": mode, "base MB": round(base, 1), "peak MB": round(_status_mb("VmHWM"), 1),
           "peak - base": round(_status_mb("VmHWM") - base, 1), "peak anon - base": round(peak_anon - base_anon, 1),
           "after - base": round(_status_mb("VmRSS") - base, 1),
           "model MB": round(model_bytes(model) / 2**20, 1), "load s": round(load_s, 1)}
    if out:
        model.save_pretrained(out)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="int4-g64", help="a config name of affineq.demo.CONFIGS")
    p.add_argument("--dir", default="/tmp/affineq_hf_bench", help="where the float and quantized checkpoints go")
    p.add_argument("--child", nargs=4, metavar=("MODE", "SRC", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, src, config, out = args.child
        print(json.dumps(child(mode, src, config, None if out == "-" else out)))
        return
    d = Path(args.dir)
    flt, q = d / "float", d / f"affineq-{args.config}"
    if not (flt / "config.json").exists():
        run_child(__file__, "save-float", str(flt), args.config, "-")
    rows = [run_child(__file__, "float", str(flt), args.config, "-"),
            run_child(__file__, "quantize-on-load", str(flt), args.config, str(q)),
            run_child(__file__, "pre-quantized", str(q), args.config, "-")]
    rows[1]["load"] += f" ({args.config})"
    fl, ql = rows[0], rows[1]
    bound = fl["peak - base"] + ql["model MB"]
    print(machine_line())
    mb = lambda path: sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20  # noqa: E731
    print(f"SmolLM2-135M, float32 checkpoint {mb(flt):.0f} MB, affineq checkpoint {mb(q):.0f} MB")
    print(table(rows, list(rows[0])))
    verdict = "below" if ql["peak - base"] < bound else "NOT below"
    print(f"quantize-on-load peak - base = {ql['peak - base']} MB, {verdict} float load ({fl['peak - base']} MB) + "
          f"quantized size ({ql['model MB']} MB) = {bound:.1f} MB")
    print(f"wrote {save_json('bench_hf_load', {'config': args.config, 'rows': rows, 'bound_mb': bound})}")


if __name__ == "__main__":
    main()
