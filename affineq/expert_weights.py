"""Mixture-of-experts weights: which modules hold them (by parameter layout) and how a config quantizes them.

transformers 5 stores the experts of an MoE layer (Mixtral, Qwen2/3-MoE, gpt-oss, DeepSeek, ...) as one module
with 3-D parameters, one slice per expert:

| parameter                    | layout (is_transposed False)    | gpt-oss style (is_transposed True)  |
|------------------------------|---------------------------------|-------------------------------------|
| `gate_up_proj` (or `up_proj`) | [E, 2I, H] (out, in)            | [E, H, 2I] (in, out)                |
| `down_proj`                   | [E, H, I]                       | [E, I, H]                           |

A module is an experts module when its parameters include a 3-D `down_proj` and a 3-D `gate_up_proj` or
`up_proj` with the same number of experts; `is_transposed` (set by transformers' `use_experts_implementation`)
says which layout. No list of model classes: any module with this layout is recognized.

`quantize_expert_weight(config, weight, module)` quantizes each expert's 2-D weight [N, K] (out, in; groups along
the input dim K) exactly as `config` quantizes a 2-D nn.Linear weight of that shape, and stacks them into one 3-D
`AffineQuantizedTensor` (spec shape (E, N, K), block (1, 1, g); `transposed` for gpt-oss, so the parameter keeps
its shape). Any config that quantizes nn.Linear weights applies, its own `quantize_weight` included.
"""

from __future__ import annotations

import torch
from torch import nn

from affineq.process_memory import release_float_copy
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.format_experts import format_of, stacked_spec

__all__ = ["EXPERT_WEIGHT_NAMES", "expert_parameter_names", "expert_weight_problem", "experts_transposed",
           "in_grouped_layout", "is_expert_module", "per_expert_shape", "quantize_expert_weight", "stack_experts"]

#: The 3-D expert weights of a transformers experts module, in the order they run.
EXPERT_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")


def _weight3d(module: nn.Module, name: str) -> torch.Tensor | None:
    p = module._parameters.get(name)
    return p if p is not None and p.dim() == 3 else None


def is_expert_module(module: nn.Module) -> bool:
    """Whether `module` holds MoE experts as 3-D parameters: a 3-D `down_proj` and a 3-D `gate_up_proj` or
    `up_proj` with the same leading (expert) dim."""
    down = _weight3d(module, "down_proj")
    up = _weight3d(module, "gate_up_proj")
    up = up if up is not None else _weight3d(module, "up_proj")
    return down is not None and up is not None and down.shape[0] == up.shape[0]


def expert_parameter_names(module: nn.Module) -> tuple[str, ...]:
    """The 3-D expert weights of an experts module (`EXPERT_WEIGHT_NAMES` it has), e.g. ("gate_up_proj",
    "down_proj")."""
    return tuple(n for n in EXPERT_WEIGHT_NAMES if _weight3d(module, n) is not None)


def experts_transposed(module: nn.Module) -> bool:
    """Whether the module stores its expert weights [E, in, out] (gpt-oss: `is_transposed`) rather than
    [E, out, in]."""
    return bool(getattr(module, "is_transposed", False))


def per_expert_shape(module: nn.Module, weight: torch.Tensor) -> tuple[int, int]:
    """(N, K) = (out, in) of one expert's weight, whichever layout the module stores."""
    _, a, b = weight.shape
    return (b, a) if experts_transposed(module) else (a, b)


def expert_weight_problem(module: nn.Module) -> str | None:
    """Why the expert weights of `module` are not the layout `experts_transposed` says (a sentence), or None:
    the input dim of `gate_up_proj` must be the output dim of `down_proj` (the hidden size), and the input dim of
    `down_proj` must be half (gated) or all of the output of `gate_up_proj` / `up_proj`."""
    names = expert_parameter_names(module)
    up_name = names[0]
    n_up, k_up = per_expert_shape(module, module._parameters[up_name])
    n_down, k_down = per_expert_shape(module, module._parameters["down_proj"])
    gated = up_name == "gate_up_proj"
    if k_up != n_down or (n_up != (2 * k_down if gated else k_down)):
        layout = "[E, in, out]" if experts_transposed(module) else "[E, out, in]"
        return (f"its expert weights {up_name} {tuple(module._parameters[up_name].shape)} and down_proj "
                f"{tuple(module._parameters['down_proj'].shape)} do not fit the layout {layout} that is_transposed="
                f"{experts_transposed(module)} says; set the module's is_transposed to match its weights")
    return None


#: Quantized experts' float pages are given back in runs of at least this many bytes.
_RELEASE_BYTES = 64 << 20


def _proxy_linear(n: int, k: int, weight: torch.Tensor) -> nn.Linear:
    """A meta nn.Linear(k, n) standing for one expert: configs choose formats and checks for a Linear weight."""
    return nn.Linear(k, n, bias=False, device="meta", dtype=weight.dtype)


