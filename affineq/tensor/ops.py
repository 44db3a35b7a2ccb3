"""The ops of `AffineQuantizedTensor`: one small registered function per op, `fn(func, args, kwargs)`.

Registered with `AffineQuantizedTensor.implements(...)` into the class's two tables (torch functions caught
before they decompose, e.g. F.linear; aten ops); lookup and the dequantize fallback for ops in neither
table live in `affineq.tensor.dispatch`. Structural ops (view, slice, select, index, split, cat, permute,
...) share one rule, `_blockwise`: apply the op to the codes and to per-element copies of the qparams, then
re-derive the block structure; they fail only when the result would cut blocks unevenly. Activation
tensors follow the input-channel dim (`act_pre_scale`) or stay as they are (per-tensor qparams).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from affineq.tensor import kernel_registry
from affineq.tensor.activation import fake_quantize_activation, finish_output
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.dispatch import check_frozen, guard_frozen_output
from affineq.tensor.fallback import announce_fallback
from affineq.tensor.format_experts import format_of

aten = torch.ops.aten
AQT = AffineQuantizedTensor
implements = AQT.implements


def _dq(t):
    return t.dequantize() if isinstance(t, AQT) else t


# -- linear and matmuls --------------------------------------------------------------------------------


@implements(F.linear, torch._C._nn.linear, aten.linear.default)  # aten: what DTensor hands its local shards
def _linear(func, args, kwargs):
    if kwargs:
        named = {**dict(zip(("input", "weight", "bias"), args, strict=False)), **kwargs}
        input, weight, bias = named["input"], named["weight"], named.get("bias")
    else:
        input, weight, bias = args if len(args) == 3 else (*args, None)
    if isinstance(input, AQT) or not isinstance(weight, AQT) or isinstance(bias, AQT):
        return F.linear(_dq(input), _dq(weight), _dq(bias))
    return kernel_registry.linear(input, weight, bias)


def _as_linear_weight(b: AQT) -> AQT:
    """The AQT W with x @ b == F.linear(x, W): b viewed transposed (no data movement)."""
    return b._replace(spec=b.spec.replace(transposed=not b.spec.transposed))


@implements(aten.mm.default)
def _mm(func, args, kwargs):
    a, b = args
    if isinstance(b, AQT) and not isinstance(a, AQT):
        return kernel_registry.linear(a, _as_linear_weight(b))
    return func(_dq(a), _dq(b))


@implements(aten.matmul.default)
def _matmul(func, args, kwargs):
    """x @ W.t() with W quantized (DTensor runs a sharded linear as aten.matmul on its local shards)."""
    a, b = args
    if isinstance(b, AQT) and not isinstance(a, AQT) and b.dim() == 2 and a.dim() >= 2:
        return kernel_registry.linear(a, _as_linear_weight(b))
    return func(_dq(a), _dq(b))


@implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if isinstance(b, AQT) and not isinstance(a, AQT) and not isinstance(bias, AQT) and beta == alpha == 1:
        return kernel_registry.linear(a, _as_linear_weight(b), bias)
    return func(_dq(bias), _dq(a), _dq(b), **kwargs)


@implements(aten.convolution.default)
def _convolution(func, args, kwargs):
    """No packed convolution kernel yet: the float conv on the dequantized weight, announced once per format.
    A weight with activation quantization (e.g. static int8 from calibration) fake-quantizes the input first,
    so the numbers are those of a quantized conv."""
    input, weight = args[0], args[1]
    if isinstance(weight, AQT) and not isinstance(input, AQT):  # (frozen check: _dequantize_then_compute)
        announce_fallback(weight.spec.fmt, "no packed convolution kernel", op="conv")
        aq = weight.spec.act_quant
        if aq is not None:  # channels last, so that a "token" is one pixel's channels (as a linear's row)
            x = fake_quantize_activation(input.movedim(1, -1), aq, weight).movedim(-1, 1)
            args = (x, *args[1:])
        out = _dequantize_then_compute(func, args, kwargs)
        return finish_output(out, weight)  # per-tensor qparams: the layout of `out` does not matter
    return _dequantize_then_compute(func, args, kwargs)


@implements(aten.bmm.default, aten.embedding_dense_backward.default)
def _dequantize_then_compute(func, args, kwargs):
    """Ops whose best CPU implementation today is the float op on the dequantized weight."""
    tree_map_only(AQT, check_frozen, (args, kwargs))
    args, kwargs = tree_map_only(AQT, lambda t: t.dequantize(), (args, kwargs))
    return func(*args, **kwargs)


@implements(aten.embedding.default)
def _embedding(func, args, kwargs):
    weight, indices = args[0], args[1]
    check_frozen(weight)
    spec = weight.spec
    if spec.transposed or len(spec.shape) != 2 or spec.block_size[0] != 1:
        return func(weight.dequantize(), *args[1:], **kwargs)
    _check_indices(indices, spec.shape[0])
    # Dequantize only the rows looked up.
    rows = format_of(spec).dequantize_rows(weight.tensors, spec, indices.reshape(-1), spec.dtype)
    return rows.view(*indices.shape, spec.shape[1])


_EMBEDDING_BAG_ARGS = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode",
                       "sparse", "per_sample_weights", "include_last_offset", "padding_idx")


def _embedding_bag(func, args, kwargs):
    """F.embedding_bag on a quantized weight: dequantize only the distinct rows looked up (a [U, D] table),
    remap the indices into it and run the float op, so the result equals the op on the dequantized weight."""
    a = {**dict(zip(_EMBEDDING_BAG_ARGS, args, strict=False)), **kwargs}
    weight, indices = a["weight"], a["input"]
    if not isinstance(weight, AQT) or any(isinstance(a.get(k), AQT) for k in ("input", "offsets",
                                                                               "per_sample_weights")):
        return F.embedding_bag(**{k: _dq(v) for k, v in a.items()})
    check_frozen(weight)
    if a.get("max_norm") is not None:  # the float op renormalizes the weight rows in place
        raise NotImplementedError("F.embedding_bag(max_norm=...) renormalizes weight rows in place, which a "
                                  "quantized weight cannot do; use max_norm=None (or call .dequantize() first)")
    spec = weight.spec
    # torch.unique has a data-dependent size, which torch.compile cannot trace: the whole table there
    if spec.transposed or len(spec.shape) != 2 or spec.block_size[0] != 1 or torch.compiler.is_compiling():
        a["weight"] = weight.dequantize()
        return F.embedding_bag(**a)
    rows = spec.shape[0]
    _check_indices(indices, rows)
    unique, inverse = torch.unique(indices, return_inverse=True)
    a["input"] = inverse.to(indices.dtype)
    a["weight"] = format_of(spec).dequantize_rows(weight.tensors, spec, unique, spec.dtype)
    pad = a.get("padding_idx")
    if pad is not None:  # the padding row's position in the small table (absent: it never occurs)
        pad = pad + rows if pad < 0 else pad
        hit = (unique == pad).nonzero()
        a["padding_idx"] = int(hit[0, 0]) if hit.numel() else None
    return F.embedding_bag(**a)


@implements(F.embedding_bag)
def _guarded_embedding_bag(func, args, kwargs):
    """`_embedding_bag`, its output guarded for a weight with requires_grad=True (`check_frozen`)."""
    out = _embedding_bag(func, args, kwargs)
    weight = {**dict(zip(_EMBEDDING_BAG_ARGS, args, strict=False)), **kwargs}.get("weight")
    return guard_frozen_output(out, weight) if isinstance(weight, AQT) else out


def _check_indices(indices: torch.Tensor, rows: int) -> None:
    """IndexError for indices outside [0, rows), as the float embedding raises (eager only: no .item() under
    torch.compile, where the float op's own bounds check is also off)."""
    if torch.compiler.is_compiling() or indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise IndexError(f"index {bad} is out of range for a quantized embedding of {rows} rows (valid: 0..{rows - 1})")


# -- tensor bookkeeping ----------------------------------------------------------------------------------


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return keep_slice_link(args[0], args[0]._apply_to_tensors(func))


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
        write_back(dst)  # dst a slice (DCP's load narrows its target): into the tensor sliced
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
        torch.equal(_bits(getattr(a, "_" + n)), _bits(getattr(b, "_" + n))) for n in a._names
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors compared as their bytes (aten's equal has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


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
    if t.dim() == 3 and {d0 % 3, d1 % 3} == {1, 2} and t.spec.block_size[0] == 1:  # expert weights [E, N, K]
        return _transpose2d(t)
    return t if d0 % t.dim() == d1 % t.dim() else _blockwise(func, [t], args[1:], kwargs)


@implements(aten.permute.default)
def _permute(func, args, kwargs):
    t, dims = args
    if t.dim() == 2 and [d % 2 for d in dims] == [1, 0]:
        return _transpose2d(t)
    if t.dim() == 3 and [d % 3 for d in dims] == [0, 2, 1] and t.spec.block_size[0] == 1:
        return _transpose2d(t)
    return _blockwise(func, [t], args[1:], kwargs)


def _transpose2d(t: AQT) -> AQT:
    """`t` with its last two dims swapped, a flag on the spec (2-D weights; 3-D expert weights per expert)."""
    return t._replace(spec=t.spec.replace(transposed=not t.spec.transposed))


@implements(
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
    aten.select.int, aten.index.Tensor, aten.unsqueeze.default, aten.squeeze.dim,
    aten.expand.default, aten.flatten.using_ints, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int,
)
def _structural(func, args, kwargs):
    t = args[0]
    if func in _EXPERT_VIEWS and len(t.spec.shape) == 3:
        out = _expert_view(func, t, args, kwargs)
        if out is not None:
            return out
    if func in _VIEWS and len(args) == 2 and tuple(args[1]) == tuple(t.shape):  # a view of the same tensor:
        return keep_slice_link(t, t._apply_to_tensors(aten.alias.default))  # writes go through
    out = _blockwise(func, [t], args[1:], kwargs)
    return link_slice(out, args) if func is aten.slice.Tensor else out


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_EXPERT_VIEWS = (aten.select.int, aten.slice.Tensor, aten.unbind.int, aten.split.Tensor)


def _expert_view(func, t: AQT, args, kwargs) -> AQT | list[AQT] | None:
    """Expert weights [E, N, K] (blocks inside one expert) indexed along the expert dim: `w[e]` is expert e's 2-D
    tensor, `w[a:b]` / unbind / split the 3-D tensors of those experts, each a view of every stored tensor (no
    unpacking: a per-expert format stores each expert's tensors at [e], `format_experts`). None: not such an op."""
    spec = t.spec
    names = ("a", "dim") if func is aten.split.Tensor else ("dim", "a", "b", "step")  # split(self, size, dim)
    a = {**dict(zip(names, args[1:], strict=False)), **kwargs}
    if spec.block_size[0] != 1 or a.get("dim", 0) % 3 != 0:
        return None
    if func is aten.select.int:
        return _expert_part(t, lambda v: v.select(0, a["a"]), 2)
    if func is aten.unbind.int:
        return [_expert_part(t, lambda v, e=e: v.select(0, e), 2) for e in range(spec.shape[0])]
    if func is aten.split.Tensor:
        size = a["a"]
        return [_expert_part(t, lambda v, s=s: v[s:s + size], 3) for s in range(0, spec.shape[0], size)]
    if a.get("step", 1) != 1:
        return None
    return _expert_part(t, lambda v: aten.slice.Tensor(v, 0, a.get("a"), a.get("b")), 3)


def _expert_part(t: AQT, index, rank: int) -> AQT:
    stored = {n: index(v) if not n.startswith("act_") else v for n, v in t.tensors.items()}
    spec = t.spec
    if rank == 2:
        new = spec.replace(shape=spec.shape[1:], block_size=spec.block_size[1:])
    else:
        new = spec.replace(shape=(stored["qdata"].shape[0], *spec.shape[1:]))
    return type(t)(stored, new)


@implements(aten.cat.default)
def _cat(func, args, kwargs):
    tensors = list(args[0])
    if not all(isinstance(t, AQT) for t in tensors):
        return func([_dq(t) for t in tensors], *args[1:], **kwargs)
    for t in tensors[1:]:
        if _family(t) != _family(tensors[0]):
            raise ValueError(
                f"cat: AffineQuantizedTensors must share target, range, domain, format and activation "
                f"quantization; got {tensors[0]!r} and {t!r}. Dequantize them first."
            )
    dim = ({**dict(zip(("dim",), args[1:], strict=False)), **kwargs}).get("dim", 0)
    if dim % max(tensors[0].dim(), 1) == 0 and _same_experts(tensors):  # expert weights joined along the experts
        stored = {n: torch.cat([getattr(t, "_" + n) for t in tensors]) for n in tensors[0]._names}
        spec = tensors[0].spec
        return type(tensors[0])(stored, spec.replace(shape=(stored["qdata"].shape[0], *spec.shape[1:])))
    return _blockwise(func, tensors, args[1:], kwargs, listwise=True)


def _same_experts(tensors: list[AQT]) -> bool:
    """Whether `tensors` are 3-D expert weights that differ only in their number of experts (same spec and stored
    layout otherwise, no activation tensors): cat along dim 0 then joins their stored tensors."""
    first = tensors[0].spec
    if len(first.shape) != 3 or first.block_size[0] != 1:
        return False
    layout = [(n, v.dtype, tuple(v.shape[1:])) for n, v in tensors[0].tensors.items()]
    return all(t.spec.replace(shape=first.shape) == first and not t.act_tensors
               and [(n, v.dtype, tuple(v.shape[1:])) for n, v in t.tensors.items()] == layout for t in tensors)


def _family(t: AQT):
    spec = t.spec
    static = {n: v for n, v in t.act_tensors.items() if n != "act_pre_scale"}
    return (spec.target, spec.quant_min, spec.quant_max, spec.zero_point_domain, spec.fmt, spec.dtype,
            spec.act_quant, spec.scale_type, spec.compute_dtype,
            tuple((n, tuple(v.tolist())) for n, v in sorted(static.items())))


def expand_blocks(q: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
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
            parts[name] = expand_blocks(parts[name].reshape(spec.num_blocks), spec.block_size)
    if "act_pre_scale" in t._names:  # per input channel: the last dim of the untransposed layout
        parts["act_pre_scale"] = t._act_pre_scale.expand(spec.shape).contiguous()
    if spec.transposed:
        parts = {k: v.transpose(-2, -1) for k, v in parts.items()}
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
    if not torch.equal(expand_blocks(corners, tuple(block)), ids) or corners.unique().numel() != corners.numel():
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
        raise ValueError(f"{func}: a 0-d result of a quantized tensor is not supported; call .dequantize() first "
                         "and index the float tensor")
    block = _infer_block(p["ids"])
    if block is None:
        raise ValueError(
            f"{func} on {base!r} would cut its quantization blocks unevenly (block_size {spec.block_size}); "
            "slice, index and reshape along whole blocks, or call .dequantize() first"
        )
    corner = tuple(slice(None, None, b) for b in block)
    zp = p["zero_point"][corner] if "zero_point" in p else None
    new_spec = spec.replace(shape=tuple(p["codes"].shape), block_size=block, transposed=False)
    if format_of(spec).check(new_spec) is not None:
        new_spec = new_spec.replace(fmt="plain")
    out = type(base).from_codes(p["codes"].contiguous(), p["scale"][corner], zp, new_spec)
    act = {n: v for n, v in base.act_tensors.items() if n != "act_pre_scale"}
    if "act_pre_scale" in p:
        act["act_pre_scale"] = _input_channel_vector(p["act_pre_scale"], base, func)
    return out.with_act_tensors(**act) if act else out


def _input_channel_vector(per_element: torch.Tensor, base: AQT, func) -> torch.Tensor:
    """act_pre_scale of a rebuilt weight: its per-element copy must still vary along the input channels only
    (the last dim of a 2-D result), else the op mixed input channels with output channels."""
    if per_element.dim() != 2 or not torch.equal(per_element, per_element[:1].expand_as(per_element)):
        raise ValueError(
            f"{func} on {base!r} would mix the input channels that its act_pre_scale scales with output "
            "channels; keep the weight 2-D [out, in] and slice rows or whole columns, or call .dequantize()"
        )
    return per_element[0].contiguous()


# -- slices that write back on copy_ (what torch.distributed.checkpoint.load needs) -----------------------


def link_slice(out: AQT, args) -> AQT:
    """`out` = aten.slice.Tensor(*args) remembers (tensor, dim, start, end) for `write_back` (step 1 only)."""
    t, dim, start, end, step = (*args, *(0, None, None, 1)[len(args) - 1:])  # slice(self, dim, start, end, step)
    if step != 1 or t.spec.transposed:
        return out
    dim %= t.dim()
    size = t.shape[dim]
    start = 0 if start is None else min(start + size if start < 0 else start, size)
    end = size if end is None else min(end + size if end < 0 else end, size)
    out._slice_of = (t, dim, start, end)
    return out


def keep_slice_link(t: AQT, out: AQT) -> AQT:
    """`out` (a detach / alias of `t`) keeps `t`'s slice link."""
    link = getattr(t, "_slice_of", None)
    if link is not None:
        out._slice_of = link
    return out


def write_back(t: AQT) -> None:
    """After a copy_ into `t`: if `t` is a slice, write its codes, qparams and act_pre_scale into the tensor it
    was sliced from (rebuilt in that tensor's spec and copied in place). ValueError if the qparams then differ
    within one of that tensor's quantization blocks (the slice cut blocks, and its qparams differ from the rest)."""
    link = getattr(t, "_slice_of", None)
    if link is None:
        return
    parent, dim, start, end = link
    whole = {n: v.clone() for n, v in _logical_parts(parent).items() if n != "ids"}
    part = _logical_parts(t)
    if set(whole) != {n for n in part if n != "ids"}:
        raise ValueError(f"copy_ into a slice of {parent!r}: the copied tensor stores {sorted(part)}; copy a "
                         "tensor quantized with the same config")
    for name, v in whole.items():
        v.narrow(dim, start, end - start).copy_(part[name])
    block = parent.spec.block_size
    corner = tuple(slice(None, None, b) for b in block)
    qparams = []
    for name in ("scale", "zero_point"):
        q = whole[name][corner] if name in whole else None
        if q is not None and not torch.equal(expand_blocks(q, block), whole[name]):
            raise ValueError(
                f"copy_ into a slice of {parent!r}: the copied {name} differs within its quantization blocks {block} "
                "(the slice cuts them: copy whole blocks of a tensor quantized with the same group size). A DCP "
                "checkpoint of per-row weights split by columns (RowwiseParallel) cannot load piecewise at another "
                "world size: save and load it with affineq.dcp_save / affineq.dcp_load")
        qparams.append(q)
    new = type(parent).from_codes(whole["codes"], qparams[0], qparams[1], parent.spec)
    act = {n: v for n, v in t.act_tensors.items() if n != "act_pre_scale"}
    if "act_pre_scale" in whole:
        act["act_pre_scale"] = whole["act_pre_scale"][0]
    parent.copy_(new.with_act_tensors(**act) if act else new)
