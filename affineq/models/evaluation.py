"""Offline evaluation helpers: a fixed eval text, perplexity, sentence embeddings, greedy decoding."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "EVAL_TOPIC_KEYS",
    "EVAL_TEXT_SHA256",
    "eval_text",
    "CALIBRATION_TOPIC_KEYS",
    "calibration_text",
    "calibration_batches",
    "byte_tokenize",
    "perplexity",
    "SENTENCES",
    "embed",
    "embedding_similarity",
    "generate_greedy",
]

# Keys of ``pydoc_data.topics.topics`` whose text is byte-identical in CPython 3.10.13, 3.11.2,
# 3.11.7, 3.12.1 and 3.13.0 (checked by hashing each topic under every interpreter). Restricting to
# them makes eval_text() -- and so every perplexity number -- independent of the Python version;
# the other topics are regenerated from the docs at each release and drift even between patch
# releases. About 49 kB of English prose + grammar snippets: ~12k SmolLM2 tokens, 49k bytes.
EVAL_TOPIC_KEYS: tuple[str, ...] = (
    "assert", "bitwise", "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object",
    "bltin-type-objects", "booleans", "break", "callable-types", "comparisons", "context-managers",
    "continue", "del", "dynamic-features", "else", "exceptions", "global", "id-classes", "if",
    "import", "in", "integers", "lambda", "pass", "return", "slicings", "typesfunctions",
    "typesmodules", "unary", "while", "with", "yield",
)  # fmt: skip

EVAL_TEXT_SHA256 = "e3fbdb5ba5b9ae14ab2ba9c6f61d87cb1c0e4de4739285d1eb71f44f42d51629"


def eval_text() -> str:
    """The fixed evaluation text: the EVAL_TOPIC_KEYS topics of ``pydoc_data.topics``, sorted by key,
    each topic's text verbatim (they end in a newline) joined with one blank line.

    Its sha256 is EVAL_TEXT_SHA256; a mismatch means this interpreter ships different topic text and
    perplexities are not comparable with recorded ones.
    """
    from pydoc_data.topics import topics

    missing = [k for k in EVAL_TOPIC_KEYS if k not in topics]
    if missing:
        raise RuntimeError(f"pydoc_data.topics of this Python lacks eval topics {missing}")
    return "\n".join(topics[k] for k in sorted(EVAL_TOPIC_KEYS))


# Keys of ``pydoc_data.topics`` for calibration (GPTQ, AWQ, SmoothQuant, static activations): prose-heavy
# topics, none of them in EVAL_TOPIC_KEYS (checked in calibration_text), so a method calibrated on this text
# is measured on text it has not seen. About 214 kB: ~55k SmolLM2 tokens, enough for 32 x 512 + spares.
# Unlike the eval topics their text may differ slightly between Python releases (calibration only).
CALIBRATION_TOPIC_KEYS: tuple[str, ...] = (
    "assignment", "attribute-access", "calls", "class", "customization", "execmodel", "function",
    "identifiers", "naming", "numeric-types", "objects", "raise", "sequence-types", "string-methods",
    "strings", "try", "types", "typesmapping", "typesseq",
)  # fmt: skip


def calibration_text() -> str:
    """Calibration text, disjoint from eval_text(): the CALIBRATION_TOPIC_KEYS topics of
    ``pydoc_data.topics`` in that (fixed) order, joined with one blank line."""
    from pydoc_data.topics import topics

    shared = set(CALIBRATION_TOPIC_KEYS) & set(EVAL_TOPIC_KEYS)
    if shared:
        raise RuntimeError(f"calibration topics {sorted(shared)} are also eval topics; keep the two disjoint")
    missing = [k for k in CALIBRATION_TOPIC_KEYS if k not in topics]
    if missing:
        raise RuntimeError(f"pydoc_data.topics of this Python lacks calibration topics {missing}")
    return "\n".join(topics[k] for k in CALIBRATION_TOPIC_KEYS)


def calibration_batches(
    tokenizer: Any, n: int = 32, seq_len: int = 512, *, vocab: int | None = None, as_dict: bool = False
) -> list[torch.Tensor] | list[dict[str, torch.Tensor]]:
    """`n` calibration items cut from calibration_text(): consecutive non-overlapping windows of `seq_len`
    token ids, each int64 [1, seq_len] (``as_dict``: {"input_ids": ..., "attention_mask": ones}). The HF
    tokenizer runs without special tokens; tokenizer=None uses byte_tokenize(text, vocab) (TinyLM)."""
    for name, v in (("n", n), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"calibration_batches: {name}={v!r} must be a positive int")
    text = calibration_text()
    if tokenizer is None:
        if vocab is None:
            raise ValueError("calibration_batches(tokenizer=None) needs vocab=<the model's vocab size> for "
                             "byte tokens")
        ids = byte_tokenize(text, vocab)
    else:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.int64)
    if ids.numel() < n * seq_len:
        raise ValueError(f"calibration_batches: the calibration text has {ids.numel()} tokens, fewer than "
                         f"n * seq_len = {n} * {seq_len}; pass a smaller n or seq_len")
    windows = [ids[i * seq_len:(i + 1) * seq_len].unsqueeze(0) for i in range(n)]
    if as_dict:
        return [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in windows]
    return windows


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def byte_tokenize(text: str, vocab: int) -> torch.Tensor:
    """Deterministic tokenizer-free ids for models without a tokenizer: UTF-8 bytes mod vocab, int64 [N]."""
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
    return data % vocab


def _progress(it: Iterable, enabled: bool, **kw: Any) -> Iterable:
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are a nicety; evaluation works without tqdm
        return it
    return tqdm(it, **kw)


def _is_hf(model: nn.Module) -> bool:
    # Duck-typed so transformers is never imported here; TinyLM has no ``generate``.
    config = getattr(model, "config", None)
    return callable(getattr(model, "generate", None)) and hasattr(config, "model_type")


def _model_output(out: Any, field: str) -> torch.Tensor:
    """The main tensor of a model's output: itself, the HF output's `field`, or the first element."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, field):
        return getattr(out, field)
    return out[0]


