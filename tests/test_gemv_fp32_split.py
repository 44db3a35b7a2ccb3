"""The 4-bit GEMV with float32 x (`cpp/gemv.cpp`). At m = 1 off AMX (`split_x3`): x as three bf16 rows whose sum
is x exactly, through the bf16-dot GEMV, the three results added at the end. Every product stays exact, so the
result is within a few fp32 roundings of the float64 product, as the fp32 FMA GEMV's is. The FMA GEMV's passes of
1-2 rows decode 16 + u and take the bias off per unit of 8 k (`gemv_unit_bias`), within the same bound. x holding
inf or NaN takes the FMA GEMV (bit for bit what a call with a second row gives the first)."""

from __future__ import annotations

import pytest
import torch

import affineq.cpp as K

EPS32 = 2.0**-24


def _problem(n: int, k: int, gs: int, qparams: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.02 + 0.005
    zero = 0.01 * torch.randn(n, k // gs, generator=g)
    if qparams == "fp32":  # W = scale * u + offset
        offset = -8 * scale + zero
        w = codes.double().view(n, -1, gs) * scale.double()[..., None] + offset.double()[..., None]
        args = (scale, offset)
    else:  # bf16 scale and zero: W = scale * (u - 8) + zero
        scale, zero = scale.bfloat16(), zero.bfloat16()
        w = (codes.double().view(n, -1, gs) - 8) * scale.double()[..., None] + zero.double()[..., None]
        args = (scale, zero)
    return K.pack_codes(codes, 4), args, w.view(n, k)


# (n, k, gs): a tail panel (37, 300), one item of 4 panels with an odd leftover (129 = 8 panels + 1 row), group
# sizes 8 to 128, K long enough for fp32 sums to round many times (4096, 11008)
CASES = [(37, 96, 32), (129, 384, 128), (64, 256, 64), (300, 4096, 32), (40, 11008, 128), (50, 200, 8)]


# rows of x: 1 (split_x3 off AMX), 2 (one pass with the unit bias), 5 / 6 (a pass of 4 rows without it, then one
# of 1 / 2 rows with it)
@pytest.mark.parametrize("m", [1, 2, 5, 6])
@pytest.mark.parametrize("qparams", ["fp32", "bf16"])
@pytest.mark.parametrize("n,k,gs", CASES)
def test_fp32_x_within_fp32_rounding_of_float64(n: int, k: int, gs: int, qparams: str, m: int) -> None:
    if not K.is_available():
        pytest.skip(f"C++ kernels unavailable: {K.unavailable_reason()}")
    packed, qp, w = _problem(n, k, gs, qparams, seed=n + k)
    g = torch.Generator().manual_seed(k + m)
    # magnitudes far apart: the parts of x span 24 bits below each value's exponent (1e-30 ~ 2^-100 keeps the
    # smallest part a normal bf16 number)
    for mag in (1.0, 1e-30, 1e20):
        x = torch.randn(m, k, generator=g) * mag
        out = torch.ops.affineq.lowbit_linear(x, packed, *qp, 4, gs, n, k)
        exact = x.double() @ w.T
        sum_abs = x.double().abs() @ w.abs().T
        err = (out.double() - exact).abs()
        # a few roundings of the largest partial sum: the FMA GEMV measures up to ~2.5 here, the split one ~0.8
        assert bool((err <= 4 * EPS32 * sum_abs).all()), f"{n}x{k} gs={gs} {qparams} m={m} |x|~{mag}: " \
            f"{float((err / sum_abs).max() / EPS32):.2f} ulps of sum |x w|"


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
            outs.append(torch.ops.affineq.lowbit_linear(x, packed, *qp, 4, gs, n, k))
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
    one = torch.ops.affineq.lowbit_linear(x[:1], packed, *qp, 4, gs, n, k)
    two = torch.ops.affineq.lowbit_linear(x, packed, *qp, 4, gs, n, k)
    torch.testing.assert_close(one, two[:1], rtol=0, atol=0, equal_nan=True)
    assert not bool(torch.isfinite(one).any())
