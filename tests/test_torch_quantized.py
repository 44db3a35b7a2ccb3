"""AffineQuantizedTensor <-> torch quantized tensors: int_repr() and dequantize() equal bit for bit both ways."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from affineq import AffineQuantizedTensor, MappingType, ZeroPointDomain
from affineq.microexp import microexp_tensor
from affineq.tensor.spec import QParamOptions

AQT = AffineQuantizedTensor
warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")

_QDTYPES = {torch.qint8: (-128, 127), torch.quint8: (0, 255), torch.qint32: (-(2**31), 2**31 - 1)}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _random_qtensors(seed: int):
    """Per-tensor and per-channel torch quantized tensors: random shapes, axes, scales, zero points, dtypes."""
    g = torch.Generator().manual_seed(seed)
    for qdtype, (lo, hi) in _QDTYPES.items():
        for _ in range(4):
            rank = int(torch.randint(1, 4, (), generator=g))
            shape = tuple(int(s) for s in torch.randint(1, 9, (rank,), generator=g))
            x = torch.randn(shape, generator=g) * float(torch.rand((), generator=g) * 50 + 0.1)
            scale = float(torch.rand((), generator=g, dtype=torch.float64)) * 0.2 + 1e-4
            zlo, zhi = (max(lo, -100), min(hi, 100)) if qdtype != torch.quint8 else (0, 255)
            zp = int(torch.randint(zlo, zhi + 1, (), generator=g))
            yield torch.quantize_per_tensor(x, scale, zp, qdtype)
            axis = int(torch.randint(0, rank, (), generator=g))
            c = shape[axis]
            scales = torch.rand(c, generator=g, dtype=torch.float64) * 0.2 + 1e-4
            zps = torch.randint(zlo, zhi + 1, (c,), generator=g)
            yield torch.quantize_per_channel(x, scales, zps, axis, qdtype)


@pytest.mark.parametrize("seed", range(3))
def test_from_torch_then_back_is_bit_exact(seed):
    for qt in _random_qtensors(seed):
        a = AQT.from_torch_quantized(qt)
        assert a.packing_format == "plain" and a.zero_point_domain is ZeroPointDomain.INT
        assert torch.equal(a.codes(), qt.int_repr()), qt.qscheme()
        assert _bits_equal(a.dequantize(), qt.dequantize()), (qt.qscheme(), qt.dtype, qt.shape)
        back = a.to_torch_quantized()
        assert back.dtype == qt.dtype and back.qscheme() == qt.qscheme()
        assert torch.equal(back.int_repr(), qt.int_repr())
        assert _bits_equal(back.dequantize(), qt.dequantize())
        if qt.qscheme() == torch.per_channel_affine:
            if qt.shape[qt.q_per_channel_axis()] > 1:  # a 1-channel axis is one block: any such dim reads alike
                assert back.q_per_channel_axis() == qt.q_per_channel_axis()
            assert torch.equal(back.q_per_channel_scales(), qt.q_per_channel_scales())  # float64 kept exactly
            assert torch.equal(back.q_per_channel_zero_points(), qt.q_per_channel_zero_points())
        else:
            assert back.q_zero_point() == qt.q_zero_point()


def test_qint32_large_codes_per_channel_and_per_tensor():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-(2**31) + 200, 2**31 - 200, (6, 10), dtype=torch.int32, generator=g)
    scales = torch.rand(10, dtype=torch.float64, generator=g)
    qt = torch._make_per_channel_quantized_tensor(q, scales, torch.randint(-9, 9, (10,), generator=g), 1)
    assert _bits_equal(AQT.from_torch_quantized(qt).dequantize(), qt.dequantize())  # both float64 math
    # per-tensor: torch rounds q - zp to float32 first; equal for every |q - zp| < 2**24
    small = torch.randint(-(2**24) + 10, 2**24 - 10, (1000,), dtype=torch.int32, generator=g)
    pt = torch._make_per_tensor_quantized_tensor(small, 0.123456789, 7)
    assert _bits_equal(AQT.from_torch_quantized(pt).dequantize(), pt.dequantize())


def test_cross_check_with_torch_quantize_per_channel():
    # torch.ao's reference: torch quantizes, affineq dequantizes (and requantizes with the same qparams)
    w = torch.randn(24, 40)
    scale, zp = torch.rand(24, dtype=torch.float64) * 0.05 + 0.01, torch.randint(-20, 20, (24,))
    qt = torch.quantize_per_channel(w, scale, zp, 0, torch.qint8)
    a = AQT.from_torch_quantized(qt)
    assert _bits_equal(a.dequantize(), qt.dequantize())
    assert a.block_size == (1, 40) and a.scale.dtype == torch.float64 and a.scale.shape == (24, 1)
    # the other direction: affineq quantizes (int8 per-row symmetric), torch reads the codes through int_repr
    aq = AQT.from_spec(w, (1, 40), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    t = aq.to_torch_quantized()
    assert t.qscheme() == torch.per_channel_affine and t.q_per_channel_axis() == 0
    assert torch.equal(t.int_repr(), aq.codes()) and _bits_equal(t.dequantize(), aq.dequantize())
    ref = torch.quantize_per_channel(w, aq.scale.flatten().double(), aq.zero_point.flatten().long(), 0, torch.qint8)
    assert torch.equal(ref.int_repr(), aq.codes())  # same codes as torch's own quantizer with those qparams


@pytest.mark.parametrize("target,qdtype", [(torch.int8, torch.qint8), (torch.uint8, torch.quint8),
                                           (torch.int32, torch.qint32)])
def test_affine_tensors_to_torch(target, qdtype):
    w = torch.randn(16, 32) * 3
    # int32: codes within +-2**23, where torch's per-tensor float32 math (float32(q - zp) * scale) is exact
    rng = dict(quant_min=-(2**23), quant_max=2**23 - 1) if target == torch.int32 else {}
    per_tensor = AQT.from_spec(w, (16, 32), target=target, mapping_type=MappingType.ASYMMETRIC, **rng)
    t = per_tensor.to_torch_quantized()
    assert t.dtype == qdtype and t.qscheme() == torch.per_tensor_affine
    assert torch.equal(t.int_repr(), per_tensor.codes()) and _bits_equal(t.dequantize(), per_tensor.dequantize())
    for block, axis in (((16, 1), 1), ((1, 32), 0)):
        a = AQT.from_spec(w, block, target=target, mapping_type=MappingType.ASYMMETRIC, **rng)
        t = a.to_torch_quantized()
        assert t.qscheme() == torch.per_channel_affine and t.q_per_channel_axis() == axis
        assert torch.equal(t.int_repr(), a.codes()) and _bits_equal(t.dequantize(), a.dequantize())
        back = AQT.from_torch_quantized(t)
        assert _bits_equal(back.dequantize(), a.dequantize())
    # a NONE zero point becomes 0; a transposed view converts its logical layout
    sym = AQT.from_spec(w, (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                        zero_point_domain=ZeroPointDomain.NONE)
    t = sym.t().to_torch_quantized()
    assert t.shape == (32, 16) and t.q_per_channel_axis() == 1 and not t.q_per_channel_zero_points().any()
    assert _bits_equal(t.dequantize(), sym.t().dequantize())


def test_symmetric_qschemes_are_read():
    # torch's kernels only build *_affine tensors; the symmetric schemes share their math, so relabel one
    x = torch.randn(8, 16)
    pc = torch.quantize_per_channel(x, torch.full((8,), 0.02, dtype=torch.float64), torch.zeros(8, dtype=torch.long),
                                    0, torch.qint8)
    pt = torch.quantize_per_tensor(x, 0.02, 0, torch.qint8)
    for qt, scheme in ((pc, torch.per_channel_symmetric), (pt, torch.per_tensor_symmetric)):
        qt.qscheme = lambda scheme=scheme: scheme
        a = AQT.from_torch_quantized(qt)
        assert a.spec.mapping_type is MappingType.SYMMETRIC and _bits_equal(a.dequantize(), qt.dequantize())


def test_unsupported_inputs_name_the_problem():
    x = torch.randn(8, 16)
    fq = torch.quantize_per_channel(x, torch.full((8,), 0.1, dtype=torch.float64), torch.zeros(8), 0, torch.quint8)
    assert fq.qscheme() == torch.per_channel_affine_float_qparams
    with pytest.raises(ValueError, match="per_channel_affine_float_qparams"):
        AQT.from_torch_quantized(fq)
    with pytest.raises(ValueError, match="quint4x2"):
        AQT.from_torch_quantized(torch.quantize_per_tensor(x, 0.1, 0, torch.quint4x2))
    with pytest.raises(ValueError, match="torch quantized tensor"):
        AQT.from_torch_quantized(x)
    cases = [
        (AQT.from_spec(x, (1, 8), target=torch.int8, mapping_type=MappingType.ASYMMETRIC), "group-wise"),
        (AQT.from_spec(x, (1, 16), target=torch.uint4, mapping_type=MappingType.ASYMMETRIC),
         "uint4 has no torch quantized dtype"),
        (AQT.from_spec(x, (1, 16), QParamOptions(preserve_zero=False), target=torch.uint8,
                       mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT),
         "zero_point_domain=FLOAT"),
        (AQT.from_spec(x, (1, 16), target=torch.float8_e4m3fn, mapping_type=MappingType.SYMMETRIC),
         "float8_e4m3fn has no torch"),
        (AQT.from_spec(x, (1, 16), target=torch.int8, mapping_type=MappingType.SYMMETRIC).with_act_tensors(
            act_pre_scale=torch.ones(16)), "activation quantization"),
        (microexp_tensor(x, "mx9"), "group-wise"),
    ]
    for a, msg in cases:
        with pytest.raises(ValueError, match=msg):
            a.to_torch_quantized()


def test_converted_weight_runs_linear():
    w = torch.randn(32, 64)
    qt = torch.quantize_per_channel(w, torch.rand(32, dtype=torch.float64) * 0.02 + 0.01,
                                    torch.zeros(32, dtype=torch.long), 0, torch.qint8)
    a = AQT.from_torch_quantized(qt)
    x = torch.randn(4, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(F.linear(x, a), x @ qt.dequantize().t(), rtol=1e-5, atol=1e-5)