def _logits(out: Any) -> torch.Tensor:
    return _model_output(out, "logits")


def _model_device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _encode(model: nn.Module, tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids int64 [N] for text: the HF tokenizer without special tokens, or bytes mod vocab."""
    if tokenizer is not None:
        # No BOS/CLS: windows are cut from one running stream, as in the usual HF perplexity recipe.
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ValueError("tokenizer=None needs a model with config.vocab_size (e.g. build_tiny_lm())")
    return byte_tokenize(text, vocab)


@torch.inference_mode()
def perplexity(
    model: nn.Module,
    tokenizer: Any,
    text: str | None = None,
    *,
    max_tokens: int = 4096,
    seq_len: int = 512,
    progress: bool = False,
) -> float:
    """Token-level perplexity exp(mean NLL) of a causal LM.

    The first ``max_tokens`` tokens of ``text`` (default eval_text()) are cut into non-overlapping
    windows of ``seq_len`` tokens (the last one may be shorter); inside each window every token after
    the first is predicted from its prefix, so N tokens give N - n_windows predictions. The model is
    called as model(input_ids [1, T]) and may return logits [1, T, V] or an object with ``.logits``.
    NLL is accumulated in float64 from float32 log-softmax whatever the model dtype.
    """
    ids = _encode(model, tokenizer, eval_text() if text is None else text)[:max_tokens]
    if ids.numel() < 2:
        raise ValueError("need at least 2 tokens to measure perplexity")
    device = _model_device(model)
    kwargs = {"use_cache": False} if _is_hf(model) else {}
    nll, count = 0.0, 0
    starts = range(0, ids.numel(), seq_len)
    for s in _progress(starts, progress, desc="perplexity", unit="win"):
        window = ids[s : s + seq_len]
        if window.numel() < 2:
            break
        x = window.unsqueeze(0).to(device)
        logits = _logits(model(x, **kwargs) if kwargs else model(x))[0, :-1].float()
        nll += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += window.numel() - 1
    return math.exp(nll / count)


# Eight topics x two paraphrases: rows (2i, 2i+1) say the same thing in different words, so a
# healthy encoder scores each pair above any cross-topic pair. Quantization error shows up as the
# embeddings drifting from the float reference (embedding_similarity) before the pairs blur.
SENTENCES: list[str] = [
    "A man is playing a guitar on stage.",
    "Someone performs a song on an acoustic guitar in front of an audience.",
    "The central bank raised interest rates to fight inflation.",
    "To curb rising prices, the monetary authority increased borrowing costs.",
    "My cat sleeps on the windowsill all afternoon.",
    "The kitten naps by the window for most of the day.",
    "Heavy rain caused flooding in several coastal towns.",
    "Storms brought floods to a number of seaside villages.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "You need 2 cups of flour and a little salt for this dish.",
    "Python lists can grow dynamically as elements are appended.",
    "In Python, a list resizes itself automatically when you append items.",
    "The football team won the championship after a dramatic penalty shootout.",
    "After a tense penalty shootout, the soccer club lifted the trophy.",
    "Astronomers discovered a planet orbiting a distant star.",
    "Scientists found a new exoplanet circling a faraway sun.",
]


@torch.inference_mode()
def embed(model: nn.Module, tokenizer: Any, sentences: Sequence[str], batch_size: int = 16) -> torch.Tensor:
    """Sentence embeddings float32 [S, hidden] (384 for MiniLM), mean-pooled over non-padding tokens and
    L2-normalized -- the sentence-transformers recipe for all-MiniLM-L6-v2 (max 256 word pieces)."""
    device = _model_device(model)
    chunks = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(
            list(sentences[i : i + batch_size]),
            padding=True,
            truncation=True,
            max_length=256,
            return_tensors="pt",
        ).to(device)
        hidden = _last_hidden(model(**enc)).float()  # [B, T, H]
        mask = enc["attention_mask"].unsqueeze(-1).float()  # [B, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        chunks.append(F.normalize(pooled, dim=-1).cpu())
    return torch.cat(chunks)


def _last_hidden(out: Any) -> torch.Tensor:
    return _model_output(out, "last_hidden_state")


def embedding_similarity(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean cosine similarity between matching rows of ref and other [S, D] (1.0 = identical directions)."""
    if ref.shape != other.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(other.shape)}")
    return F.cosine_similarity(ref.float(), other.float(), dim=-1).mean().item()


@torch.inference_mode()
def generate_greedy(model: nn.Module, tokenizer: Any, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Batch-1 greedy decoding; returns prompt + exactly ``new_tokens`` ids, int64 [1, T + new_tokens].

    HF models use ``model.generate`` (KV cache, do_sample=False); EOS is suppressed via
    min_new_tokens so every call decodes the same number of tokens (tokens/s comparable). Other models
    (TinyLM) run a plain no-cache loop re-feeding the whole sequence. ``tokenizer`` is only used to
    supply a pad id to HF generate and may be None.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids.unsqueeze(0)
    if prompt_ids.shape[0] != 1:
        raise ValueError("generate_greedy decodes a single sequence (batch 1)")
    ids = prompt_ids.to(_model_device(model), torch.int64)
    if new_tokens <= 0:
        return ids
    if _is_hf(model):
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(model.generation_config, "pad_token_id", None)
        if pad is None:
            pad = model.config.eos_token_id
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=pad,
            # Cleared so a model's sampling defaults (generation_config) don't trigger warnings.
            temperature=None,
            top_p=None,
            top_k=None,
        )
    for _ in range(new_tokens):
        nxt = _logits(model(ids))[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids
