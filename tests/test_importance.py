"""Importance matrices (llama.cpp's imatrix: per-column mean of x^2 of each linear's inputs) and the
importance-weighted round-to-nearest: never worse than RTN in the weighted error of any group, exactly RTN when
the grid is ratio 1 alone, the base config's format and kernels."""

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import affineq  # noqa: F401
from affineq.algorithms import ImportanceMatrix, ImportanceWeightedConfig, collect_importance
from affineq.algorithms.importance import importance_weighted_quantize
from affineq.configs import (
    Float8WeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    config_from_dict,
)
from affineq.granularity import PerAxis, PerGroup
from affineq.models import build_tiny_lm
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.quantize import FqnToConfig, QuantizationError, quantize_, quantized_weights
from affineq.tensor.affine import AffineQuantizedTensor

ASYM, SYM = MappingType.ASYMMETRIC, MappingType.SYMMETRIC
BASES = [
    Int4WeightOnlyConfig(group_size=16),  # uint4, FLOAT zero point, bf16 qparams
    Int4WeightOnlyConfig(group_size=16, scale_dtype=torch.float32, packing_format="plain"),
    IntxWeightOnlyConfig(torch.uint3, PerGroup(16), ASYM, ZeroPointDomain.INT, scale_dtype=torch.float32),
    IntxWeightOnlyConfig(torch.int4, PerGroup(16), SYM),  # symmetric, no zero point
    IntxWeightOnlyConfig(torch.uint4, PerGroup(16), SYM),  # symmetric unsigned: fixed integer zero point 8
    IntxWeightOnlyConfig(torch.int2, PerAxis(0), ASYM),
    Int8WeightOnlyConfig(),
    Int8DynamicActivationInt4WeightConfig(group_size=16),
]


def group_errors(w: torch.Tensor, deq: torch.Tensor, imp: torch.Tensor, g: int) -> torch.Tensor:
    """sum_k imp[k] (w - deq)^2 per group [N * K / g], float64."""
    e = imp.double() * (w.double() - deq.double()).pow(2)
    return e.reshape(-1, g).sum(1)


def rtn_and_weighted(base, w, imp, **kw):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = nn.Parameter(w.clone())
    spec = base.weight_spec(w, lin)
    rtn = AffineQuantizedTensor.from_spec(w, spec, base.qparam_options())
    ours = importance_weighted_quantize(w, imp, spec, base.qparam_options(), **kw)
    return spec, rtn, ours


@settings(max_examples=40, deadline=None)
@given(base=st.sampled_from(BASES), rows=st.integers(1, 4), groups=st.integers(1, 3), seed=st.integers(0, 2**16),
       zero_frac=st.floats(0, 0.5), refit=st.booleans())
def test_never_worse_than_rtn_on_any_group(base, rows, groups, seed, zero_frac, refit):
    gen = torch.Generator().manual_seed(seed)
    k = 16 * groups
    w = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 0.1
    w[torch.rand(rows, k, generator=gen) < 0.05] *= 8  # a few outliers, where clipping pays
    imp = torch.rand(k, generator=gen).pow(3) * 10
    imp[torch.rand(k, generator=gen) < zero_frac] = 0
    spec, rtn, ours = rtn_and_weighted(base, w, imp, refit=refit)
    g = spec.block_size[1]
    e_rtn = group_errors(w, rtn.dequantize(torch.float32), imp, g)
    e_ours = group_errors(w, ours.dequantize(torch.float32), imp, g)
    # float32 search: a win by less than float32 rounding may measure as an ulp-level loss in float64
    assert bool((e_ours <= e_rtn * (1 + 1e-6) + 1e-30).all()), (e_ours - e_rtn).max()
    assert ours.spec == rtn.spec  # the base config's format: same kernels

    # the grid of ratio 1 alone without refit is round-to-nearest, code for code
    _, _, plain = rtn_and_weighted(base, w, imp, ratios=(1.0,), refit=False)
    assert torch.equal(plain.dequantize(), rtn.dequantize())
    for name, t in rtn.tensors.items():
        assert torch.equal(plain.tensors[name], t), name


