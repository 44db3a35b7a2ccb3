"""Trace a model with torch.export and find every weight that feeds a linear-like op.

A *weight use* is a node of the exported graph that multiplies an activation by a parameter: aten.linear,
aten.matmul / mm (`x @ W` or `W @ x`), aten.addmm (`b + x @ W`) or aten.conv1d/2d/3d, whose weight input is a
get_attr node (directly, or through `.t()` / `.T` / `transpose(0, 1)`). Each use records the weight in the layout
the configs quantize: nn.Linear's [out, in] (`x @ W` reduces over W's dim 0, so that weight is `W.t()`), or the
conv's [out, in / groups, *kernel]; and a meta-device stub module of the op's type that the config checks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import fx, nn

from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["GraphModeWarning", "WeightUse", "drop_unread", "export_graph", "find_weight_uses", "get_attr_tensor"]

aten = torch.ops.aten
_LINEAR = {aten.linear.default}
_MATMUL = {aten.matmul.default, aten.mm.default}
_ADDMM = {aten.addmm.default}
_CONVS = {aten.conv1d.default: nn.Conv1d, aten.conv2d.default: nn.Conv2d, aten.conv3d.default: nn.Conv3d}
_NO_KERNEL = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}


class GraphModeWarning(UserWarning):
    """A linear-like node that graph mode leaves in float (the message names the node and why)."""


class Warner:
    """`warnings.warn` once per (node, reason) within one prepare / convert call."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, node: fx.Node, reason: str) -> None:
        if (node.name, reason) not in self.seen:
            self.seen.add((node.name, reason))
            warnings.warn(f"affineq.graph: node {node.name!r} ({node.target}) stays float: {reason}",
                          GraphModeWarning, stacklevel=2)


@dataclass
class WeightUse:
    """One linear-like node reading a parameter. `kind`: "linear", "addmm", "matmul_right" (x @ W),
    "matmul_left" (W @ x) or "conv"; `target`: the parameter's attribute name; `transpose`: the weight to quantize
    is the 2-D parameter transposed; `act`: the activation node; `layer`: the name configs resolve (the owning
    nn.Linear / ConvNd when the parameter is its `weight`, else the parameter's own name); `owner`: that module
    (else the stub); `stub`: a meta module of the op's type holding a meta weight of the quantized layout."""

    node: str
    kind: str
    target: str
    transpose: bool
    act: str
    layer: str
    owner: nn.Module
    stub: nn.Module


def export_graph(model: nn.Module, example_inputs: tuple, dynamic_shapes=None) -> fx.GraphModule:
    """`torch.export.export(model, example_inputs, strict=False).module()`: an ATen-level GraphModule whose
    parameters and buffers are attributes read by get_attr nodes (the model itself is not changed)."""
    try:
        ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # export explains untraceable code (data-dependent control flow, ...)
        raise ValueError(f"affineq.graph.prepare: torch.export could not trace the model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); make its forward traceable "
                         "(torch.export docs), or quantize it eagerly with affineq.quantize_") from e
    return ep.module()


def get_attr_tensor(gm: nn.Module, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def drop_unread(gm: fx.GraphModule, targets) -> None:
    """Delete the attributes among `targets` that no get_attr node reads any more (frees replaced tensors)."""
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in set(targets) - read:
        owner, _, name = target.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, name)


def _param_source(gm: fx.GraphModule, node) -> tuple[fx.Node, bool] | None:
    """(the get_attr node, whether the input is its transpose) when `node` reads a 2-D-or-more parameter."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return node, False
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node) \
            or node.args[0].op != "get_attr":
        return None
    src, rest = node.args[0], tuple(node.args[1:])
    if get_attr_tensor(gm, src.target).dim() != 2:
        return None
    if node.target in (aten.t.default, aten.numpy_T.default) or (
            node.target == aten.transpose.int and {d % 2 for d in rest} == {0, 1}) or (
            node.target == aten.permute.default and [d % 2 for d in rest[0]] == [1, 0]):
        return src, True
    return None


def _derived_from_param(node) -> str | None:
    """The op computing `node` when it is a call on a parameter directly (a weight graph mode cannot read)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and any(
            isinstance(a, fx.Node) and a.op == "get_attr" for a in node.args):
        return str(node.target)
    return None


