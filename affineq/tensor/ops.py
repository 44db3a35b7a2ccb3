"""The op table of `AffineQuantizedTensor`: one small registered function per op.

Two tables: `TORCH_FUNCTION_TABLE` (torch-level functions caught before they decompose, e.g. F.linear)
and `DISPATCH_TABLE` (aten ops). An op in neither table runs on the dequantized tensors, announced once
by `kernels.announce_fallback`. Structural ops (view, slice, select, index, split, cat, permute, ...)
share one rule, `_blockwise`: apply the op to the codes and to per-element copies of the qparams, then
re-derive the block structure; they fail only when the result would cut blocks unevenly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from affineq.tensor import kernels
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.formats import get_format

aten = torch.ops.aten
AQT = AffineQuantizedTensor

TORCH_FUNCTION_TABLE: dict[Callable, Callable] = {}
DISPATCH_TABLE: dict[object, Callable] = {}


def implements_torch_function(*funcs: Callable):
    def register(fn):
        for f in funcs:
            TORCH_FUNCTION_TABLE[f] = fn
        return fn

    return register


def implements(*ops):
    """Register `fn(func, args, kwargs)` for aten overloads (or whole overload packets)."""

    def register(fn):
        for op in ops:
            DISPATCH_TABLE[op] = fn
        return fn

    return register


def torch_function(func, types, args, kwargs):
    fn = TORCH_FUNCTION_TABLE.get(func)
    if fn is not None:
        return fn(*args, **kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def torch_dispatch(func, types, args, kwargs):
    fn = DISPATCH_TABLE.get(func) or DISPATCH_TABLE.get(func.overloadpacket)
    if fn is not None:
        return fn(func, args, kwargs)
    return _dequantize_fallback(func, args, kwargs)


def _dequantize_fallback(func, args, kwargs):
    if func._schema.is_mutable:
        raise NotImplementedError(
            f"affineq: in-place op {func} on an AffineQuantizedTensor is not supported; "
            "call .dequantize() first and work on the float tensor"
        )
    fmts = {t.spec.fmt for t in _aqts(args, kwargs)}
    kernels.announce_fallback("/".join(sorted(fmts)), f"{func} is not in the op table", op=str(func))
    args, kwargs = tree_map_only(AQT, lambda t: t.dequantize(), (args, kwargs))
    return func(*args, **kwargs)


def _aqts(*trees) -> list[AQT]:
    found: list[AQT] = []
    tree_map_only(AQT, found.append, trees)
    return found


def _dq(t):
    return t.dequantize() if isinstance(t, AQT) else t


# -- linear and matmuls --------------------------------------------------------------------------------


@implements_torch_function(F.linear, torch._C._nn.linear)
def _linear(input, weight, bias=None):
    if isinstance(input, AQT) or not isinstance(weight, AQT) or isinstance(bias, AQT):
        return F.linear(_dq(input), _dq(weight), _dq(bias))
    return kernels.linear(input, weight, bias)


def _as_linear_weight(b: AQT) -> AQT:
    """The AQT W with x @ b == F.linear(x, W): b viewed transposed (no data movement)."""
    return b._replace(spec=b.spec.replace(transposed=not b.spec.transposed))


@implements(aten.mm.default)
def _mm(func, args, kwargs):
    a, b = args
    if isinstance(b, AQT) and not isinstance(a, AQT):
        return kernels.linear(a, _as_linear_weight(b))
    return func(_dq(a), _dq(b))


@implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if isinstance(b, AQT) and not isinstance(a, AQT) and not isinstance(bias, AQT) and beta == alpha == 1:
        return kernels.linear(a, _as_linear_weight(b), bias)
    return func(_dq(bias), _dq(a), _dq(b), **kwargs)


@implements(aten.bmm.default, aten.convolution.default, aten.embedding_dense_backward.default)
def _dequantize_then_compute(func, args, kwargs):
    """Ops whose best CPU implementation today is the float op on the dequantized weight."""
    args, kwargs = tree_map_only(AQT, lambda t: t.dequantize(), (args, kwargs))
    return func(*args, **kwargs)


@implements(aten.embedding.default)
def _embedding(func, args, kwargs):
    weight, indices = args[0], args[1]
    spec = weight.spec
    if spec.transposed or len(spec.shape) != 2 or spec.block_size[0] != 1:
        return func(weight.dequantize(), *args[1:], **kwargs)
    # Dequantize only the rows looked up.
    rows = get_format(spec.fmt).dequantize_rows(weight.tensors, spec, indices.reshape(-1), spec.dtype)
    return rows.view(*indices.shape, spec.shape[1])


# -- tensor bookkeeping ----------------------------------------------------------------------------------


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return args[0]._apply_to_tensors(func)


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._apply_to_tensors(lambda t: t.clone())


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(
            f"cannot cast an AffineQuantizedTensor to {dtype}: its logical dtype is floating point; "
            "use .codes() for the integer codes"
        )
    device = kwargs.get("device")
    out = t._apply_to_tensors(lambda x: x.to(device=device) if device is not None else x)
    return out if dtype is None else out._replace(spec=out.spec.replace(dtype=dtype))


def _stored_layout(t: AQT) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Name, dtype and shape of each stored tensor (the same spec may be stored with fp32 or bf16 qparams)."""
    return [(n, getattr(t, "_" + n).dtype, tuple(getattr(t, "_" + n).shape)) for n in t._names]


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args
    if isinstance(dst, AQT) and isinstance(src, AQT):
        if dst.spec != src.spec or _stored_layout(dst) != _stored_layout(src):
            raise ValueError(
                f"copy_: source {src!r} does not match destination {dst!r}. The checkpoint or tensor was "
                "quantized with a different config: quantize the model with the checkpoint's config, or load "
                "into a float model with model.load_state_dict(state_dict, assign=True)"
            )
        for name in dst._names:
            getattr(dst, "_" + name).copy_(getattr(src, "_" + name))
        return dst
    if isinstance(src, AQT):
        raise ValueError(
            f"copy_: cannot copy quantized {src!r} into a plain tensor; load quantized checkpoints with "
            "model.load_state_dict(state_dict, assign=True), or copy src.dequantize()"
        )
    raise ValueError(
        f"copy_: cannot copy a float tensor into quantized {dst!r}; quantize the model after loading float "
        "weights, or load a checkpoint saved from a model quantized with the same config"
    )


