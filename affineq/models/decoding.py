"""Fast generation for decoder-only LMs: a static KV cache and a decode step compiled once.

``generate(model, input_ids, max_new_tokens)`` returns what ``model.generate(input_ids, do_sample=False)``
returns for the same model (the same token ids: the layers run the model's own weights, norms, rotary tables and
activation in the same order), without transformers' per-token Python: the decoder is rebuilt here as one
function of (token ids, positions) over preallocated caches; the decode step (batch B, one token) is compiled
once with ``torch.compile(fullgraph=True)`` and serves every position, the prefill runs eagerly or compiled on
padded prompt lengths.

Supported: transformers ``LlamaForCausalLM``, ``MistralForCausalLM`` (no sliding window) and
``Qwen2ForCausalLM`` (no sliding window), with rotary types whose tables do not depend on the sequence length
(default, linear, llama3, yarn), and affineq's built-in ``TinyLM``. Linear weights may be float or affineq
``AffineQuantizedTensor``s; other linear modules (e.g. torch.ao dynamic ``Linear``) are called as modules.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SUPPORTED_ARCHITECTURES", "generate", "StaticDecoder"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "affineq TinyLM")
_HF_TYPES = ("llama", "mistral", "qwen2")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_CACHE_BLOCK = 128  # cache lengths are rounded up to a multiple of this: one compiled step serves many lengths
PREFILL_BLOCK = 64  # compiled prefill: prompts are padded to a multiple of this (static shapes, few graphs)


# -- the model, as plain callables ------------------------------------------------------------------------


def _linear(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> mod(x) without nn.Module.__call__ (eager overhead) for a plain nn.Linear."""
    if type(mod) is nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    return mod


def _fused(mods: list[nn.Module]) -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
    """One linear computing several (q/k/v, gate/up) on the same input, split after: None where the weights cannot
    be concatenated (different configs or formats, non-Linear modules)."""
    if any(type(m) is not nn.Linear for m in mods) or len({type(m.weight) for m in mods}) != 1:
        return None
    if any(m.bias is not None for m in mods) and any(m.bias is None for m in mods):
        return None
    try:
        with torch.no_grad():
            w = torch.cat([m.weight.detach() for m in mods], 0)
            b = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods], 0)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    sizes = [m.out_features for m in mods]
    return lambda x: F.linear(x, w, b).split(sizes, -1)


@dataclass
class _Layer:
    norm1: nn.Module
    qkv: Callable[[torch.Tensor], list[torch.Tensor]]
    o: Callable[[torch.Tensor], torch.Tensor]
    norm2: nn.Module
    gate_up: Callable[[torch.Tensor], list[torch.Tensor]]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]


def _unfused(*mods: nn.Module) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    fns = [_linear(m) for m in mods]
    return lambda x: [f(x) for f in fns]


def _layers(blocks, act, fuse: bool) -> list[_Layer]:
    out = []
    for blk in blocks:
        at, mlp = blk.self_attn, blk.mlp
        qkv = (fuse and _fused([at.q_proj, at.k_proj, at.v_proj])) or _unfused(at.q_proj, at.k_proj, at.v_proj)
        gate_up = (fuse and _fused([mlp.gate_proj, mlp.up_proj])) or _unfused(mlp.gate_proj, mlp.up_proj)
        out.append(_Layer(blk.input_layernorm, qkv, _linear(at.o_proj), blk.post_attention_layernorm, gate_up,
                          _linear(mlp.down_proj), getattr(mlp, "act_fn", act)))
    return out


