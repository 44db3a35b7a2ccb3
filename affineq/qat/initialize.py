"""`initialize_fake_quantizers`: fix the qparams of static and range-learned fake quantizers from one batch."""

from __future__ import annotations

import torch
from torch import nn

from affineq.qat.fake_quantizer import FakeQuantizer

__all__ = ["initialize_fake_quantizers"]


def initialize_fake_quantizers(model: nn.Module, example_inputs) -> nn.Module:
    """Run `model` once on `example_inputs` (a tensor: model(x); a tuple: model(*x); a dict: model(**x)) under
    no_grad; every static or range-learned `FakeQuantizer` reached takes its qparams from what it sees
    (weights: min-max of the weight, or the TQT threshold of its init method; activations: of this batch).

    Call it after `QATConfig(..., step="prepare")` and before building the optimizer (it creates the learned
    Parameters). Raises RuntimeError naming the quantizers the forward did not reach."""
    pending = {name: fq for name, fq in model.named_modules()
               if isinstance(fq, FakeQuantizer) and not fq.config.is_dynamic}
    for fq in pending.values():
        fq.pending_init = True
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    finally:
        missed = [name for name, fq in pending.items() if fq.pending_init]
        for fq in pending.values():
            fq.pending_init = False
    if missed:
        raise RuntimeError(f"initialize_fake_quantizers: the forward never reached {missed}; pass example_inputs "
                           "that run every prepared module (or disable those quantizers with .enabled = False)")
    return model
