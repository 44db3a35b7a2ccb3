"""llama.cpp's own quantizer (`llama_model_quantize` of llama-cpp-python) on a GGUF file, for benchmarks that
compare affineq with the files llama.cpp makes. Imports neither torch nor affineq.

From a benchmark (any environment):

    from _llama_cpp_quantize import LlamaCppUnavailable, quantize_gguf
    path = quantize_gguf(src, dst, "Q4_K_M")            # dst=None: the cached file itself

runs this file under the benchmark venv's python (``llama_python``, else $AFFINEQ_LLAMA_PYTHON, else
.venv-llamacpp/bin/python in the repository root) with ``allow_requantize=True`` (the shipped files are already
quantized: llama.cpp dequantizes each tensor to float32 and quantizes it again). Outputs are cached under
$AFFINEQ_LLAMA_QUANT_CACHE (default ~/.cache/affineq/llama_quantize), keyed by the source's resolved path, size
and mtime, the arguments and the imatrix file's bytes; ``dst`` gets a hard link (or a copy) of the cached file.
No venv: `LlamaCppUnavailable` (a RuntimeError) saying how to make one; bad arguments: ValueError.

`ftype`: a llama.cpp file type (``Q4_K_M``, ``Q2_K``, ``Q3_K_S``, ``Q4_0``, ``Q8_0``, ``IQ4_NL``, ... the names
of ``LLAMA_FTYPE_MOSTLY_*``; ``F32`` = ALL_F32). `token_embedding_type` / `output_tensor_type`: ggml type names
(``Q8_0``, ``Q6_K``, ``F16``, ...) for token_embd.weight / output.weight. `imatrix`: an importance matrix, either
llama-imatrix's GGUF file (``<tensor>.in_sum2`` / ``<tensor>.counts``, normalized by counts as llama-quantize
does; read with the ``gguf`` package) or an ``.npz`` {GGUF tensor name: float32 [in_features] (or
[experts * in_features]) mean of x^2 per input column}.

llama.cpp's own importance matrix (``llama_imatrix``) comes from its ``llama-imatrix`` tool, which the pip
package does not build: ``bash benchmarks/build_llama_tools.sh`` builds it from the llama-cpp-python sdist into
``.llama-tools`` (or ``--llama-tools DIR`` / $AFFINEQ_LLAMA_TOOLS); it runs as a subprocess. ``llama_tokenize``
tokenizes text with llama.cpp's tokenizer of a GGUF file (the venv, ``vocab_only``), as the tools do.

Under the venv: ``python _llama_cpp_quantize.py '{"src": ..., "dst": ..., "ftype": ..., ...}'`` prints
``DONE {json}`` (``{"op": "tokenize", "model": ..., "text_file": ...}``: the token ids).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_HINT = ('python -m venv .venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON" '
             ".venv-llamacpp/bin/pip install llama-cpp-python==0.3.36")
FTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M",
          "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS",
          "IQ3_XS", "IQ3_S", "IQ3_M", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE")
GGML_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "MXFP4")


class LlamaCppUnavailable(RuntimeError):
    """No llama-cpp-python venv: the llama.cpp side of a benchmark is skipped."""


def _cache_dir() -> Path:
    """Where llama.cpp's outputs are cached: $AFFINEQ_LLAMA_QUANT_CACHE, default ~/.cache/affineq/llama_quantize."""
    cache = Path(os.environ.get("AFFINEQ_LLAMA_QUANT_CACHE") or Path.home() / ".cache/affineq/llama_quantize")
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _digest(key: dict) -> str:
    """A cache key's 16 hex digits (sha256 of its sorted JSON)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def find_llama_python(llama_python: str | os.PathLike | None = None) -> Path | None:
    """The benchmark venv's python: the argument, else $AFFINEQ_LLAMA_PYTHON, else .venv-llamacpp/bin/python."""
    p = Path(llama_python or os.environ.get("AFFINEQ_LLAMA_PYTHON") or HERE.parent / ".venv-llamacpp/bin/python")
    return p if p.exists() else None


def _check_type(kind: str | None, names: tuple[str, ...], param: str) -> str | None:
    if kind is None:
        return None
    k = str(kind).upper()
    if k not in names:
        raise ValueError(f"quantize_gguf: {param}={kind!r} is not a llama.cpp type; use one of {', '.join(names)}")
    return k


