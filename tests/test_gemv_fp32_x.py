"""The 4-bit GEMV with float32 x (`cpp/gemv.cpp`). At m = 1 where the build has AVX512-VNNI and VBMI
(`cpp/gemv_digits.cpp`): x as four exact integer digits per block under a power-of-two scale, their products with
the codes summed exactly by VNNI dot products, so the result is within a few fp32 roundings of the float64
product, as the fp32 FMA GEMV's is (which serves m = 1 on other builds). The FMA GEMV's passes of 1-2 rows decode 16 + u
and take the bias off per unit of 8 k (`gemv_unit_bias`), within the same bound. x holding inf or NaN (and, for
the digits, a block of x reaching 2^100) takes the FMA GEMV (bit for bit what a call with a second row gives the
first)."""

from __future__ import annotations

import pytest
import torch

import affineq.cpp as K
from affineq.tensor.compute_bound import cpu_kind

EPS32 = 2.0**-24


def _problem(n: int, k: int, gs: int, qparams: str, seed: int, bits: int = 4):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.02 + 0.005
    zero = 0.01 * torch.randn(n, k // gs, generator=g)
    mid = 2 ** (bits - 1)
    if qparams in ("fp32", "f16"):  # W = scale * u + offset (f16: GGUF's Q4_1)
        offset = -mid * scale + zero
        if qparams == "f16":
            scale, offset = scale.half(), offset.half()
        w = codes.double().view(n, -1, gs) * scale.double()[..., None] + offset.double()[..., None]
        args = (scale, offset, bits, gs, n, k)
    elif qparams == "sym":  # no offset array: W = scale * (u - mid) (GGUF's Q4_0 with f16 scales)
        scale = scale.half()
        w = (codes.double().view(n, -1, gs) - mid) * scale.double()[..., None]
        args = (scale, None, bits, gs, n, k, 0, -mid)
    else:  # bf16 scale and zero: W = scale * (u - mid) + zero
        scale, zero = scale.bfloat16(), zero.bfloat16()
        w = (codes.double().view(n, -1, gs) - mid) * scale.double()[..., None] + zero.double()[..., None]
        args = (scale, zero, bits, gs, n, k)
    return K.pack_codes(codes, bits), args, w.view(n, k)


# (n, k, gs): a tail panel (37, 300), one item of 4 panels with an odd leftover (129 = 8 panels + 1 row), group
# sizes 8 to 128, K long enough for fp32 sums to round many times (4096, 11008)
CASES = [(37, 96, 32), (129, 384, 128), (64, 256, 64), (300, 4096, 32), (40, 11008, 128), (50, 200, 8)]
# groups longer than a digit block (512 k): blocks of 512 and of 344 (1032 = 3 x 344)
CASES += [(48, 4096, 4096), (32, 2064, 1032)]


# rows of x: 1 (the digits where built), 2 (one pass with the unit bias), 5 / 6 (a pass of 4 rows without it, then one
# of 1 / 2 rows with it)
@pytest.mark.parametrize("m", [1, 2, 5, 6])
@pytest.mark.parametrize("qparams", ["fp32", "bf16", "f16", "sym"])
@pytest.mark.parametrize("n,k,gs", CASES)
def test_fp32_x_within_fp32_rounding_of_float64(n: int, k: int, gs: int, qparams: str, m: int) -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    packed, qp, w = _problem(n, k, gs, qparams, seed=n + k)
    g = torch.Generator().manual_seed(k + m)
    # magnitudes far apart; the digits' smallest scale 2^-149 (1e-37) and their limit 2^100 (1e31: the FMA GEMV
    # takes over)
    for mag in (1.0, 1e-30, 1e20) + ((1e-37, 1e31) if m == 1 else ()):
        x = torch.randn(m, k, generator=g) * mag
        out = torch.ops.affineq.lowbit_linear(x, packed, *qp)
        exact = x.double() @ w.T
        sum_abs = x.double().abs() @ w.abs().T
        err = (out.double() - exact).abs()
        # a few roundings of the largest partial sum: the FMA GEMV measures up to ~2.5 here
        assert bool((err <= 4 * EPS32 * sum_abs).all()), f"{n}x{k} gs={gs} {qparams} m={m} |x|~{mag}: " \
            f"{float((err / sum_abs).max() / EPS32):.2f} ulps of sum |x w|"


# Per-channel weights (one group of k) of every width. An accumulator lane sums one output row's products in
# sequence; the GEMVs add each chunk of 256 k into the total times the group's scale before the next starts
# (gemv_groups.h's kChunkUnits), so a long group's error stays that of short ones: with the whole group in one chain
# the AVX2 build measured up to 6 ulps of sum |x w| here (5- and 8-bit, 5 rows), the scalar build 6.3; chunked, 1.1.
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(48, 4096), (24, 11008)])
def test_per_channel_weights_within_two_ulps(n: int, k: int, bits: int, m: int) -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    packed, qp, w = _problem(n, k, k, "fp32", seed=bits, bits=bits)
    for seed in range(4):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
        err = (torch.ops.affineq.lowbit_linear(x, packed, *qp).double() - x.double() @ w.T).abs()
        ulps = float((err / (x.double().abs() @ w.abs().T)).max()) / EPS32
        assert ulps <= 2, f"{bits}-bit {n}x{k} m={m} seed {seed}: {ulps:.2f} ulps of sum |x w|"


