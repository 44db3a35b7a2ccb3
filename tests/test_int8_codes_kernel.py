"""affineq::int8_codes_linear (gemm_int8_codes.cpp): int8 codes of x times 8- or 4-bit weight codes summed exactly
in int32, then the qparams; bf16 input and output, thread splits, and what it refuses. Its few-row GEMV:
test_int8_codes_few_rows.py."""

from __future__ import annotations

import pytest
import torch
from conftest import dispatched_ops, needs_int8_codes_kernel, packed_problem

import affineq.cpp as K


@pytest.mark.parametrize("bits,qp", [(8, "fp32"), (4, "fp32"), (4, "bf16-scale-only"), (8, "bf16")])
@pytest.mark.parametrize("n,k,gs", [(16, 64, 64), (80, 96, 32), (160, 128, 64), (48, 256, 256)])
def test_int8_codes_kernel_sums_exact_products(n: int, k: int, gs: int, bits: int, qp: str) -> None:
    # affineq::int8_codes_linear (gemm_int8_codes.cpp): int8 codes of x times 8- or 4-bit weight codes summed in
    # int32, then the qparams: y = int8_fake_quant(x) @ W^T up to the fp32 epilogue. Tile shapes covered: 1-6 rows
    # x 4 panels, 7-12 rows x 2 panels, several row blocks, and the panels past the last group of four (n = 80,
    # 48); asymmetric rows (mode 2: zero points, including one-sign rows) and per-tensor qparams; fp32 qparams,
    # bf16 (scale, zero) and a bf16 scale alone (offset = scale * code_offset, 8da4w's symmetric int4).
    needs_int8_codes_kernel()
    codes, packed, scale, offset = packed_problem(bits, n, k, gs, seed=n + k)
    code_offset = 0
    if qp == "bf16":
        scale, offset = scale.bfloat16(), (offset + scale * 2 ** (bits - 1)).bfloat16()  # (scale, zero)
    elif qp == "bf16-scale-only":
        scale, offset, code_offset = scale.bfloat16(), None, -(2 ** (bits - 1))
    W = K._dequantize(packed, scale, offset, bits, gs, n, k, code_offset=code_offset).double()
    sf = scale.float().repeat_interleave(gs, 1)
    terms = (sf * codes.float() + sf * 2**bits).double()  # >= |each term of a weight| (offset <= scale * 2^bits)

    def op(x, per_token, mode):
        if bits == 8 and code_offset == 0:  # the schema's defaults
            return torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, gs, n, k, per_token, mode, 1e-12)
        return torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, gs, n, k, per_token, mode, 1e-12, bits,
                                                   code_offset)

    g = torch.Generator().manual_seed(1)
    for m in (1, 5, 7, 12, 13, 30):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        x[0] = x[0].abs() + 0.5  # one-sign row: zero point -128 in mode 2
        if m > 2:
            x[1] = 0.0
        for mode in (0, 1, 2):
            for per_token in (True, False):
                y = op(x, per_token, mode)
                xq = torch.ops.affineq.int8_fake_quant(x, per_token, mode, 1e-12).double()
                err = (y.double() - xq @ W.T).abs()
                bound = 1e-6 * (xq.abs() @ terms.T) + 1e-30
                assert bool((err <= bound).all()), (m, mode, per_token, (err / bound).max().item())


@pytest.mark.parametrize("n", [576, 192, 80])
def test_int8_codes_kernel_bf16_io_and_thread_split_change_no_bit(n: int) -> None:
    # bf16 x is quantized from its widened values and y rounded to bf16 as the tile stores it: bit-equal to the
    # fp32 run rounded afterwards. On 2 threads x's rows are split too when the weight's groups of 4 panels cannot
    # be shared evenly (n = 576: 9 groups; 192: 3; 80: 1 group + 1 panel): every output is the same sum however
    # the work is split.
    needs_int8_codes_kernel()
    k, gs = 96, 32
    _, packed, scale, _ = packed_problem(4, n, k, gs, seed=n)
    x = (torch.randn(100, k, generator=torch.Generator().manual_seed(n)) * 3).bfloat16()

    def op(x, threads, per_token):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return torch.ops.affineq.int8_codes_linear(x, packed, scale.bfloat16(), None, gs, n, k, per_token, 2,
                                                       1e-12, 4, -8)
        finally:
            torch.set_num_threads(old)

    for per_token in (True, False):  # one range per row, or one for all of x
        y1, y2 = op(x, 1, per_token), op(x, 2, per_token)
        assert y1.dtype == torch.bfloat16 and torch.equal(y1.view(torch.int16), y2.view(torch.int16))
        assert torch.equal(y2.view(torch.int16), op(x.float(), 2, per_token).bfloat16().view(torch.int16))


