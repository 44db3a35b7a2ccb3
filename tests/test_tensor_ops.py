"""The op table: every registered op, composed view ops, and the announced dequantize fallback."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr

from affineq import (
    AffineQuantizedTensor,
    KernelFallbackWarning,
    MappingType,
    ZeroPointDomain,
    record_kernels,
    strict_kernels,
)
from affineq.kernels import KernelFallbackError
from affineq.tensor.spec import QParamOptions

AQT = AffineQuantizedTensor
aten = torch.ops.aten


@pytest.fixture(params=["plain", "dense", "int4_cpu"])
def qw(request):
    w = torch.randn(64, 128)
    return AQT.from_spec(w, (1, 32), QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False), target=torch.uint4,
                         mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                         packing_format=request.param)


def _same(a, b):
    assert isinstance(a, AQT)
    assert a.shape == b.shape
    assert torch.equal(a.dequantize(), b)


def test_table_covers_the_issue_ops():
    for op in [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.embedding.default,
               aten.convolution.default, aten.t.default, aten.transpose.int, aten.permute.default,
               aten.view.default, aten.slice.Tensor, aten.select.int, aten.index.Tensor, aten.split.Tensor,
               aten.cat.default, aten.detach.default, aten.clone.default, aten.alias.default,
               aten._to_copy.default, aten.copy_.default, aten.equal.default]:
        assert AQT.op_handler(op) is not None, op
    assert AQT.op_handler(F.linear) is not None


def test_transpose_views_are_free_and_compose(qw):
    d = qw.dequantize()
    _same(qw.t(), d.t())
    _same(qw.t().t(), d)
    _same(qw.transpose(0, 1), d.t())
    _same(qw.permute(1, 0), d.t())
    assert qw.t().qdata.data_ptr() == qw.qdata.data_ptr()  # a flag, not a copy
    assert qw.t().t().packing_format == qw.packing_format


def test_structural_ops_match_the_float_ops(qw):
    d = qw.dequantize()
    _same(qw[16:48], d[16:48])
    _same(qw[:, 32:96], d[:, 32:96])
    _same(qw.narrow(0, 8, 16), d.narrow(0, 8, 16))
    _same(qw[5], d[5])
    idx = torch.tensor([3, 1, 60])
    _same(qw[idx], d[idx])
    _same(qw.view(64, 4, 32), d.view(64, 4, 32))
    _same(qw.reshape(2, 32, 128), d.reshape(2, 32, 128))
    parts = qw.split(16)
    assert len(parts) == 4
    for p, r in zip(parts, d.split(16), strict=False):
        _same(p, r)
    _same(torch.cat([qw[:16], qw[16:]]), d)
    _same(torch.cat([qw[:, :64], qw[:, 64:]], dim=1), d)


def test_row_slices_keep_the_packed_format(qw):
    assert qw[16:48].packing_format == qw.packing_format
    assert qw[3:4].packing_format == ("plain" if qw.packing_format == "int4_cpu" else qw.packing_format)


def test_cutting_blocks_unevenly_is_an_error(qw):
    with pytest.raises(ValueError, match="cut its quantization blocks unevenly.*block_size \\(1, 32\\)"):
        qw[:, 16:64]


def test_linear_and_matmul_routes_agree(qw):
    x = torch.randn(3, 128)
    ref = F.linear(x, qw.dequantize())
    # int4_cpu computes in bf16 (see kernels.py): > 40 dB against the fp32 reference, exact otherwise
    min_db = 40 if qw.packing_format == "int4_cpu" else 100
    for y in [F.linear(x, qw), x @ qw.t(), torch.matmul(x, qw.t().t().t()), torch.mm(x, qw.t()),
              torch.addmm(torch.zeros(64), x, qw.t())]:
        assert sqnr(ref, y) > min_db
    assert sqnr(F.linear(x, qw.dequantize()[16:48]), F.linear(x, qw[16:48])) > min_db


def test_slice_then_linear_still_runs_a_packed_kernel():
    w = AQT.from_spec(torch.randn(64, 128), (1, 32), QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False),
                      target=torch.uint4, mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                      packing_format="int4_cpu")
    with record_kernels() as used:
        F.linear(torch.randn(2, 128), w[16:48])
        F.linear(torch.randn(2, 128), w.t().t())
    assert used == ["aten._weight_int4pack_mm_for_cpu"] * 2


def test_bookkeeping_ops(qw):
    assert torch.equal(qw, qw.clone()) and qw.clone().qdata.data_ptr() != qw.qdata.data_ptr()
    assert torch.equal(qw.detach(), qw) and qw.detach().qdata.data_ptr() == qw.qdata.data_ptr()
    assert torch.equal(qw, torch.ops.aten.alias(qw))
    assert qw.contiguous() is qw
    b = qw.to(torch.bfloat16)
    assert isinstance(b, AQT) and b.dtype == torch.bfloat16 and b.dequantize().dtype == torch.bfloat16
    assert qw.to("cpu").device.type == "cpu"
    p = torch.nn.Parameter(qw, requires_grad=False)
    assert isinstance(p, AQT) and isinstance(p, torch.nn.Parameter)
    assert not qw.requires_grad_(False).requires_grad
    with pytest.raises(ValueError, match="logical dtype is floating point"):
        qw.to(torch.int8)


def test_copy_between_matching_and_mismatched_tensors(qw):
    other = AQT.from_spec(torch.randn(64, 128), (1, 32), QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False),
                          target=torch.uint4, mapping_type=MappingType.ASYMMETRIC,
                          zero_point_domain=ZeroPointDomain.FLOAT, packing_format=qw.packing_format)
    dst = qw.clone()
    dst.copy_(other)
    assert torch.equal(dst, other) and not torch.equal(dst, qw)
    int8 = AQT.from_spec(torch.randn(64, 128), (1, 128), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    with pytest.raises(ValueError, match="different config"):
        dst.copy_(int8)
    if qw.packing_format == "dense":  # same spec, qparams stored in fp32 instead of bf16
        fp32_qparams = AQT.from_spec(torch.randn(64, 128), (1, 32),
                                     QParamOptions(scale_dtype=torch.float32, preserve_zero=False), target=torch.uint4,
                                     mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                                     packing_format="dense")
        assert fp32_qparams.spec == dst.spec
        with pytest.raises(ValueError, match="different config"):
            dst.copy_(fp32_qparams)
    with pytest.raises(ValueError, match="cannot copy a float tensor into quantized"):
        dst.copy_(torch.randn(64, 128))
    with pytest.raises(ValueError, match="assign=True"):
        torch.randn(64, 128).copy_(qw)


def test_embedding_gathers_rows_only():
    w = torch.randn(1000, 64)
    q = AQT.from_spec(w, (1, 64), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    ids = torch.tensor([[0, 999], [5, 5]])
    torch.testing.assert_close(F.embedding(ids, q), F.embedding(ids, q.dequantize()), rtol=0, atol=0)


def test_conv_and_bmm_run_on_dequantized_weights():
    w = torch.randn(8, 3, 3, 3)
    q = AQT.from_spec(w, (1, 3, 3, 3), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    x = torch.randn(1, 3, 10, 10)
    with pytest.warns(KernelFallbackWarning, match="no packed convolution kernel"), record_kernels() as used:
        torch.testing.assert_close(F.conv2d(x, q), F.conv2d(x, q.dequantize()))
    assert used == ["dequantize:conv"]
    w1 = AQT.from_spec(torch.randn(8, 3, 5), (1, 3, 5), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    torch.testing.assert_close(F.conv1d(torch.randn(2, 3, 20), w1).shape, torch.Size([2, 8, 16]))
    b = AQT.from_spec(torch.randn(2, 16, 8), (1, 1, 8), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    a = torch.randn(2, 4, 16)
    torch.testing.assert_close(torch.bmm(a, b), torch.bmm(a, b.dequantize()))


def test_op_not_in_table_falls_back_and_warns_once(qw):
    with pytest.warns(KernelFallbackWarning, match="aten.sigmoid.default is not in the op table"):
        out = torch.sigmoid(qw)
    torch.testing.assert_close(out, torch.sigmoid(qw.dequantize()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.sigmoid(qw)  # second call: no new warning
    with strict_kernels(), pytest.raises(KernelFallbackError, match="strict mode"):
        torch.sigmoid(qw)


def test_inplace_op_is_a_clear_error(qw):
    with pytest.raises(NotImplementedError, match=r"in-place op .*add_.*dequantize\(\) first"):
        qw.add_(1)


def test_lstm_with_quantized_weights_runs_and_warns_once():
    lstm = torch.nn.LSTM(32, 64, num_layers=2)
    x = torch.randn(7, 3, 32)
    ref = lstm(x)[0].detach()
    for name, p in list(lstm.named_parameters()):
        if name.startswith("weight"):
            q = AQT.from_spec(p.detach(), (1, p.shape[1]), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                              zero_point_domain=ZeroPointDomain.NONE)
            setattr(lstm, name, torch.nn.Parameter(q, requires_grad=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lstm(x)[0]
        lstm(x)
    fallback = [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
    assert len(fallback) == 1
    assert (out - ref).abs().max() < 0.01


def test_views_of_a_quantized_weight_work_under_inference_mode():
    """detach / slice / cat of a (normal) quantized parameter inside torch.inference_mode(): the view's version
    counter bookkeeping needs a non-inference output (affineq.models.generate concatenates q/k/v weights there)."""
    import affineq

    lin = torch.nn.Linear(64, 48, bias=False)
    affineq.quantize_(lin, affineq.Int4WeightOnlyConfig(group_size=32))
    x = torch.randn(2, 64)
    with torch.inference_mode():
        w = lin.weight.detach()
        assert torch.equal(torch.nn.functional.linear(x, w[:16]), lin(x)[:, :16])
        both = torch.cat([w, lin.weight[:16]], 0)
        assert torch.equal(both.dequantize()[48:], w.dequantize()[:16])
