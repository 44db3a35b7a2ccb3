"""The forward of transformers' MoE experts modules on quantized expert weights: `grouped_linear`.

transformers 5 runs an experts module (`@use_experts_implementation`: Mixtral, Qwen2/3-MoE, gpt-oss, ...) through
`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`. affineq registers its own
entry there, "affineq" (`register_experts_implementation`, lazily: transformers is optional), and selects it on a
model whose expert weights it quantized (`use_affineq_experts`, run after every successful `quantize_` and after
a quantized checkpoint is loaded). transformers' source is not patched.

For T tokens routed to top-k experts (`top_k_index`, `top_k_weights` [T, k]) the forward computes, with the
S = T * k (token, expert) rows in token order:

    rows    = hidden_states repeated k times            [S, H]
    h       = grouped_linear(rows, ids, gate_up_proj, gate_up_proj_bias)      [S, 2I]  (ids = top_k_index, flat)
    h       = module._apply_gate(h)  (gated: act(gate) * up, gpt-oss's clamped interleaved SwiGLU, ...)  [S, I]
              or module.act_fn(h)    (no gate)
    out     = grouped_linear(h, ids, down_proj, down_proj_bias)               [S, H]
    result  = sum over k of out * top_k_weights                               [T, H]

so each expert's packed weight is read once per call for the rows routed to it (a decode step touches only the
chosen experts' bytes). Float expert modules in the same model run the implementation selected before
("grouped_mm" by default). Works eagerly and under torch.compile (no data-dependent Python control flow here).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from affineq.expert_weights import expert_parameter_names, is_expert_module
from affineq.quantize import AFTER_QUANTIZE
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["EXPERTS_IMPLEMENTATION", "affineq_experts_forward", "register_experts_implementation",
           "use_affineq_experts"]

#: The key of affineq's forward in transformers' `ALL_EXPERTS_FUNCTIONS`.
EXPERTS_IMPLEMENTATION = "affineq"
_FLOAT_FORWARD = "_affineq_float_experts"  # per module: the implementation its float weights ran before
_ROW_VIEWS = "_affineq_row_views"  # per module: {name: (parameter, its [E, N, K] view)} (gpt-oss layout)


def _as_rows_by_input(module: nn.Module, name: str) -> torch.Tensor:
    """Expert weight `name` as [E, N, K] (out, in), what `grouped_linear` takes. gpt-oss stores [E, K, N]
    (`is_transposed`); a quantized one is then stored as [E, N, K] codes with a transposed flag, and its [E, N, K]
    view (no data moves) is kept on the module, made eagerly (`use_affineq_experts`), so that a compiled forward
    reads it as a module attribute instead of building a spec inside the graph."""
    w = module._parameters[name]
    if not getattr(module, "is_transposed", False):
        return w
    if not isinstance(w, AffineQuantizedTensor):
        return w.transpose(-2, -1).contiguous()
    views = module.__dict__.get(_ROW_VIEWS)
    if views is not None and name in views and views[name][0] is w:
        return views[name][1]
    view = w.transpose(-2, -1)  # a flag on the spec (`ops._transpose`)
    if not torch.compiler.is_compiling():
        module.__dict__.setdefault(_ROW_VIEWS, {})[name] = (w, view)
    return view


def _bias(module: nn.Module, name: str) -> torch.Tensor | None:
    return module._parameters.get(f"{name}_bias") if getattr(module, "has_bias", False) else None


def affineq_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (`ALL_EXPERTS_FUNCTIONS` signature) through `grouped_linear`: hidden_states
    [T, H], top_k_index [T, k] int, top_k_weights [T, k] -> [T, H] in hidden_states' dtype (module docstring)."""
    names = expert_parameter_names(module)
    if not any(isinstance(module._parameters[n], AffineQuantizedTensor) for n in names):
        return _float_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    from affineq.tensor.grouped import grouped_linear

    t, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1).to(torch.int64)
    weights = top_k_weights.reshape(-1, 1)
    num_experts = module._parameters["down_proj"].shape[0]
    if getattr(module, "_is_expert_parallel", False):  # rows routed to another rank's experts: weight 0
        weights = weights.masked_fill((ids >= num_experts).unsqueeze(-1), 0.0)
        ids = ids.clamp(max=num_experts - 1)
    rows = hidden_states.repeat_interleave(k, dim=0)  # row s = token s // k, its (s % k)-th expert
    up = names[0]
    h = grouped_linear(rows, ids, _as_rows_by_input(module, up), _bias(module, up))
    h = module._apply_gate(h) if up == "gate_up_proj" else module.act_fn(h)
    out = grouped_linear(h, ids, _as_rows_by_input(module, "down_proj"), _bias(module, "down_proj"))
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    out = out * weights.to(out.dtype)
    return out.view(t, k, hidden).sum(dim=1).to(hidden_states.dtype)


