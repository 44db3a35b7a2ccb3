"""Graph patterns: BatchNorm folded into the conv / linear before it, the ReLU that ends a layer, and the
values whose static qparams must be shared (`cat` inputs and output, the two inputs of a residual `add`).

BatchNorm folding uses `affineq.fusion.fold_bn_tensors` (the eager `fuse_modules_` math), so graph mode and
eager mode fold to the same numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import fx, nn

from affineq.fusion import fold_bn_tensors
from affineq.graph.trace import Warner, drop_unread, get_attr_tensor

__all__ = ["fold_batch_norms", "layer_output", "shared_groups"]

aten = torch.ops.aten
_FOLDS_INTO = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.linear.default}
_RELUS = {aten.relu.default, aten.relu_.default}
_CAT = {aten.cat.default, aten.concat.default}
_ADD = {aten.add.Tensor}


def _set_param(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    owner_name, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    if name in owner.__dict__ or name in owner._buffers:
        delattr(owner, name)
    owner.register_parameter(name, nn.Parameter(value, requires_grad=False))


def _only_attr(node) -> bool:
    """`node` reads a tensor attribute and nothing else reads it through this node."""
    return isinstance(node, fx.Node) and node.op == "get_attr" and len(node.users) == 1


def fold_batch_norms(gm: fx.GraphModule, warn: Warner) -> int:
    """Fold every eval-mode batch_norm whose input is a conv / linear on its own parameters (used nowhere else)
    into that weight and bias, and remove the batch_norm node. Returns how many were folded."""
    folded = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target != aten.batch_norm.default:
            continue
        layer = bn.args[0]
        if not (isinstance(layer, fx.Node) and layer.op == "call_function" and layer.target in _FOLDS_INTO):
            continue
        if bool(bn.args[5]):
            warn(bn, "BatchNorm in training mode (or with track_running_stats=False) normalizes with batch "
                     "statistics and cannot be folded; call model.eval() before affineq.graph.prepare")
            continue
        w_node, b_node = layer.args[1], layer.args[2] if len(layer.args) > 2 else None
        stats = bn.args[1:5]
        if len(layer.users) != 1 or not _only_attr(w_node) or not (b_node is None or _only_attr(b_node)) or \
                not all(s is None or (isinstance(s, fx.Node) and s.op == "get_attr") for s in stats):
            warn(bn, f"not folded into {layer.name!r}: its parameters are shared with other nodes or computed")
            continue
        if stats[2] is None or stats[3] is None:
            warn(bn, "BatchNorm without running statistics (track_running_stats=False) normalizes with batch "
                     "statistics and cannot be folded")
            continue
        eps = bn.args[7]
        gamma, beta, mean, var = (None if s is None else get_attr_tensor(gm, s.target) for s in stats)
        stat = SimpleNamespace(weight=gamma, bias=beta, running_mean=mean, running_var=var, eps=eps)
        owner = w_node.target.rpartition(".")[0]
        b_target = b_node.target if b_node is not None else (f"{owner}." if owner else "") + "bias_bn_folded"
        w, b = fold_bn_tensors(get_attr_tensor(gm, w_node.target).detach(),
                               None if b_node is None else get_attr_tensor(gm, b_node.target).detach(), stat)
        _set_param(gm, w_node.target, w)
        _set_param(gm, b_target, b)
        if b_node is None:
            with gm.graph.inserting_before(layer):
                b_node = gm.graph.get_attr(b_target)
            layer.args = (*layer.args[:2], b_node, *layer.args[3:]) if len(layer.args) > 2 else (*layer.args, b_node)
        bn.replace_all_uses_with(layer)
        gm.graph.erase_node(bn)
        for s in stats:
            if isinstance(s, fx.Node) and not s.users:
                gm.graph.erase_node(s)
        drop_unread(gm, [s.target for s in stats if isinstance(s, fx.Node)])
        folded += 1
    return folded


def layer_output(node: fx.Node) -> fx.Node:
    """The node a layer's output is read from: the ReLU that is the layer's only user (linear+relu,
    conv(+bn)+relu are one unit, so the output is quantized after the ReLU), else the node itself."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _RELUS:
        return users[0]
    return node


def _is_activation(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(node, fx.Node) and node.op not in ("get_attr", "output") and isinstance(val, torch.Tensor) \
        and val.dtype.is_floating_point


def shared_groups(gm: fx.GraphModule) -> list[tuple[fx.Node, list[fx.Node]]]:
    """(consumer, values) for every `cat` (inputs; its output shares the group too) and residual `add` (two
    activation inputs) whose inputs are all float activations: those values share one static qparams."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _CAT:
            values = list(dict.fromkeys(node.args[0]))
        elif node.target in _ADD and node.kwargs.get("alpha", 1) == 1:
            values = list(dict.fromkeys(a for a in node.args[:2]))
        else:
            continue
        if len(values) >= 2 and all(_is_activation(v) for v in values):
            out.append((node, values))
    return out
