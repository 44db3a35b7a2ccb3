import io

import pytest
import torch

from affineq.tensor import fallback


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts seeded, with no fallback announced yet and strict mode off."""
    torch.manual_seed(0)
    fallback.reset_announcements()
    fallback.set_strict(False)
    yield
    fallback.set_strict(False)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref, approx = ref.double(), approx.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - approx).pow(2).mean()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` (so NaN == NaN and -0.0 != 0.0: bit-identical, not numerically equal)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def snapshot_model(model: torch.nn.Module) -> dict:
    """Everything `assert_unchanged` checks: each parameter and buffer as (object, detached clone) by name
    (tied parameters under every name), and each module object (with its class) by name."""
    return {
        "params": {n: (p, p.detach().clone()) for n, p in model.named_parameters(remove_duplicate=False)},
        "buffers": {n: (b, b.detach().clone()) for n, b in model.named_buffers(remove_duplicate=False)},
        "modules": {n: (m, type(m)) for n, m in model.named_modules(remove_duplicate=False)},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)},
    }


def assert_unchanged(model: torch.nn.Module, snapshot: dict) -> None:
    """Assert `model` holds exactly what `snapshot_model` recorded: the same parameter, buffer and module
    objects under the same names (`is`), each parameter and buffer bit-identical to its recorded value, with
    the same dtype, shape, device and requires_grad, and no module changed class."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    for kind, now in (("params", params), ("buffers", buffers)):
        assert now.keys() == snapshot[kind].keys(), f"{kind} names changed"
        for name, (obj, value) in snapshot[kind].items():
            t = now[name]
            assert t is obj, f"{name}: a different object than before"
            assert t.dtype == value.dtype and t.shape == value.shape, f"{name}: dtype or shape changed"
            assert t.device == value.device, f"{name}: moved to {t.device}"
            if kind == "params":
                assert t.requires_grad == snapshot["requires_grad"][name], f"{name}: requires_grad changed"
            assert torch.equal(_bits(t), _bits(value)), f"{name}: values changed"
    assert modules.keys() == snapshot["modules"].keys(), "module names changed"
    for name, (obj, cls) in snapshot["modules"].items():
        assert modules[name] is obj and type(obj) is cls, f"module {name!r} was replaced or changed class"


class TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight (the tied-weights cases of the reliability tests)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def save_load(obj, weights_only: bool = True):
    """`obj` through torch.save and torch.load (weights_only by default), in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def packed_problem(bits: int, n: int, k: int, gs: int, seed: int = 0):
    """(codes [n, k] uint8, their `affineq.cpp.pack_codes` bytes, fp32 scale and offset [n, k / gs]): a random
    `bits`-bit weight whose groups dequantize around zero."""
    import affineq.cpp as K

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.02 + 0.005
    offset = -scale * (2 ** (bits - 1)) + 0.01 * torch.randn(n, k // gs, generator=g)
    return codes, K.pack_codes(codes, bits), scale, offset


def needs_int8_codes_kernel() -> None:
    """Skip unless the C++ kernels load with the int8-codes kernel (AVX512-VNNI and VBMI builds); a CPU with both
    features must have it."""
    import affineq.cpp as K

    if not K.is_available():
        pytest.skip(f"external: C++ kernels unavailable: {K.unavailable_reason()}")
    if not K.int8_codes_built():
        assert not {"avx512_vnni", "avx512vbmi"} <= cpu_flags(), "the kernel must be built on this CPU"
        pytest.skip("the int8-codes kernel needs AVX512-VNNI and VBMI")


def dispatched_ops():
    """A TorchDispatchMode whose `.ops` lists the aten / affineq ops run inside it, by name ("aten.add")."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    return Ops()


def bf16_compute_pair(make, k: int, n: int, **quantize_kw):
    """(nn.Linear(k, n) quantized with make(compute_dtype=torch.bfloat16), the same linear quantized with make()):
    the same codes and qparams, one computing float32 input in bf16."""
    import copy

    from affineq import quantize_

    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    fast, plain = copy.deepcopy(lin), copy.deepcopy(lin)
    quantize_(fast, make(compute_dtype=torch.bfloat16), **quantize_kw)
    quantize_(plain, make(), **quantize_kw)
    assert fast.weight.spec.compute_dtype is torch.bfloat16 and plain.weight.spec.compute_dtype is None
    assert torch.equal(fast.weight.dequantize(), plain.weight.dequantize())  # same codes and qparams
    return fast, plain


def outlier_tiny_lm() -> torch.nn.Module:
    """A 2-layer TinyLM whose norms scale 4 channels by 20 (activation outliers for AWQ / SmoothQuant)."""
    from affineq.models.tiny import build_tiny_lm

    m = build_tiny_lm(layers=2, dim=64, heads=2, ffn=128)
    with torch.no_grad():
        for layer in m.layers:
            layer.input_layernorm.weight[:4] = 20.0
            layer.post_attention_layernorm.weight[:4] = 20.0
    return m


def static_int8_kernel(rows: int, dtype: torch.dtype = torch.float32) -> str:
    """The kernel a static int8 linear of `rows` input rows runs on this CPU: oneDNN's (VNNI / AMX, from its
    row threshold on) or aten._int_mm's (the rule of `compute_bound._qlinear_common`, whose weight conditions the
    callers' per-channel symmetric int8 weights meet)."""
    from affineq.tensor.compute_bound import exact_int8_gemm, rows_check

    fast = exact_int8_gemm() and rows_check("onednn.qlinear", torch.empty(rows, 1, dtype=dtype)) is None
    return "onednn.qlinear:static" if fast else "aten._int_mm:static"


def random_prompt(b: int = 2, s: int = 7, seed: int = 1, vocab: int = 128) -> torch.Tensor:
    """[b, s] token ids in [0, vocab), seeded."""
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def hf_greedy(model, ids: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' greedy `generate` of exactly n new tokens (the reference generate is compared with)."""
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)


def _weight_only():
    import affineq

    return {"float": None, "int8": lambda: affineq.Int8WeightOnlyConfig(),
            "int4": lambda: affineq.Int4WeightOnlyConfig(group_size=32)}


#: name -> None (float) or a factory of the weight-only config the generate tests quantize with
WEIGHT_ONLY = _weight_only()
