"""The grouped kernel for 3-D expert weights: ``torch.ops.affineq.grouped_lowbit_linear`` (cpp/grouped.cpp), its
PyTorch reference (affineq.cpp.grouped_ops) and ``affineq.tensor.grouped.grouped_linear``.

The contract: every row equals ``torch.ops.affineq.lowbit_linear`` run on its expert's rows, bit for bit (the same
per-expert kernel, the same decode and accumulation order), whatever the order of the ids, with experts that get
no rows, for every code kind and qparam convention the dense format stores. The scalar and AVX2 builds run the
op in tests/test_cpp_builds.py::test_other_isa_build_matches (one build each for all ops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import affineq.cpp as K
from affineq.configs import (
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MXWeightOnlyConfig,
)
from affineq.cpp.grouped_ops import grouped_lowbit_linear_reference
from affineq.granularity import PerGroup
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.fallback import record_kernels
from affineq.tensor.grouped import GROUPED_KERNEL, grouped_linear

OP = torch.ops.affineq.grouped_lowbit_linear

pytestmark = pytest.mark.skipif(not K.is_available(), reason=f"C++ kernels unavailable: {K.unavailable_reason()}")


def _raw_experts(E: int, n: int, k: int, bits: int, gs: int, symmetric: bool, qdtype=torch.float32, seed: int = 0):
    """Random codes and qparams of E experts, each the 2-D arrays lowbit_linear takes, stacked on a leading E."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2 ** bits, (E, n, k), dtype=torch.uint8, generator=g)
    packed = torch.stack([K.pack_codes(u[e], bits) for e in range(E)])
    scale = ((torch.rand(E, n, k // gs, generator=g) + 0.1) / 2 ** bits).to(qdtype)
    offset = None if symmetric else torch.randn(E, n, k // gs, generator=g).to(qdtype)
    return packed, scale, offset


def _per_expert(x, ids, packed, scale, offset, bits, gs, n, k, codes=0, code_offset=0):
    """The contract's reference: affineq::lowbit_linear on each expert's rows (in their order), put back."""
    y = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype)
    for e in range(packed.shape[0]):
        rows = (ids == e).nonzero().squeeze(1)
        if rows.numel():
            y[rows] = torch.ops.affineq.lowbit_linear(x[rows], packed[e], scale[e],
                                                      None if offset is None else offset[e], bits, gs, n, k, codes,
                                                      code_offset)
    return y


def _ids(T: int, E: int, seed: int) -> torch.Tensor:
    """Unsorted ids that leave expert 1 without rows (E >= 3) and pile most rows on expert E - 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T,), generator=g)
    ids[ids == 1] = E - 1
    ids[torch.rand(T, generator=g) < 0.5] = E - 1
    return ids


# T = 1 (decode), odd small T, and T = 41 with ~20+ rows on one expert: the GEMV and the GEMM paths inside one call
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_bit_exact_vs_per_expert_lowbit_linear(bits: int, gs: int, symmetric: bool) -> None:
    E, n, k = 5, 40, 128  # n = 40: two full 16-row panels and a ragged one
    packed, scale, offset = _raw_experts(E, n, k, bits, gs, symmetric, seed=bits * gs)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # fp16: the int16 VNNI GEMM where built
        for T in (1, 3, 17, 41):
            ids = _ids(T, E, seed=T)
            x = torch.randn(T, k).to(dtype)
            y = OP(x, ids, packed, scale, offset, bits, gs, n, k, 0, 0)
            assert y.dtype == dtype and y.shape == (T, n)
            assert torch.equal(y, _per_expert(x, ids, packed, scale, offset, bits, gs, n, k)), (dtype, T)


def test_bf16_qparams_and_ragged_k() -> None:
    # tinygemm convention (bf16 scale and zero), and k = 72 (x zero-padded to whole 8-column units), gs = 24
    E, n, k, gs = 3, 37, 72, 24
    for bits in (1, 4, 5, 7):
        packed, scale, offset = _raw_experts(E, n, k, bits, gs, False, torch.bfloat16, seed=bits)
        for T in (1, 6, 30):
            ids = _ids(T, E, seed=T + bits)
            x = torch.randn(T, k, dtype=torch.bfloat16)
            y = OP(x, ids, packed, scale, offset, bits, gs, n, k, 0, 0)
            assert torch.equal(y, _per_expert(x, ids, packed, scale, offset, bits, gs, n, k)), (bits, T)


def _stack(aqts):
    """The contract's 3-D dense weight as raw tensors: each expert quantized alone, _qdata / _scale / _offset
    stacked on a leading E."""
    offs = [getattr(a, "_offset", None) for a in aqts]
    return (torch.stack([a._qdata for a in aqts]), torch.stack([a._scale for a in aqts]),
            None if offs[0] is None else torch.stack(offs))


# Every kind of code the dense format stores, built by the configs users pass (expert by expert, as 2-D weights)
CONFIGS = {
    "int4_g32_bf16": Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
    "int4_g128_fp32": Int4WeightOnlyConfig(group_size=128, packing_format="dense", scale_dtype=torch.float32),
    "int8": Int8WeightOnlyConfig(group_size=64, packing_format="dense"),
    "int2_g32": IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(32), packing_format="dense",
                                     scale_dtype=torch.float32),
    "float8_e4m3": Float8WeightOnlyConfig(packing_format="dense"),
    "fp4_fp32_scales": FPxWeightOnlyConfig(ebits=2, mbits=1, group_size=32, packing_format="dense"),
    "mxfp4": MXWeightOnlyConfig(packing_format="dense"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_formats_from_configs(name: str) -> None:
    E, n, k = 4, 48, 128
    torch.manual_seed(0)
    cfg = CONFIGS[name]
    w = torch.randn(E, n, k)
    aqts = [cfg.quantize_weight(w[e], nn.Linear(k, n, bias=False)) for e in range(E)]
    assert all(a.spec.fmt == "dense" for a in aqts)
    packed, scale, offset = _stack(aqts)
    from affineq.tensor.linear_kernels import lowbit_weight_args

    _, _, _, bits, gs, codes, code_offset = lowbit_weight_args(aqts[0])
    for T in (1, 3, 17):
        ids = _ids(T, E, seed=T)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(T, k).to(dtype)
            y = OP(x, ids, packed, scale, offset, bits, gs, n, k, codes, code_offset)
            assert torch.equal(y, _per_expert(x, ids, packed, scale, offset, bits, gs, n, k, codes, code_offset))
            # and it is the product with the dequantized experts (fp32 rounding only)
            if dtype == torch.float32:
                want = torch.stack([x[t] @ aqts[int(ids[t])].dequantize().T for t in range(T)])
                torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


def test_reference_equals_op() -> None:
    E, n, k, gs, bits = 6, 33, 64, 32, 4
    for symmetric in (False, True):
        packed, scale, offset = _raw_experts(E, n, k, bits, gs, symmetric, seed=3)
        for T in (0, 1, 9):
            ids = _ids(T, E, seed=T) if T else torch.zeros(0, dtype=torch.int64)
            x = torch.randn(T, k)
            y = OP(x, ids, packed, scale, offset, bits, gs, n, k, 0, 0)
            ref = grouped_lowbit_linear_reference(x, ids, packed, scale, offset, bits, gs, n, k)
            assert y.shape == ref.shape == (T, n)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_opcheck() -> None:
    # schema, fake impl (shapes, dtypes), AOT dispatch with dynamic shapes
    E, n, k, gs, bits = 3, 24, 64, 32, 4
    for symmetric in (False, True):
        packed, scale, offset = _raw_experts(E, n, k, bits, gs, symmetric, seed=4)
        for x in (torch.randn(5, k), torch.randn(1, k, dtype=torch.bfloat16)):
            ids = _ids(x.shape[0], E, seed=1)
            torch.library.opcheck(OP.default, (x, ids, packed, scale, offset, bits, gs, n, k, 0, 0))


def test_unrouted_experts_never_enter_a_row() -> None:
    # NaN scales on every expert no row is routed to: a row that mixed in another expert's weights would be NaN
    E, n, k, gs, bits = 8, 32, 64, 32, 4
    packed, scale, offset = _raw_experts(E, n, k, bits, gs, False, seed=5)
    ids = torch.tensor([6, 2, 6])
    poisoned = scale.clone()
    poisoned[[0, 1, 3, 4, 5, 7]] = float("nan")
    x = torch.randn(3, k)
    y = OP(x, ids, packed, poisoned, offset, bits, gs, n, k, 0, 0)
    assert torch.isfinite(y).all()
    assert torch.equal(y, OP(x, ids, packed, scale, offset, bits, gs, n, k, 0, 0))


def test_argument_errors() -> None:
    E, n, k, gs, bits = 3, 16, 64, 32, 4
    packed, scale, offset = _raw_experts(E, n, k, bits, gs, False)
    x, ids = torch.randn(2, k), torch.tensor([0, 2])
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 3\) .*got 3 at row 1"):
        OP(x, torch.tensor([0, 3]), packed, scale, offset, bits, gs, n, k, 0, 0)
    with pytest.raises(ValueError, match="expert_ids must be in"):
        OP(x, torch.tensor([-1, 0]), packed, scale, offset, bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="expert_ids must be an int64"):
        OP(x, ids.int(), packed, scale, offset, bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="expert_ids must be an int64 CPU tensor of shape"):
        OP(x, torch.tensor([0]), packed, scale, offset, bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match=r"x must have shape \[T, k=64\]"):
        OP(torch.randn(2, 32), ids, packed, scale, offset, bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="packed must be a uint8"):
        OP(x, ids, packed[0], scale, offset, bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match=r"packed\[e\] must hold"):
        OP(x, ids, packed, scale, offset, 3, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="scale must be 3-D"):
        OP(x, ids, packed, scale[:2], offset, bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="offset must be 3-D"):
        OP(x, ids, packed, scale, offset[0], bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="scale must have shape"):
        OP(x, ids, packed, scale[:, :, :1], offset[:, :, :1], bits, gs, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="group_size must divide k"):
        OP(x, ids, packed, scale, offset, bits, 48, n, k, 0, 0)
    with pytest.raises(RuntimeError, match="codes must be"):
        OP(x, ids, packed, scale, offset, bits, gs, n, k, 1, 0)
    # the reference and the fake impl give ValueErrors with the same rules
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 3\)"):
        grouped_lowbit_linear_reference(x, torch.tensor([0, 3]), packed, scale, offset, bits, gs, n, k)
    with pytest.raises(ValueError, match="expert_ids must be int64"):
        grouped_lowbit_linear_reference(x, ids.int(), packed, scale, offset, bits, gs, n, k)
    with pytest.raises(ValueError, match="scale must be 3-D"):
        grouped_lowbit_linear_reference(x, ids, packed, scale[0], offset, bits, gs, n, k)


# -- grouped_linear ------------------------------------------------------------------------------------------------


def test_grouped_linear_float_weight_and_bias() -> None:
    E, n, k = 4, 24, 32
    torch.manual_seed(0)
    w, b = torch.randn(E, n, k), torch.randn(E, n)
    x, ids = torch.randn(9, k), _ids(9, E, seed=1)
    y = grouped_linear(x, ids, w, b)
    want = torch.stack([x[t] @ w[int(ids[t])].T + b[int(ids[t])] for t in range(9)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert grouped_linear(x[:0], ids[:0], w).shape == (0, n)


def test_grouped_linear_float_weight_compiles() -> None:
    E, n, k = 4, 24, 32
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(E, n, k, dtype=dtype), torch.randn(E, n, dtype=dtype)
        compiled = torch.compile(lambda xx, ii, w=w, b=b: grouped_linear(xx, ii, w, b), fullgraph=True, dynamic=True)
        for t in (3, 7):
            x, ids = torch.randn(t, k, dtype=dtype), _ids(t, E, seed=t)
            torch.testing.assert_close(compiled(x, ids), grouped_linear(x, ids, w, b), rtol=1e-5, atol=1e-5)


def test_grouped_linear_bad_input() -> None:
    E, n, k = 4, 24, 32
    w, x, ids = torch.randn(E, n, k), torch.randn(3, k), torch.tensor([0, 1, 3])
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 4\)"):
        grouped_linear(x, torch.tensor([0, 4, 1]), w)
    with pytest.raises(ValueError, match="expert_ids must be an integer tensor"):
        grouped_linear(x, ids.float(), w)
    with pytest.raises(ValueError, match="in_features is 32"):
        grouped_linear(torch.randn(3, 16), ids, w)
    with pytest.raises(ValueError, match="x must be a float tensor"):
        grouped_linear(x[0], ids, w)
    with pytest.raises(ValueError, match="weight must be 3-D"):
        grouped_linear(x, ids, w[0])
    with pytest.raises(ValueError, match=r"bias must be \[E, N\] = \[4, 24\]"):
        grouped_linear(x, ids, w, torch.randn(n))
    with pytest.raises(TypeError, match="weight must be"):
        grouped_linear(x, ids, w.int())


def _expert_aqt(w: torch.Tensor, cfg) -> AffineQuantizedTensor:
    """The contract's 3-D dense weight for w [E, N, K]: each expert quantized alone by `cfg`, its tensors stacked on
    a leading E, spec.shape (E, N, K) with blocks (1, 1, group_size)."""
    aqts = [cfg.quantize_weight(w[e], nn.Linear(w.shape[2], w.shape[1], bias=False)) for e in range(w.shape[0])]
    spec = aqts[0].spec.replace(shape=tuple(w.shape), block_size=(1, *aqts[0].spec.block_size))
    return AffineQuantizedTensor({name: torch.stack([a.tensors[name] for a in aqts]) for name in aqts[0].tensors},
                                 spec)


@pytest.mark.parametrize("cfg", [Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
                                 MXWeightOnlyConfig(packing_format="dense")], ids=["int4", "mxfp4"])
def test_grouped_linear_quantized_records_kernel_and_compiles(cfg) -> None:
    E, n, k = 4, 32, 64
    torch.manual_seed(0)
    w = torch.randn(E, n, k)
    q = _expert_aqt(w, cfg)
    x, ids, b = torch.randn(5, k), _ids(5, E, seed=2), torch.randn(E, n)
    with record_kernels() as names:
        y = grouped_linear(x, ids, q, b)
    assert names == [GROUPED_KERNEL]
    packed, scale, offset = q._qdata, q._scale, getattr(q, "_offset", None)
    from affineq.tensor.grouped import grouped_weight_args

    _, _, _, bits, gs, codes, co = grouped_weight_args(q)
    want = _per_expert(x, ids, packed, scale, offset, bits, gs, n, k, codes, co) + b[ids]
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 4\)"):  # the kernel's own check
        grouped_linear(x, torch.tensor([0, 4, 1, 1, 1]), q, b)


@pytest.mark.parametrize("cfg", [Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
                                 MXWeightOnlyConfig(packing_format="dense")], ids=["int4", "mxfp4"])
def test_grouped_linear_compiles_fullgraph(cfg) -> None:
    E, n, k = 4, 32, 64
    torch.manual_seed(0)
    q = _expert_aqt(torch.randn(E, n, k), cfg)
    names, spec = q.__tensor_flatten__()
    try:  # tracing rebuilds the weight from its spec: needs the dense format's 3-D (expert) layout
        AffineQuantizedTensor.__tensor_unflatten__({m: getattr(q, m) for m in names}, spec, q.shape, q.stride())
    except ValueError:
        pytest.skip("the dense format of this checkout has no 3-D (expert) layout yet")
    x, ids, b = torch.randn(5, k), _ids(5, E, seed=2), torch.randn(E, n)
    compiled = torch.compile(lambda xx, ii: grouped_linear(xx, ii, q, b), fullgraph=True)
    with record_kernels() as names:
        assert torch.equal(compiled(x, ids), grouped_linear(x, ids, q, b))
    assert set(names) == {GROUPED_KERNEL}


def test_other_formats_fall_back_per_routed_expert() -> None:
    # `plain` codes: no grouped kernel reads them; each routed expert is dequantized and multiplied, announced
    from affineq.primitives import MappingType

    E, n, k = 4, 32, 64
    torch.manual_seed(0)
    q = AffineQuantizedTensor.from_spec(torch.randn(E, n, k), (1, 1, 32), target=torch.uint4,
                                        mapping_type=MappingType.ASYMMETRIC, packing_format="plain")
    x, ids = torch.randn(5, k), torch.tensor([3, 0, 3, 1, 3])
    with record_kernels() as names, pytest.warns(UserWarning, match="reads the 'dense' format, not 'plain'"):
        y = grouped_linear(x, ids, q)
    assert names == ["dequantize:grouped_linear"]
    d = q.dequantize()
    torch.testing.assert_close(y, torch.stack([x[t] @ d[int(ids[t])].T for t in range(5)]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 4\)"):
        grouped_linear(x, torch.tensor([3, 0, 9, 1, 3]), q)


def test_input_gradient() -> None:
    # x.grad = grad_y @ W_e per row (the experts frozen), as autograd through the dequantized experts gives
    E, n, k = 4, 32, 64
    torch.manual_seed(0)
    q = _expert_aqt(torch.randn(E, n, k), Int4WeightOnlyConfig(group_size=32, packing_format="dense",
                                                               scale_dtype=torch.float32))
    aqts = [q._qdata, q._scale, q._offset]
    dense = torch.stack([torch.ops.affineq.lowbit_dequantize(aqts[0][e], aqts[1][e], aqts[2][e], 4, 32, n, k)
                         for e in range(E)])
    x, ids, gy = torch.randn(6, k, requires_grad=True), torch.tensor([3, 0, 3, 2, 0, 3]), torch.randn(6, n)
    y = grouped_linear(x, ids, q)
    y.backward(gy)
    x2 = x.detach().clone().requires_grad_(True)
    torch.einsum("tk,tnk->tn", x2, dense[ids]).backward(gy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, torch.einsum("tk,tnk->tn", x.detach(), dense[ids]), rtol=1e-5, atol=1e-5)


def test_compiled_op_fullgraph() -> None:
    # the op is one opaque node with a fake impl: torch.compile(fullgraph=True) equals eager, also for new T
    E, n, k, gs, bits = 4, 32, 64, 32, 4
    packed, scale, offset = _raw_experts(E, n, k, bits, gs, False, seed=9)

    def f(x, ids):
        return OP(x, ids, packed, scale, offset, bits, gs, n, k, 0, 0) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for T in (3, 5):
        x, ids = torch.randn(T, k), _ids(T, E, seed=T)
        assert torch.equal(compiled(x, ids), f(x, ids))


def test_disabled_kernels_fall_back_announced() -> None:
    from affineq.tensor.fallback import strict_kernels

    E, n, k = 3, 16, 32
    torch.manual_seed(0)
    w = torch.randn(E, n, k)
    q = _expert_aqt(w, Int4WeightOnlyConfig(group_size=32, packing_format="dense"))
    x, ids = torch.randn(4, k), torch.tensor([2, 0, 2, 2])
    fast = grouped_linear(x, ids, q)
    with K._set_disabled(True):
        with record_kernels() as names, pytest.warns(UserWarning, match="dequantize-then-grouped_linear"):
            slow = grouped_linear(x, ids, q)
        with strict_kernels(), pytest.raises(RuntimeError, match="strict mode"):
            grouped_linear(x, ids, q)
    assert names == ["dequantize:grouped_linear"]
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
