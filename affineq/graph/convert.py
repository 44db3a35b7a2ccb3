"""`convert`: put AffineQuantizedTensors in place of the prepared weights and replace the observers.

Each weight is quantized once per layout (a parameter used by several nodes shares one AffineQuantizedTensor;
with a static config each node gets its own activation tensors over the same stored codes). Nodes are
rewritten so that affineq's kernels run: `x @ W` and `b + x @ W` (addmm) become `aten.linear(x, Wq)` with
Wq = quantize(W.t()) in nn.Linear's [out, in] layout, `W @ x` becomes `linear(x.mT, Wq).mT`; linear and conv
nodes just read Wq. An observer whose readers are all static quantized layers is folded into their weights
(`act_scale` / `act_zero_point`, and `act_out_scale` for an output read right at the layer); otherwise it
becomes a `QuantDequant` node: dequantize(quantize(x)) with the calibrated qparams, the numbers of a static
int8 tensor between ops (cat inputs, residual adds, the output of a layer after its ReLU).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from affineq.calibration import Calibrated, first_value
from affineq.granularity import PerTensor
from affineq.graph.prepare import STATE_ATTR, GraphPlan, Planned, _static
from affineq.graph.trace import Warner, drop_unread, get_attr_tensor
from affineq.quantize import QuantizationError
from affineq.tensor.activation import fake_quantize_static
from affineq.tensor.spec import ActivationQuant

__all__ = ["QuantDequant", "convert"]

aten = torch.ops.aten


class QuantDequant(nn.Module):
    """Static fake quantization of an activation with calibrated per-tensor qparams:
    x -> (clamp(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale, in x's shape and dtype
    (`affineq.tensor.activation.fake_quantize_static`, what a static quantized linear does to its input)."""

    def __init__(self, act_quant: ActivationQuant, scale: float, zero_point: int | None) -> None:
        super().__init__()
        self.act_quant = act_quant
        self.register_buffer("scale", torch.tensor([scale], dtype=torch.float32))
        self.register_buffer("zero_point", None if zero_point is None else torch.tensor([zero_point],
                                                                                        dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_static(x, self.act_quant, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        zp = None if self.zero_point is None else int(self.zero_point)
        return f"dtype={self.act_quant.dtype.name}, scale={float(self.scale):.6g}, zero_point={zp}"


def _qparams(gm: fx.GraphModule, plan: GraphPlan) -> dict[str, tuple[float, int | None, nn.Module]]:
    out = {}
    for name in plan.observers:
        obs = gm.get_submodule(name)
        if int(obs.num_batches) == 0:
            raise QuantizationError(f"affineq.graph.convert: observer {name!r} (reading "
                                    f"{_observed_value(gm, name)!r}) saw no data; run calibration batches through "
                                    "the prepared module (prepared(batch)) before convert")
        scale, zp = obs.calculate_qparams()
        out[name] = (first_value(scale), first_value(zp), obs)
    return out


def _observed_value(gm: fx.GraphModule, name: str) -> str:
    return next((str(n.args[0]) for n in gm.graph.nodes if n.op == "call_module" and n.target == name), "?")


def convert(prepared: fx.GraphModule) -> fx.GraphModule:
    """Quantize the weights `affineq.graph.prepare` selected (with the calibrated qparams of static configs)
    and replace its observers; returns `prepared`, changed in place, as a GraphModule whose quantized layers run
    affineq's kernels (`affineq.record_kernels` lists them). QuantizationError (nothing changed) when an observer
    saw no calibration data; a weight that fails to quantize stays float with a `GraphModeWarning`."""
    plan = getattr(prepared, STATE_ATTR, None) if isinstance(prepared, fx.GraphModule) else None
    if plan is None:
        raise ValueError("affineq.graph.convert(prepared): prepared must be the GraphModule affineq.graph.prepare "
                         "returned (not yet converted); call prepare(model, config, example_inputs) first")
    gm, warn = prepared, Warner()
    qparams = _qparams(gm, plan)
    nodes = {n.name: n for n in gm.graph.nodes}
    weights: dict[tuple[str, bool], torch.Tensor] = {}  # (parameter, transposed) -> its quantized tensor
    folded_in: dict[str, set[fx.Node]] = {}  # observer -> nodes whose weight applies its qparams to their input
    folded_out: dict[str, set[fx.Node]] = {}  # observer -> layer outputs the kernel already quantized with them
    for p in plan.planned:
        node, use = nodes[p.use.node], p.use
        try:
            attr = _quantized_attr(gm, p, weights, qparams)
        except Exception as e:  # never crash the conversion: this node stays float and says why
            warn(node, f"quantizing {use.target!r} with {type(p.config).__name__} failed: {e}")
            continue
        reader, out = _rewrite(gm, node, use.kind, attr)
        if _static(p.config):
            folded_in.setdefault(p.act_observer, set()).add(reader)
            if p.out_on_node:
                folded_out.setdefault(p.out_observer, set()).add(out)
    _replace_observers(gm, qparams, folded_in, folded_out)
    drop_unread(gm, {t for t, _ in weights})  # the float weights the quantized ones replace
    delattr(gm, STATE_ATTR)
    gm.graph.lint()
    gm.recompile()
    return gm


def _register(gm: fx.GraphModule, name: str, value: torch.Tensor) -> str:
    gm.register_parameter(name, nn.Parameter(value, requires_grad=False))
    return name


def _quantized_attr(gm, p: Planned, weights: dict, qparams: dict) -> str:
    """The attribute holding this use's quantized weight (made once per parameter and layout)."""
    use = p.use
    key = (use.target, use.transpose)
    name = "affineq_q_" + use.target.replace(".", "_") + ("_t" if use.transpose else "")
    if key not in weights:
        w = get_attr_tensor(gm, use.target).detach()
        weights[key] = p.config.quantize_weight(w.t().contiguous() if use.transpose else w, use.stub)
    if not _static(p.config):
        if not hasattr(gm, name):
            _register(gm, name, weights[key])
        return name
    scale, zp, _ = qparams[p.act_observer]
    out_scale, out_zp = qparams[p.out_observer][:2] if p.out_on_node else (None, None)
    calibrated = Calibrated(base=p.config, act_scale=scale, act_zero_point=zp, out_scale=out_scale,
                             out_zero_point=out_zp)
    return _register(gm, f"{name}_{use.node}", calibrated.attach(weights[key]))


def _rewrite(gm: fx.GraphModule, node: fx.Node, kind: str, attr: str) -> tuple[fx.Node, fx.Node]:
    """Point `node` at the quantized weight `attr` (rewriting matmuls to linear); returns (the node that reads
    the activation, the node that now gives the layer's output)."""
    g = gm.graph
    with g.inserting_before(node):
        wq = g.get_attr(attr)
        old_w = node.args[0] if kind == "matmul_left" else node.args[2] if kind == "addmm" else node.args[1]
        if kind in ("linear", "conv"):
            node.args = (node.args[0], wq, *node.args[2:])
            new = reader = node
        elif kind == "matmul_right":
            new = reader = g.call_function(aten.linear.default, (node.args[0], wq))
        elif kind == "addmm":
            new = reader = g.call_function(aten.linear.default, (node.args[1], wq, node.args[0]))
        else:  # W @ x = (x^T @ W^T)^T = linear(x^T, W)^T; a vector x needs no transpose
            x = node.args[1]
            if x.meta["val"].dim() == 1:
                new = reader = g.call_function(aten.linear.default, (x, wq))
            else:
                reader = g.call_function(aten.transpose.int, (x, -1, -2))
                y = g.call_function(aten.linear.default, (reader, wq))
                new = g.call_function(aten.transpose.int, (y, -1, -2))
    if new is not node:
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    while isinstance(old_w, fx.Node) and not old_w.users:  # the float weight (and its .t()) now unread
        nxt = old_w.args[0] if old_w.op == "call_function" else None
        g.erase_node(old_w)
        old_w = nxt
    return reader, new


def _replace_observers(gm: fx.GraphModule, qparams: dict, folded_in: dict, folded_out: dict) -> None:
    fq: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.target not in qparams:
            continue
        name, value = node.target, node.args[0]
        for user in list(node.users):
            if user in folded_in.get(name, ()):
                user.replace_input_with(node, value)  # the layer's weight quantizes its input itself
        if value in folded_out.get(name, ()):
            node.replace_all_uses_with(value)  # the kernel already returned the quantized output
        if not node.users:
            gm.graph.erase_node(node)
            continue
        if name not in fq:
            scale, zp, obs = qparams[name]
            aq = ActivationQuant(obs.dtype, obs.mapping_type, PerTensor(), obs.zero_point_domain, static=True)
            fq[name] = name.replace("observer", "quant_dequant")
            gm.add_submodule(fq[name], QuantDequant(aq, scale, zp))
        node.target = fq[name]
    for name in qparams:
        gm.delete_submodule(name)
