"""`prepare`: trace a model, fold BatchNorms, pick each weight's config and insert the static observers.

    prepared = affineq.graph.prepare(model, Int8StaticActivationInt8WeightConfig(), (x,))
    for batch in batches: prepared(batch)          # calibration (static configs only)
    qmodel = affineq.graph.convert(prepared)

Which config a weight gets: a plain config, every weight whose op type it quantizes (`config.modules`: an
nn.Linear-like use for every matmul; convs only for configs that take convs); `FqnToConfig`, by the parameter's
name, else its layer's name (the owning nn.Linear / ConvNd, else the parameter name), regex and "_default" as
in `quantize_`; a `ModelConfig` (Quark's `Config(quant_mode=QuantizationMode.fx_graph_mode)`) by its
`layer_config`, every matmul weight counting as a Linear layer. Each weight's config comes from the planner
(`affineq.plan.weight_config`), the function every route asks. A selected weight the config cannot take (its
`check`) stays float with a `GraphModeWarning` naming the node and why.

Observers (static configs): one on the activation input of each static layer, one on its output with
`quantize_output` (after the ReLU when one follows: linear+relu, conv+bn+relu), and, with a static global config,
one shared by the inputs (and the output) of every `cat` and by the two inputs of every residual `add`. Values in
one group share one observer module, so they get one scale and zero point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from affineq.algorithms import AlgorithmConfig
from affineq.configs import QuantConfig
from affineq.graph.patterns import fold_batch_norms, layer_output, shared_groups
from affineq.graph.trace import Warner, WeightUse, export_graph, find_weight_uses
from affineq.plan import FqnToConfig, ModelConfig, QuantizationError, default_config, handler_for, weight_config
from affineq.quantize import replace_parameters

__all__ = ["GraphPlan", "prepare"]

STATE_ATTR = "_affineq_graph_plan"
OBSERVER_PREFIX = "affineq_observer_"


@dataclass
class Planned:
    """A weight use and its config; for a static config the observer (module name) of its input and of its
    output, and whether the output observer reads the layer's own node (foldable into the weight)."""

    use: WeightUse
    config: QuantConfig
    act_observer: str | None = None
    out_observer: str | None = None
    out_on_node: bool = False


@dataclass
class GraphPlan:
    """What `prepare` decided, read by `convert` (kept on the prepared GraphModule)."""

    planned: list[Planned] = field(default_factory=list)
    observers: list[str] = field(default_factory=list)


def _static(cfg) -> bool:
    return bool(getattr(cfg, "needs_calibration", False))


class _Resolver:
    """The config of each weight use (None: left float), asked of the planner (`affineq.plan.weight_config`,
    as every route asks it), and the global static config for cat / add."""

    def __init__(self, config: QuantConfig) -> None:
        why = config.route_error("graph") if isinstance(config, ModelConfig) else None
        if why is not None:
            raise ValueError(why)
        self.config = config
        self.problems: list[str] = []

    def __call__(self, use: WeightUse) -> QuantConfig | None:
        try:
            cfg, _ = weight_config(self.config, use.layer, use.owner, use.target, by_config_modules=True,
                                   on_stub=True)
        except (QuantizationError, ValueError) as e:  # a ModelConfig that cannot map this layer
            self.problems.append(f"  - {use.layer}: {e}")
            return None
        return cfg

    def static_default(self) -> QuantConfig | None:
        """The config whose observers the cat / add groups use: the global config when it is static."""
        cfg = default_config(self.config)
        return cfg if _static(cfg) else None


def _check_config(cfg: QuantConfig, where: str) -> None:
    if isinstance(cfg, AlgorithmConfig):
        raise ValueError(f"{where}: {type(cfg).__name__} runs on captured layer inputs with affineq.quantize_ "
                         "(eager mode); graph mode takes weight configs: quantize eagerly, or pass its base config")
    if handler_for(cfg) is not replace_parameters:
        raise ValueError(f"{where}: {type(cfg).__name__} swaps modules (its own quantize_ handler); graph mode "
                         "replaces weights only: use affineq.quantize_ for it")
    if cfg.param_names not in (None, ("weight",)):  # graph mode rewrites weight uses; other parameters stay float
        raise ValueError(f"{where}: {type(cfg).__name__}(param_names={cfg.param_names!r}): graph mode quantizes "
                         "each layer's weight only; leave param_names None, or quantize with affineq.quantize_")