def _imatrix_npz(imatrix: Path, cache: Path) -> Path:
    """An .npz as the venv side reads it: a GGUF imatrix is converted (sums / counts per expert, as
    llama-quantize normalizes it); an .npz is used as is."""
    if imatrix.suffix == ".npz":
        return imatrix
    if imatrix.suffix != ".gguf":
        raise ValueError(f"quantize_gguf: imatrix={str(imatrix)!r}: use llama-imatrix's .gguf file or an .npz "
                         "{tensor name: mean x^2 per input column}; the legacy .dat format is not read")
    import gguf  # the main environment's (affineq[gguf]); the venv side needs only numpy
    import numpy as np

    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in gguf.GGUFReader(str(imatrix)).tensors:
        for suffix in (".in_sum2", ".counts"):
            if t.name.endswith(suffix):
                parts.setdefault(t.name[: -len(suffix)], {})[suffix] = np.asarray(t.data, np.float32).reshape(-1)
    out = {}
    for name, p in parts.items():
        if len(p) != 2:
            raise ValueError(f"quantize_gguf: imatrix {imatrix}: {name} lacks in_sum2 or counts")
        sums, counts = p[".in_sum2"], p[".counts"]
        per = sums.reshape(counts.size, -1)
        out[name] = np.where(counts[:, None] > 0, per / np.where(counts > 0, counts, 1)[:, None], 1.0).reshape(-1)
    dst = cache / f"imatrix-{hashlib.sha256(imatrix.read_bytes()).hexdigest()[:16]}.npz"
    if not dst.exists():
        np.savez(dst, **{k: v.astype(np.float32) for k, v in out.items()})
    return dst


def quantize_gguf(src: str | os.PathLike, dst: str | os.PathLike | None, ftype: str, *,
                  token_embedding_type: str | None = None, output_tensor_type: str | None = None,
                  imatrix: str | os.PathLike | None = None, llama_python: str | os.PathLike | None = None,
                  threads: int = 2) -> Path:
    """`src` (a GGUF file) quantized by llama.cpp to file type `ftype`; returns `dst` (or the cached file when
    `dst` is None). See the module docstring for the arguments and the cache."""
    src = Path(src).resolve()
    if not src.is_file():
        raise ValueError(f"quantize_gguf: src={str(src)!r} is not a file")
    args = {"ftype": _check_type(ftype, FTYPES, "ftype"),
            "token_embedding_type": _check_type(token_embedding_type, GGML_TYPES, "token_embedding_type"),
            "output_tensor_type": _check_type(output_tensor_type, GGML_TYPES, "output_tensor_type")}
    py = find_llama_python(llama_python)
    if py is None:
        raise LlamaCppUnavailable(f"llama.cpp's quantizer needs the llama-cpp-python venv; create it ({VENV_HINT}) "
                                  "or pass llama_python= / set AFFINEQ_LLAMA_PYTHON")
    cache = _cache_dir()
    st = src.stat()
    key = {**args, "src": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "imatrix": None}
    if imatrix is not None:
        imatrix = Path(imatrix)
        if not imatrix.is_file():
            raise ValueError(f"quantize_gguf: imatrix={str(imatrix)!r} is not a file")
        key["imatrix"] = hashlib.sha256(imatrix.read_bytes()).hexdigest()
        args["imatrix"] = str(_imatrix_npz(imatrix, cache))
    digest = _digest(key)
    out = cache / f"{src.stem}.{args['ftype']}.{digest}.gguf"
    if not out.exists():
        fd, tmp = tempfile.mkstemp(suffix=".gguf.tmp", dir=cache)
        os.close(fd)
        try:
            job = {**args, "src": str(src), "dst": tmp, "threads": int(threads)}
            r = subprocess.run([str(py), str(Path(__file__).resolve()), json.dumps(job)], capture_output=True,
                               text=True)
            if r.returncode != 0 or not any(x.startswith("DONE ") for x in r.stdout.splitlines()):
                raise RuntimeError(f"llama.cpp's quantizer failed on {src.name} -> {args['ftype']} (exit "
                                   f"{r.returncode}):\n{(r.stderr + r.stdout)[-3000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    if dst is None:
        return out
    dst = Path(dst)
    if dst.resolve() != out.resolve():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(out, dst)
        except OSError:
            shutil.copy2(out, dst)
    return dst


TOOLS_HINT = ("bash benchmarks/build_llama_tools.sh [llama_cpp_python-0.3.36.tar.gz] [DIR]  (default DIR "
              ".llama-tools; then --llama-tools DIR or AFFINEQ_LLAMA_TOOLS=DIR)")


def find_llama_tool(name: str, tools: str | os.PathLike | None = None) -> Path | None:
    """llama.cpp's tool `name` (``llama-imatrix``, ``llama-perplexity``) in `tools`, else $AFFINEQ_LLAMA_TOOLS,
    else .llama-tools in the repository root (DIR/bin/NAME or DIR/NAME, as build_llama_tools.sh leaves them)."""
    d = Path(tools or os.environ.get("AFFINEQ_LLAMA_TOOLS") or HERE.parent / ".llama-tools")
    for p in (d / "bin" / name, d / name):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def llama_imatrix(model: str | os.PathLike, text_file: str | os.PathLike, *, ctx: int = 512,
                  chunks: int | None = None, tools: str | os.PathLike | None = None, threads: int = 2,
                  timeout: float = 3600) -> tuple[Path, str]:
    """llama.cpp's importance matrix of GGUF `model` over the text in `text_file`: ``llama-imatrix -m model -f
    text_file -c ctx [--chunks chunks] -o <cache>.gguf`` (its GGUF format: ``<tensor>.in_sum2`` / ``.counts``;
    the tokens are llama.cpp's tokenization of the text, cut into ``ctx``-token chunks, a BOS written over each
    chunk's first token only when the vocab adds one). Cached like quantize_gguf's outputs, keyed by the model's
    path, size and mtime, the text's bytes and the arguments. Returns (the file, the tool's log tail). No tool:
    LlamaCppUnavailable naming build_llama_tools.sh."""
    exe = find_llama_tool("llama-imatrix", tools)
    if exe is None:
        raise LlamaCppUnavailable(f"llama.cpp's llama-imatrix is not built; build it with {TOOLS_HINT}")
    model, text_file = Path(model).resolve(), Path(text_file)
    cache = _cache_dir()
    st = model.stat()
    key = {"model": str(model), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctx": int(ctx),
           "chunks": chunks, "text": hashlib.sha256(text_file.read_bytes()).hexdigest()}
    digest = _digest(key)
    out = cache / f"imatrix-{model.stem}-{digest}.gguf"
    log = out.with_suffix(".log")
    if out.exists():
        return out, (log.read_text()[-2000:] if log.exists() else "(cached)")
    tmp = out.with_name(out.stem + ".tmp.gguf")
    cmd = [str(exe), "-m", str(model), "-f", str(text_file), "-c", str(int(ctx)), "-t", str(int(threads)),
           "-o", str(tmp), "--output-frequency", "1000000"]
    cmd += ["--chunks", str(int(chunks))] if chunks is not None else []
    r = _run_into(cmd, tmp, out, "llama-imatrix", timeout)
    log.write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    return out, log.read_text()[-2000:]


def _run_into(cmd: list[str], tmp: Path, dst: Path, what: str, timeout: float) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool that writes `tmp`, then move it to `dst` (never a half-written `dst`)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not tmp.is_file():
            raise RuntimeError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}\n{(r.stderr + r.stdout)[-3000:]}")
        os.replace(tmp, dst)
        return r
    finally:
        tmp.unlink(missing_ok=True)


