"""Tensor parallelism for quantized models: shard with `parallelize_module`, save and reshard with DCP.

torch's own `parallelize_module` / `distribute_tensor` / `DTensor.from_local` / `full_tensor()` work on quantized
weights (the collectives run on the stored tensors: `affineq.tensor.sharding`); each rank then holds an
`AffineQuantizedTensor` with 1/world of the rows (ColwiseParallel) or columns (RowwiseParallel) and of the bytes.
`parallelize_quantized` is that call plus what only affineq knows:
- a check, before anything moves, that no quantization group straddles two ranks (ValueError naming the layer);
- on rowwise (K-sharded) layers with dynamic activation quantization, per-token ranges reduced across the ranks
  (`activation.reduce_input_ranges`), so every output equals the unsharded quantized model's up to the order of
  the K summation (plain `parallelize_module` quantizes each rank's slice of a token with its own range).

Checkpoints: `dcp_save` / `dcp_load` write a quantized weight as its codes, scale, zero point and activation tensors
in the logical [N, K] layout (plain tensors, or DTensors sharded as the weight is), which
`torch.distributed.checkpoint` saves and reshards like any tensors, so a checkpoint saved at one world size loads
at another (or in one process without a process group) into a model quantized with the same config.
"""

from __future__ import annotations

import fnmatch
import io
import json
import pickle
from pathlib import Path

import torch
import torch.nn as nn

from affineq.tensor.activation import range_reduce
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.ops import expand_blocks
from affineq.tensor.spec import QuantSpec

__all__ = ["dcp_load", "dcp_save", "parallelize_quantized", "quantized_state_dict"]

AQT = AffineQuantizedTensor
_PARTS = ("codes", "scale", "zero_point")  # then the activation tensors, under their own names
_SPEC = "aq_spec"  # the entry holding a weight's spec (JSON), beside its parts f"{fqn}.aq_{part}"


def _sharded_dim(style, module: nn.Module) -> int | None:
    """The weight dim a ColwiseParallel / RowwiseParallel style shards (an embedding's table is [V, D], so the two
    swap there, as in torch), None for other styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return 1 if isinstance(module, nn.Embedding) else 0
    if isinstance(style, RowwiseParallel):
        return 0 if isinstance(module, nn.Embedding) else 1
    return None


def _matches(plan_key: str, name: str) -> bool:
    """torch's rule: the plan key's dotted atoms match the module name's by fnmatch."""
    atoms, parts = plan_key.split("."), name.split(".") if name else []
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms, strict=True))


def check_plan(model: nn.Module, world: int, plan: dict) -> list[tuple[str, nn.Module, int]]:
    """(name, module, sharded dim) of every quantized weight `plan` shards; ValueError naming the layer when its
    dim does not split into `world` equal parts along whole quantization groups."""
    out = []
    for key, style in plan.items():
        for name, module in model.named_modules():
            w = getattr(module, "weight", None)
            dim = _sharded_dim(style, module) if _matches(key, name) else None
            if dim is None or not isinstance(w, AQT):
                continue
            size, block = w.spec.shape[dim], w.spec.block_size[dim]
            style_name = type(style).__name__
            if size % world:
                raise ValueError(f"layer {name!r}: {style_name} splits weight dim {dim} of size {size} over {world} "
                                 f"ranks, which needs a multiple of {world}; choose a world size that divides {size}")
            local = size // world
            if block != size and local % block:
                raise ValueError(
                    f"layer {name!r}: {style_name} gives each of {world} ranks {local} of the {size} "
                    f"{'input' if dim else 'output'} channels, but its quantization groups are {block} wide, so a "
                    f"group would straddle two ranks; quantize with a group_size that divides {local}, or use a "
                    f"world size that divides {size // block}")
            out.append((name, module, dim))
    return out