@pytest.mark.parametrize("n,k,gs", [(129, 384, 128), (300, 4096, 32)])
def test_m1_result_does_not_depend_on_threads(n: int, k: int, gs: int) -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    packed, qp, _ = _problem(n, k, gs, "fp32", seed=1)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(torch.ops.affineq.lowbit_linear(x, packed, *qp))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_m1_non_finite_x_gives_the_fma_gemvs_result(bad: float) -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    n, k, gs = 64, 256, 32
    packed, qp, _ = _problem(n, k, gs, "fp32", seed=3)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    x[0, 77] = bad
    one = torch.ops.affineq.lowbit_linear(x[:1], packed, *qp)
    two = torch.ops.affineq.lowbit_linear(x, packed, *qp)
    torch.testing.assert_close(one, two[:1], rtol=0, atol=0, equal_nan=True)
    assert not bool(torch.isfinite(one).any())


# the digits GEMV is built where the int8-codes kernel is (AVX512-VNNI and VBMI)
DIGITS_BUILT = K.is_available() and K.kernel_info()["isa"] == "avx512" and K.int8_codes_built()


def digits_run(bits: int, x_dtype: torch.dtype = torch.float32, n: int = 0, k: int = 0) -> bool:
    """Whether one row of x against `bits`-bit integer codes (n x k) takes the digits GEMV (`use_x_digits`): on
    AMX Xeons every width 2-6, elsewhere 2-4 bits with fp32 x and 2-3 bits with bf16 x; bf16 x from 2^19
    weights."""
    if not DIGITS_BUILT or not 2 <= bits <= 6 or (x_dtype == torch.bfloat16 and n * k < 2**19):
        return False
    return cpu_kind() == "amx" or bits <= (4 if x_dtype == torch.float32 else 3)


def _skip_without_digits(bits: int) -> None:
    if not digits_run(bits):
        pytest.skip(f"one row of fp32 x against {bits}-bit codes takes the FMA GEMV here ({cpu_kind()}"
                    f"{', VNNI + VBMI' if DIGITS_BUILT else ''}): the digits GEMV needs VNNI + VBMI, and off AMX "
                    "Xeons serves 2- to 4-bit codes")