def prepare(model: nn.Module, config: QuantConfig, example_inputs, *, dynamic_shapes=None) -> fx.GraphModule:
    """Trace `model` with `torch.export` (non-strict) on `example_inputs` (a tuple of positional inputs, or one
    tensor) and return a GraphModule ready for calibration: BatchNorms folded into the conv / linear before them,
    every quantizable weight assigned its config, observers inserted for static activation configs. Run the
    calibration batches through it (static configs; other configs need none), then `affineq.graph.convert` it.
    `model` is not changed. `dynamic_shapes` is passed to torch.export (without it, calibration batches must
    have the example's shapes). Raises ValueError for a config graph mode cannot run (algorithms, module swaps,
    a Quark Config in eager mode) and QuantizationError for layers a Quark Config cannot resolve."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"affineq.graph.prepare(model, ...): model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(config, QuantConfig):
        raise TypeError(f"affineq.graph.prepare: config must be an affineq config (e.g. Int8WeightOnlyConfig()) or "
                        f"a Quark Config with quant_mode=QuantizationMode.fx_graph_mode, got {config!r}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise ValueError(f"example_inputs must be a tuple of the model's positional inputs (or one tensor), got "
                         f"{type(example_inputs).__name__}; e.g. (torch.randn(8, 64),)")
    resolver = _Resolver(config)
    warn = Warner()
    gm = export_graph(model, tuple(example_inputs), dynamic_shapes)
    if isinstance(getattr(gm, "_guards_fn", None), nn.Module):
        gm._guards_fn = _ExplainedGuards(gm._guards_fn)
    fold_batch_norms(gm, warn)
    uses = find_weight_uses(gm, model, warn)
    _check_names(config, model, uses)
    planned = []
    for use in uses:
        cfg = resolver(use)
        if cfg is None:
            continue
        _check_config(cfg, use.layer)
        why = cfg.check(use.stub)
        if why is not None:
            warn(_node(gm, use.node), why)
            continue
        planned.append(Planned(use, cfg))
    if resolver.problems:
        raise QuantizationError("Config cannot quantize {} layer(s):\n{}\nNothing was prepared.".format(
            len(resolver.problems), "\n".join(resolver.problems)))
    plan = GraphPlan(planned, _insert_observers(gm, planned, resolver.static_default()))
    gm.graph.lint()
    gm.recompile()
    setattr(gm, STATE_ATTR, plan)
    return gm


class _ExplainedGuards(nn.Module):
    """torch.export's input-shape guards of the traced graph, whose bare `AssertionError: Guard failed` becomes a
    ValueError saying how to run inputs of other shapes."""

    def __init__(self, guards: nn.Module) -> None:
        super().__init__()
        self.guards = guards

    def forward(self, *args, **kwargs):
        try:
            return self.guards(*args, **kwargs)
        except AssertionError as e:
            raise ValueError(f"affineq.graph: an input does not have the shape the model was traced with ({e}); "
                             "pass dynamic_shapes to affineq.graph.prepare for dims that vary, e.g. "
                             "dynamic_shapes=({0: torch.export.Dim('batch')},) for the batch size, or give "
                             "inputs of the example_inputs' shapes") from None


def _check_names(config: QuantConfig, model: nn.Module, uses: list[WeightUse]) -> None:
    """FqnToConfig keys must name something (a typo would silently leave a layer float)."""
    if not isinstance(config, FqnToConfig):
        return
    known = {u.target for u in uses} | {u.layer for u in uses} | dict(model.named_modules()).keys() | \
        dict(model.named_parameters()).keys()
    missing = [k for k in config.fqn_to_config if not k.startswith("re:") and k != "_default" and k not in known]
    if missing:
        raise QuantizationError(f"FqnToConfig names modules or parameters the model does not have: {missing}. Use "
                                "names from model.named_modules() / model.named_parameters(), or a 're:' regex key")


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


class _Groups:
    """Union-find over value nodes; each group remembers the first request's (config, is-output)."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}
        self.first: dict[fx.Node, tuple[QuantConfig, bool]] = {}

    def add(self, v: fx.Node, cfg: QuantConfig | None = None, output: bool = False) -> None:
        self.parent.setdefault(v, v)
        if cfg is not None:
            self.first.setdefault(self.find(v), (cfg, output))

    def find(self, v: fx.Node) -> fx.Node:
        while self.parent[v] is not v:
            v = self.parent[v]
        return v

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra
            if rb in self.first:
                self.first.setdefault(ra, self.first.pop(rb))


def _insert_observers(gm: fx.GraphModule, planned: list[Planned], shared_cfg: QuantConfig | None) -> list[str]:
    """Insert the observer call_module nodes (module per group, node per value) and rewire the observed edges;
    returns the observer module names."""
    nodes = {n.name: n for n in gm.graph.nodes}
    groups = _Groups()
    edges: dict[fx.Node, set[fx.Node]] = {}  # value -> users that read it through the observer
    all_users: set[fx.Node] = set()  # values observed on every edge (a layer's quantized output)
    outs: dict[str, fx.Node] = {}  # layer node name -> the value its output observer reads
    for p in planned:
        if not _static(p.config):
            continue
        node, act = nodes[p.use.node], nodes[p.use.act]
        groups.add(act, p.config)
        edges.setdefault(act, set()).add(node)
        if getattr(p.config, "quantize_output", False):
            out = outs[p.use.node] = layer_output(node)
            groups.add(out, p.config, output=True)
            all_users.add(out)
    if shared_cfg is not None:
        for consumer, values in shared_groups(gm):
            for v in values:
                groups.add(v, shared_cfg)
                edges.setdefault(v, set()).add(consumer)
                groups.union(values[0], v)
            if consumer.target != torch.ops.aten.add.Tensor and consumer in groups.parent:
                groups.union(values[0], consumer)  # cat: its output is its inputs' values, one grid
    names: dict[fx.Node, str] = {}
    for v in groups.parent:
        if v not in edges and v not in all_users:
            continue
        root = groups.find(v)
        if root not in names:
            cfg, output = groups.first[root]
            names[root] = f"{OBSERVER_PREFIX}{len(names)}"
            gm.add_submodule(names[root], cfg.make_observer(output=output))
        where = v if v.op != "placeholder" else [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(where):
            obs = gm.graph.call_module(names[root], (v,))
        obs.meta = dict(v.meta)
        if v in all_users:
            v.replace_all_uses_with(obs, delete_user_cb=lambda u, obs=obs: u is not obs)
        else:
            for user in edges[v]:
                user.replace_input_with(v, obs)
    for p in planned:
        if not _static(p.config):
            continue
        node = nodes[p.use.node]
        p.act_observer = names[groups.find(nodes[p.use.act])]
        if p.use.node in outs:
            out = outs[p.use.node]
            p.out_observer, p.out_on_node = names[groups.find(out)], out is node
    return list(names.values())
