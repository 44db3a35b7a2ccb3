"""A weight-only linear's bias added inside the op (`affineq::lowbit_linear_biased`): bit for bit the op's result
plus the bias on every kernel path, input dtype and compute dtype, the route a quantized `nn.Linear` takes, and
compiled graphs equal to eager with it."""

from __future__ import annotations

import pytest
import torch
from conftest import dispatched_ops, packed_problem
from torch import nn

import affineq
import affineq.cpp as K

BF16 = torch.bfloat16


def _needs_kernels() -> None:
    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")


def _problem(bits: int, n: int, k: int, gs: int, qp: str):
    """(packed, scale, offset, code_offset) of a random `bits`-bit weight with fp32 or bf16 (scale-only) qparams."""
    _, packed, scale, offset = packed_problem(bits, n, k, gs, seed=bits + n)
    if qp == "bf16":
        return packed, scale.bfloat16(), None, -(2 ** (bits - 1))
    return packed, scale, offset, 0


# (bits, n, k, group_size, qparams): a ragged n (a tail panel, columns past the last full 16), k not a multiple
# of 8, groups the GEMV cannot step through (the GEMM then), bf16 scales.
WEIGHTS = [(4, 37, 96, 32, "fp32"), (8, 50, 64, 64, "bf16"), (3, 20, 30, 30, "fp32"), (6, 64, 128, 128, "bf16")]


@pytest.mark.parametrize("bits,n,k,gs,qp", WEIGHTS)
@pytest.mark.parametrize("dtype,bf16_compute", [(torch.float32, False), (BF16, False), (torch.float16, False),
                                                (torch.float32, True), (BF16, True)])
def test_every_path_adds_the_bias_as_a_separate_add(bits, n, k, gs, qp, dtype, bf16_compute) -> None:
    # Each forced path (those a CPU lacks fall back to one it has) at rows for the GEMV and the GEMMs: the biased
    # result equals the unbiased one + bias bit for bit (fp32 y one rounding; bf16 / fp16 y rounded, then the sum
    # rounded, as aten's add of two bf16 tensors; a bf16-compute y's widened bf16 values plus the fp32 bias).
    _needs_kernels()
    packed, scale, offset, code_offset = _problem(bits, n, k, gs, qp)
    gen = torch.Generator().manual_seed(n * k)
    bias = (torch.randn(n, generator=gen) * 3).to(dtype)
    path_op = torch.ops.affineq_cpp.lowbit_linear_path
    cd = BF16 if bf16_compute else None
    for m in (1, 3, 40):
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        for path in range(6):
            args = (x, packed, scale, offset, bits, gs, n, k, 0, path, code_offset, cd)
            want = path_op(*args) + bias
            got = path_op(*args, bias)
            assert got.dtype == dtype and torch.equal(got, want), (m, path)
        got = torch.ops.affineq.lowbit_linear_biased(x, packed, scale, offset, bits, gs, n, k, 0, code_offset,
                                                     bf16_compute, bias)
        plain = torch.ops.affineq.lowbit_linear_bf16_compute if bf16_compute else torch.ops.affineq.lowbit_linear
        assert torch.equal(got, plain(x, packed, scale, offset, bits, gs, n, k, 0, code_offset) + bias), m


def test_leading_dims_infinities_and_bad_arguments() -> None:
    _needs_kernels()
    packed, scale, offset, co = _problem(4, 37, 96, 32, "fp32")
    op = torch.ops.affineq.lowbit_linear_biased
    x = torch.randn(2, 5, 96)
    bias = torch.randn(37)
    bias[3], bias[4] = float("inf"), float("nan")
    got = op(x, packed, scale, offset, 4, 32, 37, 96, 0, co, False, bias)
    want = torch.ops.affineq.lowbit_linear(x, packed, scale, offset, 4, 32, 37, 96) + bias
    assert got.shape == (2, 5, 37) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[..., 3].isinf().all() and got[..., 4].isnan().all()
    for bad in (bias[:-1], bias.bfloat16(), bias.view(1, 37)):
        with pytest.raises(RuntimeError, match=r"bias must be a CPU tensor \[n=37\] of x's dtype Float"):
            op(x, packed, scale, offset, 4, 32, 37, 96, 0, co, False, bad)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16 with bf16_compute"):
        op(x.half(), packed, scale, offset, 4, 32, 37, 96, 0, co, True, bias.half())
    for xg, bg in ((x.clone().requires_grad_(), bias), (x, bias.clone().requires_grad_())):
        with pytest.raises(RuntimeError, match="an inference op .no derivative."):
            op(xg, packed, scale, offset, 4, 32, 37, 96, 0, co, False, bg)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("config", ["int4", "int8"])