def quantize_expert_weight(config, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
    """Expert weights `weight` (3-D, a parameter of experts module `module`) quantized expert by expert with
    `config` (anything with `quantize_weight(weight_2d, module)`), stacked into one 3-D AffineQuantizedTensor
    whose expert e is exactly `config.quantize_weight(w_e, nn.Linear)` of its [N, K] weight `w_e`.

    On CPU, what "auto" chose for a Linear (aten's `int4_cpu`, `plain` for `_int_mm`) becomes `dense`, the layout
    the grouped kernel reads, where it holds the spec; a weight's activation tensors (AWQ pre-scales) cannot be
    stacked (ValueError). Memory: one expert's float temporaries at a time, the output written in place, and each
    expert's pages of a memory-mapped weight (safetensors) given back once it is quantized."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not is_expert_module(module):
        raise ValueError(f"quantize_expert_weight(weight=..., module=...): weight must be one 3-D expert weight "
                         f"(got {tuple(getattr(weight, 'shape', ()))}) of an experts module (3-D gate_up_proj / "
                         f"down_proj; got {type(module).__name__})")
    transposed = experts_transposed(module)
    w = weight.transpose(-2, -1) if transposed else weight  # [E, N, K]: one expert's rows are its outputs
    e, n, k = w.shape
    proxy = _proxy_linear(n, k, weight)
    first, out, done = None, {}, 0
    per_expert = weight[0].numel() * weight.element_size() if e else 0
    for i in range(e):
        q = in_grouped_layout(config, config.quantize_weight(w[i].contiguous(), proxy))
        if first is None:
            first = q
            out = {name: torch.empty((e, *t.shape), dtype=t.dtype, device=t.device) for name, t in q.tensors.items()}
        _check_like(first, q, i)
        for name, t in q.tensors.items():
            out[name][i].copy_(t)
        if (i + 1 - done) * per_expert >= _RELEASE_BYTES or i == e - 1:  # (a syscall and a heap trim per call)
            release_float_copy(weight[done:i + 1])
            done = i + 1
    return _stacked(first, out, transposed)


def in_grouped_layout(config, q: AffineQuantizedTensor) -> AffineQuantizedTensor:
    """One expert's quantized weight `q` (quantized by `config`) in the layout it is stacked in: on CPU, what
    `config`'s "auto" packing chose for a Linear (aten's `int4_cpu`, `plain` for `_int_mm`) becomes `dense`, the
    layout the grouped kernel reads, where it holds the spec (the same codes and qparams); else `q` itself."""
    if (getattr(config, "packing_format", None) != "auto" or q.device.type != "cpu" or q.spec.fmt == "dense"
            or format_of(q.spec.replace(fmt="dense")).check(q.spec.replace(fmt="dense")) is not None):
        return q
    return q.to_format("dense")


def _check_like(first: AffineQuantizedTensor, p: AffineQuantizedTensor, i: int) -> None:
    """ValueError unless expert i's quantized weight `p` can be stacked with expert 0's `first`."""
    if not isinstance(p, AffineQuantizedTensor) or p.spec != first.spec or p.spec.transposed:
        raise ValueError(f"stack_experts: expert {i} is {p!r}, expert 0 {first!r}; every expert must be a 2-D "
                         "untransposed AffineQuantizedTensor with the same spec (the same config and shape)")
    layout = [(n, t.dtype, tuple(t.shape)) for n, t in first.tensors.items()]
    if [(n, t.dtype, tuple(t.shape)) for n, t in p.tensors.items()] != layout:
        raise ValueError(f"stack_experts: expert {i} stores {[(n, t.dtype) for n, t in p.tensors.items()]}, "
                         f"expert 0 {[(n, d) for n, d, _ in layout]}; quantize every expert with one config")
    if p.act_tensors:
        raise ValueError(f"stack_experts: expert {i} carries activation tensors {sorted(p.act_tensors)} (AWQ / "
                         "SmoothQuant pre-scales, static activation qparams), which expert weights cannot hold "
                         "yet; quantize the experts with a weight-only or dynamic-activation config")


def _stacked(first: AffineQuantizedTensor, tensors: dict[str, torch.Tensor], transposed: bool,
             ) -> AffineQuantizedTensor:
    spec = stacked_spec(first.spec, next(iter(tensors.values())).shape[0])
    format_of(spec).validate(tensors, spec)
    out = AffineQuantizedTensor(tensors, spec)
    return out._replace(spec=spec.replace(transposed=True)) if transposed else out


def stack_experts(parts: list[AffineQuantizedTensor], transposed: bool = False) -> AffineQuantizedTensor:
    """One 3-D AffineQuantizedTensor [E, N, K] (or its [E, K, N] view when `transposed`) from the 2-D quantized
    weights of E experts, which must share spec and stored layout (ValueError otherwise)."""
    if not parts:
        raise ValueError("stack_experts needs at least one expert's quantized weight")
    for i, p in enumerate(parts):
        _check_like(parts[0], p, i)
    return _stacked(parts[0], {n: torch.stack([getattr(p, "_" + n) for p in parts]) for n in parts[0]._names},
                    transposed)
