"""AffineQuantizedTensor: construction, fields, dequantize, repr, storage, formats round trips."""

import pytest
import torch
from conftest import sqnr
from expecttest import assert_expected_inline

from affineq import AffineQuantizedTensor, MappingType, ZeroPointDomain
from affineq.primitives import choose_qparams_affine, dequantize_affine, quantize_affine
from affineq.tensor.formats import FORMATS
from affineq.tensor.spec import QParamOptions

AQT = AffineQuantizedTensor


def _int4_asym(w, fmt, g=32):
    """The tinygemm scheme; bf16 scales so that every format (int4_cpu stores bf16) holds equal codes."""
    return AQT.from_spec(w, (1, g), QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False), target=torch.uint4,
                         mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
                         packing_format=fmt)


def test_wrapper_has_float_shape_dtype_and_fields():
    w = torch.randn(64, 128)
    q = AQT.from_spec(w, (1, 128), target=torch.int8, mapping_type=MappingType.SYMMETRIC)
    assert isinstance(q, torch.Tensor) and q.shape == (64, 128) and q.dtype == torch.float32
    assert q.qdata.dtype == torch.int8 and q.scale.shape == (64, 1) and q.block_size == (1, 128)
    assert (q.quant_min, q.quant_max, q.packing_format, q.target_dtype) == (-128, 127, "plain", torch.int8)
    assert q.zero_point_domain is ZeroPointDomain.INT and q.act_quant is None
    scale, zp = choose_qparams_affine(w, MappingType.SYMMETRIC, (1, 128), torch.int8)
    codes = quantize_affine(w, (1, 128), scale, zp, torch.int8)
    assert torch.equal(q.qdata, codes)
    assert torch.equal(q.dequantize(), dequantize_affine(codes, (1, 128), scale, zp, torch.int8))


def test_repr_golden():
    q = _int4_asym(torch.randn(32, 64), "plain")
    assert_expected_inline(repr(q), """AffineQuantizedTensor(shape=(32, 64), dtype=torch.float32, target=torch.uint4, block_size=(1, 32), format=plain, domain=FLOAT)""")  # noqa: E501
    assert_expected_inline(repr(q.t()), """AffineQuantizedTensor(shape=(64, 32), dtype=torch.float32, target=torch.uint4, block_size=(1, 32), format=plain, domain=FLOAT, transposed)""")  # noqa: E501