def test_a_weight_only_linear_passes_its_bias_to_the_op_unless_autograd_needs_it(dtype, config) -> None:
    from affineq import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    _needs_kernels()
    torch.manual_seed(0)
    cfg = Int4WeightOnlyConfig(group_size=32) if config == "int4" else Int8WeightOnlyConfig()
    lin = affineq.quantize_(nn.Linear(64, 48).to(dtype), cfg)
    w = lin.weight
    x = torch.randn(40, 64, dtype=dtype)
    with torch.no_grad(), affineq.record_kernels() as used:
        lin(x)
    if set(used) != {"affineq.lowbit_linear"}:
        pytest.skip(f"external: this CPU runs {sorted(set(used))} for this layer")
    with torch.no_grad(), dispatched_ops() as d:
        y = lin(x)
    assert "affineq.lowbit_linear_biased" in d.ops and "aten.add" not in d.ops, d.ops
    with torch.no_grad():
        unbiased = nn.functional.linear(x, w)
    assert torch.equal(y, unbiased + lin.bias)
    y = lin(x)  # grad mode, bias.requires_grad: the add stays outside the op, so its gradient flows
    y.float().sum().backward()
    assert torch.equal(y.detach(), unbiased + lin.bias.detach())
    assert torch.equal(lin.bias.grad, torch.full((48,), 40.0, dtype=dtype))


def test_compiled_biased_bf16_weight_only_mlp_equals_eager() -> None:
    # The bias inside the op leaves inductor no bias add to fuse unrounded with the GELU after it (README, Limits:
    # torch.compile and bf16), so a biased weight-only bf16 MLP compiles bit-equal to eager.
    from affineq import Int4WeightOnlyConfig

    _needs_kernels()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    model = affineq.quantize_(model.to(BF16).eval(), Int4WeightOnlyConfig(group_size=32))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for m in (3, 40):
            x = torch.randn(m, 256, dtype=BF16)
            with affineq.record_kernels() as used:
                eager = model(x)
            if set(used) != {"affineq.lowbit_linear"}:
                pytest.skip(f"external: this CPU runs {sorted(set(used))} at {m} rows")
            assert torch.equal(compiled(x), eager), m


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
def test_the_kquant_op_adds_the_bias_as_a_separate_add(dtype) -> None:
    # affineq::kquant_linear_biased == kquant_linear + bias bit for bit, at the GEMV's rows and the GEMM's; the route
    # of a k-quant weight takes it unless the bias needs a gradient.
    from affineq.configs import KQuantConfig

    _needs_kernels()
    torch.manual_seed(0)
    lin = affineq.quantize_(nn.Linear(256, 40).to(dtype), KQuantConfig("q4_k"))
    w = lin.weight
    args = (w.tensors["qdata"], w.tensors["scales"], w.tensors.get("mins"), w.tensors["d"], 4, 40, 256)
    for m in (1, 3, 40):
        x = torch.randn(m, 256, dtype=dtype)
        want = torch.ops.affineq.kquant_linear(x, *args) + lin.bias.detach()
        assert torch.equal(torch.ops.affineq.kquant_linear_biased(x, *args, lin.bias.detach()), want), m
        with torch.no_grad(), dispatched_ops() as d:
            y = lin(x)
        assert d.ops == ["affineq.kquant_linear_biased"] and torch.equal(y, want), d.ops
    with pytest.raises(RuntimeError, match=r"bias must be a CPU tensor \[n=40\]"):
        torch.ops.affineq.kquant_linear_biased(x, *args, lin.bias.detach()[:-1])
    lin(x).float().sum().backward()  # grad mode: the add stays outside the op, so the bias gets its gradient
    assert torch.equal(lin.bias.grad, torch.full((40,), 40.0, dtype=dtype))


def test_biased_ops_fake_impls_for_compile() -> None:
    """torch.library.opcheck: schema, fake (meta) impl and the CPU kernel agree."""
    _needs_kernels()
    packed, scale, offset, co = _problem(4, 37, 96, 32, "fp32")
    x, bias = torch.randn(2, 3, 96), torch.randn(37)
    torch.library.opcheck(torch.ops.affineq.lowbit_linear_biased.default,
                          (x, packed, scale, offset, 4, 32, 37, 96, 0, co, False, bias),
                          test_utils=("test_schema", "test_faketensor"))
    from affineq.configs import KQuantConfig

    w = affineq.quantize_(nn.Linear(256, 8, bias=False), KQuantConfig("q6_k")).weight
    args = (w.tensors["qdata"], w.tensors["scales"], None, w.tensors["d"], 6, 8, 256)
    torch.library.opcheck(torch.ops.affineq.kquant_linear_biased.default, (torch.randn(2, 256), *args, torch.randn(8)),
                          test_utils=("test_schema", "test_faketensor"))
