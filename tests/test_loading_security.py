"""Issue #28, the file side: what a user loads cannot reach outside its checkpoint directory, cannot drop a
checksum or a quantized weight unnoticed, and fails with a ValueError naming the entry; quantize_ then
save_pretrained, and load_quantized into a meta-device transformers model, just work."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import affineq  # noqa: E402
from affineq import safetensors as ast  # noqa: E402
from affineq import streaming  # noqa: E402
from affineq.hf import AffineqConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

INT8 = affineq.Int8WeightOnlyConfig()
INT4 = affineq.Int4WeightOnlyConfig(group_size=32)
LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()


def _load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _read(path):
    with safetensors.safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}


def _rewrite(path, edit):
    """Rewrite the safetensors file `path` with `edit(tensors, affineq_meta)` applied (through safetensors)."""
    header, tensors = _read(path)
    meta = json.loads(header["affineq"])
    edit(tensors, meta)
    header["affineq"] = json.dumps(meta)
    safetensors.torch.save_file(tensors, str(path), metadata=header)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A float Llama directory (save_pretrained), its quantize_checkpoint output (config.json, manifest) and
    a pre-quantized save_pretrained directory."""
    root = tmp_path_factory.mktemp("ckpt")
    _llama().save_pretrained(root / "float")
    affineq.quantize_checkpoint(root / "float", root / "qc", INT8)
    _load(root / "float", quantization_config=AffineqConfig(INT8)).save_pretrained(root / "hf")
    return root


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _sharded_float(d: Path, outside: Path | None = None) -> Path:
    """Two float shards and an index; with `outside`, the second shard lies there and the index names it."""
    d.mkdir()
    w = {"a.weight": torch.randn(32, 64), "b.weight": torch.randn(32, 64)}
    safetensors.torch.save_file({"a.weight": w["a.weight"]}, str(d / "s1.safetensors"))
    second = (outside or d) / "s2.safetensors"
    safetensors.torch.save_file({"b.weight": w["b.weight"]}, str(second))
    name = "s2.safetensors" if outside is None else os.path.relpath(second, d)
    (d / streaming.INDEX_FILE).write_text(json.dumps({"weight_map": {"a.weight": "s1.safetensors",
                                                                     "b.weight": name}}))
    return d


# -- 1. every path stays inside the checkpoint directory ----------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, how):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    src = _sharded_float(tmp_path / "src", outside)
    if how in ("absolute", "symlink"):
        index = json.loads((src / streaming.INDEX_FILE).read_text())
        target = str(outside / "s2.safetensors")
        if how == "symlink":
            (src / "link.safetensors").symlink_to(target)
            target = "link.safetensors"
        index["weight_map"]["b.weight"] = target
        (src / streaming.INDEX_FILE).write_text(json.dumps(index))
    entry = {"dotdot": "../elsewhere/s2.safetensors", "absolute": str(outside / "s2.safetensors"),
             "symlink": "link.safetensors"}[how]
    with pytest.raises(ValueError, match=f"weight_map file: '{entry}' resolves to .* outside the checkpoint"):
        affineq.quantize_checkpoint(src, tmp_path / "dst", INT8)
    assert not (tmp_path / "dst").exists()
    with torch.device("meta"):
        model = nn.Module()
        model.a, model.b = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
    with pytest.raises(ValueError, match="outside the checkpoint"):
        affineq.load_quantized(model, src, INT8)


def test_a_single_file_or_side_file_linked_outside_is_refused(tmp_path):
    outside = tmp_path / "secret.safetensors"
    safetensors.torch.save_file({"a.weight": torch.randn(32, 64)}, str(outside))
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="'model.safetensors' resolves to .* outside the checkpoint"):
        affineq.quantize_checkpoint(src, tmp_path / "dst", INT8)
    (src / "model.safetensors").unlink()
    safetensors.torch.save_file({"a.weight": torch.randn(32, 64)}, str(src / "model.safetensors"))
    (src / "tokenizer.json").symlink_to(tmp_path / "passwd")
    (tmp_path / "passwd").write_text("root:x:0:0")
    with pytest.raises(ValueError, match="'tokenizer.json' resolves to .* outside"):
        affineq.quantize_checkpoint(src, tmp_path / "dst", INT8)
    assert not (tmp_path / "dst").exists()


def test_hub_cache_snapshot_links_into_its_blobs_are_allowed(tmp_path):
    """The Hugging Face cache layout (snapshots/<rev>/f -> ../../blobs/<hash>) is the one link that leaves."""
    repo = tmp_path / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    w = torch.randn(32, 64)
    safetensors.torch.save_file({"a.weight": w}, str(repo / "blobs" / "123"))
    (snap / "model.safetensors").symlink_to("../../blobs/123")
    info = affineq.quantize_checkpoint(snap, tmp_path / "dst", INT8)
    assert info.quantized == ("a.weight",)


