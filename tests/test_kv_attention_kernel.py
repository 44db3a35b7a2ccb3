"""The fast path of affineq::kv_attention (cpp/attention.cpp): query heads of a kv head in blocks of 4, 16 dims of
a slot decoded at a time, softmax chunks of 256 slots folded in slot order. Checked against a float64 reference
built from the dequantized cache, over the shapes that pick its branches: GQA groups of 1-9 heads (blocks of 4 and
a remainder), head sizes 64 / 128 (unrolled) and 80 / 256 (the loop), every supported group layout, slots past one
chunk, padding inside a chunk, whole chunks of padding, several queries with their own positions; and its result
does not depend on the thread count (chunks folded in one order whether run by one item or split over threads);
attention sinks (gpt-oss) in the softmax's denominator."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from affineq import cpp
from affineq.cpp import kv_attention as kva

pytestmark = pytest.mark.skipif(not cpp.is_available(), reason="the affineq C++ kernels do not build here")


def _cache(kind, b, kvh, t, d, gk, gv, gen):
    k = torch.randn(b, kvh, t, d, generator=gen) * 2
    v = torch.randn(b, kvh, t, d, generator=gen) + 0.5
    return (*kva.quantize_kv(k, kind, gk), *kva.quantize_kv(v, kind, gv))


def _reference64(q, kc, ks, vc, vs, pos, valid, sinks=None):
    """float64 attention over the dequantized cache (the values the kernel reads, exactly)."""
    k, v = kva.dequantize_kv(kc, ks).double(), kva.dequantize_kv(vc, vs).double()
    return _attention64(q, k, v, pos, valid, q.shape[-1] ** -0.5, sinks)


def _attention64(q, k, v, pos, valid, scale, sinks=None):
    """float64 softmax attention written out: p_t = exp(s_t - m) / (sum_u exp(s_u - m) + exp(sink - m)) over the
    kept slots (m their largest score), 0 for a query with none."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    keep = ((torch.arange(k.shape[2])[None, None, :] <= pos[None, :, None]) & valid[:, None, :])[:, None]
    scores = ((q.double() @ k.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    if sinks is not None:  # [H] per head or [B, H, S] per query
        sinks = sinks.double().view(1, -1, 1, 1) if sinks.dim() == 1 else sinks.double()[..., None]
        m = torch.maximum(m, sinks)
    e = (scores - m).exp().masked_fill(~keep, 0.0)
    den = e.sum(-1, keepdim=True) + (0.0 if sinks is None else (sinks - m).exp())
    return ((e / den) @ v).nan_to_num(0.0) * keep.any(-1, keepdim=True)


CASES = [  # kind, H, KVH, D, key group, value group, T
    ("int8", 4, 1, 64, 32, 32, 700),
    ("int8", 9, 3, 64, 64, 64, 300),
    ("int8", 6, 1, 128, 16, 32, 520),
    ("int8", 2, 2, 80, 16, 80, 260),
    ("int4", 4, 1, 64, 16, 32, 700),
    ("int4", 6, 2, 128, 32, 64, 300),
    ("int4", 5, 1, 256, 16, 32, 270),
    ("int4", 1, 1, 64, 64, 16, 513),
]


@pytest.mark.parametrize("kind,h,kvh,d,gk,gv,t", CASES)
def test_fast_path_against_a_float64_reference(kind, h, kvh, d, gk, gv, t):
    gen = torch.Generator().manual_seed(h * 1000 + t)
    b, s = 2, 3
    kc, ks, vc, vs = _cache(kind, b, kvh, t, d, gk, gv, gen)
    q = torch.randn(b, h, s, d, generator=gen)
    pos = torch.tensor([t - 1, 255, 256])  # past a chunk, a chunk's last slot, the next chunk's first
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :260] = False  # row 1: a whole chunk of padding and more; its queries at 255 / 256 see no key
    valid[0, 100:140] = False  # padding inside a chunk
    args = (q, kc, ks, vc, vs, pos, valid)
    out = torch.ops.affineq_cpp.kv_attention_path(*args, 0)
    ref = _reference64(*args)
    # fp32 products and sums over up to 700 slots of O(1) values: |err| <= 2e-5 (measured ~1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    assert torch.equal(out[1, :, 1:], torch.zeros(h, 2, d))  # no key: 0, as sdpa
    # the scalar loop (path 1) computes the same attention
    torch.testing.assert_close(out, torch.ops.affineq_cpp.kv_attention_path(*args, 1), rtol=0, atol=2e-5)


def test_result_does_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    kc, ks, vc, vs = _cache("int8", 1, 3, 1100, 64, 32, 32, gen)
    q = torch.randn(1, 9, 2, 64, generator=gen)
    args = (q, kc, ks, vc, vs, torch.tensor([1099, 700]), torch.ones(1, 1100, dtype=torch.bool))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 4):  # 6 (b, kv head, query) items: one item per query, or chunks split over threads
            torch.set_num_threads(n)
            outs.append(torch.ops.affineq.kv_attention(*args))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_nan_query_gives_nan_and_large_scores_stay_finite(kind):
    gen = torch.Generator().manual_seed(5)
    kc, ks, vc, vs = _cache(kind, 1, 1, 300, 64, 32, 32, gen)
    pos, valid = torch.tensor([299]), torch.ones(1, 300, dtype=torch.bool)
    q = torch.randn(1, 2, 1, 64, generator=gen) * 40  # scores in the hundreds: exp of large negative gaps
    q[0, 1, 0, 3] = float("nan")
    out = torch.ops.affineq.kv_attention(q, kc, ks, vc, vs, pos, valid)
    assert out[0, 1].isnan().all()  # as the reference's softmax gives
    torch.testing.assert_close(out[0, 0].double(), _reference64(q, kc, ks, vc, vs, pos, valid)[0, 0], rtol=0,
                               atol=2e-5)


