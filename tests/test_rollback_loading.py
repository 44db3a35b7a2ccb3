"""Failing loads and writes leave everything as it was: the float weights a quantization gives back to the OS
(`affineq.process_memory.release_float_copy` on memory-mapped safetensors), `quantize_checkpoint`'s destination
directory when the final renames fail, and the model `load_quantized` / `dcp_load` fill when a late tensor fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import assert_unchanged, snapshot_model
from torch import nn

import affineq
from affineq.process_memory import release_float_copy

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")  # snapshots compare AQT bytes

# -- release_float_copy: never loses what the user wrote into a memory-mapped weight ---------------------------


class _Experts(nn.Module):
    """The parameter layout of transformers' experts modules ([E, out, in]), holding the tensors it is given."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self.is_transposed = False


def _mmapped_experts(tmp_path: Path) -> dict[str, torch.Tensor]:
    """E=4 expert weights saved and loaded again with safetensors: views of a private (copy-on-write) mapping."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "experts.safetensors"
    safetensors.torch.save_file({"gate_up_proj": torch.randn(4, 1024, 512, generator=g) * 0.1,
                                 "down_proj": torch.randn(4, 512, 512, generator=g) * 0.1}, path)
    return safetensors.torch.load_file(path)


def test_released_float_copy_keeps_the_users_edits(tmp_path):
    """Edited pages of a mmapped weight are the user's data (copy-on-write), not the file's: giving the weight's
    memory back must not revert them to the file's content (MADV_DONTNEED did)."""
    w = _mmapped_experts(tmp_path)["gate_up_proj"]
    w[0].fill_(1.0)
    expected = w.clone()
    release_float_copy(w)
    assert torch.equal(w, expected)


def test_failed_expert_quantization_keeps_edited_mmapped_weights(tmp_path):
    """quantize_ fails on a NaN in the last expert after the first expert weight was quantized (and its float pages
    given back): the model is left unchanged, the user's edit of expert 0 included."""
    sd = _mmapped_experts(tmp_path)
    model = nn.Sequential(_Experts(sd["gate_up_proj"], sd["down_proj"]))
    with torch.no_grad():
        model[0].gate_up_proj[0].fill_(1.0)
        model[0].down_proj[-1, 0, 0] = float("nan")
    snap = snapshot_model(model)
    with pytest.raises(affineq.QuantizationError, match="left unchanged"):
        affineq.quantize_(model, affineq.Int8WeightOnlyConfig())
    assert_unchanged(model, snap)
    assert bool((model[0].gate_up_proj[0] == 1.0).all())


def test_quantized_expert_weights_leave_an_alias_intact(tmp_path):
    """A successful quantization replaces the parameters; a reference the user kept to the float weight still
    holds what the user wrote into it."""
    sd = _mmapped_experts(tmp_path)
    model = nn.Sequential(_Experts(sd["gate_up_proj"], sd["down_proj"]))
    alias = sd["gate_up_proj"]
    alias[0].fill_(1.0)
    expected = alias.clone()
    affineq.quantize_(model, affineq.Int8WeightOnlyConfig())
    assert isinstance(model[0].gate_up_proj, affineq.AffineQuantizedTensor)
    assert torch.equal(alias, expected)


# -- quantize_checkpoint: a failing commit puts back the files it replaced ---------------------------------------


