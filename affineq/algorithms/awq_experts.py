"""AWQ of MoE expert weights (transformers' experts modules: 3-D `gate_up_proj` / `up_proj` [E, N, H] and
`down_proj` [E, H, I]), calibrated through the router's token assignment: expert e's statistics and search losses
come from the rows the router sends it (X_e [t_e, H]), and the rows its down projection receives
(Z_e = gate(X_e W_e^T) [t_e, I]).

Every scale is folded where the fold is an identity in float, so the quantized experts run the plain grouped
kernel (no per-expert input scale at run time):

- gate_up (up): its input is the same tensor for every expert (the post-attention norm's output), so a
  per-expert input scale could not be folded into that norm. One scale s [H] is shared by all experts:

      s(alpha) = mean|X|^alpha / mean|W~|^(1 - alpha)       X: every token reaching the module;
                                                              W~: all experts' group-normalised weights
      loss(alpha) = sum_e || X_e W_e^T - (X_e / s) Q(W_e * s)^T ||^2      (the routed rows of each expert)

  and X / s is folded into the norm that produced X (weight, bias / s) with every other reader of that tensor
  rescaled to match (the router's and a shared expert's weight columns * s); the fold is kept only when the
  block's float output on one calibration input stays within 1e-4 (relative; a quarter of the dtype's epsilon in
  a bf16 / fp16 model, `fold_tolerance`), else gate_up is left unscaled.
- down: per expert, s_e [I] searched as for a linear on Z_e, W_down_e, and folded into the rows of expert e's
  gate_up that multiply the gate's output channel-wise (`act(gate) * up`: the `up` half scaled by 1 / s_e scales
  the gate's output by 1 / s_e exactly). Which rows those are is checked numerically on the module's own gate;
  gpt-oss's clamped `(up + 1) * glu` has no such rows, so its down_proj is not scaled (clipping only). An
  expert the router sends no calibration token is not scaled.

Then each expert's weights get AWQ's clipping search on its own rows (`clip`), and are quantized by the base
config's spec one expert at a time and stacked (`stack_experts`). `prescale` does not apply: no expert scale is
kept as an input pre-scale.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from affineq.algorithms._awq_math import candidate_scale, fake_quant, qparams, search_clip, weight_mean
from affineq.algorithms._base import Precomputed
from affineq.algorithms._capture import blockwise
from affineq.algorithms._migrate import _is_norm, _rel_err, output_tensor
from affineq.algorithms._routed import as_rows_by_input, capture_routed, down_inputs, rows_per_expert, up_name
from affineq.configs import QuantConfig
from affineq.expert_weights import experts_transposed, in_grouped_layout, stack_experts
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["awq_experts", "fold_tolerance", "gate_up_rows"]

_SMALL_EXPERT = 1 << 18  # elements of one expert's weight below which the search runs on one thread
_TOL = 1e-4  # relative change of a block's float output a fold may cause (as `_migrate.migrate`) ...


def fold_tolerance(dtype: torch.dtype) -> float:
    """... or, in a low-precision model, a quarter of its dtype's epsilon: the folded weights are rounded to the
    model's dtype (bf16: ~1e-3 relative change of a block's output), the model's own rounding noise; a token
    routed to another expert changes the output far more."""
    return max(_TOL, torch.finfo(dtype).eps / 4)


def _sample(x: torch.Tensor, n: int) -> torch.Tensor:
    """At most n evenly spaced rows of x, in float32."""
    return x[:: max(1, math.ceil(x.shape[0] / n))].float()


def _search(pairs: list[tuple[torch.Tensor, torch.Tensor]], x_mean: torch.Tensor, w_mean: torch.Tensor | None,
            spec, opts, n_grid: int) -> torch.Tensor:
    """The s of the alpha grid minimising sum over (x, w) in pairs of || x w^T - (x / s) Q(w * s)^T ||^2."""
    refs = [x @ w.T for x, w in pairs]
    best, best_s = None, None
    for i in range(n_grid):
        s = candidate_scale(i / n_grid, x_mean, w_mean)
        loss = sum(float((ref - (x / s) @ fake_quant(w * s, spec, opts).T).pow(2).sum())
                   for (x, w), ref in zip(pairs, refs, strict=True))
        if best is None or loss < best:
            best, best_s = loss, s
    return best_s


def gate_up_rows(module: nn.Module) -> torch.Tensor | None:
    """The rows of the first expert weight (gate_up / up, [N] outputs) whose scaling by 1 / r scales the gate's
    output [I] by 1 / r exactly, as indices [I]; None when there are none. Checked numerically on the module's
    own gate: `act(gate) * up` (Mixtral, Qwen-MoE): the up half; an up_proj with a positively homogeneous
    activation (ReLU): all rows; gpt-oss's clamped `(up + 1) * glu`: None."""
    gated = up_name(module) == "gate_up_proj"
    n = module._parameters["down_proj"].shape[1 if experts_transposed(module) else 2]  # I
    gate = module._apply_gate if gated else module.act_fn
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 2 * n if gated else n, generator=gen)
    r = torch.rand(n, generator=gen) + 0.5
    candidates = [torch.arange(n, 2 * n), torch.arange(1, 2 * n, 2)] if gated else [torch.arange(n)]
    with torch.no_grad():
        ref = gate(h) / r
        for idx in candidates:
            h2 = h.clone()
            h2[:, idx] = h2[:, idx] / r
            if torch.allclose(gate(h2), ref, rtol=1e-5, atol=1e-6):
                return idx
    return None


