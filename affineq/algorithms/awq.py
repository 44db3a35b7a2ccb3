"""AWQ (Lin et al. 2023): activation-aware weight quantization. The few input channels that carry large
activations matter most; scaling their weight columns up before quantization (and the activations down,
an identity in float) shrinks their relative rounding error.

For each group of linears that read the same input X [tokens, in] (block by block, `_migrate`):

    s(alpha) = mean|X|^alpha                              (duo_scaling: / mean|W~|^(1 - alpha), with W~ the
    s <- s / sqrt(max(s) min(s))                           weights normalised by their group's max |w|)
    loss(alpha) = || X W^T - (X / s) Q(W * s)^T ||^2       summed over the group's quantized linears

alpha is searched on the grid {0, 1/n_grid, ..., (n_grid - 1)/n_grid} (alpha = 0 is round-to-nearest, so
the search never loses to it on the calibration tokens). Q is the base config's quantization (its spec,
qparams as its format stores them). X / s is folded into the preceding norm or linear where that is an
identity, else kept as the weight's input pre-scale. Optional clipping search (`clip=True`): per output row
and weight group, shrink the quantization range to r * [min, max] for the r in [1, 1 - max_shrink) that
minimises that group's output error || X_g (W_g - Q_r(W_g))^T ||^2.

The result is `Precomputed` weights of the base config: ordinary AffineQuantizedTensors (same kernels,
save/load), carrying `act_pre_scale` where the scale could not be folded.

MoE experts modules (3-D expert weights) are handled first, by `awq_experts`: per expert through the router's
token assignment, with every scale folded where that is exact (a shared gate_up scale into the norm before the
experts, each expert's down_proj scale into its own gate_up rows) and no input pre-scale; see that module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from affineq.algorithms._awq_math import candidate_scale, fake_quant, qparams, search_clip, weight_mean
from affineq.algorithms._base import AlgorithmConfig, Precomputed
from affineq.algorithms._migrate import migrate_blocks, scaled_weight
from affineq.algorithms.awq_experts import awq_experts
from affineq.configs import (
    QuantConfig,
)
from affineq.expert_weights import is_expert_module
from affineq.model_inputs import progress
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["AWQConfig", "fake_quant", "qparams"]


class _Stats:
    """Per-channel mean |x| over every token, plus an evenly spaced sample of at most `per_item` tokens of
    each calibration input (the tokens the search evaluates on)."""

    def __init__(self, per_item: int):
        self.per_item = per_item
        self.abs_sum, self.count, self.rows = None, 0, []

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.count += x.shape[0]
        step = max(1, math.ceil(x.shape[0] / self.per_item))
        self.rows.append(x[::step])

    @property
    def mean(self) -> torch.Tensor:
        return self.abs_sum / self.count

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


@dataclass(frozen=True)
class AWQConfig(AlgorithmConfig):
    """AWQ around a weight config with min/max integer qparams per row or group (`AlgorithmConfig.cannot_wrap`):
    Int4WeightOnlyConfig, IntxWeightOnlyConfig (int2-int8), Int8WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig, or your own. Needs calibration data.

    n_grid: alpha grid size (search over i / n_grid). duo_scaling: divide by the normalised weight
    magnitude as well (s = mean|X|^a / mean|W~|^(1-a)). clip: search a per-group clipping ratio down to
    1 - max_shrink in n_clip steps. n_tokens: calibration tokens the searches evaluate on (spread evenly
    over the items; the activation means use every token). prescale: where a fold is not an identity,
    keep the scale as the weight's input pre-scale (True) or leave that group unscaled (False).
    progress: a bar per block. The search measures weight error only (an 8da4w base's int8 activation
    rounding is not simulated). The model should be in eval mode (dropout would make the runs differ; the
    search runs it in eval mode and restores each module's mode).
    """

    needs_data: ClassVar[bool] = True
    expert_weights: ClassVar[bool] = True  # MoE experts: `awq_experts`, per expert through the router's assignment
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    max_shrink: float = 0.5
    n_clip: int = 10
    n_tokens: int = 512
    prescale: bool = True
    progress: bool = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_grid", "n_clip", "n_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AWQConfig({name}={v!r}) must be a positive int, e.g. {name}=20")
        for name in ("duo_scaling", "clip", "prescale", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AWQConfig({name}={getattr(self, name)!r}) must be True or False")
        if isinstance(self.max_shrink, bool) or not isinstance(self.max_shrink, (int, float)) \
                or not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"AWQConfig(max_shrink={self.max_shrink!r}) must be in [0, 1), e.g. 0.5")

    def _wspec(self, w: torch.Tensor, module: nn.Module):
        return self.base_config.weight_spec(w, module), self.base_config.qparam_options()

    def _search_scale(self, group, stats: _Stats) -> torch.Tensor | None:
        if group.producer is None and not self.prescale:
            return None
        x = stats.sample
        x_mean = stats.mean.clamp_min(1e-8)
        mods = list(group.selected.values())
        ws = [m.weight.detach().float() for m in mods]
        specs = [self._wspec(m.weight, m) for m in mods]
        ref = x @ torch.cat(ws).T
        w_mean = None
        if self.duo_scaling:
            rows = [weight_mean(w, sp.block_size[-1]) * w.shape[0] for w, (sp, _) in zip(ws, specs, strict=True)]
            w_mean = (torch.stack(rows).sum(0) / sum(w.shape[0] for w in ws)).clamp_min(1e-8)
        best, best_s = None, None
        for i in range(self.n_grid):
            a = i / self.n_grid
            s = candidate_scale(a, x_mean, w_mean)
            wq = torch.cat([fake_quant(w * s, sp, op) for w, (sp, op) in zip(ws, specs, strict=True)])
            loss = float((ref - (x / s) @ wq.T).pow(2).mean())
            if best is None or loss < best:
                best, best_s = loss, s
        return best_s

    def _search_clip(self, w: torch.Tensor, x: torch.Tensor, spec, opts) -> torch.Tensor:
        """Per (row, group) ratio r minimising || x_g (w_g - Q_r(w_g))^T ||^2 over the sampled tokens x."""
        return search_clip(w, x, spec, opts, self.n_clip, self.max_shrink)

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        experts = {f: m for f, m in layers.items() if is_expert_module(m)}
        out: dict[str, QuantConfig] = {}
        if experts:  # first: the linears' pass then sees the experts' folds (identities in float)
            out.update(awq_experts(self, model, experts, data))
            layers = {f: m for f, m in layers.items() if f not in experts}
        if layers:
            out.update(self._run_linears(model, layers, data))
        return out

    def _run_linears(self, model: nn.Module, layers: dict[str, nn.Module], data: list) -> dict[str, QuantConfig]:
        per_item = max(1, math.ceil(self.n_tokens / len(data)))
        samples: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def choose(group, stats: _Stats):
            s = self._search_scale(group, stats)
            if self.clip:  # kept for after the fold decision: the clip depends on whether s is used
                for fqn in group.selected:
                    x = stats.sample
                    samples[fqn] = (x[:: max(1, math.ceil(x.shape[0] / 256))], s)
            return s

        found = migrate_blocks(model, layers, data, lambda: _Stats(per_item), choose, desc="AWQ",
                               progress=self.progress)
        out: dict[str, QuantConfig] = {}
        for fqn, module in progress(layers.items(), "AWQ clip + quantize", self.progress):
            s, folded = found[fqn]
            pre = s is not None and not folded and self.prescale
            w = module.weight.detach()
            if pre:
                w = scaled_weight(w, s)
            spec, opts = self._wspec(w, module)
            ratio = None
            if self.clip and fqn in samples:
                x, s_used = samples.pop(fqn)
                x = x / s_used if (s_used is not None and (folded or pre)) else x
                ratio = self._search_clip(w.float(), x, spec, opts)
            scale, zp = qparams(w.float(), spec, opts, ratio)
            qw = AffineQuantizedTensor.from_qparams(w, scale, zp, spec)
            if pre:
                qw = qw.with_act_tensors(act_pre_scale=(1.0 / s.float()).to(w.dtype))
            out[fqn] = Precomputed(base=self.base_config, weight=qw)
        return out
