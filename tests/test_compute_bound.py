"""Compute-bound kernels (`affineq.tensor.compute_bound`): the C++ dense dequantize is bit-identical to the
PyTorch route, `affineq.dequant_linear` equals dequantize-then-F.linear within the stated bound, runs from the
per-CPU row threshold on (pinned with `record_kernels`), and works under torch.compile and torch.export."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from affineq import (
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MappingType,
    MXWeightOnlyConfig,
    PerAxis,
    PerGroup,
    cpp,
    quantize_,
    record_kernels,
)
from affineq.tensor.activation import act_eps, fake_quantize_activation, fused_int8_mode
from affineq.tensor.compute_bound import (
    _PREPACKED,
    MIN_ROWS,
    cpu_kind,
    exact_int8_gemm,
    native_bf16_gemm,
    prepacked_int8_weight,
    qlinear_run,
    set_min_rows,
)
from affineq.tensor.kernel_registry import select_linear_kernel
from affineq.tensor.linear_kernels import int8_codes_check, lowbit_weight_args

if not cpp.is_available():
    pytest.skip(f"external: the affineq C++ kernels did not build here ({cpp.unavailable_reason()})",
                allow_module_level=True)

KERNEL = "affineq.dequant_linear"
THRESHOLD = 32  # the row threshold the tests pin for this CPU (`pinned_threshold`)


@pytest.fixture
def pinned_threshold():
    """affineq.dequant_linear from THRESHOLD rows on, for fp32 and bf16 input on this CPU, whatever `MIN_ROWS`
    says for it (on an AVX2 CPU it keeps the fused kernels): the selection mechanism is tested everywhere."""
    previous = {d: set_min_rows(KERNEL, d, THRESHOLD) for d in ("fp32", "bf16")}
    yield THRESHOLD
    for d, v in previous.items():
        set_min_rows(KERNEL, d, v)

# Every kind of `dense` weight: integer codes with fp32 qparams (INT / NONE zero points: the canonical
# (u + zq) * s route), bf16 tinygemm qparams (FLOAT zero point), float8 / fp6 / fp4 codes, e8m0 scales.
CONFIGS = {
    "int4_g32": Int4WeightOnlyConfig(group_size=32),
    "int8": Int8WeightOnlyConfig(),
    "int3_g8_asym": IntxWeightOnlyConfig(torch.int3, PerGroup(8), MappingType.ASYMMETRIC),
    "uint2_axis_asym": IntxWeightOnlyConfig(torch.uint2, PerAxis(0), MappingType.ASYMMETRIC),
    "int5_g8": IntxWeightOnlyConfig(torch.int5, PerGroup(8)),
    "int7_g16": IntxWeightOnlyConfig(torch.int7, PerGroup(16)),
    "int1_g8_asym": IntxWeightOnlyConfig(torch.int1, PerGroup(8), MappingType.ASYMMETRIC),
    "fp8_e4m3": Float8WeightOnlyConfig(),
    "fp8_e5m2": Float8WeightOnlyConfig(torch.float8_e5m2),
    "fp6_e3m2": FPxWeightOnlyConfig(3, 2, group_size=8),
    "fp6_e2m3": FPxWeightOnlyConfig(2, 3, group_size=8),
    "fp4_g8": FPxWeightOnlyConfig(2, 1, group_size=8),
    "mxfp4": MXWeightOnlyConfig("fp4_e2m1"),
    "mxfp8": MXWeightOnlyConfig(torch.float8_e4m3fn),
}


def quantized_linear(config, n: int, k: int, dtype=torch.float32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=True, dtype=dtype)
    quantize_(lin, config)
    assert lin.weight.spec.fmt == "dense", lin.weight
    return lin


def python_dequantize(w, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch route of `Dense.dequantize` (taken while the C++ kernels are switched off)."""
    with cpp._set_disabled(True):
        return w.dequantize(dtype)


