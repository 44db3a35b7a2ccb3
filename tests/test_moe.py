"""Mixture-of-experts: 3-D expert weights (`affineq.expert_weights`, `affineq.tensor.format_experts`), quantize_ on
transformers 5 experts modules found by parameter layout, and their forward through `grouped_linear`
(`affineq.experts`), on tiny random Mixtral, Qwen3-MoE and gpt-oss models built here (no downloads).

SQNR of the logits against the float model (2 layers, hidden 64, top-2), measured on this machine: int8 per
channel 40.6 / 39.4 / 41.2 dB (Mixtral / Qwen3-MoE / gpt-oss), int4 group 32 17.6 / 16.6 / 18.8 dB; the bounds
below leave >= 4 dB of margin."""

import os

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers' 3-D experts modules need transformers >= 5", allow_module_level=True)

from conftest import _bits, assert_unchanged, save_load, snapshot_model  # noqa: E402
from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import affineq  # noqa: E402
from affineq import AffineQuantizedTensor as AQT  # noqa: E402
from affineq.configs import FPxWeightOnlyConfig, MicroexpWeightOnlyConfig, MXWeightOnlyConfig  # noqa: E402
from affineq.expert_weights import is_expert_module, quantize_expert_weight, stack_experts  # noqa: E402
from affineq.tensor.grouped import GROUPED_KERNEL  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::affineq.KernelFallbackWarning")

_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=64)
ARCHS = {
    "mixtral": lambda impl: MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4,
                                                             num_experts_per_tok=2, experts_implementation=impl,
                                                             **_COMMON)),
    "qwen3_moe": lambda impl: Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                                 num_experts=8, num_experts_per_tok=2,
                                                                 experts_implementation=impl, **_COMMON)),
    "gpt_oss": lambda impl: GptOssForCausalLM(GptOssConfig(intermediate_size=64, num_local_experts=4,
                                                           num_experts_per_tok=2, layer_types=["full_attention"] * 2,
                                                           experts_implementation=impl, **_COMMON)),
}
TOKENS = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))


def _model(arch: str, impl: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    m = ARCHS[arch](impl).eval()
    if arch == "gpt_oss":  # its init leaves the expert biases at zero: give them values, so biases are tested
        with torch.no_grad():
            for e in _experts(m):
                e.gate_up_proj_bias.normal_(0, 0.02)
                e.down_proj_bias.normal_(0, 0.02)
    return m


def _experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_expert_module(m)]


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def _grouped_cpp_built() -> bool:
    from affineq import cpp

    return cpp.is_available()


class _Experts(nn.Module):
    """The parameter layout of transformers' experts modules (is_transposed: gpt-oss's [E, in, out])."""

    def __init__(self, e=3, hidden=64, inter=32, transposed=False):
        super().__init__()
        torch.manual_seed(0)
        up, down = (e, 2 * inter, hidden), (e, hidden, inter)
        if transposed:
            up, down = (e, hidden, 2 * inter), (e, inter, hidden)
        self.gate_up_proj = nn.Parameter(torch.randn(up) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(down) * 0.1)
        self.is_transposed = transposed


# -- the 3-D tensor ------------------------------------------------------------------------------------------

FORMATS = {
    "int4-dense": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="dense"),
    "int8-dense": affineq.Int8WeightOnlyConfig(packing_format="dense"),
    "int3-dense": affineq.IntxWeightOnlyConfig(weight_dtype=torch.int3, packing_format="dense"),
    "int8-plain": affineq.Int8WeightOnlyConfig(group_size=32, packing_format="plain"),
    "int4-int4_cpu": affineq.Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu"),
    "float8-dense": affineq.Float8WeightOnlyConfig(packing_format="dense"),
    "fp6-dense": FPxWeightOnlyConfig(ebits=3, mbits=2, group_size=32),
    "fp4-dense": FPxWeightOnlyConfig(ebits=2, mbits=1, group_size=32),
    "mxfp4-dense": MXWeightOnlyConfig("fp4_e2m1"),
    "mxfp8-dense": MXWeightOnlyConfig(torch.float8_e4m3fn),
    "mx6-microexp": MicroexpWeightOnlyConfig("mx6"),
}


