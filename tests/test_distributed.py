"""Tensor parallelism of quantized weights (affineq.distributed, affineq.tensor.sharding): 2 gloo processes on
127.0.0.1 run every multi-rank check in one spawned group (int4, int8, 8da4w); DCP checkpoints go world 1 -> 2 in
the workers and world 2 -> 1 back in this process."""

from __future__ import annotations

import copy
import datetime
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

import affineq
from affineq.distributed import check_plan, dcp_load, dcp_save, parallelize_quantized
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor import activation
from affineq.tensor.activation import fake_quantize_activation
from affineq.tensor.spec import ActivationQuant

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

WORLD = 2
CONFIGS = {
    "int4": lambda: affineq.Int4WeightOnlyConfig(group_size=64),
    "int8": lambda: affineq.Int8WeightOnlyConfig(),
    "8da4w": lambda: affineq.Int8DynamicActivationInt4WeightConfig(group_size=32),
}

# Every other built-in weight config: (config, max |out - ref| / max |ref|). 1e-5: fp32 summation order only;
# 1e-2: a K-sharded layer on a kernel computing in bf16 (aten int4_cpu; `plain` int8 dynamic weights run as
# weight-only aten._weight_int8pack_mm on the range-reduced input there).
OTHER_CONFIGS = {
    "int4-plain": (lambda: affineq.Int4WeightOnlyConfig(group_size=32, packing_format="plain"), 1e-5),
    "int4-cpu": (lambda: affineq.Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"), 1e-2),
    "int3": (lambda: affineq.IntxWeightOnlyConfig(torch.int3, affineq.PerGroup(32)), 1e-5),
    "int8-dyn": (lambda: affineq.Int8DynamicActivationInt8WeightConfig(packing_format="plain"), 1e-2),
    "int8-dyn-dense": (lambda: affineq.Int8DynamicActivationInt8WeightConfig(packing_format="dense"), 1e-5),
    "fp8": (lambda: affineq.Float8WeightOnlyConfig(), 1e-5),
    "fp8-dyn": (lambda: affineq.Float8DynamicActivationFloat8WeightConfig(), 1e-5),
    "fp4": (lambda: affineq.FPxWeightOnlyConfig(2, 1, group_size=32), 1e-5),
    "mxfp4": (lambda: affineq.MXWeightOnlyConfig("fp4_e2m1"), 1e-5),
    "mx-dyn": (lambda: affineq.MXDynamicActivationMXWeightConfig(), 1e-5),
    "microexp": (lambda: affineq.MicroexpWeightOnlyConfig(), 1e-5),
}


def _model(config: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    return affineq.quantize_(m, CONFIGS[config]())


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 256) * 3


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the order of the K summation (each rank sums half, then an all-reduce adds the halves)."""
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), (out - ref).abs().max().item()


def _worker(rank: int, port: int, tmp: str) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))  # a rank that died fails the other
        _checks(rank, Path(tmp))
        dist.destroy_process_group()
    except BaseException:
        Path(tmp, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _checks(rank: int, tmp: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    x = _input()
    for config in CONFIGS:
        ref_model = _model(config)
        with torch.no_grad():
            ref = ref_model(x)
        full0, full2 = ref_model[0].weight, ref_model[2].weight
        model = parallelize_quantized(_model(config), mesh, _plan())
        w0, w2 = model[0].weight, model[2].weight
        assert isinstance(w0, DTensor) and w0.placements == (Shard(0),) and w2.placements == (Shard(1),)
        assert not w0.requires_grad
        l0, l2 = w0.to_local(), w2.to_local()
        assert isinstance(l0, affineq.AffineQuantizedTensor) and isinstance(l2, affineq.AffineQuantizedTensor)
        assert l0.shape == (256, 256) and l2.shape == (256, 256)
        # about half of the bytes (a per-row int8 scale is kept whole by both column shards: +1.5 %)
        assert 0.5 <= l0.storage_bytes() / full0.storage_bytes() <= 0.5
        assert 0.5 <= l2.storage_bytes() / full2.storage_bytes() <= 0.51
        assert l0.spec.fmt == full0.spec.fmt and l2.spec.fmt == full2.spec.fmt  # still packed for the kernel
        rows, cols = slice(256 * rank, 256 * (rank + 1)), slice(256 * rank, 256 * (rank + 1))
        assert torch.equal(l0.dequantize(), full0.dequantize()[rows])
        assert torch.equal(l2.dequantize(), full2.dequantize()[:, cols])
        with torch.inference_mode(), affineq.record_kernels() as used, affineq.strict_kernels():  # no fallback
            out = model(x)
        assert len(used) == 2, used  # both linears ran a packed kernel on their local shards
        _close(out, ref)
        # full_tensor (all-gather of the stored tensors), distribute_tensor with Replicate (broadcast), from_local
        g2 = w2.full_tensor()
        assert isinstance(g2, affineq.AffineQuantizedTensor) and torch.equal(g2.dequantize(), full2.dequantize())
        rep = distribute_tensor(full0, mesh, [Replicate()]).to_local()
        assert torch.equal(rep, full0)  # same spec and stored bits
        back = DTensor.from_local(l0, mesh, [Shard(0)]).full_tensor()
        assert torch.equal(back, full0)
        # DCP: the world-1 checkpoint (saved by the test process) loads resharded; then save at world 2
        loaded = parallelize_quantized(_model(config), mesh, _plan())
        _scramble(loaded[0].weight.to_local(), loaded[2].weight.to_local())  # so the load has to restore them
        dcp_load(loaded, tmp / f"{config}-w1")
        assert torch.equal(loaded[0].weight.to_local(), l0) and torch.equal(loaded[2].weight.to_local(), l2)
        with torch.no_grad():
            _close(loaded(x), ref)
        dcp_save(model, tmp / f"{config}-w2")
        # plain torch.distributed.checkpoint on the state_dict: world 2 -> 2, world 1 -> 2 (and 2 -> 1 below)
        dcp.save(model.state_dict(), checkpoint_id=str(tmp / f"{config}-plain-w2"))
        for source in ("plain-w2", "plain-w1"):
            loaded = parallelize_quantized(_model(config), mesh, _plan())
            _scramble(loaded[0].weight.to_local(), loaded[2].weight.to_local())
            dcp.load(loaded.state_dict(), checkpoint_id=str(tmp / f"{config}-{source}"))
            assert torch.equal(loaded[0].weight.to_local(), l0) and torch.equal(loaded[2].weight.to_local(), l2)
    _plain_parallelize_module_bound(mesh, x)
    _expert_parallel(mesh, rank)
    for config, (make, tol) in OTHER_CONFIGS.items():
        torch.manual_seed(0)
        ref_model = affineq.quantize_(nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)), make())
        model = parallelize_quantized(copy.deepcopy(ref_model), mesh, _plan())
        with torch.inference_mode():
            ref, out = ref_model(x[..., :128]), model(x[..., :128])
        assert (out - ref).abs().max() <= tol * ref.abs().max(), (config, (out - ref).abs().max())
        for layer in (0, 2):
            full, w = ref_model[layer].weight, model[layer].weight
            limit = 0.53  # per-row qparams: whole in both column shards
            assert w.to_local().storage_bytes() <= limit * full.storage_bytes(), config
            assert torch.equal(w.full_tensor().dequantize(), full.dequantize()), config


def _expert_parallel(mesh, rank: int) -> None:
    """MoE expert weights [E, N, K] sharded by expert (Shard(0)): each rank's shard is a view of its experts'
    stored tensors in the same format (dense), and full_tensor() gathers them back exactly (both layouts: gpt-oss
    stores [E, K, N] views)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from affineq.expert_weights import quantize_expert_weight

    for transposed in (False, True):
        experts = nn.Module()
        torch.manual_seed(0)
        shape = (4, 64, 128) if transposed else (4, 128, 64)
        experts.gate_up_proj = nn.Parameter(torch.randn(shape))
        experts.down_proj = nn.Parameter(torch.randn(4, 64, 64))
        experts.is_transposed = transposed
        full = quantize_expert_weight(affineq.Int4WeightOnlyConfig(group_size=32), experts.gate_up_proj.detach(),
                                      experts)
        shard = distribute_tensor(full, mesh, [Shard(0)])
        local = shard.to_local()
        assert local.spec.fmt == "dense" and torch.equal(local, full[2 * rank:2 * rank + 2])
        gathered = shard.full_tensor()
        assert torch.equal(gathered, full) and gathered.spec == full.spec


def _plain_parallelize_module_bound(mesh, x: torch.Tensor) -> None:
    """torch's own parallelize_module (no range reduction) on 8da4w: the row-wise layer quantizes each rank's slice
    of a token with that slice's range, a sub-range of the token's, so each element's error is at most one step s_t
    of the unsharded per-token quantization, as the unsharded input's is: |out - ref| <= 2 s_t sum_k |W2[n, k]|
    (+ fp32 summation order). The README states this bound."""
    from torch.distributed.tensor.parallel import parallelize_module

    ref_model = _model("8da4w")
    with torch.no_grad():
        h = torch.relu(ref_model[0](x))
        ref = ref_model[2](h)
    model = parallelize_module(_model("8da4w"), mesh, _plan())
    with torch.inference_mode():
        out = model(x)
    step = (h.amax(-1, keepdim=True).clamp(min=0) - h.amin(-1, keepdim=True).clamp(max=0)) / 255
    bound = 2 * step * ref_model[2].weight.dequantize().abs().sum(1) + 1e-5 * ref.abs().max()
    assert bool(((out - ref).abs() <= bound).all()), ((out - ref).abs() / bound).max().item()


def _scramble(*weights) -> None:
    for w in weights:
        w.copy_(w._apply_to_tensors(lambda t: t.flip(0)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_shard_run_gather_and_checkpoint(tmp_path):
    x = _input()
    refs = {}
    for config in CONFIGS:
        model = _model(config)
        with torch.no_grad():
            refs[config] = model(x)
        dcp_save(model, tmp_path / f"{config}-w1")  # world 1: no process group
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / f"{config}-plain-w1"))
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, str(tmp_path))) for rank in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 150
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = [f.read_text() for f in sorted(tmp_path.glob("error*.txt"))]
    assert not errors, "\n".join(errors)
    assert not hung, "a rank did not finish within 150 s"
    assert [p.exitcode for p in procs] == [0] * WORLD
    for config in CONFIGS:  # world 2 -> world 1: the same weights and outputs as the unsharded model
        model, ref_model = _model(config), _model(config)
        _scramble(model[0].weight, model[2].weight)
        dcp_load(model, tmp_path / f"{config}-w2")
        for layer in (0, 2):
            assert torch.equal(model[layer].weight, ref_model[layer].weight)
        with torch.no_grad():
            assert torch.equal(model(x), refs[config])
        plain = _model(config)
        _scramble(plain[0].weight, plain[2].weight)
        if config == "int8":  # per-row scales: the column halves of layer 2 cut its blocks, loaded one at a time
            with pytest.raises(CheckpointException, match="ValueError: .*affineq.dcp_save / affineq.dcp_load"):
                dcp.load(plain.state_dict(), checkpoint_id=str(tmp_path / f"{config}-plain-w2"))
            continue
        dcp.load(plain.state_dict(), checkpoint_id=str(tmp_path / f"{config}-plain-w2"))
        assert torch.equal(plain[0].weight, ref_model[0].weight) and torch.equal(plain[2].weight, ref_model[2].weight)


