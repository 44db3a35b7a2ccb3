"""How an op on a quantized tensor finds its implementation: the op-table lookup and the one dequantize
fallback.

Every tensor class keeps two tables (`_torch_function_table` for torch-level functions caught before they
decompose, such as F.linear; `_dispatch_table` for aten ops), filled with `cls.implements(...)`; a lookup
walks the class's MRO, so a subclass inherits its parent's ops and overrides single entries. Every handler
has one signature, `fn(func, args, kwargs)`. An aten op in no table runs on the dequantized tensors,
announced once per format and op (`affineq.tensor.fallback`).
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_map_only

from affineq.tensor import fallback


def _frozen_message(t) -> str:
    return (f"{t!r} has requires_grad=True, but quantized codes cannot receive gradients, so it would never "
            "train. Call weight.requires_grad_(False) (quantize_ leaves weights frozen; a float model's "
            "load_state_dict(sd, assign=True) keeps its parameters' requires_grad=True, so call "
            "model.requires_grad_(False) after loading, or run under torch.inference_mode()), or train the float "
            "model (quantization-aware training: affineq.QATConfig) and quantize afterwards")


def _refuse_gradient(message: str, grad):
    raise RuntimeError(message)


def check_frozen(t) -> None:
    """Arm the frozen-weight check of a quantized tensor with requires_grad=True used while grad is enabled: the
    forward runs (inference needs no gradient), and a backward that reaches `t` raises RuntimeError (its codes
    cannot receive gradients, so an optimizer would silently never update it). For aten ops, whose autograd
    formulas send a gradient to `t`: a hook on `t`. Ops computed from the stored tensors (F.linear, ...) also
    wrap their output with `guard_frozen_output`."""
    if not (torch.is_grad_enabled() and t.requires_grad):  # grad mode first: requires_grad re-enters dispatch
        return
    hooks = t._backward_hooks if t.grad_fn is None else None  # a leaf keeps its hooks here
    if hooks is not None and any(getattr(h, "func", None) is _refuse_gradient for h in hooks.values()):
        return
    t.register_hook(functools.partial(_refuse_gradient, _frozen_message(t)))


class _FrozenGuard(torch.autograd.Function):
    """Identity on `out`, with an edge to the frozen weight `w`: backward raises if that weight's gradient is
    asked for (loss.backward()), and passes the output's gradient on otherwise (autograd.grad(y, x))."""

    @staticmethod
    def forward(ctx, out, w):
        ctx.message = _frozen_message(w)
        return out.clone()  # not a view: an in-place op on the output (ReLU(inplace=True)) stays legal

    @staticmethod
    def backward(ctx, grad):
        node = ctx.next_functions[1][0]
        if node is not None and torch._C._will_engine_execute_node(node):
            raise RuntimeError(ctx.message)
        return grad, None


def guard_frozen_output(out: torch.Tensor, w) -> torch.Tensor:
    """`out` itself, or (a quantized weight `w` with requires_grad=True under grad mode) `out` through a node
    whose backward raises when `w`'s gradient is needed. For ops that compute `out` from `w`'s stored tensors,
    which autograd cannot connect to `w`."""
    if torch.is_grad_enabled() and w.requires_grad:
        return _FrozenGuard.apply(out, w)
    return out


_resolved: dict[tuple[type, object], object] = {}


def lookup(cls: type, op):
    """The handler registered for `op` (a torch function, aten overload or overload packet) on `cls` or its
    nearest parent, or None. Resolved once per (class, op) and cached: this runs on every op of every
    quantized tensor (`implements` clears the cache)."""
    key = (cls, op)
    try:
        return _resolved[key]
    except KeyError:
        pass
    aten_op = isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    attr = "_dispatch_table" if aten_op else "_torch_function_table"
    fn = None
    for klass in cls.__mro__:
        table = klass.__dict__.get(attr)
        if table is None:
            continue
        fn = table.get(op)
        if fn is None and isinstance(op, torch._ops.OpOverload):
            fn = table.get(op.overloadpacket)
        if fn is not None:
            break
    _resolved[key] = fn
    return fn


def forget_resolved() -> None:
    """Clear the lookup cache (after a registration)."""
    _resolved.clear()


def torch_function(cls: type, func, args, kwargs):
    fn = lookup(cls, func)
    if fn is not None:
        return fn(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def torch_dispatch(cls: type, func, args, kwargs):
    fn = lookup(cls, func)
    if fn is not None:
        return fn(func, args, kwargs)
    return dequantize_fallback(cls, func, args, kwargs)


def dequantize_fallback(cls: type, func, args, kwargs):
    """Run `func` on the dequantized tensors (announced once; an error in strict mode or for in-place ops)."""
    if func._schema.is_mutable:
        raise NotImplementedError(
            f"affineq: in-place op {func} on an AffineQuantizedTensor is not supported; "
            "call .dequantize() first and work on the float tensor"
        )
    found: list = []
    tree_map_only(cls, found.append, (args, kwargs))
    for t in found:
        check_frozen(t)
    fmts = {t.spec.fmt for t in found}
    fallback.announce_fallback("/".join(sorted(fmts)), f"{func} is not in the op table", op=str(func))
    args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
    return func(*args, **kwargs)
