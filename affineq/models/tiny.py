"""A small seeded decoder-only transformer in pure torch.

It stands in for SmolLM2 when the model packages are absent, so quantization code paths, tests and
benchmarks always have a real attention/MLP stack to run on. Module names follow HF Llama
(``q_proj``, ``gate_proj``, ``lm_head``...) so name-based filters treat both models alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLMConfig", "TinyLM", "build_tiny_lm"]


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _rope_angles(t: int, d: int, theta: float, device: torch.device) -> torch.Tensor:
    """Rotary angles [t, d // 2] float32 for positions 0..t-1: pos * theta^(-2i/d)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    return torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (half-split layout) on x [B, H, T, D]."""
    # Computed per call (cheap) rather than stored as a buffer: nothing to re-init after
    # meta-device construction, and torch.compile sees plain tensor math.
    ang = _rope_angles(x.shape[-2], x.shape[-1], theta, x.device)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.cfg.num_attention_heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q = _rope(split(self.q_proj(x)), self.cfg.rope_theta)
        k = _rope(split(self.k_proj(x)), self.cfg.rope_theta)
        v = split(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """SwiGLU feed-forward, as in Llama."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    """Pre-norm decoder-only LM. forward(input_ids [B, T] int64) -> logits [B, T, vocab] (param dtype)."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


@torch.no_grad()
def _init_weights(model: TinyLM, seed: int) -> None:
    # A private generator keeps the weights a pure function of the seed and leaves the global
    # RNG untouched (building a model must not perturb the caller's random stream).
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers) so the
    # residual stream stays O(1) and random-weight logits stay small (perplexity ~ vocab).
    resid_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, p in model.named_parameters():  # tied weights appear once
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.fill_(1.0)
        else:
            std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def build_tiny_lm(
    seed: int = 0,
    vocab: int = 512,
    dim: int = 256,
    layers: int = 4,
    heads: int = 4,
    ffn: int = 1024,
    *,
    tied: bool = False,
) -> TinyLM:
    """Build a deterministic float32 TinyLM in eval mode on CPU.

    Same arguments -> bit-identical weights. ``tied=True`` shares ``lm_head.weight`` with the embedding
    (like SmolLM2); the default keeps ``lm_head`` a separate nn.Linear so it is quantizable on its own.
    """
    if dim % heads or (dim // heads) % 2:
        raise ValueError(f"dim={dim} must split into {heads} heads of even size")
    cfg = TinyLMConfig(
        vocab_size=vocab,
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        tie_word_embeddings=tied,
    )
    # Build on the meta device so nn.Module default inits (which draw from the global RNG) never run.
    with torch.device("meta"):
        model = TinyLM(cfg)
    model.to_empty(device="cpu")
    if tied:  # to_empty re-materializes parameters; re-tie to be safe
        model.lm_head.weight = model.embed_tokens.weight
    _init_weights(model, seed)
    return model.eval()
