"""The linear kernel of the k-quant formats `q2_k` .. `q6_k`: `torch.ops.affineq.kquant_linear` (cpp/kquant.cpp).

    kquant_linear(x [..., K] float32 / bfloat16 / float16, blocks uint8 [N, K / 256 * type_size], kind 2..6, N, K)
        -> [..., N] in x.dtype
    kquant_dequantize(blocks, kind, N, K) -> float32 [N, K]

`blocks` are the GGUF tensor's super-blocks as `format_kquant` stores them (`qdata`), `kind` the digit of the
format name (4 for q4_k). The C++ kernel decodes each super-block once per call and forms every weight exactly
as `dequantize` does (fp32; `kquant_dequantize` is bit-identical to it), then sums fp32 products: at one to four
rows of x (q6_k: one) a fused GEMV over the packed bytes, up to 256 rows a GEMM on fp32 tiles of the weight
decoded into L1, above that fp32 weight blocks multiplied by torch's GEMM. So the
result is F.linear(x.float(), w.dequantize()) up to the order of the fp32 sums, per output
|y - y_exact| <= K * 2**-24 * sum_k |x_k| |w_k| (recursive summation's bound, any order; tests/test_kquant.py
asserts it), then the cast to x's dtype.

Without the C++ library both ops run the same math in PyTorch (`kquant_linear_reference`), so a graph compiled
while it was available still runs; the fake impls give torch.compile the output shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from affineq import cpp as _cpp
from affineq.tensor.format_kquant import KQUANT_FORMATS, KQUANT_TYPES, SUPER_BLOCK

__all__ = ["kind_of", "kquant_dequantize_reference", "kquant_linear_check", "kquant_linear_reference",
           "kquant_linear_run"]

_FORMAT_OF_KIND = {int(name[1]): name for name in KQUANT_TYPES}


def kind_of(fmt: str) -> int:
    """The `kind` argument of the ops for format `fmt` ("q4_k" -> 4)."""
    return int(fmt[1])


def _check(blocks: torch.Tensor, kind: int, n: int, k: int) -> str:
    """The format name of `kind` after the C++ op's checks (ValueError naming the argument)."""
    if kind not in _FORMAT_OF_KIND:
        raise ValueError(f"kquant: kind must be one of {sorted(_FORMAT_OF_KIND)} (q2_k .. q6_k), got {kind}")
    if n < 0 or k <= 0 or k % SUPER_BLOCK:
        raise ValueError(f"kquant: need n >= 0 and k a positive multiple of {SUPER_BLOCK}, got n={n}, k={k}")
    fmt = _FORMAT_OF_KIND[kind]
    nbytes = n * (k // SUPER_BLOCK) * KQUANT_TYPES[fmt].type_size
    if blocks.dtype != torch.uint8 or blocks.numel() != nbytes:
        raise ValueError(f"kquant: blocks must be uint8 with n * k / 256 * {KQUANT_TYPES[fmt].type_size} = {nbytes} "
                         f"bytes, got {blocks.dtype} with {blocks.numel()}")
    return fmt


def kquant_dequantize_reference(blocks: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """float32 W [n, k] of k-quant super-blocks, in PyTorch (`format_kquant`'s dequantize)."""
    fmt = _check(blocks, kind, n, k)
    return KQUANT_FORMATS[fmt]._values(blocks.reshape(n, -1), n, torch.float32)


def kquant_linear_reference(x: torch.Tensor, blocks: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """F.linear(x.float(), W) cast to x.dtype, W the dequantized super-blocks."""
    _check(blocks, kind, n, k)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"kquant_linear: x must be float32 / bfloat16 / float16 of shape [..., k={k}], got "
                         f"{x.dtype} {tuple(x.shape)}")
    return F.linear(x.float(), kquant_dequantize_reference(blocks, kind, n, k)).to(x.dtype)


_lib = torch.library.Library("affineq", "FRAGMENT")
_lib.define("kquant_linear(Tensor x, Tensor blocks, int kind, int n, int k) -> Tensor")
_lib.define("kquant_dequantize(Tensor blocks, int kind, int n, int k) -> Tensor")


@torch.library.register_fake("affineq::kquant_linear", lib=_lib)
def _kquant_linear_fake(x, blocks, kind, n, k):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::kquant_dequantize", lib=_lib)
def _kquant_dequantize_fake(blocks, kind, n, k):
    return blocks.new_empty((n, k), dtype=torch.float32)


# The PyTorch impls run only while no C++ CPU kernel is registered (the library unavailable).
_lib.impl("kquant_linear", kquant_linear_reference, "CompositeExplicitAutograd")
_lib.impl("kquant_dequantize", kquant_dequantize_reference, "CompositeExplicitAutograd")


def kquant_linear_check(x: torch.Tensor, w) -> str | None:
    """Why `affineq.kquant_linear` cannot run x @ w.T (a sentence), or None."""
    if x.device.type != "cpu":
        return f"input is on {x.device.type}, kernel runs on cpu"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"input dtype {x.dtype} is not fp32/bf16/fp16"
    if w.spec.act_quant is not None:
        return "act_quant is set (the k-quant kernel is weight-only)"
    if w.spec.transposed:
        return "the weight is a transposed view"
    if not _cpp.is_available():
        return f"the affineq C++ kernels are unavailable ({_cpp.unavailable_reason()})"
    return None


def kquant_linear_run(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = w.spec.shape
    out = torch.ops.affineq.kquant_linear(x, w._qdata, kind_of(w.spec.fmt), n, k)
    return out if bias is None else out + bias
