"""gpt-oss MXFP4 expert checkpoints <-> 3-D MXFP4 `AffineQuantizedTensor`s, code for code (no requantization).

gpt-oss ships each experts weight as two tensors (`<module>.gate_up_proj_blocks`, `..._scales`; the same for
`down_proj`):

| tensor   | shape              | content                                                                     |
|----------|--------------------|-----------------------------------------------------------------------------|
| blocks   | [E, N, K / 32, 16] | uint8, two fp4 e2m1 codes per byte: element 2j in the low nibble, 2j+1 high |
| scales   | [E, N, K / 32]     | uint8 E8M0 exponents: each block of 32 along K is scaled by 2**(s - 127)     |

with N the output and K the input dim of each expert (gate_up: N = 2I interleaved gate/up, K = H), while the
model's parameter is [E, K, N] (transformers' `is_transposed`). That is exactly affineq's MXFP4 in `dense` per
expert (`MXWeightOnlyConfig("fp4_e2m1")`: fp4_e2m1 codes, e8m0 scale bytes, blocks (1, 1, 32)) stored [E, N, K]
with the transposed flag: `mxfp4_from_blocks` repacks the nibbles into the dense bit layout and keeps the scale
bytes; `mxfp4_to_blocks` is its inverse. `load_mxfp4_experts` puts a checkpoint's expert weights into a model.

Loading through `from_pretrained` alone: transformers reads such a checkpoint with its own MXFP4 quantizer
(quantization_config quant_method "mxfp4"), which on CPU dequantizes the experts to bf16; affineq's quantizer
handles quant_method "affineq" checkpoints only. So load the model with transformers (its other weights), then
call `load_mxfp4_experts(model, checkpoint_dir)`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from affineq.bitpack import pack_codes, unpack_codes
from affineq.configs import MXWeightOnlyConfig
from affineq.expert_weights import experts_transposed, is_expert_module
from affineq.experts import use_affineq_experts
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.format_experts import stacked_spec

__all__ = ["load_mxfp4_experts", "mxfp4_from_blocks", "mxfp4_spec", "mxfp4_to_blocks"]

_BLOCK = 32
_MXFP4 = MXWeightOnlyConfig("fp4_e2m1", packing_format="dense")


def mxfp4_spec(num_experts: int, n: int, k: int, dtype: torch.dtype, transposed: bool = True):
    """The spec of `MXWeightOnlyConfig("fp4_e2m1")` expert weights [E, N, K] (transposed: viewed [E, K, N])."""
    proxy = nn.Linear(k, n, bias=False, device="meta", dtype=dtype)
    one = _MXFP4.weight_spec(torch.empty(n, k, dtype=dtype, device="meta"), proxy)
    return stacked_spec(one, num_experts, transposed)


def _check_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 4 or \
            blocks.shape[-1] != _BLOCK // 2:
        raise ValueError(f"blocks must be uint8 [E, N, K/32, 16] (gpt-oss's *_blocks), got "
                         f"{getattr(blocks, 'dtype', type(blocks))} {tuple(getattr(blocks, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(
            blocks.shape[:-1]):
        raise ValueError(f"scales must be uint8 {tuple(blocks.shape[:-1])} (one E8M0 byte per block of blocks), got "
                         f"{getattr(scales, 'dtype', type(scales))} {tuple(getattr(scales, 'shape', ()))}")


def mxfp4_from_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      transposed: bool = True) -> AffineQuantizedTensor:
    """The 3-D MXFP4 AffineQuantizedTensor holding gpt-oss's blocks [E, N, K/32, 16] and scales [E, N, K/32]
    exactly (the same fp4 codes and E8M0 bytes): logical dtype `dtype`, shape [E, K, N] when `transposed` (the
    gpt-oss parameter layout), else [E, N, K]."""
    _check_blocks(blocks, scales)
    e, n, g, _ = blocks.shape
    k = g * _BLOCK
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(e, n, k)  # element 2j low nibble, 2j+1 high
    spec = mxfp4_spec(e, n, k, dtype, transposed)
    tensors = {"qdata": torch.stack([pack_codes(codes[i], 4) for i in range(e)]) if e else
               torch.empty(0, n, k // 2, dtype=torch.uint8),
               "scale": scales.contiguous()}
    return AffineQuantizedTensor.from_tensors(tensors, spec)


def mxfp4_to_blocks(w: AffineQuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, N, K/32, 16], scales [E, N, K/32]) of 3-D MXFP4 expert weights (`MXWeightOnlyConfig`
    ("fp4_e2m1") in `dense`, either layout): the inverse of `mxfp4_from_blocks`."""
    if not isinstance(w, AffineQuantizedTensor) or len(w.spec.shape) != 3:
        raise ValueError(f"mxfp4_to_blocks takes 3-D MXFP4 expert weights, got {w!r}")
    e, n, k = w.spec.shape
    if w.spec.replace(transposed=True) != mxfp4_spec(e, n, k, w.spec.dtype, True):
        raise ValueError(f"mxfp4_to_blocks: {w!r} is not MXFP4 (fp4_e2m1 codes, e8m0 scales, blocks of 32, 'dense'); "
                         "quantize the experts with MXWeightOnlyConfig('fp4_e2m1', packing_format='dense')")
    codes = torch.stack([unpack_codes(w._qdata[i], 4, n, k) for i in range(e)]) if e else \
        torch.empty(0, n, k, dtype=torch.uint8)
    pairs = codes.reshape(e, n, k // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(e, n, k // _BLOCK, _BLOCK // 2)
    return blocks.contiguous(), w._scale.clone()


def _checkpoint_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"load_mxfp4_experts: {str(path)!r} is neither a .safetensors file nor a directory holding "
                         "some; pass the gpt-oss checkpoint directory")
    return files


def load_mxfp4_experts(model: nn.Module, checkpoint: str | os.PathLike) -> list[str]:
    """Set every expert weight of `model` that `checkpoint` (a safetensors file or a directory of them) stores as
    gpt-oss MXFP4 (`<param>_blocks` / `<param>_scales`) to the 3-D MXFP4 AffineQuantizedTensor holding those codes,
    and select affineq's experts forward. Returns the parameter names set. All-or-nothing: every tensor is read
    and checked against its parameter's shape before any parameter changes (ValueError names a mismatch)."""
    from safetensors import safe_open

    modules = dict(model.named_modules())
    new: dict[str, tuple[nn.Module, str, AffineQuantizedTensor]] = {}
    for f in _checkpoint_files(checkpoint):
        with safe_open(str(f), framework="pt") as sf:
            keys = set(sf.keys())
            for key in sorted(keys):
                if not key.endswith("_blocks") or key.removesuffix("_blocks") + "_scales" not in keys:
                    continue
                fqn, _, pname = key.removesuffix("_blocks").rpartition(".")
                module = modules.get(fqn)
                if module is None or not is_expert_module(module) or pname not in module._parameters:
                    continue
                old = module._parameters[pname]
                q = mxfp4_from_blocks(sf.get_tensor(key), sf.get_tensor(key.removesuffix("_blocks") + "_scales"),
                                      old.dtype, experts_transposed(module))
                if tuple(q.shape) != tuple(old.shape):
                    raise ValueError(f"load_mxfp4_experts: {key} holds weights of shape {tuple(q.shape)}, but "
                                     f"{fqn}.{pname} is {tuple(old.shape)}; load the checkpoint of this model's config")
                new[f"{fqn}.{pname}"] = (module, pname, q)
    for module, pname, q in new.values():
        module._parameters[pname] = nn.Parameter(q, requires_grad=False)
    use_affineq_experts(model)
    return sorted(new)