@dataclass
class _Arch:
    """What the decoder needs of a model: its modules and shapes, and the rotary tables for positions 0..T-1."""

    embed: nn.Module
    layers: list[_Layer]
    norm: nn.Module
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    rope: Callable[[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype


def _unsupported(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"affineq.models.generate does not support this model ({type(model).__name__}: {why}). Supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}; use model.generate(...) for others"
    )


def _describe(model: nn.Module, fuse: bool) -> _Arch:
    from .tiny import TinyLM, _rope_angles

    dtype = next(model.parameters()).dtype
    if isinstance(model, TinyLM):
        cfg = model.config

        dev = model.embed_tokens.weight.device  # the closures below must not hold the model (cache key, weakref)

        def tiny_rope(t: int, dt: torch.dtype):
            ang = _rope_angles(t, cfg.head_dim, cfg.rope_theta, dev)
            return torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)

        return _Arch(model.embed_tokens, _layers(model.layers, F.silu, fuse), model.norm, _linear(model.lm_head),
                     cfg.num_attention_heads, cfg.num_attention_heads, cfg.head_dim, tiny_rope, dtype)
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in _HF_TYPES or not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None), "layers"):
        raise _unsupported(model, f"model_type {kind!r}")
    if getattr(cfg, "use_sliding_window", False) or (kind == "mistral" and getattr(cfg, "sliding_window", None)):
        raise _unsupported(model, "sliding-window attention; set config.sliding_window=None if the context fits")
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") not in _STATIC_ROPE:
        raise _unsupported(model, f"rope type {rotary.rope_type!r} depends on the sequence length")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    dev = model.lm_head.weight.device  # the closure below must not hold the model (cache key, weakref)

    def hf_rope(t: int, dt: torch.dtype):
        x = torch.empty(0, dtype=dt, device=dev)
        cos, sin = rotary(x, torch.arange(t, device=x.device)[None])  # the model's own tables, bit for bit
        return cos[0], sin[0]

    return _Arch(model.model.embed_tokens, _layers(model.model.layers, None, fuse), model.model.norm,
                 _linear(model.lm_head), cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, hf_rope, dtype)


# -- the decoder ------------------------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as transformers' Llama writes it (same rounding)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


_GLOBAL_GUARDS = frozenset({"GRAD_MODE", "DETERMINISTIC_ALGORITHMS", "GLOBAL_STATE", "TORCH_FUNCTION_STATE",
                            "DEFAULT_DEVICE", "SHAPE_ENV", "AUTOGRAD_SAVED_TENSORS_HOOKS"})


def _input_guards_only(entries) -> list[bool]:
    """Keep dynamo's guards on the step's inputs (ids, pos) and on global state; drop those on the weights, caches
    and closures (hundreds of tensor checks, milliseconds per token). Safe because a decoder owns its caches and
    closures, and a weight change (quantize_, load_state_dict(assign=True)) builds a new decoder (`_decoder`)."""
    return [e.name in ("ids", "pos") or e.guard_type in _GLOBAL_GUARDS for e in entries]


