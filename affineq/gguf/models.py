"""GGUF files <-> transformers models: config from metadata, tensor names, llama.cpp's conventions.

`load_model(path)` reads the architecture and config from the GGUF metadata, builds the transformers model on
the meta device and fills it with the file's tensors (`affineq.gguf.types`: quantized weights stay quantized, no
float copy). `save_model(model, path)` writes the inverse. Names map through the `gguf` package's own
`TensorNameMap` (the table llama.cpp's converter uses). llama.cpp's conventions undone on load and redone on save:

- Llama-architecture files (Llama, SmolLM2, Mistral) store q_proj / k_proj rows permuted (rotary pairs
  interleaved); rows are reordered back, exactly for every type (a row's blocks are independent).
- Gemma 3 files store RMSNorm weights as 1 + w (transformers' Gemma3RMSNorm multiplies by 1 + w).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from affineq.gguf import files, reader, types
from affineq.gguf.reader import GGUFEntry
from affineq.process_memory import trim_heap
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["SUPPORTED_ARCHITECTURES", "load_model", "load_tokenizer", "save_model"]


def _common(meta: dict[str, Any], p: str, vocab: int, tied: bool) -> dict[str, Any]:
    heads = int(meta[f"{p}.attention.head_count"])
    hidden = int(meta[f"{p}.embedding_length"])
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(meta[f"{p}.feed_forward_length"]),
        num_hidden_layers=int(meta[f"{p}.block_count"]), num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{p}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{p}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta[f"{p}.context_length"]),
        rms_norm_eps=float(meta[f"{p}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{p}.rope.freq_base", 10000.0)), tie_word_embeddings=tied,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def _llama(meta, vocab, tied):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM, LlamaConfig(**_common(meta, "llama", vocab, tied), hidden_act="silu")


def _qwen2(meta, vocab, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM, Qwen2Config(**_common(meta, "qwen2", vocab, tied), use_sliding_window=False)


_GEMMA3_SWA_PATTERN = 6  # llama.cpp: every 6th Gemma 3 layer attends globally, the rest use the sliding window
_GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's fixed rope base of the sliding-window layers


def _gemma3_layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % _GEMMA3_SWA_PATTERN == 0 else "sliding_attention" for i in range(layers)]


def _gemma3(meta, vocab, tied):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    c = _common(meta, "gemma3", vocab, tied)
    layers = c["num_hidden_layers"]
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 62-layer 27B model: 1/sqrt(hidden / heads)
    scalar = c["hidden_size"] // c["num_attention_heads"] if layers == 62 else c["head_dim"]
    kinds = _gemma3_layer_types(layers)
    cfg = Gemma3TextConfig(**c, rope_local_base_freq=_GEMMA3_LOCAL_THETA, query_pre_attn_scalar=scalar,
                           sliding_window=int(meta.get("gemma3.attention.sliding_window", 4096)), layer_types=kinds,
                           hidden_activation="gelu_pytorch_tanh")
    return Gemma3ForCausalLM, cfg


@dataclass(frozen=True)
class _Arch:
    """A GGUF architecture: its config builder, and llama.cpp's storage conventions for it."""

    build: Callable[[dict, int, bool], tuple[type, Any]]
    permute_qk: bool = False
    norm_shift: float = 0.0


_ARCHS: dict[str, _Arch] = {
    "llama": _Arch(_llama, permute_qk=True),
    "qwen2": _Arch(_qwen2),
    "gemma3": _Arch(_gemma3, norm_shift=1.0),
}
#: transformers `model_type` -> GGUF architecture (Mistral is written as "llama", as llama.cpp's converter does)
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)


def _unsupported_arch(arch: str, where: str) -> ValueError:
    return ValueError(f"{where}: architecture {arch!r} is not supported; supported GGUF architectures: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)} (transformers model types "
                      f"{', '.join(_MODEL_TYPES)})")


def _name_map(arch: str, n_layers: int):
    gguf = reader.require_gguf()
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(enum, n_layers)