def test_int8_codes_kernel_refuses_what_it_cannot_read() -> None:
    needs_int8_codes_kernel()
    x = torch.randn(2, 64)
    _, packed, scale, offset = packed_problem(8, 24, 64, 64)
    with pytest.raises(RuntimeError, match="n % 16 == 0"):
        torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, 64, 24, 64, True, 0, 1e-12)
    _, packed, scale, offset = packed_problem(8, 32, 64, 64)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, 64, 32, 64, True, 0, 1e-12, 3, 0)
    e8m0 = torch.full((32, 1), 120, dtype=torch.uint8)  # exponent bytes: not fp32 qparams
    with pytest.raises(RuntimeError, match="not one the kernel reads"):
        torch.ops.affineq.int8_codes_linear(x, packed, e8m0, None, 64, 32, 64, True, 0, 1e-12)
    with pytest.raises(RuntimeError, match="mode"):
        torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, 64, 32, 64, True, 3, 1e-12)
    with pytest.raises(RuntimeError, match="8-bit codes"):
        torch.ops.affineq.int8_codes_linear(x, packed.flatten()[:100], scale, offset, 64, 32, 64, True, 0, 1e-12)


@pytest.mark.parametrize("bits,qp", [(8, "fp32"), (4, "bf16-scale-only")])
@pytest.mark.parametrize("dtype,bf16_compute", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("m,min_rows", [(40, 0), (3, 0), (3, 8)])
def test_int8_codes_linear_biased_adds_the_bias_as_a_separate_add(bits: int, qp: str, dtype: torch.dtype,
                                                                   bf16_compute: bool, m: int, min_rows: int) -> None:
    # The bias added as y is stored equals the op's y + bias bit for bit: fp32 y one rounding, bf16 y two (y, then
    # the sum: aten's bf16 add), a bf16-compute y as its widened bf16 values plus the fp32 bias; below min_rows
    # (the op's fused-GEMV branch) the same.
    needs_int8_codes_kernel()
    n, k, gs = 80, 96, 32
    _, packed, scale, offset = packed_problem(bits, n, k, gs, seed=m)
    if qp == "bf16-scale-only":
        scale, offset = scale.bfloat16(), None
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    bias = (torch.randn(n, generator=gen) * 4).to(dtype)
    code_offset = -(2 ** (bits - 1)) if offset is None else 0  # symmetric codes without an offset tensor
    args = (x, packed, scale, offset, gs, n, k, True, 2, 1e-12, bits, code_offset, min_rows)
    plain = (torch.ops.affineq.int8_codes_linear_bf16_compute if bf16_compute else torch.ops.affineq.int8_codes_linear)
    want = plain(*args) + bias
    got = torch.ops.affineq.int8_codes_linear_biased(*args, bf16_compute, bias)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="bias must be a CPU tensor"):
        torch.ops.affineq.int8_codes_linear_biased(*args, bf16_compute, bias[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_w8a8_linear_passes_its_bias_to_the_op_unless_it_needs_a_gradient(dtype: torch.dtype) -> None:
    from affineq import Int8DynamicActivationInt8WeightConfig, quantize_

    needs_int8_codes_kernel()
    torch.manual_seed(0)
    lin = quantize_(torch.nn.Linear(64, 48).to(dtype), Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(5, 64, dtype=dtype)
    with torch.no_grad(), dispatched_ops() as d:
        y = lin(x)
    assert "affineq.int8_codes_linear_biased" in d.ops and "aten.add" not in d.ops, d.ops
    with torch.no_grad():
        want = torch.nn.functional.linear(x, lin.weight) + lin.bias
    assert torch.equal(y, want)
    y = lin(x)  # grad mode, bias.requires_grad: the add stays outside the op, so its gradient flows
    y.float().sum().backward()
    assert torch.equal(y.detach(), want) and torch.equal(lin.bias.grad, torch.full((48,), 5.0, dtype=dtype))
