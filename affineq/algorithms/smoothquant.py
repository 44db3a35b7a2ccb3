"""SmoothQuant (Xiao et al. 2022): make int8 activations easy by migrating their outlier channels into the
weights before W8A8 quantization.

Per input channel j of a group of linears that read the same input X (calibrated max over all tokens):

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (max|W_j| over every weight row of the group)
    y = (X / s) (W * s)^T

alpha = 0.5 balances the two ranges; larger alpha moves more difficulty into the weights. X / s is folded
into the preceding norm or linear where that is an identity (`_migrate`), else stored as the quantized
weight's input pre-scale. Then the base config quantizes: int8 dynamic per-token activations
(`Int8DynamicActivationInt8WeightConfig`) or static per-tensor ones (`Int8StaticActivationInt8WeightConfig`,
calibrated after the migration on the same data, its observers seeing X / s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from affineq.algorithms._base import AlgorithmConfig
from affineq.algorithms._migrate import PreScaled, migrate_blocks
from affineq.capability import quantizes_activations
from affineq.configs import QuantConfig

__all__ = ["SmoothQuantConfig", "smooth_scale"]


def smooth_scale(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float, eps: float = 1e-5) -> torch.Tensor:
    """s = max|X|^alpha / max|W|^(1 - alpha), float32 [in_features]; both maxima clamped to `eps` so dead
    channels get a finite scale."""
    x = x_absmax.float().clamp_min(eps)
    w = w_absmax.float().clamp_min(eps)
    return (x.pow(alpha) / w.pow(1.0 - alpha)).clamp_min(eps)


class _AbsMax:
    """Running per-channel max |x| over [tokens, in_features] inputs."""

    def __init__(self):
        self.value = None

    def update(self, x: torch.Tensor) -> None:
        m = x.detach().abs().amax(0).float()
        self.value = m if self.value is None else torch.maximum(self.value, m)


@dataclass(frozen=True)
class SmoothQuantConfig(AlgorithmConfig):
    """SmoothQuant around an int8-activation config.

    base_config: a config that quantizes activations per token or per tensor (accepted by what its spec says,
    `affineq.capability.quantizes_activations`), e.g. Int8DynamicActivationInt8WeightConfig() (per-token
    dynamic) or Int8StaticActivationInt8WeightConfig(...) (per-tensor static, calibrated after smoothing).
    alpha: migration strength in [0, 1] (0: no change to activations; 0.5 the paper's default; 0.75-0.85
    for models with strong outliers). prescale: where a fold into the previous op is not an identity, store
    the scale as the weight's input pre-scale (True) or leave that group unsmoothed (False, no runtime
    multiply). progress: a bar per block. Needs calibration data."""

    needs_data: ClassVar[bool] = True
    pre_quant: ClassVar[bool] = True  # Quark's pre_quant_opt_config
    alpha: float = 0.5
    prescale: bool = True
    progress: bool = True

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"SmoothQuantConfig(alpha={self.alpha!r}): alpha must be a number in [0, 1], "
                             "e.g. 0.5")
        for name in ("prescale", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SmoothQuantConfig({name}={getattr(self, name)!r}) must be True or False")

    def cannot_wrap(self, base: QuantConfig) -> str | None:
        """None when `base` quantizes activations per token or per tensor (its spec says so), else why not."""
        return quantizes_activations(base)

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        def choose(group, stats: _AbsMax):
            if group.producer is None and not self.prescale:
                return None
            w_absmax = torch.stack([m.weight.detach().abs().amax(0).float() for m in group.members.values()]).amax(0)
            return smooth_scale(stats.value, w_absmax.to(stats.value.device), float(self.alpha))

        found = migrate_blocks(model, layers, data, _AbsMax, choose, desc="SmoothQuant", progress=self.progress)
        out: dict[str, QuantConfig] = {}
        for fqn, (s, folded) in found.items():
            if s is None or folded:
                out[fqn] = self.base_config
            elif self.prescale:
                out[fqn] = PreScaled(base=self.base_config, scale=s)
            else:  # a fold was expected but did not verify: leave the layer unsmoothed
                out[fqn] = self.base_config
        return out