@pytest.mark.parametrize("transposed", [False, True], ids=["NK", "gpt-oss-KN"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_expert_weights_are_per_expert_2d_tensors(name, transposed):
    """Each expert's slice of every stored tensor is exactly that expert quantized alone as a Linear weight; w[e]
    is a view of it; dequantize, torch.save (weights_only) and affineq.safetensors are exact."""
    cfg = FORMATS[name]
    mod = _Experts(transposed=transposed)
    w = mod.gate_up_proj.detach()
    q = quantize_expert_weight(cfg, w, mod)
    assert isinstance(q, AQT) and q.shape == w.shape and q.spec.transposed == transposed
    assert q.spec.shape == (3, 64, 64) and q.spec.block_size[0] == 1
    assert q.spec.fmt == name.split("-")[1]
    per_expert = w.transpose(1, 2) if transposed else w  # [E, N, K]
    deq = q.dequantize()
    for e in range(3):
        ref = cfg.quantize_weight(per_expert[e].contiguous(), nn.Linear(64, 64))
        assert ref.tensors.keys() == q.tensors.keys()
        for n, t in ref.tensors.items():
            assert torch.equal(_bits(getattr(q, "_" + n)[e]), _bits(t)), n
        want = ref.dequantize()
        assert torch.equal(deq[e], want.t() if transposed else want)
        qe = q[e]  # no unpacking: a view of expert e's stored bytes
        assert qe.shape == w[e].shape and qe.spec.fmt == q.spec.fmt
        assert qe._qdata.data_ptr() == q._qdata[e].data_ptr()
        assert torch.equal(qe.dequantize(), deq[e])
    loaded = save_load(q)
    assert torch.equal(loaded, q) and loaded.spec == q.spec
    assert torch.equal(loaded.dequantize(), deq)


def test_expert_weights_safetensors_and_slices(tmp_path):
    mod = _Experts(e=4, transposed=True)
    q = quantize_expert_weight(MXWeightOnlyConfig("fp4_e2m1"), mod.gate_up_proj.detach(), mod)
    affineq.safetensors.save_file({"experts.gate_up_proj": q}, tmp_path / "m.safetensors")
    back = affineq.safetensors.load_file(tmp_path / "m.safetensors")["experts.gate_up_proj"]
    assert torch.equal(back, q) and back.spec == q.spec
    part = q[1:3]
    assert part.shape == (2, *q.shape[1:]) and torch.equal(part.dequantize(), q.dequantize()[1:3])
    assert [torch.equal(u.dequantize(), q.dequantize()[i]) for i, u in enumerate(q.unbind(0))] == [True] * 4
    # what DTensor's Shard(0) (expert parallelism) runs: chunks are views, all-gather's cat joins stored tensors
    chunks = q.chunk(2)
    assert [c.spec.fmt for c in chunks] == ["dense", "dense"] and chunks[1]._qdata.data_ptr() == q._qdata[2].data_ptr()
    joined = torch.cat(chunks)
    assert torch.equal(joined, q) and joined.spec == q.spec


def test_from_spec_on_3d_input_equals_the_stack():
    torch.manual_seed(0)
    w = torch.randn(3, 32, 64)
    kw = dict(target=torch.uint4, packing_format="dense", zero_point_domain=affineq.ZeroPointDomain.FLOAT)
    q = AQT.from_spec(w, (1, 1, 32), affineq.QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False), **kw)
    parts = [AQT.from_spec(w[e], (1, 32), affineq.QParamOptions(scale_dtype=torch.bfloat16, preserve_zero=False),
                           **kw) for e in range(3)]
    assert torch.equal(q, stack_experts(parts))
    with pytest.raises(ValueError, match="block_size must start with 1"):
        AQT.from_spec(w, (3, 1, 32), **kw)


# -- quantize_ on transformers models ------------------------------------------------------------------------

SQNR_BOUNDS = {"int8": (affineq.Int8WeightOnlyConfig(), 35.0), "int4": (affineq.Int4WeightOnlyConfig(group_size=32),
                                                                        12.0)}


@pytest.mark.parametrize("scheme", list(SQNR_BOUNDS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantize_moe_model(arch, scheme):
    """Every expert weight quantized (3-D AffineQuantizedTensors), the experts run through grouped_linear, the
    logits equal transformers' own per-expert loop on the dequantized weights and are close to float."""
    cfg, bound = SQNR_BOUNDS[scheme]
    model = _model(arch)
    ref = _logits(model)
    affineq.quantize_(model, cfg)
    experts = _experts(model)
    assert len(experts) == 2
    for e in experts:
        for n in ("gate_up_proj", "down_proj"):
            p = e._parameters[n]
            assert isinstance(p, AQT) and p.dim() == 3 and p.spec.fmt == "dense", n
    assert model.config._experts_implementation == "affineq"
    with affineq.record_kernels() as kernels:
        out = _logits(model)
    assert kernels.count(GROUPED_KERNEL) == 4  # gate_up and down of 2 layers
    if _grouped_cpp_built():
        assert "dequantize:grouped_linear" not in kernels
    assert _sqnr(ref, out) >= bound

    # independent reference: transformers' eager per-expert loop on the dequantized weights, same model otherwise
    loop = _model(arch, "eager")
    for qm, fm in zip(model.modules(), loop.modules(), strict=True):
        for n, p in qm._parameters.items():
            if isinstance(p, AQT):
                fm._parameters[n] = nn.Parameter(p.dequantize(), requires_grad=False)
    torch.testing.assert_close(out, _logits(loop), rtol=1e-4, atol=1e-4)


def test_int8_dynamic_activation_experts_run_the_grouped_kernel():
    """int8 x int8 dynamic (per token): "auto" stores the experts `dense` (the grouped kernel's layout, same codes)
    and grouped_linear fake-quantizes each routed row; logits measured 38.2 dB vs float."""
    model = _model("mixtral")
    ref = _logits(model)
    affineq.quantize_(model, affineq.Int8DynamicActivationInt8WeightConfig())
    w = _experts(model)[0].down_proj
    assert w.spec.fmt == "dense" and w.spec.act_quant.granularity == affineq.granularity.PerToken()
    with affineq.record_kernels() as kernels:
        out = _logits(model)
    assert kernels.count(GROUPED_KERNEL) == 4 and "dequantize:grouped_linear" not in kernels
    assert _sqnr(ref, out) >= 32.0


def test_bf16_gpt_oss_with_mxfp4_experts():
    """A bf16 gpt-oss with MXFP4 experts (its release format) runs the grouped kernel; logits SQNR vs bf16 float
    measured 12.6 dB (MXFP4 also quantizes the attention and lm_head Linear layers here)."""
    model = _model("gpt_oss").to(torch.bfloat16)
    ref = _logits(model).float()
    affineq.quantize_(model, MXWeightOnlyConfig("fp4_e2m1"))
    w = _experts(model)[0].gate_up_proj
    assert w.dtype == torch.bfloat16 and w.spec.scale_type.name == "e8m0" and w.spec.target.name == "fp4_e2m1"
    with affineq.record_kernels() as kernels:
        out = _logits(model).float()
    assert kernels.count(GROUPED_KERNEL) == 4
    assert _sqnr(ref, out) >= 9.0


def _gpt_oss_experts(cfg) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """gpt-oss's first experts module quantized with `cfg`, and inputs (x, expert ids, routing weights) for it."""
    model = _model("gpt_oss")
    affineq.quantize_(model, cfg)
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 3], [1, 0], [2, 2], [3, 1], [0, 1]])
    return _experts(model)[0], (x, ids, torch.rand(5, 2))


