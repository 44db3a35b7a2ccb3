"""fp4 / fp6 codes and e8m0 (power-of-two) scales in the `dense` format and the C++ `affineq::lowbit_linear`:
every code decodes to its table value, the kernel matches F.linear on the dequantized weight on every path,
dense dequantizes bit for bit like plain and the primitives, and MX storage costs 4.25 / 6.25 / 8.25 bits."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import affineq
import affineq.cpp as K
from affineq.dtypes import qtype
from affineq.primitives import MappingType, ZeroPointDomain, dequantize_affine
from affineq.tensor.activation import fake_quantize_activation
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.formats import get_format
from affineq.tensor.kernel_registry import auto_format
from affineq.tensor.spec import ActivationQuant, QuantSpec

# (target, codes kind, storage bits)
FPX = [("fp4_e2m1", K.CODES_FP4_E2M1, 4), ("fp6_e2m3", K.CODES_FP6_E2M3, 6), ("fp6_e3m2", K.CODES_FP6_E3M2, 6)]
PATHS = [1, 2, 3, 4]  # fused GEMV, fp32 GEMM, int16 VNNI GEMM, bf16 dot GEMM (each falls back where missing)


def _needs_kernels() -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")


def _spec(shape, target, scale_type="e8m0", group=32, fmt="dense", **kw) -> QuantSpec:
    qt = qtype(target)
    if not qt.is_float:
        kw.setdefault("quant_min", -127)
        kw.setdefault("quant_max", 127)
    return QuantSpec.create(shape, torch.float32, target, (1, group), mapping_type=MappingType.SYMMETRIC,
                            zero_point_domain=kw.pop("zero_point_domain", ZeroPointDomain.NONE),
                            packing_format=fmt, scale_type=scale_type, **kw)


def _aqt(w: torch.Tensor, target: str, scale_type="e8m0", fmt="dense", group=32, **kw) -> AffineQuantizedTensor:
    """Weight quantized with scale = amax / element max per (1, group) block (rounded up to 2**e for e8m0)."""
    qt = qtype(target)
    top = qt.qmax if qt.is_float else kw.get("quant_max", 127)
    scale = w.view(w.shape[0], -1, group).abs().amax(-1).clamp_min(1e-12) / top
    zp = torch.zeros_like(scale, dtype=torch.int32) if kw.get("zero_point_domain") is ZeroPointDomain.INT else None
    return AffineQuantizedTensor.from_qparams(w, scale, zp, _spec(tuple(w.shape), target, scale_type, group,
                                                                    fmt, **kw))


def _stored_bits(a: AffineQuantizedTensor) -> float:
    n, k = a.spec.shape
    return sum(t.numel() * t.element_size() for t in a.tensors.values()) * 8 / (n * k)


@pytest.mark.parametrize("target,kind,bits", FPX)
def test_every_code_decodes_to_its_table_value(target: str, kind: int, bits: int) -> None:
    # every code, in every row position of a ragged panel (n = 37) and every k slot, through pack -> dequantize
    n, k = 37, 2 ** bits * 2
    u = (torch.arange(n * k) * 7 % 2**bits).to(torch.uint8).view(n, k)
    assert set(u.unique().tolist()) == set(range(2**bits))
    pk = K.pack_codes(u, bits)
    table = qtype(target).decode(u)
    ones, zeros = torch.ones(n, k // 32), torch.zeros(n, k // 32)
    assert torch.equal(K._dequantize(pk, ones, zeros, bits, 32, n, k, kind), table)
    assert torch.equal(torch.ops.affineq.lowbit_dequantize(pk, ones, zeros, bits, 32, n, k, kind), table)
    # e8m0 bytes: 2**(b - 127) times the value, exact
    b = torch.randint(100, 150, (n, k // 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    want = table * torch.exp2(b.double() - 127).repeat_interleave(32, 1).float()
    assert torch.equal(torch.ops.affineq.lowbit_dequantize(pk, b, None, bits, 32, n, k, kind), want)
    assert torch.equal(K._dequantize(pk, b, None, bits, 32, n, k, kind), want)
    # the sign is the top bit: code ^ sign bit is the negation (zero included: -0.0)
    neg = qtype(target).decode(u ^ (1 << (bits - 1)))
    assert torch.equal(neg, -table)


@pytest.mark.parametrize("target,kind,bits", FPX)
@pytest.mark.parametrize("qp", ["fp32", "e8m0"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lowbit_linear_matches_dequantized_weight(target, kind, bits, qp, xdtype) -> None:
    _needs_kernels()
    n, k, gs = 40, 128, 32
    g = torch.Generator().manual_seed(bits + kind)
    u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    pk = K.pack_codes(u, bits)
    if qp == "fp32":
        s, o = torch.rand(n, k // gs, generator=g) + 0.1, torch.zeros(n, k // gs)
    else:
        s, o = torch.randint(118, 130, (n, k // gs), dtype=torch.uint8, generator=g), None
    w = K._dequantize(pk, s, o, bits, gs, n, k, kind)
    choice, op = torch.ops.affineq_cpp.lowbit_path_for, torch.ops.affineq_cpp.lowbit_linear_path
    out_eps = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[xdtype]
    for m in (1, 2, 8, 32, 100):
        x = torch.randn(m, k, generator=g).to(xdtype)
        for path in PATHS:
            ran = choice(x, gs, kind, path)
            # path 4 computes x @ bf16(W) (like F.linear on a bf16 weight); path 3 rounds x to 16-bit fixed point
            wr = w.bfloat16().double() if ran == 4 else w.double()
            ref = x.double() @ wr.T
            tol = {1: 1e-5, 2: 1e-5, 3: 2e-4, 4: 1e-5}[ran]
            bound = tol * (x.double().abs() @ wr.abs().T) + out_eps * ref.abs() + 1e-30
            y = op(x, pk, s, o, bits, gs, n, k, kind, path)
            err = (y.double() - ref).abs()
            assert bool((err <= bound).all()), (m, path, ran, float((err / bound).max()))
            if o is not None:  # an fp32 scale without offset means offset 0 (what dense stores for fp4 / fp6)
                assert torch.equal(op(x, pk, s, None, bits, gs, n, k, kind, path), y)
        # the default choice agrees with the public op
        y = torch.ops.affineq.lowbit_linear(x, pk, s, o, bits, gs, n, k, kind)
        assert torch.equal(y, op(x, pk, s, o, bits, gs, n, k, kind, 0))


def test_path_choice_for_float_codes() -> None:
    # fp4 / fp6 are small integers after scaling (x2, x8, x16), so the int16 VNNI path serves them where float8
    # cannot; the GEMV serves small m.
    _needs_kernels()
    choice = torch.ops.affineq_cpp.lowbit_path_for
    vnni = choice(torch.zeros(32, 64, dtype=torch.float16), 32, K.CODES_UINT, 0) == 3
    for _, kind, _ in FPX:
        assert choice(torch.zeros(1, 64), 32, kind, 0) == 1
        assert choice(torch.zeros(32, 64), 32, kind, 0) == 2
        assert choice(torch.zeros(32, 64, dtype=torch.float16), 32, kind, 0) == (3 if vnni else 2)
    assert choice(torch.zeros(32, 64, dtype=torch.float16), 32, K.CODES_E4M3, 0) == 2


# (int8 with fp32 scales: tests/test_tensor_affine.py)
@pytest.mark.parametrize("target, scale_type", [
    *((t, s) for t in ("fp4_e2m1", "fp6_e2m3", "fp6_e3m2", "float8_e4m3fn", "float8_e5m2") for s in (None, "e8m0")),
    ("int8", "e8m0"),
])
def test_dense_dequantizes_like_plain_and_the_primitives(target: str, scale_type) -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    d = _aqt(w, target, scale_type)
    p = _aqt(w, target, scale_type, fmt="plain")
    spec = d.spec
    codes = get_format(spec.fmt).codes(d.tensors, spec)
    scale, zp = get_format(spec.fmt).qparams(d.tensors, spec)
    pscale, pzp = get_format(p.spec.fmt).qparams(p.tensors, p.spec)
    assert torch.equal(codes, get_format(p.spec.fmt).codes(p.tensors, p.spec))
    assert torch.equal(scale.float(), pscale.float())
    assert (zp is None) == (pzp is None)
    for out in (torch.float32, torch.bfloat16):
        prim = dequantize_affine(codes, spec.block_size, scale, zp, spec.target, spec.quant_min, spec.quant_max,
                                 spec.zero_point_domain, output_dtype=out)
        assert torch.equal(d.dequantize(out), prim)
        assert torch.equal(p.dequantize(out), prim)
        rows = torch.tensor([0, 17, 47, 17, 5])
        assert torch.equal(get_format(spec.fmt).dequantize_rows(d.tensors, spec, rows, out), prim[rows])
    if scale_type is not None:  # e8m0: exact powers of two
        m, e = torch.frexp(scale.float())
        assert bool((m == 0.5).all())


@pytest.mark.parametrize("target,bits_per_element", [("fp4_e2m1", 4.25), ("fp6_e2m3", 6.25), ("fp6_e3m2", 6.25),
                                                     ("float8_e4m3fn", 8.25), ("float8_e5m2", 8.25),
                                                     ("int8", 8.25)])
def test_mx_storage_bits_per_element(target: str, bits_per_element: float) -> None:
    # MXFP4 / MXFP6 / MXFP8 / MXINT8: the codes plus one e8m0 byte per 32 elements, nothing else
    a = _aqt(torch.randn(64, 256), target)
    assert set(a.tensors) == {"qdata", "scale"}
    assert a.tensors["scale"].dtype == torch.uint8
    assert _stored_bits(a) == bits_per_element


@pytest.mark.parametrize("target,bits_per_element", [("fp4_e2m1", 5.0), ("fp6_e2m3", 7.0), ("fp6_e3m2", 7.0)])
def test_fpx_fp32_scales_store_no_offset(target: str, bits_per_element: float) -> None:
    # FPx with an fp32 scale per 32: the codes plus 32 / 32 bits; the offset of float codes is 0, not stored
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    a = _aqt(w, target, None)
    assert set(a.tensors) == {"qdata", "scale"} and a.tensors["scale"].dtype == torch.float32
    assert _stored_bits(a) == bits_per_element
    assert torch.equal(a.dequantize(), _aqt(w, target, None, fmt="plain").dequantize())
    if K.is_available():
        x = torch.randn(5, 256)
        torch.testing.assert_close(F.linear(x, a), F.linear(x, a.dequantize()), rtol=1e-5, atol=1e-5)
        lin = torch.nn.Linear(256, 64, bias=False)
        lin.weight = torch.nn.Parameter(a, requires_grad=False)
        torch.testing.assert_close(torch.compile(lin, fullgraph=True)(x), lin(x), rtol=1e-6, atol=1e-6)


def test_e8m0_integer_codes_with_zero_points() -> None:
    # symmetric int4 [-8, 7] in the INT domain (zero point 0, stored as nothing) and MXINT8 [-127, 127]
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    for qmin, qmax, target in ((-8, 7, "int4"), (-127, 127, "int8")):
        d = _aqt(w, target, quant_min=qmin, quant_max=qmax, zero_point_domain=ZeroPointDomain.INT)
        p = _aqt(w, target, fmt="plain", quant_min=qmin, quant_max=qmax, zero_point_domain=ZeroPointDomain.INT)
        assert set(d.tensors) == {"qdata", "scale"}
        assert torch.equal(d.dequantize(), p.dequantize())
        s, zp = get_format(d.spec.fmt).qparams(d.tensors, d.spec)
        assert zp is not None and not bool(zp.any())
        if K.is_available():
            x = torch.randn(3, 64)
            torch.testing.assert_close(F.linear(x, d), F.linear(x, d.dequantize()), rtol=1e-5, atol=1e-5)


def test_e8m0_represent_keeps_powers_of_two_and_rounds_up_others() -> None:
    spec = _spec((16, 64), "fp4_e2m1")
    s = torch.tensor([0.25, 0.3, 1.0, 3.0, 2.0**-20, 5.0]).repeat(16 * 2)[: 16 * 2].view(16, 2)
    r, _ = get_format(spec.fmt).represent_qparams(s, None, spec)
    want = torch.tensor([0.25, 0.5, 1.0, 4.0, 2.0**-20, 8.0]).repeat(16 * 2)[: 16 * 2].view(16, 2)
    assert torch.equal(r, want)
    # every e8m0 power of two stays; one ulp above rounds up (fp32 log2 would round it down and clip)
    e = torch.arange(-126, 127, dtype=torch.float32).view(1, -1).expand(16, -1)
    spec = _spec((16, 32 * e.shape[1]), "fp4_e2m1")
    r, _ = get_format(spec.fmt).represent_qparams(torch.exp2(e), None, spec)
    assert torch.equal(r, torch.exp2(e))
    r, _ = get_format(spec.fmt).represent_qparams(torch.exp2(e) * (1 + 2.0**-23), None, spec)
    assert torch.equal(r, torch.exp2(e + 1))


def test_e8m0_op_arguments_are_checked() -> None:
    n, k = 16, 64
    pk = K.pack_codes(torch.zeros(n, k, dtype=torch.uint8), 4)
    b, s = torch.full((n, 2), 127, dtype=torch.uint8), torch.ones(n, 2)
    x = torch.randn(1, k)
    with pytest.raises(ValueError, match="offset=None"):
        K.lowbit_linear_reference(x, pk, b, s, 4, 32, n, k, K.CODES_FP4_E2M1)
    _needs_kernels()
    with pytest.raises((ValueError, RuntimeError), match="offset=None"):
        torch.ops.affineq.lowbit_linear(x, pk, b, s, 4, 32, n, k, K.CODES_FP4_E2M1)
    with pytest.raises((ValueError, RuntimeError), match="code_offset"):
        torch.ops.affineq.lowbit_linear(x, pk, s, s, 4, 32, n, k, K.CODES_UINT, -8)
    with pytest.raises((ValueError, RuntimeError), match="fp4_e2m1, bits=4"):
        torch.ops.affineq.lowbit_linear(x, K.pack_codes(torch.zeros(n, k, dtype=torch.uint8), 6), s, s, 6, 32, n,
                                        k, K.CODES_FP4_E2M1)


def test_linear_compile_save_load_and_auto_format() -> None:
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(5))
    a = _aqt(w, "fp4_e2m1")
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    b = torch.load(buf, weights_only=True)
    assert torch.equal(b.dequantize(), a.dequantize())
    assert auto_format("float_codes", w) == "dense"
    assert auto_format("float_codes", torch.randn(2, 3, 4)) == "plain"
    _needs_kernels()
    lin = torch.nn.Linear(96, 48, bias=True)
    lin.weight = torch.nn.Parameter(b, requires_grad=False)
    x = torch.randn(5, 96)
    with affineq.record_kernels() as used:
        eager = lin(x)
    assert "affineq.lowbit_linear" in used
    torch.testing.assert_close(eager, F.linear(x, a.dequantize(), lin.bias), rtol=1e-5, atol=1e-5)
    compiled = torch.compile(lin, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=1e-6, atol=1e-6)


def test_float_activation_quantization_runs_on_the_kernel() -> None:
    # float8 (and, through the same route, MX) activations on a dense weight: x is fake-quantized first, then the
    # exact weight product (no dequantize fallback)
    _needs_kernels()
    aq = ActivationQuant(torch.float8_e4m3fn, MappingType.SYMMETRIC, "per_token", ZeroPointDomain.NONE)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
    a = _aqt(w, "fp4_e2m1")
    a = AffineQuantizedTensor.from_qparams(w, get_format("dense").qparams(a.tensors, a.spec)[0], None,
                                           a.spec.replace(act_quant=aq))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8))
    with affineq.record_kernels() as used:
        y = F.linear(x, a)
    assert used == ["affineq.lowbit_linear"]
    torch.testing.assert_close(y, F.linear(fake_quantize_activation(x, aq), a.dequantize()), rtol=1e-5, atol=1e-5)