# Group size of each grouped config (the others have one scale per row and take any K).
GROUP = {"int4_g32": 32, "int3_g8_asym": 8, "int5_g8": 8, "int7_g16": 16, "int1_g8_asym": 8, "fp6_e3m2": 8,
         "fp6_e2m3": 8, "fp4_g8": 8, "mxfp4": 32, "mxfp8": 32}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_dequantize_is_bit_identical_to_the_python_route(name):
    g = GROUP.get(name)
    # odd N (a narrower last panel); per-row configs also get a K with a leftover unit (K % 8 != 0)
    ks = (4 * g, 2 * g, g) if g else (36, 100, 8)
    for n, k in zip((37, 16, 3), ks, strict=True):
        w = quantized_linear(CONFIGS[name], n, k).weight
        for dtype in (torch.float32, torch.bfloat16):
            fast, ref = w.dequantize(dtype), python_dequantize(w, dtype)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            assert fast.dtype == dtype and fast.shape == (n, k)
            assert torch.equal(fast.view(bits), ref.view(bits)), (name, n, k, dtype)


def test_fast_dequantize_covers_a_k_with_a_leftover_unit():
    # K = 36: the last 8-column unit holds 4 columns; groups of 4 (3 bits, zero points)
    w = quantized_linear(IntxWeightOnlyConfig(torch.int3, PerGroup(4), MappingType.ASYMMETRIC), 21, 36).weight
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(w.dequantize(dtype).float(), python_dequantize(w, dtype).float())


def compute_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The weight dtype the kernel multiplies with (bf16 only where the CPU has a native bf16 GEMM)."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 and native_bf16_gemm() else torch.float32


def run_op(x: torch.Tensor, w) -> torch.Tensor:
    from affineq.tensor.compute_bound import dequant_linear_run

    return dequant_linear_run(x, w, None)


@pytest.mark.parametrize("name", ["int4_g32", "int3_g8_asym", "int8", "fp8_e4m3", "fp6_e3m2", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_linear_equals_dequantize_then_linear(name, dtype):
    n, k = 45, 96  # odd N: a leftover 13-row panel
    w = quantized_linear(CONFIGS[name], n, k).weight
    cdt = compute_dtype(dtype)
    wref = w.dequantize(cdt)
    for m in (1, 3, 33, 130, 1024):
        x = torch.randn(m, k).to(dtype)
        got = run_op(x, w)
        ref = F.linear(x.to(cdt), wref).to(dtype)
        assert got.dtype == dtype and got.shape == (m, n)
        scale = ref.float().abs().max().item()
        # fp32: summation order only; bf16 output: at most 1 ulp of bf16 (2**-8 relative) on top of that
        tol = 1e-5 * scale if dtype == torch.float32 else 2**-7 * scale
        assert (got.float() - ref.float()).abs().max().item() <= tol, (name, m)


def test_dequant_linear_of_a_3d_input_and_many_panels_per_thread():
    w = quantized_linear(Int4WeightOnlyConfig(group_size=64), 1000, 512).weight  # 63 panels, leftover 8 rows
    x = torch.randn(2, 40, 512)
    ref = F.linear(x, w.dequantize(torch.float32))
    got = run_op(x, w)
    assert got.shape == (2, 40, 1000)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_runs_from_the_threshold_on_and_the_fused_kernel_below(dtype, pinned_threshold):
    # The op compares M with its threshold itself (a graph with a symbolic M runs what eager runs): below it the
    # fused kernel's values bit for bit, from it on the dequantized GEMM's.
    lin = quantized_linear(Int4WeightOnlyConfig(group_size=32), 64, 128)
    w = lin.weight
    packed, scale, offset, bits, gs, codes, co = lowbit_weight_args(w)
    for m in (1, THRESHOLD - 1, THRESHOLD, 2 * THRESHOLD + 1, THRESHOLD - 1, 1):
        x = torch.randn(m, 128, dtype=dtype)
        with torch.no_grad(), record_kernels() as used:
            got = lin(x)
            fused = torch.ops.affineq.lowbit_linear(x, packed, scale, offset, bits, gs, 64, 128, codes, co) + lin.bias
        assert used == [KERNEL], (m, used)
        if m < THRESHOLD:
            assert torch.equal(got, fused), m
        else:
            ref = F.linear(x.float(), w.dequantize(torch.float32), lin.bias.float())
            tol = 1e-5 if dtype == torch.float32 else 2**-6
            assert (got.float() - ref).abs().max().item() <= tol * ref.abs().max().item(), m
    kernel, _ = select_linear_kernel(torch.randn(2, 128, dtype=dtype), w)
    assert kernel.name == KERNEL


@pytest.fixture
def no_int8_codes_for_int4():
    """The exact int8 kernel off for 4-bit weights (it would take 8da4w before the dequantizing one here)."""
    previous = {d: set_min_rows(INT8_INT4, d, None) for d in ("fp32", "bf16")}
    yield
    for d, v in previous.items():
        set_min_rows(INT8_INT4, d, v)


INT8_INT4 = "affineq.int8_codes_linear:int4"
LOWBIT_INT8_ACT = "affineq.lowbit_linear:int8_act"


def test_8da4w_fake_quantizes_the_input_first(pinned_threshold, no_int8_codes_for_int4):
    lin = quantized_linear(Int8DynamicActivationInt4WeightConfig(group_size=32), 48, 64)
    x = torch.randn(THRESHOLD, 64)
    with torch.no_grad(), record_kernels() as used:
        got = lin(x)
    assert used == [KERNEL]
    with torch.no_grad():
        small = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])  # per token: the fused kernel, row by row
    assert (got - small).abs().max().item() <= 1e-5 * small.abs().max().item()