class _Fold:
    """New Parameters for some modules, kept when the block's float output on `sample` stays within `tol`
    (relative) of `ref`, else reverted (the old Parameter objects put back)."""

    def __init__(self, block: nn.Module, sample: tuple[tuple, dict], ref: torch.Tensor, tol: float) -> None:
        self.block, self.sample, self.ref, self.tol = block, sample, ref, tol
        self.saved: list[tuple[nn.Module, str, nn.Parameter]] = []

    def set(self, module: nn.Module, name: str, value: torch.Tensor) -> None:
        old = module._parameters[name]
        self.saved.append((module, name, old))
        module._parameters[name] = nn.Parameter(value.to(old.dtype), requires_grad=old.requires_grad)

    def keep(self) -> bool:
        args, kwargs = self.sample
        out = output_tensor(self.block(*args, **kwargs))
        if torch.isfinite(out).all() and _rel_err(self.ref, out) <= self.tol:
            return True
        for module, name, old in reversed(self.saved):
            module._parameters[name] = old
        return False


def _input_readers(block: nn.Module, experts: nn.Module, sample: tuple[tuple, dict]):
    """(the module that produced the experts module's input, [the other modules reading that tensor's storage])
    on one run of `block` on `sample`; the producer is None when no submodule of the block returned it."""
    produced: dict[int, str] = {}
    reads: list[tuple[str, int]] = []
    alive: list[torch.Tensor] = []  # held so no storage is reused during the run
    handles = []

    def pre(name):
        def hook(_m, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                alive.append(x)
                reads.append((name, x.data_ptr()))
        return hook

    def post(name):
        def hook(_m, _args, out):
            if isinstance(out, torch.Tensor):
                alive.append(out)
                produced.setdefault(out.data_ptr(), name)  # innermost first
        return hook

    modules = dict(block.named_modules())
    for name, m in modules.items():
        if name:
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post(name)))
    try:
        args, kwargs = sample
        block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    mine = next((n for n, m in modules.items() if m is experts), None)
    ptr = next((p for n, p in reads if n == mine), None)
    producer = produced.get(ptr)
    readers = list(dict.fromkeys(n for n, p in reads if p == ptr and n not in (mine, producer)))
    return (None if producer is None else modules[producer]), [modules[n] for n in readers]


