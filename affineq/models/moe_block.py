"""The feed-forward part of a ``StaticDecoder`` layer: a gated MLP (gate/up/down linears), or a transformers
sparse mixture-of-experts block (Mixtral, Qwen3-MoE, gpt-oss) run through the model's own router and experts.

MoE: ``router(x) -> (logits, top_k_weights [N, k], top_k_index [N, k])`` and ``experts(x, top_k_index,
top_k_weights) -> [N, H]`` are the block's own modules, called as the block's forward calls them, so the experts'
implementation the model is set to (transformers' ``experts_implementation``: ``grouped_mm``, ``batched_mm``, or
one an affineq quantized experts module registers) runs unchanged, quantized experts included. Only the
``"eager"`` implementation (a Python loop over the experts hit, data-dependent) cannot be compiled in one graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["is_moe_block", "moe_forward", "gated_mlp_forward", "experts_implementation"]


def is_moe_block(block: nn.Module) -> bool:
    """Whether ``block`` is a transformers sparse MoE block: an ``experts`` module and a ``gate`` / ``router``."""
    return hasattr(block, "experts") and isinstance(getattr(block, "gate", None) or getattr(block, "router", None),
                                                   nn.Module)


def experts_implementation(block: nn.Module) -> str | None:
    """The experts implementation a MoE block runs (transformers' ``config._experts_implementation``)."""
    cfg = getattr(block.experts, "config", None)
    return getattr(cfg, "_experts_implementation", None)


def moe_forward(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, S, H] -> the block's output [B, S, H]: its router, then its experts on the routed tokens."""
    router = getattr(block, "gate", None) or block.router
    experts = block.experts

    def run(x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        _, weights, index = router(flat)
        return experts(flat, index, weights).reshape(b, s, h)

    return run


def gated_mlp_forward(gate_up: Callable[[torch.Tensor], list[torch.Tensor]],
                      down: Callable[[torch.Tensor], torch.Tensor],
                      act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> down(act(gate(x)) * up(x)), transformers' Llama MLP order."""

    def run(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x)
        return down(act(gate) * up)

    return run
