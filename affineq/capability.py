"""What a config's weight spec can do, for the workflows that accept configs by capability, not by class.

QAT (fake quantization that `convert` reproduces exactly), GPTQ, AWQ and HQQ (which compute their own codes
and qparams on the base config's grid) need the same thing from a base config: it quantizes its weights with
min/max qparams (`QuantConfig.quantize_weight`, i.e. `AffineQuantizedTensor.from_spec`) onto an integer target,
in blocks that stay inside one row (per row or per group). They ask the spec the config gives a probe weight
(a 2-D nn.Linear weight on the meta device: nothing is allocated), so a config written outside the package
with only `weight_spec` qualifies like the built-in ones.
"""

from __future__ import annotations

import torch
from torch import nn

from affineq.configs import QuantConfig
from affineq.tensor.spec import QuantSpec

__all__ = ["PROBE_SHAPE", "min_max_integer_rows", "min_max_qparams", "probe_spec", "quantizes_activations",
           "runtime_only"]

#: [out, in] of the probe weight: in_features divisible by every usual group size (32 ... 768, 96, 192).
PROBE_SHAPE = (256, 3072)


def probe_spec(config: QuantConfig) -> QuantSpec | None:
    """The spec `config` gives a [256, 3072] nn.Linear weight (meta device), or None when it cannot say for
    that shape (its checks then run per layer)."""
    with torch.device("meta"):
        module = nn.Linear(PROBE_SHAPE[1], PROBE_SHAPE[0], bias=False)
    try:
        return config.weight_spec(module.weight.detach(), module)
    except (ValueError, TypeError, NotImplementedError):
        return None


def min_max_qparams(config: QuantConfig) -> str | None:
    """None when `config` quantizes its weights with min/max qparams of its spec (`QuantConfig.quantize_weight`:
    `from_spec`), so an observer's or an algorithm's qparams on the same grid can stand in; else why not."""
    name = type(config).__name__
    if not isinstance(config, QuantConfig):
        return f"{config!r} is not a weight config"
    if getattr(config, "workflow", None) is not None:
        return f"{name} runs its own workflow ({config.workflow.name})"
    if type(config).quantize_weight is not QuantConfig.quantize_weight:
        return f"{name} computes its weights itself (it overrides quantize_weight), not with min/max qparams"
    return None


def min_max_integer_rows(config: QuantConfig) -> str | None:
    """None when `config` quantizes weights with min/max qparams onto an integer target in row-local blocks,
    else why not (a phrase naming the config)."""
    why = min_max_qparams(config)
    if why is not None:
        return why
    name = type(config).__name__
    spec = probe_spec(config)
    if spec is None:
        return None
    if spec.target.is_float:
        return f"{name} stores {spec.target.name} codes, not integers"
    if spec.block_size[0] != 1:
        return f"{name}'s blocks {spec.block_size} span rows (per tensor or 2-D blocks); it needs per-row or per-group"
    return None


def quantizes_activations(config: QuantConfig) -> str | None:
    """None when `config` quantizes a Linear's input with one scale per token or per tensor (dynamic, or static
    from calibration: `ActivationQuant` on its weight spec), as SmoothQuant needs; else why not."""
    name = type(config).__name__
    if not isinstance(config, QuantConfig):
        return f"{config!r} is not a weight config"
    if getattr(config, "workflow", None) is not None and not getattr(config, "needs_calibration", False):
        return f"{name} runs its own workflow ({config.workflow.name})"
    spec = probe_spec(config)
    if spec is None:
        return f"{name} gives no weight spec for a [{PROBE_SHAPE[0]}, {PROBE_SHAPE[1]}] nn.Linear weight"
    if spec.act_quant is None:
        return f"{name} leaves activations float (weight-only)"
    if spec.act_quant.is_mx:
        return f"{name} quantizes activations in MX blocks, whose shared exponents absorb the migration"
    return None


def runtime_only(config: QuantConfig) -> str | None:
    """None when `config` needs nothing but the weight (weight-only or dynamic activations: no calibration, no
    workflow), as torch.ao's `quantize_dynamic` does; else why not."""
    name = type(config).__name__
    if not isinstance(config, QuantConfig):
        return f"{config!r} is not a weight config"
    if getattr(config, "needs_calibration", False):
        return f"{name} quantizes activations statically (it needs calibration)"
    if getattr(config, "workflow", None) is not None:
        return f"{name} runs its own workflow ({config.workflow.name})"
    return None