def _float_checkpoint(d: Path, *, nan_in_last: bool = False) -> dict[str, torch.Tensor]:
    """Two Linear(64, 64) layers as a transformers-style directory (model.safetensors, config.json, tokenizer)."""
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).state_dict().items()}
    if nan_in_last:
        sd["1.weight"][3, 5] = float("nan")
    d.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(sd, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (d / "tokenizer.json").write_text("NEW TOK")
    return sd


def _listing(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


def test_failed_commit_restores_the_files_dst_held(tmp_path, monkeypatch):
    src, dst = tmp_path / "float", tmp_path / "q"
    _float_checkpoint(src)
    dst.mkdir()
    (dst / "config.json").write_text("OLD CONFIG")
    (dst / "tokenizer.json").write_text("OLD TOK")
    before = _listing(dst)
    real = os.replace

    def no_space_for_shards(a, b, *args, **kwargs):
        if os.fspath(b).endswith(".safetensors"):
            raise OSError(28, "No space left on device")
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "replace", no_space_for_shards)
    with pytest.raises(OSError, match="left as it was"):
        affineq.quantize_checkpoint(src, dst, affineq.Int8WeightOnlyConfig())
    assert _listing(dst) == before


def test_commit_over_existing_files_leaves_no_backup(tmp_path):
    """A successful commit replaces the side files dst held and removes the copies it moved aside; a hidden file
    of the user's under a backup-like name is not touched."""
    src, dst = tmp_path / "float", tmp_path / "q"
    _float_checkpoint(src)
    dst.mkdir()
    (dst / "tokenizer.json").write_text("OLD TOK")
    (dst / ".tokenizer.json.affineq-old").write_text("USER FILE")
    affineq.quantize_checkpoint(src, dst, affineq.Int8WeightOnlyConfig())
    assert sorted(f.name for f in dst.iterdir()) == [".tokenizer.json.affineq-old", "config.json",
                                                     "model.safetensors", "tokenizer.json"]
    assert (dst / "tokenizer.json").read_text() == "NEW TOK"
    assert (dst / ".tokenizer.json.affineq-old").read_text() == "USER FILE"


# -- load_quantized: all or nothing ------------------------------------------------------------------------------


@pytest.fixture
def quantized_dir(tmp_path) -> Path:
    _float_checkpoint(tmp_path / "float")
    affineq.quantize_checkpoint(tmp_path / "float", tmp_path / "q", affineq.Int8WeightOnlyConfig())
    return tmp_path / "q"


def _target(out2: int = 64) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, out2))


def test_load_quantized_checks_every_shape_before_placing(quantized_dir):
    model = _target(out2=32)
    snap = snapshot_model(model)
    with pytest.raises(ValueError, match="2 tensor") as e:
        affineq.load_quantized(model, quantized_dir)
    assert "1.weight (Linear.weight): the checkpoint's tensor has shape (64, 64), the model's (32, 64)" in str(e.value)
    assert "1.bias (Linear.bias): the checkpoint's tensor has shape (64,), the model's (32,)" in str(e.value)
    assert_unchanged(model, snap)


def test_load_quantized_rolls_back_on_a_failed_checksum(quantized_dir):
    path = quantized_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's bytes: the others are placed before it is read
    path.write_bytes(bytes(data))
    model = _target()
    snap = snapshot_model(model)
    with pytest.raises(ValueError, match="checksum"):
        affineq.load_quantized(model, quantized_dir)
    assert_unchanged(model, snap)


def test_load_quantized_rolls_back_on_a_nan_weight_while_quantizing(tmp_path):
    _float_checkpoint(tmp_path / "float", nan_in_last=True)
    model = _target()
    snap = snapshot_model(model)
    with pytest.raises(ValueError, match=r"1\.weight"):
        affineq.load_quantized(model, tmp_path / "float", affineq.Int8WeightOnlyConfig())
    assert_unchanged(model, snap)


def test_load_quantized_rolls_back_a_meta_model(quantized_dir):
    path = quantized_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with torch.device("meta"):
        model = _target()
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match="checksum"):
        affineq.load_quantized(model, quantized_dir)
    after = dict(model.named_parameters())  # meta tensors have no values to compare: the same objects
    assert after.keys() == before.keys() and all(after[n] is p and p.is_meta for n, p in before.items())


# -- dcp_load: every weight checked before any value is copied in -----------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_checks_every_weight_before_copying(tmp_path):
    from affineq.distributed import dcp_load, dcp_save
    from affineq.granularity import PerGroup

    torch.manual_seed(0)
    source = affineq.quantize_(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), affineq.Int8WeightOnlyConfig())
    dcp_save(source, tmp_path / "ckpt")
    model = _target()
    affineq.quantize_(model[0], affineq.Int8WeightOnlyConfig())
    affineq.quantize_(model[1], affineq.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)))
    snap = snapshot_model(model)
    with pytest.raises(ValueError, match=r"1\.weight.*does not match"):
        dcp_load(model, tmp_path / "ckpt")
    assert_unchanged(model, snap)
    same = _target()
    affineq.quantize_(same, affineq.Int8WeightOnlyConfig())
    dcp_load(same, tmp_path / "ckpt")  # a matching model loads every value
    for name, t in source.state_dict().items():
        assert torch.equal(same.state_dict()[name], t), name
