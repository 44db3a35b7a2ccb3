"""Accuracy per bit on SmolLM2-135M: for uniform weight configs of the decoder linears, bits per weight counted
from the stored tensors (codes + qparams) against perplexity, mean / 99th-percentile KL divergence and top-1
agreement with the float model (`affineq.eval.compare`, llama.cpp's `perplexity --kl-divergence` definitions),
each config plain round-to-nearest and with an importance matrix (`ImportanceWeightedConfig`), and
`affineq.autoquant` mixes at given budgets (its DEFAULT_CANDIDATES, plus their importance-weighted versions).

    python benchmarks/bench_accuracy_bpw.py             # the full table (run it alone: several minutes)
    python benchmarks/bench_accuracy_bpw.py --quick     # smoke run: a tiny slice, seconds after the model loads
    python benchmarks/bench_accuracy_bpw.py --configs int4-g64 int3-g64 --no-imatrix
    python benchmarks/bench_accuracy_bpw.py --configs --budgets 3.5 4.5   # autoquant rows only
    python benchmarks/bench_accuracy_bpw.py --configs int3-g64 --gptq --budgets --llama   # + a GPTQ row
    python benchmarks/bench_accuracy_bpw.py --configs --budgets --llama-imatrix   # llama.cpp with and without
                                                                     # its own importance matrix

llama.cpp's rows (`--llama`): its quantizer on the shipped Q4_1 file (the llama-cpp-python venv). With
`--llama-imatrix`, the same file types again with llama.cpp's own importance matrix: `llama-imatrix` (built by
benchmarks/build_llama_tools.sh from the llama-cpp-python sdist; `--llama-tools DIR` / $AFFINEQ_LLAMA_TOOLS,
default .llama-tools) run with `-c 512 --chunks 32` on the same GGUF over a text file holding the decoded
calibration ids of the affineq rows (`M.calibration_batches`, 32 x 512 in FULL sizes, plus one window of spare
text so the last chunk is whole). llama-imatrix takes text, not ids: llama.cpp re-tokenizes the file (no BOS:
SmolLM2's vocab adds none), so it sees 32 chunks of 512 tokens, each processed alone as a fresh context like
the affineq calibration items; the run checks with llama.cpp's tokenizer that those are the same ids and prints
how many differ. The imatrix goes to llama.cpp's quantizer (`quantize_gguf(..., imatrix=)`, as llama-quantize
--imatrix normalizes it); rows "llama.cpp <ftype> + imatrix". `--llama-kld-check`: each llama.cpp row also
scored by llama.cpp itself (`llama-perplexity --kl-divergence` against the shipped file converted to F32, on the
same eval ids), stored as the row's "llama_perplexity".

Eval: the first 4 x 512 tokens of `eval_text()` (the pydoc topics the package pins by hash), windows of 512, the
second half of each scored (255 predictions per window, as llama.cpp). The importance matrix comes from
`calibration_text()` (disjoint from the eval text), 32 x 512 tokens. lm_head (tied to the embedding) and the
embedding stay float in every row, so bits per weight are those of the decoder blocks' linears. Writes
results/bench_accuracy_bpw.json (and .png, ppl / KLD against bpw, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, machine_line, save_json  # noqa: E402

import affineq  # noqa: E402
from affineq import eval as aeval  # noqa: E402
from affineq import models as M  # noqa: E402
from affineq.algorithms import GPTQConfig, ImportanceWeightedConfig, collect_importance  # noqa: E402
from affineq.autoquant import DEFAULT_CANDIDATES, FAST_RATIOS, autoquant  # noqa: E402
from affineq.configs import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, QuantConfig  # noqa: E402
from affineq.granularity import PerGroup  # noqa: E402
from affineq.primitives import MappingType, ZeroPointDomain  # noqa: E402
from affineq.quantize import FqnToConfig, quantized_weights  # noqa: E402

ASYM = MappingType.ASYMMETRIC


def _intx(dtype: torch.dtype, group: int) -> Callable[[], QuantConfig]:
    return lambda: IntxWeightOnlyConfig(dtype, PerGroup(group), ASYM, ZeroPointDomain.FLOAT)  # bf16 qparams


# Uniform weight configs, roughly from most to fewest bits.
CONFIGS: dict[str, Callable[[], QuantConfig]] = {
    "int8": lambda: Int8WeightOnlyConfig(),
    "int6-g32": _intx(torch.int6, 32),
    "int5-g32": _intx(torch.int5, 32),
    "int4-g32": lambda: Int4WeightOnlyConfig(group_size=32),
    "int4-g64": lambda: Int4WeightOnlyConfig(group_size=64),
    "int4-g192": lambda: Int4WeightOnlyConfig(group_size=192),  # 128 does not divide SmolLM2's width 576
    "int3-g32": _intx(torch.int3, 32),
    "int3-g64": _intx(torch.int3, 64),
    "int2-g32": _intx(torch.int2, 32),
}

# blocks: how many decoder blocks are quantized (None: all 30); --quick quantizes the first 2 only, and its
# autoquant row chooses among 3 candidates (int3-g64, int4-g64, int8) with a 3-ratio importance grid
FULL = {"windows": 4, "window": 512, "calib_n": 32, "calib_len": 512, "blocks": None, "quick_autoquant": False}
QUICK = {"windows": 2, "window": 64, "calib_n": 2, "calib_len": 64, "blocks": 2, "quick_autoquant": True}


def decoder_linears(blocks: int | None) -> Callable[[nn.Module, str], bool]:
    """filter_fn: the linears of the decoder blocks (of the first `blocks` of them); lm_head stays float."""
    prefixes = None if blocks is None else tuple(f"model.layers.{i}." for i in range(blocks))
    return lambda m, fqn: (isinstance(m, nn.Linear) and fqn != "lm_head"
                           and (prefixes is None or fqn.startswith(prefixes)))


class CachedLogits:
    """The float model's logits per window, computed once and reused by every row's compare()."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.cache = model, {}

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        key = ids.numpy().tobytes()
        if key not in self.cache:
            self.cache[key] = self.model(ids, use_cache=False).logits
        return self.cache[key]


