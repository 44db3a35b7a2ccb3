"""The bf16-dot GEMM (`cpp/gemm_bf16.cpp`, path 4: bf16 x, m >= 3 on AVX512-BF16 builds): two dequantized tiles of
32 columns per micro-kernel call, K cut into equal slices, up to 516 rows per pass. Checked against x @ bf16(W) in
float64 (fp32 sums of exact bf16 products), and for the property the blocking must keep: a row's result depends
on nothing but that row (the same bits whichever rows share the call, however many threads split it)."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_flags

import affineq.cpp as K

PATH_BF16_GEMM = 4


def _weight(n: int, k: int, gs: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.02 + 0.005
    offset = -scale * 2 ** (bits - 1) + 0.001 * torch.randn(n, k // gs, generator=g)
    w = (codes.double().view(n, k // gs, gs) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)
    return K.pack_codes(codes, bits), scale, offset, w


# (n, k, gs): an odd tile count (96 = 3 x 32: a pair and a single tile), a partial last tile (40, 200), K of one
# slice, of equal slices (576 = 2 x 288, 1000 = 4 x 250 -> 256-wide), and padded to whole 8-column units (100)
@pytest.mark.parametrize("n,k,gs", [(96, 576, 32), (40, 104, 104), (200, 1000, 8), (64, 100, 100), (128, 288, 32)])
def test_bf16_gemm_rows_are_independent_of_blocking_and_threads(n, k, gs):
    if not K.is_available():
        pytest.skip(f"the C++ kernels are unavailable: {K.unavailable_reason()}")
    packed, scale, offset, w = _weight(n, k, gs, 4, seed=n + k)
    x = (torch.randn(530, k, generator=torch.Generator().manual_seed(k)) * 2).bfloat16()

    def run(rows: torch.Tensor, threads: int = 2) -> torch.Tensor:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return torch.ops.affineq_cpp.lowbit_linear_path(rows, packed, scale, offset, 4, gs, n, k, 0,
                                                            PATH_BF16_GEMM, 0)
        finally:
            torch.set_num_threads(old)

    if torch.ops.affineq_cpp.lowbit_path_for(x, gs, 0, PATH_BF16_GEMM) != PATH_BF16_GEMM:
        assert "avx512_bf16" not in cpu_flags(), "path 4 must run on an AVX512-BF16 CPU"
        pytest.skip("this build has no bf16-dot GEMM (AVX512-BF16)")
    y = run(x)  # 530 rows: two passes of 265 (516-row limit), 6-row blocks with a remainder of 1
    ref = x.double() @ w.bfloat16().double().T
    bound = 2**-8 * (x.double().abs() @ w.bfloat16().double().abs().T) + 1e-30  # bf16 output rounding + fp32 sums
    assert y.dtype == torch.bfloat16 and ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(y.view(torch.int16), run(x, threads=1).view(torch.int16))
    for lo, hi in ((0, 3), (5, 17), (100, 107), (523, 530)):
        assert torch.equal(y[lo:hi].view(torch.int16), run(x[lo:hi]).view(torch.int16)), (lo, hi)
