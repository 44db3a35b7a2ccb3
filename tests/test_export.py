"""torch.export and AOTInductor of quantized models: every built-in config keeps its packed kernel in the graph.

For each config: a small MLP exported with a dynamic batch dim; the exported program's graph holds the op of the
kernel eager runs (`record_kernels`) and no float matmul of a dequantized weight; it equals eager bit for bit
(the same kernels run on the same inputs: affineq's C++ ops, aten's int4 / int8 / _int_mm / _scaled_mm CPU
kernels are deterministic for a given shape); `torch.export.save` / `load` round-trips it; it runs at other
batch sizes. AOTInductor: a few models with one linear per config (FqnToConfig), so one compile covers many
configs, compared bit for bit with eager, also loaded in a fresh process.
"""

from __future__ import annotations

import collections
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from affineq import (
    AffineQuantizedTensor,
    AWQConfig,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    FqnToConfig,
    GPTQConfig,
    HQQConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MappingType,
    MicroexpWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
    PerAxis,
    PerGroup,
    SmoothQuantConfig,
    ZeroPointDomain,
    cpp,
    quantize_,
    record_kernels,
)
from affineq.granularity import PerTensor
from affineq.primitives import choose_qparams_affine
from affineq.tensor.activation import quantize_activation
from affineq.tensor.compute_bound import MIN_ROWS, cpu_kind, min_rows, set_min_rows
from affineq.tensor.spec import ActivationQuant

aten = torch.ops.aten
D_IN, D_HID = 128, 256


# Read before `fused_kernels_at_every_m` changes it: what a fresh process (tutorials) selects with.
INT8_CODES_INT4_ROWS = min_rows("affineq.int8_codes_linear:int4", torch.float32)
DEQUANT_ROWS = min_rows("affineq.dequant_linear", torch.float32)


@pytest.fixture(autouse=True, scope="module")
def fused_kernels_at_every_m():
    """oneDNN's W8A8 row threshold off: its precondition compares M in Python, so an exported graph with a symbolic
    batch serves every M with the fused kernels, and eager takes them too for the comparisons here. (The kernels
    that compare M inside their op, dequant_linear and int8_codes_linear, keep their thresholds.)"""
    previous = {(k, d): set_min_rows(k, d, None) for k in ("onednn.qlinear",) for d in ("fp32", "bf16")
                if d in MIN_ROWS[k][cpu_kind()]}
    yield
    for (k, d), v in previous.items():
        set_min_rows(k, d, v)

# The graph op each eager kernel name (`record_kernels`) becomes. The aten int8 kernels run inside affineq's
# opaque custom ops (one op per linear: see tensor/linear_kernels.py).
KERNEL_OPS = {
    "affineq.lowbit_linear": torch.ops.affineq.lowbit_linear.default,
    "affineq.int8_codes_linear": torch.ops.affineq.int8_codes_linear.default,
    "aten._weight_int4pack_mm_for_cpu": aten._weight_int4pack_mm_for_cpu.default,
    "aten._weight_int8pack_mm": torch.ops.affineq.weight_int8pack_mm.default,
    "affineq.dequant_linear": torch.ops.affineq.dequant_linear.default,
    "onednn.qlinear": torch.ops.affineq.int8_dynamic_onednn_linear.default,
    "onednn.qlinear:static": torch.ops.affineq.int8_static_onednn_linear.default,
    "aten._int_mm": torch.ops.affineq.int8_dynamic_linear.default,
    "aten._int_mm:static": torch.ops.affineq.int8_static_linear.default,
    "aten._scaled_mm": aten._scaled_mm.default,
}
# The ops that add a linear's bias as they store y, by kernel (taken where no gradient is recorded).
BIASED_OPS = {"affineq.lowbit_linear": torch.ops.affineq.lowbit_linear_biased.default,
              "affineq.int8_codes_linear": torch.ops.affineq.int8_codes_linear_biased.default}
# A float matmul in the graph means a dequantized weight (the MLP has no float linear).
FLOAT_MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default,
                 torch.ops.affineq.lowbit_dequantize.default, torch.ops.affineq.dense_dequantize.default}

