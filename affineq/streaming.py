"""Quantizing models larger than memory: a float safetensors checkpoint is read, quantized and written (or
placed into a model built on the `meta` device) one tensor at a time.

    affineq.quantize_checkpoint("float_dir", "int4_dir", affineq.Int4WeightOnlyConfig(group_size=64))
    with torch.device("meta"):
        model = MyModel()
    affineq.load_quantized(model, "int4_dir")            # or load_quantized(model, "float_dir", config)

Peak memory: one float tensor (its mmapped pages, released right after it is quantized) plus the
quantization temporaries plus the output shard being filled (at most `max_shard_bytes`) for
`quantize_checkpoint`, or plus the quantized model for `load_quantized`. Never the float model.

Which tensors are quantized mirrors `quantize_`: with a `model` (any module, usually built on `meta`; only its
structure is used) exactly `quantize_`'s selection on it (every nn.Linear, `FqnToConfig` names, tied weights);
without one, every 2-D floating ``*.weight`` tensor whose module name is not an embedding's (`is_linear_weight`).
`filter_fn(name, shape)` replaces that default: it is asked about every ``*.weight`` tensor (with a model: each
module's weight, and the module's config then checks it as `quantize_` would). The result is bit-identical to
`quantize_` on the float model loaded in memory.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from affineq import safetensors as _st
from affineq._checkpoint_writer import (
    INDEX_FILE,
    SINGLE_FILE,
    ShardWriter,
    check_dst,
    commit,
    nbytes,
    side_files,
    source_hf_config,
    write_side_files,
)
from affineq._meta_buffers import meta_tensors, plan_meta_buffers
from affineq._untrusted import inside, read_json
from affineq.algorithms import AlgorithmConfig
from affineq.configs import QuantConfig
from affineq.expert_weights import is_expert_module, quantize_expert_weight
from affineq.experts import use_affineq_experts
from affineq.plan import (
    FqnToConfig,
    ModelConfig,
    QuantizationError,
    Snapshot,
    handler_for,
    parameter_owners,
    plan,
    raise_problems,
    weight_config,
)
from affineq.process_memory import release_float_copy, trim_heap
from affineq.quantize import replace_parameters
from affineq.recurrent import RECURRENT_TYPES
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QuantSpec

__all__ = ["quantize_checkpoint", "load_quantized", "is_linear_weight", "QuantizedCheckpoint"]

SelectFn = Callable[[str, tuple[int, ...]], bool]
# The shard being filled is held in memory until written: it bounds quantize_checkpoint's peak (an 8B model at
# int4 g32: ~0.6 GB above the interpreter with 512 MiB shards, over 2 GB with 2 GiB ones).
DEFAULT_MAX_SHARD_BYTES = 512 * 2**20
#: Elements per row chunk when a weight with row-local qparams is quantized (16 MiB of fp32 temporaries).
CHUNK_ELEMENTS = 1 << 20

# safetensors dtype codes -> torch dtypes (for planning from the headers, before any data is read)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
           "U64": torch.uint64, "BOOL": torch.bool}
# module names of embeddings in common model families: their 2-D weights are looked up, not multiplied
_EMBEDDING = re.compile(r"(^|.*\.)(\w*embed\w*|wte|wpe|shared)$")


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """The default selection without a model: a 2-D ``*.weight`` whose module is not an embedding by name
    (``*embed*``, ``wte``, ``wpe``, ``shared``). Pass `model=` for a decision by module type instead."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and len(shape) == 2 and not _EMBEDDING.fullmatch(module)


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """What `quantize_checkpoint` wrote: `files` (paths), `quantized` (names of the quantized weights),
    `float_bytes` / `quantized_bytes` (those weights before and after), `src_bytes` / `dst_bytes` (all tensors
    read / written)."""

    files: tuple[str, ...]
    quantized: tuple[str, ...]
    float_bytes: int
    quantized_bytes: int
    src_bytes: int
    dst_bytes: int


# -- the source checkpoint (headers only) ----------------------------------------------------------------------


@dataclass
class _Source:
    files: list[Path]
    keys: dict[str, tuple[Path, tuple[int, ...], torch.dtype]]  # key -> (file, shape, dtype)
    meta: dict | None  # merged "affineq" metadata of a quantized checkpoint
    weight_map: dict[str, Path] | None = None  # the index's tensor -> file, if there is one


def _safetensors():
    return _st._import_safetensors()


