"""Fast generation for decoder-only LMs: a static KV cache and a decode step compiled once.

``generate(model, input_ids, max_new_tokens)`` returns what ``model.generate(input_ids, do_sample=False)``
returns for the same model (the same token ids: the layers run the model's own weights, norms, rotary tables and
activation in the same order), without transformers' per-token Python: the decoder (``StaticDecoder``) is one
function of (token ids, cache slots) over preallocated caches; the decode step (batch B, one token) is compiled
once with ``torch.compile(fullgraph=True)`` and serves every position, the prefill runs eagerly or compiled on
padded prompt lengths. A batch of prompts of different lengths comes left-padded with its ``attention_mask``,
as for transformers' ``generate``; the KV cache may be int8 or int4 (``kv_cache_dtype``).

Supported: transformers ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Gemma3ForCausalLM`` (``gemma3_text``: sandwich and q/k norms, local sliding-window layers with their own rope
base, final logit soft-capping) and the mixture-of-experts ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``GptOssForCausalLM`` (attention sinks, alternating sliding windows), sliding windows included, with rotary
types whose tables do not depend on the sequence length (default, linear, llama3, yarn), and affineq's built-in
``TinyLM``. Linear weights may be float or affineq ``AffineQuantizedTensor``s; other linear
modules (e.g. torch.ao dynamic ``Linear``) are called as modules. MoE layers call the model's own router and
experts modules (whatever ``experts_implementation`` the model runs; the ``"eager"`` loop only with
``compile=False``).
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from .kv_cache import check_kv_group_size, kv_cache_kind
from .static_decoder import SUPPORTED_ARCHITECTURES, StaticDecoder, model_limits, padded_prompt_length

__all__ = ["SUPPORTED_ARCHITECTURES", "generate", "StaticDecoder"]

_CACHE_BLOCK = 128  # cache lengths are rounded up to a multiple of this: one compiled step serves many lengths

# -- generate ---------------------------------------------------------------------------------------------

_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _version(p: torch.Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # an inference tensor tracks no version (it cannot be changed in place outside one)
        return 0


def _weights_key(model: nn.Module) -> tuple:
    """Identity and version of every parameter, and the attention / experts implementations the model is set
    to: a decoder built before quantize_ (or any weight swap, an in-place change its fused copies would miss, or
    ``set_attn_implementation`` / ``set_experts_implementation``) is stale after it."""
    cfg = getattr(model, "config", None)
    impls = (getattr(cfg, "_attn_implementation", None), getattr(cfg, "_experts_implementation", None))
    return (*impls, *((id(p), _version(p)) for p in model.parameters()))


def _decoder(model: nn.Module, batch: int, length: int, compile: bool, compile_prefill: bool, cpp_wrapper: bool,
             fuse: bool | None, kv_cache_dtype, kv_group_size: int | None) -> StaticDecoder:
    max_len = -(-length // _CACHE_BLOCK) * _CACHE_BLOCK
    per_model = _decoders.setdefault(model, {})
    key = (batch, max_len, compile, compile_prefill, cpp_wrapper, fuse, next(model.parameters()).dtype,
           kv_cache_kind(kv_cache_dtype), kv_group_size)
    dec, wkey = per_model.get(key, (None, None))
    if dec is None or wkey != _weights_key(model):
        dec = StaticDecoder(model, batch, max_len, compile=compile, compile_prefill=compile_prefill,
                            cpp_wrapper=cpp_wrapper, fuse=fuse, kv_cache_dtype=kv_cache_dtype,
                            kv_group_size=kv_group_size)
        per_model[key] = (dec, _weights_key(model))
    return dec


def _token_id(value) -> int | None:
    """`value` as a token id: a Python or numpy integer, or a 0-d integer tensor (what indexing a tokenizer's
    tensor output gives); None for anything else (bool, float, str, ...: never read as an id)."""
    if isinstance(value, torch.Tensor):
        dt = value.dtype
        ok = value.dim() == 0 and not (dt.is_floating_point or dt.is_complex or dt == torch.bool)
        return int(value) if ok else None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # np.int64 is Integral, np.bool_ not
        return None
    return int(value)


def _eos_ids(model: nn.Module, eos_token_id, vocab: int) -> list[int]:
    """End-of-sequence ids: `eos_token_id`, or the model's generation_config's when None; each in [0, vocab).
    An empty list means none (decode max_new_tokens; nothing banned with ignore_eos)."""
    source = "eos_token_id"
    if eos_token_id is None:
        gen = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None)
        source = "the model's generation_config.eos_token_id"
    if eos_token_id is None:
        return []
    one = _token_id(eos_token_id)
    # a str is iterable too: it must not be read as its characters' ids
    ids = [one] if one is not None else [_token_id(e) for e in eos_token_id] if isinstance(
        eos_token_id, (list, tuple)) else [None]
    if any(i is None or not 0 <= i < vocab for i in ids):
        raise ValueError(f"eos_token_id must be an int or a list of ints in [0, vocab_size) = [0, {vocab}), got "
                         f"{eos_token_id!r}" + ("" if source == "eos_token_id" else f" from {source}; pass "
                                                "eos_token_id explicitly"))
    return ids


def _pad_id(pad_token_id, vocab: int) -> int | None:
    """`pad_token_id` checked: None or an int in [0, vocab) (it is fed back to the model as a token)."""
    if pad_token_id is None:
        return None
    pad = _token_id(pad_token_id)
    if pad is None or not 0 <= pad < vocab:
        raise ValueError(f"pad_token_id must be an int in [0, vocab_size) = [0, {vocab}) or None (the first eos id), "
                         f"got {pad_token_id!r}")
    return pad


def _choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
            generator: torch.Generator | None, banned: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: argmax, or a sample of softmax(logits / temperature) restricted to
    the top_k largest and to the smallest set whose probability reaches top_p; `banned` ids never win."""
    logits = logits.float()
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the first token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def _check(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise ValueError("input_ids must be an int64 tensor [batch, prompt_length] (prompts of different lengths: "
                         f"left-padded, with attention_mask); got {getattr(input_ids, 'dtype', type(input_ids))} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[0] == 0:  # before anything reduces over the ids (min() of an empty tensor raises)
        raise ValueError("input_ids has batch size 0: pass at least one prompt")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: pass at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    # The sampling settings are checked whether or not do_sample is on (a bad value is a mistake either way)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0 or (temperature == 0 and not do_sample)):  # 0: greedy, as other APIs spell it
        raise ValueError(f"temperature must be a number > 0 (or 0 with do_sample=False: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def _check_against_model(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> int:
    """Token ids inside the vocabulary, prompt + new tokens inside max_position_embeddings (before any work);
    returns the vocabulary size."""
    vocab, max_positions = model_limits(model)
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        where = tuple(int(i) for i in (input_ids == bad).nonzero()[0])
        raise ValueError(f"input_ids holds token id {bad} at {where}, outside the model's vocabulary of {vocab} ids "
                         f"[0, {vocab}); tokenize with the model's own tokenizer")
    s = input_ids.shape[1]
    if max_positions is not None and s + max_new_tokens > max_positions:
        raise ValueError(f"prompt length {s} + max_new_tokens {max_new_tokens} = {s + max_new_tokens} exceeds the "
                         f"model's max_position_embeddings {max_positions}; pass max_new_tokens <= "
                         f"{max(max_positions - s, 0)} or a shorter prompt")
    return vocab


def _check_mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor | None:
    """attention_mask [B, S] of 0/1 (int or bool), each row zeros then ones (left padding); None if all ones."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)} (1 = token, "
                         f"0 = left padding); got {got}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex or not bool(
            ((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError(f"attention_mask must hold only 0 and 1 (int or bool), got {attention_mask.dtype} values")
    m = attention_mask.to(torch.int64)
    if bool((m[:, 1:] < m[:, :-1]).any()) or not bool(m[:, -1].all()):
        row = int(((m[:, 1:] < m[:, :-1]).any(1) | (m[:, -1] == 0)).nonzero()[0])
        raise ValueError(f"attention_mask row {row} is not left-padded: generate needs each prompt's pad tokens "
                         "first and its last position a token (tokenizer.padding_side = 'left')")
    return None if bool(m.all()) else m


@torch.inference_mode()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    compile: bool = True,
    compile_prefill: bool = False,
    cpp_wrapper: bool = True,
    fuse_projections: bool | None = None,
    kv_cache_dtype: torch.dtype | str | None = None,
    kv_group_size: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    ignore_eos: bool = False,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Decode up to ``max_new_tokens`` tokens after ``input_ids`` [B, S] (int64); returns [B, S + n] int64.

    Greedy by default: the same ids as ``model.generate(input_ids, attention_mask=..., do_sample=False,
    max_new_tokens=...)``. Prompts of different lengths: left-pad them (``tokenizer.padding_side = "left"``) and
    pass ``attention_mask`` [B, S] (1 = token, 0 = pad); each row then gets transformers' positions (its first
    token at 0) and never attends to its pads. It stops when every row has produced an end-of-sequence token
    (``eos_token_id``, default the model's generation_config; ``ignore_eos=True`` bans those ids instead, as
    transformers' ``min_new_tokens`` and llama.cpp's ``ignore_eos`` do, and always decodes ``max_new_tokens``); rows
    that finished earlier are filled with ``pad_token_id`` (default: the first eos id). Token ids
    (``eos_token_id``: one or a list, ``[]`` for none; ``pad_token_id``) are ints in [0, vocab_size): Python or
    numpy integers or 0-d integer tensors. ``do_sample=True`` samples with ``temperature``, ``top_k``, ``top_p``
    (``generator`` for reproducibility).

    ``kv_cache_dtype``: None keeps the KV cache in the model dtype; ``torch.int8`` (or ``"int8"``) stores int8
    codes with one fp32 scale per ``kv_group_size`` elements of a head and token (default 32, llama.cpp q8_0's
    blocks), ``"int4"`` 4-bit codes with a scale and min per group (keys 16, values 32 by default; see
    ``affineq.models.kv_cache``);
    attention then reads the codes directly (C++ kernel), never a float copy of the cache.

    ``compile=True`` compiles the decode step once per (batch, cache length rounded up to 128, dtype, cache kind);
    the compiled code and the KV cache stay with the model for later calls (rebuilt when its weights change). The
    prefill runs eagerly (one call over the whole prompt: its Python overhead is shared by all prompt tokens), or
    compiled with ``compile_prefill=True`` on prompts padded to a multiple of 64 (static shapes: one compile per
    padded length; benchmarks/README.md has the trade-off). ``cpp_wrapper=True`` has inductor emit the code that
    calls the step's kernels as C++ instead of Python (less per-token overhead; its first compile takes longer,
    later processes load it from inductor's cache). ``fuse_projections`` runs q/k/v and gate/up each as one
    call: dense quantized weights of one config share one kernel call as they are (nothing copied; by default),
    other weights of one format and config run as one linear over their concatenation, a copy the decoder keeps,
    so the default (None) copies only while the copies total at most ``static_decoder.FUSE_COPY_LIMIT`` (256 MiB:
    SmolLM2-size models) and True always; False never fuses.

    Errors (ValueError, before any work): an empty batch, ids outside the vocabulary (prompt, ``eos_token_id``,
    ``pad_token_id``), prompt length + ``max_new_tokens`` above the model's ``max_position_embeddings``, a mask of
    another shape or not left-padded, an unknown ``kv_cache_dtype``, ``kv_group_size`` without a quantized KV
    cache, ``compile=True`` on MoE experts set to transformers' ``"eager"`` loop.
    """
    _check(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p)
    vocab = _check_against_model(model, input_ids, max_new_tokens)
    mask = _check_mask(attention_mask, input_ids)
    check_kv_group_size(kv_cache_kind(kv_cache_dtype), kv_group_size)
    eos = _eos_ids(model, eos_token_id, vocab)
    pad_token_id = _pad_id(pad_token_id, vocab)
    b, s = input_ids.shape
    if max_new_tokens == 0:
        return input_ids.clone()
    length = max(s + max_new_tokens, padded_prompt_length(s) if compile and compile_prefill else 0)
    dec = _decoder(model, b, length, compile, compile_prefill, cpp_wrapper, fuse_projections, kv_cache_dtype,
                   kv_group_size)
    dev = dec.slots.device
    eos_t = torch.tensor(eos, dtype=torch.int64, device=dev)
    banned, eos = (eos_t, []) if ignore_eos and eos else (None, eos)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    ids = input_ids.to(dev).clone(memory_format=torch.contiguous_format)  # an inference tensor like every step input
    dec.set_padding(None if mask is None else mask.to(dev))
    logits = dec.run_prefill(ids)
    out = [ids]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    for i in range(max_new_tokens):
        nxt = _choose(logits, do_sample, temperature, top_k, top_p, generator, banned)
        if eos:
            nxt = nxt.masked_fill(done, pad)
            done = done | torch.isin(nxt, eos_t)
        out.append(nxt[:, None])
        if i + 1 == max_new_tokens or (eos and bool(done.all())):
            break
        logits = dec.step(nxt[:, None], torch.tensor([s + i], device=dev))
    return torch.cat(out, 1)