CALIBRATION = [torch.randn(8, D_IN, generator=torch.Generator().manual_seed(i)) for i in range(4)]

# name -> config. Every built-in weight config (several options of some), two algorithm configs' outputs.
CONFIGS = {
    "int4_g64": Int4WeightOnlyConfig(group_size=64),
    "int4_g64_aten": Int4WeightOnlyConfig(group_size=64, packing_format="int4_cpu"),
    "int8": Int8WeightOnlyConfig(),
    "int8_aten": Int8WeightOnlyConfig(packing_format="plain"),
    "int3_g32": IntxWeightOnlyConfig(torch.int3, PerGroup(32)),
    "uint2_axis": IntxWeightOnlyConfig(torch.uint2, PerAxis(0), MappingType.ASYMMETRIC),
    "int6_g64": IntxWeightOnlyConfig(torch.int6, PerGroup(64)),
    "int8_dyn": Int8DynamicActivationInt8WeightConfig(),
    "int8_dyn_tensor": Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor"),
    "int8_dyn_dense": Int8DynamicActivationInt8WeightConfig(packing_format="dense"),
    "8da4w": Int8DynamicActivationInt4WeightConfig(group_size=32),
    "fp8_weight": Float8WeightOnlyConfig(),
    "fp8_dyn_row": Float8DynamicActivationFloat8WeightConfig(),
    "fp8_dyn_tensor": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
    "fp6_e3m2": FPxWeightOnlyConfig(3, 2),
    "fp4_e8m0": FPxWeightOnlyConfig(2, 1, scale_type="e8m0"),
    "mxfp4": MXWeightOnlyConfig(),
    "mxfp8": MXWeightOnlyConfig(torch.float8_e4m3fn),
    "mxfp4_dyn": MXDynamicActivationMXWeightConfig(),
    "mx6_microexp": MicroexpWeightOnlyConfig("mx6"),
    "static_asym": Int8StaticActivationInt8WeightConfig(),
    "static_sym_out": Int8StaticActivationInt8WeightConfig(activation_symmetric=True, quantize_output=True),
    "static_dense": Int8StaticActivationInt8WeightConfig(packing_format="dense"),
    "hqq_int4": HQQConfig(Int4WeightOnlyConfig(group_size=64), progress=False),
    "gptq_int4": GPTQConfig(Int4WeightOnlyConfig(group_size=64), progress=False),
    "awq_8da4w": AWQConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), progress=False),
    "smoothquant_int8_dyn": SmoothQuantConfig(Int8DynamicActivationInt8WeightConfig(), progress=False),
}
# AWQ / SmoothQuant scale the input of a linear with no norm before it by the weight's act_pre_scale.
PRE_SCALED = {"awq_8da4w", "smoothquant_int8_dyn"}
# MicroexpWeightOnlyConfig's `microexp` format has no kernel (its docstring says so): eager runs the announced
# dequantize fallback, and the exported program holds that same dequantize + linear.
FALLBACK = {"mx6_microexp"}
# Kernels that need the affineq C++ library (built with the machine's C++ compiler on first use).
CPP_KERNELS = {"affineq.lowbit_linear", "affineq.int8_codes_linear"}


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN))


def _needs_data(config) -> bool:
    if isinstance(config, FqnToConfig):
        return any(_needs_data(c) for c in config.fqn_to_config.values())
    return getattr(config, "needs_calibration", False) or getattr(config, "needs_data", False)


def quantized(model: nn.Module, config) -> nn.Module:
    return quantize_(model, config, calibration_data=CALIBRATION if _needs_data(config) else None)


def _skip_without_cpp(kernels) -> None:
    if set(kernels) & CPP_KERNELS and not cpp.is_available():
        pytest.skip(f"external: the affineq C++ kernels did not build here ({cpp.unavailable_reason()})")


def call_targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def export_batch_dynamic(model: nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=1, max=4096)
    return torch.export.export(model, (x,), dynamic_shapes=({0: batch},))