def _files(src: str | os.PathLike) -> tuple[list[Path], dict[str, Path] | None]:
    """(the checkpoint's safetensors files, the index's tensor -> file map or None). Every file named by the
    index, and model.safetensors, must lie inside the directory after resolving symlinks (ValueError)."""
    path = Path(src)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"src={os.fspath(src)!r} is not a .safetensors file; pass a checkpoint directory or "
                             "a .safetensors file")
        return [path], None
    if not path.is_dir():
        raise ValueError(f"src={os.fspath(src)!r} does not exist; pass a checkpoint directory holding "
                         f"{SINGLE_FILE} or {INDEX_FILE}")
    index = path / INDEX_FILE
    if index.is_file():
        raw = read_json(inside(path, INDEX_FILE, f"{index}"))
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index} is not a safetensors index (a 'weight_map' object of tensor name -> file "
                             "name)")
        names = sorted(set(weight_map.values()))
        files = {n: inside(path, n, f"{index}: weight_map file") for n in names}
        missing = [n for n in names if not files[n].is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {missing[:5]}")
        return [files[n] for n in names], {k: files[v] for k, v in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        return [inside(path, SINGLE_FILE, os.fspath(path / SINGLE_FILE))], None
    raise ValueError(f"src={os.fspath(src)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass a safetensors "
                     "checkpoint directory (save_pretrained writes one) or a .safetensors file")


def _open_source(src: str | os.PathLike) -> _Source:
    st = _safetensors()
    files, weight_map = _files(src)
    source = _Source(files, {}, None, weight_map)
    for path in source.files:
        try:
            with _st.open_file(path) as f:
                meta = _st.parse_metadata(f.metadata(), str(path))
                for key in f.keys():
                    sl = f.get_slice(key)
                    if key in source.keys:
                        raise ValueError(f"tensor {key!r} is in both {source.keys[key][0]} and {path}")
                    source.keys[key] = (path, tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype(), torch.uint8))
        except st.SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}): it is truncated or corrupted") from None
        if meta is not None:
            source.meta = _st.merge_metadata(source.meta, meta, str(path))
    for key, path in (weight_map or {}).items():
        if key not in source.keys or source.keys[key][0] != path:
            raise ValueError(f"{os.fspath(src)}/{INDEX_FILE} maps tensor {key!r} to {path.name}, which lacks it; a "
                             "shard is truncated or was replaced, or the index was edited: download the checkpoint "
                             "again")
    return source