@pytest.mark.skipif(not cpp.int8_codes_built(), reason="external: this build has no int8-codes kernel (AVX512-VNNI "
                    "and VBMI)")
@pytest.mark.parametrize("group_size,dtype", [(32, torch.float32), (128, torch.float32), (32, torch.bfloat16)])
def test_8da4w_takes_the_exact_int8_kernel_from_its_threshold(group_size, dtype):
    # 4-bit weights x int8 activation codes summed in int32 (VNNI) from the row threshold on; below it the fused
    # kernel on the fake-quantized x, in x's dtype: eager selects it (lowbit_linear), and the op itself computes the
    # same values there (a graph with a symbolic M runs the op at every M). Both are x_fake_quant @ W^T: equal
    # within the output dtype's rounding, and to it in float64.
    name = "fp32" if dtype == torch.float32 else "bf16"
    previous = set_min_rows(INT8_INT4, name, 4)
    tiles = set_min_rows(LOWBIT_INT8_ACT, name, None)  # the AMX tiles' own threshold: the next test
    try:
        lin = quantized_linear(Int8DynamicActivationInt4WeightConfig(group_size=group_size), 80, 256, dtype, seed=3)
        w = lin.weight
        tol = 2e-6 if dtype == torch.float32 else 2**-7  # bf16 y: one rounding of the output
        for m in (1, 3, 4, 37):
            x = (torch.randn(m, 256) * 3 + 0.5).to(dtype)  # asymmetric per-token ranges: zero points
            with torch.no_grad(), record_kernels() as used:
                got = lin(x)
            want = "affineq.int8_codes_linear" if m >= 4 else "affineq.lowbit_linear"
            assert used == [want] and got.dtype == dtype, (m, used)
            with torch.no_grad():
                xq = fake_quantize_activation(x, w.spec.act_quant, w)
                packed, scale, offset, bits, gs, codes, co = lowbit_weight_args(w)
                fused = torch.ops.affineq.lowbit_linear(xq, packed, scale, offset, bits, gs, 80, 256, codes, co)
                ref = xq.double() @ w.dequantize(torch.float32).double().T
                aq = w.spec.act_quant
                op = torch.ops.affineq.int8_codes_linear(x, packed, scale, offset, gs, 80, 256, aq.per_token,
                                                         fused_int8_mode(aq), act_eps(x, aq), bits, co, 4)
            fused = fused + lin.bias
            ref = ref + lin.bias.double()
            assert torch.equal(got, (op + lin.bias).to(dtype)), m  # eager's choice == the op's own, every M
            if m < 4:  # the fused kernel: the same values as the fused route
                assert torch.equal(got, fused), m
            scale_ = ref.abs().max().item()
            assert (got.double() - ref).abs().max().item() <= tol * scale_, m
            assert (got.double() - fused.double()).abs().max().item() <= 2 * tol * scale_, m
    finally:
        set_min_rows(INT8_INT4, name, previous)
        set_min_rows(LOWBIT_INT8_ACT, name, tiles)


@pytest.mark.skipif(not cpp.int8_codes_built(), reason="external: this build has no int8-codes kernel (AVX512-VNNI "
                    "and VBMI)")
