"""The planner (`affineq.plan`): one config selects the same weights on every route that uses it (issue #29)."""

import safetensors.torch
import torch
from torch import nn

import affineq
from affineq.calibration import prepare_, unprepare_
from affineq.plan import FqnToConfig, plan
from affineq.streaming import load_quantized, quantize_checkpoint


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.up = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 128)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.emb = nn.Embedding(16, 64)
    m.layers = nn.ModuleList([_Block(), _Block()])
    m.head = nn.Linear(128, 16)
    return m


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