def _read(source: _Source) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every tensor of the checkpoint, file by file. Each tensor is a view of the file's
    mapping: its pages become resident as they are read."""
    for path in source.files:
        with _st.open_file(path) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


# -- which tensors to quantize ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    config: QuantConfig
    module: nn.Module  # what the config's weight_spec sees (the model's module, or a meta nn.Linear)


def _meta_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if callable(model):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"model=... factory returned {type(built).__name__}; it must return an nn.Module")
        return built
    raise TypeError(f"model must be an nn.Module (e.g. built under `with torch.device('meta'):`) or a factory "
                    f"returning one, got {type(model).__name__}")


def _check_streamable(config: QuantConfig, fqn: str, module: nn.Module) -> None:
    if isinstance(config, AlgorithmConfig) or getattr(config, "needs_calibration", False):
        raise QuantizationError(f"{type(config).__name__} ({fqn or '<root>'}) needs calibration data or a whole-model "
                                "pass, which a tensor-by-tensor quantizer cannot give: load the float model and run "
                                "affineq.quantize_(model, config, calibration_data=...)")
    if handler_for(config) is not replace_parameters or isinstance(module, RECURRENT_TYPES):
        raise QuantizationError(f"{type(config).__name__} replaces the module {fqn or '<root>'} "
                                f"({type(module).__name__}) rather than its weights; the streaming quantizer only "
                                "replaces weights: quantize that module with affineq.quantize_, or leave it float "
                                "(FqnToConfig {name: None} or filter_fn)")


def _targets_from_model(source: _Source, config: QuantConfig, model: nn.Module,
                        filter_fn: SelectFn | None) -> dict[str, _Target]:
    if isinstance(config, ModelConfig):
        config = config.to_fqn_config(model)
    module_filter = None
    if filter_fn is not None:
        def module_filter(module: nn.Module, fqn: str) -> bool:
            w = module._parameters.get("weight")
            return w is not None and bool(filter_fn(f"{fqn}.weight" if fqn else "weight", tuple(w.shape)))
    steps, problems = plan(model, config, module_filter)
    raise_problems(config, problems)
    by_param: dict[int, _Target] = {}
    for step in steps:
        _check_streamable(step.config, step.fqn, step.module)
        for pname in step.config.parameter_names(step.module):
            by_param.setdefault(id(step.module._parameters[pname]), _Target(step.config, step.module))
    params = dict(model.named_parameters(remove_duplicate=False))
    if params and not any(k in params for k in source.keys):
        raise ValueError(f"model= shares no parameter name with the checkpoint (model: {next(iter(params))!r}, file: "
                         f"{next(iter(source.keys), None)!r}); pass the model class the checkpoint was saved from "
                         "(e.g. AutoModelForCausalLM rather than AutoModel)")
    targets = {k: by_param[id(params[k])] for k in source.keys if k in params and id(params[k]) in by_param}
    wrong = [f"{k}: {source.keys[k][1]} in the file, {tuple(params[k].shape)} in the model" for k in targets
             if source.keys[k][1] != tuple(params[k].shape)]
    if wrong:
        raise ValueError(f"model= does not match the checkpoint ({wrong[:3]}); build it with the checkpoint's config")
    return targets


def _targets_by_name(source: _Source, config: QuantConfig, filter_fn: SelectFn | None) -> dict[str, _Target]:
    if isinstance(config, ModelConfig):
        raise ValueError(f"{type(config).__name__} plans over the model's modules: pass model=<the model built on "
                         "the meta device> (or a factory)")
    targets, problems = {}, []
    linear_stub, other_stub = nn.Linear(1, 1, bias=False, device="meta"), nn.Module()
    def explicit_param(key: str) -> bool:
        return isinstance(config, FqnToConfig) and key in config.fqn_to_config

    for key, (_, shape, dtype) in source.keys.items():
        if not dtype.is_floating_point:
            continue
        fqn, _, leaf = key.rpartition(".")
        chosen = filter_fn(key, shape) if filter_fn is not None and leaf == "weight" else None
        # the planner decides, on a stub of the type the name implies (a Linear: `is_linear_weight`)
        cfg, _ = weight_config(config, fqn, linear_stub if is_linear_weight(key, shape) else other_stub, key,
                               selected=chosen, on_stub=True)
        if cfg is None or (leaf != "weight" and not explicit_param(key)):
            continue  # as `plan`: a layer's config quantizes its weight; other tensors only when named exactly
        cfg = dataclasses.replace(cfg, param_names=None)
        if len(shape) != 2:
            problems.append((key, f"it is {len(shape)}-D {shape}; without a model only 2-D (Linear) weights can be "
                                  "quantized: pass model=<the model on the meta device>"))
            continue
        module = nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=dtype)
        why = cfg.check(module)
        if why is None:
            _check_streamable(cfg, fqn, module)
            targets[key] = _Target(cfg, module)
        else:
            problems.append((key, why))
    raise_problems(config, problems)
    return targets


def _targets(source: _Source, config: QuantConfig, model, filter_fn: SelectFn | None) -> dict[str, _Target]:
    if not isinstance(config, QuantConfig) or isinstance(config, type):
        raise TypeError(f"config must be an affineq config instance (e.g. Int4WeightOnlyConfig()), got {config!r}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable filter_fn(name, shape) -> bool, got {filter_fn!r}")
    if model is not None:
        return _targets_from_model(source, config, model, filter_fn)
    return _targets_by_name(source, config, filter_fn)


# -- quantizing one weight in row chunks ---------------------------------------------------------------------


def quantize_weight(config: QuantConfig, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
    """`config.quantize_weight(weight, module)`, bit for bit, with temporaries bounded by `CHUNK_ELEMENTS`.

    `from_spec` holds several full-size fp32 temporaries (the scaled, rounded, clamped weight: ~4x an fp32
    weight). Where the qparams are row-local (block_size[0] == 1: per row, per group) the codes of a row
    depend on that row only, so `from_spec(..., chunk_rows=)` computes them chunk by chunk and packs once: the
    temporaries shrink to one chunk plus the codes (one byte per weight), and the pages of a memory-mapped
    weight are given back chunk by chunk. Configs with their own `quantize_weight` are quantized whole."""
    if weight.dim() == 3 and is_expert_module(module):  # MoE experts: one expert (2-D) at a time
        return quantize_expert_weight(config, weight, module)
    if type(config).quantize_weight is not QuantConfig.quantize_weight or weight.dim() != 2:
        return config.quantize_weight(weight, module)
    spec = config.weight_spec(weight, module)
    rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    return AffineQuantizedTensor.from_spec(weight, spec, config.qparam_options(), chunk_rows=rows)


def _named(key: str, source: _Source, e: ValueError) -> ValueError:
    """`e` again, naming the checkpoint tensor it came from."""
    msg = f"tensor {key!r} of {source.keys[key][0]}: {e}"
    return QuantizationError(msg) if isinstance(e, QuantizationError) else ValueError(msg)


def _manifest(src: str | os.PathLike) -> list[str] | None:
    """The quantized weights config.json's affineq `quantization_config` lists (None: no such list)."""
    path = Path(src)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    cfg = read_json(inside(path, "config.json", os.fspath(path / "config.json")))
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    names = qc.get("quantized_weights") if isinstance(qc, dict) and qc.get("quant_method") == "affineq" else None
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{path / 'config.json'}: quantization_config.quantized_weights must be a list of weight "
                         f"names, got {type(names).__name__}; the file was edited")
    return names