@implements(aten.equal.default)
def _equal(func, args, kwargs):
    a, b = args
    if not (isinstance(a, AQT) and isinstance(b, AQT)):
        return func(_dq(a), _dq(b))
    return a.spec == b.spec and a._names == b._names and all(
        torch.equal(getattr(a, "_" + n), getattr(b, "_" + n)) for n in a._names
    )


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return args[0]._qdata.is_pinned()


# -- structural ops: transpose flag for 2-D, `_blockwise` for the rest ------------------------------------


@implements(aten.t.default)
def _t(func, args, kwargs):
    return _transpose2d(args[0])


@implements(aten.transpose.int)
def _transpose(func, args, kwargs):
    t, d0, d1 = args
    if t.dim() == 2 and d0 % 2 != d1 % 2:
        return _transpose2d(t)
    return t if d0 % t.dim() == d1 % t.dim() else _blockwise(func, [t], args[1:], kwargs)


@implements(aten.permute.default)
def _permute(func, args, kwargs):
    t, dims = args
    if t.dim() == 2 and [d % 2 for d in dims] == [1, 0]:
        return _transpose2d(t)
    return _blockwise(func, [t], args[1:], kwargs)


def _transpose2d(t: AQT) -> AQT:
    return t._replace(spec=t.spec.replace(transposed=not t.spec.transposed))


@implements(
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
    aten.select.int, aten.index.Tensor, aten.unsqueeze.default, aten.squeeze.dim,
    aten.expand.default, aten.flatten.using_ints, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int,
)
def _structural(func, args, kwargs):
    return _blockwise(func, [args[0]], args[1:], kwargs)