def test_bfloat16_queries_round_the_fp32_result():
    gen = torch.Generator().manual_seed(6)
    kc, ks, vc, vs = _cache("int4", 1, 2, 400, 64, 16, 32, gen)
    q = torch.randn(1, 8, 1, 64, generator=gen).bfloat16()
    args = (q, kc, ks, vc, vs, torch.tensor([399]), torch.ones(1, 400, dtype=torch.bool))
    out = torch.ops.affineq.kv_attention(*args)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.ops.affineq.kv_attention(q.float(), *args[1:]).bfloat16())


@pytest.mark.parametrize("kind,h,kvh,d,gk,gv,t", [CASES[0], CASES[2], CASES[5], CASES[7]])
def test_sinks_join_the_denominator(kind, h, kvh, d, gk, gv, t):
    """gpt-oss' attention sinks: one logit per query head in each softmax's denominator, on the vector path, the
    scalar loop and the float-cache kernel; a query with no key still gives 0; a sink of -inf is no sink."""
    gen = torch.Generator().manual_seed(7 * h + t)
    b = 2
    kc, ks, vc, vs = _cache(kind, b, kvh, t, d, gk, gv, gen)
    q = torch.randn(b, h, 3, d, generator=gen)
    pos = torch.tensor([t - 1, 255, 256])
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :260] = False
    sinks = torch.randn(h, generator=gen) * 3
    sinks[0] = 30.0  # far above every score: that head's output shrinks towards 0
    args = (q, kc, ks, vc, vs, pos, valid)
    ref = _reference64(*args, sinks)
    assert not torch.allclose(ref, _reference64(*args), atol=1e-3)  # the sinks move every head
    for path in (0, 1):
        out = torch.ops.affineq_cpp.kv_attention_path(*args, path, sinks)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
        assert torch.equal(out[1, :, 1:], torch.zeros(h, 2, d))  # no key: 0
    out = torch.ops.affineq.kv_attention_sinks(*args, sinks.bfloat16())  # any float dtype, read as fp32
    torch.testing.assert_close(out.double(), _reference64(*args, sinks.bfloat16().float()), rtol=0, atol=2e-5)
    none = torch.full((h,), float("-inf"))
    assert torch.equal(torch.ops.affineq.kv_attention_sinks(*args, none), torch.ops.affineq.kv_attention(*args))
    torch.testing.assert_close(kva.kv_attention_reference(*args, sinks).double(), ref, rtol=0, atol=2e-5)
    per_query = torch.randn(b, h, 3, generator=gen) * 3  # one sink per query (an int4 cache's shifted logits)
    ref3 = _reference64(*args, per_query)
    for path in (0, 1):
        torch.testing.assert_close(torch.ops.affineq_cpp.kv_attention_path(*args, path, per_query).double(), ref3,
                                   rtol=0, atol=2e-5)
    torch.testing.assert_close(kva.kv_attention_reference(*args, per_query).double(), ref3, rtol=0, atol=2e-5)
    k, v = kva.dequantize_kv(kc, ks), kva.dequantize_kv(vc, vs)  # the same values as a float cache
    if d % 16 == 0:
        out = torch.ops.affineq.float_kv_attention_sinks(q, k, v, pos, valid, d**-0.5, sinks)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
        torch.testing.assert_close(kva.float_kv_attention_reference(q, k, v, pos, valid, d**-0.5, sinks).double(),
                                   ref, rtol=0, atol=2e-5)


def test_sinks_are_checked():
    gen = torch.Generator().manual_seed(8)
    kc, ks, vc, vs = _cache("int8", 1, 2, 20, 64, 32, 32, gen)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    args = (q, kc, ks, vc, vs, torch.tensor([19]), torch.ones(1, 20, dtype=torch.bool))
    msg = r"sinks must be a float CPU tensor \[H\] = \[4\] \(one logit per query head\) or \[B, H, S\] = \[1, 4, 1\]"
    for bad in (torch.zeros(3), torch.zeros(4, 1), torch.zeros(1, 4, 2), torch.zeros(4, dtype=torch.int64)):
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.affineq.kv_attention_sinks(*args, bad)
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.affineq.float_kv_attention_sinks(q, kva.dequantize_kv(kc, ks), kva.dequantize_kv(vc, vs), *args[5:],
                                             0.125, torch.zeros(2))