def save_load(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def assert_no_baked_weights(ep: torch.export.ExportedProgram, model: nn.Module) -> None:
    """No stored tensor of a quantized weight is a constant of `ep` (each is read from its weight parameter);
    constants such as MX's fp4 value grid are fine."""
    stored = [t for p in model.parameters() if isinstance(p, AffineQuantizedTensor) for t in p.tensors.values()]
    for name, c in ep.constants.items():
        assert not any(c.shape == t.shape and c.dtype == t.dtype and torch.equal(c, t) for t in stored), name


def assert_packed_graph(gm: torch.fx.GraphModule, kernels: list[str], linears: int) -> None:
    """`gm` runs each linear on the op of the kernel eager ran (`kernels`), and no float matmul."""
    targets = call_targets(gm)

    def count(name: str) -> int:  # the kernel's op, or its biased twin
        return targets.count(KERNEL_OPS[name]) + (targets.count(BIASED_OPS[name]) if name in BIASED_OPS else 0)

    for name in set(kernels):
        assert count(name) == kernels.count(name), f"{KERNEL_OPS[name]} x{kernels.count(name)} expected in {targets}"
    assert sum(count(k) for k in set(kernels)) == linears
    assert not FLOAT_MATMULS & set(targets), f"a dequantize-then-matmul in the graph: {targets}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_keeps_the_packed_kernel_and_equals_eager(name):
    model = quantized(make_mlp(), CONFIGS[name])
    x = torch.randn(4, D_IN)
    with torch.no_grad(), record_kernels() as used:
        ref = model(x)
    _skip_without_cpp(used)
    assert ("act_pre_scale" in model[0].weight.act_tensors) == (name in PRE_SCALED)
    ep = export_batch_dynamic(model, x)
    assert_no_baked_weights(ep, model)
    if name in FALLBACK:
        assert used == ["dequantize:linear"] * 2
        assert call_targets(ep.graph_module).count(aten.linear.default) == 2
    else:
        assert len(used) == 2 and all(k in KERNEL_OPS for k in used), used
        assert_packed_graph(ep.graph_module, used, linears=2)
        # The inference IR (what AOTInductor and other runtimes consume) keeps the packed ops too.
        assert_packed_graph(ep.run_decompositions().graph_module, used, linears=2)
    assert torch.equal(ep.module()(x), ref)
    loaded = save_load(ep)
    for m in (1, 7):  # other batch sizes, after a save / load round trip
        xm = torch.randn(m, D_IN)
        with torch.no_grad():
            assert torch.equal(loaded.module()(xm), model(xm)), m


def test_export_under_no_grad_and_of_a_3d_input():
    model = quantized(make_mlp(), Int4WeightOnlyConfig(group_size=64))
    x = torch.randn(2, 5, D_IN)
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=512)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch, 1: seq},))
        assert_packed_graph(ep.graph_module, ["affineq.lowbit_linear"] * 2, linears=2)
        x2 = torch.randn(3, 11, D_IN)
        assert torch.equal(ep.module()(x2), model(x2))


def test_mixed_formats_read_every_stored_tensor_from_the_weight():
    # torch.export proxies the stored-tensor attributes it finds on the first quantized weight it meets; a
    # later weight storing one that the first lacks (dense `offset` after aten `plain`) was traced as a baked-in
    # constant and export failed. AffineQuantizedTensor.__dir__ lists every stored name.
    model = quantized(make_mlp(), FqnToConfig({"0": Int8WeightOnlyConfig(packing_format="plain"),
                                               "2": Int4WeightOnlyConfig(group_size=64)}))
    x = torch.randn(3, D_IN)
    ep = export_batch_dynamic(model, x)
    assert_no_baked_weights(ep, model)
    reads = {n.args[1] for n in ep.graph.nodes if n.target == torch.ops.export.access_subclass_inner_tensor.default}
    assert {"_qdata", "_scale", "_offset"} <= reads
    with torch.no_grad():
        assert torch.equal(ep.module()(x), model(x))