def parallelize_quantized(model: nn.Module, device_mesh, plan: dict) -> nn.Module:
    """`torch.distributed.tensor.parallel.parallelize_module(model, device_mesh, plan)` for a quantized model.

    Checks first that every quantized weight the plan shards splits along whole groups (ValueError naming the
    layer, the model untouched), then shards (each rank's weights: DTensors whose local tensors are
    AffineQuantizedTensors with 1/world of the rows or columns), freezes the quantized weights, and on layers
    sharded along their input channels K with dynamic activation quantization reduces each token's range across
    the ranks, so outputs equal the unsharded model's up to summation order. `device_mesh`: a 1-D DeviceMesh."""
    from torch.distributed.tensor.parallel import parallelize_module

    if device_mesh.ndim != 1:
        raise ValueError(f"device_mesh must be 1-D (tensor parallelism over one dim), got {device_mesh.ndim}-D")
    sharded = check_plan(model, device_mesh.size(), plan)
    parallelize_module(model, device_mesh, plan)
    group = device_mesh.get_group()
    for _, module, dim in sharded:
        module.weight.requires_grad_(False)  # nn.Parameter(DTensor) turned it on; codes take no gradient
        aq = module.weight.to_local().spec.act_quant
        if dim == 1 and isinstance(module, nn.Linear) and aq is not None and not aq.static:
            _reduce_ranges_in(module, group)
    return model


def _reduce_ranges_in(module: nn.Module, group) -> None:
    """Forward hooks that make `activation.reduce_input_ranges` all-reduce over `group` while `module` runs."""
    import torch.distributed as dist

    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=ops[op], group=group)
        return t

    tokens = []
    module.register_forward_pre_hook(lambda m, args: tokens.append(range_reduce.set(reduce)))
    module.register_forward_hook(lambda m, args, out: range_reduce.reset(tokens.pop()), always_call=True)


# -- checkpoints -----------------------------------------------------------------------------------------------


def _local(w):
    from torch.distributed.tensor import DTensor

    return (w.to_local(), w) if isinstance(w, DTensor) else (w, None)


def _parts(w: AQT) -> dict[str, torch.Tensor]:
    """A weight's codes and qparams in the logical layout (what `from_codes` takes) and its activation tensors."""
    parts = {"codes": w.codes(), "scale": w.scale}
    if w.zero_point is not None:
        parts["zero_point"] = w.zero_point
    return {**parts, **w.act_tensors}