def test_8da4w_bf16_leaves_the_int8_kernel_to_the_tiles_from_their_threshold():
    # bf16 x on an AMX Xeon: the int8-codes kernel's cost grows with every row, lowbit_linear's AMX tiles pay their
    # weight dequantization once, so the int8-codes kernel declines from the tiles' threshold (pinned here so that
    # every CPU runs the selection; the kernels themselves are checked above and in test_amx_kernels.py).
    previous = set_min_rows(INT8_INT4, "bf16", 1), set_min_rows(LOWBIT_INT8_ACT, "bf16", 16)
    try:
        lin = quantized_linear(Int8DynamicActivationInt4WeightConfig(group_size=32), 64, 256, torch.bfloat16)
        for m, want in ((1, "affineq.int8_codes_linear"), (8, "affineq.int8_codes_linear"),
                        (15, "affineq.int8_codes_linear"), (16, "affineq.lowbit_linear"),
                        (40, "affineq.lowbit_linear")):
            with torch.no_grad(), record_kernels() as used:
                lin(torch.randn(m, 256, dtype=torch.bfloat16))
            assert used == [want], (m, used)
        x = torch.randn(16, 256, dtype=torch.bfloat16)
        assert "lowbit_linear's AMX tiles run 4-bit weights with torch.bfloat16 input from 16 rows" in \
            int8_codes_check(x, lin.weight)
    finally:
        set_min_rows(INT8_INT4, "bf16", previous[0])
        set_min_rows(LOWBIT_INT8_ACT, "bf16", previous[1])


def test_the_table_decides_where_no_threshold_is_pinned():
    w = quantized_linear(Int4WeightOnlyConfig(group_size=32), 64, 128).weight
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        least = MIN_ROWS[KERNEL][cpu_kind()].get(name)
        kernel, reasons = select_linear_kernel(torch.randn(1024, 128, dtype=dtype), w)
        if least is None:
            assert kernel.name == "affineq.lowbit_linear"
            assert any(r.startswith(f"{KERNEL}: not used for {name} input on a {cpu_kind()} CPU") for r in reasons)
        else:
            assert kernel.name == KERNEL


def test_set_min_rows_takes_powers_of_two_only():
    for bad in (0, 24, -8, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            set_min_rows(KERNEL, "fp32", bad)
    with pytest.raises(ValueError, match="unknown kernel"):
        set_min_rows("affineq.nope", "fp32", 32)
    with pytest.raises(ValueError, match="kind must be one of"):
        set_min_rows(KERNEL, "int8", 32)


def mlp(config) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))
    return quantize_(model, config)


def test_eager_equals_compiled_and_export_keeps_the_kernel(pinned_threshold):
    model = mlp(Int4WeightOnlyConfig(group_size=32))
    x = torch.randn(THRESHOLD + 3, 64)
    with torch.no_grad(), record_kernels() as used:
        ref = model(x)
    assert used == [KERNEL] * 2
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)(x)
    assert torch.equal(compiled, ref)
    ep = torch.export.export(model, (x,))  # static M: the graph holds the kernel's op
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.affineq.dequant_linear.default) == 2, targets
    assert torch.equal(ep.module()(x), ref)
    # a dynamic M keeps the same op (it compares M itself, no guard on M): the exported program equals eager on
    # both sides of the threshold
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=4096)},))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.affineq.dequant_linear.default) == 2, targets
    for m in (1, THRESHOLD - 1, THRESHOLD + 9):
        xm = torch.randn(m, 64)
        with torch.no_grad():
            assert torch.equal(ep.module()(xm), model(xm)), m


# -- W8A8: oneDNN's int8 GEMM on a prepacked weight ------------------------------------------------------------


