"""The planner (`affineq.plan`): one config selects the same weights on every route that uses it (issue #29)."""

import pytest
import safetensors.torch
import torch
from torch import nn

import affineq
from affineq.calibration import prepare_, unprepare_
from affineq.plan import FqnToConfig, plan, planned_weights, weight_config
from affineq.streaming import load_quantized, quantize_checkpoint


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.up = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 128)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(128, 16)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            h = block.up(block.q(x) + block.k(x))
            x = x + h[..., :64]
        return self.head(h)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Model().eval()


def _config(base) -> FqnToConfig:
    """An exact name, a regex, an explicit None and the default."""
    return FqnToConfig({"head": affineq.Int8WeightOnlyConfig(), r"re:layers\.1\..*": base, "layers.0.k": None,
                        "_default": base})


# the weights the planner gives `_config(...)`: every linear but layers.0.k (None), the head by name
EXPECTED = {"head.weight", "layers.0.q.weight", "layers.0.up.weight", "layers.1.q.weight", "layers.1.k.weight",
            "layers.1.up.weight"}


def _planned(model, config) -> set[str]:
    steps, problems = plan(model, config, None)
    assert problems == []
    return {f"{s.fqn}.{n}" for s in steps for n in s.config.parameter_names(s.module)}


def test_eager_route_quantizes_what_the_planner_plans():
    config = _config(affineq.Int4WeightOnlyConfig(group_size=32))
    model = _model()
    assert _planned(model, config) == EXPECTED
    affineq.quantize_(model, config)
    assert set(affineq.quantized_weights(model)) == EXPECTED


def test_streaming_routes_quantize_what_the_planner_plans(tmp_path):
    config = _config(affineq.Int4WeightOnlyConfig(group_size=32))
    model = _model()
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(tmp_path / "model.safetensors"))
    out = quantize_checkpoint(tmp_path, tmp_path / "q", config, model=_model)
    assert set(out.quantized) == EXPECTED
    with torch.device("meta"):
        meta = _model()
    load_quantized(meta, tmp_path, config)
    assert set(affineq.quantized_weights(meta)) == EXPECTED
    eager = affineq.quantize_(_model(), config)  # and the same codes as the eager route
    for name, w in affineq.quantized_weights(meta).items():
        e = dict(eager.named_parameters())[name]
        assert all(torch.equal(w.tensors[k], e.tensors[k]) for k in e.tensors), name


def test_calibration_route_observes_what_the_planner_plans():
    config = _config(affineq.Int8StaticActivationInt8WeightConfig())
    model = _model()
    static = {n for n in _planned(model, config) if n != "head.weight"}  # the head's config is weight-only
    prepare_(model, config)
    try:
        observed = {f"{fqn}.weight" for fqn, m in model.named_modules() if hasattr(m, "affineq_input_observer")}
    finally:
        unprepare_(model)
    assert observed == static == EXPECTED - {"head.weight"}


def test_planned_weights_and_weight_config_agree_with_plan():
    """The two planner views routes use (`planned_weights`, `weight_config` per layer) give `plan`'s weights."""
    config = _config(affineq.Int4WeightOnlyConfig(group_size=32))
    model = _model()
    planned, problems = planned_weights(model, config)
    assert problems == [] and set(planned) == EXPECTED
    assert planned["head.weight"] == affineq.Int8WeightOnlyConfig()
    per_layer = {f"{fqn}.weight" for fqn, m in model.named_modules()
                 if "weight" in m._parameters and weight_config(config, fqn, m, f"{fqn}.weight")[0] is not None}
    assert per_layer == EXPECTED


def test_streaming_without_a_model_quantizes_what_the_planner_plans(tmp_path):
    config = _config(affineq.Int4WeightOnlyConfig(group_size=32))
    model = _model()
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(tmp_path / "model.safetensors"))
    out = quantize_checkpoint(tmp_path, tmp_path / "q", config)  # by name: `embed` is an embedding by its name
    assert set(out.quantized) == EXPECTED


def test_graph_route_quantizes_what_the_planner_plans():
    from affineq.graph import convert, prepare
    from affineq.graph.prepare import STATE_ATTR

    config = _config(affineq.Int4WeightOnlyConfig(group_size=32))
    model = _model()
    prepared = prepare(model, config, (torch.randint(0, 16, (2, 8)),))
    chosen = {p.use.target for p in getattr(prepared, STATE_ATTR).planned}
    assert chosen == EXPECTED
    assert len(affineq.quantized_weights(convert(prepared))) == len(EXPECTED)


def test_transformers_on_load_quantizes_what_the_planner_plans(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from affineq.hf import AffineqConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    base = affineq.Int4WeightOnlyConfig(group_size=32)
    config = FqnToConfig({"lm_head": affineq.Int8WeightOnlyConfig(), r"re:model\.layers\.1\..*": base,
                          "model.layers.0.mlp.up_proj": None, "model.layers.0.self_attn.q_proj.weight": base,
                          "_default": base})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=AffineqConfig(
        config, modules_to_not_convert=[]))
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    planned, _ = planned_weights(eager, config)
    assert "model.layers.0.mlp.up_proj.weight" not in planned and "lm_head.weight" in planned
    affineq.quantize_(eager, config)
    assert set(affineq.quantized_weights(loaded)) == set(affineq.quantized_weights(eager)) == set(planned)
    for name, w in affineq.quantized_weights(loaded).items():
        e = affineq.quantized_weights(eager)[name]
        assert w.spec == e.spec and all(torch.equal(w.tensors[k], e.tensors[k]) for k in e.tensors), name


def test_torch_ao_route_quantizes_what_the_planner_plans():
    """quantize_dynamic reads torch.ao's qconfig_spec into an FqnToConfig of exact names the planner runs: a set
    of types selects the layers the planner's default filter selects for the same affineq config."""
    model = _model()
    q = affineq.quantize_dynamic(_model(), {nn.Linear}, dtype=torch.qint8)
    config = affineq.Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")
    planned, _ = planned_weights(model, config)
    assert set(affineq.quantized_weights(q)) == set(planned) == EXPECTED | {"layers.0.k.weight"}
    eager = affineq.quantize_(model, config)
    for name, w in affineq.quantized_weights(q).items():
        e = dict(eager.named_parameters())[name]
        assert all(torch.equal(w.tensors[k], e.tensors[k]) for k in e.tensors), name
