"""affineq::int8_codes_linear with 4-bit weights at 1-8 rows of x (gemm_int8_codes.cpp `gemv4`): the packed 4-bit
units are read in place instead of through a widened 8-bit copy. Its int32 sums and epilogue are the widened
tile's, so per-token rows must come out bit for bit as the same rows do inside a batch of 12 or more (which takes
the widened tile): zero points (code sums from the kernel's own dot product), one group per row (per-channel),
panels past the last group of four, row blocks of 6 + 1 and 6 + 2, bf16 input and output, 1 and 2 threads; and
16-bit scales kept 16-bit in the per-item tiles give the values of their fp32 widening."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_int8_codes_kernel
from hypothesis import given, settings
from hypothesis import strategies as st

import affineq.cpp as K


def _weight(n: int, k: int, gs: int, seed: int, qp: str):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.02 + 0.005
    if qp == "fp32":  # an offset array (asymmetric weights)
        return K.pack_codes(codes, 4), scale, -8 * scale + 0.01 * torch.randn(n, k // gs, generator=g), 0
    return K.pack_codes(codes, 4), scale.bfloat16(), None, -8  # 8da4w: a bf16 scale, symmetric codes


def _run(x, w, n, k, gs, mode, threads=None):
    packed, scale, offset, code_offset = w
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        return torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, gs, n, k, True, mode, 1e-12, 4,
                                                   code_offset)
    finally:
        torch.set_num_threads(old)


def _rows(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32)


@pytest.mark.parametrize("qp", ["fp32", "bf16-scale-only"])
@pytest.mark.parametrize("n,k,gs", [(64, 256, 32), (80, 128, 128), (48, 64, 8), (160, 512, 64), (96, 96, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_equal_the_widened_tile_bit_for_bit(n: int, k: int, gs: int, qp: str, dtype: torch.dtype) -> None:
    needs_int8_codes_kernel()
    w = _weight(n, k, gs, seed=n + k + gs, qp=qp)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(13, k, generator=g) * torch.rand(13, 1, generator=g) * 4 + 0.3).to(dtype)
    x[0] = x[0].abs() + 0.5  # one sign: zero point -128 in mode 2
    x[2] = 0.0
    for mode in (1, 2):  # symmetric (no zero points) and asymmetric per-token codes
        batch = _run(x, w, n, k, gs, mode)  # 13 rows: the widened tile
        for m in range(1, 9):
            for threads in (1, 2):
                y = _run(x[:m].contiguous(), w, n, k, gs, mode, threads)
                assert y.dtype == dtype and torch.equal(_rows(y), _rows(batch[:m])), (m, mode, threads)


@settings(max_examples=30, deadline=None)
@given(panels=st.integers(1, 11), groups=st.integers(1, 6), gs=st.sampled_from([8, 16, 32, 64]),
       m=st.integers(1, 8), seed=st.integers(0, 2**16), mode=st.sampled_from([1, 2]))
def test_few_rows_property(panels: int, groups: int, gs: int, m: int, seed: int, mode: int) -> None:
    # any panel count (groups of four and the rest), group count and size: the rows alone equal the rows in a batch
    needs_int8_codes_kernel()
    n, k = 16 * panels, gs * groups
    w = _weight(n, k, gs, seed=seed, qp="fp32" if seed % 2 else "bf16-scale-only")
    x = torch.randn(m + 12, k, generator=torch.Generator().manual_seed(seed)) * 2 - 0.5
    batch = _run(x, w, n, k, gs, mode)
    assert torch.equal(_rows(_run(x[:m].contiguous(), w, n, k, gs, mode)), _rows(batch[:m]))


@pytest.mark.parametrize("sdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("code_offset", [-8, 0])
@pytest.mark.parametrize("n,k,gs", [(64, 512, 32), (80, 2048, 128), (144, 256, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_16bit_scales_equal_their_fp32_widening(sdtype: torch.dtype, code_offset: int, n: int, k: int, gs: int,
                                                dtype: torch.dtype) -> None:
    # 16-bit scales without an offset array and groups in multiples of 16 keep their per-item tile 16-bit
    # (TileQparams::s16, offset = scale * code_offset formed per group): the same values as the fp32 tiles the
    # same scales widened to fp32 (and their offset array) take, in gemv4 (1-8 rows) and in the widened tile (13 rows)
    needs_int8_codes_kernel()
    g = torch.Generator().manual_seed(n + k)
    packed = K.pack_codes(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), 4)
    scale = ((torch.rand(n, k // gs, generator=g) * 0.02 + 0.005) * torch.randn(n, k // gs, generator=g).sign())
    scale = scale.to(sdtype)
    x = (torch.randn(13, k, generator=g) * 3 + 0.2).to(dtype)
    ref_offset = scale.float() * code_offset if code_offset else None  # exact; fp32 scales take the fp32 tiles
    for mode in (1, 2):
        for m in (1, 2, 5, 8, 13):
            for threads in (1, 2):
                xm = x[:m].contiguous()
                y16 = _run(xm, (packed, scale, None, code_offset), n, k, gs, mode, threads)
                y32 = _run(xm, (packed, scale.float(), ref_offset, 0), n, k, gs, mode, threads)
                assert torch.equal(_rows(y16), _rows(y32)), (mode, m, threads)
