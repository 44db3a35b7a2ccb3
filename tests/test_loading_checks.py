"""Loading refuses what a crafted or corrupted file would otherwise slip in: a plain tensor failing its checksum
(load_quantized), code execution through a DCP checkpoint's pickles (dcp_load), NaN e8m0 scale bytes, dense codes
outside the spec's range, a name stored both plain and quantized; and load_file takes any spelling of a device."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
import safetensors.torch  # noqa: E402

import affineq  # noqa: E402
from affineq import safetensors as ast  # noqa: E402
from affineq.primitives import MappingType  # noqa: E402
from affineq.tensor.affine import AffineQuantizedTensor as AQT  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")


def _craft(path, flat: dict, quantized: dict) -> None:
    """A safetensors file with affineq metadata listing `quantized` and correct checksums of `flat`."""
    meta = {"version": 1, "writer": "test", "quantized": quantized,
            "checksums": {k: ast._crc(t) for k, t in flat.items()}}
    safetensors.torch.save_file({k: t.contiguous() for k, t in flat.items()}, str(path),
                                metadata={"format": "pt", "affineq": json.dumps(meta)})


# -- load_quantized: plain tensors' checksums ------------------------------------------------------------


def test_load_quantized_verifies_plain_tensor_checksums(tmp_path):
    def mk():
        return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))

    torch.manual_seed(0)
    m = mk()
    (tmp_path / "f").mkdir()
    safetensors.torch.save_file({k: v.contiguous() for k, v in m.state_dict().items()},
                                str(tmp_path / "f" / "model.safetensors"))
    affineq.quantize_checkpoint(tmp_path / "f", tmp_path / "q", affineq.Int8WeightOnlyConfig())
    good = mk()
    affineq.load_quantized(good, tmp_path / "q")  # the untouched checkpoint loads
    assert torch.equal(good[1].weight, m[1].weight)
    p = tmp_path / "q" / "model.safetensors"
    b = bytearray(p.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    start, _ = json.loads(b[8:8 + n])["1.weight"]["data_offsets"]
    b[8 + n + start + 3] ^= 0x40  # one byte of the LayerNorm's (plain) weight
    p.write_bytes(bytes(b))
    model = mk()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'1\.weight' fails its checksum"):
        affineq.load_quantized(model, tmp_path / "q")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left as it was


def test_load_quantized_refuses_a_name_both_plain_and_quantized(tmp_path):
    w = AQT.from_spec(torch.randn(8, 32), (1, 32), target=torch.int8)
    flat, meta = ast.flatten_state_dict({"weight": w})
    flat["weight"] = torch.zeros(8, 32)
    (tmp_path / "c").mkdir()
    _craft(tmp_path / "c" / "model.safetensors", flat, meta["quantized"])
    lin = nn.Linear(32, 8, bias=False)
    with pytest.raises(ValueError, match="both as plain tensors and as quantized"):
        affineq.load_quantized(lin, tmp_path / "c")


# -- safetensors.load_file -------------------------------------------------------------------------------


def test_load_file_refuses_nan_e8m0_scale(tmp_path):
    m = nn.Sequential(nn.Linear(64, 64, bias=False))
    affineq.quantize_(m, affineq.MXWeightOnlyConfig("fp4_e2m1"))
    flat, meta = ast.flatten_state_dict({"w": m[0].weight})
    assert flat["w:scale"].dtype == torch.uint8
    _craft(tmp_path / "ok.safetensors", flat, meta["quantized"])
    ast.load_file(tmp_path / "ok.safetensors")
    flat["w:scale"] = flat["w:scale"].clone()
    flat["w:scale"][0, 0] = 0xFF  # NaN in e8m0
    _craft(tmp_path / "nan.safetensors", flat, meta["quantized"])
    with pytest.raises(ValueError, match=r"'w'.*scale.*0xFF"):
        ast.load_file(tmp_path / "nan.safetensors")


@pytest.mark.parametrize("fmt", ["dense", "plain"])
def test_load_file_refuses_codes_outside_the_range(tmp_path, fmt):
    torch.manual_seed(0)
    w = AQT.from_spec(torch.randn(16, 64), (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                      quant_min=-127, quant_max=127, packing_format=fmt)
    flat, meta = ast.flatten_state_dict({"w": w})
    _craft(tmp_path / "ok.safetensors", flat, meta["quantized"])
    back = ast.load_file(tmp_path / "ok.safetensors")["w"]
    assert torch.equal(back.codes(), w.codes())
    flat["w:qdata"] = flat["w:qdata"].clone()
    flat["w:qdata"][0, 0] = 255 if fmt == "dense" else -128  # dense: u = 255 -> code 128; plain: -128
    _craft(tmp_path / "bad.safetensors", flat, meta["quantized"])
    with pytest.raises(ValueError, match=r"'w': codes span .* outside the spec's range \[-127, 127\]"):
        ast.load_file(tmp_path / "bad.safetensors")


def test_load_file_refuses_a_name_both_plain_and_quantized(tmp_path):
    w = AQT.from_spec(torch.randn(8, 32), (1, 32), target=torch.int8)
    flat, meta = ast.flatten_state_dict({"w": w})
    flat["w"] = torch.zeros(8, 32)
    _craft(tmp_path / "dup.safetensors", flat, meta["quantized"])
    with pytest.raises(ValueError, match="'w' is stored both as a plain tensor and as a quantized entry"):
        ast.load_file(tmp_path / "dup.safetensors")


def test_load_file_device_argument(tmp_path):
    w = AQT.from_spec(torch.randn(8, 32), (1, 32), target=torch.int8)
    ast.save_file({"w": w, "b": torch.ones(3)}, tmp_path / "ok.safetensors")
    for dev in ("cpu:0", torch.device("cpu", 0), "cpu", torch.device("cpu")):
        sd = ast.load_file(tmp_path / "ok.safetensors", device=dev)
        assert torch.equal(sd["w"].dequantize(), w.dequantize()) and sd["b"].device.type == "cpu"
    with pytest.raises(ValueError, match="device='bogus' is not a torch device"):
        ast.load_file(tmp_path / "ok.safetensors", device="bogus")


# -- dcp_load: no code runs from the checkpoint -----------------------------------------------------------


def _dcp_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    affineq.quantize_(m, affineq.Int8WeightOnlyConfig())
    return m


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_dcp_round_trip_with_checked_metadata(tmp_path):
    m = _dcp_model()
    affineq.dcp_save(m, tmp_path / "ck")
    m2 = _dcp_model()
    with torch.no_grad():
        m2[1].weight.fill_(3.0)
        m2[0].bias.zero_()
    affineq.dcp_load(m2, tmp_path / "ck")
    assert torch.equal(m2[1].weight, m[1].weight) and torch.equal(m2[0].bias, m[0].bias)
    assert torch.equal(m2[0].weight.dequantize(), m[0].weight.dequantize())


def test_dcp_load_metadata_pickle_runs_no_code(tmp_path):
    m = _dcp_model()
    affineq.dcp_save(m, tmp_path / "ck")
    marker = tmp_path / "pwned.txt"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ValueError, match=r"\.metadata refers to posix\.system|refers to nt\.system"):
        affineq.dcp_load(_dcp_model(), tmp_path / "ck")
    assert not marker.exists()


def test_dcp_load_metadata_data_file_outside_is_refused(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    m = _dcp_model()
    affineq.dcp_save(m, tmp_path / "ck")
    md = FileSystemReader(str(tmp_path / "ck")).read_metadata()  # our own, trusted file
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ValueError, match="not a file name inside the checkpoint directory"):
        affineq.dcp_load(_dcp_model(), tmp_path / "ck")


def test_dcp_load_bytes_entry_runs_no_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    m = _dcp_model()
    marker = tmp_path / "pwned.txt"
    sd = affineq.distributed.quantized_state_dict(m)
    sd["0.weight.aq_spec"] = _Payload(marker)  # stored as a pickle in the data file
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    model = _dcp_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="'0.weight.aq_spec' is not a plain value"):
        affineq.dcp_load(model, tmp_path / "ck")
    assert not marker.exists()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in ("1.weight", "0.bias"))
