"""`compute_dtype=torch.bfloat16` on configs that quantize activations (8da4w, W8A8 dynamic / static, float8, MX):
a float32 input is rounded to bf16 once and the linear computes exactly as it does for that bf16 input (the
rounded x quantized as a bf16 x is), the bf16 result widened to float32 before the float32 bias. Checked bit for
bit against the same weight fed the rounded input, on the C++ ops that round x themselves
(`affineq::lowbit_linear_int8_act_bf16_compute`, `affineq::int8_codes_linear_bf16_compute`), inside a K-sharded
linear (reduced token ranges), through torch.compile, save / load and a recurrent module."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import bf16_compute_pair, dispatched_ops, needs_int8_codes_kernel, packed_problem, save_load
from torch import nn

import affineq.cpp as K
from affineq import (
    Float8DynamicActivationFloat8WeightConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    MXDynamicActivationMXWeightConfig,
    QuantSpec,
    config_from_dict,
    quantize_,
    record_kernels,
)
from affineq.tensor import activation
from affineq.tensor.linear_kernels import lowbit_weight_args

BF16 = torch.bfloat16
K_IN, N_OUT = 256, 96  # k % 32 == 0: the AMX tiles (path 5) take the larger row counts where the CPU has them
CONFIGS = {
    "8da4w": lambda **kw: Int8DynamicActivationInt4WeightConfig(group_size=32, **kw),
    "8da4w-dense": lambda **kw: Int8DynamicActivationInt4WeightConfig(group_size=64, packing_format="dense", **kw),
    "w8a8": lambda **kw: Int8DynamicActivationInt8WeightConfig(**kw),
    "w8a8-dense": lambda **kw: Int8DynamicActivationInt8WeightConfig(packing_format="dense", **kw),
    "static": lambda **kw: Int8StaticActivationInt8WeightConfig(**kw),
    "fp8-dyn": lambda **kw: Float8DynamicActivationFloat8WeightConfig(**kw),
    "mx-dyn": lambda **kw: MXDynamicActivationMXWeightConfig(**kw),
}


def _pair(name: str):
    """(bf16-compute linear, the same quantized weight without compute_dtype)."""
    cal = torch.Generator().manual_seed(1)
    kw = {"calibration_data": [torch.randn(16, K_IN, generator=cal) for _ in range(2)]} if name == "static" else {}
    fast, plain = bf16_compute_pair(CONFIGS[name], K_IN, N_OUT, **kw)
    assert fast.weight.spec.act_quant is not None and fast.weight.spec.act_quant == plain.weight.spec.act_quant
    return fast, plain


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m", [1, 3, 40, 130])
def test_float32_input_is_quantized_as_its_bf16_rounding(name, m):
    fast, plain = _pair(name)
    x = torch.randn(m, K_IN) * torch.linspace(0.1, 3, K_IN)
    with torch.no_grad():
        with record_kernels() as fast_kernels:
            y = fast(x)
        with record_kernels() as bf16_kernels:
            want = F.linear(x.to(BF16), plain.weight).float() + plain.bias
        exact = plain(x)
    assert y.dtype == torch.float32 and torch.equal(y, want)
    assert fast_kernels == bf16_kernels
    # it does compute in bf16: the float32 route differs, by about bf16's rounding of x, W and y
    assert not torch.equal(y, exact)
    scale = (x.abs() @ plain.weight.dequantize().abs().T).max()
    assert (y - exact).abs().max() <= 0.05 * scale


def test_bf16_input_and_3d_input_are_unchanged():
    fast, plain = _pair("8da4w")
    x = torch.randn(2, 33, K_IN)
    with torch.no_grad():
        assert torch.equal(fast(x.to(BF16)), plain(x.to(BF16)))
        assert fast(x).shape == (2, 33, N_OUT)


@pytest.mark.parametrize("layout", ["empty", "3d", "transposed", "strided"])
def test_any_input_layout_gives_the_rounded_inputs_result(layout):
    fast, plain = _pair("8da4w")
    x = {"empty": lambda: torch.randn(0, K_IN), "3d": lambda: torch.randn(3, 40, K_IN),
         "transposed": lambda: torch.randn(K_IN, 50).t(),
         "strided": lambda: torch.randn(40, 2 * K_IN)[:, ::2]}[layout]()
    with torch.no_grad():
        y = fast(x)
        assert y.shape == (*x.shape[:-1], N_OUT)
        assert torch.equal(y, F.linear(x.to(BF16), plain.weight).float() + plain.bias)


# the op each kernel hands float32 x to, as it is (it rounds x and widens y itself)
BF16_COMPUTE_TWIN = {"affineq.lowbit_linear": "affineq.lowbit_linear_int8_act_bf16_compute",
                     "affineq.int8_codes_linear": "affineq.int8_codes_linear_bf16_compute"}


@pytest.mark.parametrize("name", ["8da4w", "w8a8-dense"])
@pytest.mark.parametrize("m", [3, 64])
def test_eager_call_hands_float32_x_to_one_op(name, m):
    """Where bf16 x takes our lowbit kernel or the int8-codes kernel (one op quantizes and multiplies), float32 x
    goes to its bf16_compute twin as it is: no aten cast of x or y around the call. Where another kernel takes
    bf16 x, the rounded route casts (and still gives its values, test above)."""
    if not K.is_available():
        pytest.skip(f"the C++ kernels are unavailable: {K.unavailable_reason()}")
    fast, plain = _pair(name)
    x = torch.randn(m, K_IN)
    with torch.no_grad():
        fast(x)  # the first call of a row bucket selects the kernel
        with record_kernels() as used:
            plain(x.to(BF16))
        with dispatched_ops() as seen:
            y = fast(x)
    if used[0] in BF16_COMPUTE_TWIN:
        twin = BF16_COMPUTE_TWIN[used[0]]
        if twin == "affineq.int8_codes_linear_bf16_compute" and plain.bias is not None:
            twin = "affineq.int8_codes_linear_biased"  # the same op with the bias added as it stores y
        assert twin in seen.ops and "aten._to_copy" not in seen.ops, seen.ops
    else:
        assert "aten._to_copy" in seen.ops
    assert torch.equal(y, F.linear(x.to(BF16), plain.weight).float() + plain.bias)


@pytest.mark.parametrize("bits,per_token,mode", [(8, True, 2), (8, True, 0), (8, False, 2), (4, True, 2),
                                                 (4, True, 1), (4, False, 0)])
def test_int8_codes_op_rounds_float32_x_itself(bits, per_token, mode):
    """affineq::int8_codes_linear_bf16_compute on float32 x: bit-equal to int8_codes_linear on x.to(bf16),
    widened, below its min_rows (the fused GEMV's twin) and above (the kernel, AMX int8 tiles where the CPU has
    them: k % 64 == 0), with float32 subnormals and halfway cases; bf16 x: the op itself."""
    needs_int8_codes_kernel()
    for n, k, gs in ((64, 256, 32), (48, 96, 96)):
        _, packed, scale, offset = packed_problem(bits, n, k, gs, seed=k + bits)
        for m in (1, 3, 17, 70):
            args = (packed, scale.bfloat16(), offset.bfloat16(), gs, n, k, per_token, mode, 1e-6, bits, 0, 4)
            x = torch.randn(m, k) * torch.linspace(0.5, 4, k)
            if m > 2:
                x[1] = torch.randn(k) * 2.0**-140
                x[2] = (1 + (2 * torch.arange(k) + 1) * 2.0**-8) * torch.randn(k).sign()
            y = torch.ops.affineq.int8_codes_linear_bf16_compute(x, *args)
            want = torch.ops.affineq.int8_codes_linear(x.to(BF16), *args).float()
            assert y.dtype == torch.float32 and torch.equal(y, want), (n, k, m)
            assert not torch.equal(y, torch.ops.affineq.int8_codes_linear(x, *args))  # it does round
            xb = x.to(BF16)
            assert torch.equal(torch.ops.affineq.int8_codes_linear_bf16_compute(xb, *args),
                               torch.ops.affineq.int8_codes_linear(xb, *args))
    with pytest.raises(RuntimeError, match="int8_codes_linear_bf16_compute: x must be a float32 or bfloat16 CPU"):
        torch.ops.affineq.int8_codes_linear_bf16_compute(x.half(), *args)


@pytest.mark.parametrize("per_token,mode", [(True, 2), (True, 0), (True, 1), (False, 2), (False, 0)])
def test_op_rounds_float32_x_itself(per_token, mode):
    """affineq::lowbit_linear_int8_act_bf16_compute on float32 x: bit-equal to lowbit_linear_int8_act on
    x.to(bf16), widened, from one row to the AMX tiles' sizes, padded k included; bf16 x: the op itself."""
    if not K.is_available():
        pytest.skip(f"the C++ kernels are unavailable: {K.unavailable_reason()}")
    for k in (K_IN, 100):
        torch.manual_seed(k)
        lin = nn.Linear(k, 64, bias=False)
        quantize_(lin, Int8DynamicActivationInt4WeightConfig(group_size=50 if k == 100 else 32,
                                                             packing_format="dense"))
        args = (*lowbit_weight_args(lin.weight)[:3], 4, lin.weight.spec.block_size[1], 64, k, K.CODES_UINT,
                lowbit_weight_args(lin.weight)[6], per_token, mode, 1e-6)
        for m in (1, 2, 17, 64, 200):
            x = torch.randn(m, k) * torch.linspace(0.5, 4, k)
            if m > 2:  # float32 subnormals, and halfway cases that round to even
                x[1] = torch.randn(k) * 2.0**-140
                x[2] = (1 + (2 * torch.arange(k) + 1) * 2.0**-8) * torch.randn(k).sign()
            y = torch.ops.affineq.lowbit_linear_int8_act_bf16_compute(x, *args)
            want = torch.ops.affineq.lowbit_linear_int8_act(x.to(BF16), *args).float()
            assert y.dtype == torch.float32 and torch.equal(y, want), (k, m)
            xb = x.to(BF16)
            assert torch.equal(torch.ops.affineq.lowbit_linear_int8_act_bf16_compute(xb, *args),
                               torch.ops.affineq.lowbit_linear_int8_act(xb, *args))
        with pytest.raises(RuntimeError, match="x must be float32 or bfloat16 .it is computed in bfloat16., got Half"):
            torch.ops.affineq.lowbit_linear_int8_act_bf16_compute(x.half(), *args)