def _own_code(method):
    """`method` bound to the same object, with a code object of its own. dynamo keeps compiled code per code
    object; with the weight guards dropped (`_input_guards_only`), a decoder sharing `_step`'s code object with
    another decoder would run that decoder's graph."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(method.__self__):x}")
    return types.MethodType(types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__),
                            method.__self__)


class StaticDecoder:
    """A model's decoder over a preallocated KV cache: ``forward(ids [B, S], pos [S]) -> logits [B, V]`` of the
    last position, writing keys/values of positions ``pos`` into the cache.

    Cache: per layer keys and values [B, kv_heads, T, head_dim] in the model dtype (T = ``max_len``); each query
    attends to cache slots <= its position (the rest are masked), so one compiled graph serves every position.
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int, *, compile: bool = True,
                 compile_prefill: bool = False, cpp_wrapper: bool = True, fuse: bool = True):
        self.arch = a = _describe(model, fuse)
        self.batch, self.max_len = batch, max_len
        dev = a.embed.weight.device
        shape = (batch, a.kv_heads, max_len, a.head_dim)
        self.k = [torch.zeros(shape, dtype=a.dtype, device=dev) for _ in a.layers]
        self.v = [torch.zeros(shape, dtype=a.dtype, device=dev) for _ in a.layers]
        with torch.no_grad():
            self.cos, self.sin = a.rope(max_len, a.dtype)
        self.slots = torch.arange(max_len, device=dev)
        self.gqa = a.heads != a.kv_heads  # a bool here: under dynamic=True an int comparison would be symbolic
        self.step, self.prefill = self._step, self._prefill
        if compile:
            opts = {"guard_filter_fn": _input_guards_only, "cpp_wrapper": cpp_wrapper}
            self.step = torch.compile(_own_code(self._step), fullgraph=True, dynamic=False, options=opts)
            if compile_prefill:  # static shapes: `run_prefill` pads prompts to a multiple of PREFILL_BLOCK
                self.prefill = torch.compile(_own_code(self._prefill), fullgraph=True, dynamic=False, options=opts)
        self.prefill_compiled = compile and compile_prefill

    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.forward(ids, pos)

    def _prefill(self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward(ids, pos, last)

    def run_prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after the prompt ids [B, S] (positions 0..S-1). Compiled prefill: the prompt is padded to a
        multiple of PREFILL_BLOCK (one graph per padded length); the pad's cache slots lie after the prompt, where
        decode steps overwrite them before any query can attend to them."""
        s, dev = ids.shape[1], ids.device
        if s == 1:
            return self.step(ids, torch.zeros(1, dtype=torch.int64, device=dev))  # a length-1 prompt is a step
        if not self.prefill_compiled:
            return self.prefill(ids, torch.arange(s, device=dev))
        p = padded_prompt_length(s)
        padded = torch.zeros(ids.shape[0], p, dtype=ids.dtype, device=dev)
        padded[:, :s] = ids
        return self.prefill(padded, torch.arange(p, device=dev), torch.tensor([s - 1], device=dev))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        a = self.arch
        b, s = ids.shape
        x = a.embed(ids)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]  # [1, 1, S, D]
        compiled = torch.compiler.is_compiling()
        mask = self.slots[None, :] <= pos[:, None] if compiled else None  # [S, T]: causal over the cache
        for layer, kc, vc in zip(a.layers, self.k, self.v, strict=True):
            q, k, v = layer.qkv(layer.norm1(x))
            q = _rotate(q.view(b, s, a.heads, a.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(b, s, a.kv_heads, a.head_dim).transpose(1, 2), cos, sin)
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v.view(b, s, a.kv_heads, a.head_dim).transpose(1, 2))
            o = self._attend(q, kc, vc, pos, mask)
            x = x + layer.o(o.transpose(1, 2).reshape(b, s, a.heads * a.head_dim))
            gate, up = layer.gate_up(layer.norm2(x))
            x = x + layer.down(layer.act(gate) * up)
        x = x[:, -1] if last is None else x.index_select(1, last)[:, 0]
        return a.lm_head(a.norm(x))

    def _attend(self, q, kc, vc, pos, mask):
        """softmax(q k^T / sqrt(D)) v over the cache [B, H, S, D]. Compiled: over all T slots under the causal mask
        (static shapes). Eager: over exactly the filled slots, causal in the prefill, as transformers' dynamic
        cache does, so that eager results equal model.generate's bit for bit."""
        if mask is not None:
            b, h, s, d = q.shape
            g = h // kc.shape[1]
            qg = q.reshape(b, kc.shape[1], g * s, d)  # query heads kv*g + i share kv head kv: rows (i, s)
            # Broadcast products and sums, not matmuls: inductor fuses them into its own loops, where 60 tiny
            # bmm calls per token would each pay a library call.
            scores = (qg[:, :, :, None, :] * kc[:, :, None]).sum(-1).float() * d**-0.5
            scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
            p = scores.softmax(-1).to(q.dtype)
            return (p[..., None] * vc[:, :, None]).sum(-2).view(b, h, s, d)
        end = int(pos[-1]) + 1
        prefill = q.shape[2] > 1
        return F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], is_causal=prefill,
                                              enable_gqa=self.gqa)