def test_moe_compiled_equals_eager():
    """The quantized experts module (gpt-oss: transposed weights, biases, clamped SwiGLU) under torch.compile."""
    experts, (x, ids, weights) = _gpt_oss_experts(affineq.Int4WeightOnlyConfig(group_size=32))
    with torch.no_grad():
        eager = experts(x, ids, weights)
        torch._dynamo.reset()
        compiled = torch.compile(experts, fullgraph=True)(x, ids, weights)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("second", ["float", "down_proj"])
def test_fqn_to_config_names_experts(second):
    """FqnToConfig names an experts module (all its expert weights) or one expert parameter; a float experts module
    of the same model keeps running transformers' implementation (grouped_mm), a partly quantized one runs
    grouped_linear on its float weight too."""
    model = _model("mixtral")
    names = {"model.layers.0.mlp.experts": affineq.Int8WeightOnlyConfig(), "_default": None}
    if second == "down_proj":
        names["model.layers.1.mlp.experts.down_proj"] = affineq.Int4WeightOnlyConfig(group_size=32)
    affineq.quantize_(model, affineq.FqnToConfig(names))
    first, other = _experts(model)
    assert isinstance(first.gate_up_proj, AQT) and first.gate_up_proj.spec.target.name == "int8"
    assert isinstance(first.down_proj, AQT)
    assert not isinstance(other.gate_up_proj, AQT)
    assert isinstance(other.down_proj, AQT) == (second == "down_proj")
    assert not any(isinstance(m.weight, AQT) for m in model.modules() if isinstance(m, nn.Linear))
    loop = _model("mixtral", "eager")
    for qm, fm in zip(model.modules(), loop.modules(), strict=True):
        for n, p in qm._parameters.items():
            if isinstance(p, AQT):
                fm._parameters[n] = nn.Parameter(p.dequantize(), requires_grad=False)
    with affineq.record_kernels() as kernels:
        out = _logits(model)
    assert kernels.count(GROUPED_KERNEL) == (3 if second == "down_proj" else 2)  # (float gate_up: F.linear)
    torch.testing.assert_close(out, _logits(loop), rtol=1e-4, atol=1e-4)


