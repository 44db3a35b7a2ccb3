"""Writing `quantize_checkpoint`'s output directory: shards of quantized and passed-through tensors, the index,
the source's other files and config.json, all under hidden part names first, then renamed into place at once.

The commit is all or nothing for the directory: a file already there under a final name (a tokenizer.json or
config.json of an earlier run) is moved aside before its replacement is renamed in, and moved back if any rename
fails, so a failing `quantize_checkpoint` leaves `dst_dir` holding exactly what it held before.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from affineq import safetensors as _st
from affineq._untrusted import inside, read_json
from affineq.process_memory import release_float_copy, trim_heap
from affineq.tensor.affine import AffineQuantizedTensor

if TYPE_CHECKING:
    from affineq.configs import QuantConfig

__all__ = ["SINGLE_FILE", "INDEX_FILE", "ShardWriter", "commit", "check_dst", "source_hf_config", "side_files",
           "write_side_files", "nbytes"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def nbytes(t: torch.Tensor) -> int:
    return t.storage_bytes() if isinstance(t, AffineQuantizedTensor) else t.numel() * t.element_size()


class ShardWriter:
    """Collects tensors and writes them with `affineq.safetensors.save_file` once the next one would take the
    shard past `max_bytes`; `close()` names the shards as transformers does and writes the index."""

    def __init__(self, dst: Path, max_bytes: int) -> None:
        self.dst, self.max_bytes = dst, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.written: list[Path] = []
        self.dst_bytes = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        n = nbytes(t)
        if self.pending and self.size + n > self.max_bytes:
            self.flush()
        self.pending[key] = t
        self.size += n

    def flush(self) -> None:
        path = self.dst / f".model-{len(self.written) + 1:05d}.safetensors.part"
        _st.save_file(self.pending, path)
        for t in self.pending.values():  # float tensors passed through are views of the source's mapping
            if not isinstance(t, AffineQuantizedTensor):
                release_float_copy(t)
        self.dst_bytes += self.size
        self.written.append(path)
        self.pending, self.size = {}, 0
        trim_heap()

    def close(self) -> list[tuple[Path, Path]]:
        """Write the last shard and the index, all under hidden names; returns (written, final name) pairs
        that `commit` renames into place (shards named as transformers names them)."""
        if self.pending or not self.written:
            self.flush()
        n = len(self.written)
        if n == 1:
            final = [self.dst / SINGLE_FILE]
        else:
            final = [self.dst / f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        moves = list(zip(self.written, final, strict=True))
        if n > 1:
            weight_map = {}
            for part, path in moves:
                with _st.open_file(part) as f:
                    weight_map.update({k: path.name for k in f.keys()})
            index = {"metadata": {"total_size": self.dst_bytes, "format": "affineq"}, "weight_map": weight_map}
            moves.append((self.hidden(INDEX_FILE, json.dumps(index, indent=2)), self.dst / INDEX_FILE))
        return moves

    def hidden(self, name: str, text: str) -> Path:
        """Write `text` to a hidden part file for `name` (removed again if quantize_checkpoint fails)."""
        part = self.dst / f".{name}.part"
        self.written.append(part)
        part.write_text(text)
        return part


def commit(moves: list[tuple[Path, Path]]) -> None:
    """Rename every written part into place, the shards last: a checkpoint is only loadable once complete.

    All or nothing: a file already under a final name is first moved aside to a hidden backup name (a rename in
    the same directory: no copy, no space needed); if any rename fails, the files renamed in are removed and the
    backups moved back, so the directory holds what it held before, and the error propagates. On success the
    backups are removed."""
    done: list[Path] = []
    backups: list[tuple[Path, Path]] = []
    try:
        for part, final in sorted(moves, key=lambda m: m[1].suffix == ".safetensors"):
            if os.path.lexists(final):
                backup = _free_name(final)
                os.replace(final, backup)
                backups.append((backup, final))
            os.replace(part, final)
            done.append(final)
    except BaseException as e:
        for final in done:
            final.unlink(missing_ok=True)
        for backup, final in reversed(backups):
            try:
                os.replace(backup, final)
            except OSError as undo:  # say where the previous file is rather than hide the first error
                e.add_note(f"quantize_checkpoint: could not move {os.fspath(backup)!r} back to {final.name!r} "
                           f"({undo}); the previous {final.name} is there")
        raise
    for backup, _ in backups:
        backup.unlink(missing_ok=True)


def _free_name(final: Path) -> Path:
    """A hidden name beside `final` that nothing uses (a user's file of that name must not be overwritten)."""
    i = 0
    while os.path.lexists(backup := final.with_name(f".{final.name}.affineq-old{i or ''}")):
        i += 1
    return backup


def check_dst(src_files: list[Path], dst: Path) -> None:
    """ValueError if `dst` is a file, already holds a safetensors checkpoint, or is the source's directory."""
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"dst_dir={os.fspath(dst)!r} is a file; pass a directory (it is created if missing)")
    if dst.is_dir() and (list(dst.glob("*.safetensors")) or (dst / INDEX_FILE).exists()):
        raise ValueError(f"dst_dir={os.fspath(dst)!r} already holds a safetensors checkpoint; pass an empty or new "
                         "directory (mixing shards of two checkpoints would load the wrong weights)")
    if any(f.resolve().parent == dst.resolve() for f in src_files):
        raise ValueError("dst_dir must differ from the source directory")


def source_hf_config(src: Path) -> dict | None:
    """The checkpoint directory's transformers config.json, or None; ValueError if it is already quantized."""
    path = src / "config.json"
    if not path.is_file():
        return None
    cfg = read_json(inside(src, "config.json", os.fspath(path)))
    if not isinstance(cfg, dict):
        return None
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) else "?"
        raise ValueError(f"{path} says the checkpoint is already quantized (quant_method {method!r}); "
                         "quantize_checkpoint reads float checkpoints")
    return cfg


_OTHER_WEIGHTS = (".safetensors", ".gguf")  # the float weights again (a GGUF of the same model): not copied


def side_files(src: Path) -> list[Path]:
    """Every other file of the source directory (tokenizer, generation config...), each inside it."""
    return [inside(src, f.name, f"{src}: {f.name}") for f in sorted(src.iterdir())
            if f.is_file() and f.suffix not in _OTHER_WEIGHTS and f.name not in (INDEX_FILE, "config.json")]


def write_side_files(src: Path, writer: ShardWriter, hf_config: dict | None, config: QuantConfig,
                     quantized: list[str]) -> list[tuple[Path, Path]]:
    """The source's other files, and config.json marked quantized as `affineq.hf.AffineqConfig` writes it
    (with `quantized`, the manifest of the quantized weights a load checks), so that transformers'
    `from_pretrained(dst)` loads the quantized checkpoint; as hidden parts, (part, final name) pairs."""
    moves = []
    for f in side_files(src):
        part = writer.dst / f".{f.name}.part"
        writer.written.append(part)
        shutil.copy2(f, part)
        moves.append((part, writer.dst / f.name))
    if hf_config is not None:
        quant = {"quant_method": "affineq", "quant_config": config.to_dict(), "modules_to_not_convert": None,
                 "quantized_weights": sorted(quantized)}
        text = json.dumps({**hf_config, "quantization_config": quant}, indent=2) + "\n"
        moves.append((writer.hidden("config.json", text), writer.dst / "config.json"))
    return moves