FLOAT_CASES = [  # H, KVH, D, T
    (4, 1, 64, 700),
    (9, 3, 128, 300),
    (6, 2, 80, 520),
    (5, 5, 16, 260),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kvh,d,t", FLOAT_CASES)
def test_float_cache_kernel_against_a_float64_reference(dtype, h, kvh, d, t):
    """affineq::float_kv_attention (the compiled decoder's float-cache attention): the same fast path over float
    values, logits (q . k) * scale."""
    gen = torch.Generator().manual_seed(d + t)
    k, v = (torch.randn(2, kvh, t, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(2, h, 3, d, generator=gen).to(dtype)
    pos = torch.tensor([t - 1, 255, 256])
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :260] = False
    valid[0, 100:140] = False
    out = torch.ops.affineq.float_kv_attention(q, k, v, pos, valid, 0.37)
    assert out.dtype == dtype
    ref = kva.float_kv_attention_reference(q.double(), k.double(), v.double(), pos, valid, 0.37)
    atol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16 / fp16 output: one rounding of the fp32 result
    torch.testing.assert_close(out.double(), ref, rtol=0 if dtype == torch.float32 else 2**-7, atol=atol)
    assert torch.equal(out[1, :, 1:], torch.zeros(h, 2, d, dtype=dtype))
    if dtype != torch.float32:  # exactly the fp32 computation, rounded once
        assert torch.equal(out, torch.ops.affineq.float_kv_attention(q.float(), k, v, pos, valid, 0.37).to(dtype))


def test_float_cache_kernel_checks_its_arguments():
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    pos, valid = torch.tensor([9]), torch.ones(1, 10, dtype=torch.bool)
    op = torch.ops.affineq.float_kv_attention
    with pytest.raises(RuntimeError, match="v must match k"):
        op(q, k, k.bfloat16(), pos, valid, 0.125)
    with pytest.raises(RuntimeError, match="head size must be a multiple of 16, got 24"):
        op(q[..., :24], k[..., :24], k[..., :24], pos, valid, 0.125)
    with pytest.raises(RuntimeError, match="k must be float32, bfloat16 or float16"):
        op(q, k.to(torch.int8), k.to(torch.int8), pos, valid, 0.125)
    with pytest.raises(RuntimeError, match="KVH dividing H"):
        op(q, torch.randn(1, 3, 10, 64), torch.randn(1, 3, 10, 64), pos, valid, 0.125)
    with pytest.raises(RuntimeError, match=r"pos\[0\] = 10 is outside the cache"):
        op(q, k, k, torch.tensor([10]), valid, 0.125)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["int8", "int4", "bf16", "fp32"]), rep=st.integers(1, 9), kvh=st.integers(1, 3),
       d=st.sampled_from([16, 32, 48, 64, 80, 128]), t=st.integers(1, 600), s=st.integers(1, 3),
       pad=st.integers(0, 40), seed=st.integers(0, 2**16), with_sinks=st.booleans())
def test_fast_path_property(kind, rep, kvh, d, t, s, pad, seed, with_sinks):
    """Any shape the vector path takes (queries per kv head, head size, slots, queries, left padding, with or
    without sinks): the float64 attention over the values it reads, to 2e-5."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, rep * kvh, s, d, generator=gen)
    sinks = torch.randn(rep * kvh, generator=gen) * 2 if with_sinks else None
    pos = torch.randint(0, t, (s,), generator=gen)
    valid = torch.ones(1, t, dtype=torch.bool)
    valid[0, :min(pad, t)] = False
    k, v = torch.randn(1, kvh, t, d, generator=gen), torch.randn(1, kvh, t, d, generator=gen)
    if kind in ("int8", "int4"):
        g = 16 if kind == "int4" or d % 32 else 32  # int4 groups of 16 (keys) / 16 or 32 (values)
        kc, ks = kva.quantize_kv(k, kind, g)
        vc, vs = kva.quantize_kv(v, kind, 32 if d % 32 == 0 else 16)
        args = (q, kc, ks, vc, vs, pos, valid)
        out, ref = torch.ops.affineq_cpp.kv_attention_path(*args, 0, sinks), _reference64(*args, sinks)
    else:
        k, v = (k.bfloat16(), v.bfloat16()) if kind == "bf16" else (k, v)
        op = torch.ops.affineq.float_kv_attention_sinks if with_sinks else torch.ops.affineq.float_kv_attention
        out = op(q, k, v, pos, valid, d**-0.5, *([sinks] if with_sinks else []))
        ref = _attention64(q, k, v, pos, valid, d**-0.5, sinks)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
