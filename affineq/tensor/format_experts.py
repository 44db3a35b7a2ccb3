"""Expert weights [E, N, K] (mixture-of-experts layers) in any 2-D packing format: one 2-D tensor per expert,
stacked.

A 3-D spec (shape (E, N, K), block_size (1, b_n, b_k)) in a format that packs 2-D weights only (`dense`,
`int4_cpu`, `microexp`, the k-quants...) is held by `PerExpert(format)`: each stored tensor is the stack along a
new leading dim of that format's tensors for one expert quantized alone, so for every expert e

    tensors[name][e] == format.pack(codes[e], scale[e], zero_point[e], expert_spec(spec))[name]

(`dense`: qdata [E, N, ceil(K / 8) * bits], scale / offset [E, N, K / g]). Kernels read expert e's bytes as
they read a 2-D weight's, and slicing one expert (`w[e]`) is a view of each stored tensor. `plain` holds any
rank itself (codes [E, N, K], qparams [E, N, K / g] are already that stack), so it is not wrapped.

`format_of(spec)` is the packing format every caller asks for a spec: the named format, or its `PerExpert` for
a 3-D spec.
"""

from __future__ import annotations

import torch

from affineq.tensor.formats import PackingFormat, TensorLayout, Tensors, get_format
from affineq.tensor.spec import QuantSpec

__all__ = ["PerExpert", "expert_spec", "format_of", "stacked_spec"]


def expert_spec(spec: QuantSpec) -> QuantSpec:
    """The 2-D spec of one expert of a 3-D spec (E, N, K): shape (N, K), block_size without its leading 1."""
    return spec.replace(shape=spec.shape[1:], block_size=spec.block_size[1:], transposed=False)


def stacked_spec(spec: QuantSpec, num_experts: int, transposed: bool = False) -> QuantSpec:
    """The 3-D spec of `num_experts` experts of 2-D `spec` stacked along a new leading dim."""
    if len(spec.shape) != 2 or spec.transposed:
        raise ValueError(f"stacked_spec takes the untransposed 2-D spec of one expert, got shape {spec.shape} "
                         f"(transposed={spec.transposed})")
    return spec.replace(shape=(num_experts, *spec.shape), block_size=(1, *spec.block_size), transposed=transposed)


class PerExpert(PackingFormat):
    """A 2-D packing format applied to each expert of a 3-D spec; see the module docstring."""

    def __init__(self, inner: PackingFormat) -> None:
        self.inner = inner
        self.name = inner.name  # the spec keeps naming the 2-D format
        self.portable = inner.portable

    def check(self, spec):
        if len(spec.shape) != 3:
            return f"per-expert storage holds 3-D expert weights [E, N, K], got shape {spec.shape}"
        if spec.block_size[0] != 1:
            return (f"{self.name} stores expert weights one expert at a time: block_size must start with 1 (blocks "
                    f"inside one expert, e.g. (1, 1, 32)), got {spec.block_size}")
        why = self.inner.check(expert_spec(spec))
        return None if why is None else f"{why} (per expert of shape {spec.shape})"

    def layout(self, spec):
        e = spec.shape[0]
        return {name: TensorLayout(None if lay.shape is None else (e, *lay.shape), lay.dtypes, lay.optional)
                for name, lay in self.inner.layout(expert_spec(spec)).items()}

    def validate(self, t, spec):
        super().validate(t, spec)  # names, dtypes and [E, ...] shapes from `layout`
        if spec.shape[0]:
            self.inner.validate({k: v[0] for k, v in t.items()}, expert_spec(spec))  # the format's own checks

    def represent_qparams(self, scale, zero_point, spec):
        es = expert_spec(spec)
        pairs = [self.inner.represent_qparams(scale[e], None if zero_point is None else zero_point[e], es)
                 for e in range(spec.shape[0])]
        zps = [z for _, z in pairs]
        return (_stack([s for s, _ in pairs], scale),
                None if zero_point is None or zps[0] is None else _stack(zps, zero_point))

    def pack(self, codes, scale, zero_point, spec):
        es = expert_spec(spec)
        parts = [self.inner.pack(codes[e], scale[e], None if zero_point is None else zero_point[e], es)
                 for e in range(spec.shape[0])]
        if not parts:
            return {name: torch.empty(0, *(lay.shape or ()), dtype=lay.dtypes[0], device=codes.device)
                    for name, lay in self.inner.layout(es).items() if not lay.optional}
        return {name: torch.stack([p[name] for p in parts]) for name in parts[0]}

    def codes(self, t, spec):
        return self._per_expert(t, spec, lambda te, es: self.inner.codes(te, es))

    def qparams(self, t, spec):
        es = expert_spec(spec)
        pairs = [self.inner.qparams({k: v[e] for k, v in t.items()}, es) for e in range(spec.shape[0])]
        zps = [z for _, z in pairs]
        return torch.stack([s for s, _ in pairs]), None if not zps or zps[0] is None else torch.stack(zps)

    def dequantize(self, t, spec, output_dtype):
        return self._per_expert(t, spec, lambda te, es: self.inner.dequantize(te, es, output_dtype))

    def dequantize_rows(self, t, spec, rows, output_dtype):
        raise ValueError(f"row lookups (embedding) take a 2-D weight, not expert weights of shape {spec.shape}; "
                         "select one expert first (w[e])")

    def _per_expert(self, t: Tensors, spec: QuantSpec, fn) -> torch.Tensor:
        es = expert_spec(spec)
        return torch.stack([fn({k: v[e] for k, v in t.items()}, es) for e in range(spec.shape[0])])


def _stack(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.stack(parts) if parts else like


_WRAPPED: dict[str, PerExpert] = {}


def format_of(spec: QuantSpec) -> PackingFormat:
    """The packing format that holds `spec`: `get_format(spec.fmt)`, or its per-expert form for a 3-D spec in a
    format that packs 2-D weights only."""
    fmt = get_format(spec.fmt)
    if len(spec.shape) != 3 or fmt.any_rank:
        return fmt
    wrapped = _WRAPPED.get(fmt.name)
    if wrapped is None or wrapped.inner is not fmt:  # (a format registered again under its name)
        wrapped = _WRAPPED[fmt.name] = PerExpert(fmt)
    return wrapped
