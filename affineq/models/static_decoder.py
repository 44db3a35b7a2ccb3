"""A decoder-only LM rebuilt as one function of (token ids, cache slots) over a preallocated KV cache.

``StaticDecoder(model, batch, max_len)`` runs the model's own weights, norms, rotary tables and activation in the
same order as transformers' Llama / Mistral / Qwen2 (and affineq's ``TinyLM``), so greedy tokens equal
``model.generate``'s; ``affineq.models.decoding.generate`` drives it. Left-padded batches follow transformers'
conventions: a row with ``p`` pad tokens has rotary positions ``slot - p`` (0 on the pads) and its pad slots are
masked out of every query's keys. The KV cache is in the model dtype, or quantized (``affineq.models.kv_cache``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SUPPORTED_ARCHITECTURES", "StaticDecoder", "PREFILL_BLOCK", "padded_prompt_length"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "affineq TinyLM")
_HF_TYPES = ("llama", "mistral", "qwen2")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
PREFILL_BLOCK = 64  # compiled prefill: prompts are padded to a multiple of this (static shapes, few graphs)


def padded_prompt_length(s: int) -> int:
    return -(-s // PREFILL_BLOCK) * PREFILL_BLOCK


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


def model_limits(model: nn.Module) -> tuple[int, int | None]:
    """(vocabulary size, max_position_embeddings or None) of a supported model, read without building anything;
    ValueError for an unsupported model."""
    from .tiny import TinyLM

    if isinstance(model, TinyLM):
        return model.embed_tokens.weight.shape[0], None
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if kind not in _HF_TYPES or getattr(emb, "weight", None) is None:
        raise _unsupported(model, f"model_type {kind!r}")
    return emb.weight.shape[0], getattr(cfg, "max_position_embeddings", None)


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
    last position, writing keys/values of cache slots ``pos`` into the cache.

    Cache: per layer keys and values [B, kv_heads, T, head_dim] (T = ``max_len``) in the model dtype, or int8 /
    int4 codes with scales (``kv_cache_dtype``, see ``affineq.models.kv_cache``). Each query attends to the slots
    <= its own that hold a real token (``valid`` [B, T]: False on a row's left padding), so one compiled graph
    serves every position. ``set_padding(attention_mask)`` sets ``valid`` and the per-row pad count ``shift``
    [B, 1] (rotary position = slot - shift, 0 on pads: transformers' ``cumsum(mask) - 1``).
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int, *, compile: bool = True,
                 compile_prefill: bool = False, cpp_wrapper: bool = True, fuse: bool = True,
                 kv_cache_dtype: str | torch.dtype | None = None, kv_group_size: int | None = None):
        from .kv_cache import QuantizedKVCache, kv_cache_kind

        kind = kv_cache_kind(kv_cache_dtype)
        self.arch = a = _describe(model, fuse)
        self.batch, self.max_len = batch, max_len
        dev = a.embed.weight.device
        shape = (batch, a.kv_heads, max_len, a.head_dim)
        self.qcache = None
        if kind is None:
            self.k = [torch.zeros(shape, dtype=a.dtype, device=dev) for _ in a.layers]
            self.v = [torch.zeros(shape, dtype=a.dtype, device=dev) for _ in a.layers]
        else:
            self.k = self.v = [None] * len(a.layers)
            self.qcache = QuantizedKVCache(kind, len(a.layers), shape, kv_group_size, dev)
        with torch.no_grad():
            self.cos, self.sin = a.rope(max_len, a.dtype)
        self.slots = torch.arange(max_len, device=dev)
        self.valid = torch.ones(batch, max_len, dtype=torch.bool, device=dev)
        self.shift = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.padded = False  # eager path only: whether `valid` masks any slot (then attention takes a mask)
        self.gqa = a.heads != a.kv_heads  # a bool here: under dynamic=True an int comparison would be symbolic
        self.step, self.prefill = self._step, self._prefill
        if compile:
            opts = {"guard_filter_fn": _input_guards_only, "cpp_wrapper": cpp_wrapper}
            self.step = torch.compile(_own_code(self._step), fullgraph=True, dynamic=False, options=opts)
            if compile_prefill:  # static shapes: `run_prefill` pads prompts to a multiple of PREFILL_BLOCK
                self.prefill = torch.compile(_own_code(self._prefill), fullgraph=True, dynamic=False, options=opts)
        self.prefill_compiled = compile and compile_prefill

    def cache_bytes_per_token(self) -> int:
        """Bytes the KV cache holds per token (all layers, one sequence), scales included."""
        if self.qcache is not None:
            return self.qcache.bytes_per_token()
        a = self.arch
        return 2 * len(a.layers) * a.kv_heads * a.head_dim * self.k[0].element_size()

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Left padding of the next prompt: attention_mask [B, S] (1 = token, 0 = pad, zeros first) or None."""
        self.valid.fill_(True)
        self.shift.zero_()
        self.padded = attention_mask is not None and not bool(attention_mask.all())
        if self.padded:
            s = attention_mask.shape[1]
            self.valid[:, :s] = attention_mask.bool()
            self.shift.copy_((s - attention_mask.sum(1, dtype=torch.int64))[:, None])

    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.forward(ids, pos)

    def _prefill(self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward(ids, pos, last)

    def run_prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after the prompt ids [B, S] (slots 0..S-1). Compiled prefill: the prompt is padded to a
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
        rpos = (pos[None, :] - self.shift).clamp_min(0)  # [B, S] rotary positions (0 on left padding)
        cos, sin = self.cos[rpos][:, None], self.sin[rpos][:, None]  # [B, 1, S, D]
        mask = None
        if self.qcache is None and (torch.compiler.is_compiling() or self.padded):
            mask = (self.slots[None, None, :] <= pos[None, :, None]) & self.valid[:, None, :]  # [B, S, T]
        for i, (layer, kc, vc) in enumerate(zip(a.layers, self.k, self.v, strict=True)):
            q, k, v = layer.qkv(layer.norm1(x))
            q = _rotate(q.view(b, s, a.heads, a.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(b, s, a.kv_heads, a.head_dim).transpose(1, 2), cos, sin)
            v = v.view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
            if self.qcache is not None:
                self.qcache.write(i, pos, k, v)
                o = self.qcache.attend(i, q, pos, self.valid)
            else:
                kc.index_copy_(2, pos, k)
                vc.index_copy_(2, pos, v)
                o = self._attend(q, kc, vc, pos, mask)
            x = x + layer.o(o.transpose(1, 2).reshape(b, s, a.heads * a.head_dim))
            gate, up = layer.gate_up(layer.norm2(x))
            x = x + layer.down(layer.act(gate) * up)
        x = x[:, -1] if last is None else x.index_select(1, last)[:, 0]
        return a.lm_head(a.norm(x))

    def _attend(self, q, kc, vc, pos, mask):
        """softmax(q k^T / sqrt(D)) v over the cache [B, H, S, D] (a row with no key, a pad query, gives 0 as
        sdpa does). Compiled: over all T slots under mask [B, S, T] (static shapes). Eager: over exactly the filled
        slots, as transformers' dynamic cache does and with the same sdpa call (its GQA handling included), so
        that eager results equal model.generate's bit for bit."""
        b, h, s, d = q.shape
        g = h // kc.shape[1]
        if torch.compiler.is_compiling():
            qg = q.reshape(b, kc.shape[1], g * s, d)  # query heads kv*g + i share kv head kv: rows (i, s)
            # Broadcast products and sums, not matmuls: inductor fuses them into its own loops, where 60 tiny
            # bmm calls per token would each pay a library call.
            scores = (qg[:, :, :, None, :] * kc[:, :, None]).sum(-1).float() * d**-0.5
            keep = mask.repeat(1, g, 1)[:, None]  # [B, 1, g*S, T]
            p = scores.masked_fill(~keep, float("-inf")).softmax(-1).masked_fill(~keep, 0.0).to(q.dtype)
            return (p[..., None] * vc[:, :, None]).sum(-2).view(b, h, s, d)
        end = int(pos[-1]) + 1
        kc, vc = kc[:, :, :end], vc[:, :, :end]
        if mask is None:
            return F.scaled_dot_product_attention(q, kc, vc, is_causal=s > 1, enable_gqa=self.gqa)
        m = mask[:, None, :, :end]  # [B, 1, S, end]
        if self.gqa and s == 1:  # transformers' pack_gqa: a kv head's g query heads as g query rows
            return F.scaled_dot_product_attention(q.reshape(b, h // g, g, d), kc, vc, attn_mask=m).view(b, h, 1, d)
        if self.gqa:  # transformers' repeat_kv
            kc, vc = (t[:, :, None].expand(b, h // g, g, end, d).reshape(b, h, end, d) for t in (kc, vc))
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=m)