@pytest.mark.parametrize("fmt", ["plain", "dense", "int4_cpu"])
def test_every_cpu_format_holds_the_same_codes_and_qparams(fmt):
    w = torch.randn(64, 256)
    ref = _int4_asym(w, "plain")
    q = _int4_asym(w, fmt)
    assert q.packing_format == fmt
    assert torch.equal(q.codes(), ref.codes())
    torch.testing.assert_close(q.scale.float(), ref.scale.float(), rtol=0, atol=0)
    torch.testing.assert_close(q.zero_point.float(), ref.zero_point.float(), rtol=1e-6, atol=1e-6)
    # scale * u + offset and (q - mid) * scale + zp agree to float rounding
    torch.testing.assert_close(q.dequantize(), ref.dequantize(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", range(1, 9))
def test_dense_storage_is_bit_packed(bits):
    dtype = getattr(torch, f"int{bits}")
    w = torch.randn(128, 512)
    q = AQT.from_spec(w, (1, 128), target=dtype, mapping_type=MappingType.SYMMETRIC, packing_format="dense",
                      zero_point_domain=ZeroPointDomain.NONE)
    assert q.qdata.numel() * q.qdata.element_size() == 128 * 512 * bits // 8
    ref = AQT.from_spec(w, (1, 128), target=dtype, mapping_type=MappingType.SYMMETRIC,
                        zero_point_domain=ZeroPointDomain.NONE)
    assert torch.equal(q.codes(), ref.codes())


def test_storage_bytes_per_parameter():
    w = torch.randn(1024, 1024)
    q4 = _int4_asym(w, "dense", g=128)
    q8 = AQT.from_spec(w, (1, 1024), target=torch.int8, mapping_type=MappingType.SYMMETRIC, packing_format="dense",
                       zero_point_domain=ZeroPointDomain.NONE)
    assert q4.storage_bytes() / w.numel() <= 0.57
    assert q8.storage_bytes() / w.numel() <= 1.02
    assert _int4_asym(w, "int4_cpu", g=128).storage_bytes() / w.numel() <= 0.54


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_output_dtype_and_no_alias(dtype):
    w = torch.randn(32, 64, dtype=dtype)
    q = AQT.from_spec(w, (1, 32), target=torch.uint8, mapping_type=MappingType.ASYMMETRIC)
    d = q.dequantize()
    assert d.dtype == dtype and q.dequantize(torch.float32).dtype == torch.float32
    assert d.data_ptr() != q.qdata.data_ptr()
    assert sqnr(w.float(), d.float()) > 40


def test_from_qparams_uses_given_scale():
    w = torch.randn(16, 64)
    scale = torch.full((16, 2), 0.05)
    zp = torch.zeros(16, 2, dtype=torch.int32)
    q = AQT.from_qparams(w, scale, zp, (1, 32), torch.int8)
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.qdata, torch.clamp(torch.round(w / 0.05), -128, 127).to(torch.int8))


@pytest.mark.parametrize(("fmt", "shape", "words"), [
    ("int4_cpu", (32, 63), "even in_features"),
    ("int4_cpu", (24, 64), "divisible by 16"),
    ("dense", (2, 4, 8, 32), "2-D"),  # (3-D: expert weights, held per expert: tests/test_moe.py)
])
def test_format_rejects_what_it_cannot_hold(fmt, shape, words):
    w = torch.randn(shape)
    block = (1,) * (len(shape) - 1) + (shape[-1] if fmt != "int4_cpu" else 32,)
    if shape == (32, 63):
        block = (1, 63)
    with pytest.raises(ValueError, match=f"packing_format='{fmt}'.*{words}"):
        AQT.from_spec(w, block, target=torch.uint4, mapping_type=MappingType.ASYMMETRIC, packing_format=fmt)


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown packing_format 'fancy'.*dense"):
        AQT.from_spec(torch.randn(4, 8), (1, 8), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                      packing_format="fancy")
    assert {"plain", "dense", "int4_cpu", "int4_cuda"} <= set(FORMATS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="int4_cuda needs a CUDA device")
def test_int4_cuda_format_round_trip():
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    ref = _int4_asym(w, "plain", g=128)
    q = _int4_asym(w, "int4_cuda", g=128)
    assert torch.equal(q.codes(), ref.codes())


@pytest.mark.parametrize(("target", "mapping", "domain", "scale_dtype"), [
    (torch.int8, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.float32),  # Int8WeightOnlyConfig
    (torch.int3, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.float32),
    (torch.int3, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.bfloat16),
    (torch.uint2, MappingType.ASYMMETRIC, ZeroPointDomain.INT, torch.float32),
    (torch.uint4, MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT, torch.bfloat16),  # Int4WeightOnlyConfig
    (torch.float8_e4m3fn, MappingType.SYMMETRIC, ZeroPointDomain.NONE, torch.float32),
])
def test_dense_dequantizes_with_the_primitives_rounding(target, mapping, domain, scale_dtype):
    # "auto" stores `plain` without the C++ kernels and `dense` with them: dequantize() must not depend on it,
    # so dense rounds as the primitives do ((q - zp) * scale), bit for bit, in dequantize and embedding rows
    torch.manual_seed(3)
    w = torch.randn(48, 96)
    q = AffineQuantizedTensor.from_spec(w, (1, 32), QParamOptions(scale_dtype=scale_dtype), target=target,
                                        mapping_type=mapping, zero_point_domain=domain, packing_format="dense")
    plain = q.to_format("plain")
    ref = dequantize_affine(plain.codes(), (1, 32), plain.scale, plain.zero_point, target,
                            zero_point_domain=domain)
    assert torch.equal(q.dequantize(), ref) and torch.equal(plain.dequantize(), ref)
    rows = torch.tensor([0, 47, 16, 5])
    assert torch.equal(torch.nn.functional.embedding(rows, q), ref[rows])


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("spec_args", [
    dict(target=torch.uint4, mapping_type=MappingType.ASYMMETRIC, packing_format="dense"),
    dict(target=torch.int8, mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE),
    dict(target="fp4_e2m1", mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.NONE,
         packing_format="dense"),
], ids=["uint4-g32-dense", "int8-g32-plain", "fp4-g32-dense"])
def test_from_spec_by_row_chunks_is_bit_identical(rows, spec_args):
    """The one quantizing constructor: `chunk_rows` (the streaming quantizer's bounded temporaries) stores the
    same tensors as quantizing the whole weight; a weight whose blocks span rows is quantized whole."""
    w = torch.randn(100, 64)
    opts = QParamOptions(scale_dtype=torch.bfloat16) if spec_args["target"] == torch.uint4 else None
    whole = AQT.from_spec(w, (1, 32), opts, **spec_args)
    chunked = AQT.from_spec(w, (1, 32), opts, chunk_rows=rows, **spec_args)
    assert whole.spec == chunked.spec and whole.tensors.keys() == chunked.tensors.keys()
    assert all(torch.equal(whole.tensors[k], chunked.tensors[k]) for k in whole.tensors)
    per_tensor = AQT.from_spec(w, (100, 64), chunk_rows=rows, target=torch.int8)
    assert torch.equal(per_tensor.qdata, AQT.from_spec(w, (100, 64), target=torch.int8).qdata)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        AQT.from_spec(w, (1, 32), chunk_rows=0, **spec_args)


def test_from_float_is_a_deprecated_spelling_of_from_spec():
    w = torch.randn(16, 64)
    with pytest.warns(DeprecationWarning, match=r"from_spec\(input, block_size, QParamOptions"):
        old = AQT.from_float(w, MappingType.ASYMMETRIC, (1, 32), torch.uint4, scale_dtype=torch.float32,
                             packing_format="dense")
    new = AQT.from_spec(w, (1, 32), QParamOptions(scale_dtype=torch.float32), target=torch.uint4,
                        mapping_type=MappingType.ASYMMETRIC, packing_format="dense")
    assert old.spec == new.spec and all(torch.equal(old.tensors[k], new.tensors[k]) for k in new.tensors)
