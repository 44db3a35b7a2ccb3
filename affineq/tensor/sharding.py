"""Collectives on `AffineQuantizedTensor`: what DTensor needs to scatter, broadcast and gather quantized weights.

A quantized tensor is a wrapper with no storage of its own, so a collective handed the wrapper (gloo reads its
storage) crashes. Here every collective runs on the stored tensors instead, moved as raw bytes (gloo has no
float8 / uint4 types, and bytes keep bf16 qparams bit-exact):

| op (what calls it)                                         | rule                                            |
|------------------------------------------------------------|-------------------------------------------------|
| `c10d.scatter_` (`distribute_tensor(w, mesh, [Shard(d)])`) | each stored tensor of the chunks, into the output's |
| `c10d.broadcast_` (`distribute_tensor(w, ..., [Replicate()])`) | each stored tensor, in place                |
| `_c10d_functional.all_gather_into_tensor` (`full_tensor()`, | each stored tensor gathered; the world's shards |
| `redistribute(..., [Replicate()])`)                        | rebuilt and concatenated along dim 0 by `aten.cat` |

All three need every rank's tensor to have the same spec and stored layout, which DTensor's even sharding
gives: chunks of one tensor along whole blocks (`ops._blockwise`) have equal shapes, so their stored tensors
do too, whatever the packing format. The concatenation reuses the structural rule of `aten.cat`, so the
gathered tensor holds the same codes and qparams as the unsharded one (its format's own layout, not a byte
concatenation: a `dense` panel or an `int4_cpu` tile does not split at arbitrary rows).

`aten.empty_like` (the scatter's receive buffer) is an uninitialized tensor with the same spec and layout.

Slices write through: a slice of a quantized tensor is rebuilt from codes (a packed layout has no strided view),
so it remembers where it came from (`ops.link_slice`), and `copy_` into it writes the copied region back into the
tensor it was sliced from (`ops.write_back`). `torch.distributed.checkpoint.load` narrows each target to the region
a saved chunk covers and copies into that: this makes it load quantized weights, resharded, in place.
"""

from __future__ import annotations

import torch

from affineq.tensor import ops
from affineq.tensor.affine import AffineQuantizedTensor

AQT = AffineQuantizedTensor
implements = AQT.implements
aten = torch.ops.aten


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous `t` (writes through: collectives receive into it)."""
    if not t.is_contiguous():
        raise ValueError(f"a stored tensor of shape {tuple(t.shape)} is not contiguous; call .contiguous() on the "
                         "quantized tensor before the collective")
    return t.reshape(-1).view(torch.uint8)


def _stored(t: AQT, name: str) -> torch.Tensor:
    return getattr(t, "_" + name)


def _check_same_layout(tensors: list[AQT], op: str) -> None:
    """ValueError unless all `tensors` share spec and stored layout (what a byte-wise collective needs)."""
    first = tensors[0]
    for t in tensors[1:]:
        if t.spec != first.spec or ops._stored_layout(t) != ops._stored_layout(first):
            raise ValueError(f"{op}: the quantized tensors differ in spec or stored layout ({first!r} vs {t!r}); "
                             "shard along whole quantization blocks into equal parts (even sharding)")


@implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != t.dtype:
        raise ValueError(f"empty_like(dtype={dtype}) of a quantized {t.dtype} tensor: leave dtype unset, or call "
                         ".dequantize() first")
    return t._apply_to_tensors(lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device))


@implements(aten.new_empty.default)
def _new_empty(func, args, kwargs):
    """A float buffer of the logical dtype: an empty buffer of another shape has no codes or blocks to keep."""
    t, size = args[0], args[1]
    return torch.empty(size, dtype=kwargs.get("dtype") or t.dtype, device=kwargs.get("device") or t.device)


def _scatter(func, args, kwargs):
    outputs, inputs, *rest = args
    _check_aqts(outputs, "scatter")
    out = outputs[0]
    chunks = list(inputs[0]) if inputs else []
    _check_aqts(chunks, "scatter")
    _check_same_layout([out, *chunks], "scatter")
    work = None
    for name in out._names:
        src = [[_bytes(_stored(c, name).contiguous()) for c in chunks]] if chunks else []
        _, work = func([_bytes(_stored(out, name))], src, *rest, **kwargs)
        work.wait()
    return outputs, work


def _broadcast(func, args, kwargs):
    tensors, *rest = args
    _check_aqts(tensors, "broadcast")
    work = None
    for name in tensors[0]._names:
        _, work = func([_bytes(_stored(t, name)) for t in tensors], *rest, **kwargs)
        work.wait()
    return tensors, work


def _all_gather_into_tensor(func, args, kwargs):
    t, group_size, *rest = args
    wait = torch.ops._c10d_functional.wait_tensor.default
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(group_size)]
    for name in t._names:
        x = _stored(t, name).contiguous()
        gathered = wait(func(_bytes(x), group_size, *rest, **kwargs))
        for i, chunk in enumerate(gathered.view(group_size, -1)):
            shards[i][name] = chunk.view(x.dtype).view(x.shape)
    parts = [type(t)(s, t.spec) for s in shards]
    return aten.cat.default(parts, 0)


def _wait_tensor(func, args, kwargs):
    return args[0]  # the collectives above have waited for their inner tensors already


def _wrap_tensor_autograd(func, args, kwargs):
    return args[0]  # (an AsyncCollectiveTensor wrapper elsewhere): the gather above has completed


def _check_aqts(tensors, op: str) -> None:
    if not all(isinstance(t, AQT) for t in tensors):
        kinds = sorted({type(t).__name__ for t in tensors})
        raise ValueError(f"{op}: cannot mix quantized and plain tensors ({kinds}); quantize every rank's tensor "
                         "with the same config")


if torch.distributed.is_available():  # builds without distributed have no c10d ops
    import torch.distributed._functional_collectives  # noqa: F401  (defines _wrap_tensor_autograd)

    implements(torch.ops.c10d.scatter_.default)(_scatter)
    implements(torch.ops.c10d.broadcast_.default)(_broadcast)
    implements(torch.ops._c10d_functional.all_gather_into_tensor.default)(_all_gather_into_tensor)
    implements(torch.ops._c10d_functional.wait_tensor.default)(_wait_tensor)
    implements(torch.ops._c10d_functional._wrap_tensor_autograd.default)(_wrap_tensor_autograd)