def _fold_input_scale(fold: _Fold, experts: nn.Module, s: torch.Tensor, producer, readers) -> bool:
    """Stage X / s into the norm `producer` and W * s into every reader's weight columns (the experts' first
    weight included); False (nothing staged) when some reader is not a float module with weight [out, H]."""
    if producer is None or not _is_norm(producer) or not _float(producer._parameters.get("weight")):
        return False
    h = s.shape[0]
    scaled = []
    for m in readers:
        own = list(m._parameters)
        if not own:
            continue  # a container: its children that read the tensor are readers themselves
        w = m._parameters.get("weight")
        if not _float(w) or w.dim() != 2 or w.shape[1] != h:
            return False
        scaled.append(m)
    inv = 1.0 / s
    fold.set(producer, "weight", producer.weight.float() * inv.to(producer.weight.device))
    if producer._parameters.get("bias") is not None:
        fold.set(producer, "bias", producer.bias.float() * inv.to(producer.bias.device))
    for m in scaled:
        fold.set(m, "weight", m.weight.float() * s.to(m.weight.device))
    name = up_name(experts)
    w = experts._parameters[name]
    dim = -2 if experts_transposed(experts) else -1  # the input (H) dim
    fold.set(experts, name, w.float() * (s if dim == -1 else s[:, None]).to(w.device))
    return True


def _float(w) -> bool:
    return isinstance(w, torch.Tensor) and not isinstance(w, AffineQuantizedTensor) and w.dtype.is_floating_point


def _quantize(cfg, module: nn.Module, name: str, xs: list[torch.Tensor | None]) -> AffineQuantizedTensor:
    """Expert weight `name` of `module` (its current float values) quantized expert by expert with the base
    config's spec, expert e's groups clipped by AWQ's search on its rows xs[e] (None: no clipping)."""
    weight = module._parameters[name].detach()
    w = as_rows_by_input(module, weight)  # [E, N, K]
    proxy = nn.Linear(w.shape[2], w.shape[1], bias=False, device="meta", dtype=w.dtype)
    base = cfg.base_config
    spec, opts = base.weight_spec(w[0], proxy), base.qparam_options()
    parts = []
    for e in range(w.shape[0]):
        we = w[e].contiguous()
        ratio = None
        if cfg.clip and xs[e] is not None:
            ratio = search_clip(we.float(), xs[e], spec, opts, cfg.n_clip, cfg.max_shrink)
        scale, zp = qparams(we.float(), spec, opts, ratio)
        parts.append(in_grouped_layout(base, AffineQuantizedTensor.from_qparams(we, scale, zp, spec)))
    return stack_experts(parts, experts_transposed(module))