def test_k_sharded_linear_quantizes_with_the_reduced_token_range():
    """Inside a K-sharded linear the token's range comes from every rank (`activation.range_reduce`): the float32
    x must take the route that reduces it, not the kernel that quantizes its own rows."""
    fast, plain = _pair("8da4w")
    x = torch.randn(40, K_IN)
    lo, hi = x.amin(1, keepdim=True) * 3, x.amax(1, keepdim=True) * 3  # other ranks saw a wider range
    token = activation.range_reduce.set(lambda t, op: (lo if op == "min" else hi).to(t.dtype))
    try:
        with torch.no_grad():
            y = fast(x)
            want = F.linear(x.to(BF16), plain.weight).float() + plain.bias
    finally:
        activation.range_reduce.reset(token)
    assert torch.equal(y, want)
    with torch.no_grad():
        assert not torch.equal(y, fast(x))  # the reduction changed the codes


def test_compiled_equals_eager_and_save_load_keeps_it():
    fast, _ = _pair("8da4w")
    x = torch.randn(40, K_IN)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(fast)(x), fast(x))
    loaded = save_load(fast.state_dict())["weight"]
    assert loaded.spec == fast.weight.spec and loaded.spec.compute_dtype is BF16
    d = fast.weight.spec.to_dict()
    assert d["compute_dtype"] == "bfloat16" and d["act_quant"] is not None
    assert QuantSpec.from_dict(d) == fast.weight.spec
    cfg = CONFIGS["8da4w"](compute_dtype=BF16)
    assert config_from_dict(cfg.to_dict()) == cfg


def test_recurrent_module_computes_in_bf16_through_the_python_loop():
    """The C++ recurrence quantizes float32 h; with compute_dtype it would skip h's rounding, so the layer runs
    the Python loop (each step through F.linear, which rounds): the bf16 result, not the float32 one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LSTM(32, 32))
    recurrent = lambda m, fqn: isinstance(m, nn.LSTM)  # noqa: E731
    q = quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig(compute_dtype=BF16), filter_fn=recurrent)
    exact = quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig(), filter_fn=recurrent)
    x = torch.randn(7, 3, 32)
    with torch.no_grad(), record_kernels() as used:
        y = q(x)[0]
    assert "affineq.lowbit_rnn_layer" not in used
    with torch.no_grad():
        y_exact = exact(x)[0]
    err = (y - y_exact).norm() / y_exact.norm()
    assert 1e-4 < err < 0.05  # bf16 rounding: neither exact nor far off
