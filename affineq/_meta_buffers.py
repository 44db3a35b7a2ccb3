"""Materialising what a checkpoint does not hold: the non-persistent buffers (rotary `inv_freq`, BERT's
`position_ids`) of a model built on the meta device, computed again on the CPU the way the model's own
initialisation computes them.

A module is materialised by, in order: the model's transformers initialiser (`PreTrainedModel._init_weights`
on that module, which recomputes rotary tables and position ids) or the module's own `reset_parameters`. Only
modules that own no parameter or persistent buffer are re-initialised (an initialiser would overwrite what
the checkpoint filled); each buffer is pre-filled with a sentinel (NaN, or the integer minimum) and must not
hold it afterwards, so an initialiser that skips a buffer is caught instead of leaving `torch.empty` garbage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MetaBufferPlan", "plan_meta_buffers", "meta_tensors"]


@dataclass
class MetaBufferPlan:
    """The modules whose non-persistent buffers are on meta, each with its initialiser."""

    steps: list[tuple[str, nn.Module, Callable[[], None]]]

    def run(self) -> None:
        """Materialise every planned module's meta buffers on the CPU; ValueError naming a buffer the
        initialiser did not fill."""
        for fqn, module, init in self.steps:
            names = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            for n in names:
                module._buffers[n] = _sentinel_like(module._buffers[n])
            with torch.no_grad():
                init()
            unfilled = [n for n in names if _holds_sentinel(module._buffers[n])]
            if unfilled:
                raise ValueError(f"load_quantized: {type(module).__name__} {fqn or '<root>'!r}: its initialiser left "
                                 f"buffers {unfilled} unset; build this model on the CPU, or fill them after loading")


def _sentinel_like(b: torch.Tensor) -> torch.Tensor:
    t = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    if b.dtype.is_floating_point or b.dtype.is_complex:
        return t.fill_(float("nan"))
    if b.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(b.dtype).min)


def _holds_sentinel(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).any())


def _owns_loaded_tensors(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None and n not in module._non_persistent_buffers_set for n, b in module._buffers.items())


def plan_meta_buffers(model: nn.Module) -> tuple[MetaBufferPlan, list[str]]:
    """(plan, names of the meta non-persistent buffers nothing can materialise). Changes nothing."""
    hf_init = getattr(model, "_init_weights", None)
    steps, impossible = [], []
    for fqn, module in model.named_modules():
        names = [n for n, b in module._buffers.items()
                 if b is not None and b.is_meta and n in module._non_persistent_buffers_set]
        if not names:
            continue
        init = None
        if not _owns_loaded_tensors(module):
            if callable(hf_init):
                init = (lambda m=module: hf_init(m))
            elif callable(getattr(module, "reset_parameters", None)):
                init = module.reset_parameters
        if init is None:
            impossible += [f"{fqn}.{n}" if fqn else n for n in names]
        else:
            steps.append((fqn, module, init))
    return MetaBufferPlan(steps), impossible


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of every parameter and buffer of `model` still on the meta device."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [n for n, t in tensors if t.is_meta]
