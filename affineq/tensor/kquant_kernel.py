"""The linear kernel of the k-quant formats `q2_k` .. `q6_k`: `torch.ops.affineq.kquant_linear` (cpp/kquant.cpp).

    kquant_linear(x [..., K] float32 / bfloat16 / float16, qdata uint8 [N, K / 8 * bits], scales uint8 [N, K / g],
                  mins uint8 [N, K / g] or None, d float16 [N, K / 256 * (1 or 2)], kind 2..6, N, K)
        -> [..., N] in x.dtype

`qdata`, `scales`, `mins` (q4_k / q5_k only) and `d` are the stored tensors of `format_kquant` (codes packed as
`dense` packs them, the sub-block scale bytes, the min bytes, the super-blocks' d and dmin), `kind` the digit of
the format name (4 for q4_k). The C++ op runs the dense kernels (`affineq.lowbit_linear`'s GEMV, tile GEMMs and
dequantize + GEMM driver) with the per-sub-block scale d * sc_j and offset decoded from them, exactly; so the
result is F.linear(x.float(), w.dequantize()) up to the order and rounding of the fp32 sums, as for the dense
formats (tests/test_kquant.py asserts a bound), then the cast to x's dtype; a bf16 x may take the dense formats'
bf16 dot-product path on the weight rounded to bf16.

Without the C++ library the op runs the same math in PyTorch (`kquant_linear_reference`), so a graph compiled
while it was available still runs; the fake impl gives torch.compile the output shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from affineq import cpp as _cpp
from affineq.tensor.format_kquant import KQUANT_FORMATS, KQUANT_TYPES, SUPER_BLOCK

__all__ = ["kind_of", "kquant_linear_check", "kquant_linear_reference", "kquant_linear_run"]

_FORMAT_OF_KIND = {int(name[1]): name for name in KQUANT_TYPES}


def kind_of(fmt: str) -> int:
    """The `kind` argument of the op for format `fmt` ("q4_k" -> 4)."""
    return int(fmt[1])


def kquant_linear_reference(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                            d: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """F.linear(x.float(), W) cast to x.dtype, W the dequantized weight (ValueError naming a bad argument)."""
    if kind not in _FORMAT_OF_KIND:
        raise ValueError(f"kquant_linear: kind must be one of {sorted(_FORMAT_OF_KIND)} (q2_k .. q6_k), got {kind}")
    if n < 0 or k <= 0 or k % SUPER_BLOCK:
        raise ValueError(f"kquant_linear: need n >= 0 and k a positive multiple of {SUPER_BLOCK}, got n={n}, k={k}")
    fmt = KQUANT_FORMATS[_FORMAT_OF_KIND[kind]]
    t = fmt.kind
    if t.has_mins != (mins is not None):
        raise ValueError(f"kquant_linear: mins must be given for q4_k / q5_k (kind 4, 5) and None otherwise, got "
                         f"kind={kind}")
    want = {"qdata": (qdata, torch.uint8, n * k // 8 * t.bits), "scales": (scales, torch.uint8, n * k // t.group),
            "mins": (mins, torch.uint8, n * k // t.group), "d": (d, torch.float16, n * k // SUPER_BLOCK * t.supers)}
    for name, (v, dtype, numel) in want.items():
        if v is not None and (v.dtype != dtype or v.numel() != numel):
            raise ValueError(f"kquant_linear: {name} must be {dtype} with {numel} elements, got {v.dtype} with "
                             f"{v.numel()}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"kquant_linear: x must be float32 / bfloat16 / float16 of shape [..., k={k}], got "
                         f"{x.dtype} {tuple(x.shape)}")
    qp = {"scales": scales.reshape(n, -1), "d": d.reshape(n, -1)}
    if mins is not None:
        qp["mins"] = mins.reshape(n, -1)
    w = fmt.values(fmt.unpacked_codes(qdata.reshape(n, -1), n, k), qp, torch.float32)
    return F.linear(x.float(), w).to(x.dtype)


_lib = torch.library.Library("affineq", "FRAGMENT")
_lib.define("kquant_linear(Tensor x, Tensor qdata, Tensor scales, Tensor? mins, Tensor d, int kind, int n, int k)"
            " -> Tensor")


# kquant_linear + bias (bias [N] in x.dtype) bit for bit, the bias added as the kernels store y. Inference only.
_lib.define("kquant_linear_biased(Tensor x, Tensor qdata, Tensor scales, Tensor? mins, Tensor d, int kind, int n,"
            " int k, Tensor bias) -> Tensor")


@torch.library.register_fake("affineq::kquant_linear", lib=_lib)
def _kquant_linear_fake(x, qdata, scales, mins, d, kind, n, k):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("affineq::kquant_linear_biased", lib=_lib)
def _kquant_linear_biased_fake(x, qdata, scales, mins, d, kind, n, k, bias):
    return x.new_empty((*x.shape[:-1], n))


def _kquant_linear_biased_reference(x, qdata, scales, mins, d, kind, n, k, bias):
    return kquant_linear_reference(x, qdata, scales, mins, d, kind, n, k) + bias


# The PyTorch impls run only while no C++ CPU kernel is registered (the library unavailable).
_lib.impl("kquant_linear", kquant_linear_reference, "CompositeExplicitAutograd")
_lib.impl("kquant_linear_biased", _kquant_linear_biased_reference, "CompositeExplicitAutograd")


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
    args = (x, w._qdata, w._scales, getattr(w, "_mins", None), w._d, kind_of(w.spec.fmt), n, k)
    if bias is not None and bias.dtype == x.dtype and not (torch.is_grad_enabled() and bias.requires_grad):
        return torch.ops.affineq.kquant_linear_biased(*args, bias)  # added as y is stored, no pass of its own
    out = torch.ops.affineq.kquant_linear(*args)
    return out if bias is None else out + bias