def test_quantize_moe_all_or_nothing():
    """A config that cannot take the expert weights (group 48 does not divide hidden 64) fails before anything
    changes, naming the experts module; the model is left exactly as it was."""
    model = _model("qwen3_moe")
    snap = snapshot_model(model)
    impl = model.config._experts_implementation
    with pytest.raises(affineq.QuantizationError, match=r"mlp\.experts.*group_size=48"):
        affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=48))
    assert_unchanged(model, snap)
    assert model.config._experts_implementation == impl


# -- save / load through transformers ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_save_pretrained_from_pretrained(arch, tmp_path):
    """save_pretrained / from_pretrained of a quantized MoE model is bit-exact: the expert weights keep their 3-D
    names (transformers' conversion back to per-expert w1 / w3 weights on save is skipped for them); quantize on
    load quantizes the expert weights as quantize_ does, and that model re-saves and loads exactly too."""
    from transformers import AutoModelForCausalLM

    from affineq.hf import AffineqConfig

    def same(a: nn.Module, b: nn.Module) -> None:
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        for n, p in pa.items():
            assert type(pb[n]) is type(p) and torch.equal(pb[n], p), n
        assert b.config._experts_implementation == "affineq"

    cfg = affineq.Int4WeightOnlyConfig(group_size=32)
    model = _model(arch)
    affineq.quantize_(model, cfg)
    ref = _logits(model)
    model.save_pretrained(tmp_path / "q")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    same(model, back)
    assert torch.equal(_logits(back), ref)

    # quantize on load (lm_head stays float on load by default), then save and load that model
    _model(arch).save_pretrained(tmp_path / "f")
    qol = AutoModelForCausalLM.from_pretrained(tmp_path / "f", dtype=torch.float32,
                                               quantization_config=AffineqConfig(cfg)).eval()
    for a, b in zip(_experts(model), _experts(qol), strict=True):
        assert isinstance(b.gate_up_proj, AQT) and torch.equal(a.gate_up_proj, b.gate_up_proj)
        assert isinstance(b.down_proj, AQT) and torch.equal(a.down_proj, b.down_proj)
    qol.save_pretrained(tmp_path / "q2")
    same(qol, AutoModelForCausalLM.from_pretrained(tmp_path / "q2", dtype=torch.float32))


# -- gpt-oss MXFP4 checkpoints -------------------------------------------------------------------------------