def test_search_lowers_the_weighted_error():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) * 0.02
    imp = torch.rand(128, generator=gen).pow(4) * 5
    base = Int4WeightOnlyConfig(group_size=32)
    _, rtn, ours = rtn_and_weighted(base, w, imp)
    e_rtn = group_errors(w, rtn.dequantize(torch.float32), imp, 32).sum()
    e_ours = group_errors(w, ours.dequantize(torch.float32), imp, 32).sum()
    assert e_ours < 0.8 * e_rtn  # measured 0.66
    # refit=False (clipping alone) gains less but still gains
    _, _, clip = rtn_and_weighted(base, w, imp, refit=False)
    e_clip = group_errors(w, clip.dequantize(torch.float32), imp, 32).sum()
    assert e_ours <= e_clip < e_rtn


def test_uniform_importance_on_a_representable_weight_is_rtn():
    # every group holds codes 0..15 of step 0.25 around -2: RTN reproduces it exactly, nothing can do better
    codes = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i)) for i in range(8)])
    w = ((codes.float() - 8) * 0.25).reshape(4, 32)
    base = Int4WeightOnlyConfig(group_size=16, scale_dtype=torch.float32, packing_format="plain")
    _, rtn, ours = rtn_and_weighted(base, w, torch.ones(32))
    assert torch.equal(rtn.dequantize(), w)
    for name, t in rtn.tensors.items():
        assert torch.equal(ours.tensors[name], t), name