def _gguf_names(model: nn.Module, arch: str) -> dict[str, str]:
    """{transformers state_dict name: GGUF name} for every parameter and persistent buffer of `model`."""
    tmap = _name_map(arch, model.config.num_hidden_layers)
    out = {}
    for name in model.state_dict(keep_vars=True):
        g = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise ValueError(f"{type(model).__name__}: parameter {name!r} has no GGUF name for architecture {arch!r}")
        out[name] = g
    return out


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """GGUF row of each transformers q/k row: llama.cpp interleaves each head's two rotary halves."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _heads_of(gguf_name: str, config) -> int | None:
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_attention_heads
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_key_value_heads
    return None


def _is_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               widen_kquants: bool = False) -> nn.Module:
    """The transformers model (eval mode, CPU) of GGUF file `path`: Llama family (Llama, SmolLM2, Mistral),
    Qwen2 or Gemma 3; another architecture is a ValueError naming the supported ones, and a damaged or incomplete
    file (metadata without a key the config needs, tensors that do not match it) a ValueError naming the file.

    Quantized tensors become `AffineQuantizedTensor` parameters with the file's codes and scales (logical dtype
    `dtype`; `widen_kquants` as in `load_file`), float tensors are cast to `dtype`. The model is built on the meta
    device and filled, so it never holds a float copy of a quantized weight. Ready for `affineq.models.generate`
    (Llama / Mistral / Qwen2) and for `save_pretrained`.
    """
    contents = reader.read(path)
    meta = contents.metadata
    arch_name = meta.get("general.architecture")
    if arch_name not in _ARCHS:
        raise _unsupported_arch(arch_name, os.fspath(path))
    arch = _ARCHS[arch_name]
    entries = {e.name: e for e in contents.tensors}
    where = os.fspath(path)
    _check_block_count(arch_name, meta, entries, where)  # before any config: its layer count is the file's
    cls, config = _build(arch_name, arch, meta, "output.weight" not in entries, where)
    _check_tensors(arch_name, cls, config, entries, where)  # every size the metadata gives against the tensors
    with torch.device("meta"):
        model = cls(config)
    names = _gguf_names(model, arch_name)
    by_gguf: dict[str, list[str]] = {}
    for hf, g in names.items():
        by_gguf.setdefault(g, []).append(hf)
    missing = sorted({g for g in by_gguf if g not in entries} - ({"output.weight"} if config.tie_word_embeddings
                                                                 else set()))
    unexpected = sorted(set(entries) - set(by_gguf))
    if missing or unexpected:
        raise ValueError(f"{where}: its tensors do not match a {cls.__name__} of its metadata: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    slots = _slots(model)
    for g, entry in entries.items():
        for hf in by_gguf[g]:  # shapes first: the q/k row permutation needs the row count it describes
            module, attr = slots[hf]
            _check_shape(where, g, entry.shape, tuple(module._parameters[attr].shape))
        param = nn.Parameter(_model_tensor(entry, arch, config, dtype, widen_kquants), requires_grad=False)
        for hf in by_gguf[g]:
            module, attr = slots[hf]
            module._parameters[attr] = param
    if config.tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    _materialize_buffers(model)
    del contents, entries
    trim_heap()  # the decoding temporaries, freed but kept by glibc's heap, back to the OS (resident ~ tensors)
    return model.eval()


try:  # transformers' config validation (an odd rotary head size...) raises huggingface_hub's, not a ValueError
    from huggingface_hub.errors import StrictDataclassError as _ConfigError
except ImportError:  # pragma: no cover - an older huggingface_hub validates nothing
    _ConfigError = ValueError


def _build(arch_name: str, arch: _Arch, meta: dict[str, Any], tied: bool, where: str) -> tuple[type, Any]:
    """(model class, config) from the file's metadata; ValueError naming the file and the key when the metadata
    lacks one the config needs or holds an unusable value (a damaged or incomplete file, not a bug to report)."""
    try:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else int(meta[f"{arch_name}.vocab_size"])
        return arch.build(meta, vocab, tied)
    except KeyError as e:
        raise ValueError(f"{where}: not a complete {arch_name} GGUF: its metadata has no {e.args[0]!r}, which the "
                         "model config needs; write the file with affineq.gguf.save_model or llama.cpp's "
                         "converter") from e
    except (TypeError, ValueError, ZeroDivisionError, _ConfigError) as e:
        raise ValueError(f"{where}: not a valid {arch_name} GGUF: its metadata does not describe a model "
                         f"({type(e).__name__}: {e})") from e


_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _check_block_count(arch_name: str, meta: dict[str, Any], entries: dict[str, GGUFEntry], where: str) -> None:
    """`{arch}.block_count` against the blocks the file holds (`blk.0.` ... `blk.{n-1}.`), before the config or
    the model is built from it: a count no tensors back (20000 layers in 544 bytes) is refused in no time. A
    missing key is left to `_build`, which names it."""
    key = f"{arch_name}.block_count"
    if key not in meta:
        return
    count = meta[key]
    held = {int(m.group(1)) for m in map(_BLOCK.fullmatch, entries) if m}
    # distinct indices >= 0: n of them whose largest is n - 1 are exactly 0..n-1 (no range(count) is built)
    if not isinstance(count, int) or isinstance(count, bool) or len(held) != count or (held and max(held) != count - 1):
        shown = f"blocks {min(held)} to {max(held)} ({len(held)} distinct)" if held else "no blk.N tensors"
        raise ValueError(f"{where}: metadata {key!r} is {count!r}, but the file's tensors hold {shown}; its "
                         f"metadata and tensors are inconsistent (a damaged or edited file)")


def _check_tensors(arch_name: str, cls: type, config, entries: dict[str, GGUFEntry], where: str) -> None:
    """Every tensor name and shape against a one-block model of `config` (built on the meta device: the sizes of
    the metadata, heads, vocabulary, widths, allocate nothing), before the whole model is: ValueError naming the
    tensor, its shape and the one the metadata implies; or the tensors missing or unexpected."""
    probe_config = copy.copy(config)
    probe_config.num_hidden_layers = min(1, config.num_hidden_layers)
    if getattr(config, "layer_types", None) is not None:
        probe_config.layer_types = config.layer_types[:probe_config.num_hidden_layers]
    with torch.device("meta"):
        probe = cls(probe_config)
    state = probe.state_dict(keep_vars=True)
    want = {g: tuple(state[hf].shape) for hf, g in _gguf_names(probe, arch_name).items()}
    unexpected = []
    for name, entry in entries.items():
        m = _BLOCK.fullmatch(name)
        generic = f"blk.0.{m.group(2)}" if m else name
        if generic not in want:
            unexpected.append(name)
        else:
            _check_shape(where, name, entry.shape, want[generic])
    optional = {"output.weight"} if config.tie_word_embeddings else set()
    per_block = [g[len("blk.0."):] for g in want if g.startswith("blk.0.")]
    missing = [g for g in want if not g.startswith("blk.") and g not in entries and g not in optional]
    for i in range(config.num_hidden_layers):  # no more than the file's blk.N tensors (`_check_block_count`)
        missing += [f"blk.{i}.{s}" for s in per_block if f"blk.{i}.{s}" not in entries]
        if len(missing) > 5:
            break
    if missing or unexpected:
        raise ValueError(f"{where}: its tensors do not match a {cls.__name__} of its metadata: missing "
                         f"{missing[:5]}, unexpected {sorted(unexpected)[:5]}")


def _check_shape(where: str, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != want:
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, but the model its metadata describes "
                         f"needs {want}; the file's metadata and tensors are inconsistent")


def _model_tensor(entry: GGUFEntry, arch: _Arch, config, dtype: torch.dtype, widen: bool) -> torch.Tensor:
    heads = _heads_of(entry.name, config) if arch.permute_qk else None
    if heads is not None and len(entry.shape) == 2:  # permute the rows of bytes: exact for every type
        entry = GGUFEntry(entry.name, entry.ggml_type, entry.shape, entry.data[_rope_rows(entry.shape[0], heads)])
    t = types.to_tensor(entry, widen_kquants=widen)
    if isinstance(t, AffineQuantizedTensor):
        return AffineQuantizedTensor.from_tensors(t.tensors, t.spec.replace(dtype=dtype))
    if heads is not None:
        t = t[_rope_rows(t.shape[0], heads)]
    if arch.norm_shift and _is_norm(entry.name):
        t = t.float() - arch.norm_shift
    return t.to(dtype)


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    return {f"{fqn}.{n}" if fqn else n: (m, n)
            for fqn, m in model.named_modules(remove_duplicate=False) for n in m._parameters}


def _materialize_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers the meta-device build left without data (rotary tables, Gemma's
    embedding scale)."""
    for mod in model.modules():
        meta = [n for n, b in mod._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        if hasattr(mod, "scalar_embed_scale"):
            mod.embed_scale = torch.tensor(mod.scalar_embed_scale)
        elif any("inv_freq" in n for n in meta):
            fresh = type(mod)(config=mod.config)
            for n, b in fresh._buffers.items():
                mod._buffers[n] = b
        else:
            raise ValueError(f"{type(mod).__name__}: buffers {meta} cannot be rebuilt after a meta-device build")


# -- tokenizer --------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer a GGUF file describes.

    transformers' GGUF conversion, except for the byte-level "smollm" pre-tokenizer, which it converts without
    llama.cpp's digit split (`affineq.models.loaders.smollm_tokenizer` builds that one as llama.cpp tokenizes). The
    tokenizer keeps the file's `tokenizer.*` metadata as `gguf_metadata`, which `save_model` writes back as is.
    """
    contents = reader.read(path)
    meta = {k: v for k, v in contents.metadata.items() if k.startswith("tokenizer.")}
    arch = contents.metadata.get("general.architecture")
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") == "smollm":
        from affineq.models.loaders import smollm_tokenizer
        ctx = contents.metadata.get(f"{arch}.context_length", 2048)
        tok = smollm_tokenizer({**meta, "llama.context_length": ctx})
    else:
        from transformers import AutoTokenizer
        p = Path(path)
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    tok.gguf_metadata = meta
    return tok


def _tokenizer_metadata(tokenizer) -> dict[str, Any]:
    """`tokenizer.*` GGUF metadata: a tokenizer from `load_tokenizer` writes back its file's; another byte-level
    BPE fast tokenizer is described as a "gpt2" vocabulary (no pre-tokenizer name: llama.cpp's default)."""
    meta = getattr(tokenizer, "gguf_metadata", None)
    if meta:
        return dict(meta)
    import json
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    if model.get("type") != "BPE":
        raise ValueError(f"save_model(tokenizer=...): only byte-level BPE fast tokenizers (or one from "
                         f"affineq.gguf.load_tokenizer) can be written to GGUF, got {type(tokenizer).__name__}")
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("save_model(tokenizer=...): the vocabulary's ids are not 0..n-1")
    special = set(tokenizer.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                           "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
                           "tokenizer.ggml.merges": merges}
    for key, attr in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id"),
                      ("unknown", "unk_token_id")):
        if getattr(tokenizer, attr, None) is not None:
            out[f"tokenizer.ggml.{key}_token_id"] = int(getattr(tokenizer, attr))
    if getattr(tokenizer, "chat_template", None):
        out["tokenizer.chat_template"] = tokenizer.chat_template
    return out


# -- saving -----------------------------------------------------------------------------------------------------


def _arch_metadata(arch: str, config) -> dict[str, Any]:
    p = arch
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    if arch == "gemma3":
        rope = rope.get("full_attention", {})
    meta = {
        f"{p}.context_length": int(config.max_position_embeddings), f"{p}.embedding_length": int(config.hidden_size),
        f"{p}.feed_forward_length": int(config.intermediate_size), f"{p}.block_count": int(config.num_hidden_layers),
        f"{p}.attention.head_count": int(heads), f"{p}.attention.head_count_kv": int(config.num_key_value_heads),
        f"{p}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{p}.attention.key_length": int(head_dim), f"{p}.attention.value_length": int(head_dim),
        f"{p}.rope.freq_base": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        f"{p}.rope.dimension_count": int(head_dim), f"{p}.vocab_size": int(config.vocab_size),
        "general.quantization_version": 2,
    }
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"save_model: rope_type {rope.get('rope_type')!r} is not written yet (default rotary only)")
    if arch == "gemma3":
        kinds = list(getattr(config, "layer_types", None) or [])
        if kinds != _gemma3_layer_types(config.num_hidden_layers):
            raise ValueError(f"save_model: this Gemma 3 model's layer_types {kinds} differ from llama.cpp's fixed "
                             f"pattern (every {_GEMMA3_SWA_PATTERN}th layer global), which GGUF cannot describe")
        meta["gemma3.attention.sliding_window"] = int(config.sliding_window)
    for key, attr in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = getattr(config, attr, None)
        if isinstance(v, int):
            meta[f"tokenizer.ggml.{key}_token_id"] = v
    return meta


