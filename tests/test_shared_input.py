"""Several dense weights on one input in one kernel call: `affineq::lowbit_linear_multi` and
`affineq.tensor.shared_input.shared_input_linear`, against the separate calls (bit for bit: same items, same
order of sums)."""

import pytest
import torch
from torch import nn

import affineq
import affineq.cpp as K
from affineq.tensor.fallback import record_kernels
from affineq.tensor.shared_input import shared_input_linear

needs_cpp = pytest.mark.skipif(not K.is_available(), reason="affineq C++ kernels unavailable")


def _weights(bits: int, gs: int, qdtype: torch.dtype, ns=(64, 48, 130, 512), k: int = 256, offset: bool = True):
    g = torch.Generator().manual_seed(bits * 100 + gs)
    out = []
    for n in ns:
        u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
        scale = (torch.rand(n, k // gs, generator=g) * 0.01 + 1e-3).to(qdtype)
        off = (torch.randn(n, k // gs, generator=g) * 0.01).to(qdtype) if offset else None
        out.append((K.pack_codes(u, bits), scale, off, n))
    return out


@needs_cpp
@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 32), (6, 16), (3, 64), (5, 32)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_multi_equals_separate_calls(bits, gs, qdtype):
    k = 256
    ws = _weights(bits, gs, qdtype)
    for m in (1, 2, 3, 8, 33):  # GEMV rows (one pool of items), then the tile GEMMs (one call per weight)
        for xdtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdtype)
            ref = torch.cat([torch.ops.affineq.lowbit_linear(x, p, s, o, bits, gs, n, k) for p, s, o, n in ws], -1)
            out = torch.ops.affineq.lowbit_linear_multi(x, [w[0] for w in ws], [w[1] for w in ws],
                                                        [w[2] for w in ws], bits, gs, [w[3] for w in ws], k)
            assert out.dtype == ref.dtype == xdtype and torch.equal(out, ref), (m, xdtype)


@needs_cpp
def test_multi_any_thread_count_and_scale_only():
    """Which thread takes which item never changes a number (items of several weights in one pool)."""
    ws = _weights(4, 32, torch.bfloat16, offset=False)
    x = torch.randn(1, 256).bfloat16()
    args = ([w[0] for w in ws], [w[1] for w in ws], [None] * len(ws), 4, 32, [w[3] for w in ws], 256, 0, -8)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(torch.ops.affineq.lowbit_linear_multi(x, *args))
    finally:
        torch.set_num_threads(threads)
    ref = torch.cat([torch.ops.affineq.lowbit_linear(x, p, s, None, 4, 32, n, 256, 0, -8) for p, s, _, n in ws], -1)
    assert all(torch.equal(o, ref) for o in outs)


@needs_cpp
def test_multi_rejects_mismatched_arguments():
    ws = _weights(4, 32, torch.float32, ns=(32, 32))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="one entry per weight"):
        torch.ops.affineq.lowbit_linear_multi(x, [ws[0][0]], [w[1] for w in ws], [w[2] for w in ws], 4, 32,
                                              [32, 32], 256)
    with pytest.raises(RuntimeError, match="same qparam dtype"):
        torch.ops.affineq.lowbit_linear_multi(x, [w[0] for w in ws], [ws[0][1], ws[1][1].bfloat16()],
                                              [ws[0][2], ws[1][2].bfloat16()], 4, 32, [32, 32], 256)
    with pytest.raises(RuntimeError, match="packed must hold"):
        torch.ops.affineq.lowbit_linear_multi(x, [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws], 4, 32,
                                              [32, 48], 256)


def _linears(config, shapes=((96, 64), (32, 64), (32, 64)), bias=False):
    torch.manual_seed(0)
    mods = [nn.Linear(k, n, bias=bias) for n, k in shapes]
    model = nn.Sequential(*mods)
    affineq.quantize_(model, config)
    return mods


@needs_cpp
@pytest.mark.parametrize("bias", [False, True])
def test_shared_input_linear_matches_f_linear(bias):
    mods = _linears(affineq.Int4WeightOnlyConfig(group_size=32), bias=bias)
    f = shared_input_linear([m.weight for m in mods], [m.bias for m in mods])
    assert f is not None
    for x in (torch.randn(1, 64), torch.randn(2, 3, 64).bfloat16(), torch.randn(40, 64)):
        with record_kernels() as names:
            outs = f(x)
        assert names == ["affineq.lowbit_linear"] * 3
        for o, m in zip(outs, mods, strict=True):
            assert torch.equal(o, m(x))


def test_shared_input_linear_declines_what_it_cannot_share():
    int4 = _linears(affineq.Int4WeightOnlyConfig(group_size=32))
    int8 = _linears(affineq.Int8WeightOnlyConfig())
    assert shared_input_linear([int4[0].weight, int8[1].weight], [None, None]) is None  # two configurations
    assert shared_input_linear([int4[0].weight], [None]) is None  # nothing to share
    w8da4w = _linears(affineq.Int8DynamicActivationInt4WeightConfig(group_size=32))
    assert shared_input_linear([m.weight for m in w8da4w], [None] * 3) is None  # activation quantization
    plain = [nn.Linear(64, 32) for _ in range(2)]
    assert shared_input_linear([m.weight for m in plain], [None, None]) is None