def test_gpt_oss_mxfp4_blocks_keep_the_file_codes():
    """Random gpt-oss blocks / scales (every nibble, a range of exponents): the 3-D tensor dequantizes exactly as
    transformers' own MXFP4 dequantization, and gives the same bytes back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from affineq.gpt_oss import mxfp4_from_blocks, mxfp4_to_blocks

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 16, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 16, 2), dtype=torch.uint8, generator=g)
    q = mxfp4_from_blocks(blocks, scales, torch.float32)
    assert q.shape == (3, 64, 16) and q.spec.fmt == "dense" and q.spec.scale_type.name == "e8m0"
    # equal values (affineq's dense fp4 decode gives code 0b1000 as +0.0 where transformers' table has -0.0)
    assert torch.equal(q.dequantize(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    back_blocks, back_scales = mxfp4_to_blocks(q)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)
    with pytest.raises(ValueError, match="scales must be uint8"):
        mxfp4_from_blocks(blocks, scales[:, :, :1])


def test_load_gpt_oss_mxfp4_experts(tmp_path):
    """A gpt-oss-format checkpoint (*_blocks / *_scales) loads into a float model code for code: the parameters
    equal the MXFP4 tensors they were written from, and the logits follow."""
    from safetensors.torch import save_file

    from affineq.gpt_oss import load_mxfp4_experts, mxfp4_to_blocks

    q = _model("gpt_oss")
    affineq.quantize_(q, MXWeightOnlyConfig("fp4_e2m1"), filter_fn=lambda m, fqn: is_expert_module(m))
    files = {}
    for fqn, m in q.named_modules():
        if is_expert_module(m):
            for n in ("gate_up_proj", "down_proj"):
                files[f"{fqn}.{n}_blocks"], files[f"{fqn}.{n}_scales"] = mxfp4_to_blocks(m._parameters[n])
    save_file(files, tmp_path / "model.safetensors")
    model = _model("gpt_oss")
    names = load_mxfp4_experts(model, tmp_path)
    assert len(names) == 4
    for a, b in zip(_experts(q), _experts(model), strict=True):
        assert torch.equal(a.gate_up_proj, b.gate_up_proj) and torch.equal(a.down_proj, b.down_proj)
    assert model.config._experts_implementation == "affineq"
    assert torch.equal(_logits(model), _logits(q))

    small = GptOssForCausalLM(GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                           layer_types=["full_attention"] * 2, **_COMMON))
    before = small.model.layers[0].mlp.experts.gate_up_proj
    with pytest.raises(ValueError, match="holds weights of shape"):
        load_mxfp4_experts(small, tmp_path)
    assert small.model.layers[0].mlp.experts.gate_up_proj is before


def test_quantize_checkpoint_streams_expert_weights(tmp_path):
    """The streaming quantizer (with the model built on meta) quantizes the 3-D expert weights of a float
    checkpoint bit for bit as quantize_ does in memory; load_quantized selects the grouped forward."""
    cfg = affineq.Int4WeightOnlyConfig(group_size=32)
    _model("gpt_oss").save_pretrained(tmp_path / "f")

    def meta():
        with torch.device("meta"):
            return ARCHS["gpt_oss"](None)

    affineq.quantize_checkpoint(tmp_path / "f", tmp_path / "q", cfg, model=meta)
    streamed = affineq.load_quantized(meta(), tmp_path / "q")
    ref = _model("gpt_oss")
    affineq.quantize_(ref, cfg)
    got = dict(streamed.named_parameters())
    for n, p in ref.named_parameters():
        assert type(got[n]) is type(p) and torch.equal(got[n], p), n
    assert isinstance(_experts(streamed)[0].gate_up_proj, AQT)
    assert streamed.config._experts_implementation == "affineq"


# -- algorithms -------------------------------------------------------------------------------------------------


def test_hqq_quantizes_expert_weights():
    """HQQ (calibration-free) runs on each expert's [N, K] weight alone: expert e of the result is hqq_quantize of
    that weight, and the logits are at least as close to float as round-to-nearest's."""
    from affineq.algorithms.hqq import hqq_quantize

    base = affineq.Int4WeightOnlyConfig(group_size=32)
    model = _model("gpt_oss")
    ref = _logits(model)
    affineq.quantize_(model, affineq.HQQConfig(base, progress=False))
    experts = _experts(model)[0]
    assert isinstance(experts.gate_up_proj, AQT) and model.config._experts_implementation == "affineq"
    w = _experts(_model("gpt_oss"))[0].gate_up_proj.detach().transpose(1, 2)  # [E, N, K]
    for e in range(w.shape[0]):
        one = hqq_quantize(w[e].contiguous(), base.weight_spec(w[e], nn.Linear(64, 128)), base.qparam_options())
        assert torch.equal(experts.gate_up_proj[e].dequantize(), one.dequantize().t())
    rtn = _model("gpt_oss")
    affineq.quantize_(rtn, base)
    assert _sqnr(ref, _logits(model)) >= _sqnr(ref, _logits(rtn)) - 0.1


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_gptq_quantizes_expert_weights(arch):
    """GPTQ of each expert with H from the calibration tokens the router sends it: expert e of layer 0's gate_up is
    gptq_quantize(w_e, H_e) for the rows routed to e (recorded here with a hook on the float model), and its output
    error on those rows, sum_e |X_e (Q_e - W_e)^T|^2, is below round-to-nearest's."""
    from affineq.algorithms.gptq import Hessian, gptq_quantize

    base = affineq.Int4WeightOnlyConfig(group_size=32)
    data = [torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    only_experts = lambda m, fqn: is_expert_module(m)  # noqa: E731
    model = _model(arch)
    ref = _logits(model)
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = _experts(model)[0].register_forward_pre_hook(lambda m, args: routed.append((args[0], args[1])))
    for x in data:
        with torch.no_grad():
            model(x)
    hook.remove()
    cfg = affineq.GPTQConfig(base, progress=False)
    affineq.quantize_(model, cfg, filter_fn=only_experts, calibration_data=data)
    q = _experts(model)[0].gate_up_proj
    assert isinstance(q, AQT) and isinstance(_experts(model)[1].down_proj, AQT)
    w = _experts(_model(arch))[0].gate_up_proj.detach()
    w = w.transpose(1, 2) if arch == "gpt_oss" else w
    rtn = _model(arch)
    affineq.quantize_(rtn, base, filter_fn=only_experts)
    rtn_q = _experts(rtn)[0].gate_up_proj
    err_gptq = err_rtn = 0.0
    for e in range(w.shape[0]):
        hs = Hessian(64)
        rows = torch.cat([x[(ids == e).any(-1)] for x, ids in routed])
        for x, ids in routed:
            hs.add(x[(ids == e).any(-1)])
        one, _ = gptq_quantize(w[e].contiguous(), hs.matrix(), base.weight_spec(w[e], nn.Linear(64, 128)),
                               base.qparam_options(), act_order=True, clip_search=True)
        want = one.dequantize()
        got = q[e].dequantize()
        assert torch.equal(got, want.t() if arch == "gpt_oss" else want)
        got, near = (got.t(), rtn_q[e].dequantize().t()) if arch == "gpt_oss" else (got, rtn_q[e].dequantize())
        err_gptq += float((rows @ (got - w[e]).t()).pow(2).sum())
        err_rtn += float((rows @ (near - w[e]).t()).pow(2).sum())
    assert err_gptq < err_rtn
    assert _sqnr(ref, _logits(model)) >= 25.0  # (experts-only int4; held-out logits: GPTQ ~ RTN at this size)


# SQNR of the logits with AWQ int4 g32 experts (experts only), measured: 41.1 / 54.1 / 27.2 dB, bf16 Mixtral 39.7
AWQ_SQNR = {"mixtral": 36.0, "qwen3_moe": 48.0, "gpt_oss": 22.0, "mixtral-bf16": 34.0}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss", "mixtral-bf16"])
def test_awq_quantizes_expert_weights(arch):
    """AWQ of each expert through the router's token assignment: every expert weight quantized, logits within the
    stated SQNR, each decoder layer's output error on the calibration inputs (float inputs of that layer) below
    round-to-nearest's, the shared gate_up scale folded into the post-attention norm (and the router's columns),
    and the down_proj scales folded into the gate_up rows only where the gate makes that exact. bf16: the folds
    hold within the dtype's rounding (`fold_tolerance`), and the logits are at least as close to float as
    round-to-nearest's (a layer's bf16 rounding is as large as the int4 error difference at this size, so the
    per-layer comparison is made in float32 only)."""
    from affineq.algorithms.awq_experts import gate_up_rows

    key, arch, dtype = arch, arch.removesuffix("-bf16"), torch.bfloat16 if arch.endswith("bf16") else torch.float32
    base = affineq.Int4WeightOnlyConfig(group_size=32)
    data = [torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    only_experts = lambda m, fqn: is_expert_module(m)  # noqa: E731
    _typed = lambda: _model(arch).to(dtype)  # noqa: E731
    flt = _typed()
    ref = _logits(flt).float()
    layer_io: list[list] = [[] for _ in flt.model.layers]
    hooks = [layer.register_forward_hook(lambda m, a, kw, o, i=i: layer_io[i].append((a, kw, o)), with_kwargs=True)
             for i, layer in enumerate(flt.model.layers)]
    for x in data:
        with torch.no_grad():
            flt(x, use_cache=False)  # (a cache in the recorded kwargs would grow when the layers run again)
    for h in hooks:
        h.remove()
    model = _typed()
    affineq.quantize_(model, affineq.AWQConfig(base, progress=False), filter_fn=only_experts, calibration_data=data)
    rtn = _typed()
    affineq.quantize_(rtn, base, filter_fn=only_experts)
    for e in _experts(model):
        assert all(isinstance(getattr(e, n), AQT) for n in ("gate_up_proj", "down_proj"))
    assert model.config._experts_implementation == "affineq"
    assert _sqnr(ref, _logits(model).float()) >= AWQ_SQNR[key]
    if dtype == torch.bfloat16:
        assert _sqnr(ref, _logits(model).float()) >= _sqnr(ref, _logits(rtn).float())
        layer_io = []
    for i, io in enumerate(layer_io):
        def err(m, i=i, io=io):
            first = lambda t: t[0] if isinstance(t, tuple) else t  # noqa: E731
            with torch.no_grad():
                return sum(float((first(m.model.layers[i](*a, **kw)) - first(o)).float().pow(2).sum())
                           for a, kw, o in io)
        assert err(model) < err(rtn), i
    norm = model.model.layers[0].post_attention_layernorm.weight
    assert not torch.equal(norm, flt.model.layers[0].post_attention_layernorm.weight)  # the shared scale, folded
    rows = gate_up_rows(_experts(flt)[0])
    if arch == "gpt_oss":  # clamped (up + 1) * glu: no rows scale its output
        assert rows is None
    else:
        assert torch.equal(rows, torch.arange(32 if arch == "qwen3_moe" else 64, 64 if arch == "qwen3_moe" else 128))


@pytest.mark.parametrize("make", [
    lambda: affineq.Int8StaticActivationInt8WeightConfig(),
    lambda: affineq.Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor"),
], ids=["static", "dynamic-per-tensor"])
def test_unsupported_configs_name_the_expert_weights(make):
    """Configs that cannot take expert weights yet say so, naming the experts module, and change nothing."""
    model = _model("mixtral")
    snap = snapshot_model(model)
    with pytest.raises(affineq.QuantizationError, match=r"model\.layers\.0\.mlp\.experts: .*(expert|per tensor)"):
        affineq.quantize_(model, make(), calibration_data=[TOKENS])
    assert_unchanged(model, snap)


@pytest.mark.parametrize("name", ["int8-plain", "int4-int4_cpu", "mx6-microexp", "float8-dynamic"])
def test_moe_on_the_dequantize_fallback_compiles_whole_and_keeps_strict_mode(name):
    """Experts no grouped kernel reads: compiled with fullgraph=True (the routed experts are data; the fallback is
    one opaque op), equal to eager, and strict mode raises while compiling as in eager."""
    experts, (x, ids, weights) = _gpt_oss_experts(FORMATS.get(name)
                                                  or affineq.Float8DynamicActivationFloat8WeightConfig())
    with torch.no_grad():
        eager = experts(x, ids, weights)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(experts, fullgraph=True)(x, ids, weights), eager)
        torch._dynamo.reset()
        with affineq.strict_kernels():
            with pytest.raises(affineq.kernels.KernelFallbackError, match="strict mode"):
                torch.compile(experts)(x, ids, weights)
            torch._dynamo.reset()
            with pytest.raises(Exception, match=r"KernelFallbackError.*strict mode"):  # fullgraph: dynamo wraps it
                torch.compile(experts, fullgraph=True)(x, ids, weights)
