"""Static (calibrated) int8 activations: the int8 x int8 GEMM runs with the stored act_scale / act_zero_point,
matches the reference numerics, compiles, and saves with the weight."""

import io

import pytest
import torch
import torch.nn.functional as F
from conftest import static_int8_kernel
from torch import nn

import affineq
from affineq import (
    ActivationQuant,
    AffineQuantizedTensor,
    MappingType,
    QParamOptions,
    QuantSpec,
    ZeroPointDomain,
    record_kernels,
)
from affineq.primitives import dequantize_affine, quantize_affine


def _static_weight(domain: ZeroPointDomain, fmt: str = "plain", zp: int | None = -7):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    mapping = MappingType.ASYMMETRIC if domain is ZeroPointDomain.INT else MappingType.SYMMETRIC
    aq = ActivationQuant(torch.int8, mapping, "per_tensor", domain, static=True)
    spec = QuantSpec.create(w.shape, w.dtype, torch.int8, (1, 128), mapping_type=MappingType.SYMMETRIC,
                            zero_point_domain=ZeroPointDomain.NONE, packing_format=fmt, act_quant=aq)
    qw = AffineQuantizedTensor.from_spec(w, spec, QParamOptions(scale_dtype=torch.float32))
    x_zp = None if domain is ZeroPointDomain.NONE else torch.tensor([zp], dtype=torch.int32)
    return qw.with_act_tensors(act_scale=torch.tensor([0.03]), act_zero_point=x_zp), x_zp


def _reference(x, qw, x_zp, domain):
    scale = torch.tensor([0.03])
    xq = quantize_affine(x, x.shape, scale, x_zp, torch.int8, zero_point_domain=domain)
    return F.linear(dequantize_affine(xq, x.shape, scale, x_zp, torch.int8, zero_point_domain=domain),
                    qw.dequantize())


@pytest.mark.parametrize("domain", [ZeroPointDomain.INT, ZeroPointDomain.NONE])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_static_int8_gemm_runs_and_matches_the_reference(domain, m):
    qw, x_zp = _static_weight(domain)
    x = torch.randn(m, 128)
    with record_kernels() as used:
        y = F.linear(x, qw)
    assert used == [static_int8_kernel(m)]
    ref = _reference(x, qw, x_zp, domain)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_dense_static_weight_runs_our_kernel_on_the_fake_quantized_input():
    qw, x_zp = _static_weight(ZeroPointDomain.INT, fmt="dense")
    x = torch.randn(4, 128)
    with record_kernels() as used:
        y = F.linear(x, qw)
    expected = "affineq.lowbit_linear" if affineq.cpp.is_available() else "dequantize:linear"
    assert used == [expected]
    ref = _reference(x, qw, x_zp, ZeroPointDomain.INT)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_static_weight_compiles_and_saves_with_its_qparams():
    qw, _ = _static_weight(ZeroPointDomain.INT)
    lin = nn.Linear(128, 64, bias=False)
    lin.weight = nn.Parameter(qw, requires_grad=False)
    x = torch.randn(3, 128)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = lin(x)
        compiled = torch.compile(lin, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    fresh = nn.Linear(128, 64, bias=False)
    fresh.load_state_dict(sd, assign=True)
    assert torch.equal(fresh.weight.act_tensors["act_zero_point"], qw.act_tensors["act_zero_point"])
    with torch.no_grad():
        assert torch.equal(fresh(x), eager)


def test_dynamic_per_tensor_int8_runs_int_mm_with_one_scale_per_call():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    affineq.quantize_(lin, affineq.Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor",
                                                                         packing_format="plain"))
    x = torch.randn(5, 64)
    x[0] *= 10  # one loud row sets the scale of every row (per token it would not)
    with torch.no_grad(), record_kernels() as used:
        y = lin(x)
    assert used == ["aten._int_mm"]
    s = x.abs().max() / 127.5
    xq = torch.clamp(torch.round(x / s), -128, 127) * s
    ref = F.linear(xq, lin.weight.dequantize())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="act_granularity"):
        affineq.Int8DynamicActivationInt8WeightConfig(act_granularity="per_row")