def _float_forward(module: nn.Module):
    """The implementation a module's float expert weights run: the one selected before affineq's (its
    `ALL_EXPERTS_FUNCTIONS` entry, or the module's own loop for "eager")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = module.__dict__.get(_FLOAT_FORWARD) or "grouped_mm"
    if name in ALL_EXPERTS_FUNCTIONS and name != EXPERTS_IMPLEMENTATION:
        return ALL_EXPERTS_FUNCTIONS[name]
    forward = type(module).forward  # "eager": the loop `use_experts_implementation` wrapped
    return getattr(forward, "__wrapped__", ALL_EXPERTS_FUNCTIONS["grouped_mm"])


def register_experts_implementation() -> bool:
    """Register "affineq" in transformers' `ALL_EXPERTS_FUNCTIONS` (once). False when transformers (or its MoE
    dispatch, transformers >= 5) is not installed."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    except ImportError:
        return False
    if ALL_EXPERTS_FUNCTIONS.get(EXPERTS_IMPLEMENTATION) is not affineq_experts_forward:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, affineq_experts_forward)
    return True


def use_affineq_experts(model: nn.Module) -> int:
    """Select the "affineq" experts implementation for every experts module of `model` with quantized expert
    weights (their `config._experts_implementation`, shared with the model's config; float expert modules keep
    running the implementation selected before). Returns how many modules hold quantized expert weights."""
    found = 0
    for m in model.modules():
        if not is_expert_module(m) or not any(
                isinstance(m._parameters[n], AffineQuantizedTensor) for n in expert_parameter_names(m)):
            continue
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(cfg, "_experts_implementation") or not register_experts_implementation():
            continue
        found += 1
        for n in expert_parameter_names(m):
            _as_rows_by_input(m, n)  # the [E, N, K] views of gpt-oss-layout weights, made here, outside a graph
        current = cfg._experts_implementation
        if current != EXPERTS_IMPLEMENTATION:
            for other in model.modules():  # every module sharing this config keeps its float implementation
                if getattr(other, "config", None) is cfg and is_expert_module(other):
                    other.__dict__.setdefault(_FLOAT_FORWARD, current)
            cfg._experts_implementation = EXPERTS_IMPLEMENTATION
    return found


def _after_quantize(model: nn.Module, config) -> None:
    """`quantize_`'s hook: quantized expert weights run through `grouped_linear`. Never raises."""
    try:
        use_affineq_experts(model)
    except Exception as e:  # noqa: BLE001 - quantize_ has succeeded: say so, and how to select it by hand
        warnings.warn(f"affineq could not select its experts implementation ({e}); the quantized experts run "
                      "transformers' selected one on dequantized weights: call "
                      "affineq.experts.use_affineq_experts(model)", stacklevel=3)


AFTER_QUANTIZE[:] = [h for h in AFTER_QUANTIZE if getattr(h, "__module__", None) != __name__] + [_after_quantize]
