"""QAT of MoE expert weights (transformers' experts modules, 3-D `gate_up_proj` / `up_proj` / `down_proj`).

An experts module has no fake-quantized counterpart class (each model family has its own), so prepare leaves the
module and its forward alone and registers a parametrization on each 3-D expert weight
(`torch.nn.utils.parametrize`): reading `module.gate_up_proj` then returns the fake-quantized weight, computed from
the float Parameter `module.parametrizations.gate_up_proj.original` (the tensor an optimizer trains), so whichever
experts implementation transformers runs (eager loop, grouped_mm, ...) sees it, with straight-through gradients to
the 3-D float parameter.

The fake quantization is per expert: expert e's weight [N, K] (out, in; gpt-oss's [K, N] storage transposed) is
fake-quantized exactly as the base config quantizes an nn.Linear weight of that shape (`fake_quantize_configs`:
spec, qparam options, the packing format's stored qparams). Its blocks lie inside one row of one expert, so the
[E, N, K] stack is fake-quantized as one [E * N, K] matrix: the same blocks, qparams and codes. convert removes
the parametrizations and stores `quantize_expert_weight(base, trained weight, module)`: the 3-D
AffineQuantizedTensor `quantize_` would make of the trained weight, whose dequantized values are the prepared
forward's. Weight-only base configs with dynamic qparams only (no activation fake quantization, no range learning).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from affineq.expert_weights import (
    expert_parameter_names,
    experts_transposed,
    is_expert_module,
    per_expert_shape,
    quantize_expert_weight,
)
from affineq.qat.config import FakeQuantizeConfig
from affineq.qat.fake_quantizer import FakeQuantizer

__all__ = ["ExpertWeightFakeQuantizer", "convert_experts", "expert_proxies", "is_prepared_experts", "prepare_experts"]


class ExpertWeightFakeQuantizer(nn.Module):
    """A parametrization of a 3-D expert weight: [E, N, K] (or gpt-oss's [E, K, N] with `transposed`) -> the same
    shape, each expert's [N, K] fake-quantized by `weight_config` (blocks along K) as viewed [E * N, K]."""

    def __init__(self, weight_config: FakeQuantizeConfig, packing_format: str, transposed: bool) -> None:
        super().__init__()
        self.weight_fake_quantizer = FakeQuantizer(weight_config)
        self.weight_fake_quantizer.packing_format = packing_format
        self.transposed = transposed

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        rows = w.transpose(-2, -1) if self.transposed else w  # [E, N, K]
        e, n, k = rows.shape
        out = self.weight_fake_quantizer(rows.reshape(e * n, k)).reshape(e, n, k)
        return out.transpose(-2, -1) if self.transposed else out


def _fake_quantizers(module: nn.Module) -> dict[str, ExpertWeightFakeQuantizer]:
    plist = getattr(module, "parametrizations", None)
    if plist is None:
        return {}
    return {name: p[0] for name, p in plist.items() if len(p) == 1 and isinstance(p[0], ExpertWeightFakeQuantizer)}


def is_prepared_experts(module: nn.Module) -> bool:
    """Whether `module` is an experts module whose expert weights `prepare_experts` parametrized."""
    return bool(_fake_quantizers(module))


def expert_proxies(module: nn.Module) -> dict[str, tuple[torch.Tensor, nn.Linear]]:
    """{name: (a meta [N, K] weight, a meta nn.Linear(K, N))} standing for one expert of each 3-D expert weight of
    `module`: what a config's fake-quantization is derived from (`fake_quantize_configs`)."""
    out = {}
    for name in expert_parameter_names(module):
        w = module._parameters[name]
        n, k = per_expert_shape(module, w)
        out[name] = (torch.empty(n, k, device="meta", dtype=w.dtype),
                     nn.Linear(k, n, bias=False, device="meta", dtype=w.dtype))
    return out


def prepare_experts(module: nn.Module, base, configs: dict[str, tuple[FakeQuantizeConfig, str]]) -> nn.Module:
    """Parametrize each 3-D expert weight `name` of `module` with an `ExpertWeightFakeQuantizer` of
    configs[name] = (weight config, packing format), both derived from weight-only config `base` (recorded for
    convert). Returns `module`."""
    fqs = {name: ExpertWeightFakeQuantizer(wcfg, fmt, experts_transposed(module))
           for name, (wcfg, fmt) in configs.items()}
    for name, fq in fqs.items():
        parametrize.register_parametrization(module, name, fq)
    module.qat_base_config = base
    return module


def convert_experts(module: nn.Module, base) -> nn.Module:
    """Remove the parametrizations of a prepared experts module, its expert weights becoming the 3-D
    AffineQuantizedTensors `quantize_expert_weight(base, trained weight, module)`. Returns `module`."""
    names = list(_fake_quantizers(module))
    trained = {name: module.parametrizations[name].original.detach() for name in names}
    for name in names:
        parametrize.remove_parametrizations(module, name, leave_parametrized=False)
    if not is_expert_module(module):  # (cannot happen: the original Parameters are back)
        raise ValueError(f"{type(module).__name__} has no 3-D expert weights after removing its QAT parametrizations")
    for name, w in trained.items():
        module._parameters[name] = nn.Parameter(quantize_expert_weight(base, w, module), requires_grad=False)
    module.__dict__.pop("qat_base_config", None)
    return module
