"""Scale migration, shared by AWQ and SmoothQuant: move a per-input-channel scale between a linear's input
and its weight, an identity in exact arithmetic:

    y = x W^T = (x / s) (W * s)^T          s: [in_features], W * s scales the weight's columns

The scaled linears are those that receive the same input tensor (detected on one calibration item: their
forward inputs are the same object). `x / s` is folded into the op that produced x when the model allows it:

- a norm (RMSNorm / LayerNorm: weight and bias divided by s) whose output feeds only those linears (pre-norm
  decoders: Llama's input_layernorm -> q/k/v, post_attention_layernorm -> gate/up);
- the rows of a preceding linear whose output reaches the consumer through channel-wise ops only (a rule
  table: v_proj -> o_proj, up_proj -> down_proj, BERT's value -> attention.output.dense) when shapes match.

Every fold is verified: the block's float output on one calibration input must stay within `tol` (relative)
of its output before; otherwise (e.g. post-norm BERT, whose LayerNorm output also feeds the residual) the
fold is reverted. Where no fold holds, the scale becomes the quantized weight's input pre-scale
(`act_pre_scale = 1 / s`, applied as x * (1 / s) before every matmul) through `PreScaled`, and the float
model is left as it was. Folds assign new Parameters (never in place) so `quantize_` can restore the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from affineq.configs import QuantConfig
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["Group", "PreScaled", "find_groups", "migrate", "output_tensor", "scaled_weight"]

#: consumer name suffix -> producer name (same parent module) whose output rows may absorb 1/s: the paths
#: between them are channel-wise (attention mixes tokens, not channels; SwiGLU multiplies elementwise).
LINEAR_PRODUCERS: dict[str, str] = {
    "o_proj": "v_proj",  # Llama / Mistral / Qwen attention (only when no GQA repetition: shapes must match)
    "out_proj": "v_proj",  # OPT
    "down_proj": "up_proj",  # SwiGLU MLP: silu(gate) * up
    "attention.output.dense": "attention.self.value",  # BERT
}


def _is_norm(m: nn.Module) -> bool:
    name = type(m).__name__
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm"))


@dataclass
class Group:
    """Linears of one block that read the same input. `members`: every nn.Linear reading it {name in
    block: module}; `selected`: the fqns (model names) among them being quantized; `producer`: (name in
    block, module, "norm" | "linear") a fold may go into, or None."""

    members: dict[str, nn.Linear]
    selected: dict[str, nn.Linear]
    producer: tuple[str, nn.Module, str] | None = None


def find_groups(block: nn.Module, prefix: str, layers: dict[str, nn.Module], sample: tuple[tuple, dict]
                ) -> list[Group]:
    """Group the linears of `block` (model name `prefix`, "" for the model itself) by shared input, from
    one run of the block on `sample` ((args, kwargs) it receives). Only groups holding a selected layer of
    `layers` ({fqn: module}) are returned, in the order their inputs were first seen."""
    pre = f"{prefix}." if prefix else ""
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    seen_inputs: list[torch.Tensor] = []  # kept alive so ids stay unique while we compare
    readers: dict[int, list[str]] = {}
    produced: dict[int, str] = {}
    handles = []

    def reader(name):
        def hook(_m, args):
            if args and isinstance(args[0], torch.Tensor):
                x = args[0]
                if not any(x is t for t in seen_inputs):
                    seen_inputs.append(x)
                readers.setdefault(id(x), []).append(name)
        return hook

    def producer(name):
        def hook(_m, _args, out):
            if isinstance(out, torch.Tensor):
                seen_inputs.append(out)
                produced.setdefault(id(out), name)  # forward hooks fire innermost first: keep the innermost
        return hook

    for n, m in block.named_modules():
        if n:
            handles.append(m.register_forward_hook(producer(n)))
    for n, m in linears.items():
        handles.append(m.register_forward_pre_hook(reader(n)))
    try:
        with torch.no_grad():
            args, kwargs = sample
            block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    modules = dict(block.named_modules())
    groups = []
    for key, names in readers.items():
        names = list(dict.fromkeys(names))  # a linear called twice on one tensor counts once
        members = {n: linears[n] for n in names}
        selected = {pre + n: m for n, m in members.items() if pre + n in layers and layers[pre + n] is m}
        if not selected:
            continue
        prod = None
        pname = produced.get(key)
        if pname is not None and _is_norm(modules[pname]) and hasattr(modules[pname], "weight"):
            prod = (pname, modules[pname], "norm")
        elif len(members) == 1:
            prod = _linear_producer(next(iter(members)), next(iter(members.values())), modules)
        groups.append(Group(members, selected, prod))
    return groups


def _linear_producer(name: str, consumer: nn.Linear, modules: dict[str, nn.Module]):
    for suffix, prod in LINEAR_PRODUCERS.items():
        if name == suffix or name.endswith("." + suffix):
            pname = name[: len(name) - len(suffix)] + prod
            m = modules.get(pname)
            if isinstance(m, nn.Linear) and m.out_features == consumer.in_features:
                return (pname, m, "linear")
    return None


def _param(old: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.to(old.dtype), requires_grad=old.requires_grad)


def _float_weight(m: nn.Module) -> bool:
    w = m._parameters.get("weight")
    return w is not None and not isinstance(w, AffineQuantizedTensor) and w.dtype.is_floating_point


def output_tensor(out) -> torch.Tensor:
    """The main tensor of a block's or model's output: itself, the first element of a tuple, or the first
    tensor value of a dict-like output (HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return output_tensor(out[0])
    if isinstance(out, dict):
        return output_tensor(next(v for v in out.values() if isinstance(v, torch.Tensor)))
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


def _rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def migrate(block: nn.Module, group: Group, s: torch.Tensor, sample: tuple[tuple, dict], ref: torch.Tensor,
            tol: float = 1e-4) -> bool:
    """Fold `s` into `group`: producer / s and every member's weight columns * s (new Parameters). Returns
    True when the block's output on `sample` stays within `tol` relative of `ref` (its output before);
    otherwise restores the old Parameters and returns False (the caller stores s as a pre-scale)."""
    if group.producer is None or not all(_float_weight(m) for m in group.members.values()):
        return False
    _, prod, kind = group.producer
    if not _float_weight(prod):
        return False
    saved = [(m, name, m._parameters[name]) for m in (prod, *group.members.values())
             for name in ("weight", "bias") if m._parameters.get(name) is not None]
    s32 = s.float()
    for m in group.members.values():
        m.weight = _param(m.weight, m.weight.float() * s32.to(m.weight.device))
    inv = (1.0 / s32).to(prod.weight.device)
    if kind == "norm":
        prod.weight = _param(prod.weight, prod.weight.float() * inv)
    else:
        prod.weight = _param(prod.weight, prod.weight.float() * inv[:, None])
    if prod._parameters.get("bias") is not None:
        prod.bias = _param(prod.bias, prod.bias.float() * inv)
    with torch.no_grad():
        args, kwargs = sample
        out = output_tensor(block(*args, **kwargs))
    if torch.isfinite(out).all() and _rel_err(ref, out) <= tol:
        return True
    for m, name, p in saved:
        setattr(m, name, p)
    return False


def scaled_weight(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W * s: the weight's columns (input channels) scaled, in the weight's dtype."""
    return (weight.float() * s.float().to(weight.device)).to(weight.dtype)


@dataclass(frozen=True, eq=False)
class PreScaled(QuantConfig):
    """`base` applied to W * s, the quantized weight carrying `act_pre_scale = 1 / s` so the linear
    computes (x / s) (W * s)^T: the migration where no fold holds. The float module is left as it was (the
    model stays an identity for calibration run after the algorithm). A static base (`needs_calibration`)
    gets an observer that sees x / s, the input its quantized linear will receive. Compared by identity
    (the scale is a tensor)."""

    modules: ClassVar = (nn.Linear,)
    base: QuantConfig = None
    scale: torch.Tensor = field(default=None, repr=False)

    @property
    def needs_calibration(self) -> bool:
        return bool(getattr(self.base, "needs_calibration", False))

    @property
    def workflow(self):
        """The base's workflow (a static base calibrates)."""
        return getattr(self.base, "workflow", None)

    def check(self, module: nn.Module) -> str | None:
        return self.base.check(module)

    def weight_spec(self, weight, module):
        return self.base.weight_spec(weight, module)

    def qparam_options(self):
        return self.base.qparam_options()

    def quantize_weight(self, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
        qw = self.base.quantize_weight(scaled_weight(weight, self.scale), module)
        act = {"act_pre_scale": (1.0 / self.scale.float()).to(weight.dtype)}
        aq = qw.act_quant
        if aq is not None and aq.static:
            # a static base is only reached through convert_, whose `Calibrated` wraps this config and
            # replaces these placeholders with the calibrated qparams (a static spec must carry some)
            act["act_scale"] = torch.ones(1, dtype=torch.float32)
            if "act_zero_point" in qw.act_tensors or aq.zero_point_domain.name != "NONE":
                act["act_zero_point"] = torch.zeros(1, dtype=torch.int32)
        return qw.with_act_tensors(**act)

    def make_observer(self) -> nn.Module:
        return _PreScaledObserver(self.base.make_observer(), 1.0 / self.scale.float())


class _PreScaledObserver(nn.Module):
    """An observer fed x * pre_scale (the input the pre-scaled quantized linear will see)."""

    def __init__(self, inner: nn.Module, pre_scale: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("pre_scale", pre_scale.detach().clone())

    @property
    def num_batches(self) -> torch.Tensor:
        return self.inner.num_batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner(x * self.pre_scale.to(x.dtype))
        return x

    def calculate_qparams(self):
        return self.inner.calculate_qparams()


def migrate_blocks(model: nn.Module, layers: dict[str, nn.Module], data: list, make_stats, choose_scale, *,
                   desc: str, progress: bool = True, tol: float = 1e-4
                   ) -> dict[str, tuple[torch.Tensor | None, bool]]:
    """Block by block: group the linears of `layers` by shared input, feed every calibration input of the
    block through `make_stats()` objects (`.update(x)` with x [tokens, in_features], one per group), ask
    `choose_scale(group, stats)` for s [in_features] (or None: leave the group alone), and fold it where a
    fold verifies. Returns {fqn: (s or None, folded)} for every layer of `layers` (layers outside the blocks:
    (None, False)). Runs under no_grad in eval mode (each module's mode restored); the model's float outputs
    are unchanged up to `tol` per fold."""
    result: dict[str, tuple[torch.Tensor | None, bool]] = {f: (None, False) for f in layers}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout would make the fold verification (two runs compared) fail at random
    try:
        _migrate_blocks(model, layers, data, make_stats, choose_scale, desc, progress, tol, result)
    finally:
        for m, training in modes:
            m.training = training
    return result


def _migrate_blocks(model, layers, data, make_stats, choose_scale, desc, progress, tol, result) -> None:
    from affineq.algorithms._capture import blockwise, record_linear_inputs

    with torch.no_grad():
        for prefix, block, inputs in blockwise(model, layers, data, desc, progress):
            groups = find_groups(block, prefix, layers, inputs[0])
            if not groups:
                continue
            reps = {str(i): next(iter(g.members.values())) for i, g in enumerate(groups)}
            stats = {k: make_stats() for k in reps}
            with record_linear_inputs(reps, lambda k, x, stats=stats: stats[k].update(x)):
                for args, kwargs in inputs:
                    block(*args, **kwargs)
            ref = output_tensor(block(*inputs[0][0], **inputs[0][1]))
            for i, g in enumerate(groups):
                s = choose_scale(g, stats[str(i)])
                if s is None:
                    continue
                folded = migrate(block, g, s, inputs[0], ref, tol)
                for fqn in g.selected:
                    result[fqn] = (s, folded)