# -- generate ---------------------------------------------------------------------------------------------

_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model: nn.Module) -> tuple:
    """Identity of every parameter: a decoder built before quantize_ (or any weight swap) is stale after it."""
    return tuple(id(p) for p in model.parameters())


def padded_prompt_length(s: int) -> int:
    return -(-s // PREFILL_BLOCK) * PREFILL_BLOCK


def _decoder(model: nn.Module, batch: int, length: int, compile: bool, compile_prefill: bool, cpp_wrapper: bool,
             fuse: bool) -> StaticDecoder:
    max_len = -(-length // _CACHE_BLOCK) * _CACHE_BLOCK
    per_model = _decoders.setdefault(model, {})
    key = (batch, max_len, compile, compile_prefill, cpp_wrapper, fuse, next(model.parameters()).dtype)
    dec, wkey = per_model.get(key, (None, None))
    if dec is None or wkey != _weights_key(model):
        dec = StaticDecoder(model, batch, max_len, compile=compile, compile_prefill=compile_prefill,
                            cpp_wrapper=cpp_wrapper, fuse=fuse)
        per_model[key] = (dec, _weights_key(model))
    return dec


def _eos_ids(model: nn.Module, eos_token_id) -> list[int]:
    if eos_token_id is None:
        gen = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


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
        raise ValueError("input_ids must be an int64 tensor [batch, prompt_length] (prompts of equal length, no "
                         f"padding); got {getattr(input_ids, 'dtype', type(input_ids))} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: pass at least one prompt token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when do_sample=True, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


@torch.inference_mode()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    compile: bool = True,
    compile_prefill: bool = False,
    cpp_wrapper: bool = True,
    fuse_projections: bool = True,
    eos_token_id: int | list[int] | None = None,
    ignore_eos: bool = False,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Decode up to ``max_new_tokens`` tokens after ``input_ids`` [B, S] (int64); returns [B, S + n] int64.

    Greedy by default: the same ids as ``model.generate(input_ids, do_sample=False, max_new_tokens=...)``. It
    stops when every row has produced an end-of-sequence token (``eos_token_id``, default the model's
    generation_config; ``ignore_eos=True`` bans those ids instead, as transformers' ``min_new_tokens`` and llama.cpp's
    ``ignore_eos`` do, and always decodes ``max_new_tokens``); rows that finished earlier are
    filled with ``pad_token_id`` (default: the first eos id). ``do_sample=True`` samples with ``temperature``,
    ``top_k``, ``top_p`` (``generator`` for reproducibility).

    ``compile=True`` compiles the decode step once per (batch, cache length rounded up to 128, dtype); the
    compiled code and the KV cache stay with the model for later calls (rebuilt when its weights change). The
    prefill runs eagerly (one call over the whole prompt: its Python overhead is shared by all prompt tokens), or
    compiled with ``compile_prefill=True`` on prompts padded to a multiple of 64 (static shapes: one compile per
    padded length; benchmarks/README.md has the trade-off). ``cpp_wrapper=True`` has inductor emit the code that
    calls the step's kernels as C++ instead of Python (less per-token overhead; its first compile takes longer,
    later processes load it from inductor's cache). ``fuse_projections`` runs q/k/v and gate/up each as
    one linear where their weights concatenate (same format and config).
    """
    _check(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p)
    b, s = input_ids.shape
    if max_new_tokens == 0:
        return input_ids.clone()
    length = max(s + max_new_tokens, padded_prompt_length(s) if compile and compile_prefill else 0)
    dec = _decoder(model, b, length, compile, compile_prefill, cpp_wrapper, fuse_projections)
    dev = dec.slots.device
    eos = _eos_ids(model, eos_token_id)
    eos_t = torch.tensor(eos, dtype=torch.int64, device=dev)
    banned, eos = (eos_t, []) if ignore_eos and eos else (None, eos)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    ids = input_ids.to(dev).clone(memory_format=torch.contiguous_format)  # an inference tensor like every step input
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
