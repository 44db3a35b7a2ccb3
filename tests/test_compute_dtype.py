"""`compute_dtype=torch.bfloat16` on weight-only configs: a float32 input is rounded to bf16 once, runs the bf16
kernels, and the bf16 result comes back widened to float32 with the float32 bias added. Checked bit for bit
against the same weight fed the rounded input, against the exact float32 path within bf16's rounding, through
save / load, torch.compile, the grouped MoE kernel, and for every refusal. The C++ op takes the float32 x itself
(`compute_dtype=`): its bf16 kernels read x rounded and write y widened, bit for bit the rounded route's values."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_unchanged, bf16_compute_pair, dispatched_ops, save_load, snapshot_model
from torch import nn

import affineq.cpp as K
from affineq import (
    AWQConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    GPTQConfig,
    HQQConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    KernelFallbackWarning,
    MicroexpWeightOnlyConfig,
    PerGroup,
    QATConfig,
    QuantSpec,
    SmoothQuantConfig,
    config_from_dict,
    quantize_,
    record_kernels,
)
from affineq.configs.kquant import KQuantConfig
from affineq.gguf.block_quant import GGUFBlockConfig
from affineq.tensor.grouped import grouped_linear
from affineq.tensor.linear_kernels import lowbit_weight_args

BF16 = torch.bfloat16
CONFIGS = {
    "int4-g32": lambda **kw: Int4WeightOnlyConfig(group_size=32, **kw),
    "int8": lambda **kw: Int8WeightOnlyConfig(**kw),
    "int3-g32": lambda **kw: IntxWeightOnlyConfig(weight_dtype=torch.int3, granularity=PerGroup(32), **kw),
    "fp8": lambda **kw: Float8WeightOnlyConfig(**kw),
}


def _pair(name: str, k: int = 96, n: int = 80):
    """(bf16-compute linear, the same quantized weight without compute_dtype)."""
    return bf16_compute_pair(CONFIGS[name], k, n)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m", [1, 3, 33, 130])
def test_float32_input_runs_the_bf16_path_bit_for_bit(name, m):
    fast, plain = _pair(name)
    assert fast.weight.spec.compute_dtype is BF16 and plain.weight.spec.compute_dtype is None
    x = torch.randn(m, 96)
    with record_kernels() as fast_kernels:
        y = fast(x)
    with record_kernels() as bf16_kernels:
        want = F.linear(x.to(BF16), plain.weight).float() + plain.bias
    assert y.dtype == torch.float32
    assert torch.equal(y, want)
    assert fast_kernels == bf16_kernels and not any("fallback" in k for k in fast_kernels)
    # against the exact float32 path: only bf16 rounding of x, W and the result separates them
    exact = plain(x)
    scale = (x.abs() @ plain.weight.dequantize().abs().T).max()
    assert (y - exact).abs().max() <= 3 * 2**-8 * scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("name,k", [("int4-g32", 96), ("int8", 100), ("int3-g32", 96), ("fp8", 100)])
def test_op_rounds_float32_x_itself_on_every_path(name, k):
    # affineq::lowbit_linear_bf16_compute on float32 x: bit-equal to lowbit_linear on x.to(bf16), widened,
    # on every path (forced: 1 GEMV, 2 fp32 GEMM, 3 int16 VNNI GEMM, 4 bf16 dot GEMM, 5 AMX tiles, which round x's
    # rows as they pack them; the ones this build or shape lacks fall back), with x's columns padded (k = 100), a
    # NaN row, halfway cases and subnormals; the reference implementation agrees.
    if not K.is_available():
        pytest.skip(f"the C++ kernels are unavailable: {K.unavailable_reason()}")
    fast, _ = _pair(name, k=k)
    packed, scale, offset, bits, gs, codes, code_offset = lowbit_weight_args(fast.weight)
    n = fast.weight.shape[0]
    for m in (1, 2, 3, 17, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        if m > 3:
            x[1] = float("nan")
            x[2] = (1 + (2 * torch.arange(k) + 1) * 2.0**-8) * x[2].sign()  # halfway cases: round to even
            x[3, :8] = torch.randn(8) * 2.0**-140  # float32 subnormals
        for path in range(6):
            run = lambda x, path=path, **kw: torch.ops.affineq_cpp.lowbit_linear_path(  # noqa: E731
                x, packed, scale, offset, bits, gs, n, k, codes, path, code_offset, **kw)
            y = run(x, compute_dtype=BF16)
            assert y.dtype == torch.float32 and torch.equal(_bits(y), _bits(run(x.to(BF16)).float())), (m, path)
        y = torch.ops.affineq.lowbit_linear_bf16_compute(x, packed, scale, offset, bits, gs, n, k, codes, code_offset)
        ref = K.lowbit_linear_reference(x, packed, scale, offset, bits, gs, n, k, codes, code_offset, BF16)
        assert torch.equal(_bits(ref), _bits(K.lowbit_linear_reference(x.to(BF16), packed, scale, offset, bits, gs,
                                                                       n, k, codes, code_offset).float()))
        assert torch.equal(_bits(y.nan_to_num()), _bits(torch.ops.affineq.lowbit_linear(
            x.to(BF16), packed, scale, offset, bits, gs, n, k, codes, code_offset).float().nan_to_num()))
    x16 = torch.randn(2, k, dtype=torch.float16)
    op = torch.ops.affineq.lowbit_linear_bf16_compute
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16 .it is computed in bfloat16., got Half"):
        op(x16, packed, scale, offset, bits, gs, n, k, codes, code_offset)
    with pytest.raises(RuntimeError, match="an inference op .no derivative.: for a gradient call"):
        op(x.clone().requires_grad_(), packed, scale, offset, bits, gs, n, k, codes, code_offset)
    for call in (lambda: K.lowbit_linear_reference(x16, packed, scale, offset, bits, gs, n, k, codes, code_offset,
                                                   BF16),
                 lambda: K.lowbit_linear_reference(x, packed, scale, offset, bits, gs, n, k, codes, code_offset,
                                                   torch.float16)):
        with pytest.raises(ValueError, match="compute_dtype must be None or torch.bfloat16"):
            call()


def test_module_call_makes_no_bf16_copies_unless_autograd_needs_them():
    # Eager F.linear on float32 x hands x to the op as it is (the kernel rounds it) and gets float32 y back: no
    # aten casts around the call. With autograd recording, the casts stay (their backward converts the gradient).
    if not K.is_available():
        pytest.skip(f"the C++ kernels are unavailable: {K.unavailable_reason()}")
    fast, plain = _pair("int4-g32")
    x = torch.randn(40, 96)
    fast(x)  # the first call of a row bucket selects the kernel (for an empty bf16 tensor of x's shape)
    with torch.no_grad(), dispatched_ops() as seen:
        y = fast(x)
    assert seen.ops == ["affineq.lowbit_linear_biased"]  # bf16_compute=True, the bias added as y is stored
    assert torch.equal(y, F.linear(x.to(BF16), plain.weight).float() + plain.bias)
    xg = x.clone().requires_grad_()
    with dispatched_ops() as seen:
        yg = fast(xg)
    assert "aten._to_copy" in seen.ops and torch.equal(yg.detach(), y)
    yg.sum().backward()
    assert xg.grad is not None and xg.grad.dtype == torch.float32


def test_one_weight_alternating_float32_and_bf16_inputs_keeps_each_its_runner():
    # Eager F.linear caches the kernel choice and the kernel's bound runner per (weight, dtype chosen for, input
    # dtype, ...): float32 x on a bf16-compute weight is chosen for bf16 but runs the op that rounds x, bf16 x the
    # plain op (y rounded to bf16 before the float32 bias is added), and neither may get the other's runner
    # whichever comes first.
    for first in (torch.float32, BF16):
        fast, plain = _pair("int4-g32")
        x = torch.randn(3, 96)
        want = {torch.float32: F.linear(x.to(BF16), plain.weight).float() + plain.bias, BF16: plain(x.to(BF16))}
        with torch.no_grad():
            for dtype in (first, BF16 if first is torch.float32 else torch.float32) * 2:
                y = fast(x.to(dtype))
                assert y.dtype == want[dtype].dtype and torch.equal(y, want[dtype]), (first, dtype)


def test_bf16_input_is_unchanged_and_3d_inputs_keep_their_shape():
    fast, plain = _pair("int4-g32")
    x = torch.randn(2, 5, 96)
    assert torch.equal(fast(x.to(BF16)), plain(x.to(BF16)))
    assert fast(x).shape == (2, 5, 80)


def test_survives_save_load_dict_and_old_pickles():
    fast, _ = _pair("int4-g32")
    spec = fast.weight.spec
    assert save_load(fast.state_dict())["weight"].spec.compute_dtype is BF16
    d = spec.to_dict()
    assert d["compute_dtype"] == "bfloat16" and QuantSpec.from_dict(d) == spec
    old = {k: v for k, v in d.items() if k != "compute_dtype"}  # written before the field existed
    assert QuantSpec.from_dict(old) == spec.replace(compute_dtype=None)
    state = {f: getattr(spec, f) for f in spec.__dataclass_fields__ if f != "compute_dtype"}
    revived = object.__new__(QuantSpec)
    revived.__setstate__(state)
    assert revived.compute_dtype is None
    with pytest.raises(ValueError, match="compute_dtype 'int8' is not a floating-point dtype name"):
        QuantSpec.from_dict({**d, "compute_dtype": "int8"})
    cfg = Int4WeightOnlyConfig(group_size=32, compute_dtype=BF16)
    assert config_from_dict(cfg.to_dict()) == cfg


def test_compiled_equals_eager():
    fast, _ = _pair("int8")
    x = torch.randn(40, 96)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fast)(x), fast(x))


def test_grouped_expert_kernel_computes_in_bf16_too():
    torch.manual_seed(0)
    holder = nn.Module()
    holder.gate_up_proj = nn.Parameter(torch.randn(4, 64, 96))
    holder.down_proj = nn.Parameter(torch.randn(4, 96, 32))
    fast, plain = copy.deepcopy(holder), copy.deepcopy(holder)
    quantize_(fast, Int4WeightOnlyConfig(group_size=32, compute_dtype=BF16), filter_fn=lambda m, fqn: fqn == "")
    quantize_(plain, Int4WeightOnlyConfig(group_size=32), filter_fn=lambda m, fqn: fqn == "")
    x, ids = torch.randn(10, 96), torch.tensor([0, 3, 1, 1, 2, 0, 3, 3, 2, 1])
    y = grouped_linear(x, ids, fast.gate_up_proj)
    assert fast.gate_up_proj.spec.compute_dtype is BF16 and y.dtype == torch.float32
    assert torch.equal(y, grouped_linear(x.to(BF16), ids, plain.gate_up_proj).float())


def test_refusals_name_the_setting_and_change_nothing():
    with pytest.raises(ValueError, match=r"compute_dtype=torch.float16: use None .* or torch.bfloat16"):
        Int4WeightOnlyConfig(compute_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"compute_dtype='bf16' must be a dtype or NoneType.*torch.bfloat16"):
        Int8WeightOnlyConfig(compute_dtype="bf16")
    emb = nn.Sequential(nn.Embedding(16, 32))
    snap = snapshot_model(emb)
    with pytest.raises(ValueError, match="compute_dtype=torch.bfloat16 applies to linear layers"):
        quantize_(emb, Int8WeightOnlyConfig(compute_dtype=BF16), filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    assert_unchanged(emb, snap)


@pytest.mark.parametrize("make", [lambda: KQuantConfig(kind="q4_k", compute_dtype=BF16),
                                  lambda: GGUFBlockConfig("Q4_0", compute_dtype=BF16),
                                  lambda: MicroexpWeightOnlyConfig("mx9", compute_dtype=BF16)],
                         ids=["kquant", "gguf-block", "microexp"])
def test_configs_that_build_their_own_tensor_carry_it_too(make):
    """k-quants, GGUF blocks and shared micro-exponents build their tensors without weight_spec: the setting
    must reach them as well (it was dropped), so the linear computes as F.linear in bf16."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 64, bias=False)
    quantize_(lin, make())
    w = lin.weight
    assert w.spec.compute_dtype is BF16
    x = torch.randn(3, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)  # microexp has no packed kernel
        y = lin(x)
    assert y.dtype == torch.float32 and torch.equal(y, y.to(BF16).float())  # the bf16 result, widened
    want = F.linear(x.to(BF16), w.dequantize(BF16)).float()  # another summation order: 1 bf16 ulp apart at most
    assert (y - want).abs().max() <= 2**-7 * want.abs().max()


