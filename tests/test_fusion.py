"""Module fusion (BatchNorm folding, conv/linear + ReLU), checked against torch.ao.quantization.fuse_modules, and
quantized convolutions (weights, static activations)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr
from torch import nn

import affineq
from affineq import (
    ActivationQuant,
    AffineQuantizedTensor,
    Int8WeightOnlyConfig,
    MappingType,
    QuantSpec,
    ZeroPointDomain,
    fuse_modules_,
    quantize_,
    record_kernels,
)
from affineq.fusion import ConvReLU, LinearReLU


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 8, 3, bias=False), nn.BatchNorm2d(8),
        nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10), nn.ReLU(),
    )
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for bn in (m[1], m[4], m[7]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return m.eval()


GROUPS = [["0", "1", "2"], ["3", "4"], ["6", "7"], ["9", "10"]]


def test_fused_model_matches_the_float_model_and_torch_ao():
    m = _cnn()
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        ref = m(x)
        ao = torch.ao.quantization.fuse_modules(copy.deepcopy(m), GROUPS)
        fused = copy.deepcopy(m)
        assert fuse_modules_(fused, GROUPS) == GROUPS
        assert isinstance(fused[0], ConvReLU) and isinstance(fused[6], nn.Linear) and isinstance(fused[1], nn.Identity)
        assert isinstance(fused[3], nn.Conv2d) and isinstance(fused[9], LinearReLU)
        torch.testing.assert_close(fused(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused(x), ao(x), rtol=1e-5, atol=1e-5)
        # folded weights: torch.ao's fused conv (folding in float32) agrees within float32 rounding
        torch.testing.assert_close(fused[0][0].weight, ao[0][0].weight, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fused[3].bias, ao[3].bias, rtol=1e-6, atol=1e-7)


def test_auto_fusion_finds_the_patterns_inside_sequentials():
    m = _cnn()
    assert fuse_modules_(m) == GROUPS
    assert fuse_modules_(m) == []  # nothing left to fuse


def test_fusion_errors_name_the_group_and_change_nothing():
    m = _cnn()
    before = {n: p for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"group \[.1., .0.\].*cannot fuse.*supported"):
        fuse_modules_(m, [["3", "4"], ["1", "0"]])  # the valid first group is not applied either
    with pytest.raises(ValueError, match=r"no modules \['nope'\]"):
        fuse_modules_(m, [["0", "nope"]])
    with pytest.raises(ValueError, match="training mode.*model.eval"):
        fuse_modules_(m.train(), [["0", "1"]])
    with pytest.raises(ValueError, match="list of two or three module names"):
        fuse_modules_(m, [["0"]])
    assert {n: p for n, p in m.named_parameters()} == before
    assert fuse_modules_(m) == [["9", "10"]]  # training-mode BatchNorm is left alone by auto fusion


def test_quantized_conv_weights_after_folding():
    m = _cnn()
    fuse_modules_(m)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        ref = m(x)
        quantize_(m, Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: isinstance(mod, (nn.Conv2d, nn.Linear)))
        assert isinstance(m[0][0].weight, AffineQuantizedTensor) and isinstance(m[3].weight, AffineQuantizedTensor)
        with pytest.warns(affineq.KernelFallbackWarning, match="no packed convolution kernel"), \
                record_kernels() as used:
            out = m(x)
    assert used.count("dequantize:conv") == 2
    assert sqnr(ref, out) > 35


def test_static_activation_quantization_on_a_conv():
    torch.manual_seed(1)
    w = torch.randn(8, 3, 3, 3)
    aq = ActivationQuant(torch.int8, MappingType.ASYMMETRIC, "per_tensor", ZeroPointDomain.INT, static=True)
    spec = QuantSpec.create(w.shape, w.dtype, torch.int8, (1, 3, 3, 3), mapping_type=MappingType.SYMMETRIC,
                            zero_point_domain=ZeroPointDomain.NONE, act_quant=aq)
    scale, zp = torch.tensor([0.02]), torch.tensor([5], dtype=torch.int32)
    qw = AffineQuantizedTensor.from_spec(w, spec, affineq.QParamOptions(scale_dtype=torch.float32))
    qw = qw.with_act_tensors(act_scale=scale, act_zero_point=zp)
    x = torch.randn(2, 3, 10, 10)
    x_fq = affineq.primitives.fake_quantize_affine(x, x.shape, scale, zp, torch.int8)
    with pytest.warns(affineq.KernelFallbackWarning):
        out = F.conv2d(x, qw, padding=1)
    torch.testing.assert_close(out, F.conv2d(x_fq, qw.dequantize(), padding=1), rtol=0, atol=0)


def test_overlapping_groups_are_refused_and_change_nothing():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-0.5, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = m(x)
    mods = list(m)
    with pytest.raises(ValueError, match=r"module '0' is in two groups, \['0', '1'\] and \['0', '2'\]"):
        fuse_modules_(m, [["0", "1"], ["0", "2"]])
    assert list(m) == mods
    with pytest.raises(ValueError, match=r"module '1' is in two groups"):
        fuse_modules_(m, (g for g in [["0", "1"], ["1", "2"]]))  # a generator of groups is checked too
    assert list(m) == mods
    assert fuse_modules_(m, (g for g in [["0", "1"]])) == [["0", "1"]]  # linear + BatchNorm (+ the ReLU after)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-6)
