"""Calibration plumbing the algorithms share: find the repeated blocks (transformer layers) that hold the
selected linears, capture a block's inputs, and record the inputs that reach given linears (a calibration item
becomes a model call through `affineq.model_inputs`).

Block-wise algorithms (GPTQ) keep one block's activations in memory: the inputs of the first block are
captured once (the model stops there), then each block runs on them and its outputs feed the next block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from affineq.model_inputs import as_call, call_model, describe_item, progress


def find_blocks(model: nn.Module, fqns: Iterable[str]) -> tuple[str, list[nn.Module]] | None:
    """(name, blocks) of the nn.ModuleList whose children hold the most of the linears `fqns` (the decoder
    layers of a transformer), or None when no ModuleList holds any (then the whole model is one block)."""
    fqns = list(fqns)
    best, best_count = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        prefix = f"{name}." if name else ""
        count = sum(1 for f in fqns if f.startswith(prefix) and f[len(prefix):].split(".")[0].isdigit())
        if count > best_count:
            best, best_count = (name, list(m)), count
    return best


class Stop(Exception):
    """Raised by a hook to end a forward early (the rest of the model is not needed)."""


def capture_inputs(model: nn.Module, module: nn.Module, data: list) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) `module` receives for each calibration item; the model stops at `module`."""
    captured: list[tuple[tuple, dict]] = []

    def hook(_mod, args, kwargs):
        captured.append((args, kwargs))
        raise Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for i, item in enumerate(data):
                try:
                    call_model(model, item, i)
                except Stop:
                    pass
                except Exception as e:  # name the item: the model's own error is about tensor sizes
                    raise ValueError(f"{describe_item(item, i)} failed in {type(model).__name__}: "
                                     f"{type(e).__name__}: {e}; pass the inputs the model takes") from e
    finally:
        handle.remove()
    captured = [(args, _without_cache(kwargs)) for args, kwargs in captured]
    if len(captured) != len(data):
        raise RuntimeError(f"{len(data) - len(captured)} calibration item(s) never reached {type(module).__name__}; "
                           "pass inputs that run the layers being quantized")
    return captured


def _without_cache(kwargs: dict) -> dict:
    """kwargs with any key/value cache (an HF `Cache`: it has `update` and `get_seq_length`) replaced by None
    and use_cache=False: a block run again on the same captured inputs would otherwise append its keys and
    values to the cache each time and attend to the stale ones."""
    out = {k: None if hasattr(v, "update") and hasattr(v, "get_seq_length") else v for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def block_output(out) -> torch.Tensor:
    """A block's hidden states: the output itself, or the first element of a tuple (HF decoder layers)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def run_block(block: nn.Module, inputs: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Run `block` on each captured input; the next block's inputs (hidden states replaced, other arguments
    kept)."""
    out = []
    with torch.no_grad():
        for args, kwargs in inputs:
            h = block_output(block(*args, **kwargs))
            out.append(((h, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": h}))
    return out


@contextlib.contextmanager
def record_linear_inputs(layers: dict[str, nn.Module], fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call fn(fqn, x) with every input x (flattened to [tokens, in_features]) that reaches each layer (a
    pre-hook; fn may raise `Stop` to end the forward)."""
    handles = []
    for fqn, layer in layers.items():
        def hook(_mod, args, fqn=fqn):
            x = args[0].detach()
            fn(fqn, x.reshape(-1, x.shape[-1]))
        handles.append(layer.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def blockwise(model: nn.Module, fqns: Iterable[str], data: list, desc: str, enabled: bool = True
              ) -> Iterator[tuple[str, nn.Module, list[tuple[tuple, dict]]]]:
    """Yield (name, block, inputs) for each block holding the linears `fqns` (the model itself, name "",
    when `find_blocks` finds none), with the (args, kwargs) each calibration item gives that block. The next
    block's inputs are computed after the caller is done with a block (so they see what it changed); one
    block's activations are held at a time."""
    found = find_blocks(model, fqns)
    if found is None:
        yield "", model, [as_call(item, i) for i, item in enumerate(data)]
        return
    name, blocks = found
    inputs = capture_inputs(model, blocks[0], data)
    for i, block in enumerate(progress(blocks, desc, enabled)):
        yield (f"{name}.{i}" if name else str(i)), block, inputs
        if i + 1 < len(blocks):
            inputs = run_block(block, inputs)
