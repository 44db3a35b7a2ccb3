"""torch.compile's on-disk caches see affineq's dispatch state (affineq.compile_cache): a process that changed a
setting the kernel choice reads gets its own graph, not one an earlier process cached with other kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import affineq
from affineq import compile_cache
from affineq.tensor.compute_bound import set_min_rows

DEQUANT = "affineq.dequant_linear"


@pytest.fixture
def user_tag():
    """A user's own cache_key_tag in front of affineq's part, put back afterwards."""
    saved = torch.compiler.config.cache_key_tag
    torch.compiler.config.cache_key_tag = "mine"
    compile_cache.refresh()
    yield
    torch.compiler.config.cache_key_tag = saved
    compile_cache.refresh()


def _tag() -> str:
    tag = torch.compiler.config.cache_key_tag
    assert tag.startswith("mine|affineq:") and len(tag) == len("mine|affineq:") + 16, tag
    return tag


def test_the_tag_follows_the_row_thresholds(user_tag):
    before = _tag()
    prev = set_min_rows(DEQUANT, "fp32", 1)
    try:
        assert _tag() != before
    finally:
        set_min_rows(DEQUANT, "fp32", prev)
    assert _tag() == before  # None (never) digests as the absent entry it replaced


def test_the_tag_follows_strict_mode_and_the_kernel_switch(user_tag):
    before = _tag()
    with affineq.strict_kernels():
        strict = _tag()
    assert strict != before and _tag() == before
    with affineq.cpp._set_disabled(True):
        off = _tag()
    assert off not in (before, strict) and _tag() == before


def test_the_tag_follows_the_kernel_build_asked_for(user_tag, monkeypatch):
    # a graph cached with the native build may call a kernel another build (AFFINEQ_CPP_MARCH) lacks
    monkeypatch.delenv("AFFINEQ_CPP_MARCH", raising=False)
    compile_cache.refresh()
    native = _tag()
    monkeypatch.setenv("AFFINEQ_CPP_MARCH", "x86-64-v3")
    compile_cache.refresh()
    assert _tag() != native
    monkeypatch.setenv("AFFINEQ_CPP_MARCH", "native")  # the default, spelled out
    compile_cache.refresh()
    assert _tag() == native


_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    from torch._inductor.utils import run_and_get_code
    from affineq import Int4WeightOnlyConfig, quantize_
    from affineq.tensor.compute_bound import set_min_rows
    if sys.argv[1] == "dequant":
        set_min_rows("affineq.dequant_linear", "fp32", 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    quantize_(model, Int4WeightOnlyConfig(group_size=32))
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(model), torch.randn(8, 64))
    code = "\\n".join(code)
    print("dequant_linear" in code, "lowbit_linear" in code)
""")


def test_a_cached_graph_does_not_override_a_later_processs_row_threshold(tmp_path):
    """Before affineq keyed the caches, the second process ran the first one's lowbit_linear graph (an
    AOTAutograd cache hit on the same dynamo graph) although it had set dequant_linear's threshold to 1 row."""
    if not affineq.cpp.is_available():
        pytest.skip(f"external: no C++ kernels here ({affineq.cpp.unavailable_reason()})")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()[-2:]

    assert run("default") == ["False", "True"]
    assert run("dequant") == ["True", "False"]


def test_tracing_refreshes_the_tag(user_tag, monkeypatch):
    """A state read without a setter (the environment's kill switch) is keyed as it is while a graph is traced,
    and a tag the user set since keeps affineq's part."""
    from torch import nn

    from affineq import Int8WeightOnlyConfig, quantize_

    before = _tag()
    model = quantize_(nn.Sequential(nn.Linear(32, 32)), Int8WeightOnlyConfig())
    for env, same in (("1", False), (None, True)):
        if env is None:
            monkeypatch.delenv("AFFINEQ_DISABLE_CPP_KERNELS")
        else:
            monkeypatch.setenv("AFFINEQ_DISABLE_CPP_KERNELS", env)
        torch.compiler.config.cache_key_tag = "mine"
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, fullgraph=True)(torch.randn(2, 32))
        assert (_tag() == before) is same


def test_set_min_rows_warns_when_earlier_graphs_keep_their_kernels():
    """In one process dynamo's cache does not see the thresholds: after a quantized graph was traced, a changed
    threshold says that graph keeps its kernels (and how to recompile it); setting the same value says nothing."""
    import warnings

    from torch import nn

    from affineq import Int8WeightOnlyConfig, quantize_

    model = quantize_(nn.Sequential(nn.Linear(32, 32)), Int8WeightOnlyConfig())
    with torch.no_grad():
        torch.compile(model)(torch.randn(2, 32))
    assert compile_cache.traced_in_this_process()
    with pytest.warns(UserWarning, match=r"keep the kernels they traced; call torch\._dynamo\.reset\(\)"):
        prev = set_min_rows(DEQUANT, "fp32", 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            set_min_rows(DEQUANT, "fp32", 1)  # unchanged: nothing to say
    finally:
        with pytest.warns(UserWarning):
            set_min_rows(DEQUANT, "fp32", prev)
