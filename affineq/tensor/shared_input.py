"""Several quantized linears on one input (q / k / v, gate / up) in one kernel call, without copying weights.

`shared_input_linear(weights, biases)` returns f(x) = [F.linear(x, w_i, b_i) for each i]. Where each weight alone
would run `affineq.lowbit_linear` (dense format, weight-only; the registry's choice for this x), f makes one
`affineq::lowbit_linear_multi` call: the same numbers as the separate calls, bit for bit, from one pool of GEMV
work items over all of the weights' panels (one library call and one thread fork instead of one per weight,
which a decode step of a 1B model pays ~100 times per token). Otherwise f calls F.linear per weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from affineq.tensor import fallback
from affineq.tensor.activation import computes_in_other_dtype
from affineq.tensor.kernel_registry import _select_cached, rows_bucket
from affineq.tensor.linear_kernels import lowbit_weight_args

__all__ = ["shared_input_linear"]

_KERNEL = "affineq.lowbit_linear"


def _weight_only_dense(w) -> bool:
    spec = getattr(w, "spec", None)
    return (spec is not None and spec.fmt == "dense" and spec.act_quant is None and not spec.transposed
            and "act_pre_scale" not in w._names and "act_out_scale" not in w._names and not w.requires_grad)


def shared_input_linear(weights: list, biases: list[torch.Tensor | None]
                        ) -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
    """f(x) -> [x @ w_i^T + b_i] for `dense` weight-only AffineQuantizedTensors [n_i, k] that share one
    configuration (bits, group size, code kind, qparam dtype, offset or not, compute dtype), as one
    `affineq::lowbit_linear_multi` call where each weight would run `affineq.lowbit_linear`; None when the
    weights cannot share a call (another format or configuration, activation quantization or transforms, a
    trainable weight)."""
    if len(weights) < 2 or len(biases) != len(weights) or not all(_weight_only_dense(w) for w in weights):
        return None
    args = [lowbit_weight_args(w) for w in weights]
    config = {(a[3], a[4], a[5], a[6], a[1].dtype, a[2] is None, w.spec.shape[1], w.spec.compute_dtype)
              for a, w in zip(args, weights, strict=True)}
    if len(config) != 1:
        return None
    packed, scales, offsets = [a[0] for a in args], [a[1] for a in args], [a[2] for a in args]
    bits, group_size, codes, code_offset = args[0][3], args[0][4], args[0][5], args[0][6]
    ns = [w.spec.shape[0] for w in weights]
    k = weights[0].spec.shape[1]

    @torch._dynamo.assume_constant_result
    def shares(bucket: int, dtype: torch.dtype) -> bool:
        """Whether each weight would run `affineq.lowbit_linear` on an x of this dtype and row bucket (the
        registry's preconditions read only these): run eagerly, a constant to torch.compile (the preconditions
        call what dynamo does not trace)."""
        x = torch.empty((1 << max(bucket - 1, 0), k), dtype=dtype)
        return not computes_in_other_dtype(x, weights[0]) and all(
            (kern := _select_cached(x, w)[0]) is not None and kern.name == _KERNEL for w in weights)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        if not shares(rows_bucket(x), x.dtype):
            return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        if not torch.compiler.is_compiling():  # dynamo cannot read the recorders' ContextVar; eager calls record
            for _ in weights:
                fallback.record(_KERNEL)
        out = torch.ops.affineq.lowbit_linear_multi(x, packed, scales, offsets, bits, group_size, ns, k, codes,
                                                    code_offset)
        return [o if b is None else o + b for o, b in zip(out.split(ns, -1), biases, strict=True)]

    return run
