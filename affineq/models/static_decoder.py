"""A decoder-only LM rebuilt as one function of (token ids, cache slots) over a preallocated KV cache.

``StaticDecoder(model, batch, max_len)`` runs the model's own weights, norms, rotary tables and activation in the
same order as transformers' Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 and the mixture-of-experts Mixtral /
Qwen3-MoE / gpt-oss (and affineq's ``TinyLM``), so greedy tokens equal ``model.generate``'s;
``affineq.models.decoding.generate`` drives it. Per-architecture pieces: attention variants (sliding windows, sinks,
logit scale) in ``attention_variants``, the feed-forward (gated MLP or the model's own router + experts) in
``moe_block``. Left-padded batches follow transformers' conventions: a row with ``p`` pad tokens has rotary
positions ``slot - p`` (0 on the pads) and its pad slots are masked out of every query's keys. The KV cache is in
the model dtype, or quantized (``affineq.models.kv_cache``: the prompt attends over its own float keys / values
and leaves their codes; decode steps and teacher-forced scoring read the codes).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from affineq.tensor.shared_input import shared_input_linear

from .attention_variants import AttentionSpec, attend_compiled, attend_eager_math, attend_sdpa, window_keys
from .moe_block import experts_implementation, gated_mlp_forward, is_moe_block, moe_forward

__all__ = ["SUPPORTED_ARCHITECTURES", "StaticDecoder", "PREFILL_BLOCK", "FUSE_COPY_LIMIT", "fusion_copy_bytes",
           "padded_prompt_length"]

_HF_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gpt_oss", "gemma3_text")
SUPPORTED_ARCHITECTURES = (*_HF_TYPES, "affineq TinyLM")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
PREFILL_BLOCK = 64  # compiled prefill: prompts are padded to a multiple of this (static shapes, few graphs)
# q/k/v and gate/up run as one call each: dense quantized weights share a kernel call as they are
# (`shared_input_linear`), other weights are concatenated, a copy the decoder holds next to the model's own. With
# fuse=None the decoder copies only while all copies together stay under this many bytes: a small model gains from
# fewer linear calls per token, a 1B-8B one would double most of its weight memory.
FUSE_COPY_LIMIT = 256 * 2**20


def padded_prompt_length(s: int) -> int:
    return -(-s // PREFILL_BLOCK) * PREFILL_BLOCK


# -- the model, as plain callables ------------------------------------------------------------------------


def _linear(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> mod(x) without nn.Module.__call__ (eager overhead) for a plain nn.Linear."""
    if type(mod) is nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    return mod


def _fused(mods: list[nn.Module], copy: bool) -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
    """Several linears on the same input (q/k/v, gate/up) as one call: quantized weights that can share a kernel
    call as they are (`shared_input_linear`: nothing copied), else, where `copy` allows, one linear over their
    concatenated weights (a copy), split after; None where neither applies (different configs or formats,
    non-Linear modules)."""
    if any(type(m) is not nn.Linear for m in mods) or len({type(m.weight) for m in mods}) != 1:
        return None
    shared = shared_input_linear([m.weight for m in mods], [m.bias for m in mods])
    if shared is not None or not copy:
        return shared
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
    """One decoder layer as callables. ``q_norm`` / ``k_norm`` (Qwen3, Gemma 3) act on each head's vector before
    the rotary embedding; ``post_attn_norm`` / ``post_mlp_norm`` (Gemma 3's sandwich norms) on the attention and
    MLP outputs before their residual adds; ``rope`` indexes the decoder's rotary tables (Gemma 3's local layers
    have their own base); ``attn`` holds the scale, sinks and sliding window."""

    norm1: nn.Module
    qkv: Callable[[torch.Tensor], list[torch.Tensor]]
    o: Callable[[torch.Tensor], torch.Tensor]
    norm2: nn.Module
    mlp: Callable[[torch.Tensor], torch.Tensor]
    attn: AttentionSpec
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    post_attn_norm: nn.Module | None = None
    post_mlp_norm: nn.Module | None = None
    rope: int = 0