def test_strict_export_of_a_bf16_model_with_mixed_configs():
    # strict=True traces with dynamo (the default, non-strict, with Python): both keep the packed ops.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_HID), nn.ReLU(),
                          nn.Linear(D_HID, D_IN)).to(torch.bfloat16)
    quantized(model, FqnToConfig({"0": Int8WeightOnlyConfig(packing_format="plain"),
                                  "2": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
                                  "4": Int4WeightOnlyConfig(group_size=64)}))
    x = torch.randn(4, D_IN, dtype=torch.bfloat16)
    with torch.no_grad(), record_kernels() as used:
        model(x)
    _skip_without_cpp(used)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=4096)},), strict=True)
    assert_packed_graph(ep.graph_module, used, linears=3)
    x = torch.randn(9, D_IN, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), model(x))


@pytest.mark.parametrize("target, mapping", [(torch.int8, MappingType.SYMMETRIC), (torch.int8, MappingType.ASYMMETRIC),
                                             (torch.float8_e4m3fn, MappingType.SYMMETRIC)])
def test_per_tensor_activation_qparams_equal_the_whole_tensor_block(target, mapping):
    # Under export the batch dim is symbolic, so per-tensor activation quantization takes its qparams from
    # (min, max) with int block sizes: bit for bit those of block_size = x.shape.
    domain = ZeroPointDomain.INT if mapping is MappingType.ASYMMETRIC else ZeroPointDomain.NONE
    aq = ActivationQuant(target, mapping, "per_tensor", domain)
    x = torch.randn(6, 64) * 3 + 0.5
    q, scale, zp, block = quantize_activation(x, aq)
    ref_scale, ref_zp = choose_qparams_affine(x, mapping, x.shape, target, scale_dtype=torch.float32,
                                              zero_point_domain=domain)
    assert block == (1, 64) and scale.shape == (6, 1)
    assert torch.equal(scale, ref_scale.expand(6, 1))
    assert (zp is None) == (ref_zp is None) and (zp is None or torch.equal(zp, ref_zp.expand(6, 1)))


# -- AOTInductor -----------------------------------------------------------------------------------------

# One compile per group (inductor's C++ compile costs ~15 s on 2 cores): each model has one linear per config.
AOTI_GROUPS = {
    "weight_only": ["int4_g64", "int4_g64_aten", "int8", "int8_aten", "int3_g32", "uint2_axis", "int6_g64",
                    "fp8_weight", "fp6_e3m2", "fp4_e8m0", "mxfp4", "mxfp8", "mx6_microexp", "hqq_int4", "gptq_int4"],
    "activation_quant": ["int8_dyn", "int8_dyn_tensor", "int8_dyn_dense", "8da4w", "fp8_dyn_row",
                         "fp8_dyn_tensor", "mxfp4_dyn", "static_asym", "static_sym_out", "static_dense",
                         "awq_8da4w", "smoothquant_int8_dyn"],
}


class Fanout(nn.Module):
    """One linear per name on the same input, outputs side by side: [B, D_IN] -> [B, 32 * len(names)]."""

    def __init__(self, names: list[str]):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({n: nn.Linear(D_IN, 32) for n in names})

    def forward(self, x):
        return torch.cat([layer(x) for layer in self.layers.values()], dim=-1)


def test_aoti_groups_cover_every_config():
    grouped = [n for names in AOTI_GROUPS.values() for n in names]
    assert sorted(grouped) == sorted(CONFIGS)


def _fanout(group: str) -> nn.Module:
    names = AOTI_GROUPS[group]
    return quantized(Fanout(names), FqnToConfig({f"layers.{n}": CONFIGS[n] for n in names}))