def _stat(text: str, label: str) -> float | None:
    import re

    m = re.search(re.escape(label) + r"\s*:\s*([-\d.]+)", text)
    return float(m.group(1)) if m else None


def llama_kld(model: str | os.PathLike, base: str | os.PathLike, text_file: str | os.PathLike, *, ctx: int = 512,
              chunks: int | None = None, tools: str | os.PathLike | None = None, threads: int = 2,
              timeout: float = 3600) -> dict:
    """llama.cpp's own scores of GGUF `model` against GGUF `base` (``llama-perplexity --kl-divergence``): the
    base's logits over `text_file` (``-c ctx [--chunks chunks] --kl-divergence-base``, cached), then `model` on
    the same tokens. Returns {"ppl", "ppl_base", "mean_kld", "kld_p99", "top1_agreement"} as llama-perplexity
    prints them (the second half of each chunk scored). No tool: LlamaCppUnavailable."""
    exe = find_llama_tool("llama-perplexity", tools)
    if exe is None:
        raise LlamaCppUnavailable(f"llama.cpp's llama-perplexity is not built; build it with {TOOLS_HINT}")
    base, model, text_file = Path(base).resolve(), Path(model).resolve(), Path(text_file)
    cache = _cache_dir()
    st = base.stat()
    key = {"base": str(base), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctx": int(ctx), "chunks": chunks,
           "text": hashlib.sha256(text_file.read_bytes()).hexdigest()}
    logits = cache / f"kld-base-{_digest(key)}.bin"
    common = ["-c", str(int(ctx)), "-t", str(int(threads))]
    if not logits.exists():
        tmp = logits.with_name(logits.stem + ".tmp.bin")
        cmd = [str(exe), "-m", str(base), "-f", str(text_file), *common, "--kl-divergence-base", str(tmp)]
        cmd += ["--chunks", str(int(chunks))] if chunks is not None else []
        _run_into(cmd, tmp, logits, "llama-perplexity (base logits)", timeout)
    cmd = [str(exe), "-m", str(model), *common, "--kl-divergence-base", str(logits), "--kl-divergence"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    stats = {"ppl": _stat(out, "Mean PPL(Q)"), "ppl_base": _stat(out, "Mean PPL(base)"),
             "mean_kld": _stat(out, "Mean    KLD"), "kld_p99": _stat(out, "99.0%   KLD")}
    top = _stat(out, "Same top p")
    stats["top1_agreement"] = None if top is None else top / 100
    chunk_lines = [x.split() for x in out.splitlines() if x.strip()[:1].isdigit() and x.count("±") == 5]
    if stats["mean_kld"] is None and chunk_lines:  # under 100 scored tokens it prints only the running values
        v = [float(x.rstrip("%")) for x in chunk_lines[-1] if x not in ("±", "%")]  # chunk, ppl, +-, ln, +-, ...
        stats.update(ppl=v[1], mean_kld=v[5], top1_agreement=v[9] / 100)
    if r.returncode != 0 or stats["mean_kld"] is None:
        raise RuntimeError(f"llama-perplexity --kl-divergence failed (exit {r.returncode}): {' '.join(cmd)}\n"
                           f"{out[-3000:]}")
    return stats


def llama_tokenize(model: str | os.PathLike, text: str, llama_python: str | os.PathLike | None = None,
                   timeout: float = 600) -> list[int]:
    """llama.cpp's token ids of `text` with GGUF `model`'s vocab, as llama-imatrix / llama-perplexity tokenize a
    file (``add_special`` true: a BOS only when the vocab adds one; special tokens not parsed). Runs under the
    llama-cpp-python venv; none: LlamaCppUnavailable."""
    py = find_llama_python(llama_python)
    if py is None:
        raise LlamaCppUnavailable(f"llama.cpp's tokenizer needs the llama-cpp-python venv; create it ({VENV_HINT}) "
                                  "or pass llama_python= / set AFFINEQ_LLAMA_PYTHON")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "text.txt"
        f.write_bytes(text.encode())
        job = {"op": "tokenize", "model": str(Path(model).resolve()), "text_file": str(f)}
        r = subprocess.run([str(py), str(Path(__file__).resolve()), json.dumps(job)], capture_output=True, text=True,
                           timeout=timeout)
    done = [x for x in r.stdout.splitlines() if x.startswith("DONE ")]
    if r.returncode != 0 or not done:
        raise RuntimeError(f"llama.cpp's tokenizer failed (exit {r.returncode}):\n{(r.stderr + r.stdout)[-3000:]}")
    return json.loads(done[-1][5:])["ids"]


# -- the venv side ----------------------------------------------------------------------------------------------


def _run_in_venv(job: dict) -> dict:
    import ctypes

    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    ftype = job["ftype"]
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32 if ftype == "F32" else getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_"
                                                                                  + ftype)
    params.nthread = int(job.get("threads", 2))
    params.allow_requantize = True
    for field in ("token_embedding_type", "output_tensor_type"):
        if job.get(field):
            setattr(params, field, getattr(llama_cpp, "GGML_TYPE_" + job[field]))
    keep = []  # the imatrix arrays must outlive the call
    if job.get("imatrix"):
        data = np.load(job["imatrix"])
        entries = (llama_cpp.llama_model_imatrix_data * (len(data.files) + 1))()  # ends with name == NULL
        for i, name in enumerate(data.files):
            arr = np.ascontiguousarray(data[name], dtype=np.float32)
            keep += [arr, name.encode()]
            entries[i].name = keep[-1]
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(entries)
    rc = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    return {"dst": job["dst"], "bytes": os.path.getsize(job["dst"]),
            "llama_cpp_version": getattr(llama_cpp, "__version__", None)}


def _tokenize_in_venv(job: dict) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=job["model"], vocab_only=True, verbose=False)
    text = Path(job["text_file"]).read_bytes()
    return {"ids": llm.tokenize(text, add_bos=True, special=False)}  # llama_tokenize(add_special=True, ...)


if __name__ == "__main__":
    _job = json.loads(sys.argv[1])
    print("DONE " + json.dumps(_tokenize_in_venv(_job) if _job.get("op") == "tokenize" else _run_in_venv(_job)),
          flush=True)