# -- the importance matrix ----------------------------------------------------------------------------------


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_collect_importance_is_the_mean_of_x_squared():
    m = TwoLayers()
    data = [torch.randn(3, 8), torch.randn(2, 5, 8)]
    with pytest.warns(UserWarning, match="no calibration input reached"):
        imp = collect_importance(m, data, progress_bar=False)
    x = torch.cat([d.reshape(-1, 8) for d in data]).double()
    h = torch.relu(m.a(x.float())).double()
    assert set(imp) == {"a", "b"} and imp.tokens == {"a": 13, "b": 13}
    torch.testing.assert_close(imp["a"], x.pow(2).mean(0).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(imp["b"], h.pow(2).mean(0).float(), rtol=1e-5, atol=0)
    only_b = collect_importance(m, data, filter_fn=lambda mod, fqn: fqn == "b", progress_bar=False)
    assert list(only_b) == ["b"] and torch.equal(only_b["b"], imp["b"])


def test_importance_matrix_save_load(tmp_path):
    imp = collect_importance(TwoLayers(), [torch.randn(4, 8)], filter_fn=lambda m, f: f != "unused",
                             progress_bar=False)
    path = tmp_path / "imatrix.safetensors"
    imp.save(path)
    back = ImportanceMatrix.load(path)
    assert list(back) == list(imp) and back.tokens == imp.tokens == {"a": 4, "b": 4}
    for k in imp:
        assert torch.equal(back[k], imp[k])
    assert isinstance(dict(back)["a"], torch.Tensor)
    with pytest.raises(ValueError, match="does not exist"):
        ImportanceMatrix.load(tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        ImportanceMatrix.load(tmp_path / "junk.safetensors")
    affineq.safetensors.save_file({"a": torch.ones(8)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not an affineq importance file"):
        ImportanceMatrix.load(tmp_path / "other.safetensors")


@pytest.mark.parametrize("values, match", [
    ({"a": torch.ones(2, 2)}, "non-empty 1-D tensor"),
    ({"a": -torch.ones(2)}, "negative or non-finite"),
    ({"a": torch.tensor([float("nan")])}, "negative or non-finite"),
    ([1, 2], "must map layer names"),
])
def test_importance_matrix_bad_values(values, match):
    with pytest.raises(ValueError, match=match):
        ImportanceMatrix(values)


# -- the config through quantize_ ---------------------------------------------------------------------------


def tiny():
    return build_tiny_lm(vocab=96, dim=64, layers=2, heads=2, ffn=128)


DATA = [torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def test_quantize_on_the_tiny_model(tmp_path):
    model = tiny()
    base = Int4WeightOnlyConfig(group_size=32)
    imp = collect_importance(model, DATA, progress_bar=False)
    # importance collected by quantize_ from calibration_data equals the one passed in
    a = quantize_(copy.deepcopy(model), ImportanceWeightedConfig(base, progress=False), calibration_data=DATA)
    b = quantize_(copy.deepcopy(model), ImportanceWeightedConfig(base, importance=imp, progress=False))
    imp.save(tmp_path / "imatrix.safetensors")
    cfg = ImportanceWeightedConfig(base, importance=str(tmp_path / "imatrix.safetensors"), progress=False)
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # a path round-trips through JSON
    c = quantize_(copy.deepcopy(model), cfg)
    rtn = quantize_(copy.deepcopy(model), base)
    qa, qb, qc, qr = ({k.removesuffix(".weight"): v for k, v in quantized_weights(m).items()}
                      for m in (a, b, c, rtn))
    assert qa.keys() == qr.keys() == set(imp)
    total_ours = total_rtn = 0.0
    for fqn, w in qr.items():
        assert torch.equal(qa[fqn].dequantize(), qb[fqn].dequantize())
        assert torch.equal(qa[fqn].dequantize(), qc[fqn].dequantize())
        assert qa[fqn].spec == w.spec
        wf = model.get_submodule(fqn).weight.detach()
        total_ours += float(group_errors(wf, qa[fqn].dequantize(), imp[fqn], 32).sum())
        total_rtn += float(group_errors(wf, w.dequantize(), imp[fqn], 32).sum())
    assert total_ours < 0.9 * total_rtn  # measured ~0.85


def test_config_errors():
    base = Int4WeightOnlyConfig(group_size=32)
    model = tiny()
    imp = collect_importance(model, DATA[:1], progress_bar=False)
    with pytest.raises(QuantizationError, match="needs none"):
        quantize_(copy.deepcopy(model), ImportanceWeightedConfig(base, importance=imp), calibration_data=DATA)
    with pytest.raises(QuantizationError, match="needs calibration data"):
        quantize_(copy.deepcopy(model), ImportanceWeightedConfig(base))
    partial = ImportanceMatrix({k: v for k, v in imp.items() if k != "lm_head"})
    snapshot = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError, match="no entry for 'lm_head'"):
        quantize_(model, ImportanceWeightedConfig(base, importance=partial, progress=False))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())  # left unchanged
    wrong = ImportanceMatrix({**dict(imp), "lm_head": torch.ones(5)})
    with pytest.raises(QuantizationError, match="has shape"):
        quantize_(copy.deepcopy(model), ImportanceWeightedConfig(base, importance=wrong, progress=False))
    with pytest.raises(ValueError, match="JSON cannot hold"):
        ImportanceWeightedConfig(base, importance=imp).to_dict()
    with pytest.raises(ValueError, match="ratios"):
        ImportanceWeightedConfig(base, ratios=())
    with pytest.raises(ValueError, match="ratios"):
        ImportanceWeightedConfig(base, ratios=(1.0, 0.0))
    with pytest.raises(ValueError, match="cannot wrap Float8WeightOnlyConfig"):
        ImportanceWeightedConfig(Float8WeightOnlyConfig())
    with pytest.raises(ValueError, match="scale_type"):
        ImportanceWeightedConfig(IntxWeightOnlyConfig(torch.int4, PerGroup(32), scale_type="e8m0"))
    with pytest.raises(ValueError, match="importance"):
        ImportanceWeightedConfig(base, importance=3)
    # a plain dict is accepted (validated into an ImportanceMatrix); a list of ratios becomes a tuple
    cfg = ImportanceWeightedConfig(base, importance=dict(imp), ratios=[1.0, 0.9])
    assert isinstance(cfg.importance, ImportanceMatrix) and cfg.ratios == (1.0, 0.9)
    # configs holding different matrices are different configs (FqnToConfig keeps them apart)
    other = ImportanceWeightedConfig(base, importance=collect_importance(model, DATA[1:], progress_bar=False))
    assert ImportanceWeightedConfig(base, importance=imp) != other
    quantize_(copy.deepcopy(model), FqnToConfig({"lm_head": ImportanceWeightedConfig(base, importance=imp),
                                                 "layers.0.mlp.up_proj": other}))


# -- HQQ with the importance as its per-column weight -------------------------------------------------------


def test_hqq_with_importance():
    from affineq.algorithms import HQQConfig
    from affineq.algorithms.hqq import hqq_quantize

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=gen) / torch.randn(128, 256, generator=gen).abs().clamp_min(0.3) * 0.02
    imp = torch.rand(256, generator=gen).pow(4) * 5
    base = Int4WeightOnlyConfig(group_size=64)
    spec, o = base.weight_spec(w, nn.Linear(256, 128)), base.qparam_options()
    rtn = AffineQuantizedTensor.from_spec(w, spec, o)
    plain, weighted = hqq_quantize(w, spec, o), hqq_quantize(w, spec, o, importance=imp)
    err = {name: float(group_errors(w, t.dequantize(torch.float32), imp, 64).sum())
           for name, t in (("rtn", rtn), ("plain", plain), ("weighted", weighted))}
    assert err["weighted"] < 0.92 * err["plain"] < err["rtn"]  # measured 0.85
    # uniform importance is plain HQQ, exactly
    assert torch.equal(hqq_quantize(w, spec, o, importance=torch.full((256,), 3.0)).dequantize(), plain.dequantize())
    # a group whose columns all have importance 0 keeps round-to-nearest
    zero_first = imp.clone()
    zero_first[:64] = 0
    z = hqq_quantize(w, spec, o, importance=zero_first).dequantize()
    assert torch.equal(z[:, :64], rtn.dequantize()[:, :64]) and not torch.equal(z, rtn.dequantize())
    with pytest.raises(ValueError, match="not all 0"):
        hqq_quantize(w, spec, o, importance=torch.zeros(256))
    with pytest.raises(ValueError, match=r"\[in_features\] = \[256\]"):
        hqq_quantize(w, spec, o, importance=torch.ones(3))

    # through quantize_: no calibration data, the matrix computed beforehand (or a saved file)
    model = tiny()
    mat = collect_importance(model, DATA, progress_bar=False)
    base32 = Int4WeightOnlyConfig(group_size=32)
    mlp = lambda m, f: isinstance(m, nn.Linear) and ".mlp." in f  # noqa: E731
    q = quantize_(copy.deepcopy(model), HQQConfig(base32, importance=mat, progress=False), filter_fn=mlp)
    plain_q = quantize_(copy.deepcopy(model), HQQConfig(base32, progress=False), filter_fn=mlp)
    layers = [f for f in mat if ".mlp." in f]
    ours = sum(float(group_errors(model.get_submodule(f).weight.detach(),
                                  q.get_submodule(f).weight.dequantize(), mat[f], 32).sum()) for f in layers)
    theirs = sum(float(group_errors(model.get_submodule(f).weight.detach(),
                                    plain_q.get_submodule(f).weight.dequantize(), mat[f], 32).sum()) for f in layers)
    assert ours < theirs
    with pytest.raises(ValueError, match="JSON cannot hold"):
        HQQConfig(base32, importance=mat).to_dict()
    with pytest.raises(QuantizationError, match="no entry for 'lm_head'"):
        quantize_(copy.deepcopy(model), HQQConfig(base32, importance={k: v for k, v in mat.items() if k != "lm_head"},
                                                  progress=False))


def test_collect_importance_runs_in_eval_mode_and_keeps_batchnorm_statistics():
    from conftest import assert_unchanged, snapshot_model

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))  # training mode
    before = snapshot_model(m)
    collect_importance(m, [torch.randn(4, 8) for _ in range(3)], progress_bar=False)
    assert_unchanged(m, before)  # "the model is not changed": running statistics included
    assert all(x.training for x in m.modules())
