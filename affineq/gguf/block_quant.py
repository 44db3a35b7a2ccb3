"""Quantizing weights into ggml's 32-weight block types the way llama.cpp does, so they save to GGUF exactly.

`quantize_blocks(weight, "Q4_1")` is a torch port of ggml's reference quantizers (`quantize_row_q4_0_ref` ...
`quantize_row_q8_0_ref`, which `gguf.quants.quantize` also follows), per block of 32 weights x of a row:

| type | d (stored fp16)           | m (Q4_1 / Q5_1: stored fp16) | code                                  |
|------|---------------------------|------------------------------|---------------------------------------|
| Q4_0 | x[argmax abs] / -8        |                              | min(15, trunc(x / d + 8.5))           |
| Q5_0 | x[argmax abs] / -16       |                              | min(31, trunc(x / d + 16.5))          |
| Q4_1 | (max - min) / 15          | min                          | min(15, trunc((x - min) / d + 0.5))   |
| Q5_1 | (max - min) / 31          | min                          | min(31, trunc((x - min) / d + 0.5))   |
| Q8_0 | amax / 127                |                              | round half away (x / d)               |

(codes are computed with the fp32 d and 1 / d, as ggml does, then d and m are rounded to fp16). The result is
the `dense` tensor `load_file` makes of such a file's blocks (fp16-exact d and m), so `save_model` writes it as
that type bit for bit. `GGUFBlockConfig` is the `quantize_` config of it: the asymmetric Q4_1 / Q5_1 need it,
since affineq's own asymmetric mapping (scale and integer zero point) leaves an offset fp16 cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from affineq.configs.base import QuantConfig, check_choice
from affineq.gguf import blocks, types
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["BLOCK_QUANT_TYPES", "GGUFBlockConfig", "quantize_blocks"]

BLOCK_QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _check_shape(weight_shape: tuple[int, ...], ggml_type: str) -> None:
    if len(weight_shape) != 2 or weight_shape[1] % blocks.BLOCK:
        raise ValueError(f"{ggml_type} needs a 2-D weight whose last dimension is a multiple of {blocks.BLOCK}, got "
                         f"shape {tuple(weight_shape)}: leave this layer out (filter_fn) or keep it in float")


def quantize_blocks(weight: torch.Tensor, ggml_type: str = "Q4_0") -> AffineQuantizedTensor:
    """`weight` [N, K] (K a multiple of 32, any float dtype) as ggml block type `ggml_type` (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0; the table in the module docstring): a `dense` AffineQuantizedTensor of logical dtype
    weight.dtype whose codes and fp16 scales (and mins) are the bytes ggml's reference quantizer writes."""
    check_choice("ggml_type", ggml_type, BLOCK_QUANT_TYPES)
    _check_shape(tuple(weight.shape), ggml_type)
    if not weight.dtype.is_floating_point:
        raise TypeError(f"quantize_blocks: weight must be floating point, got {weight.dtype}")
    n, k = weight.shape
    x = weight.detach().to("cpu", torch.float32).reshape(-1, blocks.BLOCK)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("quantize_blocks: weight has NaN or inf values")
    bt = blocks.BLOCK_TYPES[ggml_type]
    top = (1 << bt.bits) - 1
    if ggml_type == "Q8_0":
        d = x.abs().amax(1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = x * inv
        q = torch.sign(q) * torch.floor(q.abs() + 0.5)  # roundf: half away from zero
        u = (q.to(torch.int16) + 128).to(torch.uint8)
        m16 = None
    elif bt.has_min:
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        d = (hi - lo) / top
        inv = torch.where(d == 0, 0.0, 1 / d)
        u = torch.trunc((x - lo) * inv + 0.5).clamp(0, top).to(torch.uint8)
        m16 = lo.to(torch.float16)
    else:
        big = x.gather(1, x.abs().argmax(1, keepdim=True))  # the first largest magnitude, with its sign
        d = big / -(bt.center)
        inv = torch.where(d == 0, 0.0, 1 / d)
        u = torch.trunc(x * inv + (bt.center + 0.5)).clamp(0, top).to(torch.uint8)
        m16 = None
    d16 = d.to(torch.float16)
    if not bool(torch.isfinite(d16).all()) or (m16 is not None and not bool(torch.isfinite(m16).all())):
        raise ValueError(f"quantize_blocks: {ggml_type} stores fp16 scales; this weight's range (max |w| "
                         f"{float(x.abs().max()):.3g}) overflows fp16: scale the weight down first")
    df = d16.float().reshape(n, -1)
    m = m16.float().reshape(n, -1) if m16 is not None else -bt.center * df
    return types.legacy_tensor(ggml_type, u.reshape(n, k), df, m, weight.dtype)


@dataclass(frozen=True)
class GGUFBlockConfig(QuantConfig):
    """Weight-only ggml block quantization (`quantize_blocks`): Q4_0 / Q5_0 / Q8_0 (symmetric) or Q4_1 / Q5_1
    (asymmetric: fp16 scale and min per 32 weights), exactly as llama.cpp quantizes them, for nn.Linear and
    nn.Embedding weights whose last dimension is a multiple of 32. The model then saves to GGUF
    (`affineq.gguf.save_model`) in that type bit for bit and runs on the `dense` kernels meanwhile.

        quantize_(model, GGUFBlockConfig("Q4_1"))
    """

    modules: ClassVar = (nn.Linear, nn.Embedding)
    ggml_type: str = "Q4_0"

    def __post_init__(self):
        super().__post_init__()
        check_choice("ggml_type", self.ggml_type, BLOCK_QUANT_TYPES)

    def _block_size(self, shape, module):
        _check_shape(tuple(shape), self.ggml_type)
        return (1, blocks.BLOCK)

    def weight_spec(self, weight: torch.Tensor, module: nn.Module):
        self._block_size(tuple(weight.shape), module)
        return types.legacy_spec(self.ggml_type, tuple(weight.shape), weight.dtype)

    def quantize_weight(self, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
        return quantize_blocks(weight, self.ggml_type)