def save_model(model: nn.Module, path: str | os.PathLike, *, tokenizer=None) -> None:
    """Write `model` (a transformers Llama / Mistral / Qwen2 / Gemma 3 causal LM, float or quantized by affineq)
    as a GGUF file llama.cpp loads: the architecture's metadata, every tensor under its GGUF name in the GGUF type
    that holds it exactly (`affineq.gguf.types.from_tensor`; a weight none holds is a ValueError naming it and
    the nearest types, before anything is written), llama.cpp's q/k row order and Gemma's 1 + w norms, and the
    tokenizer's vocabulary if given."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in _MODEL_TYPES:
        raise _unsupported_arch(str(model_type), f"save_model({type(model).__name__})")
    arch_name = _MODEL_TYPES[model_type]
    arch = _ARCHS[arch_name]
    meta = _arch_metadata(arch_name, cfg)
    if tokenizer is not None:
        meta.update(_tokenizer_metadata(tokenizer))
    names = _gguf_names(model, arch_name)
    state = model.state_dict(keep_vars=True)
    tensors: dict[str, torch.Tensor] = {}
    row_order: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for hf, g in names.items():
        t = state[hf]
        if id(t) in seen:  # a tied lm_head: llama.cpp reuses token_embd when output.weight is absent
            continue
        seen.add(id(t))
        t = t.detach()
        if not isinstance(t, AffineQuantizedTensor) and arch.norm_shift and _is_norm(g):
            t = (t.float() + arch.norm_shift).to(t.dtype)
        heads = _heads_of(g, cfg) if arch.permute_qk else None
        if heads is not None:
            inverse = torch.argsort(_rope_rows(t.shape[0], heads))
            if isinstance(t, AffineQuantizedTensor):
                row_order[g] = inverse
            else:
                t = t[inverse]
        tensors[g] = t
    files.save_file(tensors, path, arch=arch_name, metadata=meta, row_order=row_order)