def bits_per_weight(model: nn.Module) -> tuple[float, int]:
    """(bits per weight over the quantized weights, from their stored tensors; how many weights)."""
    qw = quantized_weights(model)
    n = sum(w.numel() for w in qw.values())
    return sum(w.storage_bytes() for w in qw.values()) * 8 / n, n


def run(config_names: list[str], budgets: list[float], imatrix: bool, quick: bool,
        sensitivity_items: int = 2, llama_ftypes: tuple[str, ...] = (), llama_python: str | None = None,
        hqq: bool = False, aq_candidates: list[str] | None = None, aq_calib: int | None = None,
        gptq: bool = False, aq_gptq: bool = False, llama_imatrix: bool = False,
        llama_tools: str | None = None, llama_kld_check: bool = False) -> list[dict]:
    sizes = QUICK if quick else FULL
    selected = decoder_linears(sizes["blocks"])
    model, tok = M.load_smollm2()
    all_ids = torch.tensor(tok(M.eval_text(), add_special_tokens=False, verbose=False)["input_ids"],
                           dtype=torch.int64)
    ids = all_ids[: sizes["windows"] * sizes["window"]]
    reference = CachedLogits(model)
    compare = lambda m: aeval.compare(m, reference, ids, window=sizes["window"], progress=False)  # noqa: E731
    rows = [{"config": "float", "imatrix": False, "bpw": 32.0, **compare(reference)}]  # its cached logits
    print(_line(rows[-1]), flush=True)
    importance = None
    data = M.calibration_batches(tok, sizes["calib_n"], sizes["calib_len"])
    if imatrix and config_names:
        start = time.perf_counter()
        importance = collect_importance(model, data, filter_fn=selected, progress_bar=False)
        print(f"# importance matrix: {len(importance)} linears, {sizes['calib_n']} x {sizes['calib_len']} tokens, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    for name in config_names:
        base = CONFIGS[name]()
        variants = [(False, base)] + ([(True, ImportanceWeightedConfig(base, importance=importance, progress=False))]
                                      if imatrix else [])
        variants += [("gptq", GPTQConfig(base, progress=False))] if gptq else []
        for with_imatrix, config in variants:
            q = copy.deepcopy(model)
            start = time.perf_counter()
            affineq.quantize_(q, config, filter_fn=selected, calibration_data=data if with_imatrix == "gptq" else None)
            seconds = time.perf_counter() - start
            bpw, n = bits_per_weight(q)
            row = {"config": name, "imatrix": with_imatrix is True, "gptq": with_imatrix == "gptq", "bpw": bpw,
                   "weights": n, "quantize_s": seconds, **compare(q)}
            rows.append(row)
            print(_line(row), flush=True)
            del q
    if llama_ftypes:
        check = (LlamaKldCheck(tok, all_ids, sizes, llama_tools, llama_python)
                 if llama_kld_check else None)
        rows += llama_cpp_rows(compare, llama_ftypes, llama_python, check=check)
        if llama_imatrix:
            imat = llama_imatrix_file(tok, sizes, llama_tools, llama_python)
            rows += llama_cpp_rows(compare, llama_ftypes, llama_python, imat, check) if imat is not None else []
        if check is not None:
            check.close()
        # autoquant also at each file's size (rounded down: equal or fewer bits), from the same measurement
        budgets = budgets and sorted(set(budgets) | {math.floor(r["bpw"] * 100) / 100 for r in rows
                                         if r["config"].startswith("llama.cpp")})
    if hqq:
        rows += hqq_rows(model, selected, compare)
    if budgets:
        aq_data = data[:aq_calib] if aq_calib else data
        for row in _autoquant_rows(model, budgets, aq_data, imatrix, selected, compare, sizes["quick_autoquant"],
                                   sensitivity_items, aq_candidates, aq_gptq):
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _autoquant_rows(model, budgets, data, imatrix: bool, selected, compare, quick: bool,
                    sensitivity_items: int = 2, names: list[str] | None = None,
                    with_gptq: bool = False) -> list[dict]:
    """autoquant's plans at `budgets` bits per weight (one measurement) over DEFAULT_CANDIDATES (plain and
    importance-weighted rounding, the importance from the same calibration data; plain only without `imatrix`),
    each applied to a copy of the model and compared."""
    if names:  # a chosen candidate set: these, and importance-weighted those below 5 bpw
        plain = [CONFIGS[k]() for k in names]
        cands = plain + ([ImportanceWeightedConfig(CONFIGS[k](), ratios=FAST_RATIOS, progress=False) for k in names
                          if k not in ("int8", "int6-g32", "int5-g32", "int4-g32")] if imatrix else [])
    elif quick:
        plain = [CONFIGS[k]() for k in ("int3-g64", "int4-g64", "int8")]
        cands = plain + ([ImportanceWeightedConfig(c, ratios=(1.0, 0.9, 0.8), progress=False) for c in plain[:2]]
                         if imatrix else [])
    else:
        cands = [c for c in DEFAULT_CANDIDATES if imatrix or not isinstance(c, ImportanceWeightedConfig)]
    start = time.perf_counter()
    plans = autoquant(model, list(budgets), data, candidates=cands, filter_fn=selected, progress=True,
                      sensitivity_items=sensitivity_items)
    search_s = time.perf_counter() - start
    print(f"# autoquant at {budgets} bpw: {search_s:.0f} s (one measurement; a loaded machine unless run alone)",
          flush=True)
    rows = []
    for budget, plan in zip(budgets, plans, strict=True):
        for gptq in (False, True) if with_gptq else (False,):
            if gptq:  # the same choice with GPTQ around each chosen config: autoquant(..., gptq=True)'s plan
                plan = gptq_plan(plan)
            q = copy.deepcopy(model)
            start = time.perf_counter()
            affineq.quantize_(q, plan, calibration_data=data if gptq else None)
            quantize_s = time.perf_counter() - start
            bpw, n = bits_per_weight(q)
            mix: dict[str, int] = {}
            for key in (names := {f: short_name(c) for f, c in plan.fqn_to_config.items()}).values():
                mix[key] = mix.get(key, 0) + 1
            rows.append({"config": f"autoquant@{budget}" + ("+gptq" if gptq else ""), "imatrix": imatrix,
                         "gptq": gptq, "bpw": bpw, "weights": n, "search_s": search_s, "quantize_s": quantize_s,
                         "mix": mix, "plan": names,
                         **compare(q)})
            del q
    return rows


def gptq_plan(plan: FqnToConfig) -> FqnToConfig:
    """`plan` with GPTQConfig around each config GPTQ can wrap (an importance-weighted one's base), as
    autoquant(..., gptq=True) returns it; apply it with calibration_data."""
    out = {}
    for f, c in plan.fqn_to_config.items():
        try:
            out[f] = GPTQConfig(getattr(c, "base_config", c), progress=False)
        except ValueError:  # a format GPTQ cannot write: kept
            out[f] = c
    return FqnToConfig(out)


def short_name(c: QuantConfig) -> str:
    """int4-g64 / int3-g96+imatrix / int3-g64+gptq for a plan's config."""
    tag = "+imatrix" if isinstance(c, ImportanceWeightedConfig) else "+gptq" if isinstance(c, GPTQConfig) else ""
    return _short(getattr(c, "base_config", c)) + tag


#: llama.cpp file types made from the shipped Q4_1 file (the issue's contest; Q2_K falls back to Q3_K_S-like
#: types on SmolLM2, whose width 576 is not a multiple of 256)
LLAMA_FTYPES = ("Q2_K", "Q4_0", "IQ4_NL", "Q3_K_M")


def gguf_block_bpw(path) -> tuple[float, int, dict[str, int]]:
    """(bits per weight of the decoder blocks' 2-D tensors as stored in the file, their weights, {ggml type:
    tensors}); norms (1-D) and the embedding / output are not counted, as in the affineq rows."""
    from affineq.gguf import reader

    bits = n = 0
    types: dict[str, int] = {}
    for e in reader.read(path).tensors:
        if e.name.startswith("blk.") and len(e.shape) == 2:
            bits += e.data.nbytes * 8
            n += e.shape[0] * e.shape[1]
            types[e.ggml_type] = types.get(e.ggml_type, 0) + 1
    return bits / n, n, types


def _llama_text(tok, ids: torch.Tensor, n: int, llama_python: str | None, what: str) -> str:
    """The text of `ids` for a llama.cpp tool that reads text, and a printed count of how many of the first `n`
    ids llama.cpp's tokenizer gives differently (it drops one trailing newline of -f files)."""
    import _llama_cpp_quantize as lq

    text = tok.decode(ids.tolist(), clean_up_tokenization_spaces=False)
    try:
        theirs = lq.llama_tokenize(M.smollm2_path(), text.removesuffix("\n"), llama_python)[:n]
        differ = sum(a != b for a, b in zip(theirs, ids[:n].tolist(), strict=False)) + abs(n - len(theirs))
        print(f"# llama.cpp's tokens of the {what} text: {differ} of {n} differ from the rows' {what} ids", flush=True)
    except lq.LlamaCppUnavailable as e:
        print(f"# (llama.cpp's tokens of the {what} text not checked: {e})", flush=True)
    return text


def llama_imatrix_file(tok, sizes: dict, tools: str | None, llama_python: str | None) -> Path | None:
    """llama.cpp's importance matrix (llama-imatrix's GGUF file) of the shipped SmolLM2 GGUF over the affineq
    rows' calibration ids (`calib_n` x `calib_len`), as the module docstring says; None, with a printed message
    naming build_llama_tools.sh, without the tool."""
    import tempfile

    import _llama_cpp_quantize as lq

    if lq.find_llama_python(llama_python) is None:  # its quantizer: the rows would be skipped anyway
        print("# llama.cpp + imatrix rows skipped: no llama-cpp-python venv (see --llama-python)", flush=True)
        return None
    if lq.find_llama_tool("llama-imatrix", tools) is None:
        print(f"# llama.cpp + imatrix rows skipped: llama-imatrix is not built; build it with {lq.TOOLS_HINT}",
              flush=True)
        return None
    n, length = sizes["calib_n"], sizes["calib_len"]
    windows = M.calibration_batches(tok, n + 1, length)  # the rows' n windows, then spare text for the last chunk
    text = _llama_text(tok, torch.cat(windows, dim=1)[0], n * length, llama_python, "calibration")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "calibration.txt"
        f.write_bytes(text.encode())
        start = time.perf_counter()
        path, log = lq.llama_imatrix(M.smollm2_path(), f, ctx=length, chunks=n, tools=tools)
    last = [x.split(" I ", 1)[-1] for x in log.splitlines() if "computing over" in x or "Final estimate" in x]
    print(f"# llama-imatrix: {path.name}, {n} chunks of {length} tokens, {time.perf_counter() - start:.0f} s; "
          + " | ".join(x.strip() for x in last), flush=True)
    return path


class LlamaKldCheck:
    """llama.cpp's own `llama-perplexity --kl-divergence` scores of a GGUF file on the rows' eval ids (a text
    file of their decoded ids plus one spare window, `--chunks windows -c window`), against the shipped file
    converted to F32 by llama.cpp (the fp32 model's weights); a cross-check of compare()'s numbers, which
    differ by llama.cpp's arithmetic (it quantizes activations to 8 bits for its quantized dot products)."""

    def __init__(self, tok, all_ids: torch.Tensor, sizes: dict, tools: str | None, llama_python: str | None):
        import tempfile

        import _llama_cpp_quantize as lq

        self.tools, self.sizes, self.ok = tools, sizes, False
        if lq.find_llama_tool("llama-perplexity", tools) is None or lq.find_llama_python(llama_python) is None:
            print(f"# llama-perplexity cross-check skipped: not built ({lq.TOOLS_HINT}) or no llama.cpp venv",
                  flush=True)
            return
        n = sizes["windows"] * sizes["window"]
        text = _llama_text(tok, all_ids[: n + sizes["window"]], n, llama_python, "eval")
        self.dir = tempfile.TemporaryDirectory()
        self.text = Path(self.dir.name) / "eval.txt"
        self.text.write_bytes(text.encode())
        self.base = lq.quantize_gguf(M.smollm2_path(), None, "F32", llama_python=llama_python)
        self.ok = True

    def __call__(self, path: Path) -> dict | None:
        import _llama_cpp_quantize as lq

        if not self.ok:
            return None
        return lq.llama_kld(path, self.base, self.text, ctx=self.sizes["window"], chunks=self.sizes["windows"],
                            tools=self.tools)

    def close(self) -> None:
        if self.ok:
            self.dir.cleanup()


def llama_cpp_rows(compare, ftypes, llama_python: str | None, imatrix: Path | None = None,
                   check: LlamaKldCheck | None = None) -> list[dict]:
    """llama.cpp's quantizer on the shipped SmolLM2 Q4_1 file (allow_requantize, embedding / output Q8_0; with
    `imatrix`, llama-imatrix's file, as llama-quantize --imatrix uses it), each file loaded with
    affineq.gguf.load_model (its codes exactly) and compared with the fp32 model on the same token ids as the
    affineq rows. Skipped with a message without the llama.cpp venv."""
    from _llama_cpp_quantize import LlamaCppUnavailable, quantize_gguf

    from affineq.gguf import load_model

    rows = []
    for ftype in ftypes:
        try:
            path = quantize_gguf(M.smollm2_path(), None, ftype, token_embedding_type="Q8_0",
                                 output_tensor_type="Q8_0", imatrix=imatrix, llama_python=llama_python)
        except LlamaCppUnavailable as e:
            print(f"# llama.cpp rows skipped: {e}", flush=True)
            return rows
        bpw, n, types = gguf_block_bpw(path)
        model = load_model(path)
        rows.append({"config": f"llama.cpp {ftype}" + (" + imatrix" if imatrix is not None else ""),
                     "imatrix": imatrix is not None, "bpw": bpw, "weights": n,
                     "ggml_types": types, **compare(model)})
        print(_line(rows[-1]) + f"  types {types}", flush=True)
        if check is not None and (own := check(path)) is not None:
            rows[-1]["llama_perplexity"] = own
            print(f"{'':>14} llama-perplexity --kl-divergence: " + "  ".join(
                f"{k} {v:.4f}" for k, v in own.items() if v is not None), flush=True)
        del model
    return rows


def hqq_rows(model, selected, compare) -> list[dict]:
    """HQQ at int4 g64 against the reference `hqq` library on the same model and tokens: the library's
    Quantizer (zero-point-only proximal steps, its defaults, fp16 scale / zero as HQQLinear stores them: 4.5 bpw)
    on every decoder linear, then affineq's HQQConfig(Int4WeightOnlyConfig(group_size=64)) (bf16 qparams, 4.5
    bpw) with its defaults and zero-point-only. Skipped with a message when `hqq` is not installed (a benchmark
    peer only: pip install --no-deps hqq termcolor einops)."""
    try:
        from hqq.core.quantize import Quantizer
    except ImportError as e:
        print(f"# hqq rows skipped: the hqq library is not installed ({e}); pip install --no-deps hqq termcolor "
              "einops", flush=True)
        return []
    from affineq.algorithms import HQQConfig

    rows = []
    q = copy.deepcopy(model)
    start = time.perf_counter()
    with torch.no_grad():
        for fqn, m in q.named_modules():
            if selected(m, fqn):
                w_q, meta = Quantizer.quantize(m.weight.data, nbits=4, group_size=64, axis=1, bitpack=False,
                                               compute_dtype=torch.float32, device="cpu")
                meta["scale"], meta["zero"] = meta["scale"].half().float(), meta["zero"].half().float()
                m.weight.data = Quantizer.dequantize(w_q, meta).reshape(m.weight.shape).float()
    rows.append({"config": "hqq library int4-g64", "imatrix": False, "bpw": 4.5,
                 "quantize_s": time.perf_counter() - start, **compare(q)})
    print(_line(rows[-1]), flush=True)
    del q
    base = Int4WeightOnlyConfig(group_size=64)
    for name, cfg in (("affineq HQQ int4-g64", HQQConfig(base, progress=False)),
                      ("affineq HQQ int4-g64 zero-only", HQQConfig(base, optimize_scale=False, progress=False))):
        q = copy.deepcopy(model)
        start = time.perf_counter()
        affineq.quantize_(q, cfg, filter_fn=selected)
        bpw, n = bits_per_weight(q)
        rows.append({"config": name, "imatrix": False, "bpw": bpw, "quantize_s": time.perf_counter() - start,
                     **compare(q)})
        print(_line(rows[-1]), flush=True)
        del q
    return rows


def _short(cfg: QuantConfig) -> str:
    """int4-g64 / int3-g32 / int8 for the configs autoquant picks among."""
    if isinstance(cfg, Int4WeightOnlyConfig):
        return f"int4-g{cfg.group_size}"
    if isinstance(cfg, IntxWeightOnlyConfig):
        return f"{str(cfg.weight_dtype).removeprefix('torch.')}-g{getattr(cfg.granularity, 'group_size', 'row')}"
    return "int8" if isinstance(cfg, Int8WeightOnlyConfig) else type(cfg).__name__


def _line(r: dict) -> str:
    kind = "gptq" if r.get("gptq") else "imatrix" if r["imatrix"] else "rtn"
    return (f"{r['config']:>14} {kind:>7}  bpw {r['bpw']:6.3f}  ppl {r['ppl']:8.3f}  "
            f"KLD {r['mean_kld']:.4f} (p99 {r['kld_p99']:.3f})  top1 {r['top1_agreement']:.3f}"
            + (f"  mix {r['mix']}" if "mix" in r else ""))


def markdown(rows: list[dict]) -> str:
    lines = ["| config | rounding | bits / weight | ppl | mean KLD | KLD p99 | same top-1 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        kind = "GPTQ" if r.get("gptq") else "imatrix" if r["imatrix"] else "RTN"
        lines.append(f"| {r['config']} | {kind} | {r['bpw']:.3f} | {r['ppl']:.3f} | "
                     f"{r['mean_kld']:.4f} | {r['kld_p99']:.3f} | {r['top1_agreement']:.3f} |")
    return "\n".join(lines)


def rows_from_log(path) -> list[dict]:
    """The rows of a run's printed lines (`_line`), for runs saved as logs."""
    import re

    pat = re.compile(r"^\s*(?P<config>.+?)\s+(?P<kind>rtn|imatrix|gptq)\s+bpw\s+(?P<bpw>[\d.]+)\s+ppl\s+(?P<ppl>[\d.]+)"
                     r"\s+KLD\s+(?P<kld>[\d.]+)\s+\(p99\s+(?P<p99>[\d.]+)\)\s+top1\s+(?P<top1>[\d.]+)(?:\s+mix\s+(?P<mix>.*))?")
    rows = []
    for line in Path(path).read_text().splitlines():
        m = pat.match(line.split("\r")[-1])
        if m:
            row = {"config": m["config"], "imatrix": m["kind"] == "imatrix", "gptq": m["kind"] == "gptq",
                   "bpw": float(m["bpw"]),
                   "ppl": float(m["ppl"]), "mean_kld": float(m["kld"]), "kld_p99": float(m["p99"]),
                   "top1_agreement": float(m["top1"])}
            if m["mix"]:
                row["mix"] = m["mix"]
            rows.append(row)
    return rows


def plot(rows: list[dict], name: str) -> None:
    """ppl and mean KLD against bpw: uniform configs (plain / importance-weighted), autoquant, llama.cpp's files,
    HQQ rows; skipped with a message without matplotlib (a benchmark-only install)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(pip install matplotlib for results/{name}.png)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    uniform = [r for r in rows if r["config"] in CONFIGS]
    groups = (("round-to-nearest", "o-", "C0", [r for r in uniform if not r["imatrix"] and not r.get("gptq")]),
              ("importance-weighted", "s--", "C1", [r for r in uniform if r["imatrix"]]),
              ("GPTQ", "^:", "C4", [r for r in uniform if r.get("gptq")]),
              ("autoquant", "*", "k", [r for r in rows if r["config"].startswith("autoquant")]),
              ("llama.cpp files", "v", "C3", [r for r in rows if r["config"].startswith("llama.cpp")
                                                and not r["imatrix"]]),
              ("llama.cpp + imatrix", "^", "C5", [r for r in rows if r["config"].startswith("llama.cpp")
                                                  and r["imatrix"]]),
              ("HQQ int4 g64", "D", "C2", [r for r in rows if "HQQ" in r["config"] or "hqq" in r["config"]]))
    for ax, key, label in ((axes[0], "ppl", "perplexity"), (axes[1], "mean_kld", "mean KLD vs float")):
        for glabel, style, color, grp in groups:
            pts = sorted((r["bpw"], r[key]) for r in grp if r["bpw"] < 5.6)
            if pts:
                ax.plot(*zip(*pts, strict=True), style.lstrip("k"), color=color, label=glabel,
                        markersize=11 if glabel == "autoquant" else 6)
            if glabel.startswith("llama.cpp"):
                for r in grp:
                    ax.annotate(r["config"].removeprefix("llama.cpp ").replace(" + imatrix", "+i"),
                                (r["bpw"], r[key]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
        floats = [r for r in rows if r["config"] == "float"]
        if key == "ppl" and floats:
            ax.axhline(floats[0]["ppl"], color="gray", lw=0.8, label="float")
        ax.set_xlabel("bits per weight (decoder linears, stored tensors)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M: accuracy per bit (4 x 512 tokens, same ids for every row)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / name}.png")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--budgets", nargs="*", type=float, default=[3.5, 4.5],
                   help="autoquant rows at these bits per weight (none: no autoquant rows)")
    p.add_argument("--no-imatrix", action="store_true", help="round-to-nearest rows only")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 x 64 eval tokens, int4-g64 and autoquant@4.5 only, the first 2 decoder blocks")
    p.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    p.add_argument("--sensitivity-items", type=int, default=2,
                   help="calibration items of autoquant's model-units sensitivity pass (one forward each per layer)")
    p.add_argument("--llama", nargs="*", default=list(LLAMA_FTYPES), choices=list(LLAMA_FTYPES),
                   help="llama.cpp file types to compare (none: no llama.cpp rows); needs the llama-cpp-python venv")
    p.add_argument("--llama-python", default=None,
                   help="the llama-cpp-python venv's python (default $AFFINEQ_LLAMA_PYTHON or .venv-llamacpp)")
    p.add_argument("--llama-imatrix", action="store_true",
                   help="also the --llama file types made with llama.cpp's own importance matrix (llama-imatrix "
                        "on the same calibration text; build it with benchmarks/build_llama_tools.sh)")
    p.add_argument("--llama-tools", default=None,
                   help="directory of the built llama.cpp tools (default $AFFINEQ_LLAMA_TOOLS or .llama-tools)")
    p.add_argument("--llama-kld-check", action="store_true",
                   help="each llama.cpp row also scored by llama.cpp itself (llama-perplexity --kl-divergence "
                        "against the F32 file, same eval ids)")
    p.add_argument("--hqq", action="store_true", help="HQQ int4 g64 rows: the hqq library against affineq's HQQ")
    p.add_argument("--name", default=None, help="results file name (default bench_accuracy_bpw[_quick])")
    p.add_argument("--plot-from", nargs="*", default=None,
                   help="only plot: merge the rows of these results (.json) or logs (.log) into results/NAME.png")
    p.add_argument("--aq-candidates", nargs="*", default=None, choices=list(CONFIGS),
                   help="autoquant's candidates (and their importance-weighted versions below 5 bpw) instead of "
                        "DEFAULT_CANDIDATES")
    p.add_argument("--gptq", action="store_true", help="also a GPTQ row (GPTQConfig's defaults) per uniform config")
    p.add_argument("--aq-gptq", action="store_true",
                   help="each autoquant plan also with GPTQ around its chosen configs (autoquant(..., gptq=True))")
    p.add_argument("--aq-calib", type=int, default=None, help="autoquant uses the first N calibration items")
    args = p.parse_args(argv)
    if args.plot_from is not None:
        import json

        rows = []
        for f in args.plot_from:
            rows += json.loads(Path(f).read_text())["rows"] if f.endswith(".json") else rows_from_log(f)
        plot(rows, args.name or "bench_accuracy_bpw")
        return
    if not M.available_models().get("smollm2"):
        raise SystemExit(f"SmolLM2 is not installed: {M.INSTALL_HINT}")
    configs = ["int4-g64"] if args.quick and args.configs == list(CONFIGS) else args.configs
    budgets = [4.5] if args.quick and args.budgets == [3.5, 4.5] else args.budgets
    print(machine_line())
    llama = [] if args.quick and args.llama == list(LLAMA_FTYPES) else args.llama
    rows = run(configs, budgets, not args.no_imatrix, args.quick, args.sensitivity_items, tuple(llama),
               args.llama_python, args.hqq, args.aq_candidates, args.aq_calib, args.gptq,
               args.aq_gptq, args.llama_imatrix, args.llama_tools, args.llama_kld_check)
    table = markdown(rows)
    print()
    print(table)
    if not args.no_save:
        name = args.name or ("bench_accuracy_bpw_quick" if args.quick else "bench_accuracy_bpw")
        sizes = QUICK if args.quick else FULL
        path = save_json(name, {"quick": args.quick, "sizes": sizes, "rows": rows, "table": table})
        print(f"\nwrote {path}")
        plot(rows, name)


if __name__ == "__main__":
    main()
