"""Calibration of MoE experts through the router's token assignment, shared by GPTQ and AWQ: the inputs a
transformers experts module receives (hidden_states [T, H], top_k_index [T, k]) on each calibration input, the
rows each expert is sent, and the rows its down projection then receives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from affineq.algorithms._capture import Stop
from affineq.expert_weights import expert_parameter_names, experts_transposed

__all__ = ["as_rows_by_input", "capture_routed", "down_inputs", "rows_per_expert", "up_name"]


def up_name(module: nn.Module) -> str:
    """The first expert weight the forward runs: "gate_up_proj" (gated) or "up_proj"."""
    return expert_parameter_names(module)[0]


def capture_routed(module: nn.Module, inputs: list, forward: Callable) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(hidden_states [T, H], top_k_index [T, k]) per input]: what experts module `module` receives when
    `forward(inp)` runs on each of `inputs` (the forward stops at the module)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(_mod, args, kwargs):
        named = {**dict(zip(("hidden_states", "top_k_index"), args, strict=False)), **kwargs}
        x, ids = named["hidden_states"], named.get("top_k_index", named.get("router_indices"))
        seen.append((x.detach().reshape(-1, x.shape[-1]), ids.detach().reshape(x.shape[0], -1)))
        raise Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for inp in inputs:
                with contextlib.suppress(Stop):
                    forward(inp)
    finally:
        handle.remove()
    return seen


def rows_per_expert(seen: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int) -> list[list[torch.Tensor]]:
    """rows[e][i]: the rows of input i's hidden_states the router sends to expert e ([t_ei, H], possibly empty)."""
    return [[x[(ids == e).any(-1)] for x, ids in seen] for e in range(num_experts)]


def down_inputs(module: nn.Module, up_weight: torch.Tensor, rows: list[list[torch.Tensor]]
                ) -> list[list[torch.Tensor]]:
    """The rows down_proj of each expert receives: gate(x W_e^T + b_e) (the module's `_apply_gate`, or `act_fn`
    without a gate) for x in rows[e]; up_weight: the module's first expert weight as [E, N, K] (out, in) in
    float, e.g. its dequantized quantized copy."""
    name = up_name(module)
    bias = module._parameters.get(f"{name}_bias") if getattr(module, "has_bias", False) else None
    out = []
    for e, xs in enumerate(rows):
        outs = []
        for x in xs:
            h = torch.nn.functional.linear(x, up_weight[e].to(x.dtype), None if bias is None else bias[e].to(x.dtype))
            outs.append(module._apply_gate(h) if name == "gate_up_proj" else module.act_fn(h))
        out.append(outs)
    return out


def as_rows_by_input(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """An expert weight of `module` as [E, N, K] (out, in): gpt-oss's [E, K, N] transposed (a view)."""
    return weight.transpose(-2, -1) if experts_transposed(module) else weight
