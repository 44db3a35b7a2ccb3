"""Calibration items as model inputs, for every workflow that runs a model on them (calibration, GPTQ, AWQ,
importance matrices): an item (a tensor, a tuple or a dict) as the call's (args, kwargs), its description in
error messages, the check that every item can be a model input, and the optional progress bar."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn


def as_call(item, index: int = 0) -> tuple[tuple, dict]:
    """A calibration item as the (args, kwargs) of the model call: model(x) for a tensor, model(*x) for a
    tuple, model(**x) for a dict."""
    if isinstance(item, torch.Tensor):
        return (item,), {}
    if isinstance(item, tuple):
        return item, {}
    if isinstance(item, dict):
        return (), dict(item)
    raise TypeError(f"calibration item {index} is a {type(item).__name__}: pass tensors (model(x)), tuples "
                    "(model(*x)) or dicts (model(**x))")


def _item_tensors(item, index: int) -> list[tuple[str, torch.Tensor]]:
    args, kwargs = as_call(item, index)
    return ([(f"[{j}]", t) for j, t in enumerate(args) if isinstance(t, torch.Tensor)]
            + [(f"[{k!r}]", t) for k, t in kwargs.items() if isinstance(t, torch.Tensor)])


def describe_item(item, index: int) -> str:
    """'calibration item 3 (input_ids (1, 0))': the item's tensors and shapes, for error messages."""
    try:
        parts = [f"{w} {tuple(t.shape)}" for w, t in _item_tensors(item, index)]
    except TypeError:
        parts = [type(item).__name__]
    return f"calibration item {index} ({', '.join(parts) or 'no tensors'})"


def check_calibration_items(data: list) -> None:
    """ValueError naming the first calibration item that cannot be a model input: not a tensor / tuple / dict,
    an empty tensor (no token gives no statistics), token ids (an integer tensor) with more than 2 dims
    ([batch, seq_len] or [seq_len]), or a tensor with another number of dims than item 0's at that place."""
    first = None
    for i, item in enumerate(data):
        try:
            tensors = _item_tensors(item, i)
        except TypeError as e:
            raise ValueError(str(e)) from None
        for where, t in tensors:
            if t.numel() == 0:
                raise ValueError(f"{describe_item(item, i)}: the tensor at {where} is empty; every calibration item "
                                 "must hold at least one token / row (drop empty sequences)")
            if not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool) and t.dim() > 2:
                raise ValueError(f"{describe_item(item, i)}: the integer tensor (token ids) at {where} has {t.dim()} "
                                 "dims; token ids are [batch, seq_len] (or [seq_len]): pass "
                                 "ids.reshape(-1, ids.shape[-1]), or one [batch, seq_len] tensor per item")
        dims = {where: t.dim() for where, t in tensors}
        first = dims if first is None else first
        other = [w for w in dims if w in first and dims[w] != first[w]]
        if other:
            w = other[0]
            raise ValueError(f"{describe_item(item, i)}: the tensor at {w} has {dims[w]} dims, item 0's has "
                             f"{first[w]}; every item must have the shape layout the model takes")


def call_model(model: nn.Module, item, index: int = 0):
    """Run `model` on one calibration item (see `as_call`)."""
    args, kwargs = as_call(item, index)
    return model(*args, **kwargs)


def progress(items: Iterable, desc: str, enabled: bool = True, **kw) -> Iterable:
    """`items` wrapped in a tqdm bar on stderr when tqdm is installed (an optional extra) and `enabled`."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, file=sys.stderr, leave=False, **kw)