def _tensor_bytes(t: torch.Tensor) -> int:
    """Stored bytes of a weight (a quantized tensor subclass reports its own through ``storage_bytes``)."""
    own = getattr(t, "storage_bytes", None)
    return int(own()) if callable(own) else t.numel() * t.element_size()


def fusion_copy_bytes(blocks) -> int:
    """Bytes that fusing q/k/v and gate/up of these decoder layers would copy (Linear weights and biases)."""
    total = 0
    for blk in blocks:
        mods = [getattr(blk.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        mods += [getattr(blk.mlp, n, None) for n in ("gate_proj", "up_proj")]
        for m in mods:
            if isinstance(m, nn.Linear):
                total += sum(_tensor_bytes(t) for t in (m.weight, m.bias) if t is not None)
    return total


def _unfused(*mods: nn.Module) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    fns = [_linear(m) for m in mods]
    return lambda x: [f(x) for f in fns]


def _projections(mods: list[nn.Module], fuse: bool | None) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """The linears on one input as one call where `fuse` allows (True: share a call, else copy; None: share a call
    only; False: never), else one call each."""
    return (fuse is not False and _fused(mods, bool(fuse))) or _unfused(*mods)


def _mlp(mlp: nn.Module, act, fuse: bool | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if is_moe_block(mlp):
        return moe_forward(mlp)
    gate_up = _projections([mlp.gate_proj, mlp.up_proj], fuse)
    return gated_mlp_forward(gate_up, _linear(mlp.down_proj), getattr(mlp, "act_fn", act))


def _layers(blocks, act, fuse: bool | None, specs: list[AttentionSpec], ropes: list[int]) -> list[_Layer]:
    out = []
    for blk, spec, rope in zip(blocks, specs, ropes, strict=True):
        at = blk.self_attn
        qkv = _projections([at.q_proj, at.k_proj, at.v_proj], fuse)
        sandwich = hasattr(blk, "pre_feedforward_layernorm")  # Gemma: post_attention_layernorm is on the output
        norm2 = blk.pre_feedforward_layernorm if sandwich else blk.post_attention_layernorm
        out.append(_Layer(blk.input_layernorm, qkv, _linear(at.o_proj), norm2, _mlp(blk.mlp, act, fuse), spec,
                          getattr(at, "q_norm", None), getattr(at, "k_norm", None),
                          blk.post_attention_layernorm if sandwich else None,
                          getattr(blk, "post_feedforward_layernorm", None), rope))
    return out


@dataclass
class _Arch:
    """What the decoder needs of a model: its modules and shapes, and the rotary tables for positions 0..T-1 (one
    pair per rope kind the layers use)."""

    embed: nn.Module
    layers: list[_Layer]
    norm: nn.Module
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    ropes: list[Callable[[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]]
    dtype: torch.dtype
    sdpa: bool = True  # eager attention as transformers' sdpa (else its eager_attention_forward)
    final_softcap: float | None = None
    eager_experts: bool = False  # a MoE block runs transformers' "eager" experts loop (data-dependent)


def _unsupported(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"affineq.models.generate does not support this model ({type(model).__name__}: {why}). Supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}; use model.generate(...) for others"
    )


def _layer_windows(cfg, n: int) -> list[int | None]:
    """Per layer sliding window (slots) or None, as transformers builds its masks: models with ``layer_types``
    window their "sliding_attention" layers, the others (Mistral, Mixtral, Qwen3-MoE) every layer when
    ``config.sliding_window`` is set."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types[:n]]


def _hf_ropes(model: nn.Module, cfg, head_dim: int) -> tuple[list, list[int]]:
    """The model's rotary tables (its own module, bit for bit) per rope kind, and each layer's kind index."""
    rotary = model.model.rotary_emb
    kinds = rotary.rope_type if isinstance(rotary.rope_type, dict) else {None: rotary.rope_type}
    for kind in kinds.values():
        if kind not in _STATIC_ROPE:
            raise _unsupported(model, f"rope type {kind!r} depends on the sequence length")
    dev = model.lm_head.weight.device  # the closures below must not hold the model (cache key, weakref)

    def table(layer_type):
        def rope(t: int, dt: torch.dtype):
            x = torch.empty(0, dtype=dt, device=dev)
            pos = torch.arange(t, device=dev)[None]
            cos, sin = rotary(x, pos) if layer_type is None else rotary(x, pos, layer_type)
            if cos.shape[-1] == head_dim // 2:  # gpt-oss: half tables, rotation written on the two halves
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            return cos[0], sin[0]
        return rope

    names = list(kinds)
    types = getattr(cfg, "layer_types", None) if None not in kinds else None
    per_layer = [0] * cfg.num_hidden_layers if types is None else [names.index(t) for t in types]
    return [table(n) for n in names], per_layer


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's activations (and so of its KV cache): its first float parameter that is not
    quantized (a norm's weight, or a float embedding). Not simply the first parameter: a quantized weight keeps
    the logical dtype of the checkpoint it came from (bf16), also in a model loaded with dtype=torch.float32,
    whose norms turn the activations float32."""
    params = list(model.parameters())
    # plain tensors only: this package imports nothing from affineq's quantization code, and every quantized
    # weight is a tensor subclass
    plain = (p for p in params if type(p) in (torch.Tensor, nn.Parameter) and p.dtype.is_floating_point)
    return next(plain, params[0]).dtype


def _describe(model: nn.Module, fuse: bool | None) -> _Arch:
    from .tiny import TinyLM, _rope_angles

    if fuse is None:  # copies only while small; sharing a call (no copy) always
        blocks = model.layers if isinstance(model, TinyLM) else getattr(getattr(model, "model", None), "layers", [])
        fuse = True if fusion_copy_bytes(blocks) <= FUSE_COPY_LIMIT else None
    dtype = _activation_dtype(model)
    if isinstance(model, TinyLM):
        cfg = model.config

        dev = model.embed_tokens.weight.device  # the closures below must not hold the model (cache key, weakref)

        def tiny_rope(t: int, dt: torch.dtype):
            ang = _rope_angles(t, cfg.head_dim, cfg.rope_theta, dev)
            return torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)

        n = len(model.layers)
        specs = [AttentionSpec(cfg.head_dim**-0.5) for _ in range(n)]
        return _Arch(model.embed_tokens, _layers(model.layers, F.silu, fuse, specs, [0] * n), model.norm,
                     _linear(model.lm_head), cfg.num_attention_heads, cfg.num_attention_heads, cfg.head_dim,
                     [tiny_rope], dtype)
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in _HF_TYPES or not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None), "layers"):
        raise _unsupported(model, f"model_type {kind!r}")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise _unsupported(model, "bidirectional attention")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    blocks = model.model.layers
    ropes, per_layer = _hf_ropes(model, cfg, head_dim)
    windows = _layer_windows(cfg, len(blocks))
    # No attention logit soft-cap: Gemma 3 replaced it by q/k norms (transformers ignores attn_logit_softcapping).
    specs = [AttentionSpec(getattr(b.self_attn, "scaling", head_dim**-0.5), getattr(b.self_attn, "sinks", None), w)
             for b, w in zip(blocks, windows, strict=True)]
    eager_experts = any(is_moe_block(b.mlp) and experts_implementation(b.mlp) == "eager" for b in blocks)
    sdpa = getattr(cfg, "_attn_implementation", "sdpa") == "sdpa"
    return _Arch(model.model.embed_tokens, _layers(blocks, None, fuse, specs, per_layer), model.model.norm,
                 _linear(model.lm_head), cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, ropes, dtype,
                 sdpa, getattr(cfg, "final_logit_softcapping", None), eager_experts)


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


def _check_options(model: nn.Module, a: _Arch, compile: bool) -> None:
    """ValueError for a model feature the chosen options cannot run (before anything is allocated)."""
    if compile and a.eager_experts:
        raise ValueError(f"compile=True cannot run {type(model).__name__} with experts_implementation='eager' (a "
                         "data-dependent loop over the experts); call model.set_experts_implementation('grouped_mm')"
                         " or pass compile=False")


# -- the decoder ------------------------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as transformers' Llama writes it (same rounding)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


_GLOBAL_GUARDS = frozenset({"GRAD_MODE", "DETERMINISTIC_ALGORITHMS", "GLOBAL_STATE", "TORCH_FUNCTION_STATE",
                            "DEFAULT_DEVICE", "SHAPE_ENV", "AUTOGRAD_SAVED_TENSORS_HOOKS"})


#: Float caches of at least this many slots are attended by ``affineq::float_kv_attention`` in compiled decode
#: steps (below it the fused loops cost about as much as the op call: SmolLM2 at 128 slots was no faster with the
#: op; at 4096 slots the loops took ~40% of a 1B step; benchmarks/README.md, KV-cache attention).
FLOAT_KERNEL_MIN_SLOTS = 512


def _cpp_available() -> bool:
    from affineq import cpp

    if not cpp.is_available():
        return False
    import affineq.cpp.kv_attention  # noqa: F401  (defines the op's schema)

    return True


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

    ``fuse``: run q/k/v and gate/up each as one call: dense quantized weights sharing one kernel call as they
    are (``affineq.tensor.shared_input``), others as one linear over concatenated weights (a copy). True, False
    (never), or None (share always; copy while the copies total at most ``FUSE_COPY_LIMIT`` bytes,
    ``fusion_copy_bytes``).

    Cache: per layer keys and values [B, kv_heads, T, head_dim] (T = ``max_len``) in the model dtype, or int8 /
    int4 codes with scales (``kv_cache_dtype``, see ``affineq.models.kv_cache``). Each query attends to the slots
    <= its own that hold a real token (``valid`` [B, T]: False on a row's left padding), so one compiled graph
    serves every position. ``set_padding(attention_mask)`` sets ``valid`` and the per-row pad count ``shift``
    [B, 1] (rotary position = slot - shift, 0 on pads: transformers' ``cumsum(mask) - 1``).
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int, *, compile: bool = True,
                 compile_prefill: bool = False, cpp_wrapper: bool = True, fuse: bool | None = None,
                 kv_cache_dtype: str | torch.dtype | None = None, kv_group_size: int | None = None):
        from .kv_cache import QuantizedKVCache, check_kv_group_size, kv_cache_kind

        kind = kv_cache_kind(kv_cache_dtype)
        check_kv_group_size(kind, kv_group_size)
        self.arch = a = _describe(model, fuse)
        _check_options(model, a, compile)
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
            tables = [rope(max_len, a.dtype) for rope in a.ropes]
        self.cos, self.sin = [c for c, _ in tables], [t for _, t in tables]
        self.math = not a.sdpa or any(layer.attn.sinks is not None for layer in a.layers)
        self.windows = sorted({layer.attn.window for layer in a.layers} - {None})
        # The quantized-cache kernel scales logits by D^-0.5: queries carry the rest of the model's scale.
        self.q_rescale = [layer.attn.scaling * a.head_dim**0.5 for layer in a.layers]
        # Compiled decode steps attend over a float cache of FLOAT_KERNEL_MIN_SLOTS or more with
        # affineq::float_kv_attention (the slots <= pos, where the compiled PyTorch loops read all max_len; below,
        # the loops cost about an op call); chosen here, not while tracing.
        self.float_kernel = (kind is None and dev.type == "cpu" and a.head_dim % 16 == 0
                             and max_len >= FLOAT_KERNEL_MIN_SLOTS and _cpp_available())
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
        return self.forward(ids, pos, last, prompt=True)

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

    def score(self, ids: torch.Tensor, first_write: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [B, S, V] (fp32) of ids [B, S] from an empty cache (slots 0..S-1, no padding): the
        prediction at every position through the same cache code as decoding (for perplexity with a quantized
        KV cache). Eager; S <= max_len. ``first_write``: the cache is written in two passes, the first
        ``first_write`` tokens (as a prompt: they fix an int4 cache's key offset) and then the rest; None: one."""
        b, s = ids.shape
        if b != self.batch or not 0 < s <= self.max_len:
            raise ValueError(f"ids must be [{self.batch}, S] with 0 < S <= max_len {self.max_len}; got "
                             f"{tuple(ids.shape)}")
        if first_write is not None and (not isinstance(first_write, int) or first_write < 1):
            raise ValueError(f"first_write must be None or an int >= 1, got {first_write!r}")
        self.set_padding(None)
        cuts = [0, s] if first_write is None or first_write >= s else [0, first_write, s]
        pos = torch.arange(s, device=ids.device)
        with torch.inference_mode():
            return torch.cat([self.forward(ids[:, i:j], pos[i:j], every_position=True).float()
                              for i, j in zip(cuts[:-1], cuts[1:], strict=True)], 1)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor | None = None,
                every_position: bool = False, prompt: bool = False) -> torch.Tensor:
        """Logits [B, V] of the last position (or of position ``last`` [1]), or [B, S, V] of every position with
        ``every_position=True`` (teacher forcing: each position attends through the cache, quantized or not, to
        the slots <= its own, exactly as a decode step at that position would).

        ``prompt=True`` (the prefill; ``pos`` must be 0..S-1): with a quantized cache, the prompt attends over its
        own float keys and values with the float cache's attention (as transformers' ``QuantizedCache`` does)
        and only their codes are kept for the decode steps; without one, nothing changes."""
        a = self.arch
        b, s = ids.shape
        x = a.embed(ids)
        rpos = (pos[None, :] - self.shift).clamp_min(0)  # [B, S] rotary positions (0 on left padding)
        tables = [(cos[rpos][:, None], sin[rpos][:, None]) for cos, sin in zip(self.cos, self.sin, strict=True)]
        float_prompt = prompt and self.qcache is not None
        masks = self._masks(pos, s, float_prompt)
        real = None
        if self.qcache is not None and self.qcache.k_offset is not None:
            # The tokens whose keys set int4's key offset on a first write: not left padding, not the compiled
            # prefill's pad tail, and not each row's first token when the row has another.
            real = self.valid[:, pos] & ((pos <= last) if last is not None else True)
            later = real & (pos[None, :] != self.shift)
            real = torch.where(later.any(1, keepdim=True), later, real)
        for i, (layer, kc, vc) in enumerate(zip(a.layers, self.k, self.v, strict=True)):
            q, k, v = layer.qkv(layer.norm1(x))
            q, k = q.view(b, s, a.heads, a.head_dim), k.view(b, s, a.kv_heads, a.head_dim)
            if layer.q_norm is not None:  # per-head RMSNorm before the rotary embedding (Qwen3, Gemma 3)
                q, k = layer.q_norm(q), layer.k_norm(k)
            cos, sin = tables[layer.rope]
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            v = v.view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
            if float_prompt:  # the prompt's own keys / values are slots 0..S-1: the float path over them
                self.qcache.write(i, pos, k, v, real)
                o = self._attend(q, k, v, pos, masks.get(layer.attn.window), layer.attn)
            elif self.qcache is not None:
                self.qcache.write(i, pos, k, v, real)
                o = self.qcache.attend(i, q * self.q_rescale[i], pos, self.valid, layer.attn.window,
                                       layer.attn.sinks)
            else:
                kc.index_copy_(2, pos, k)
                vc.index_copy_(2, pos, v)
                o = self._attend(q, kc, vc, pos, masks.get(layer.attn.window), layer.attn)
            o = layer.o(o.transpose(1, 2).reshape(b, s, a.heads * a.head_dim))
            x = x + (o if layer.post_attn_norm is None else layer.post_attn_norm(o))
            m = layer.mlp(layer.norm2(x))
            x = x + (m if layer.post_mlp_norm is None else layer.post_mlp_norm(m))
        if not every_position:
            x = x[:, -1] if last is None else x.index_select(1, last)[:, 0]
        logits = a.lm_head(a.norm(x))
        if a.final_softcap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits

    def _masks(self, pos: torch.Tensor, s: int, float_prompt: bool = False) -> dict[int | None, torch.Tensor]:
        """Attention masks [B, S, T] per sliding window (None: full causal): slots <= the query's that hold a
        token, and within the window. Eager sdpa, unpadded: a layer whose keys need no cut beyond causality gets
        none (plain causal sdpa, as transformers skips its mask there). A quantized cache's prompt
        (``float_prompt``) attends over its S float keys only: masks [B, S, S]."""
        if self.qcache is not None and not float_prompt:
            return {}
        compiling = torch.compiler.is_compiling()
        end = int(pos[-1]) + 1 if not compiling else self.max_len
        out: dict[int | None, torch.Tensor] = {}
        base = (self.slots[None, None, :] <= pos[None, :, None]) & self.valid[:, None, :]
        # The eager formula has no is_causal, and sdpa's is_causal aligns a block of queries that does not start
        # at slot 0 (score's second write) to the wrong keys.
        full = compiling or self.padded or (s > 1 and (self.math or int(pos[0]) > 0))
        if full:
            out[None] = base
        for w in self.windows:
            if full or (s > 1 and end > w):
                out[w] = base & (self.slots[None, None, :] > pos[None, :, None] - w)
        if float_prompt and compiling:  # eager `_attend` cuts masks to the slots it reads; compiled reads all
            out = {w: m[..., :s] for w, m in out.items()}
        return out

    def _attend(self, q, kc, vc, pos, mask, spec: AttentionSpec):
        """Attention of q [B, H, S, D] over the cache (a row with no key, a pad query, gives 0 as sdpa does).
        Compiled: a decode step over a float cache of FLOAT_KERNEL_MIN_SLOTS or more through
        ``affineq::float_kv_attention`` (the slots <= pos, fp32 products and sums, attention sinks included), else
        over all T slots under mask [B, S, T]. Eager: over exactly the keys transformers' dynamic cache holds (a
        sliding layer's decode step: the last ``window`` slots), with the same sdpa call or eager formula, so that
        eager results equal model.generate's bit for bit."""
        if torch.compiler.is_compiling():
            if self.float_kernel and q.shape[2] == 1 and kc.shape[2] == self.max_len:
                valid = self.valid if spec.window is None else self.valid & (self.slots > pos[0] - spec.window)[None]
                if spec.sinks is None:
                    return torch.ops.affineq.float_kv_attention(q, kc, vc, pos, valid, spec.scaling)
                return torch.ops.affineq.float_kv_attention_sinks(q, kc, vc, pos, valid, spec.scaling, spec.sinks)
            return attend_compiled(q, kc, vc, mask, spec)
        end = int(pos[-1]) + 1
        start = window_keys(end, q.shape[2], spec.window)
        kc, vc = kc[:, :, start:end], vc[:, :, start:end]
        if mask is not None:
            mask = mask[:, :, start:end]
        if not self.math:
            return attend_sdpa(q, kc, vc, mask, self.gqa, spec.scaling)
        return attend_eager_math(q, kc, vc, mask, spec)