@pytest.mark.parametrize("pre_quantized", [True, False])
def test_from_pretrained_refuses_an_index_naming_a_shard_outside(tmp_path, pre_quantized):
    src = tmp_path / "q"
    model = _llama()
    if pre_quantized:
        affineq.quantize_(model, INT8)
    model.save_pretrained(src, max_shard_size="20KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).write_bytes((src / shard).read_bytes())
    (src / shard).unlink()
    index["weight_map"] = {k: (f"../{v}" if v == shard else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    kw = {} if pre_quantized else {"quantization_config": AffineqConfig(INT8)}  # quantize on load
    # ours, or transformers' own check, which runs first from transformers 5.25 on: refused either way
    refusal = f"'{shard}'.* outside the checkpoint directory|shard filename that points outside the model directory"
    with pytest.raises(ValueError, match=refusal):
        _load(src, **kw)


# -- 4. every stored tensor has a checksum ---------------------------------------------------------------------


def _saved(tmp_path) -> Path:
    m = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32))
    affineq.quantize_(m, INT8)
    path = tmp_path / "m.safetensors"
    ast.save_file(m.state_dict(), path)
    return path


def test_a_deleted_checksum_does_not_let_an_edited_byte_load(tmp_path):
    path = _saved(tmp_path)

    def edit(tensors, meta):
        del meta["checksums"]["0.weight:qdata"]
        tensors["0.weight:qdata"][0, 0] += 1  # an edited code, in range
    _rewrite(path, edit)
    with pytest.raises(ValueError, match=r"tensors \['0.weight:qdata'\] have no checksum.*allow_unchecked=True"):
        ast.load_file(path)
    assert ast.load_file(path, allow_unchecked=True)["0.weight"].qdata[0, 0] != 0  # the explicit opt-out


def test_an_emptied_checksum_dict_does_not_let_a_nan_load(tmp_path):
    path = _saved(tmp_path)

    def edit(tensors, meta):
        meta["checksums"] = {}
        tensors["1.weight"][0] = float("nan")
    _rewrite(path, edit)
    with pytest.raises(ValueError, match=r"have no checksum \(6 in all\)"):
        ast.load_file(path)
    # with the opt-out, tensors that still list a checksum are still checked
    _rewrite(path, lambda t, m: m["checksums"].update({"1.bias": "00000000"}))
    with pytest.raises(ValueError, match="'1.bias' fails its checksum"):
        ast.load_file(path, allow_unchecked=True)


def test_a_file_without_affineq_metadata_needs_the_opt_out(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"x": torch.ones(3)}, str(path))
    with pytest.raises(ValueError, match="no 'affineq' metadata.*allow_unchecked=True"):
        ast.load_file(path)
    assert torch.equal(ast.load_file(path, allow_unchecked=True)["x"], torch.ones(3))


def test_load_quantized_and_from_pretrained_refuse_a_missing_checksum(dirs, tmp_path):
    qc = _copy(dirs / "qc", tmp_path / "qc")
    _rewrite(qc / "model.safetensors", lambda t, m: m["checksums"].pop("model.norm.weight"))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with pytest.raises(ValueError, match=r"\['model.norm.weight'\] have no checksum"):
        affineq.load_quantized(model, qc)
    assert model.model.norm.weight.is_meta  # nothing changed
    affineq.load_quantized(model, qc, allow_unchecked=True)
    hf = _copy(dirs / "hf", tmp_path / "hf")
    key = "model.layers.0.mlp.up_proj.weight:scale"
    _rewrite(hf / "model.safetensors", lambda t, m: m["checksums"].pop(key))
    with pytest.raises(ValueError, match=f"'{key}'.* have no checksum"):
        _load(hf)


# -- 5. the manifest names every quantized weight --------------------------------------------------------------


def _drop_weight(name: str, replace_by_float: bool):
    """An edit removing quantized weight `name` (its tensors, metadata entry and checksums)."""
    def edit(tensors, meta):
        entry = meta["quantized"].pop(name)
        for inner in entry["tensors"]:
            del tensors[f"{name}:{inner}"]
            meta["checksums"].pop(f"{name}:{inner}")
        if replace_by_float:
            tensors[name] = torch.zeros(entry["spec"]["shape"])
            meta["checksums"][name] = ast._crc(tensors[name])
    return edit


def test_from_pretrained_fails_naming_a_quantized_weight_the_files_lack(dirs, tmp_path):
    qc = json.loads((dirs / "hf" / "config.json").read_text())["quantization_config"]
    model = _load(dirs / "hf")
    assert qc["quantized_weights"] == sorted(affineq.quantized_weights(model))
    d = _copy(dirs / "hf", tmp_path / "hf")
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(d / "model.safetensors", _drop_weight(name, replace_by_float=False))
    with pytest.raises(ValueError, match=f"config.json lists quantized weights that the checkpoint's files lack: "
                                         rf"\['{name}'\]"):
        _load(d)


