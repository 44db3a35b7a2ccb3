"""Module fusion before quantization: BatchNorm folded into the conv / linear before it, and conv+relu /
linear+relu kept together: the patterns `torch.ao.quantization.fuse_modules` fuses in eval mode.

    fuse_modules_(model, [["conv1", "bn1", "relu1"], ["fc", "relu2"]])   # named groups, in place
    fuse_modules_(model)                                                  # every known pattern in nn.Sequential

Folding (eval-mode BatchNorm with running statistics; per output channel c):
    w'[c] = w[c] * gamma[c] / sqrt(var[c] + eps),   b'[c] = (b[c] - mean[c]) * gamma[c] / sqrt(var[c] + eps) + beta[c]
A relu that follows is kept in a fused container (`ConvReLU`, `LinearReLU`: child 0 the conv / linear, child 1
the ReLU), so `quantize_` still finds the conv / linear and the pair stays one unit. The other names of a
group become `nn.Identity`, so the model's attribute names keep working.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["ConvReLU", "LinearReLU", "fold_batch_norm", "fold_bn_tensors", "fuse_modules_"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BNS = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d, nn.Linear: nn.BatchNorm1d}


class ConvReLU(nn.Sequential):
    """A conv (BatchNorm folded in, if any) followed by a ReLU, fused by `fuse_modules_`."""


class LinearReLU(nn.Sequential):
    """A linear (BatchNorm folded in, if any) followed by a ReLU, fused by `fuse_modules_`."""


def fold_bn_tensors(weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.Module
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w', b'): eval-mode `bn` (running statistics) folded into a conv / linear `weight` [out, ...] and `bias`
    [out] (None: zeros), computed in float64 and returned in the weight's dtype (the module docstring's formula).
    `bn` may be any object with BatchNorm's attributes (running_mean, running_var, eps, weight, bias)."""
    with torch.no_grad():
        inv_std = torch.rsqrt(bn.running_var.double() + bn.eps)
        gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(inv_std)
        beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(inv_std)
        factor = gamma * inv_std
        shape = (-1,) + (1,) * (weight.dim() - 1)
        b = bias.double() if bias is not None else torch.zeros_like(inv_std)
        return ((weight.double() * factor.view(shape)).to(weight.dtype),
                ((b - bn.running_mean.double()) * factor + beta).to(weight.dtype))


def fold_batch_norm(layer: nn.Module, bn: nn.Module) -> nn.Module:
    """A copy of `layer` (Conv1d/2d/3d or Linear) with eval-mode `bn` folded into its weight and bias."""
    want = _BNS.get(type(layer))
    if want is None or not isinstance(bn, want):
        raise ValueError(f"cannot fold {type(bn).__name__} into {type(layer).__name__}: supported pairs are "
                         + ", ".join(f"{c.__name__} + {b.__name__}" for c, b in _BNS.items()))
    if bn.training:
        raise ValueError(f"{type(bn).__name__} is in training mode: its batch statistics change every step, so it "
                         "cannot be folded; call model.eval() before fusing")
    if not bn.track_running_stats or bn.running_mean is None:
        raise ValueError(f"{type(bn).__name__} has no running statistics (track_running_stats=False); it cannot "
                         "be folded: remove it or train with running statistics")
    out = copy.deepcopy(layer)
    w, b = fold_bn_tensors(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), bn)
    out.weight = nn.Parameter(w, requires_grad=layer.weight.requires_grad)
    out.bias = nn.Parameter(b)
    return out


def _kind(m: nn.Module) -> str:
    if isinstance(m, _CONVS):
        return "conv"
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return "bn"
    if isinstance(m, nn.ReLU):
        return "relu"
    return "other"


# What torch.ao.quantization.fuse_modules fuses (it has no linear + BatchNorm + ReLU).
_PATTERNS = {("conv", "bn"), ("conv", "bn", "relu"), ("conv", "relu"), ("linear", "bn"), ("linear", "relu")}


def _fuse(mods: list[nn.Module]) -> nn.Module:
    kinds = tuple(_kind(m) for m in mods)
    if kinds not in _PATTERNS:
        raise ValueError(f"cannot fuse {[type(m).__name__ for m in mods]}: supported groups are conv/linear + "
                         "BatchNorm, conv/linear + ReLU and conv + BatchNorm + ReLU (in that order, as torch.ao)")
    layer = fold_batch_norm(mods[0], mods[1]) if kinds[1] == "bn" else mods[0]
    if kinds[-1] == "relu":
        return (ConvReLU if kinds[0] == "conv" else LinearReLU)(layer, mods[-1])
    return layer


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _auto_groups(model: nn.Module) -> list[list[str]]:
    """Adjacent fusable runs inside every nn.Sequential (longest pattern first)."""
    groups = []
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential) or isinstance(seq, (ConvReLU, LinearReLU)):
            continue
        names = list(seq._modules)
        i = 0
        while i < len(names):
            for n in (3, 2):
                run = names[i:i + n]
                if len(run) == n and tuple(_kind(seq._modules[k]) for k in run) in _PATTERNS:
                    if "bn" in [_kind(seq._modules[k]) for k in run] and seq._modules[run[1]].training:
                        continue  # training-mode BatchNorm: leave it (fuse explicitly to get the error)
                    groups.append([f"{prefix}.{k}" if prefix else k for k in run])
                    i += n - 1
                    break
            i += 1
    return groups


def fuse_modules_(model: nn.Module, groups: list[list[str]] | None = None) -> list[list[str]]:
    """Fuse `groups` of module names in place (None: every known pattern of adjacent modules inside an
    nn.Sequential) and return the groups fused. All or nothing: every group is checked and fused before the
    model changes. Raises ValueError naming the group for an unknown name, an unsupported pattern, a
    BatchNorm in training mode, or a module named in two groups."""
    if groups is None:
        groups = _auto_groups(model)
    groups = list(groups)  # walked twice (checks, then fusion): a generator would be used up by the checks
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}  # module name -> index of the first group naming it
    for i, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or len(group) < 2 or not all(isinstance(n, str) for n in group):
            raise ValueError(f"each group must be a list of two or three module names, got {group!r}")
        # each group's fusion replaces its modules; a module in two groups would be fused twice, the first
        # result silently overwritten (a folded BatchNorm lost), so overlapping groups are refused up front
        for name in group:
            j = owner.setdefault(name, i)
            if j != i:
                raise ValueError(f"fuse_modules_: module {name!r} is in two groups, {list(groups[j])} and "
                                 f"{list(group)}; each module can be fused once: pass disjoint groups, e.g. one "
                                 "group of three for conv + BatchNorm + ReLU")
    fused = []
    for group in groups:
        missing = [n for n in group if n not in modules]
        if missing:
            raise ValueError(f"fuse_modules_: the model has no modules {missing} (group {group}); names are those "
                             "of model.named_modules()")
        try:
            fused.append((group, _fuse([modules[n] for n in group])))
        except ValueError as e:
            raise ValueError(f"fuse_modules_: group {list(group)}: {e}") from None
    for group, module in fused:
        _set(model, group[0], module)
        for name in group[1:]:
            _set(model, name, nn.Identity())
    return [list(g) for g, _ in fused]