def _awq_module(cfg, block: nn.Module, module: nn.Module, inputs: list) -> dict[str, AffineQuantizedTensor]:
    """AWQ of one experts module inside `block` (module docstring); {parameter name: quantized weight}."""
    seen = capture_routed(module, inputs, lambda inp: block(*inp[0], **inp[1]))
    num = module._parameters["down_proj"].shape[0]
    rows = rows_per_expert(seen, num)
    routed = [torch.cat(r).float() if r else None for r in rows]
    routed = [None if r is None or not r.shape[0] else r for r in routed]
    n = cfg.n_tokens
    name = up_name(module)
    base = cfg.base_config
    proxy = lambda w: nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)  # noqa: E731
    w_up = as_rows_by_input(module, module._parameters[name].detach()).float()  # [E, N, H], before any fold
    w_down = as_rows_by_input(module, module._parameters["down_proj"].detach()).float()  # [E, H, I]
    up_spec = (base.weight_spec(w_up[0], proxy(w_up[0])), base.qparam_options())
    down_spec = (base.weight_spec(w_down[0], proxy(w_down[0])), base.qparam_options())
    sample = inputs[0]
    ref = output_tensor(block(*sample[0], **sample[1]))
    tol = fold_tolerance(module._parameters[name].dtype)

    # gate_up: one scale for all experts, folded into the norm before them (and the tensor's other readers)
    if not seen:
        warnings.warn(f"AWQ: the calibration inputs never reached {type(module).__name__}; its experts are quantized "
                      "round-to-nearest", stacklevel=4)
    x_all = torch.cat([x for x, _ in seen]).float() if seen else None
    w_mean = None
    if cfg.duo_scaling:
        w_mean = torch.stack([weight_mean(w, up_spec[0].block_size[-1]) for w in w_up]).mean(0).clamp_min(1e-8)
    pairs = [(_sample(x, n), w_up[e]) for e, x in enumerate(routed) if x is not None]
    s_up = _search(pairs, x_all.abs().mean(0).clamp_min(1e-8), w_mean, *up_spec, cfg.n_grid) if pairs else None
    fold = _Fold(block, sample, ref, tol)
    if s_up is not None and not (_fold_input_scale(fold, module, s_up, *_input_readers(block, module, sample))
                                 and fold.keep()):
        s_up = None

    # down: one scale per expert, folded into the rows of its gate_up that scale the gate's output
    idx = gate_up_rows(module)
    hidden = down_inputs(module, w_up, [[x] if x is not None else [] for x in routed])
    hidden = [h[0] if h else None for h in hidden]
    s_down: list[torch.Tensor | None] = [None] * num
    if idx is not None:
        for e, z in enumerate(hidden):
            if z is None:
                continue
            wm = weight_mean(w_down[e], down_spec[0].block_size[-1]).clamp_min(1e-8) if cfg.duo_scaling else None
            s_down[e] = _search([(_sample(z, n), w_down[e])], z.abs().mean(0).clamp_min(1e-8), wm, *down_spec,
                                cfg.n_grid)
    if any(s is not None for s in s_down):
        ones = torch.ones(w_down.shape[2])
        sd = torch.stack([s if s is not None else ones for s in s_down])  # [E, I]
        fold = _Fold(block, sample, ref, tol)
        up = module._parameters[name].detach().float()
        row_scale = torch.ones(num, up.shape[-2 if not experts_transposed(module) else -1])
        row_scale[:, idx] = 1.0 / sd
        if experts_transposed(module):  # [E, H, N]: the rows are the last dim
            fold.set(module, name, up * row_scale[:, None, :])
            down = module._parameters["down_proj"].detach().float() * sd[:, :, None]  # [E, I, H]
        else:
            fold.set(module, name, up * row_scale[:, :, None])
            down = module._parameters["down_proj"].detach().float() * sd[:, None, :]  # [E, H, I]
        bias = module._parameters.get(f"{name}_bias") if getattr(module, "has_bias", False) else None
        if bias is not None:
            fold.set(module, f"{name}_bias", bias.detach().float() * row_scale)
        fold.set(module, "down_proj", down)
        if not fold.keep():
            s_down = [None] * num

    up_x = [None if x is None else _sample(x if s_up is None else x / s_up, 256) for x in routed]
    down_x = [None if z is None else _sample(z if s is None else z / s, 256) for z, s in zip(hidden, s_down,
                                                                                             strict=True)]
    return {name: _quantize(cfg, module, name, up_x), "down_proj": _quantize(cfg, module, "down_proj", down_x)}


def awq_experts(cfg, model: nn.Module, layers: dict[str, nn.Module], data: list) -> dict[str, QuantConfig]:
    """AWQ (`cfg`, an AWQConfig) of the experts modules `layers` ({fqn: module}) on calibration items `data`,
    block by block (float blocks: AWQ's folds are identities); {f"{fqn}.{parameter}": Precomputed}. May assign
    new Parameters to float modules (the folds). Runs in eval mode (each module's mode restored)."""
    out: dict[str, QuantConfig] = {}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    threads = torch.get_num_threads()
    # small experts: one thread. Their searches are thousands of small ops, where splitting each across threads
    # costs more in synchronisation than it saves (40x slower on a loaded 2-core machine); large experts' matmuls
    # (a real model's [1536, 2048]) keep every thread
    largest = max(p[0].numel() for m in layers.values() for n, p in m._parameters.items()
                  if p is not None and p.dim() == 3)
    torch.set_num_threads(1 if largest < _SMALL_EXPERT else threads)
    try:
        with torch.no_grad():
            for prefix, block, inputs in blockwise(model, layers, data, "AWQ experts", cfg.progress):
                pre = f"{prefix}." if prefix else ""
                for fqn, module in layers.items():
                    if fqn.startswith(pre):
                        for name, q in _awq_module(cfg, block, module, inputs).items():
                            out[f"{fqn}.{name}"] = Precomputed(base=cfg.base_config, weight=q)
    finally:
        torch.set_num_threads(threads)
        for m, training in modes:
            m.training = training
    return out
