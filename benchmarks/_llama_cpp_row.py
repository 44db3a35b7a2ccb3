"""The llama.cpp row of bench_decode.py, run under the benchmark-only llama-cpp-python venv.

Imports neither affineq nor torch (that venv has neither). Called as

    python _llama_cpp_row.py '{"model": PATH, "prompt_ids": [...], "prompt_text": "...", "new_tokens": 64,
                              "threads": 2, "repeats": 5}'

and prints one line ``ROW {json}``. Greedy decoding by hand on the low-level eval API, so EOS is never
special and the input is exactly our token ids: ``llm.eval(prompt_ids)``, then n - 1 times
``tok = argmax(last logits)`` (llama_get_logits_ith), ``llm.eval([tok])``. Timed per run: prefill =
eval(prompt) + first argmax; decode = the n - 1 single-token steps (eval + argmax each), so decode
tok/s = (n - 1) / decode s, the definition bench_decode.py uses for every row. Median over `repeats`
runs after one warm-up run. ``internal_decode_tok_s`` is llama.cpp's own timer of the same steps (no
Python), to show what the binding adds.

``"turns": {"dir": D, "role": R}`` (optional) pairs the timed runs with another process's (``_turns.Turns``): the
warm-up and each repeat wait for their turn, so the two rows alternate on the same machine.

``{"task": "compare", "model": PATH, "prompt_ids": [...], "new_tokens": 24, "windows": [[ids], ...]}``
(bench_gguf's correctness rows) prints instead ``ROW {"tokens": greedy ids, "nll": sum, "count": predictions,
"ppl": exp(nll / count)}``: each window evaluated from an empty KV cache with every position's logits
(logits_all), token i + 1 scored by log_softmax of position i's logits (natural log, float64), as
affineq's side does on the same ids. Untimed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
from llama_cpp import Llama, llama_get_logits_ith, llama_perf_context, llama_perf_context_reset


def _amx_host() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "amx_tile" in fh.read()
    except OSError:
        return False


#: llama-cpp-python 0.3.36 segfaults on AMX hosts in its first eval with ggml's extra buffer types on (the AMX /
#: repacked weight buffers), so there the models load with use_extra_bufts=False: its CPU buffers and the AVX-512
#: VNNI dot products. The Llama constructor has no argument for it, so the default model params get it.
EXTRA_BUFTS = not _amx_host()
if not EXTRA_BUFTS:
    import llama_cpp.llama as _llama_module

    _default_params = _llama_module.llama_cpp.llama_model_default_params

    def _params_without_extra_bufts():
        params = _default_params()
        params.use_extra_bufts = False
        return params

    _llama_module.llama_cpp.llama_model_default_params = _params_without_extra_bufts


def _argmax_last(llm: Llama) -> int:
    """Greedy token from the last evaluated position's logits. Read from the context itself: with
    logits_all=False, llama-cpp-python 0.3.x no longer copies them into ``llm.scores``."""
    return int(np.argmax(np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))


def _greedy(llm: Llama, prompt_ids: list[int], n: int) -> tuple[list[int], float, float]:
    """(n generated ids, prefill s, decode s of the n - 1 later tokens), from an empty KV cache."""
    llm.reset()
    llama_perf_context_reset(llm.ctx)
    t0 = time.perf_counter()
    llm.eval(prompt_ids)
    out = [_argmax_last(llm)]
    t1 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([out[-1]])
        out.append(_argmax_last(llm))
    return out, t1 - t0, time.perf_counter() - t1


def _window_nll(llm: Llama, window: list[int]) -> float:
    """Sum of -log p(window[i + 1] | window[:i + 1]) over the window, from an empty KV cache."""
    llm.reset()
    llm.eval(window)
    logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return float((logz - logits[np.arange(len(window) - 1), window[1:]]).sum())


def compare(args: dict) -> dict:
    """Greedy tokens and perplexity on given ids (no timing): the "compare" task of the module docstring."""
    import math

    windows = [[int(i) for i in w] for w in args.get("windows", [])]
    ids = [int(i) for i in args["prompt_ids"]]
    n = int(args.get("new_tokens", 24))
    threads = int(args.get("threads", 2))
    n_ctx = max([len(ids) + n, *map(len, windows)])
    llm = Llama(model_path=args["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    row: dict = {"tokens": _greedy(llm, ids, n)[0] if n else []}
    text = args.get("prompt_text")
    if text is not None:
        theirs = llm.tokenize(text.encode(), add_bos=bool(args.get("add_bos", False)), special=True)
        row["tokenizer_ids_equal"] = theirs == ids
        if theirs != ids:
            row["llama_cpp_prompt_ids"] = theirs
    nll = sum(_window_nll(llm, w) for w in windows)
    count = sum(len(w) - 1 for w in windows)
    row.update(nll=nll, count=count, ppl=math.exp(nll / count) if count else None)
    return row


def run(args: dict) -> dict:
    n, ids = int(args["new_tokens"]), [int(i) for i in args["prompt_ids"]]
    if n < 2:
        raise ValueError("new_tokens must be >= 2 (decode time covers tokens 2..n)")
    threads = int(args.get("threads", 2))
    t = time.perf_counter()
    n_ctx = max(512, len(ids) + n)  # bench_scale's long prompts
    llm = Llama(model_path=args["model"], n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                logits_all=False, verbose=False)
    load_s = time.perf_counter() - t
    row: dict = {"load_s": load_s, "llama_cpp_threads": threads, "llama_cpp_extra_bufts": EXTRA_BUFTS}
    text = args.get("prompt_text")
    if text is not None:
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        row["tokenizer_ids_equal"] = theirs == ids
        if theirs != ids:
            print(f"note: llama.cpp tokenizes the prompt as {theirs}, ours is {ids}; the row feeds our ids",
                  file=sys.stderr)
    turns = None
    if args.get("turns"):  # paired with an affineq row (bench_scale): runs alternate with the partner's
        from _turns import Turns

        turns = Turns(args["turns"]["dir"], int(args["turns"]["role"]))
        turns.start()
        turns.wait()
    tokens, _, _ = _greedy(llm, ids, n)  # warm-up (page-in of the mmapped weights, thread pool)
    if turns:
        turns.give()
    prefill, decode, internal = [], [], []
    for _ in range(int(args.get("repeats", 5))):
        if turns:
            turns.wait()
        again, p, d = _greedy(llm, ids, n)
        if turns:
            turns.give()
        perf = llama_perf_context(llm.ctx)  # llama.cpp's own timer of the single-token decodes
        if perf.n_eval and perf.t_eval_ms > 0:
            internal.append(perf.n_eval / (perf.t_eval_ms * 1e-3))
        if again != tokens:
            row["nondeterministic"] = True
        prefill.append(p)
        decode.append(d)
    d = statistics.median(decode)
    row.update(tokens=tokens, prefill_ms=statistics.median(prefill) * 1e3, decode_tok_s=(n - 1) / d,
               ms_per_token=d / (n - 1) * 1e3, runs=len(decode),
               # without llama-cpp-python's per-token Python work (batch setup, ctypes, our argmax)
               internal_decode_tok_s=statistics.median(internal) if internal else None)
    import llama_cpp

    row["llama_cpp_version"] = getattr(llama_cpp, "__version__", None)
    row["system_info"] = llama_cpp.llama_print_system_info().decode()  # SIMD the build uses (GGML_NATIVE)
    return row


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print("ROW " + json.dumps(compare(job) if job.get("task") == "compare" else run(job)), flush=True)