@pytest.mark.parametrize("make", [
    lambda: GPTQConfig(Int4WeightOnlyConfig(group_size=32), compute_dtype=BF16),
    lambda: HQQConfig(Int4WeightOnlyConfig(group_size=32), compute_dtype=BF16),
    lambda: AWQConfig(Int4WeightOnlyConfig(group_size=32), compute_dtype=BF16),
    lambda: SmoothQuantConfig(Int8DynamicActivationInt8WeightConfig(), compute_dtype=BF16),
    lambda: FqnToConfig({"_default": Int4WeightOnlyConfig()}, compute_dtype=BF16),
    lambda: FqnToConfig({"_default": Int4WeightOnlyConfig()}, param_names=("bias",)),
    lambda: QATConfig(Int4WeightOnlyConfig(group_size=32), compute_dtype=BF16),
], ids=["gptq", "hqq", "awq", "smoothquant", "fqn", "fqn-param-names", "qat"])
def test_wrappers_refuse_a_setting_their_inner_configs_own(make):
    """Algorithm wrappers, FqnToConfig and QATConfig build no spec themselves: a compute_dtype (or param_names)
    set on them was silently dropped; it is refused and the message says where it goes."""
    with pytest.raises(ValueError, match=r"(compute_dtype|param_names).*(base config|configs it maps to|on those)"):
        make()