def w8a8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [n, k] and fp32 scales [n, 1]. Without VNNI / AMX oneDNN sums u8 x s8 pairs in saturating
    int16, so there the codes stay within +-64 (pairs <= 2 * 255 * 64 < 2**15) and its sums are exact too: the
    plumbing is checked here, the full range on VNNI / AMX CPUs."""
    g = torch.Generator().manual_seed(seed)
    lim = 127 if exact_int8_gemm() else 64
    return torch.randint(-lim, lim + 1, (n, k), dtype=torch.int8, generator=g), torch.rand(n, 1, generator=g) + 0.01


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("no_clipping", [False, True])
def test_onednn_dynamic_op_equals_the_int_mm_route_bit_for_bit(per_token, no_clipping):
    codes, scale = w8a8_weight(40, 72)
    for m in (1, 33, 130):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, 72) * 3).to(dtype)
            eps = torch.finfo(torch.float32).tiny
            got = torch.ops.affineq.int8_dynamic_onednn_linear(x, codes, scale, per_token, no_clipping, eps)
            ref = torch.ops.affineq.int8_dynamic_linear(x, codes, scale, per_token, no_clipping, eps)
            assert got.dtype == dtype and torch.equal(got, ref), (m, dtype)


@pytest.mark.parametrize("zero_point", [None, 0, -7, 100])
def test_onednn_static_op_equals_the_int_mm_route_bit_for_bit(zero_point):
    codes, scale = w8a8_weight(24, 64, seed=1)
    x_scale = torch.tensor([0.02])
    zp = None if zero_point is None else torch.tensor([zero_point], dtype=torch.int32)
    x = torch.randn(65, 64)
    got = torch.ops.affineq.int8_static_onednn_linear(x, codes, scale, x_scale, zp)
    assert torch.equal(got, torch.ops.affineq.int8_static_linear(x, codes, scale, x_scale, zp))


def test_prepacked_weight_is_cached_per_codes_tensor_and_dropped_with_it():
    codes, _ = w8a8_weight(16, 32)
    packed = prepacked_int8_weight(codes)
    assert prepacked_int8_weight(codes) is packed  # packed once
    assert prepacked_int8_weight(codes.clone()) is not packed  # another tensor: its own pack
    codes.add_(1)  # changed in place: packed again
    assert prepacked_int8_weight(codes) is not packed
    key = id(codes)
    del codes
    assert key not in _PREPACKED


def test_w8a8_model_with_a_prepacked_weight_saves_copies_and_compiles(tmp_path):
    model = mlp(Int8DynamicActivationInt8WeightConfig(packing_format="plain"))
    for lin in (model[0], model[2]):  # codes oneDNN sums exactly on any CPU (see w8a8_weight)
        lin.weight._qdata.clamp_(-64, 64)
    x = torch.randn(40, 64)
    with torch.no_grad():
        def forward(m, xx):
            h = qlinear_run(xx, m[0].weight, m[0].bias).relu()
            return qlinear_run(h, m[2].weight, m[2].bias)

        ref = forward(model, x)  # fills the side cache
        assert torch.equal(ref, model(x))  # whichever kernel model(x) picks here: the same values
        path = tmp_path / "m.pt"
        torch.save(model.state_dict(), path)
        again = mlp(Int8DynamicActivationInt8WeightConfig(packing_format="plain"))
        again.load_state_dict(torch.load(path, weights_only=False), assign=True)
        assert torch.equal(forward(again, x), ref)
        assert torch.equal(forward(copy.deepcopy(model), x), ref)
        compiled = torch.compile(lambda xx: forward(model, xx), backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(x), ref)


def test_w8a8_kernel_runs_only_where_oneDNN_sums_exactly():
    model = mlp(Int8DynamicActivationInt8WeightConfig(packing_format="plain"))
    least = MIN_ROWS["onednn.qlinear"][cpu_kind()].get("fp32")
    x = torch.randn(max(least or 1, 64), 64)
    kernel, reasons = select_linear_kernel(x, model[0].weight)
    if exact_int8_gemm() and least is not None:
        assert kernel.name == "onednn.qlinear"
        with torch.no_grad(), record_kernels() as used:
            got = model(x)
        assert used == ["onednn.qlinear"] * 2
        with torch.no_grad():
            small = torch.cat([model(x[i:i + 1]) for i in range(x.shape[0])])  # aten._int_mm, row by row
        assert torch.equal(got, small)
    else:
        assert kernel.name == "aten._int_mm"
        assert any(r.startswith("onednn.qlinear: ") for r in reasons), reasons


def test_canonical_dequantize_of_a_zero_scale_row_is_zero_not_nan():
    # An all-zero GGUF block stores scale 0: its zero point round(offset / scale) would be 0/0. Eager
    # `Dense.dequantize` routes such tensors around the canonical form; the C++ op itself (what a compiled graph,
    # which skips that host-side check, runs) must give zeros too.
    from affineq.tensor.formats import dense_code_offset  # noqa: F401  (the op's argument conventions)

    w = quantized_linear(CONFIGS["int8"], 8, 64).weight
    t = dict(w.tensors)
    scale = t["scale"].clone()
    scale[0] = 0.0
    n, k = w.shape
    out = torch.ops.affineq.dense_dequantize(
        t["qdata"], scale, t.get("offset"), 8, k if w.spec.block_size[1] == k else w.spec.block_size[1], n, k,
        cpp.codes_kind(w.spec.target), 0, True, False)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(k))
    assert torch.equal(out[1:], w.dequantize(torch.float32)[1:])
