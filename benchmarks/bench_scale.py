"""1B-8B models: quantizing, decoding, prefill, batches, long context and the quantized KV cache (issue #32).

    python benchmarks/bench_scale.py --prepare                     # checkpoints under --data (once; not timed)
    python benchmarks/bench_scale.py --rows decode prefill         # rows, each measurement in its own process
    python benchmarks/bench_scale.py --rows decode --quick         # smoke run: 1B only, tiny sizes, no timing

Checkpoints (``--prepare``, under ``--data``, default /work/data): make_synthetic.py's Llama-3.2-1B and
Llama-3.1-8B bodies (bf16 safetensors, SmolLM2's 49152-id vocabulary, an F16 GGUF of the same tensors); each
quantized by ``affineq.quantize_checkpoint`` (with the meta-device model, so a tied head is quantized as
``quantize_`` does) to ``<body>-int4-g32`` (``Int4WeightOnlyConfig(group_size=32)``: uint4 with a bf16 scale and
zero per 32, 5 bits per weight), ``<body>-int4-g32-sym`` (symmetric int4 with a bf16 scale per 32: 4.5 bits per
weight, Q4_0's layout) and ``<body>-int8``
(``Int8WeightOnlyConfig()``, per-channel), and by llama.cpp's own quantizer (benchmarks/_llama_cpp_quantize.py)
to ``model-q4_0.gguf`` / ``model-q8_0.gguf``, every tensor in that type (token_embd and output included, as
affineq quantizes every Linear including the head). The 8B F16 GGUF (16 GB) may be deleted afterwards.

Rows (``--rows``; every measurement runs in a fresh subprocess, one after another):
- ``quantize``: ``quantize_checkpoint`` of the 8B bf16 checkpoint to int4 g32: peak RSS above the interpreter
  (VmHWM reset after imports; it counts resident mmapped checkpoint pages) and time; the result loads with
  ``load_quantized`` (meta model) and transformers ``from_pretrained``, both run a forward on 8 tokens and must
  give the same logits. transformers quantize-on-load (``AffineqConfig``) of the 1B against
  ``quantize_checkpoint`` of the 1B (times; target within 2x).
- ``decode``: batch 1, 64 new tokens after a 128-token prompt (random ids, seed 0, the same ids for llama.cpp),
  at 1B and 8B: affineq int4 g32 symmetric (4.5 bits per weight, as Q4_0) / int8 (``StaticDecoder``, compiled
  step) against llama.cpp Q4_0 / Q8_0, and the asymmetric int4 g32 (5 bits per weight) alone.
  Decode s/token = median over repeats of the n - 1 single-token steps (argmax included), as
  benchmarks/_llama_cpp_row.py times llama.cpp. A row with a llama.cpp twin runs paired with it: both processes
  loaded, their timed runs alternating one at a time (benchmarks/_turns.py), so both see the same machine.
  MB read per token = stored bytes of every Linear weight (the head included; GGUF: every tensor but an untied
  token_embd); GB/s against the read bandwidth (common.memory_bandwidth_gbs, same threads) measured just before
  each timed run of an affineq decode row (the median of the per-run fractions; a llama.cpp twin against the
  median of its partner's): this VM's probe jumps between ~40-50 and ~62-83 GB/s from one minute to the next.
  ``weights_read_fraction``: the same GB/s against a read of the step's own weight tensors (common.weights_read_gbs,
  next to each run), since reading a model's gigabytes of distinct weights is slower here than the probe's buffer.
- ``prefill``: time to first token (prefill + first argmax) of 512- and 2048-token prompts at 1B: affineq int4 /
  int8 / bf16 (eager prefill, as ``generate``) and llama.cpp Q4_0 / Q8_0 prompt processing.
- ``batch``: decode at batch 1, 4, 16 at 1B (128-token prompts, 64 new tokens): per-request tok/s, batch tok/s,
  ms per step (the per-request latency of a token); int4 g32 and int8 against bf16.
- ``long-context``: decode at 1B int4 g32 weights after a 4096-token prompt with the KV cache in fp32 (fp32
  activations), bf16, int8, int4 (bf16 activations); cache bytes per token.
- ``kv-accuracy`` (no timing): SmolLM2-135M (fp32): perplexity of the eval text over 2048-token windows through
  the decoder's cache (``affineq.models.cache_eval.kv_cache_perplexity``, teacher-forced through the same cache
  code as decoding) with the float, int8 and int4 caches (targets +0.5%, +3%); 64 greedy tokens with the int8
  cache against the float cache.
- ``memory`` (no timing): 8B int4 g32 decode (the symmetric int4 g32 where only that was prepared; 128-token
  prompt, 16 new tokens, eager decoder): resident set against
  1.15 x (model bytes + KV cache bytes) + 300 MB (model bytes: every parameter's stored bytes, the bf16 embedding
  included).

llama.cpp: the llama-cpp-python venv's python from ``--llama-python``, $AFFINEQ_LLAMA_PYTHON or
.venv-llamacpp/bin/python in the repository root; without it the llama.cpp rows are skipped with a message.
``--small`` / ``--big`` name other make_synthetic.py bodies (e.g. ``--small tiny-llama --quick`` for a fast check).

``--quick``: the 1B in place of the 8B, small prompts and windows, 1 repeat, eager decoder: checks that the rows
run (the numbers are not timings). ``--big-only``: the quantize / decode / memory rows at 8B only (``--quick
--big-only``: the 8B rows with the quick sizes); ``--no-big``: those rows at 1B only.
Results: results/bench_scale.json (``--out``: another name under results/, e.g. the AMX Xeon's bench_scale_amx; a
run's rows replace the saved rows of the same name, see `merge_group`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, machine_line, memory_bandwidth_gbs, run_child, table  # noqa: E402

HERE = Path(__file__).resolve().parent
SMALL, BIG = "llama-3.2-1b", "llama-3.1-8b"
ROWS = ["quantize", "decode", "prefill", "batch", "long-context", "kv-accuracy", "memory"]
MB = 1e6
MiB = 2**20


# -- children (one measurement each, in its own process) ----------------------------------------------------

def _config(name: str):
    import affineq

    if name == "int4-g32":
        return affineq.Int4WeightOnlyConfig(group_size=32)
    if name == "int4-g32-sym":  # Q4_0's twin: symmetric int4 codes, a bf16 scale per 32 (4.5 bits per weight)
        from affineq.primitives import MappingType, ZeroPointDomain

        return affineq.Int4WeightOnlyConfig(group_size=32, mapping_type=MappingType.SYMMETRIC,
                                            zero_point_domain=ZeroPointDomain.NONE)
    if name == "int8":
        return affineq.Int8WeightOnlyConfig()
    raise ValueError(f"unknown config {name!r}")


def _meta_factory(src: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(src)
    return lambda: AutoModelForCausalLM.from_config(cfg)


def _reset_peak() -> int:
    """Trim the heap, reset VmHWM to VmRSS; returns the resident bytes now (the `base`)."""
    from affineq.process_memory import status_bytes, trim_heap

    trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def child_quantize(job: dict) -> dict:
    """quantize_checkpoint src -> dst (meta model): peak RSS above the base, seconds, bytes written."""
    import torch

    import affineq
    from affineq.process_memory import status_bytes

    cfg = _config(job["config"])
    factory = _meta_factory(job["src"])
    cfg.quantize_weight(torch.randn(256, 256), torch.nn.Linear(256, 256))  # the kernels' first load
    with torch.device("meta"):
        factory()  # the first meta construction imports torch's meta kernels (once)
    base = _reset_peak()
    t0 = time.perf_counter()
    info = affineq.quantize_checkpoint(job["src"], job["dst"], cfg, model=factory)
    secs = time.perf_counter() - t0
    return {"base_MiB": base / MiB, "peak_above_base_MiB": (status_bytes("VmHWM") - base) / MiB, "s": secs,
            "dst_bytes": info.dst_bytes}


def child_quantize_on_load(job: dict) -> dict:
    """transformers from_pretrained(src, quantization_config=AffineqConfig(config)) in bf16: seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    import affineq.hf

    _config(job["config"]).quantize_weight(torch.randn(256, 256), torch.nn.Linear(256, 256))
    t0 = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(job["src"], dtype=torch.bfloat16,
                                         quantization_config=affineq.hf.AffineqConfig(_config(job["config"])))
    return {"s": time.perf_counter() - t0}