def _stub(kind_cls: type, w_shape: tuple[int, ...], dtype: torch.dtype, groups: int = 1) -> nn.Module:
    if kind_cls is nn.Linear:
        stub = nn.Linear(w_shape[1], w_shape[0], bias=False, device="meta")
    else:
        stub = kind_cls(w_shape[1] * groups, w_shape[0], tuple(w_shape[2:]), groups=groups, bias=False,
                        device="meta")
    stub.weight = nn.Parameter(torch.empty(w_shape, dtype=dtype, device="meta"), requires_grad=False)
    return stub


def _layer(model: nn.Module, target: str, cls: type, stub: nn.Module) -> tuple[str, nn.Module]:
    owner_name, _, pname = target.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        owner = None
    if pname == "weight" and isinstance(owner, cls):
        return owner_name, owner
    return target, stub


def find_weight_uses(gm: fx.GraphModule, model: nn.Module, warn: Warner) -> list[WeightUse]:
    """Every weight use of `gm` (in graph order); linear-like nodes on a parameter it cannot quantize are warned
    about (`warn`) and left out."""
    uses = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = _classify(gm, node, warn)
        if found is None:
            continue
        kind, src, transpose, act, cls, groups = found
        p = get_attr_tensor(gm, src.target)
        if not p.dtype.is_floating_point or isinstance(p, AffineQuantizedTensor):  # nothing (more) to quantize
            continue
        shape = tuple(p.shape)
        if cls is nn.Linear and len(shape) != 2:
            warn(node, f"its parameter {src.target!r} has {len(shape)} dims; only 2-D matmul weights are quantized")
            continue
        shape = (shape[1], shape[0]) if transpose else shape
        stub = _stub(cls, shape, p.dtype, groups)
        layer, owner = _layer(model, src.target, cls, stub)
        uses.append(WeightUse(node.name, kind, src.target, transpose, act.name, layer, owner, stub))
    return uses


def _classify(gm, node, warn):
    """(kind, get_attr node, transpose, activation node, module class, groups) of a weight use, or None."""
    args = node.args
    if node.target in _LINEAR:
        return _one_side(gm, node, warn, "linear", args[0], args[1], flip=False)
    if node.target in _ADDMM:
        alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
        if _param_source(gm, args[2]) is not None and (alpha != 1 or beta != 1):
            warn(node, f"addmm with alpha={alpha}, beta={beta}: only b + x @ W is rewritten to a quantized linear")
            return None
        return _one_side(gm, node, warn, "addmm", args[1], args[2], flip=True)
    if node.target in _MATMUL:
        a, b = _param_source(gm, args[0]), _param_source(gm, args[1])
        if a is not None and b is not None:
            warn(node, "both operands are parameters (a constant product); nothing to quantize at run time")
            return None
        if a is not None:
            return "matmul_left", a[0], a[1], args[1], nn.Linear, 1
        return _one_side(gm, node, warn, "matmul_right", args[0], args[1], flip=True)
    if node.target in _CONVS:
        w = args[1]
        if isinstance(w, fx.Node) and w.op == "get_attr" and isinstance(args[0], fx.Node):
            groups = args[6] if len(args) > 6 else node.kwargs.get("groups", 1)
            return "conv", w, False, args[0], _CONVS[node.target], groups
        if _derived_from_param(w):
            warn(node, f"its weight is computed by {_derived_from_param(w)}, not read from a parameter")
        return None
    if node.target in _NO_KERNEL and _param_source(gm, args[1]) is not None:
        warn(node, "transposed convolutions have no quantized form in affineq")
    return None


def _one_side(gm, node, warn, kind, act, weight, flip):
    """A use whose weight is `weight` (linear layout when not `flip`, else [in, out] as in x @ W)."""
    src = _param_source(gm, weight)
    if src is None:
        if _derived_from_param(weight):
            warn(node, f"its weight is computed by {_derived_from_param(weight)}, not read from a parameter")
        return None
    if not isinstance(act, fx.Node):
        return None
    return kind, src[0], src[1] != flip, act, nn.Linear, 1