def _ones(n: int, k: int, gs: int, qparams: str, bits: int = 4) -> tuple:
    """Op arguments of an n x k weight whose every element is exactly 1 (codes 2^(bits-1) + 1, scale 1), with
    qparams whose bias leaves exactly (bf16: zero 0; sym: no offset array), so y[n] = sum(x) as the tiles sum it."""
    mid = 2 ** (bits - 1)
    packed = K.pack_codes(torch.full((n, k), mid + 1, dtype=torch.uint8), bits)
    scale = torch.ones(n, k // gs)
    if qparams == "bf16":
        return packed, scale.bfloat16(), torch.zeros(n, k // gs, dtype=torch.bfloat16), bits, gs, n, k
    return packed, scale.half(), None, bits, gs, n, k, 0, -mid


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("qparams", ["bf16", "sym"])
@pytest.mark.parametrize("gs", [32, 128, 4096])
def test_digits_sum_each_block_exactly(gs: int, qparams: str, bits: int) -> None:
    _skip_without_digits(bits)
    # 2^24 + 1 - 2^24 in fp32 sums loses the 1; the digits' int32 sums keep it (one block holds all three)
    n, k = 32, 4096
    x = torch.full((1, k), 0.5)
    for b in range(0, k, 64):
        x[0, b:b + 4] = torch.tensor([2.0**24, 1.0, -(2.0**24), 1.0])
    out = torch.ops.affineq.lowbit_linear(x, *_ones(n, k, gs, qparams, bits))
    assert bool((out == x.double().sum()).all()), f"{out[0, :4]} against {float(x.double().sum())}"


def test_digits_keep_subnormal_x_exact() -> None:
    _skip_without_digits(4)
    # every fp32 subnormal is a multiple of the smallest digit scale 2^-149
    n, k, gs = 16, 256, 64
    j = torch.randint(-40, 41, (1, k), generator=torch.Generator().manual_seed(5))
    x = j.float() * 2.0**-140
    assert bool((x.abs() < 2.0**-126).all())
    out = torch.ops.affineq.lowbit_linear(x, *_ones(n, k, gs, "sym"))
    assert bool((out.double() == float(j.sum()) * 2.0**-140).all())


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7])
@pytest.mark.parametrize("qparams", ["fp32", "bf16"])
@pytest.mark.parametrize("n,k,gs", [(37, 96, 32), (129, 384, 128), (48, 4096, 4096)])
def test_other_widths_one_row_within_fp32_rounding(n: int, k: int, gs: int, qparams: str, bits: int) -> None:
    # one row of fp32 x against 2- to 7-bit codes: the digits GEMV where digits_run (the codes' bias 2^(bits-1)),
    # within the 4-bit cases' bound; elsewhere, and 7 bits, the FMA GEMV (biased for 3, 5, 6, 7 bits,
    # the bias leaving per group: measured up to 6.5 ulps)
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    packed, qp, w = _problem(n, k, gs, qparams, seed=n + bits, bits=bits)
    g = torch.Generator().manual_seed(k + bits)
    for mag in (1.0, 1e-30, 1e20):
        x = torch.randn(1, k, generator=g) * mag
        out = torch.ops.affineq.lowbit_linear(x, packed, *qp)
        err = (out.double() - x.double() @ w.T).abs()
        sum_abs = x.double().abs() @ w.abs().T
        ulps = 4 if digits_run(bits) else 8
        assert bool((err <= ulps * EPS32 * sum_abs).all()), f"{bits} bits {n}x{k} gs={gs} {qparams} |x|~{mag}: " \
            f"{float((err / sum_abs).max() / EPS32):.2f} ulps of sum |x w|"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("n,k,gs", [(512, 1024, 32), (176, 4096, 128), (40, 1024, 64)])
def test_one_bf16_row_is_its_fp32_rows_result_rounded(n: int, k: int, gs: int, bits: int) -> None:
    # one row of bf16 x on a weight of 2^19 weights or more takes the digits where digits_run: its values widened
    # (exact), the fp32 row's digits result rounded to bf16 once, bit for bit; a smaller weight (40 x 1024) and
    # the other widths keep the bf16-dot (4-bit) or the FMA GEMV, within a bf16 rounding of the float64 product
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    packed, qp, w = _problem(n, k, gs, "bf16", seed=n + bits, bits=bits)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k + bits)).bfloat16()
    out = torch.ops.affineq.lowbit_linear(x, packed, *qp)
    assert out.dtype == torch.bfloat16
    if digits_run(bits, torch.bfloat16, n, k):
        torch.testing.assert_close(out, torch.ops.affineq.lowbit_linear(x.float(), packed, *qp).bfloat16(), rtol=0,
                                   atol=0)
    ref = x.double() @ w.T
    sum_abs = x.double().abs() @ w.abs().T
    assert bool(((out.double() - ref).abs() <= 2.0**-8 * ref.abs() + 8 * EPS32 * sum_abs).all())
