"""Fake-quantized modules: float modules whose forward fake-quantizes the input activation and the weight.

They subclass the float modules (an `isinstance(m, nn.Linear)` filter still selects them) and share the
float module's Parameters when built with `from_float`, so tied weights stay tied and an optimizer built
after prepare trains the same tensors convert quantizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from affineq.qat.config import FakeQuantizeConfig
from affineq.qat.fake_quantizer import FakeQuantizer

__all__ = ["FakeQuantizedConv2d", "FakeQuantizedEmbedding", "FakeQuantizedLinear"]


def _quantizers(module: nn.Module, activation_config, weight_config) -> None:
    for name, cfg in (("activation_config", activation_config), ("weight_config", weight_config)):
        if cfg is not None and not isinstance(cfg, FakeQuantizeConfig):
            raise ValueError(f"{name} must be a FakeQuantizeConfig or None, got {cfg!r}")
    module.activation_fake_quantizer = (None if activation_config is None
                                        else FakeQuantizer(activation_config, activation=True))
    module.weight_fake_quantizer = None if weight_config is None else FakeQuantizer(weight_config)


def _share(new: nn.Module, old: nn.Module) -> nn.Module:
    """`new` (built on the meta device) takes `old`'s parameters, buffers and train/eval state."""
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    for name, b in old.named_buffers(recurse=False):
        setattr(new, name, b)
    new.train(old.training)
    return new


class _FakeQuantized:
    activation_fake_quantizer: FakeQuantizer | None
    weight_fake_quantizer: FakeQuantizer | None

    def _fq_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.activation_fake_quantizer is None else self.activation_fake_quantizer(x)

    def _fq_weight(self) -> torch.Tensor:
        return self.weight if self.weight_fake_quantizer is None else self.weight_fake_quantizer(self.weight)


class FakeQuantizedLinear(_FakeQuantized, nn.Linear):
    """nn.Linear with y = F.linear(fq_act(x), fq_weight(W), b). Signature as torchao's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 activation_config: FakeQuantizeConfig | None = None,
                 weight_config: FakeQuantizeConfig | None = None, *, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        _quantizers(self, activation_config, weight_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._fq_input(x), self._fq_weight(), self.bias)

    @classmethod
    def from_float(cls, mod: nn.Linear, activation_config=None, weight_config=None) -> FakeQuantizedLinear:
        new = cls(mod.in_features, mod.out_features, mod.bias is not None, activation_config, weight_config,
                  device="meta")
        return _share(new, mod)

    def to_float(self) -> nn.Linear:
        new = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        return _share(new, self)


class FakeQuantizedEmbedding(_FakeQuantized, nn.Embedding):
    """nn.Embedding whose table is fake-quantized (rows looked up from fq_weight(W)); inputs are indices, so
    there is no activation quantizer."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 weight_config: FakeQuantizeConfig | None = None, *, device=None, dtype=None, **kwargs) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype, **kwargs)
        _quantizers(self, None, weight_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self._fq_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    @classmethod
    def from_float(cls, mod: nn.Embedding, activation_config=None, weight_config=None) -> FakeQuantizedEmbedding:
        if activation_config is not None:
            raise ValueError("an embedding's input is indices: pass activation_config=None for nn.Embedding")
        new = cls(mod.num_embeddings, mod.embedding_dim, mod.padding_idx, weight_config, device="meta",
                  max_norm=mod.max_norm, norm_type=mod.norm_type, scale_grad_by_freq=mod.scale_grad_by_freq,
                  sparse=mod.sparse)
        return _share(new, mod)

    def to_float(self) -> nn.Embedding:
        new = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse, device="meta")
        return _share(new, self)


class FakeQuantizedConv2d(_FakeQuantized, nn.Conv2d):
    """nn.Conv2d with y = conv2d(fq_act(x), fq_weight(W), b). The activation quantizer sees x [N, C, H, W] as
    rows of W values (per-tensor granularity is the meaningful one for convolutions)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 activation_config: FakeQuantizeConfig | None = None,
                 weight_config: FakeQuantizeConfig | None = None, *, device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device=device, dtype=dtype)
        _quantizers(self, activation_config, weight_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self._fq_input(x), self._fq_weight(), self.bias)

    @classmethod
    def from_float(cls, mod: nn.Conv2d, activation_config=None, weight_config=None) -> FakeQuantizedConv2d:
        new = cls(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                  mod.groups, mod.bias is not None, mod.padding_mode, activation_config, weight_config,
                  device="meta")
        return _share(new, mod)

    def to_float(self) -> nn.Conv2d:
        new = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                        self.dilation, self.groups, self.bias is not None, self.padding_mode, device="meta")
        return _share(new, self)


#: float module type -> its fake-quantized counterpart
FAKE_QUANTIZED = {nn.Linear: FakeQuantizedLinear, nn.Embedding: FakeQuantizedEmbedding,
                  nn.Conv2d: FakeQuantizedConv2d}