def _part_placements(name: str, dt) -> list:
    """How a part of DTensor weight `dt` is laid out over the mesh: codes, scale and zero point are sharded along
    the weight's sharded dim (their dims are the weight's), act_pre_scale [K] along its only dim when K is
    sharded; per-tensor activation qparams are replicated."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in dt.placements:
        if not isinstance(p, Shard):
            out.append(Replicate())
        elif name in _PARTS:
            out.append(Shard(p.dim))
        else:
            out.append(Shard(0) if name == "act_pre_scale" and p.dim == 1 else Replicate())
    return out


def _global(part: torch.Tensor, name: str, dt, placements: list | None = None):
    """`part` (this rank's) as a DTensor laid out like DTensor weight `dt` (or as `placements`), or `part` itself
    for a plain weight."""
    if dt is None:
        return part
    from torch.distributed.tensor import DTensor, Shard

    placements = placements or _part_placements(name, dt)
    shape = list(part.shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= dt.device_mesh.size(mesh_dim)
    return DTensor.from_local(part, dt.device_mesh, placements, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _quantized_weights(model: nn.Module) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.state_dict(keep_vars=True).items():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(local, AQT):
            out[name] = p
    return out


def quantized_state_dict(model: nn.Module) -> dict[str, object]:
    """`model.state_dict()` with each quantized weight `fqn` replaced by f"{fqn}.aq_codes", ".aq_scale",
    ".aq_zero_point" (if any), ".aq_<act tensor>" (plain tensors, or DTensors sharded like the weight) and
    ".aq_spec" (the spec as JSON, shape and block size those of the whole weight): what `dcp_save` writes."""
    sd = dict(model.state_dict())
    for fqn, w in _quantized_weights(model).items():
        local, dt = _local(w)
        del sd[fqn]
        for name, part in _parts(local).items():
            sd[f"{fqn}.aq_{name}"] = _global(part, name, dt)
        codes = sd[f"{fqn}.aq_codes"]
        scale_shape = tuple(sd[f"{fqn}.aq_scale"].shape)
        block = tuple(c // s for c, s in zip(codes.shape, scale_shape, strict=True))
        spec = local.spec.replace(shape=tuple(codes.shape), block_size=block, fmt="plain", transposed=False)
        sd[f"{fqn}.{_SPEC}"] = json.dumps(spec.to_dict())
    return sd


def dcp_save(model: nn.Module, checkpoint_id: str | Path) -> None:
    """Save `model` (quantized, sharded or not) with `torch.distributed.checkpoint.save` into `checkpoint_id`
    (a directory). Every rank of the model's process group calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(quantized_state_dict(model), checkpoint_id=str(checkpoint_id))


def dcp_load(model: nn.Module, checkpoint_id: str | Path) -> nn.Module:
    """Load a `dcp_save` checkpoint into `model`, quantized with the same config and sharded at any world size (or
    not sharded, in one process). Quantized weights are rebuilt from the saved codes and qparams and copied into
    the model's weights (in place, their own packing format); a weight saved with another target, range or
    activation quantization is a ValueError naming it.

    All or nothing: everything is read into new tensors and every quantized weight is rebuilt and checked against
    the model's before the first value is copied in, so a failing load leaves the model as it was (peak memory:
    the model plus one copy of what the checkpoint holds).

    Nothing in the checkpoint runs code: its `.metadata` (a pickle) is read with an allow-list of the classes torch
    writes there (ValueError naming any other), and its non-tensor entries with `torch.load(weights_only=True)`."""
    import torch.distributed.checkpoint as dcp

    reader = _checked_reader(checkpoint_id)  # .metadata unpickled with an allow-list, not pickle.load
    metadata = reader.read_metadata().state_dict_metadata
    weights = _quantized_weights(model)
    targets = dict(model.state_dict())
    _check_shapes(targets, weights, metadata)  # before anything is read
    # dcp.load copies into the tensors it is given: give it new ones, not the model's (a later check may fail)
    sd = {k: torch.empty_like(t) if isinstance(t, torch.Tensor) else t for k, t in targets.items() if k not in weights}
    for fqn, w in weights.items():
        local, dt = _local(w)
        sd[f"{fqn}.{_SPEC}"] = ""
        for name in _saved_part_names(metadata, fqn):
            meta = metadata[f"{fqn}.aq_{name}"]
            shape, placements = _load_layout(name, meta.size, dt, fqn)
            sd[f"{fqn}.aq_{name}"] = _global(torch.empty(shape, dtype=meta.properties.dtype), name, dt, placements)
    try:
        dcp.load(sd, checkpoint_id=str(checkpoint_id), storage_reader=reader, planner=_bytes_planner())
    except dcp.api.CheckpointException as e:  # one rank's ValueError (a refused entry) as itself
        errs = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        first = next((x for x in errs if isinstance(x, ValueError)), None)
        if first is None:
            raise
        raise ValueError(str(first)) from None
    rebuilt = {}
    for fqn, w in weights.items():
        local, _ = _local(w)
        text = sd.pop(f"{fqn}.{_SPEC}")
        if not isinstance(text, str):
            raise ValueError(f"dcp_load: {fqn}: the checkpoint's {_SPEC} is a {type(text).__name__}, not the spec's "
                             "JSON; the checkpoint was edited (nothing was loaded)")
        saved = QuantSpec.from_dict(json.loads(text))
        parts = {n: _local(sd.pop(f"{fqn}.aq_{n}"))[0] for n in _saved_part_names(metadata, fqn)}
        rebuilt[fqn] = _rebuild(local, tuple(w.shape), saved, parts, fqn)
        _check_fits(local, rebuilt[fqn], fqn)
    # nothing below can fail on the checkpoint's content: only now is the model written
    with torch.no_grad():
        for key, t in sd.items():
            if isinstance(t, torch.Tensor) and isinstance(targets.get(key), torch.Tensor):
                targets[key].copy_(t)
        for fqn, w in weights.items():
            _local(w)[0].copy_(rebuilt[fqn])
    return model


# -- reading a checkpoint's pickles with an allow-list ----------------------------------------------------------

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file: only the classes torch's checkpoint metadata holds (and torch dtypes)."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise ValueError(f"dcp_load: {self.where} refers to {module}.{name}, which a checkpoint's metadata never "
                         "holds (only torch.distributed.checkpoint's metadata classes, torch.Size, dtypes, layouts "
                         "and paths are allowed): the file was crafted or corrupted; nothing was loaded")

    def persistent_load(self, pid):
        raise ValueError(f"dcp_load: {self.where} holds a persistent reference, which checkpoint metadata never "
                         "does: the file was crafted or corrupted; nothing was loaded")