def test_reduced_ranges_reproduce_unsharded_activation_quantization():
    """A K slice fake-quantized with the whole token's range (what the all-reduce yields) is bit for bit the slice
    of the unsharded fake-quantized input, for the 8da4w (asymmetric) and int8 dynamic (symmetric) schemes."""
    x = torch.randn(5, 64) * torch.linspace(0.1, 4, 64)
    aq_8da4w = ActivationQuant(torch.int8, MappingType.ASYMMETRIC, "per_token", ZeroPointDomain.INT)
    for aq in (aq_8da4w, ActivationQuant(torch.int8, MappingType.SYMMETRIC, "per_token"),
               ActivationQuant(torch.int8, MappingType.SYMMETRIC, "per_tensor")):
        w = affineq.AffineQuantizedTensor.from_spec(torch.randn(8, 32), (1, 32), target=torch.int4,
                                                    mapping_type=MappingType.SYMMETRIC, act_quant=aq)
        per_token = aq.per_token
        lo = x.amin(1, keepdim=True) if per_token else x.amin().view(1, 1)
        hi = x.amax(1, keepdim=True) if per_token else x.amax().view(1, 1)
        token = activation.range_reduce.set(lambda t, op, lo=lo, hi=hi: lo if op == "min" else hi)  # whole token
        try:
            halves = [activation.reduce_input_ranges(x[:, k:k + 32], w) for k in (0, 32)]
        finally:
            activation.range_reduce.reset(token)
        assert all(h[1].spec.act_quant is None for h in halves)  # the kernel must not quantize again
        assert torch.equal(torch.cat([h[0] for h in halves], 1), fake_quantize_activation(x, aq))
        assert activation.reduce_input_ranges(x, w)[1] is w  # no reduction outside a sharded linear


