"""Grouped low-bit linear over 3-D expert weights: ``torch.ops.affineq.grouped_lowbit_linear`` and its reference.

Mixture-of-experts layers multiply each routed (token, expert) pair by that expert's weight. With the experts'
weights stored as one 3-D dense-format tensor (``affineq.cpp`` module docstring for the per-expert math and the
packed layout; a leading expert dim E on every array)::

    x          [T, K]   float32 / bfloat16 / float16, one row per (token, chosen expert) pair
    expert_ids [T]      int64 in [0, E), any order
    packed     [E, N, ceil(K / 8) * bits]  uint8, expert e's pack_codes output at packed[e]
    scale      [E, N, K / group_size]      float32 / bfloat16 (or uint8 e8m0 exponent bytes)
    offset     [E, N, K / group_size] or None

    y[t] = lowbit_linear(x[t], packed[e], scale[e], offset[e], ...)   with e = expert_ids[t]   -> [T, N], x.dtype

The C++ kernel (cpp/grouped.cpp) buckets the rows by expert (counting sort), gathers each expert's rows and runs
the same per-expert kernel ``lowbit_linear`` runs on them, so every row equals ``lowbit_linear`` on that
expert's rows bit for bit; only experts with rows are read (batch-1 decode reads the top-k experts' bytes).
``grouped_lowbit_linear_reference`` computes the same per expert in PyTorch (``lowbit_linear_reference``).
The op has no autograd kernel: expert weights are frozen and this is an inference kernel.
"""

from __future__ import annotations

import torch

from affineq.bitpack import packed_nbytes

from . import _check_args, is_available, lowbit_linear_reference, unavailable_reason

__all__ = ["grouped_lowbit_linear_reference", "check_grouped_args"]

_OP = "affineq::grouped_lowbit_linear"


def check_grouped_args(x: torch.Tensor, expert_ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       offset: torch.Tensor | None, bits: int, group_size: int, n: int, k: int, codes: int = 0,
                       code_offset: int = 0) -> None:
    """ValueError naming the argument unless the shapes and dtypes fit (the C++ binding's rules, less the range
    of expert_ids, which needs the data: the reference and the kernel check it)."""
    if x.dim() != 2:
        raise ValueError(f"grouped_lowbit_linear: x must be 2-D [T, k={k}], got shape {tuple(x.shape)}")
    if expert_ids.dim() != 1 or expert_ids.dtype != torch.int64 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_lowbit_linear: expert_ids must be int64 of shape [T] = [{x.shape[0]}] (one per "
                         f"row of x), got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if packed.dim() != 3 or packed.dtype != torch.uint8:
        raise ValueError(f"grouped_lowbit_linear: packed must be uint8 [E, n, packed bytes per row], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    e = packed.shape[0]
    for name, t in (("scale", scale), ("offset", offset)):
        if t is not None and (t.dim() != 3 or t.shape[0] != e):
            raise ValueError(f"grouped_lowbit_linear: {name} must be 3-D [E={e}, n, k // group_size], got shape "
                             f"{tuple(t.shape)}")
    if e == 0:
        raise ValueError("grouped_lowbit_linear: packed holds no experts (E = 0)")
    if packed[0].numel() != packed_nbytes(n, k, bits):
        raise ValueError(f"grouped_lowbit_linear: packed[e] must hold {packed_nbytes(n, k, bits)} bytes (pack_codes "
                         f"of [n={n}, k={k}] at bits={bits}), got {packed[0].numel()}")
    _check_args(x, packed[0], scale[0], None if offset is None else offset[0], bits, group_size, n, k, codes,
                code_offset)


def _check_ids_range(expert_ids: torch.Tensor, num_experts: int) -> None:
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise ValueError(f"grouped_lowbit_linear: expert_ids must be in [0, {num_experts}), got values in "
                         f"[{int(expert_ids.min())}, {int(expert_ids.max())}]")


def grouped_lowbit_linear_reference(x: torch.Tensor, expert_ids: torch.Tensor, packed: torch.Tensor,
                                    scale: torch.Tensor, offset: torch.Tensor | None, bits: int, group_size: int,
                                    n: int, k: int, codes: int = 0, code_offset: int = 0) -> torch.Tensor:
    """Pure-PyTorch ``grouped_lowbit_linear``: per expert with rows, ``lowbit_linear_reference`` on its rows
    (only those experts are dequantized). Returns [T, n] in x.dtype."""
    check_grouped_args(x, expert_ids, packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    _check_ids_range(expert_ids, packed.shape[0])
    y = x.new_empty((x.shape[0], n))
    ids = expert_ids.to(x.device)
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(1)
        y[rows] = lowbit_linear_reference(x[rows], packed[e], scale[e], None if offset is None else offset[e],
                                          bits, group_size, n, k, codes, code_offset)
    return y


# --------------------------------------------------------------------------------------------------------
# The op: schema and fake impl here; the CPU kernel comes from cpp/grouped.cpp when the library loads (no
# autograd kernel). The CompositeExplicitAutograd impl runs until then (and on other devices: refused).
# --------------------------------------------------------------------------------------------------------
_lib = torch.library.Library("affineq", "FRAGMENT")
_lib.define(
    "grouped_lowbit_linear(Tensor x, Tensor expert_ids, Tensor packed, Tensor scale, Tensor? offset, int bits,"
    " int group_size, int n, int k, int codes=0, int code_offset=0) -> Tensor"
)


@torch.library.register_fake(_OP, lib=_lib)
def _grouped_lowbit_linear_fake(x, expert_ids, packed, scale, offset, bits, group_size, n, k, codes=0,
                                code_offset=0):
    check_grouped_args(x, expert_ids, packed, scale, offset, bits, group_size, n, k, codes, code_offset)
    return x.new_empty((x.shape[0], n))


def _grouped_lowbit_linear_fallback(x, expert_ids, packed, scale, offset, bits, group_size, n, k, codes=0,
                                    code_offset=0):
    # Runs only while no C++ CPU kernel is registered: load it, then dispatch again to reach it.
    if x.device.type != "cpu":
        raise NotImplementedError(f"{_OP} only supports CPU tensors, got x on {x.device}")
    if is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "CPU"):
        return torch.ops.affineq.grouped_lowbit_linear(x, expert_ids, packed, scale, offset, bits, group_size, n, k,
                                                       codes, code_offset)
    # A graph compiled while the kernels were available, run after they were disabled: the same numbers in
    # PyTorch, said as every dequantize fallback does.
    from affineq.tensor.fallback import announce_fallback

    why = unavailable_reason() or f"the loaded library registered no CPU kernel for {_OP}"
    announce_fallback("dense", f"the affineq C++ kernels are unavailable ({why})", op="grouped_linear")
    return grouped_lowbit_linear_reference(x, expert_ids, packed, scale, offset, bits, group_size, n, k, codes,
                                           code_offset)


_lib.impl("grouped_lowbit_linear", _grouped_lowbit_linear_fallback, "CompositeExplicitAutograd")
