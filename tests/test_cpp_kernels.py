"""Tests for affineq.cpp: packing format, the C++ lowbit_linear op (all paths) and its Python face."""

from __future__ import annotations

import pytest
import torch
from conftest import packed_problem

import affineq.cpp as K

# (n, k, group_size): ragged n (tail panel), group sizes 32/64/128/per-channel, groups that are not a multiple
# of 8 (fp32 GEMM fallback), k not a multiple of 8 (padded units).
CASES = [
    (37, 96, 32),
    (129, 384, 128),
    (64, 256, 64),
    (50, 200, 200),
    (33, 72, 24),
    (20, 30, 30),
    (17, 40, 8),
]
MS = [1, 2, 3, 8, 33, 130]
# Private path selector of the C++ op: 0 = heuristic, 1 = fused GEMV, 2 = fp32 GEMM, 3 = int16 VNNI GEMM,
# 4 = bf16 dot GEMM, 5 = AMX tile GEMM (each falls back where unsupported; `lowbit_path_for` says which one
# runs).
PATHS = [0, 1, 2, 3, 4, 5]


def _needs_kernels() -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")


def _exact(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, gs: int) -> torch.Tensor:
    n, k = codes.shape
    w = codes.double().view(n, k // gs, gs) * scale.double()[..., None] + offset.double()[..., None]
    return x.double() @ w.view(n, k).T


def _reference(x: torch.Tensor, path: int, gs: int, codes: int, exact: torch.Tensor, w: torch.Tensor,
               bits: int) -> torch.Tensor:
    """What the op must match for x and a `bits`-bit weight: `exact` (fp64 W), or x @ bf16(W) when the bf16 dot
    path runs (it computes dequantize-to-bf16 then a bf16 matmul with fp32 accumulation, like F.linear on the
    bf16 weight)."""
    if torch.ops.affineq_cpp.lowbit_path_for(x, gs, codes, path, bits, w.shape[0]) in (4, 5):
        return x.double() @ w.bfloat16().double().T
    return exact


def _assert_close(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == dtype, what
    mag = exact.abs().max().item() + 1e-30
    err = (out.double() - exact).abs()
    if dtype == torch.float32:
        # fp32 paths are ~1e-6; the forced int16 VNNI path rounds x to 2^-16 * block max (~2e-5 here)
        assert err.max().item() <= 1e-4 * mag, f"{what}: max err {err.max().item():.3g} vs |y| {mag:.3g}"
    else:
        # only the final cast may round: half an ulp of the output dtype (+ fp32-level slack)
        half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
        bound = half_ulp * exact.abs() * 1.01 + 1e-4 * mag
        assert bool((err <= bound).all()), f"{what}: max err {err.max().item():.3g}, |y| {mag:.3g}"


# --------------------------------------------------------------------------------------------------------
# Packing (pure PyTorch, no compiler needed)
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n,k", [(33, 72), (16, 64), (1, 1), (17, 9), (48, 130), (0, 16), (5, 0)])
def test_pack_unpack_roundtrip(bits: int, n: int, k: int) -> None:
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    packed = K.pack_codes(codes, bits)
    k8 = (k + 7) // 8 * 8
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert tuple(packed.shape) == (n, k8 // 8 * bits)
    assert packed.numel() == K.packed_nbytes(n, k, bits) == n * k8 * bits // 8
    # documented padding: only k is rounded up to a multiple of 8
    dense = -(-n * k * bits // 8)
    assert dense <= K.packed_nbytes(n, k, bits) <= dense + n * ((7 * bits + 7) // 8)
    assert torch.equal(K.unpack_codes(packed, bits, n, k), codes)


def test_packed_density_of_real_shapes() -> None:
    for bits, per_elem in [(2, 0.25), (3, 0.375), (4, 0.5), (8, 1.0)]:
        for n, k in [(4096, 4096), (11008, 4096), (4096, 11008)]:
            assert K.packed_nbytes(n, k, bits) == n * k * per_elem


def test_pack_layout_is_the_documented_one() -> None:
    # int4, one full panel of 16 rows + a 3-row tail, one unit (k = 8): slot s, byte j = u[j, 2s] | u[j, 2s+1] << 4
    n, k = 19, 8
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    flat = K.pack_codes(codes, 4).reshape(-1)
    for rows, base, w in [(range(0, 16), 0, 16), (range(16, 19), 64, 3)]:
        for s in range(4):
            for j, r in enumerate(rows):
                assert flat[base + s * w + j] == codes[r, 2 * s] | (codes[r, 2 * s + 1] << 4)
    # int3 = 2-bit plane (bits 0-1, 2 slots of 4 codes) then 1-bit plane (bit 2, 1 slot of 8 codes)
    codes = torch.randint(0, 8, (16, 8), dtype=torch.uint8)
    flat = K.pack_codes(codes, 3).reshape(-1).long()
    for j in range(16):
        for t in range(8):
            low = (flat[(t // 4) * 16 + j] >> (2 * (t % 4))) & 3
            high = (flat[32 + j] >> t) & 1
            assert low | (high << 2) == codes[j, t]


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2\\*\\*bits"):
        K.pack_codes(torch.full((2, 8), 16, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="uint8"):
        K.pack_codes(torch.zeros(2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="bits"):
        K.pack_codes(torch.zeros(2, 8, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="packed"):
        K.unpack_codes(torch.zeros(3, dtype=torch.uint8), 4, 2, 8)


# --------------------------------------------------------------------------------------------------------
# The op vs exact math, every bit width, path, dtype and ragged shape
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_lowbit_linear_all_paths(bits: int) -> None:
    _needs_kernels()
    op = torch.ops.affineq.lowbit_linear
    path_op = torch.ops.affineq_cpp.lowbit_linear_path
    for ci, (n, k, gs) in enumerate(CASES):
        codes, packed, scale, offset = packed_problem(bits, n, k, gs, seed=bits * 100 + ci)
        for m in MS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            exact = _exact(x, codes, scale, offset, gs)
            ref = K.lowbit_linear_reference(x, packed, scale, offset, bits, gs, n, k)
            _assert_close(ref, exact, torch.float32, f"reference bits={bits} {n}x{k} gs={gs} m={m}")
            _assert_close(op(x, packed, scale, offset, bits, gs, n, k), exact, torch.float32,
                          f"op bits={bits} {n}x{k} gs={gs} m={m}")
            for path in PATHS[1:]:
                out = path_op(x, packed, scale, offset, bits, gs, n, k, 0, path)
                _assert_close(out, exact, torch.float32, f"path {path} bits={bits} {n}x{k} gs={gs} m={m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", range(1, 9))
def test_lowbit_linear_half_inputs(bits: int, dtype: torch.dtype) -> None:
    # bf16 x: the GEMV's bf16 tiles (4-bit codes from 1 row, the others from 3, in passes of 4 rows) must give
    # the exact products of the codes with x, as the fp32 GEMV does, for every width's decoder
    _needs_kernels()
    path_op = torch.ops.affineq_cpp.lowbit_linear_path
    for n, k, gs in CASES[:4] + CASES[6:]:
        codes, packed, scale, offset = packed_problem(bits, n, k, gs)
        # the GEMV's rows for bf16 x (4, or 8 for 4 / 8-bit codes; 4-bit passes of 2, 3 or 4 rows), then the GEMM's
        for m in (1, 2, 3, 4, 5, 8, 9, 33):
            x = torch.randn(m, k).to(dtype)
            exact = _exact(x, codes, scale, offset, gs)  # from the rounded x: the op must not round it further
            w = K._dequantize(packed, scale, offset, bits, gs, n, k)
            for path in PATHS:
                out = path_op(x, packed, scale, offset, bits, gs, n, k, 0, path)
                _assert_close(out, _reference(x, path, gs, 0, exact, w, bits), dtype,
                              f"{dtype} path {path} bits={bits} {n}x{k} m={m}")


def test_bf16_x_on_a_large_4bit_weight_up_to_24_rows() -> None:
    # 2^21 weights or more: the bf16-dot GEMV serves bf16 x up to 24 rows (passes of 8 rows, then of 2 or 3, or of
    # 4 where the rest is a multiple of 4), the GEMM from 25
    _needs_kernels()
    n, k, gs = 1024, 2048, 32
    codes, packed, scale, offset = packed_problem(4, n, k, gs)
    w = K._dequantize(packed, scale, offset, 4, gs, n, k)
    for m in (9, 12, 16, 19, 24, 25):
        x = torch.randn(m, k).bfloat16()
        out = torch.ops.affineq.lowbit_linear(x, packed, scale, offset, 4, gs, n, k)
        exact = _exact(x, codes, scale, offset, gs)
        _assert_close(out, _reference(x, 0, gs, 0, exact, w, 4), torch.bfloat16, f"m={m}")


@pytest.mark.parametrize("n,k,gs", [(16 * 17 + 5, 256, 32), (64, 512, 64)])
def test_bf16_x_4bit_gemv_rows_equal_single_row_calls(n: int, k: int, gs: int) -> None:
    # The bf16-dot 4-bit GEMV's passes (8 rows, then 4 / 3 / 2) sum each row in the same order as a one-row call:
    # every row of an m-row call is bit for bit that row's own call, for m = 1..20 (a tail panel included)
    _needs_kernels()
    codes, packed, scale, offset = packed_problem(4, n, k, gs)
    x = torch.randn(20, k).bfloat16()
    run = lambda x: torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, 4, gs, n, k, 0, 1)  # noqa: E731
    one = torch.cat([run(x[i:i + 1]) for i in range(20)]).view(torch.int16)
    assert [m for m in range(1, 21) if not torch.equal(run(x[:m]).view(torch.int16), one[:m])] == []


def test_bf16_x_8bit_gemv_wide_passes_equal_4_row_calls() -> None:
    # 8-bit codes with bf16 x: the GEMV's 8-row passes sum each row as its 4-row passes do (bit for bit)
    _needs_kernels()
    n, k, gs = 16 * 17 + 5, 512, 64
    codes, packed, scale, offset = packed_problem(8, n, k, gs)
    x = torch.randn(16, k).bfloat16()
    run = lambda x: torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, 8, gs, n, k, 0, 1)  # noqa: E731
    four = torch.cat([run(x[i:i + 4]) for i in range(0, 16, 4)]).view(torch.int16)
    assert [m for m in (8, 12, 16) if not torch.equal(run(x[:m]).view(torch.int16), four[:m])] == []


@pytest.mark.parametrize("bits,gs", [(4, 128), (8, 1024), (2, 64), (5, 32)])
def test_lowbit_linear_multi_panel_shapes(bits: int, gs: int) -> None:
    # several tile blocks per thread, a tail panel (n % 16), a partial 32-column tile and > 240 rows of x
    _needs_kernels()
    n, k = 16 * 17 + 5, 1024
    codes, packed, scale, offset = packed_problem(bits, n, k, gs)
    for m in (1, 7, 250):
        x = torch.randn(m, k)
        exact = _exact(x, codes, scale, offset, gs)
        for path in PATHS:
            out = torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, bits, gs, n, k, 0, path)
            _assert_close(out, exact, torch.float32, f"path {path} m={m}")


@pytest.mark.parametrize("threads", [2, 3])
def test_gemm_paths_share_tiles_and_rows(threads: int) -> None:
    # The GEMM paths hand each thread a block of 32-column tiles, or (tiles that do not share evenly: 9 tiles on
    # 2 threads, 5 on 3) all tiles of a part of the rows: row parts that start mid-pass, a partial last tile,
    # row counts that are not multiples of the micro-tiles, bf16 x written straight to a bf16 y.
    _needs_kernels()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k, gs in [(288, 96, 32), (16 * 9 + 3, 64, 64), (150, 40, 8), (32 * 6, 48, 16)]:
            codes, packed, scale, offset = packed_problem(4, n, k, gs)
            w = K._dequantize(packed, scale, offset, 4, gs, n, k)
            for m in (47, 131, 509):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, k).to(dtype)
                    exact = _exact(x, codes, scale, offset, gs)
                    for path in (2, 3, 4):
                        out = torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, 4, gs, n, k, 0,
                                                                       path)
                        _assert_close(out, _reference(x, path, gs, 0, exact, w, 4), dtype,
                                      f"{threads} threads path {path} {dtype} {n}x{k} m={m}")
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("qparams", ["fp32 offsets", "bf16 offsets", "scale only"])
def test_gemv_items_claimed_by_any_thread_give_one_result(qparams: str) -> None:
    # The GEMV hands out its work items (blocks of 4 panels, single panels, the tail panel) one at a time to
    # whichever thread asks first, and prefetches for the item a thread runs next: every thread count must give
    # the exact result, bit for bit the same, call after call.
    _needs_kernels()
    n, k, gs = 64 * 9 + 16 * 3 + 5, 256, 32
    codes, packed, scale, offset = packed_problem(4, n, k, gs)
    code_offset = 0
    if qparams == "bf16 offsets":
        scale, offset = scale.bfloat16(), (offset + scale * 8).bfloat16()  # (scale, zero)
    elif qparams == "scale only":
        scale, offset, code_offset = scale.bfloat16(), None, -8
    w = K._dequantize(packed, scale, offset, 4, gs, n, k, code_offset=code_offset).double()
    previous = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 2):
                x = torch.randn(m, k).to(dtype)
                exact = x.double() @ w.T
                outs = []
                for threads in (1, 2, 3, 2):
                    torch.set_num_threads(threads)
                    outs.append(torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, 4, gs, n, k, 0, 1,
                                                                         code_offset))
                    _assert_close(outs[-1], exact, dtype, f"{qparams} {threads} threads {dtype} m={m}")
                assert all(torch.equal(o, outs[0]) for o in outs[1:]), f"{qparams} {dtype} m={m}"
    finally:
        torch.set_num_threads(previous)


def test_bf16_path_output_nan_is_torchs() -> None:
    # The bf16 GEMM writes its bf16 output itself: a NaN comes out as torch's float -> bf16 NaN (0x7FC0), finite
    # values as the fp32 result rounded to nearest even once.
    _needs_kernels()
    n, k, gs = 64, 64, 32
    codes, packed, scale, offset = packed_problem(4, n, k, gs)
    x = torch.randn(40, k).bfloat16()
    x[3, 5] = float("nan")
    x[7, 0] = float("-inf")
    if torch.ops.affineq_cpp.lowbit_path_for(x, gs, 0, 4) != 4:
        pytest.skip("no AVX512-BF16: the bf16 dot path does not run on this CPU")
    out = torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, 4, gs, n, k, 0, 4)
    w = K._dequantize(packed, scale, offset, 4, gs, n, k).bfloat16()
    ref = x.double() @ w.double().T
    nan = ref.isnan()
    assert bool(nan[3].all()) and torch.equal(out.isnan(), nan)
    assert bool((out.view(torch.int16)[nan] == 0x7FC0).all())
    assert torch.equal(out[7].isinf(), ref[7].isinf()) and torch.equal(out[7].signbit(), ref[7].signbit())
    rows = [i for i in range(x.shape[0]) if i not in (3, 7)]
    _assert_close(out[rows], ref[rows], torch.bfloat16, "finite rows")

@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("qdtype,with_offset", [(torch.float16, True), (torch.float16, False),
                                                (torch.bfloat16, False)])
def test_lowbit_linear_16bit_qparams(bits: int, qdtype: torch.dtype, with_offset: bool) -> None:
    # fp16 scale and offset: W = scale * u + offset (GGUF's Q4_1); a 16-bit scale alone: W = scale * (u + co),
    # co = -2^(bits-1) (GGUF's Q4_0 / Q8_0, symmetric codes), exact with the product's sign (negative scales too)
    _needs_kernels()
    path_op = torch.ops.affineq_cpp.lowbit_linear_path
    co = 0 if with_offset else -(2 ** (bits - 1))
    for n, k, gs in CASES[:5]:
        codes, packed, scale, offset = packed_problem(bits, n, k, gs)
        scale = (scale * torch.where(torch.rand_like(scale) < 0.3, -1.0, 1.0)).to(qdtype)
        offset = offset.to(qdtype) if with_offset else None
        off64 = offset.double() if with_offset else scale.double() * co
        exact_w = (codes.double().view(n, k // gs, gs) * scale.double()[..., None] + off64[..., None]).view(n, k)
        w = torch.ops.affineq.lowbit_dequantize(packed, scale, offset, bits, gs, n, k, 0, co)
        assert torch.equal(w.double(), exact_w.float().double())  # one rounding (none without an offset)
        assert torch.equal(K._dequantize(packed, scale, offset, bits, gs, n, k, 0, co).view(torch.int32),
                           w.view(torch.int32))
        if not with_offset:  # signed zeros as scale * q: -0 where the scale is negative
            assert torch.equal(torch.signbit(w), torch.signbit(scale.float().repeat_interleave(gs, 1)
                                                               * (codes.float() + co)))
        for bf in (False, True):
            fast = torch.ops.affineq.dense_dequantize(packed, scale, offset, bits, gs, n, k, 0, co, False, bf)
            want = K.dense_dequantize_reference(packed, scale, offset, bits, gs, n, k, 0, co, False, bf)
            assert torch.equal(fast.view(torch.int16 if bf else torch.int32),
                               want.view(torch.int16 if bf else torch.int32)), (qdtype, with_offset, bf)
        for m, dtype in ((1, torch.float32), (5, torch.float32), (33, torch.float32), (33, torch.bfloat16)):
            x = torch.randn(m, k).to(dtype)
            exact = x.double() @ exact_w.T
            for path in PATHS:
                _assert_close(path_op(x, packed, scale, offset, bits, gs, n, k, 0, path, co),
                              _reference(x, path, gs, 0, exact, w, bits), dtype,
                              f"{qdtype} qparams (offset {with_offset}) path {path} bits={bits} {n}x{k} m={m}")
    x = torch.randn(2, k)
    for args, msg in (((x, packed, scale.float(), None, bits, gs, n, k, 0, co or -4), "16-bit or e8m0"),
                      ((x, packed, scale, scale, bits, gs, n, k, 0, -4), "without an offset tensor"),
                      ((x, packed, scale, scale.float(), bits, gs, n, k, 0, 0), "offset must")):
        with pytest.raises((RuntimeError, ValueError), match=msg):
            torch.ops.affineq.lowbit_linear(*args)
        with pytest.raises((RuntimeError, ValueError), match=msg):
            K.lowbit_linear_reference(*args)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("qparams", ["f16+offset", "f16", "bf16", "bf16+zero"])
def test_fma_gemv_reads_16bit_qparams_as_stored(bits: int, qparams: str) -> None:
    # The fp32 GEMV at 1-2 rows of 4- / 8-bit codes reads 16-bit qparams as stored (G % 16 == 0) instead of fp32
    # tiles: every convention (fp16 scale and offset, a 16-bit scale alone, bf16 scale and tinygemm zero) within a
    # few fp32 roundings of the float64 product; 5 rows (a pass of 4 on fp32 tiles, then 1) alike.
    _needs_kernels()
    n, k, gs = 40, 512, 32  # G = 16
    codes, packed, scale, offset = packed_problem(bits, n, k, gs, seed=bits)
    half = 2 ** (bits - 1)
    co = 0
    if qparams == "f16+offset":
        scale, offset = scale.half(), offset.half()
        w = codes.double().view(n, -1, gs) * scale.double()[..., None] + offset.double()[..., None]
    elif qparams == "bf16+zero":
        scale, offset = scale.bfloat16(), (0.01 * torch.randn(n, k // gs)).bfloat16()
        w = (codes.double().view(n, -1, gs) - half) * scale.double()[..., None] + offset.double()[..., None]
    else:
        scale, offset, co = scale.to(torch.float16 if qparams == "f16" else torch.bfloat16), None, -half
        w = (codes.double().view(n, -1, gs) + co) * scale.double()[..., None]
    w = w.view(n, k)
    for m in (1, 2, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        out = torch.ops.affineq_cpp.lowbit_linear_path(x, packed, scale, offset, bits, gs, n, k, 0, 1, co)
        err = (out.double() - x.double() @ w.T).abs()
        bound = 4 * 2.0**-24 * (x.double().abs() @ w.abs().T)
        assert bool((err <= bound).all()), f"{qparams} bits={bits} m={m}: {float((err / bound).max()):.2f} x bound"


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_lowbit_linear_bf16_qparams(bits: int) -> None:
    # bf16 scale and zero, the tinygemm convention: W = scale * (u - 2^(bits-1)) + zero
    _needs_kernels()
    path_op = torch.ops.affineq_cpp.lowbit_linear_path
    for n, k, gs in CASES[:5]:
        codes, packed, scale, _ = packed_problem(bits, n, k, gs)
        scale = scale.bfloat16()
        zero = (0.01 * torch.randn(n, k // gs)).bfloat16()
        offset64 = zero.double() - 2 ** (bits - 1) * scale.double()
        w = torch.ops.affineq.lowbit_dequantize(packed, scale, zero, bits, gs, n, k)
        exact_w = codes.double().view(n, k // gs, gs) * scale.double()[..., None] + offset64[..., None]
        torch.testing.assert_close(w.double(), exact_w.view(n, k), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(K._dequantize(packed, scale, zero, bits, gs, n, k), w, rtol=1e-6, atol=1e-7)
        for m, dtype in ((1, torch.float32), (5, torch.float32), (33, torch.float32), (33, torch.bfloat16)):
            x = torch.randn(m, k).to(dtype)
            exact = _exact(x, codes, scale.double(), offset64, gs)
            for path in PATHS:
                _assert_close(path_op(x, packed, scale, zero, bits, gs, n, k, 0, path),
                              _reference(x, path, gs, 0, exact, w, bits), dtype,
                              f"bf16 qparams path {path} bits={bits} {n}x{k} gs={gs} m={m}")


@pytest.mark.parametrize("codes_kind,fp8", [(K.CODES_E4M3, torch.float8_e4m3fn), (K.CODES_E5M2, torch.float8_e5m2)])
def test_lowbit_linear_float8_codes(codes_kind: int, fp8: torch.dtype) -> None:
    _needs_kernels()
    path_op = torch.ops.affineq_cpp.lowbit_linear_path
    # every finite byte (normals, subnormals, +-0) decodes exactly, in the dequantize op and in both fp32 paths
    byte = torch.arange(256, dtype=torch.uint8)
    finite = byte[torch.isfinite(byte.view(fp8).float())]
    u = finite[: finite.numel() // 16 * 16].view(-1, 16)
    n, k = u.shape
    packed = K.pack_codes(u, 8)
    ones, zeros = torch.ones(n, 1), torch.zeros(n, 1)
    values = u.view(fp8).float()
    assert torch.equal(torch.ops.affineq.lowbit_dequantize(packed, ones, zeros, 8, k, n, k, codes_kind), values)
    for path in (1, 2):
        assert torch.equal(path_op(torch.eye(k), packed, ones, zeros, 8, k, n, k, codes_kind, path).T, values)
    # random weights on odd shapes, every path (path 3 is integer-only and falls back to 2)
    for n, k, gs in CASES:
        w8 = (torch.randn(n, k) * 40).to(fp8)
        scale = torch.rand(n, k // gs) + 0.1
        offset = 0.1 * torch.randn(n, k // gs)
        packed = K.pack_codes(w8.view(torch.uint8), 8)
        exact_w = w8.double().view(n, k // gs, gs) * scale.double()[..., None] + offset.double()[..., None]
        for m, dtype in ((1, torch.float32), (3, torch.float32), (33, torch.float32), (33, torch.bfloat16)):
            x = torch.randn(m, k).to(dtype)
            exact = x.double() @ exact_w.view(n, k).T
            w = exact_w.view(n, k).float()
            for path in PATHS:
                _assert_close(path_op(x, packed, scale, offset, 8, gs, n, k, codes_kind, path),
                              _reference(x, path, gs, codes_kind, exact, w, 8), dtype,
                              f"{fp8} path {path} {n}x{k} gs={gs} m={m}")
            _assert_close(K.lowbit_linear_reference(x, packed, scale, offset, 8, gs, n, k, codes_kind), exact,
                          dtype, f"{fp8} reference")
    x = torch.randn(2, k)
    packed4 = K.pack_codes(torch.zeros(n, k, dtype=torch.uint8), 4)
    for bad, msg in (((x, packed4, scale, offset, 4, gs, n, k, codes_kind), "codes"),
                     ((x, packed, scale.bfloat16(), offset.bfloat16(), 8, gs, n, k, codes_kind), "integer codes")):
        with pytest.raises((RuntimeError, ValueError), match=msg):
            torch.ops.affineq.lowbit_linear(*bad)
        with pytest.raises((RuntimeError, ValueError), match=msg):
            K.lowbit_linear_reference(*bad)


def test_path_choice() -> None:
    # fp32 x never leaves fp32 arithmetic by default; bf16 x takes the bf16 dot GEMM where the CPU has it, from 5
    # rows (8-bit integer codes, whose GEMV tiles take bf16 dot products too: 9, 17 on a weight of 2^21 weights or
    # more; 4-bit codes: 17, 25), or the AMX GEMM where the CPU has AMX and k is a multiple of 32, from 5 rows (7
    # for 4-bit codes); float8 codes and groups that are not a multiple of 8 never take the int16 path.
    _needs_kernels()
    choice = torch.ops.affineq_cpp.lowbit_path_for
    has_bf16 = choice(torch.zeros(8, 64, dtype=torch.bfloat16), 32, 0, 4) == 4
    has_amx = choice(torch.zeros(8, 64, dtype=torch.bfloat16), 32, 0, 5) == 5
    assert not has_amx or has_bf16
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 24, 25, 33):
        assert choice(torch.zeros(m, 64), 32, 0, 0) == (1 if m <= 8 else 2)
        assert choice(torch.zeros(m, 64), 30, 0, 0) == 2
        xb = torch.zeros(m, 64, dtype=torch.bfloat16)
        if has_amx:
            for bits in (3, 5, 6, 8):
                assert choice(xb, 32, 0, 0, bits) == (1 if m <= 4 else 5)
            assert choice(xb, 32, K.CODES_E4M3, 0, 8) == (1 if m <= 4 else 5)
            assert choice(torch.zeros(m, 2048, dtype=torch.bfloat16), 32, 0, 0, 4, 1024) == (1 if m <= 6 else 5)
            assert choice(torch.zeros(m, 72, dtype=torch.bfloat16), 24, 0, 0, 4) == (1 if m <= 8 else 4)  # k % 32
            assert choice(xb, 32, 0, 4, 4) == 4  # forced: the AVX512-BF16 GEMM still runs
        elif has_bf16:
            for bits in (3, 5, 6):
                assert choice(xb, 32, 0, 0, bits) == (1 if m <= 4 else 4)
            assert choice(xb, 32, K.CODES_E4M3, 0, 8) == (1 if m <= 4 else 4)
            big = torch.zeros(m, 2048, dtype=torch.bfloat16)  # [1024, 2048]: 2^21 weights
            for bits, rows, rows_big in ((4, 16, 24), (8, 8, 16)):  # 4-bit codes: passes of 8 rows
                assert choice(xb, 32, 0, 0, bits) == (1 if m <= rows else 4)
                assert choice(big, 32, 0, 0, bits, 1024) == (1 if m <= rows_big else 4)
                assert choice(big, 32, 0, 0, bits, 1023) == (1 if m <= rows else 4)
            assert choice(xb, 32, 0, 5, 4) == 4  # no AMX: the forced AMX path falls back to the bf16 dot GEMM
        else:
            assert choice(xb, 32, 0, 0, 8) in (1, 2, 3)
        assert choice(torch.zeros(m, 64, dtype=torch.float16), 30, 0, 3) == 2
        assert choice(torch.zeros(m, 64, dtype=torch.float16), 32, K.CODES_E4M3, 3) == 2
    assert choice(torch.zeros(8, 64), 32, 0, 4) == 2  # fp32 x: exact fp32 GEMM, never bf16
    assert choice(torch.zeros(8, 64), 32, 0, 5) == 2


def test_lowbit_linear_layouts_and_batch_dims() -> None:
    _needs_kernels()
    bits, n, k, gs = 4, 40, 64, 32
    codes, packed, scale, offset = packed_problem(bits, n, k, gs)
    op = torch.ops.affineq.lowbit_linear
    base = torch.randn(2, 5, k)
    y = op(base, packed, scale, offset, bits, gs, n, k)
    assert y.shape == (2, 5, n)
    _assert_close(y, _exact(base, codes, scale, offset, gs), torch.float32, "3-D x")
    variants = {
        "transposed": torch.randn(k, 6).T,
        "sliced": torch.randn(6, 2 * k)[:, ::2],
        "column slice": torch.randn(6, k + 10)[:, 5 : 5 + k],
        "expanded": torch.randn(1, k).expand(4, k),
        "1-D": torch.randn(k),
    }
    for name, x in variants.items():
        out = op(x, packed, scale, offset, bits, gs, n, k)
        assert out.shape == (*x.shape[:-1], n), name
        assert torch.equal(out, op(x.contiguous(), packed, scale, offset, bits, gs, n, k)), name
        _assert_close(out, _exact(x, codes, scale, offset, gs), torch.float32, name)
    assert op(torch.randn(0, k), packed, scale, offset, bits, gs, n, k).shape == (0, n)


def test_lowbit_linear_argument_errors() -> None:
    _needs_kernels()
    bits, n, k, gs = 4, 16, 64, 32
    _, packed, scale, offset = packed_problem(bits, n, k, gs)
    x = torch.randn(2, k)
    op = torch.ops.affineq.lowbit_linear
    bad = [
        ((x.int(), packed, scale, offset, bits, gs, n, k), "x must be float32"),
        ((torch.randn(2, k + 1), packed, scale, offset, bits, gs, n, k), "x must have shape"),
        ((x, packed[:-1], scale, offset, bits, gs, n, k), "packed"),
        ((x, packed.view(torch.int8), scale, offset, bits, gs, n, k), "packed"),
        ((x, packed, scale.double(), offset, bits, gs, n, k), "scale"),
        ((x, packed, scale, offset[:, :1], bits, gs, n, k), "offset"),
        ((x, packed, scale, offset, 9, gs, n, k), "bits"),
        ((x, packed, scale, offset, bits, 24, n, k), "group_size"),
    ]
    for args, msg in bad:
        with pytest.raises((RuntimeError, ValueError), match=msg):
            op(*args)
        with pytest.raises((RuntimeError, ValueError), match=msg):
            K.lowbit_linear_reference(*args)


def test_int16_x_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32 x stays fp32-exact by default (the fp32 GEMM path); bf16/fp16 x may use the int16 VNNI path.
    _needs_kernels()
    bits, n, k, gs = 4, 40, 256, 128
    codes, packed, scale, offset = packed_problem(bits, n, k, gs)
    op, path_op = torch.ops.affineq.lowbit_linear, torch.ops.affineq_cpp.lowbit_linear_path
    args = (packed, scale, offset, bits, gs, n, k)
    x = torch.randn(33, k)
    exact = _exact(x, codes, scale, offset, gs)
    monkeypatch.delenv("AFFINEQ_KERNELS_INT16_X", raising=False)
    out = op(x, *args)
    assert torch.equal(out, path_op(x, *args, 0, 2))
    assert (out.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    monkeypatch.setenv("AFFINEQ_KERNELS_INT16_X", "1")
    assert torch.equal(op(x, *args), path_op(x, *args, 0, 3))  # path 3 falls back to 2 without VNNI
    xb = x.bfloat16()
    choice = torch.ops.affineq_cpp.lowbit_path_for
    has_bf16 = choice(xb, gs, 0, 4) == 4
    bf16_gemm = choice(xb, gs, 0, 5)  # the AMX GEMM where present, else the bf16 dot GEMM
    monkeypatch.setenv("AFFINEQ_KERNELS_INT16_X", "0")  # bf16 x: the bf16 dot path where present, else fp32
    assert choice(xb, gs, 0, 0) == (bf16_gemm if has_bf16 else 2)
    assert torch.equal(op(xb, *args), path_op(xb, *args, 0, choice(xb, gs, 0, 0)))
    monkeypatch.setenv("AFFINEQ_KERNELS_INT16_X", "auto")  # ... else the int16 path where VNNI is present
    has_vnni = choice(x.half(), gs, 0, 3) == 3
    assert choice(xb, gs, 0, 0) == (bf16_gemm if has_bf16 else 3 if has_vnni else 2)
    assert torch.equal(op(xb, *args), path_op(xb, *args, 0, choice(xb, gs, 0, 0)))
    xh = x.half()  # fp16 x: the int16 path by default (the bf16 dot path would round x to bf16)
    assert torch.equal(op(xh, *args), path_op(xh, *args, 0, 3))


@pytest.mark.parametrize("bits", range(1, 9))
def test_lowbit_dequantize_op(bits: int) -> None:
    _needs_kernels()
    for n, k, gs in CASES:
        codes, packed, scale, offset = packed_problem(bits, n, k, gs)
        w = torch.ops.affineq.lowbit_dequantize(packed, scale, offset, bits, gs, n, k)
        exact = (codes.double().view(n, k // gs, gs) * scale.double()[..., None] + offset.double()[..., None])
        torch.testing.assert_close(w.double(), exact.view(n, k), rtol=1e-6, atol=1e-7)


def test_autograd_through_op() -> None:
    _needs_kernels()
    bits, n, k, gs = 4, 24, 64, 32
    _, packed, scale, offset = packed_problem(bits, n, k, gs)
    w = K._dequantize(packed, scale, offset, bits, gs, n, k)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, k, dtype=dtype, requires_grad=True)
        g = torch.randn(2, 3, n, dtype=dtype)
        torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, gs, n, k).backward(g)
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        torch.testing.assert_close(x.grad, (g.float() @ w).to(dtype))
    with torch.no_grad():  # no graph when grad is off
        assert not torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, gs, n, k).requires_grad


def test_opcheck() -> None:
    _needs_kernels()
    bits, n, k, gs = 4, 24, 64, 32
    _, packed, scale, offset = packed_problem(bits, n, k, gs)
    for x in (torch.randn(3, k), torch.randn(2, 3, k, dtype=torch.bfloat16), torch.randn(3, k, requires_grad=True)):
        torch.library.opcheck(torch.ops.affineq.lowbit_linear.default, (x, packed, scale, offset, bits, gs, n, k))
    torch.library.opcheck(torch.ops.affineq.lowbit_dequantize.default, (packed, scale, offset, bits, gs, n, k))


def test_torch_compile_fullgraph() -> None:
    _needs_kernels()
    bits, n, k, gs = 4, 32, 64, 32
    _, packed, scale, offset = packed_problem(bits, n, k, gs)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.affineq.lowbit_linear(x * 2, packed, scale, offset, bits, gs, n, k) + 1

    x = torch.randn(4, k)
    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs):  # records what Dynamo traced
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend=capture)(x), f(x))
    assert len(graphs) == 1  # fullgraph=True would have raised on a break; one graph, one opaque op node
    op = torch.ops.affineq.lowbit_linear
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum(t in (op, op.default) for t in targets) == 1
    # through AOTAutograd + inductor (uses the fake impl for shapes, calls the C++ kernel at run time)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x))


# --------------------------------------------------------------------------------------------------------
# Availability switches
# --------------------------------------------------------------------------------------------------------
def test_disable_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    bits, n, k, gs = 4, 16, 32, 32
    codes, packed, scale, offset = packed_problem(bits, n, k, gs)
    x = torch.randn(2, k)
    K.is_available()  # loads the library where it builds (run alone, nothing else has), so the kill switch meets it
    with K._set_disabled(True):
        assert not K.is_available()
        assert "_set_disabled" in K.unavailable_reason()
        if K._lib_path is not None:
            with pytest.raises(RuntimeError, match="disabled|unavailable"):
                torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, gs, n, k)
        assert torch.equal(K.unpack_codes(K.pack_codes(codes, bits), bits, n, k), codes)
        _assert_close(K.lowbit_linear_reference(x, packed, scale, offset, bits, gs, n, k),
                      _exact(x, codes, scale, offset, gs), torch.float32, "reference while disabled")
    monkeypatch.setenv("AFFINEQ_DISABLE_CPP_KERNELS", "1")
    assert not K.is_available()
    assert "AFFINEQ_DISABLE_CPP_KERNELS=1" in K.unavailable_reason()
    with K._set_disabled(False):  # an explicit override beats the environment
        assert K.is_available() == (K._lib_path is not None)
    monkeypatch.delenv("AFFINEQ_DISABLE_CPP_KERNELS")
    if K._lib_path is not None:
        assert K.is_available() and K.unavailable_reason() is None
        torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, gs, n, k)  # re-enabled in C++ too


def test_disable_switch_is_read_on_every_call_once_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    # is_available answers from os.environ's bytes mapping once the kernels run enabled: setting, changing and
    # removing the variable between calls still switches them, on the linear route too
    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")
    from affineq import Int4WeightOnlyConfig, KernelFallbackWarning, quantize_, record_kernels

    lin = torch.nn.Linear(64, 32, bias=False)
    quantize_(lin, Int4WeightOnlyConfig(group_size=32))
    x = torch.randn(2, 64)
    assert K.is_available() and K.is_available()
    monkeypatch.setenv("AFFINEQ_DISABLE_CPP_KERNELS", "yes")
    assert not K.is_available() and "AFFINEQ_DISABLE_CPP_KERNELS=yes" in K.unavailable_reason()
    with pytest.warns(KernelFallbackWarning), record_kernels() as ran:
        lin(x)
    assert "affineq.lowbit_linear" not in ran
    monkeypatch.setenv("AFFINEQ_DISABLE_CPP_KERNELS", "0")
    assert K.is_available() and K.is_available()
    with record_kernels() as ran:
        lin(x)
    assert "affineq.lowbit_linear" in ran
    monkeypatch.setenv("AFFINEQ_DISABLE_CPP_KERNELS", "1")
    assert not K.is_available()
    monkeypatch.delenv("AFFINEQ_DISABLE_CPP_KERNELS")
    assert K.is_available() and K.is_available()


def _int8_activation_cases():
    from affineq import ActivationQuant, MappingType, ZeroPointDomain

    for mapping, domain in [(MappingType.SYMMETRIC, ZeroPointDomain.NONE),
                            (MappingType.SYMMETRIC_NO_CLIPPING_ERR, ZeroPointDomain.INT),
                            (MappingType.ASYMMETRIC, ZeroPointDomain.INT)]:
        for granularity in ("per_token", "per_tensor"):
            yield ActivationQuant(torch.int8, mapping, granularity, domain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_fake_quant_op_is_the_eager_shortcut(dtype, monkeypatch):
    # affineq::int8_fake_quant replaces ~12 eager ops per linear call: bit for bit the same values, including
    # all-zero rows, one-sign rows, and values at the dtype's limit (saturated, never inf)
    _needs_kernels()
    from affineq.tensor import activation

    big = torch.finfo(dtype).max
    xs = [torch.randn(1, 576) * 3, torch.randn(9, 300) * torch.rand(9, 1) * 50, torch.zeros(2, 64),
          torch.rand(3, 40) + 1, -torch.rand(3, 40), torch.tensor([[-big, 1.0, 0.0, big / 3]]),
          torch.randn(700, 200) * torch.rand(700, 1) * 4]  # rows in several threads' chunks
    for aq in _int8_activation_cases():
        for x in xs:
            x = x.to(dtype)
            fused = activation.fake_quantize_activation(x, aq)
            with monkeypatch.context() as m:
                m.setattr(activation._cpp, "is_available", lambda: False)
                eager = activation.fake_quantize_activation(x, aq)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            assert torch.isfinite(fused).all(), (aq, x)
            assert torch.equal(fused.view(bits), eager.view(bits)), (aq, dtype, x.shape)
    # the op with an eps below float32's smallest normal (ActivationQuant refuses one): subnormal scales and
    # values, which bf16 y keeps (rounded in integer arithmetic, not by vcvtneps2bf16, which flushes them), as
    # torch rounds the fp32 result
    if dtype == torch.bfloat16:
        for x in [torch.randn(3, 64) * 2e-37, torch.randn(2, 40) * 4e-37]:  # scales ~5e-39, 1 / scale finite
            x = x.bfloat16()
            for mode in (0, 1, 2):
                for per_token in (True, False):
                    got = torch.ops.affineq.int8_fake_quant(x, per_token, mode, 1e-42)
                    want = torch.ops.affineq.int8_fake_quant(x.float(), per_token, mode, 1e-42).bfloat16()
                    assert bool(((want != 0) & (want.float().abs() < torch.finfo(torch.float32).tiny)).any())
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (x.shape, mode, per_token)