def child_load(job: dict) -> dict:
    """The quantized directory through load_quantized (meta model) and transformers from_pretrained: a forward on
    8 tokens each, the same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    import affineq
    from affineq.demo import model_bytes
    from affineq.process_memory import status_bytes

    ids = torch.arange(1, 9)[None]
    base = _reset_peak()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = _meta_factory(job["dir"])()
    model = affineq.load_quantized(model, job["dir"]).eval()
    load_s = time.perf_counter() - t0
    with torch.inference_mode():
        a = model(ids).logits.float()
    row = {"load_quantized_s": load_s, "load_quantized_peak_above_base_MiB": (status_bytes("VmHWM") - base) / MiB,
           "model_MiB": model_bytes(model) / MiB, "logits_finite": bool(a.isfinite().all())}
    del model
    base = _reset_peak()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["dir"]).eval()
    row["from_pretrained_s"] = time.perf_counter() - t0
    with torch.inference_mode():
        b = model(ids).logits.float()
    row.update(from_pretrained_peak_above_base_MiB=(status_bytes("VmHWM") - base) / MiB,
               from_pretrained_dtype=str(next(model.parameters()).dtype),
               logits_max_abs_diff=float((a - b).abs().max()), logits_equal=bool(torch.equal(a, b)))
    return row


def _linear_bytes(model) -> int:
    from bench_models import _linear_bytes as lb

    return lb(model)[0]


def child_decode(job: dict) -> dict:
    """StaticDecoder over a checkpoint directory (float or quantized): per repeat, prefill + first argmax (time to
    first token), then n - 1 single-token steps (each with its argmax). Medians; RSS after."""
    import torch
    from transformers import AutoModelForCausalLM

    from affineq.demo import model_bytes
    from affineq.models import StaticDecoder
    from affineq.process_memory import status_bytes

    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job.get("dtype", "bfloat16"))
    base = status_bytes("VmRSS")  # the interpreter with torch, transformers and affineq imported
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    b, s, n = job["batch"], job["prompt"], job["new_tokens"]
    ids = prompt_ids(s, model.config.vocab_size)[None].expand(b, -1).contiguous()
    max_len = -(-(s + n) // 128) * 128
    dec = StaticDecoder(model, b, max_len, compile=job["compile"], kv_cache_dtype=job.get("kv"))

    def run() -> tuple[float, float, list[int]]:  # greedy as generate's: argmax of fp32 logits
        with torch.inference_mode():
            t = time.perf_counter()
            tok = dec.run_prefill(ids).float().argmax(-1)
            t1 = time.perf_counter()
            out = [int(tok[0])]
            for i in range(n - 1):
                tok = dec.step(tok[:, None], torch.tensor([s + i])).float().argmax(-1)
                out.append(int(tok[0]))
            return t1 - t, time.perf_counter() - t1, out

    turns = None
    if job.get("turns"):  # paired with a llama.cpp row: runs alternate with the partner's (_turns.Turns)
        from _turns import Turns

        turns = Turns(job["turns"]["dir"], int(job["turns"]["role"]), partner=job["turns"].get("partner"))
        turns.start()
        turns.wait()
    t0 = time.perf_counter()
    _, _, tokens = run()  # warm-up: compiles the step, pages the weights in
    warm = time.perf_counter() - t0
    if turns:
        turns.give()
    pre, dts, bws, wbws = [], [], [], []
    for _ in range(job["repeats"]):
        if turns:
            turns.wait()
        if job.get("bandwidth_each_run"):  # this VM's bandwidth drifts: measure it next to every run
            from common import memory_bandwidth_gbs, stored_tensors, weights_read_gbs

            bws.append(memory_bandwidth_gbs())
            wbws.append(weights_read_gbs(stored_tensors(model)))  # the same bytes the step reads, on their pages
        p, d, again = run()
        if turns:
            turns.give()
        pre.append(p)
        dts.append(d)
    d = statistics.median(dts)
    step_ms = d / (n - 1) * 1e3 if n > 1 else float("nan")
    row = {"load_s": load_s, "warmup_s": warm, "ttft_ms": statistics.median(pre) * 1e3, "ms_per_step": step_ms,
           "decode_tok_s": 1e3 / step_ms, "batch_tok_s": b * 1e3 / step_ms, "tokens": tokens,
           "deterministic": again == tokens, "weight_bytes_per_token": _linear_bytes(model),
           "model_bytes": model_bytes(model), "kv_bytes_per_token": dec.cache_bytes_per_token(),
           "kv_cache_bytes": dec.cache_bytes_per_token() * b * max_len, "max_len": max_len,
           "rss_MiB": status_bytes("VmRSS") / MiB, "hwm_MiB": status_bytes("VmHWM") / MiB, "base_MiB": base / MiB}
    if bws:  # each run's GB/s over the read bandwidth measured just before it
        gbs = [row["weight_bytes_per_token"] / (t / (n - 1)) / 1e9 for t in dts]
        row.update(run_read_bandwidth_gbs=bws, run_weights_read_gbs=wbws,
                   run_bandwidth_fraction=[g / bw for g, bw in zip(gbs, bws, strict=True)],
                   run_weights_read_fraction=[g / bw for g, bw in zip(gbs, wbws, strict=True)])
    return row


def child_kv_accuracy(job: dict) -> dict:
    """SmolLM2 (fp32): perplexity through the float / int8 / int4 cache; 64 greedy tokens int8 vs float."""
    import torch

    from affineq import models as M
    from affineq.models.cache_eval import kv_cache_perplexity

    torch.set_num_threads(job["threads"])
    model, tok = M.load_smollm2()
    ids = tok(M.eval_text(), return_tensors="pt")["input_ids"][0]
    out: dict = {"eval_tokens": ids.numel(), "window": job["window"]}
    for kind in (None, "int8", "int4"):
        out[f"ppl_{kind or 'float'}"] = kv_cache_perplexity(model, ids, job["window"], kv_cache_dtype=kind,
                                                            max_windows=job.get("max_windows"))
    f = out["ppl_float"]["ppl"]
    out["int8_ppl_change"] = out["ppl_int8"]["ppl"] / f - 1
    out["int4_ppl_change"] = out["ppl_int4"]["ppl"] / f - 1
    from bench_decode import PROMPT

    prompt = tok(PROMPT, return_tensors="pt")["input_ids"]
    s = prompt.shape[1]
    ref = M.generate(model, prompt, job["new_tokens"], compile=False, ignore_eos=True)[0, s:]
    q = M.generate(model, prompt, job["new_tokens"], compile=False, ignore_eos=True, kv_cache_dtype="int8")[0, s:]
    diff = (ref != q).nonzero()
    out.update(greedy_new_tokens=job["new_tokens"], greedy_int8_equal=bool(torch.equal(ref, q)),
               greedy_first_mismatch=int(diff[0]) if len(diff) else None, greedy_float_tokens=ref.tolist())
    return out


def prompt_ids(n: int, vocab: int):
    """n random token ids (seed 0) in [1, vocab): the prompt every engine gets, batch rows alike."""
    import torch

    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(0))


CHILDREN = {"quantize": child_quantize, "quantize-on-load": child_quantize_on_load, "load": child_load,
            "decode": child_decode, "kv-accuracy": child_kv_accuracy}


# -- llama.cpp rows ------------------------------------------------------------------------------------------

def _llama_available(py: Path | None, gguf: Path) -> bool:
    if py is None or not gguf.exists():
        print(f"llama.cpp {gguf.name}: skipped ({'no llama-cpp-python venv' if py is None else 'no such file'})")
        return False
    return True


def _llama_start(py: Path, gguf: Path, prompt: int, n: int, threads: int, repeats: int,
                 turns: dict | None = None) -> subprocess.Popen:
    """benchmarks/_llama_cpp_row.py on the same prompt ids, in the llama-cpp-python venv, started (not awaited)."""
    args = {"model": str(gguf), "prompt_ids": prompt_ids(prompt, 49152).tolist(), "new_tokens": n,
            "threads": threads, "repeats": repeats, "turns": turns}
    return subprocess.Popen([str(py), str(HERE / "_llama_cpp_row.py"), json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _llama_result(proc: subprocess.Popen, gguf: Path) -> dict | None:
    from bench_decode import _gguf_bytes_per_token

    out, err = proc.communicate()
    line = next((x for x in out.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        print(f"llama.cpp {gguf.name}: failed\n{err[-2000:]}")
        return None
    r = json.loads(line[4:])
    return {"ttft_ms": r["prefill_ms"], "ms_per_step": r["ms_per_token"], "decode_tok_s": r["decode_tok_s"],
            "batch_tok_s": r["decode_tok_s"], "tokens": r["tokens"], "internal_decode_tok_s":
            r.get("internal_decode_tok_s"), "weight_bytes_per_token": _gguf_bytes_per_token(gguf)}


def _llama_row(py: Path | None, gguf: Path, prompt: int, n: int, threads: int, repeats: int) -> dict | None:
    """The llama.cpp row alone (None: skipped)."""
    if not _llama_available(py, gguf):
        return None
    return _llama_result(_llama_start(py, gguf, prompt, n, threads, repeats), gguf)


def _llama_python(arg: str | None) -> Path | None:
    from _llama_cpp_quantize import find_llama_python

    return find_llama_python(arg)


# -- preparation ---------------------------------------------------------------------------------------------

CONFIGS = ("int4-g32", "int4-g32-sym", "int8")


def _checkpoint(data: Path, body: str, cfg: str) -> Path:
    """The directory --prepare writes for `cfg` of `body` (bf16: the body itself)."""
    return data / (body if cfg == "bf16" else f"{body}-{cfg}")


def _prepared(data: Path, body: str, cfg: str) -> bool:
    """Whether --prepare has written the `cfg` directory of `body`."""
    return (_checkpoint(data, body, cfg) / "config.json").exists()


def _ready(data: Path, body: str, cfg: str) -> bool:
    """_prepared, printing which directory a row skips for when not (a run of other rows goes on)."""
    if _prepared(data, body, cfg):
        return True
    print(f"skipped {body} {cfg}: no {_checkpoint(data, body, cfg)} (run --prepare)")
    return False


def prepare(data: Path, bodies: list[str], llama_py: Path | None, threads: int, configs=CONFIGS) -> None:
    """The checkpoints the rows read (skipping what exists): bf16 + F16 GGUF, the `configs` directories (int4-g32 /
    int4-g32-sym / int8), Q4_0 / Q8_0 GGUFs."""
    for body in bodies:
        src = data / body
        gguf_only = (src / "model.safetensors.index.json").exists()
        quantized = all((src / f"model-{t}.gguf").exists() for t in ("q4_0", "q8_0"))  # the F16 one may be gone
        if not gguf_only or not ((src / "model-f16.gguf").exists() or quantized):
            subprocess.run([sys.executable, str(HERE / "make_synthetic.py"), body, str(src), "--gguf", "f16",
                            *(["--gguf-only"] if gguf_only else [])],
                           check=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        if not (src / "tokenizer.json").exists():
            from make_synthetic import _write_tokenizer

            print(_write_tokenizer(src))
        for cfg in configs:
            dst = _checkpoint(data, body, cfg)
            if not _prepared(data, body, cfg):
                print(json.dumps(run_child(__file__, json.dumps({"kind": "quantize", "src": str(src),
                                                                 "dst": str(dst), "config": cfg}))))
                for f in [*src.glob("tokenizer*"), *src.glob("*.jinja")]:
                    shutil.copy2(f, dst)
        if llama_py is None:
            print("no llama-cpp-python venv: the Q4_0 / Q8_0 GGUFs are not made")
            continue
        from _llama_cpp_quantize import quantize_gguf

        for t in ("Q4_0", "Q8_0"):
            out = src / f"model-{t.lower()}.gguf"
            if not out.exists():
                quantize_gguf(src / "model-f16.gguf", out, t, token_embedding_type=t, output_tensor_type=t,
                              llama_python=llama_py, threads=threads)
                print(f"wrote {out}")


# -- the rows ------------------------------------------------------------------------------------------------

def _decode(data: Path, body: str, cfg: str, *, prompt: int, n: int, batch: int = 1, kv: str | None = None,
            dtype: str = "bfloat16", a: argparse.Namespace, turns: dict | None = None,
            bandwidth_each_run: bool = False) -> dict:
    job = {"kind": "decode", "dir": str(_checkpoint(data, body, cfg)), "prompt": prompt, "new_tokens": n,
           "batch": batch, "kv": kv, "dtype": dtype, "threads": a.threads, "repeats": a.repeats, "turns": turns,
           "bandwidth_each_run": bandwidth_each_run and not a.quick,
           "compile": not a.quick and not (a.eager_big and body == a.big)}
    r = run_child(__file__, json.dumps(job))
    return {**r, "compiled": job["compile"]}


def bodies(a: argparse.Namespace) -> list[str]:
    """The bodies of the rows that run at 1B and 8B (quantize, decode, memory; the largest first): both, the 1B
    only (``--no-big``, or ``--quick``), or the 8B only (``--big-only``, also with ``--quick``)."""
    if a.big_only:
        return [a.big]
    return [a.small] if a.quick or a.no_big else [a.big, a.small]


def rows_quantize(a, data: Path) -> list[dict]:
    big = bodies(a)[0]
    tmp = data / "bench_scale_tmp"
    out = []
    for body in bodies(a):
        keep = not _prepared(data, body, "int4-g32")  # then the result is --prepare's directory
        dst = data / f"{body}-int4-g32" if keep else tmp / f"{body}-int4-g32"
        subprocess.run(["rm", "-rf", str(dst)], check=True)
        r = run_child(__file__, json.dumps({"kind": "quantize", "src": str(data / body), "dst": str(dst),
                                            "config": "int4-g32"}))
        r.update(row=f"quantize_checkpoint {body} int4-g32")
        if body == big:
            r.update(run_child(__file__, json.dumps({"kind": "load", "dir": str(dst)})))
        out.append(r)
        if keep:
            for f in [*(data / body).glob("tokenizer*"), *(data / body).glob("*.jinja")]:
                shutil.copy2(f, dst)
        else:
            subprocess.run(["rm", "-rf", str(dst)], check=True)
    if a.small not in bodies(a):
        return out
    r = run_child(__file__, json.dumps({"kind": "quantize-on-load", "src": str(data / a.small), "config": "int4-g32"}))
    r.update(row=f"from_pretrained + AffineqConfig {a.small} int4-g32",
             vs_quantize_checkpoint=r["s"] / out[-1]["s"])
    out.append(r)
    return out


def rows_decode(a, data: Path, py: Path | None) -> list[dict]:
    n, prompt = (4, 16) if a.quick else (64, 128)
    out = []
    for body in reversed(bodies(a)):
        for cfg, gguf in (("int4-g32-sym", "q4_0"), ("int4-g32", None), ("int8", "q8_0")):
            if not _ready(data, body, cfg):
                continue
            path = data / body / f"model-{gguf}.gguf" if gguf else None
            if path is None or not _llama_available(py, path):
                out.append({"row": f"{body} affineq {cfg}", **_decode(data, body, cfg, prompt=prompt, n=n, a=a,
                                                                      bandwidth_each_run=True)})
                continue
            # Paired: both processes loaded, their timed runs alternating (one runs at a time), so the ratio
            # compares the two on the same machine state (this VM's speed drifts by tens of percent in minutes).
            with tempfile.TemporaryDirectory() as tdir:
                proc = _llama_start(py, path, prompt, n, a.threads, a.repeats, {"dir": tdir, "role": 0})
                try:
                    r = _decode(data, body, cfg, prompt=prompt, n=n, a=a, bandwidth_each_run=True,
                                turns={"dir": tdir, "role": 1, "partner": proc.pid})
                except BaseException:
                    proc.kill()
                    raise
                lr = _llama_result(proc, path)
            out.append({"row": f"{body} affineq {cfg}", **r, "paired": lr is not None})
            if lr:
                if r.get("run_read_bandwidth_gbs"):  # the twin's runs alternate with ours: the same bandwidth
                    lr["paired_read_bandwidth_gbs"] = statistics.median(r["run_read_bandwidth_gbs"])
                out.append({"row": f"{body} llama.cpp {gguf.upper()}", **lr, "paired": True,
                            "vs_affineq": out[-1]["decode_tok_s"] / lr["decode_tok_s"]})
    return out


def rows_prefill(a, data: Path, py: Path | None) -> list[dict]:
    out = []
    for prompt in ((64, 128) if a.quick else (512, 2048)):
        for cfg in ("int4-g32", "int8", "bf16"):
            if _ready(data, a.small, cfg):
                out.append({"row": f"{a.small} {prompt} tokens affineq {cfg}",
                            **_decode(data, a.small, cfg, prompt=prompt, n=2, a=a)})
        for gguf in ("q4_0", "q8_0"):
            lr = _llama_row(py, data / a.small / f"model-{gguf}.gguf", prompt, 2, a.threads, a.repeats)
            if lr:
                out.append({"row": f"{a.small} {prompt} tokens llama.cpp {gguf.upper()}", **lr})
    return out


def rows_batch(a, data: Path) -> list[dict]:
    n, prompt, batches = (4, 16, (1, 2)) if a.quick else (64, 128, (1, 4, 16))
    return [{"row": f"{a.small} affineq {cfg} batch {b}", "batch": b,
             **_decode(data, a.small, cfg, prompt=prompt, n=n, batch=b, a=a)}
            for cfg in ("int4-g32", "int8", "bf16") if _ready(data, a.small, cfg) for b in batches]


def rows_long_context(a, data: Path) -> list[dict]:
    n, prompt = (4, 256) if a.quick else (32, 4096)
    out = []
    if not _ready(data, a.small, "int4-g32"):
        return out
    for kv, dtype in ((None, "float32"), (None, "bfloat16"), ("int8", "bfloat16"), ("int4", "bfloat16")):
        label = f"kv {kv or ('fp32' if dtype == 'float32' else 'bf16')} ({dtype} activations)"
        out.append({"row": f"{a.small} int4-g32 {prompt} ctx {label}",
                    **_decode(data, a.small, "int4-g32", prompt=prompt, n=n, kv=kv, dtype=dtype, a=a)})
    return out


def rows_kv_accuracy(a) -> list[dict]:
    job = {"kind": "kv-accuracy", "threads": a.threads, "window": 256 if a.quick else 2048, "new_tokens":
           8 if a.quick else 64, "max_windows": 1 if a.quick else None}
    r = run_child(__file__, json.dumps(job))
    return [{"row": "SmolLM2-135M KV cache accuracy", **r}]


def rows_memory(a, data: Path) -> list[dict]:
    body = bodies(a)[0]
    # the asymmetric int4 g32 body, else the symmetric one (`--prepare --configs` may have made only that)
    cfg = next((c for c in ("int4-g32", "int4-g32-sym") if _prepared(data, body, c)), None)
    if cfg is None:
        print(f"skipped {body} decode memory: no {data / f'{body}-int4-g32'} or -int4-g32-sym (run --prepare)")
        return []
    r = _decode(data, body, cfg, prompt=16 if a.quick else 128, n=4 if a.quick else 16,
                a=argparse.Namespace(**{**vars(a), "quick": True, "repeats": 1}))  # eager decoder: no compiler
    bound = 1.15 * (r["model_bytes"] + r["kv_cache_bytes"]) / MiB + 300
    return [{"row": f"{body} {cfg} decode memory", **r, "bound_MiB": bound, "within": r["hwm_MiB"] <= bound,
             # the interpreter alone (torch + transformers) is ~0.4 GB: the same bound on the resident set above it
             "hwm_above_base_MiB": r["hwm_MiB"] - r["base_MiB"],
             "within_above_base": r["hwm_MiB"] - r["base_MiB"] <= bound}]


# -- report --------------------------------------------------------------------------------------------------

def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def report(group: str, rows: list[dict], bandwidth: float) -> None:
    for r in rows:
        if "weight_bytes_per_token" in r and "ms_per_step" in r:
            r["MB_per_token"] = r["weight_bytes_per_token"] / MB
            r["GB_s"] = r["weight_bytes_per_token"] / (r["ms_per_step"] * 1e-3) / 1e9  # one read per step, any batch
            r["bandwidth_fraction"] = r["GB_s"] / bandwidth
            r["read_bandwidth_gbs"] = bandwidth
        if r.get("run_bandwidth_fraction"):  # measured next to each run: the median of the per-run fractions
            r["bandwidth_fraction"] = statistics.median(r["run_bandwidth_fraction"])
            r["read_bandwidth_gbs"] = statistics.median(r["run_read_bandwidth_gbs"])
            if r.get("run_weights_read_fraction"):
                r["weights_read_fraction"] = statistics.median(r["run_weights_read_fraction"])
                r["weights_read_gbs"] = statistics.median(r["run_weights_read_gbs"])
        elif r.get("paired_read_bandwidth_gbs") and "GB_s" in r:
            r["bandwidth_fraction"] = r["GB_s"] / r["paired_read_bandwidth_gbs"]
            r["read_bandwidth_gbs"] = r["paired_read_bandwidth_gbs"]
    cols = {"quantize": ["row", "s", "peak_above_base_MiB", "dst_bytes", "load_quantized_s", "from_pretrained_s",
                         "logits_equal", "vs_quantize_checkpoint"],
            "decode": ["row", "decode_tok_s", "ms_per_step", "MB_per_token", "GB_s", "bandwidth_fraction",
                       "weights_read_fraction", "vs_affineq"],
            "prefill": ["row", "ttft_ms"],
            "batch": ["row", "decode_tok_s", "batch_tok_s", "ms_per_step"],
            "long-context": ["row", "decode_tok_s", "ms_per_step", "kv_bytes_per_token", "ttft_ms"],
            "kv-accuracy": ["row", "int8_ppl_change", "int4_ppl_change", "greedy_int8_equal", "greedy_first_mismatch"],
            "memory": ["row", "hwm_MiB", "hwm_above_base_MiB", "model_bytes", "kv_cache_bytes", "bound_MiB", "within",
                       "within_above_base"]}[group]
    print(f"\n## {group}")
    print(table([{c: _fmt(r.get(c, "")) for c in cols} for r in rows], cols), flush=True)


def merge_group(old: dict | None, rows: list[dict], run: dict) -> dict:
    """A row group of results/bench_scale.json after this run: its rows replace the saved rows of the same name,
    the other saved rows stay (a ``--big-only`` run keeps the 1B rows); `run` (machine, bandwidth, threads)
    describes the latest run; each row keeps the bandwidth its fraction was computed with."""
    names = {r["row"] for r in rows}
    old = old or {}
    kept = [r for r in old.get("rows", []) if r.get("row") not in names]
    for r in kept:  # rows saved before rows carried their own bandwidth: their run's
        if "bandwidth_fraction" in r and "read_bandwidth_gbs" not in r:
            r["read_bandwidth_gbs"] = old.get("bandwidth_gbs")
    return {**run, "rows": kept + rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    p.add_argument("--data", type=Path, default=Path("/work/data"), help="where the checkpoints are (--prepare)")
    p.add_argument("--prepare", action="store_true", help="write the checkpoints the rows need, then exit")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="--prepare: the affineq configs to quantize to (8B int4-g32 alone is 4.5 GB; the decode "
                        "and memory rows skip a missing one with a message)")
    p.add_argument("--small", default=SMALL, help="the 1B body (make_synthetic.py's name)")
    p.add_argument("--big", default=BIG, help="the 8B body")
    p.add_argument("--no-big", action="store_true", help="quantize / decode / memory rows: the 1B body only")
    p.add_argument("--big-only", action="store_true",
                   help="quantize / decode / memory rows: the 8B body only (with --quick: a smoke run of the 8B rows)")
    p.add_argument("--eager-big", action="store_true",
                   help="8B decode rows with the eager decoder (no minutes-long compile of the 8B step; at 8B a token "
                        "takes ~100x the step's Python overhead)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llama-python", default=None, help="python of the llama-cpp-python venv")
    p.add_argument("--quick", action="store_true", help="1B only, tiny sizes, 1 repeat, eager: checks the rows run")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--out", default="bench_scale",
                   help="results/<out>.json (the AMX Xeon's runs: bench_scale_amx; the Zen 5's: bench_scale)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.big_only and a.no_big:
        p.error("--big-only and --no-big exclude each other; pass one")
    if a.child:
        job = json.loads(a.child)
        print(json.dumps(CHILDREN[job.pop("kind")](job)))
        return
    py = _llama_python(a.llama_python)
    if a.prepare:
        prepare(a.data, bodies(a)[::-1], py, a.threads, a.configs)
        return
    if a.quick:
        a.repeats, a.no_save = 1, True
    import torch

    torch.set_num_threads(a.threads)
    print(machine_line())
    timed = {"decode", "prefill", "batch", "long-context"} & set(a.rows)
    bandwidth = memory_bandwidth_gbs() if timed and not a.quick else float("nan")
    print(f"# read bandwidth {bandwidth:.1f} GB/s ({a.threads} threads)", flush=True)
    results = {}
    for group in a.rows:
        fn = {"quantize": lambda: rows_quantize(a, a.data), "decode": lambda: rows_decode(a, a.data, py),
              "prefill": lambda: rows_prefill(a, a.data, py), "batch": lambda: rows_batch(a, a.data),
              "long-context": lambda: rows_long_context(a, a.data), "kv-accuracy": lambda: rows_kv_accuracy(a),
              "memory": lambda: rows_memory(a, a.data)}[group]
        results[group] = fn()
        report(group, results[group], bandwidth)
    if not a.no_save:
        path = RESULTS / f"{a.out}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        for group, rows in results.items():
            old[group] = merge_group(old.get(group), rows, {"machine": machine(), "bandwidth_gbs": bandwidth,
                                                            "threads": a.threads})
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(old, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
