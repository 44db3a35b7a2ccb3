"""The AMX tile kernels (Xeons from Sapphire Rapids on; skipped where the CPU or the build lacks AMX).

- lowbit_linear's path 5 (gemm_amx.cpp): bf16 x times path 4's bf16 weight tiles on AMX tiles; it must give what
  path 4 computes, F.linear of x on the weight dequantized to bf16 with fp32 sums, up to the summation order and
  the final rounding to bf16: over every code width, leftover rows (M % 32), partial 32-column tiles, several
  k-slices, zero points, M from 5 to 1024 and 1 or 2 threads.
- lowbit_linear_int8_act (8da4w's linear): on path 5 it quantizes x's rows as it packs them; it must equal
  lowbit_linear(int8_fake_quant(x)) bit for bit, on any path (where AMX is absent: the two ops in turn).
- int8_codes_linear on per-channel weights (W8A8): from 16 rows AMX int8 tiles sum the codes (rows in chunks over
  B tiles packed once per work item); the int32 sums and the epilogue are the VNNI tiles', so every row must
  equal, bit for bit, the same row computed in a call of fewer rows (the VNNI tiles). Where AMX is absent this
  still checks the row independence of the VNNI tiles.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import affineq.cpp as K

BF16 = torch.bfloat16


def _needs_amx_path() -> None:
    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")
    if torch.ops.affineq_cpp.lowbit_path_for(torch.zeros(64, 64, dtype=BF16), 32, 0, 5) != 5:
        pytest.skip("external: this CPU (or build) has no AMX tiles")


def _weight(bits: int, n: int, k: int, gs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.02 + 0.005
    offset = -scale * (2 ** (bits - 1)) + 0.01 * torch.randn(n, k // gs, generator=g)
    return K.pack_codes(codes, bits), scale, offset


def _check_path5(x, packed, scale, offset, bits, gs, n, k, codes=0, code_offset=0, what=""):
    path = torch.ops.affineq_cpp.lowbit_linear_path
    y5 = path(x, packed, scale, offset, bits, gs, n, k, codes, 5, code_offset)
    y4 = path(x, packed, scale, offset, bits, gs, n, k, codes, 4, code_offset)
    w = K._dequantize(packed, scale, offset, bits, gs, n, k, codes, code_offset).bfloat16().double()
    ref = x.double() @ w.T
    assert y5.dtype == BF16 and y5.shape == (x.shape[0], n), what
    # both round one fp32 sum to bf16: half an ulp of |y| each, plus fp32-level slack for the summation order
    mag = ref.abs().max().item() + 1e-30
    bound = 2.0**-8 * ref.abs() * 1.01 + 1e-4 * mag
    assert bool(((y5.double() - ref).abs() <= bound).all()), f"{what}: {(y5.double() - ref).abs().max():.3g}"
    assert bool(((y5.double() - y4.double()).abs() <= 2 * bound).all()), what


@pytest.mark.parametrize("bits", range(1, 9))
def test_amx_path_every_width_leftover_rows_and_columns(bits: int) -> None:
    _needs_amx_path()
    for n, k, gs, m in [(37, 96, 32, 5), (100, 576, 64, 33), (277, 1024, 128, 130), (48, 1600, 32, 70)]:
        packed, scale, offset = _weight(bits, n, k, gs, seed=bits * 7 + n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(BF16)
        _check_path5(x, packed, scale, offset, bits, gs, n, k, what=f"bits={bits} {n}x{k} g{gs} m={m}")


@pytest.mark.parametrize("codes,bits", [(K.CODES_E4M3, 8), (K.CODES_E5M2, 8), (K.CODES_FP4_E2M1, 4),
                                        (K.CODES_FP6_E2M3, 6), (K.CODES_FP6_E3M2, 6)])
def test_amx_path_float_codes(codes: int, bits: int) -> None:
    _needs_amx_path()
    n, k, gs, m = 80, 256, 32, 40
    g = torch.Generator().manual_seed(codes)
    raw = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    if codes == K.CODES_E4M3:
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
    if codes == K.CODES_E5M2:
        raw[((raw >> 2) & 31) == 31] = 0  # no inf / NaN codes
    scale = torch.rand(n, k // gs, generator=g) * 0.1 + 0.01
    x = torch.randn(m, k, generator=g).to(BF16)
    _check_path5(x, K.pack_codes(raw, bits), scale, None, bits, gs, n, k, codes=codes, what=f"codes={codes}")


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_path_many_rows_and_slices(threads: int) -> None:
    # passes of 512 rows, k cut into slices (1600 -> 544 + 544 + 512), a partial last tile of 32 columns; with 2
    # threads from 256 rows each thread takes its own rows (513: 288 + 225) of a narrow weight
    _needs_amx_path()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, k, gs = 16 * 9 + 8, 1600, 64
        packed, scale, offset = _weight(4, n, k, gs, seed=threads)
        for m in (31, 32, 513, 1024):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(BF16)
            _check_path5(x, packed, scale, offset, 4, gs, n, k, what=f"m={m} threads={threads}")
        # 66 tiles: several work items per thread (the threads share the tiles), each running every pass of
        # 1100 rows (3 passes) in turn with the others over 2 k-slices
        n, k = 2100, 704
        packed, scale, offset = _weight(8, n, k, gs, seed=5 + threads)
        x = torch.randn(1100, k, generator=torch.Generator().manual_seed(3)).to(BF16)
        _check_path5(x, packed, scale, offset, 8, gs, n, k, what=f"items x passes, threads={threads}")
    finally:
        torch.set_num_threads(old)


def test_amx_path_is_what_bf16_x_takes_from_a_few_rows() -> None:
    # the op's own choice on AMX: the GEMV up to 6 rows (4-bit codes) / 4 rows (others), then path 5; k % 32 != 0
    # keeps the AVX512-BF16 GEMM
    _needs_amx_path()
    choice = torch.ops.affineq_cpp.lowbit_path_for
    assert choice(torch.zeros(7, 4096, dtype=BF16), 128, 0, 0, 4, 4096) == 5
    assert choice(torch.zeros(6, 4096, dtype=BF16), 128, 0, 0, 4, 4096) == 1
    assert choice(torch.zeros(5, 4096, dtype=BF16), 128, 0, 0, 8, 4096) == 5
    assert choice(torch.zeros(64, 4104, dtype=BF16), 8, 0, 0, 4, 64) == 4


@pytest.mark.parametrize("threads", [1, 2])
def test_lowbit_linear_int8_act_is_fake_quant_then_lowbit_linear(threads: int) -> None:
    # every int8 mode, per token and per tensor; M from the GEMV's rows to several 512-row passes and 2 threads'
    # own rows; k over several slices; k % 32 != 0 (not path 5); rows of one sign, zeros, and a 3-D x
    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k, gs, m in [(64, 96, 32, 5), (100, 576, 64, 33), (192, 576, 32, 512), (48, 1600, 32, 70),
                            (80, 100, 20, 40), (32, 256, 32, 1030)]:
            packed, scale, offset = _weight(4, n, k, gs, seed=n + m)
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 2 - 0.3).to(BF16)
            x[1] = x[1].abs() + 0.5
            x[2] = 0
            for mode in (0, 1, 2):
                for per_token in (True, False):
                    args = (packed, scale, offset, 4, gs, n, k, 0, 0)
                    got = torch.ops.affineq.lowbit_linear_int8_act(x, *args, per_token, mode, 1e-12)
                    xq = torch.ops.affineq.int8_fake_quant(x, per_token, mode, 1e-12)
                    want = torch.ops.affineq.lowbit_linear(xq, *args)
                    what = (n, k, gs, m, mode, per_token, threads)
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), what
        packed, scale, offset = _weight(4, 32, 256, 32, seed=3)
        x3 = torch.randn(2, 40, 256).to(BF16)
        got = torch.ops.affineq.lowbit_linear_int8_act(x3, packed, scale, offset, 4, 32, 32, 256, 0, 0, True, 2, 1e-5)
        want = torch.ops.affineq.lowbit_linear(torch.ops.affineq.int8_fake_quant(x3.reshape(80, 256), True, 2, 1e-5),
                                               packed, scale, offset, 4, 32, 32, 256, 0, 0)
        assert got.shape == (2, 40, 32) and torch.equal(got.reshape(80, 32).view(torch.int16), want.view(torch.int16))
    finally:
        torch.set_num_threads(old)


def test_lowbit_linear_int8_act_bad_mode_names_it() -> None:
    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")
    packed, scale, offset = _weight(4, 32, 64, 32, seed=0)
    with pytest.raises(RuntimeError, match="mode must be an int8_fake_quant mode"):
        torch.ops.affineq.lowbit_linear_int8_act(torch.randn(4, 64).to(BF16), packed, scale, offset, 4, 32, 32, 64,
                                                 0, 0, True, 3, 1e-5)


def _needs_int8_codes() -> None:
    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")
    if not K.int8_codes_built():
        pytest.skip("external: the int8-codes kernel needs AVX512-VNNI and VBMI")


def _int8_codes(x, bits, n, k, mode, seed, threads=None):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, 1, generator=g) * 0.02 + 0.005
    offset = -scale * 2 ** (bits - 1) + 0.001 * torch.randn(n, 1, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        return torch.ops.affineq.int8_codes_linear(x, K.pack_codes(codes, bits), scale, offset, k, n, k, True, mode,
                                                   1e-12, bits, 0)
    finally:
        torch.set_num_threads(old)


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16) if y.dtype == BF16 else y.view(torch.int32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_int8_codes_per_channel_rows_equal_in_any_batch(bits: int, dtype: torch.dtype) -> None:
    _needs_int8_codes()
    for n, k in [(64, 256), (80, 1024), (48, 576)]:  # 4 + 1 panels, k over 2 slices, 9 steps of 64
        x = (torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * 2 - 0.3).to(dtype)
        x[3] = x[3].abs() + 0.5  # one sign: zero point -128 in mode 2
        for mode in (1, 2):  # symmetric and asymmetric per-token codes
            for threads in (1, 2):
                batch = _int8_codes(x, bits, n, k, mode, seed=n, threads=threads)  # AMX tiles where present
                rows = torch.cat([_int8_codes(x[i:i + 12].contiguous(), bits, n, k, mode, seed=n, threads=threads)
                                  for i in range(0, 70, 12)])  # 12 rows: the VNNI tiles
                assert batch.dtype == dtype and torch.equal(_bits(batch), _bits(rows)), (n, k, mode, threads)


@pytest.mark.parametrize("bits", [8, 4])
def test_int8_codes_per_channel_row_chunks(bits: int) -> None:
    # k = 4096: the AMX tiles take each work item's rows in chunks of 128 (their A tiles in L2) over B tiles
    # packed once per item (4-bit panels widened first); 300 rows = 2 full chunks and a partial one (per thread,
    # 2 threads: 160 + 140 rows), 5 panels = a quad and a single panel. Every row as in 12-row calls.
    _needs_int8_codes()
    n, k = 80, 4096
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(bits)).to(BF16)
    for threads in (1, 2):
        batch = _int8_codes(x, bits, n, k, 1, seed=bits, threads=threads)
        rows = torch.cat([_int8_codes(x[i:i + 12].contiguous(), bits, n, k, 1, seed=bits, threads=threads)
                          for i in range(0, 300, 12)])
        assert torch.equal(_bits(batch), _bits(rows)), threads


@settings(max_examples=20, deadline=None)
@given(panels=st.integers(1, 9), steps=st.integers(1, 12), m=st.integers(16, 80), seed=st.integers(0, 2**16))
def test_int8_codes_per_channel_property(panels: int, steps: int, m: int, seed: int) -> None:
    _needs_int8_codes()
    n, k = 16 * panels, 64 * steps
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    batch = _int8_codes(x, 8, n, k, 1 + seed % 2, seed)
    assert torch.equal(_bits(batch[-5:]), _bits(_int8_codes(x[-5:].contiguous(), 8, n, k, 1 + seed % 2, seed)))
