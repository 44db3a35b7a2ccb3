"""safetensors files for state_dicts holding `AffineQuantizedTensor`s: `save_file` / `load_file`, the names and
meaning of `safetensors.torch`'s, with no pickle anywhere.

A quantized entry `name` is stored as its inner tensors (`AffineQuantizedTensor.tensors`) under the keys
``name:qdata``, ``name:scale``, ... and its `QuantSpec` as JSON in the header metadata, under the key
``"affineq"``:

    {"version": 1, "writer": "affineq 0.1.0",
     "quantized": {name: {"spec": QuantSpec.to_dict(), "tensors": [inner names],
                          "layout": "int4_cpu", "dtypes": {inner name: "bfloat16"}}},   # layout/dtypes: optional
     "checksums": {key: crc32 hex of the stored bytes}}

Device-specific packed layouts (aten's `int4_cpu`, whose byte order may depend on the CPU) are written in
their portable format (`plain`) and repacked on load ("layout" names the layout to rebuild; the save checks
that the repack reproduces every stored tensor bit for bit, else the layout is stored as it is and its spec
names it). Loading checks everything it reads: the file itself (a truncated file is a `ValueError`), the
metadata version, each spec, the names, shapes and dtypes of the inner tensors (`from_tensors`), the CRC32 of
every tensor (an edited byte fails; a tensor without a checksum is refused unless the caller passes
`allow_unchecked=True`, so deleting checksums does not switch the check off), integer codes inside
[quant_min, quant_max] and finite float qparams. `save_file` writes a hidden temporary file and renames it
into place, so a failed write (disk full) leaves no file, or the previous one, at `path`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import zlib
from typing import Any

import torch

from affineq._untrusted import parse_json
from affineq.bitpack import unpack_codes
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.formats import get_format
from affineq.tensor.spec import QuantSpec

__all__ = ["FILE_VERSION", "METADATA_KEY", "SEP", "OPEN_EVENT", "save_file", "load_file", "open_file",
           "flatten_state_dict", "unflatten_state_dict", "parse_metadata", "merge_metadata", "verify_checksums",
           "check_coverage", "check_manifest"]

#: Version of the "affineq" metadata encoding; files with a newer one are refused with both versions named.
FILE_VERSION = 1
METADATA_KEY = "affineq"
#: Separates a quantized entry's name from its inner tensor's name in the file's keys ("w:qdata").
SEP = ":"
#: `sys.audit` event raised with the path of every safetensors file affineq opens (safetensors opens files in
#: Rust, which Python's own "open" audit event does not see).
OPEN_EVENT = "affineq.safetensors.open"


def _affineq_version() -> str:
    from affineq._version import __version__

    return __version__


def _import_safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ImportError("affineq.safetensors needs the safetensors package: pip install safetensors "
                          "(or pip install affineq[models])") from None
    return safetensors


def open_file(path: str | os.PathLike, device: str = "cpu"):
    """`safetensors.safe_open(path)` (framework "pt"), announced to audit hooks as `OPEN_EVENT`."""
    st = _import_safetensors()
    sys.audit(OPEN_EVENT, os.fspath(path))
    return st.safe_open(os.fspath(path), framework="pt", device=device)


def _crc(t: torch.Tensor) -> str:
    """CRC32 (8 hex digits) of the bytes of `t` as safetensors stores them (row-major, little-endian)."""
    b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return format(zlib.crc32(b.numpy()), "08x")


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtype(name: Any, where: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype name")
    return d


# -- saving -------------------------------------------------------------------------------------------


def _portable(w: AffineQuantizedTensor) -> tuple[AffineQuantizedTensor, dict]:
    """(tensor to store, extra entry fields): a device-specific layout in its portable format plus what
    rebuilds it exactly, or the tensor itself."""
    if get_format(w.spec.fmt).portable is None:
        return w, {}
    p = w.to_portable()
    dtypes = {n: _dtype_name(t.dtype) for n, t in w.tensors.items()}
    try:
        back = _repack(p, w.spec.fmt, dtypes, "check")
        exact = all(torch.equal(back.tensors[n], t) for n, t in w.tensors.items())
    except (ValueError, RuntimeError):
        exact = False
    return (p, {"layout": w.spec.fmt, "dtypes": dtypes}) if exact else (w, {})


def _repack(p: AffineQuantizedTensor, layout: str, dtypes: dict, name: str) -> AffineQuantizedTensor:
    """`p` (portable) repacked into `layout`, each inner tensor cast to its recorded dtype."""
    try:
        b = p.to_format(layout)
        tensors = {n: t.to(_dtype(dtypes.get(n, _dtype_name(t.dtype)), f"{name}: dtypes[{n!r}]"))
                   for n, t in b.tensors.items()}
        return AffineQuantizedTensor.from_tensors(tensors, b.spec)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{name}: the file stores this tensor portably and asks to repack it as {layout!r}, which "
                         f"failed on this machine ({e}); load it where {layout!r} is available, or save it with "
                         "packing_format='plain'") from None


def flatten_state_dict(state_dict: dict[str, torch.Tensor], *, checksum_plain: bool = True,
                       skip: frozenset[str] = frozenset()) -> tuple[dict[str, torch.Tensor], dict]:
    """(plain tensors by file key, the "affineq" metadata dict) for `state_dict`. Quantized entries become
    ``name:inner`` keys and are checksummed; plain tensors keep their name (checksummed if `checksum_plain`).
    `skip`: names to leave out (e.g. tied weights that a loader re-ties)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of name -> tensor, got {type(state_dict).__name__}")
    out: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    sums: dict[str, str] = {}
    plain: list[str] = []
    for name, v in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"state_dict keys must be str, got {name!r}")
        if name in skip:
            continue
        if isinstance(v, AffineQuantizedTensor):
            w, extra = _portable(v)
            for inner, t in w.tensors.items():
                key = f"{name}{SEP}{inner}"
                if key in state_dict:
                    raise ValueError(f"state_dict has both a quantized {name!r} and a tensor named {key!r}; rename it")
                out[key] = t.detach().contiguous()
                sums[key] = _crc(t)
            entries[name] = {"spec": w.spec.to_dict(), "tensors": list(w.tensors), **extra}
        elif isinstance(v, torch.Tensor):
            t = v.detach()
            if type(t) is not torch.Tensor:
                t = t.as_subclass(torch.Tensor)
            out[name] = t
            plain.append(name)
            if checksum_plain:
                sums[name] = _crc(t)
        else:
            raise TypeError(f"state_dict[{name!r}] is a {type(v).__name__}; save_file stores tensors only")
    clash = [k for k in plain if SEP in k and k.partition(SEP)[0] in entries]
    if clash:
        raise ValueError(f"state_dict keys {clash[:3]} look like the inner tensors of quantized entries "
                         f"({SEP!r} after a quantized name); rename them")
    meta = {"version": FILE_VERSION, "writer": f"affineq {_affineq_version()}", "quantized": entries,
            "checksums": sums}
    return out, meta