def test_group_straddling_two_ranks_is_a_clear_error():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = nn.Sequential(nn.Linear(256, 192), nn.ReLU(), nn.Linear(192, 256))
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=64, packing_format="plain"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    ok = {"0": ColwiseParallel(), "2": ColwiseParallel()}  # rows: blocks (1, 64) never cut
    assert [(n, d) for n, _, d in check_plan(model, 2, ok)] == [("0", 0), ("2", 0)]
    assert [(n, d) for n, _, d in check_plan(model, 2, {"0": RowwiseParallel()})] == [("0", 1)]  # K 256 -> 128
    with pytest.raises(ValueError, match=r"layer '2': RowwiseParallel .* 96 of the 192 input channels.* 64 wide"):
        check_plan(model, 2, plan)  # K = 192 over 2 ranks cuts the second group of 64
    with pytest.raises(ValueError, match=r"layer '0': ColwiseParallel splits weight dim 0 of size 192 over 5"):
        check_plan(model, 5, {"0": ColwiseParallel()})


def test_copy_into_a_slice_writes_through():
    """What DCP's load does to its target: narrow, detach, copy_; the copied region lands in the sliced tensor."""
    a = affineq.AffineQuantizedTensor.from_spec(torch.randn(32, 128), (1, 32), target=torch.uint4,
                                                mapping_type=MappingType.ASYMMETRIC, packing_format="dense")
    b = affineq.AffineQuantizedTensor.from_spec(torch.randn(32, 128), (1, 32), target=torch.uint4,
                                                mapping_type=MappingType.ASYMMETRIC, packing_format="dense")
    expected = torch.cat([b.dequantize()[:, :64], a.dequantize()[:, 64:]], 1)
    a.view(32, 128).narrow(1, 0, 64).detach().copy_(b[:, :64])
    assert torch.equal(a.dequantize(), expected) and a.spec.fmt == "dense"
    a[16:].copy_(b[16:])
    assert torch.equal(a.dequantize()[16:], b.dequantize()[16:])
    with pytest.raises(ValueError, match="differs within its quantization blocks"):
        a[:, 64:80].copy_(b[:, 64:80])  # cuts groups of 32 that rows 0-15 still hold from `a`