@implements(aten.cat.default)
def _cat(func, args, kwargs):
    tensors = list(args[0])
    if not all(isinstance(t, AQT) for t in tensors):
        return func([_dq(t) for t in tensors], *args[1:], **kwargs)
    base = tensors[0].spec
    for t in tensors[1:]:
        if _family(t.spec) != _family(base):
            raise ValueError(
                f"cat: AffineQuantizedTensors must share target dtype, range, domain and format; got "
                f"{tensors[0]!r} and {t!r}. Dequantize them first."
            )
    return _blockwise(func, tensors, args[1:], kwargs, listwise=True)


def _family(spec):
    return (spec.target_dtype, spec.quant_min, spec.quant_max, spec.zero_point_domain, spec.fmt, spec.dtype)


def _expand(q: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """Per-element copy of a per-block tensor: q[i // b0, j // b1, ...]."""
    for d, b in enumerate(block):
        if b > 1:
            q = q.repeat_interleave(b, dim=d)
    return q


def _logical_parts(t: AQT) -> dict[str, torch.Tensor]:
    """codes, per-element scale / zero point and block ids, all in the logical (user-visible) layout."""
    spec = t.spec
    scale, zp = t.scale, t.zero_point
    ids = torch.arange(scale.numel(), device=scale.device).view(spec.num_blocks)
    parts = {"codes": t.codes(), "scale": scale, "ids": ids}
    if zp is not None:
        parts["zero_point"] = zp
    for name in ("scale", "zero_point", "ids"):
        if name in parts:
            parts[name] = _expand(parts[name].reshape(spec.num_blocks), spec.block_size)
    if spec.transposed:
        parts = {k: v.t() for k, v in parts.items()}
    return parts


def _infer_block(ids: torch.Tensor) -> tuple[int, ...] | None:
    """The block size under which `ids` is constant on each block and distinct across blocks, if any."""
    block = []
    for d in range(ids.dim()):
        line = ids[tuple(slice(None) if e == d else 0 for e in range(ids.dim()))]
        change = torch.nonzero(line[1:] != line[:-1])
        b = int(change[0]) + 1 if change.numel() else ids.shape[d]
        if ids.shape[d] % b:
            return None
        block.append(b)
    corners = ids[tuple(slice(None, None, b) for b in block)]
    if not torch.equal(_expand(corners, tuple(block)), ids) or corners.unique().numel() != corners.numel():
        return None
    return tuple(block)


def _blockwise(func, tensors: list[AQT], rest, kwargs, listwise: bool = False):
    """Apply a structural op to codes and per-element qparams, then rebuild quantized tensor(s)."""
    base = tensors[0]
    parts = [_logical_parts(t) for t in tensors]
    offset = 0
    for p in parts:  # block ids must stay distinct across cat inputs
        p["ids"] = p["ids"] + offset
        offset += int(p["ids"].max()) + 1
    names = parts[0].keys()
    if listwise:
        out = {n: func([p[n] for p in parts], *rest, **kwargs) for n in names}
    else:
        out = {n: func(parts[0][n], *rest, **kwargs) for n in names}
    if isinstance(out["codes"], (list, tuple)):
        return [_rebuild(base, {n: out[n][i] for n in names}, func) for i in range(len(out["codes"]))]
    return _rebuild(base, out, func)


def _rebuild(base: AQT, p: dict[str, torch.Tensor], func) -> AQT:
    spec = base.spec
    if p["codes"].dim() == 0:
        raise ValueError(f"{func}: a 0-d result of a quantized tensor is not supported; dequantize() first")
    block = _infer_block(p["ids"])
    if block is None:
        raise ValueError(
            f"{func} on {base!r} would cut its quantization blocks unevenly (block_size {spec.block_size}); "
            "slice, index and reshape along whole blocks, or call .dequantize() first"
        )
    corner = tuple(slice(None, None, b) for b in block)
    zp = p["zero_point"][corner] if "zero_point" in p else None
    new_spec = spec.replace(shape=tuple(p["codes"].shape), block_size=block, transposed=False)
    fmt = spec.fmt if get_format(spec.fmt).check(new_spec) is None else "plain"
    return AQT.from_codes(
        p["codes"].contiguous(), p["scale"][corner], zp, block, spec.target_dtype, spec.quant_min,
        spec.quant_max, spec.zero_point_domain, dtype=spec.dtype, packing_format=fmt,
        mapping_type=spec.mapping_type, act_quant=spec.act_quant,
    )