# -- the public entry points ----------------------------------------------------------------------------------


def quantize_checkpoint(
    src_dir: str | os.PathLike,
    dst_dir: str | os.PathLike,
    config: QuantConfig,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    filter_fn: SelectFn | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> QuantizedCheckpoint:
    """Quantize the float safetensors checkpoint `src_dir` (``model.safetensors``, a sharded
    ``model.safetensors.index.json`` checkpoint, or one ``.safetensors`` file) into `dst_dir`, one tensor at
    a time, without ever holding the float model.

    The selected weights (see the module docstring: `model`, `filter_fn`) are quantized with `config` exactly
    as `quantize_` would; every other tensor is copied as is. Everything is validated from the headers before
    anything is read (`QuantizationError` lists every weight the config cannot take). The output is affineq's
    safetensors format (`affineq.safetensors.load_file` reads each shard; `load_quantized` fills a model) in
    shards of at most `max_shard_bytes` (a larger single tensor gets its own), named and indexed as
    transformers names them. The directory's other files are copied, config.json with the affineq
    `quantization_config`, so transformers' `from_pretrained(dst_dir)` loads it too (`import affineq` first).

    model: a module (only its structure is read; build it under ``with torch.device("meta"):``) or a
    zero-argument factory called on the meta device, e.g.
    ``lambda: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src_dir))``; its parameter names
    must be the checkpoint's.
    Peak memory: one float tensor, its quantization temporaries and one output shard.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int (bytes per output shard), got {max_shard_bytes!r}")
    source = _open_source(src_dir)
    if source.meta is not None:
        raise ValueError(f"src_dir={os.fspath(src_dir)!r} is already an affineq-quantized checkpoint; quantize the "
                         "float checkpoint (or load this one with affineq.load_quantized)")
    targets = _targets(source, config, None if model is None else _meta_model(model), filter_fn)
    if not targets:
        raise QuantizationError(f"{type(config).__name__} selects no weight of {os.fspath(src_dir)!r} (no 2-D *.weight "
                                "outside embeddings, or filter_fn / model= chose none); the output would be the input")
    src = Path(src_dir)
    hf_config = source_hf_config(src) if src.is_dir() else None
    if src.is_dir():
        side_files(src)  # refuse links leading outside before anything is written
    dst = Path(dst_dir)
    check_dst(source.files, dst)
    made_dst = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(dst, max_shard_bytes)
    quantized = [k for k in source.keys if k in targets]
    float_bytes = quantized_bytes = src_bytes = 0
    try:
        for key, t in _read(source):
            src_bytes += nbytes(t)
            target = targets.get(key)
            if target is None:
                writer.add(key, t)
                continue
            try:
                q = quantize_weight(target.config, t, target.module)
            except ValueError as e:  # NaN / inf weights
                raise _named(key, source, e) from None
            float_bytes += nbytes(t)
            quantized_bytes += nbytes(q)
            release_float_copy(t)
            del t
            writer.add(key, q)
        moves = writer.close()
        shards = [final for _, final in moves]
        if src.is_dir():
            moves += write_side_files(src, writer, hf_config, config, quantized)
        commit(moves)  # all or nothing: a failing commit has put back every file it replaced
    except BaseException as e:  # leave nothing a later load could take for a checkpoint
        for part in writer.written:
            part.unlink(missing_ok=True)
        if made_dst:
            shutil.rmtree(dst, ignore_errors=True)
        if isinstance(e, OSError):
            err = OSError(f"quantize_checkpoint: writing {os.fspath(dst)!r} failed ({e}); it was left as it was "
                          "(is the disk full?)")
            for note in getattr(e, "__notes__", ()):  # a backup commit could not move back: where it is
                err.add_note(note)
            raise err from None
        raise
    files = [f for f in shards if f.suffix == ".safetensors"]
    return QuantizedCheckpoint(tuple(str(f) for f in files), tuple(quantized), float_bytes, quantized_bytes,
                               src_bytes, writer.dst_bytes)


def load_quantized(
    model: nn.Module,
    src: str | os.PathLike,
    config: QuantConfig | None = None,
    *,
    filter_fn: SelectFn | None = None,
    allow_unchecked: bool = False,
) -> nn.Module:
    """Fill `model` (usually built on the meta device) from the safetensors checkpoint `src`, one tensor at a
    time, and return it.

    `src` may be a checkpoint `quantize_checkpoint` (or `save_file`, or transformers with affineq) wrote: its
    quantized weights are rebuilt as they were stored. With `config`, float weights are quantized as they are
    read, selected as `quantize_(model, config)` selects them (`filter_fn(name, shape)` replaces that choice),
    so the model never holds its float weights: peak memory is one float tensor plus the quantized model.
    Every parameter and persistent buffer must come from the file and every tensor of the file must have a
    place in the model (ValueError lists what does not, before anything changes); tied parameters are filled
    once for all their names. Non-persistent buffers left on the meta device (rotary tables, position ids)
    are computed on the CPU by the module's own initialisation (a transformers model's `_init_weights`, else
    `reset_parameters`); ValueError names any that nothing can compute, before anything changes.

    An affineq checkpoint is checked as it is read: every tensor against its checksum (a tensor without one
    is refused unless `allow_unchecked=True`: transformers' save_pretrained checksums quantized weights only),
    and every weight config.json's `quantized_weights` lists must be stored quantized. Every file must lie
    inside `src` after resolving symlinks.

    All or nothing: shapes are checked from the headers before anything is read, and a load that fails later (a
    checksum, a NaN weight while quantizing, a buffer nothing fills) puts back every parameter and buffer it
    replaced, so the model is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_quantized(model, ...): model must be an nn.Module, got {type(model).__name__}")
    source = _open_source(src)
    if source.meta is not None:
        _st.check_coverage(source.keys, source.meta["checksums"], os.fspath(src), allow_unchecked=allow_unchecked)
    entries = (source.meta or {}).get("quantized", {})
    _st.check_manifest(_manifest(src), entries, os.fspath(src))
    both = sorted(k for k in source.keys if k in entries)
    if both:
        raise ValueError(f"load_quantized: {os.fspath(src)!r} stores {both[:5]} both as plain tensors and as quantized "
                         "entries; the checkpoint was edited (affineq never writes both)")
    targets = {} if config is None else _targets(source, config, model, filter_fn)
    slots = _slots(model)
    names = {k.partition(_st.SEP)[0] if k.partition(_st.SEP)[0] in entries else k for k in source.keys}
    unexpected = sorted(names - set(slots))
    filled = {id(slots[n][2]) for n in names if n in slots}
    missing = sorted(n for n, (_, _, t) in slots.items() if id(t) not in filled)
    if unexpected or missing:
        raise ValueError(f"load_quantized: the checkpoint {os.fspath(src)!r} does not match the model: tensors with no "
                         f"place in the model {unexpected[:5]}, model tensors not in the checkpoint {missing[:5]} "
                         "(build the model the checkpoint was saved from; its state_dict names must be the file's)")
    buffers, impossible = plan_meta_buffers(model)
    if impossible:
        raise ValueError(f"load_quantized: non-persistent buffers {impossible} are on the meta device and neither the "
                         "checkpoint (which never holds them) nor their module's initialisation can fill them; build "
                         "those modules on the CPU")
    _check_shapes(source, entries, slots)  # before anything is read or placed
    owners = parameter_owners(model)
    # A checksum, a NaN weight (quantizing while loading) or a buffer initialiser can still fail after some tensors
    # are placed: put every replaced parameter and buffer back then. _place only ever assigns new tensors (never
    # copies into the model's), so restoring the references restores every value too.
    snapshot = Snapshot(model)
    try:
        _place_all(source, entries, targets, slots, owners, src)
        buffers.run()
        left = meta_tensors(model)
        if left:
            raise ValueError(f"load_quantized: {left} are still on the meta device after loading; fill them (or build "
                             "their modules on the CPU) before running the model")
    except BaseException:
        snapshot.restore()
        raise
    trim_heap()
    use_affineq_experts(model)  # quantized MoE expert weights run through grouped_linear
    return model


def _place_all(source: _Source, entries: dict, targets: dict[str, _Target], slots: dict, owners,
               src: str | os.PathLike) -> None:
    """Read every tensor of the checkpoint and place it in its slot: quantized entries rebuilt (checksums verified)
    once all their tensors are read, selected float weights quantized with their config, the rest as they are."""
    partial: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _read(source):
        name, _, inner = key.partition(_st.SEP)
        if name in entries and inner:
            got = partial.setdefault(name, {})
            got[inner] = t
            if len(got) < len(entries[name]["tensors"]):
                continue
            del partial[name]
            where = str(source.keys[key][0])
            _st.verify_checksums({f"{name}{_st.SEP}{i}": v for i, v in got.items()}, source.meta["checksums"], where)
            _place(slots[name], owners, _st.build_entry(name, entries[name], got, where), quantized=True)
            continue
        if source.meta is not None:  # a plain tensor (float weight, norm, bias): its checksum too, before placing
            _st.verify_checksums({key: t}, source.meta["checksums"], str(source.keys[key][0]))
        if key in targets:
            try:
                q = quantize_weight(targets[key].config, t, targets[key].module)
            except ValueError as e:  # NaN / inf weights
                raise _named(key, source, e) from None
            release_float_copy(t)
            _place(slots[key], owners, q, quantized=True)
        else:
            _place(slots[key], owners, t, quantized=False)
        del t
    if partial:
        raise ValueError(f"{os.fspath(src)!r}: quantized entries {sorted(partial)[:5]} lack some of their tensors; the "
                         "checkpoint is truncated or was edited")


def _check_shapes(source: _Source, entries: dict, slots: dict) -> None:
    """ValueError naming every model tensor whose shape differs from what the checkpoint's header says it holds
    (a quantized entry: its spec's shape), before anything is read. An entry whose spec cannot be read is left
    to `build_entry`, which names what is wrong with it."""
    problems = []
    for key, (_, shape, _) in source.keys.items():
        name, _, inner = key.partition(_st.SEP)
        if name in entries and inner:
            continue
        if key in slots:
            problems += _shape_problem(key, slots[key], shape)
    for name, entry in entries.items():
        if name not in slots:
            continue
        try:
            shape = QuantSpec.from_dict(entry["spec"]).logical_shape
        except (ValueError, KeyError, TypeError):
            continue
        problems += _shape_problem(name, slots[name], shape)
    if problems:
        raise ValueError("load_quantized: {} tensor(s) of the model have other shapes than the checkpoint's:\n{}\n"
                         "Build the model with the checkpoint's configuration (nothing was loaded)".format(
                             len(problems), "\n".join(problems)))


def _shape_problem(name: str, slot: tuple[nn.Module, str, torch.Tensor], shape) -> list[str]:
    module, attr, old = slot
    if tuple(shape) == tuple(old.shape):
        return []
    return [f"  - {name} ({type(module).__name__}.{attr}): the checkpoint's tensor has shape {tuple(shape)}, the "
            f"model's {tuple(old.shape)}"]


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """{state_dict name: (module, attribute, current tensor)} for every parameter (tied ones under each of
    their names) and persistent buffer."""
    out = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        prefix = f"{fqn}." if fqn else ""
        for n, p in m._parameters.items():
            if p is not None:
                out[prefix + n] = (m, n, p)
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out[prefix + n] = (m, n, b)
    return out


def _place(slot: tuple[nn.Module, str, torch.Tensor], owners, value: torch.Tensor, *, quantized: bool) -> None:
    module, attr, old = slot
    if tuple(value.shape) != tuple(old.shape):
        raise ValueError(f"{type(module).__name__}.{attr}: the checkpoint's tensor has shape {tuple(value.shape)}, the "
                         f"model's {tuple(old.shape)}; build the model with the checkpoint's configuration")
    if attr in module._buffers:
        module._buffers[attr] = value
        return
    new = nn.Parameter(value, requires_grad=False if quantized else old.requires_grad)
    for owner, owner_attr in owners.get(id(old), [(module, attr)]):
        owner._parameters[owner_attr] = new