def test_load_quantized_fails_naming_a_quantized_weight_the_files_lack(dirs, tmp_path):
    d = _copy(dirs / "qc", tmp_path / "qc")
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(d / "model.safetensors", _drop_weight(name, replace_by_float=True))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with pytest.raises(ValueError, match=rf"files lack: \['{name}'\]"):
        affineq.load_quantized(model, d)


# -- 6 / 11. index and spec errors name the entry --------------------------------------------------------------


def test_an_index_listing_a_tensor_its_shard_lacks(tmp_path):
    src = _sharded_float(tmp_path / "src")
    index = json.loads((src / streaming.INDEX_FILE).read_text())
    index["weight_map"]["c.weight"] = "s1.safetensors"
    (src / streaming.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="maps tensor 'c.weight' to s1.safetensors, which lacks it"):
        affineq.quantize_checkpoint(src, tmp_path / "dst", INT8)


def test_zero_block_size_and_deep_json_are_value_errors(tmp_path):
    path = _saved(tmp_path)
    _rewrite(path, lambda t, m: m["quantized"]["0.weight"]["spec"].update(block_size=[1, 0]))
    with pytest.raises(ValueError, match=r"'0.weight'.*block_size \[1, 0\] must be positive"):
        ast.load_file(path)
    header, tensors = _read(path)
    safetensors.torch.save_file(tensors, str(path), metadata={**header, "affineq": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(ValueError, match="'affineq' metadata nests JSON .* too deeply"):
        ast.load_file(path)
    src = _sharded_float(tmp_path / "src")
    (src / streaming.INDEX_FILE).write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="index.json nests JSON"):
        affineq.quantize_checkpoint(src, tmp_path / "dst", INT8)


def test_a_nan_in_the_source_names_the_tensor(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    w = torch.randn(32, 64)
    w[3, 5] = float("nan")
    safetensors.torch.save_file({"good.weight": torch.randn(32, 64), "bad.weight": w}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'bad.weight' of .*model.safetensors: .*NaN"):
        affineq.quantize_checkpoint(src, tmp_path / "dst", INT8)
    assert not (tmp_path / "dst").exists()


# -- 13. quantize_ then save_pretrained ------------------------------------------------------------------------


def _same_directory(a: Path, b: Path) -> None:
    """Same files; every non-weight file byte-identical; every safetensors file the same header metadata and
    the same tensors bit for bit (the order of tensors in the file follows transformers' set iteration)."""
    assert sorted(f.name for f in a.iterdir()) == sorted(f.name for f in b.iterdir())
    for f in a.iterdir():
        if f.suffix == ".safetensors":
            (ma, ta), (mb, tb) = _read(f), _read(b / f.name)
            assert ma == mb and ta.keys() == tb.keys()
            assert all(t.dtype == tb[k].dtype and torch.equal(t, tb[k]) for k, t in ta.items())
        else:
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_quantize_then_save_pretrained_is_quantize_on_load(dirs, tmp_path):
    m = _load(dirs / "float")
    affineq.quantize_(m, INT8, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "lm_head")
    assert m.config.quantization_config.quant_config == INT8  # recorded as set_quantization_config does
    m.save_pretrained(tmp_path / "q")
    _same_directory(tmp_path / "q", dirs / "hf")
    assert torch.equal(_logits(_load(tmp_path / "q")), _logits(m))
    # the default selection quantizes the tied lm_head / embedding too: saved once, reloaded bit for bit
    m = _load(dirs / "float")
    affineq.quantize_(m, INT4)
    m.save_pretrained(tmp_path / "q4")
    r = _load(tmp_path / "q4")
    assert isinstance(r.lm_head.weight, affineq.AffineQuantizedTensor)
    assert r.lm_head.weight is r.model.embed_tokens.weight
    assert torch.equal(_logits(r), _logits(m))


# -- 14. load_quantized into a meta-device transformers model ------------------------------------------------


def test_load_quantized_into_a_meta_llama_runs(dirs):
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    affineq.load_quantized(model, dirs / "qc")
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    ref = _load(dirs / "float")
    affineq.quantize_(ref, INT8, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "lm_head")
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert torch.equal(_logits(model), _logits(ref))
    # a save_pretrained directory: its plain tensors carry no checksum, so the caller opts out explicitly
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    with pytest.raises(ValueError, match="no checksum.*allow_unchecked=True"):
        affineq.load_quantized(model, dirs / "hf")
    affineq.load_quantized(model, dirs / "hf", allow_unchecked=True)
    assert torch.equal(_logits(model), _logits(_load(dirs / "hf")))


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_a_meta_buffer_nothing_can_compute_is_named_before_anything_changes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    safetensors.torch.save_file({"lin.weight": torch.randn(32, 64)}, str(src / "model.safetensors"))
    with torch.device("meta"):
        model = nn.Module()
        model.lin, model.rot = nn.Linear(64, 32, bias=False), _Rotary()
    with pytest.raises(ValueError, match=r"non-persistent buffers \['rot.table'\] are on the meta device"):
        affineq.load_quantized(model, src, INT8)
    assert model.lin.weight.is_meta