@pytest.fixture(scope="module")
def aoti_packages(tmp_path_factory):
    """group -> (package path, model, eager kernels), compiled once for this file."""
    if not cpp.is_available():
        pytest.skip(f"external: no working C++ toolchain for AOTInductor / affineq ({cpp.unavailable_reason()})")
    out = {}
    for group in AOTI_GROUPS:
        model = _fanout(group)
        x = torch.randn(4, D_IN)
        with torch.no_grad(), record_kernels() as used:
            model(x)
        ep = export_batch_dynamic(model, x)
        path = str(tmp_path_factory.mktemp("aoti") / f"{group}.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
        out[group] = (path, model, used)
    return out


@pytest.mark.parametrize("group", list(AOTI_GROUPS))
def test_aoti_round_trip_equals_eager(aoti_packages, group):
    path, model, used = aoti_packages[group]
    kernels = [k for k in used if k in KERNEL_OPS]
    assert len(kernels) == len(AOTI_GROUPS[group]) - sum(n in FALLBACK for n in AOTI_GROUPS[group])
    runner = torch._inductor.aoti_load_package(path)
    for m in (1, 4, 9):
        x = torch.randn(m, D_IN)
        with torch.no_grad():
            ref = model(x)
        # Bit for bit: inductor's generated C++ for the bias adds and the activation quantization ops matched
        # eager exactly here (and the packed kernels are the same ops).
        assert torch.equal(runner(x), ref), (group, m, (runner(x) - ref).abs().max())


def test_aoti_keeps_the_packed_kernels_in_the_generated_code(aoti_packages):
    # The package's generated C++ calls our op and aten's packed kernels by name (through the proxy executor for
    # ops without a C shim): the dequantize-then-matmul is not what got compiled.
    import zipfile

    # Which ops those are depends on the CPU ("auto" stores int8 weights for _int_mm only where it is fast): every
    # kernel the eager model ran must appear by name.
    path, _, eager_kernels = aoti_packages["activation_quant"]
    with zipfile.ZipFile(path) as z:
        code = "\n".join(z.read(n).decode(errors="replace") for n in z.namelist()
                         if n.endswith((".cpp", ".json")))
    names = {KERNEL_OPS[k]._schema.name for k in eager_kernels if k in KERNEL_OPS}
    assert {"affineq::lowbit_linear", "aten::_scaled_mm"} <= names, names
    for op in names:
        assert op.removeprefix("aten::") in code, op


def test_exported_and_aoti_programs_load_in_a_fresh_process(aoti_packages, tmp_path):
    """Deployment: a process that only imports torch and affineq loads the saved program and the AOTInductor
    package and reproduces the eager outputs bit for bit."""
    path, model, _ = aoti_packages["weight_only"]
    x = torch.randn(5, D_IN)
    with torch.no_grad():
        ref = model(x)
    torch.export.save(export_batch_dynamic(model, x), tmp_path / "weight_only.pt2")
    torch.save({"x": x, "ref": ref}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch
        import affineq  # registers the affineq ops and the tensor subclass the programs use
        io = torch.load({str(tmp_path / 'io.pt')!r})
        ep = torch.export.load({str(tmp_path / 'weight_only.pt2')!r})
        assert torch.equal(ep.module()(io["x"]), io["ref"]), "exported program"
        runner = torch._inductor.aoti_load_package({path!r})
        assert torch.equal(runner(io["x"]), io["ref"]), "AOTInductor package"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_tutorial_05_exports_a_quantized_block():
    """tutorials/05 as a user runs it (SmolLM2's block when the model package is installed, else TinyLM's):
    the loaded program equals eager and its graph holds the packed ops and no float matmul."""
    _skip_without_cpp(["affineq.lowbit_linear"])
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "tutorials" / "05_export_a_quantized_block.py")],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "loaded program equals eager (batch 2 x seq 16, batch 3 x seq 40): True" in out, out
    # 7 linears on our kernels, the ops this CPU's row table picks (`MIN_ROWS`; the ops compare M themselves): 4
    # int4 ones on lowbit_linear (or dequant_linear where it has a threshold, AMX), and the 3 MLP linears (8da4w)
    # on the int8-codes op (its int32 sums) where the build and the table have it, else like the int4 ones after
    # affineq::int8_fake_quant
    ops = collections.Counter()
    dense = "affineq.dequant_linear.default" if DEQUANT_ROWS is not None else "affineq.lowbit_linear.default"
    ops[dense] += 4
    if cpp.int8_codes_built() and INT8_CODES_INT4_ROWS is not None:
        ops["affineq.int8_codes_linear.default"] += 3
    else:
        ops[dense] += 3
        ops["affineq.int8_fake_quant.default"] += 3
    for op, count in ops.items():
        assert f"'{op}': {count}" in out, (op, count, out)
    assert "float matmuls in the graph: none" in out, out