def save_file(state_dict: dict[str, torch.Tensor], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
    """Write `state_dict` (plain tensors and AffineQuantizedTensors, e.g. `model.state_dict()`) to the
    safetensors file `path`. `metadata`: extra str -> str header entries (the key "affineq" is reserved)."""
    st = _import_safetensors()
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError("metadata must be a dict of str -> str (as safetensors stores it), or None")
    if metadata and METADATA_KEY in metadata:
        raise ValueError(f"metadata key {METADATA_KEY!r} is reserved for affineq's own entry; rename yours")
    tensors, meta = flatten_state_dict(state_dict)
    header = {"format": "pt", **(metadata or {}), METADATA_KEY: json.dumps(meta, separators=(",", ":"))}
    where = os.fspath(path)
    head, name = os.path.split(where)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")  # hidden: no loader takes it
    try:
        st.torch.save_file(tensors, tmp, metadata=header)
        os.replace(tmp, where)
    except RuntimeError as e:  # shared storage (tied weights), non-contiguous views
        raise ValueError(f"save_file({where!r}): safetensors refused the state_dict: {e}") from None
    except (OSError, st.SafetensorError) as e:  # disk full, file size limit, no permission
        raise OSError(f"save_file({where!r}): writing failed ({e}); nothing was written at {where!r} (is the disk "
                      "full or the directory read-only?)") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# -- loading ------------------------------------------------------------------------------------------


def parse_metadata(header: dict[str, str] | None, where: str) -> dict | None:
    """The validated "affineq" metadata dict of a file's header, or None for a file affineq did not write."""
    if not header or METADATA_KEY not in header:
        return None
    meta = parse_json(header[METADATA_KEY], f"{where}: the {METADATA_KEY!r} metadata")
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: the {METADATA_KEY!r} metadata must be a JSON object, got {type(meta).__name__}")
    version, writer = meta.get("version"), meta.get("writer", "an unknown writer")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{where}: the {METADATA_KEY!r} metadata has no valid 'version' (got {version!r})")
    if version > FILE_VERSION:
        raise ValueError(f"{where} was written by {writer} with affineq file format version {version}; this affineq "
                         f"{_affineq_version()} reads versions 1..{FILE_VERSION}: upgrade affineq to load it")
    q, sums = meta.get("quantized"), meta.get("checksums")
    if not isinstance(q, dict) or not isinstance(sums, dict):
        raise ValueError(f"{where}: the {METADATA_KEY!r} metadata needs 'quantized' and 'checksums' objects")
    for name, e in q.items():
        if not (isinstance(e, dict) and isinstance(e.get("spec"), dict) and isinstance(e.get("tensors"), list)
                and e["tensors"] and all(isinstance(n, str) for n in e["tensors"])):
            raise ValueError(f"{where}: quantized entry {name!r} needs a 'spec' object and a 'tensors' list of names")
        if "layout" in e and not (isinstance(e["layout"], str) and isinstance(e.get("dtypes"), dict)):
            raise ValueError(f"{where}: quantized entry {name!r}: 'layout' must be a format name with 'dtypes'")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise ValueError(f"{where}: 'checksums' must map tensor keys to crc32 hex strings")
    return meta


def merge_metadata(merged: dict | None, meta: dict, where: str) -> dict:
    """The "affineq" metadata of a sharded checkpoint: the union of its shards' (`parse_metadata` dicts). A shard
    may list every entry (transformers' save_pretrained writes the same metadata into each) or only its own
    (`affineq.quantize_checkpoint`); an entry or checksum listed by two shards must agree (ValueError)."""
    if merged is None:
        return {**meta, "quantized": dict(meta["quantized"]), "checksums": dict(meta["checksums"])}
    for field in ("quantized", "checksums"):
        for k, v in meta[field].items():
            if merged[field].setdefault(k, v) != v:
                raise ValueError(f"{where}: its affineq metadata for {k!r} differs from another shard's; the "
                                 "checkpoint mixes files from different saves")
    return merged


def verify_checksums(tensors: dict[str, torch.Tensor], sums: dict[str, str], where: str) -> None:
    """ValueError unless every key of `sums` present in `tensors` has that CRC32."""
    for key, want in sums.items():
        t = tensors.get(key)
        if t is not None and _crc(t) != want:
            raise ValueError(f"{where}: tensor {key!r} fails its checksum (crc32 {_crc(t)} != {want}): its bytes were "
                             "edited or corrupted; write the file again")


def check_coverage(keys, sums: dict[str, str], where: str, *, allow_unchecked: bool = False) -> None:
    """ValueError unless every key of `keys` has a checksum in `sums` (or the caller opted out)."""
    if allow_unchecked:
        return
    unchecked = sorted(k for k in keys if k not in sums)
    if unchecked:
        raise ValueError(f"{where}: tensors {unchecked[:5]} have no checksum ({len(unchecked)} in all), so edited "
                         "bytes in them would load unnoticed: the metadata was edited, or another program wrote the "
                         "file (transformers' save_pretrained checksums quantized weights only: load its directory "
                         "with from_pretrained); pass allow_unchecked=True to load it anyway")


def check_manifest(manifest: list[str] | None, entries, where: str) -> None:
    """ValueError naming every weight the manifest lists as quantized that the files do not hold quantized."""
    lost = sorted(set(manifest or ()) - set(entries))
    if lost:
        raise ValueError(f"{where}: config.json lists quantized weights that the checkpoint's files lack: {lost[:5]} "
                         f"({len(lost)} in all); a shard was replaced or edited: download or save it again")


def _check_values(w: AffineQuantizedTensor, name: str) -> None:
    """Cheap checks on values: integer codes of `plain` and `dense` inside [quant_min, quant_max]; finite float
    qparams; no NaN (0xFF) among e8m0 scale bytes."""
    s = w.spec
    codes = None
    if not s.target.is_float and w.qdata.numel():
        if s.fmt == "plain":
            codes = w.qdata
        elif s.fmt == "dense" and s.quant_max - s.quant_min < 2 ** s.target.bits - 1:
            # dense stores u = q - quant_min in `bits` bits: a narrower spec range can be exceeded
            u = unpack_codes(w.qdata, s.target.bits, *s.shape)
            codes = u.to(torch.int32) + s.quant_min
    if codes is not None:
        lo, hi = int(codes.min()), int(codes.max())
        if lo < s.quant_min or hi > s.quant_max:
            raise ValueError(f"{name}: codes span [{lo}, {hi}], outside the spec's range [{s.quant_min}, "
                             f"{s.quant_max}]; the file was edited or corrupted")
    for inner, t in w.tensors.items():
        if inner != "qdata" and t.dtype.is_floating_point and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: {inner} holds inf or NaN; the file was edited or corrupted")
        if (s.scale_type is not None and inner in ("scale", "shared_exp") and t.dtype == torch.uint8 and t.numel()
                and bool((t == 0xFF).any())):
            raise ValueError(f"{name}: {inner} holds the e8m0 byte 0xFF (NaN); the file was edited or corrupted")


def build_entry(name: str, entry: dict, tensors: dict[str, torch.Tensor], where: str) -> AffineQuantizedTensor:
    """The AffineQuantizedTensor of metadata `entry` from its inner tensors {inner name: tensor}, validated
    (spec, names, shapes, dtypes, values) and repacked into its recorded layout."""
    try:
        spec = QuantSpec.from_dict(entry["spec"])
    except ValueError as e:
        raise ValueError(f"{where}: quantized entry {name!r}: {e}") from None
    missing = [n for n in entry["tensors"] if n not in tensors]
    if missing or set(tensors) != set(entry["tensors"]):
        raise ValueError(f"{where}: quantized entry {name!r} lists tensors {entry['tensors']} but the file holds "
                         f"{sorted(tensors)}; the file is truncated or was edited")
    try:
        w = AffineQuantizedTensor.from_tensors({n: tensors[n] for n in entry["tensors"]}, spec)
    except ValueError as e:
        raise ValueError(f"{where}: quantized entry {name!r}: {e}") from None
    _check_values(w, f"{where}: {name!r}")
    if "layout" in entry:
        w = _repack(w, entry["layout"], entry["dtypes"], f"{where}: {name!r}")
    return w


def unflatten_state_dict(tensors: dict[str, torch.Tensor], meta: dict | None, where: str = "state_dict", *,
                         allow_unchecked: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of `flatten_state_dict` on a whole file's tensors (`meta` from `parse_metadata`). Every tensor
    must have a checksum unless `allow_unchecked` (then a file without affineq metadata is read as it is)."""
    if meta is None:
        odd = [k for k in tensors if SEP in k]
        if odd:
            raise ValueError(f"{where} has keys like affineq's quantized tensors ({odd[:3]}) but no {METADATA_KEY!r} "
                             "metadata: the header was edited; write the file again with affineq.safetensors")
        if not allow_unchecked and tensors:
            raise ValueError(f"{where} has no {METADATA_KEY!r} metadata, so none of its tensors can be checked: it "
                             "was not written by affineq.safetensors.save_file, or its header was edited; pass "
                             "allow_unchecked=True to read a safetensors file another program wrote")
        return dict(tensors)
    verify_checksums(tensors, meta["checksums"], where)
    check_coverage(tensors, meta["checksums"], where, allow_unchecked=allow_unchecked)
    absent = sorted(k for k in meta["checksums"] if k not in tensors)
    if absent:
        raise ValueError(f"{where} lacks tensors its metadata lists ({absent[:5]}); the file is truncated or edited")
    out: dict[str, torch.Tensor] = {}
    claimed: set[str] = set()
    for name, entry in meta["quantized"].items():
        keys = {k.partition(SEP)[2]: k for k in tensors if k.partition(SEP)[0] == name and SEP in k}
        claimed.update(keys.values())
        out[name] = build_entry(name, entry, {i: tensors[k] for i, k in keys.items()}, where)
    for k, t in tensors.items():
        if k in claimed:
            continue
        if SEP in k and k.partition(SEP)[0] in meta["quantized"]:
            raise ValueError(f"{where}: unexpected tensor {k!r}; the file was edited")
        if k in meta["quantized"]:
            raise ValueError(f"{where}: {k!r} is stored both as a plain tensor and as a quantized entry; the file "
                             "was edited (save_file never writes both)")
        out[k] = t
    return out


def load_file(path: str | os.PathLike, device: str | torch.device = "cpu", *,
              allow_unchecked: bool = False) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `save_file` -> state_dict with AffineQuantizedTensors rebuilt on
    `device`. ValueError for a truncated, edited or newer-version file, and for a tensor without a checksum
    (deleted from the metadata, or a file another program wrote) unless `allow_unchecked=True`: then tensors
    without one are read unchecked (those with one are still checked) and any safetensors file is read."""
    st = _import_safetensors()
    where = os.fspath(path)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load_file({where!r}): device={device!r} is not a torch device ({e})") from None
    if dev.type == "cpu":
        dev = torch.device("cpu")  # safetensors takes "cpu" only, not "cpu:0"
    try:
        with open_file(where, device=str(dev)) as f:
            header = f.metadata()
            meta = parse_metadata(header, where)  # before any tensor is read
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except st.SafetensorError as e:
        raise ValueError(f"{where} is not a readable safetensors file ({e}): it is truncated or corrupted; write it "
                         "again") from None
    return unflatten_state_dict(tensors, meta, where, allow_unchecked=allow_unchecked)