def _load_metadata(data: bytes, where: str):
    """The `Metadata` a DCP `.metadata` file holds, unpickled with `_MetadataUnpickler` and checked."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data), where).load()
    except ValueError:
        raise
    except Exception as e:  # truncated pickle, wrong arguments to an allowed class, unknown layout name
        raise ValueError(f"dcp_load: {where} is not a readable checkpoint metadata file ({type(e).__name__}: {e}); "
                         "nothing was loaded") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ValueError(f"dcp_load: {where} holds a {type(md).__name__}, not torch.distributed.checkpoint's "
                         "Metadata; nothing was loaded")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or rel in (".", "..") or "/" in rel or "\\" in rel:
            raise ValueError(f"dcp_load: {where} names the data file {rel!r}, which is not a file name inside the "
                             "checkpoint directory; nothing was loaded")
    return md


def _checked_reader(checkpoint_id):
    """A `FileSystemReader` of `checkpoint_id` whose `read_metadata` (called by dcp_load and again by dcp.load)
    unpickles with the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            get_path = getattr(self, "_get_metadata_path", None)
            path = get_path(kwargs.get("rank")) if get_path else self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(path, "rb") as f:
                md = _load_metadata(f.read(), str(path))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(str(checkpoint_id))


def _bytes_planner():
    """torch's DefaultLoadPlanner, reading non-tensor entries (the specs' JSON) with weights_only=True (torch's
    own unpickles them with weights_only=False: a crafted entry would run code)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                raise ValueError(f"dcp_load: the checkpoint's entry {read_item.dest_index.fqn!r} is not a plain "
                                 f"value ({type(e).__name__}: {str(e)[:200]}); nothing was loaded") from None
            super().load_bytes(read_item, _saved(obj))

    return _Planner()


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _check_fits(local: AQT, new: AQT, fqn: str) -> None:
    """ValueError unless `new` can be copied into `local` (what AffineQuantizedTensor.copy_ requires: the same
    spec and stored tensors), checked for every weight before any is copied."""
    def layout(t: AQT) -> list:
        return [(n, x.dtype, tuple(x.shape)) for n, x in t.tensors.items()]

    if new.spec != local.spec or layout(new) != layout(local):
        raise ValueError(f"dcp_load: {fqn}: the checkpoint's weight {new!r} does not match the model's {local!r} "
                         "(another config, or qparams stored in another dtype); quantize the model with the config "
                         "the checkpoint was saved with (nothing was loaded)")


def _check_shapes(sd: dict, weights: dict, metadata) -> None:
    """ValueError naming every tensor whose (global) shape differs from the checkpoint's, before dcp.load reads
    anything (its own error names neither the layer's fix nor all of them). A quantized weight is compared
    through its saved codes (the weight's shape)."""
    problems = []
    for key, t in sd.items():
        meta = metadata.get(f"{key}.aq_codes" if key in weights else key)
        size = getattr(meta, "size", None)
        if size is not None and isinstance(t, torch.Tensor) and tuple(size) != tuple(t.shape):
            problems.append(f"  - {key}: the checkpoint holds {tuple(size)}, the model {tuple(t.shape)}")
    if problems:
        raise ValueError("dcp_load: {} tensor(s) of the model have other shapes than the checkpoint's:\n{}\nBuild the "
                         "model with the sizes the checkpoint was saved from (nothing was loaded)".format(
                             len(problems), "\n".join(problems)))


def _saved_part_names(metadata, fqn: str) -> list[str]:
    prefix = f"{fqn}.aq_"
    return [k[len(prefix):] for k in metadata if k.startswith(prefix) and k != f"{fqn}.{_SPEC}"]


def _load_layout(name: str, size, dt, fqn: str) -> tuple[list[int], list | None]:
    """This rank's shape of a saved part of global `size` and its placements. A qparam with one entry along the
    sharded dim (a per-row scale saved unsharded, its block spanning the dim) is replicated: both column shards
    of a per-row weight keep the row's scale."""
    shape = list(size)
    if dt is None:
        return shape, None
    from torch.distributed.tensor import Replicate, Shard

    placements = _part_placements(name, dt)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            n = dt.device_mesh.size(mesh_dim)
            if shape[p.dim] == 1 and name in ("scale", "zero_point"):
                placements[mesh_dim] = Replicate()
            elif shape[p.dim] % n:
                raise ValueError(f"{fqn}: the checkpoint's {name} has {shape[p.dim]} entries along dim {p.dim}, "
                                 f"which do not split over {n} ranks; load it at a world size dividing "
                                 f"{shape[p.dim]}")
            else:
                shape[p.dim] //= n
    return shape, placements


def _rebuild(local: AQT, shape: tuple[int, ...], saved: QuantSpec, parts: dict[str, torch.Tensor], fqn: str) -> AQT:
    """The weight `local` (this rank's; `shape`: the whole weight's) with the loaded codes and qparams, in `local`'s
    spec and format. The saved blocks may be finer than `local`'s (a per-row scale saved from a column-sharded
    weight is one per shard): the qparams must then be equal within each of `local`'s blocks."""
    spec = local.spec
    same = ("dtype", "target", "quant_min", "quant_max", "zero_point_domain", "mapping_type", "act_quant",
            "scale_type")
    diff = [f for f in same if getattr(saved, f) != getattr(spec, f)]
    if diff or saved.shape != shape:
        raise ValueError(f"{fqn}: the checkpoint's weight ({saved}) differs from the model's ({spec}) in "
                         f"{diff or 'shape'}; quantize the model with the config the checkpoint was saved with")
    codes = parts["codes"]
    saved_block = tuple(c // s for c, s in zip(codes.shape, parts["scale"].shape, strict=True))
    qparams = []
    for name in ("scale", "zero_point"):
        q = parts.get(name)
        if q is not None and saved_block != spec.block_size:
            full = expand_blocks(q, saved_block)
            q = full[tuple(slice(None, None, b) for b in spec.block_size)]
            if not torch.equal(expand_blocks(q, spec.block_size), full):
                raise ValueError(f"{fqn}: the checkpoint's {name} varies within the model's quantization blocks "
                                 f"{spec.block_size} (saved with blocks {saved_block}); quantize the model with "
                                 "the checkpoint's group size")
        qparams.append(q)
    out = type(local).from_codes(codes, qparams[0], qparams[1], spec.replace(transposed=False))
    act = {n: t for n, t in parts.items() if n not in _PARTS}
    return out.with_act_tensors(**act) if act else out

