"""Automatic per-layer precision under a bits-per-weight budget.

    plan = affineq.autoquant(model, 4.5, calibration_batches)     # an FqnToConfig: inspect, save, apply
    json.dump(plan.to_dict(), f);  quantize_(model, plan)

1. Cost: each candidate config quantizes each selected linear's weight; its bits are counted from the stored
   tensors (codes + qparams), `storage_bytes() * 8`.
2. Sensitivity: the output error of the layer alone quantized with the candidate, on the calibration inputs it
   receives in the float model: with H = X^T X / T over its input rows x [T, K] and D = W - W_q [N, K],

       e(layer, candidate) = mean_x ||x D^T||^2 = trace(D H D^T)      (per token, summed over outputs)

   sensitivity="layer": loss = e. Otherwise a layer's output error costs the model more or less depending on
   where it sits. sensitivity="fisher" (default) weights each output channel n by the model's Fisher information
   there, from one forward and backward over the sensitivity items for all layers at once (`_fisher`):

       loss(layer, c) = 1/2 sum_n f_n (D H D^T)_nn,   f_n = mean_t g_tn^2,   g = d log p(y) / d(layer output)

   with y sampled from the float model's own prediction: E[g g^T] is the Hessian of the KL divergence at the
   float model, kept diagonal per token and output channel (a K-FAC-like factorisation; the dropped cross-token
   terms make its absolute scale differ from a measured KLD, while the order of layers, which the knapsack
   uses, follows it). The measured alternative puts each layer's e in model units by one forward per layer:
   its smallest candidate alone applied, the divergence of the model's output from the float one,

       loss(layer, c) = e(layer, c) * div(layer, c_min) / e(layer, c_min)

   div, "kld": the mean over tokens of KL(p_float || p_quant), p = softmax of the output's last dim (logits);
   "mse": the output's squared error relative to its energy, ||y_q - y||^2 / ||y||^2 (an encoder's embeddings);
   "auto" (default): "kld" for an output with `.logits` (a language model), else "mse".
   These passes reuse one float pass: the outputs of the repeated blocks (the transformer layers, `find_blocks`)
   are cached, and a layer in block b is measured by running blocks b.. only, the blocks before it replaying
   their cached outputs (the same numbers as a full forward: those blocks do not see the change).
   Calibration items of equal shape are stacked along dim 0 and run as one batch (each item's divergence is
   still computed on its own slice, then averaged).

Importance: candidates `ImportanceWeightedConfig(base)` given without an importance matrix use the one of the
calibration data, the diagonal of each layer's H (the mean of x_k^2 per input column: llama.cpp's imatrix), so
one pass over the data serves both. DEFAULT_CANDIDATES holds such importance-weighted versions of its
sub-8-bit configs: autoquant picks plain or weighted rounding per layer, whichever has the lower loss.

GPTQ: a candidate `GPTQConfig(base)` is measured by GPTQ on the layer alone with the same H (2 H, GPTQ's scale),
so its loss is that of the error GPTQ leaves, not round-to-nearest's. A plan holding GPTQ configs applies with
calibration data, `quantize_(model, plan, calibration_data=batches)`: GPTQ then runs block by block on the
layers given to it, each with the H of the partly quantized model (so its error differs a little from the
measured one).

3. Choice: one candidate per layer minimising sum loss subject to sum bits <= budget_bits * sum weights
   (a multiple-choice knapsack), by dynamic programming over the bit budget in `resolution` steps, each
   choice's bits rounded up to a whole step (so the plan never exceeds the budget; it may leave less than a step
   of it unused per layer). When the lowest-loss candidate of every layer fits, that is the plan.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from affineq.algorithms import AlgorithmConfig, GPTQConfig, ImportanceMatrix, ImportanceWeightedConfig
from affineq.configs import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, QuantConfig
from affineq.eval import eval_mode
from affineq.granularity import PerGroup
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.quantize import FqnToConfig

__all__ = ["DEFAULT_CANDIDATES", "LayerChoice", "autoquant", "autoquant_report"]


def _default_candidates() -> tuple[QuantConfig, ...]:
    def intx(dtype: torch.dtype, group: int) -> QuantConfig:  # bf16 scale and float zero point: 32 bits a group
        return IntxWeightOnlyConfig(dtype, PerGroup(group), MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT)

    # int3 at five group sizes (3.17 .. 4 bpw): the steps between 3 and 4 bits that let a tight budget buy 5-bit
    # layers with slightly coarser groups elsewhere instead of with int2 (SmolLM2-135M at 3.5 bpw, mean KLD: 0.329
    # without them, 0.270 with them; uniform int3 g64 + imatrix 0.367). Groups that do not divide a layer's width
    # are no choice there (widths of multiples of 128 take g128, SmolLM2's 576 g96 / g192).
    weighted_bases = (intx(torch.int2, 32), intx(torch.int3, 192), intx(torch.int3, 128), intx(torch.int3, 96),
                      intx(torch.int3, 64), intx(torch.int3, 32), Int4WeightOnlyConfig(group_size=128),
                      Int4WeightOnlyConfig(group_size=64))
    plain = (*weighted_bases, Int4WeightOnlyConfig(group_size=32), intx(torch.int5, 32), intx(torch.int6, 32))
    # importance from the calibration data (module docstring); a 6-ratio clipping grid: the 16 of the uniform
    # config's default cost 2.7x the time for a few % of its gain
    weighted = tuple(ImportanceWeightedConfig(c, ratios=FAST_RATIOS, progress=False) for c in weighted_bases)
    return (*plain, Int8WeightOnlyConfig(), *weighted)


#: Clipping ratios of DEFAULT_CANDIDATES' importance-weighted configs.
FAST_RATIOS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)

#: The candidates tried when none are given: int2 g32, int3 g192 / g128 / g96 / g64 / g32, int4 g128 / g64 / g32,
#: int5 g32, int6 g32, int8 (3 to 8.5 bits per weight with qparams), those below 5 bits also importance-weighted
#: (importance from the calibration data).
DEFAULT_CANDIDATES: tuple[QuantConfig, ...] = _default_candidates()


@dataclass(frozen=True)
class LayerChoice:
    """What autoquant measured for one layer: per candidate (in the order given) its bits and loss, None where the
    candidate cannot quantize this layer (e.g. a group size that does not divide its width)."""

    fqn: str
    numel: int
    bits: tuple[int | None, ...]
    loss: tuple[float | None, ...]

    def options(self) -> list[int]:
        """Indices of the candidates that can quantize this layer."""
        return [i for i, b in enumerate(self.bits) if b is not None]

    def smallest(self) -> int:
        return min(self.bits[i] for i in self.options())


def autoquant(model: nn.Module, budget_bits: float | Sequence[float], calibration_data, *,
              candidates: Sequence[QuantConfig] | None = None,
              filter_fn: Callable[[nn.Module, str], bool] | None = None,
              resolution: int = 4096, progress: bool = True, report: list | None = None,
              sensitivity: str = "fisher", sensitivity_items: int = 2,
              gptq: bool = False) -> FqnToConfig | list[FqnToConfig]:
    """A config per selected linear of `model` minimising the summed output error (module docstring) with at
    most `budget_bits` bits per weight on average over those layers' weights, bits counted from each candidate's
    stored tensors. The model is not changed (it runs in eval mode, its modules' training flags restored
    after). A sequence of budgets gives a list of plans, one per budget, from
    one measurement (the cost is in the measurement; the knapsack takes milliseconds).

    calibration_data: model inputs (a tensor: model(x), tuple: model(*x), dict: model(**x)), as for quantize_.
    candidates: weight configs (default DEFAULT_CANDIDATES), calibration-free algorithm configs around one
        (HQQConfig, ImportanceWeightedConfig(importance=...)), ImportanceWeightedConfig without importance (the
        calibration data's), or GPTQConfig (then apply the plan with calibration_data). A candidate that cannot
        quantize a layer (its
        `check` says why, e.g. a group size not dividing the width) is no choice there; every layer needs one.
    filter_fn(module, fqn): the layers to plan (default: every nn.Linear except one named lm_head).
    resolution: steps of the knapsack's bit budget (more: closer to the budget, slower).
    report: a list to which the measured `LayerChoice`s are appended (to inspect the trade-off).
    sensitivity: "fisher" (default: the output error weighted per channel by the model's Fisher information, one
        forward and backward), "auto", "kld" or "mse" (each layer's error scaled by its measured effect on the
        model's output, module docstring: one extra pass per layer), or "layer" (its own error only).
    sensitivity_items: how many calibration items (the first ones) those passes use.
    gptq: the plan holds GPTQConfig(base) in place of each chosen candidate GPTQ can wrap (an importance-weighted
        one: its base config; same format and bits): the choice is made on the measured losses, then GPTQ's
        error feedback lowers each layer's error further. Apply it with calibration_data.
    Returns FqnToConfig({fqn: chosen candidate}); apply it with quantize_(model, plan) (with calibration_data
    when it holds GPTQ configs).
    """
    candidates = tuple(DEFAULT_CANDIDATES if candidates is None else candidates)
    budgets = list(budget_bits) if isinstance(budget_bits, (list, tuple)) else [budget_bits]
    for b in budgets or [None]:
        _check_args(b, candidates, resolution)
    if sensitivity not in ("fisher", "auto", "kld", "mse", "layer"):
        raise ValueError(f"autoquant: sensitivity={sensitivity!r} must be 'fisher' (the output error weighted by "
                         "the model's Fisher information), 'auto', 'kld' or 'mse' (scaled by the measured effect on "
                         "the model's output) or 'layer' (the layer's own output error)")
    if isinstance(sensitivity_items, bool) or not isinstance(sensitivity_items, int) or sensitivity_items < 1:
        raise ValueError(f"autoquant: sensitivity_items={sensitivity_items!r} must be an int >= 1")
    if not isinstance(gptq, bool):
        raise ValueError(f"autoquant: gptq={gptq!r} must be True or False")
    layers = _select(model, filter_fn, candidates)
    # Measured in eval mode: a plan is for inference, and a module in training mode would change as it runs
    # (BatchNorm's running stats, dropout); every module's training flag is restored after, also on an error.
    with eval_mode(model):
        hessians, tokens = _input_covariances(model, layers, calibration_data, progress)
        if any(_wants_importance(c) for c in candidates):  # the calibration data's importance matrix: diag(H)
            imatrix = ImportanceMatrix({f: h.diagonal().float() for f, h in hessians.items()}, tokens)
            candidates = tuple(dataclasses.replace(c, importance=imatrix) if _wants_importance(c) else c
                               for c in candidates)
        items = list(calibration_data)[:sensitivity_items]
        fisher = _fisher(model, layers, items) if sensitivity == "fisher" else {}
        choices = [_measure(model, fqn, layers[fqn], hessians.pop(fqn), candidates, fisher.get(fqn))
                   for fqn in _bar(list(layers), progress, "autoquant: layer errors")]
        if sensitivity not in ("layer", "fisher"):
            choices = _in_model_units(model, layers, choices, candidates, items, sensitivity, progress)
    if report is not None:
        report.extend(choices)
    plans = []
    for b in budgets:
        picks = _knapsack(choices, b, resolution)
        plans.append(FqnToConfig({c.fqn: _with_gptq(candidates[i]) if gptq else candidates[i]
                                  for c, i in zip(choices, picks, strict=True)}))
    return plans if isinstance(budget_bits, (list, tuple)) else plans[0]


def autoquant_report(plan: FqnToConfig, choices: Sequence[LayerChoice], candidates: Sequence[QuantConfig]) -> dict:
    """{"bpw": bits per weight of the plan, "loss": its summed loss, "counts": {candidate repr: layers}}."""
    keys = [_unfilled(c) for c in candidates]
    idx = {c.fqn: keys.index(_unfilled(plan.fqn_to_config[c.fqn])) for c in choices}
    bits = sum(c.bits[idx[c.fqn]] for c in choices)
    counts: dict[str, int] = {}
    for c in choices:
        key = repr(candidates[idx[c.fqn]])
        counts[key] = counts.get(key, 0) + 1
    return {"bpw": bits / sum(c.numel for c in choices), "loss": sum(c.loss[idx[c.fqn]] for c in choices),
            "counts": counts}


# -- steps -----------------------------------------------------------------------------------------------


def _wants_importance(c: QuantConfig) -> bool:
    """An importance-weighted candidate given without its matrix: autoquant supplies the calibration data's."""
    return isinstance(c, ImportanceWeightedConfig) and c.importance is None


def _with_gptq(c: QuantConfig) -> QuantConfig:
    """GPTQConfig around the weight config `c` stores (an importance-weighted candidate's base), or `c` itself
    when it already is GPTQ or GPTQ cannot wrap it (e.g. HQQ, k-quants: their own searches)."""
    if isinstance(c, GPTQConfig):
        return c
    base = c.base_config if isinstance(c, ImportanceWeightedConfig) else c
    if isinstance(base, AlgorithmConfig):
        return c
    try:
        return GPTQConfig(base, progress=False)
    except ValueError:  # a format GPTQ cannot write (its cannot_wrap says why)
        return c


def _unfilled(c: QuantConfig) -> QuantConfig:
    """A plan's config as the candidate it came from (the importance autoquant filled in taken out again)."""
    return dataclasses.replace(c, importance=None) if isinstance(c, ImportanceWeightedConfig) else c


def _check_args(budget_bits, candidates, resolution) -> None:
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float)) or not (
            math.isfinite(budget_bits) and budget_bits > 0):
        raise ValueError(f"autoquant: budget_bits={budget_bits!r} must be a positive number of bits per weight, "
                         "e.g. 4.5")
    if not candidates:
        raise ValueError("autoquant: candidates is empty; pass weight configs, or None for DEFAULT_CANDIDATES")
    for c in candidates:
        if not isinstance(c, QuantConfig) or isinstance(c, FqnToConfig) or (
                getattr(c, "needs_data", False) and not (_wants_importance(c) or isinstance(c, GPTQConfig))):
            raise ValueError(f"autoquant: candidate {c!r} must be a weight config such as "
                             "Int4WeightOnlyConfig(group_size=64), or a calibration-free algorithm around one "
                             "(HQQConfig, ImportanceWeightedConfig: its importance given, or the calibration "
                             "data's when not), or GPTQConfig; not another algorithm needing calibration data, nor "
                             "FqnToConfig")
    if len(set(candidates)) != len(candidates):
        raise ValueError("autoquant: candidates holds the same config twice; give each once")
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 16:
        raise ValueError(f"autoquant: resolution={resolution!r} must be an int >= 16 (steps of the bit budget)")


def _select(model, filter_fn, candidates) -> dict[str, nn.Linear]:
    if filter_fn is None:
        filter_fn = lambda m, fqn: fqn.split(".")[-1] != "lm_head"  # noqa: E731
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and filter_fn(m, fqn)}
    if not layers:
        raise ValueError("autoquant: no nn.Linear selected; check filter_fn")
    for fqn, m in layers.items():
        whys = [c.check(m) for c in candidates]
        if all(w is not None for w in whys):
            raise ValueError(f"autoquant: no candidate can quantize {fqn} ({whys[0]}); add a candidate that can, or "
                             "leave the layer out with filter_fn")
    return layers


def _input_covariances(model, layers, calibration_data, progress) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """({fqn: H = X^T X / T float64 [K, K]} of the inputs each layer receives in the float model, {fqn: T}).

    Layers fed the same tensor (q / k / v, gate / up) share one product; the forward stops after the last block
    holding a selected layer when every selected layer sits in a block (the head's output is not needed)."""
    items = list(calibration_data) if calibration_data is not None else []
    if not items:
        raise ValueError("autoquant: calibration_data is empty; pass an iterable of model inputs, e.g. "
                         "affineq.models.calibration_batches(tokenizer)")
    sums = {f: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for f, m in layers.items()}
    tokens = dict.fromkeys(layers, 0)
    last: list = [None, None]  # (the input tensor last seen, its X^T X)
    run: list = [0, None]  # (index of the first calibration item of the forward running, the items' sizes)

    def hook(fqn):
        def add(module, args):
            # checked here, where each layer's input width is known: the model's input need not be a Linear's
            width = args[0].shape[-1] if args[0].dim() else None
            if width != module.in_features:
                raise ValueError(f"autoquant: calibration item {run[0]} gives layer '{fqn}' inputs of width {width}, "
                                 f"expected in_features={module.in_features}; pass the inputs the model takes")
            if args[0] is not last[0]:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                last[0], last[1] = args[0], (x.T @ x).to("cpu", torch.float64)
                if not bool(torch.isfinite(last[1]).all()):  # H would make every loss of the layers it feeds NaN
                    raise ValueError(f"autoquant: calibration item {_non_finite_item(args[0], *run)} gives layer "
                                     f"'{fqn}' non-finite inputs (NaN or inf, or too large for float32); check "
                                     "the calibration data and the model's float forward on it")
            sums[fqn] += last[1]
            tokens[fqn] += args[0].numel() // args[0].shape[-1]
        return add

    handles = [m.register_forward_pre_hook(hook(f)) for f, m in layers.items()]
    blocks = _blocks(model, layers)
    if blocks is not None and all(b is not None for b in blocks[1].values()):
        handles.append(blocks[0][max(blocks[1].values())].register_forward_hook(_stop))
    try:
        with torch.inference_mode():
            for index, item, sizes in _bar(_stacked(items, _BATCH), progress, "autoquant: calibration"):
                run[0], run[1] = index, sizes
                try:
                    _call(model, item, index)
                except _Stop:
                    pass
    finally:
        last[0] = last[1] = None
        for h in handles:
            h.remove()
    missing = [f for f, t in tokens.items() if t == 0]
    if missing:
        raise ValueError(f"autoquant: no calibration input reached {missing}; pass inputs that run them, or leave "
                         "them out with filter_fn")
    return {f: sums[f] / tokens[f] for f in layers}, tokens


def _non_finite_item(x: torch.Tensor, first: int, sizes: list[int] | None) -> int:
    """Index of the calibration item whose rows of a stacked layer input `x` hold NaN / inf (`first`, the run's
    first item, when the rows cannot be told apart or none does: then the X^T X product overflowed)."""
    if sizes is None or len(sizes) == 1 or x.dim() < 2 or x.shape[0] != sum(sizes):
        return first
    for i, part in enumerate(x.split(sizes)):
        if not bool(torch.isfinite(part).all()):
            return first + i
    return first


#: calibration items stacked into one forward (equal shapes only)
_BATCH = 8


class _Stop(Exception):
    """Ends a forward early: what follows the last block holding a selected layer is not needed."""


def _stop(*_args) -> None:
    raise _Stop


def _blocks(model: nn.Module, layers) -> tuple[list[nn.Module], dict[str, int | None]] | None:
    """(blocks, {fqn: index of the block holding it, None if none}) for the nn.ModuleList whose children hold the
    most selected layers (a transformer's layers), or None when no ModuleList holds any."""
    best, best_count = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        prefix = f"{name}." if name else ""
        where = {f: int(f[len(prefix):].split(".")[0]) if f.startswith(prefix) and
                 f[len(prefix):].split(".")[0].isdigit() else None for f in layers}
        count = sum(w is not None for w in where.values())
        if count > best_count:
            best, best_count = (list(m), where), count
    return best


def _stacked(items: list, batch: int):
    """(index of the first item, one model input, sizes along dim 0 of the items in it): runs of up to `batch`
    tensor items of equal shape (>= 2 dims) concatenated along dim 0, other items alone."""
    out, i = [], 0
    while i < len(items):
        first = items[i]
        j = i + 1
        if isinstance(first, torch.Tensor) and first.dim() >= 2:
            while (j < len(items) and j - i < batch and isinstance(items[j], torch.Tensor)
                   and items[j].shape == first.shape and items[j].dtype == first.dtype):
                j += 1
        run = items[i:j]
        out.append((i, torch.cat(run) if j - i > 1 else first,
                    [t.shape[0] for t in run] if isinstance(first, torch.Tensor) and first.dim() >= 2 else None))
        i = j
    return out


def _call(model: nn.Module, item, index: int):
    if isinstance(item, torch.Tensor):
        return model(item)
    if isinstance(item, tuple):
        return model(*item)
    if isinstance(item, dict):
        return model(**item)
    raise ValueError(f"autoquant: calibration item {index} is a {type(item).__name__}: pass tensors (model(x)), "
                     "tuples (model(*x)) or dicts (model(**x))")


def _bar(items, enabled: bool, desc: str = "autoquant"):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # an optional extra: no bar without it
        return items
    return tqdm(items, desc=desc, file=sys.stderr, leave=False)


def _measure(model: nn.Module, fqn: str, layer: nn.Linear, h: torch.Tensor, candidates,
             fisher: torch.Tensor | None = None) -> LayerChoice:
    """The layer's bits and loss per candidate: trace(D H D^T), or with `fisher` [N] (per output weights)
    sum_n fisher_n (D H D^T)_nn."""
    w = layer.weight.detach()
    h32 = h.float()  # trace(D H D^T) in float32: 2x the speed, ~1e-6 relative error on a sum of positive terms
    bits, loss = [], []
    for c in candidates:
        if c.check(layer) is not None:
            bits.append(None)
            loss.append(None)
            continue
        if isinstance(c, GPTQConfig):  # GPTQ on this layer alone with the float model's H (2 X^T X / T, its scale)
            qw = c.quantize_layer(layer, 2.0 * h)
        elif isinstance(c, AlgorithmConfig):  # calibration-free (HQQ, importance given): its run on this layer alone
            qw = c.run(model, {fqn: layer}, None)[fqn].quantize_weight(w, layer)
        else:
            qw = c.quantize_weight(w, layer)
        d = w.float() - qw.dequantize(torch.float32)
        bits.append(int(qw.storage_bytes()) * 8)
        rows = ((d @ h32) * d).sum(1, dtype=torch.float64)
        loss.append(float(rows.sum() if fisher is None else (rows * fisher).sum()))
        if not math.isfinite(loss[-1]):  # H is finite (checked where it is summed): the weight or fisher is not
            raise ValueError(f"autoquant: layer '{fqn}' gets a non-finite loss ({loss[-1]}) with candidate {c!r}: "
                             "its weight error, or its Fisher weights (sensitivity='fisher'), overflow float32; "
                             "check the layer's weight for huge values")
    return LayerChoice(fqn, w.numel(), tuple(bits), tuple(loss))


def _fisher(model: nn.Module, layers, items: list) -> dict[str, torch.Tensor]:
    """{fqn: float64 [out_features]}: the weights that make sum_n f_n (D H D^T)_nn the model's divergence
    (module docstring, "fisher"), from one forward and backward over `items` (stacked).

    Language model (an output with .logits): y_t ~ softmax(logits_t) sampled (a fixed seed), g = d/d(layer output)
    of sum_t log p(y_t); E[g g^T] is the Hessian of the summed KL at the float model, so with g_t's square taken
    per output channel and averaged over the T tokens, mean_t KL ~ 1/2 sum_n mean_t(g_tn^2) (D H D^T)_nn.
    Other outputs y: g = d/d(layer output) of sum (v * y) / ||y|| per item, v ~ N(0, 1); E[g g^T] = J^T J / ||y||^2,
    so ||dy||^2 / ||y||^2 ~ (tokens per item) sum_n mean_t(g_tn^2) (D H D^T)_nn."""
    sums = {f: torch.zeros(m.out_features, dtype=torch.float64) for f, m in layers.items()}
    rows = dict.fromkeys(layers, 0)

    def hook(fqn):
        def keep(_module, _args, out):
            if not out.requires_grad:  # nothing upstream needs a gradient: the layer's output starts the graph
                out.requires_grad_()

            def add(g):
                g = g.detach().reshape(-1, g.shape[-1])
                sums[fqn] += g.float().square().sum(0, dtype=torch.float64)
                rows[fqn] += g.shape[0]
            out.register_hook(add)
        return keep

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # no parameter gradients: the model is not changed (nor its .grad)
        p.requires_grad_(False)
    handles = [m.register_forward_hook(hook(f)) for f, m in layers.items()]
    gen = torch.Generator().manual_seed(0)
    factor = 0.5
    try:
        with torch.enable_grad():
            for index, item, sizes in _stacked(items, len(items)):
                out = _call(model, item, index)
                if hasattr(out, "logits"):
                    logits = out.logits.float()
                    logits = logits.reshape(-1, logits.shape[-1])
                    y = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen)
                    loss = torch.log_softmax(logits, -1).gather(1, y).sum()
                else:
                    y = (out.last_hidden_state if hasattr(out, "last_hidden_state") else
                         out[0] if isinstance(out, (tuple, list)) else out).float()
                    parts = y.split(sizes) if sizes is not None and len(sizes) > 1 else [y]
                    loss = sum((torch.randn(p.shape, generator=gen) * p).sum() / p.detach().norm().clamp_min(1e-30)
                               for p in parts)
                    factor = y.numel() / y.shape[-1] / len(parts)  # tokens (rows) per item
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.requires_grad_(True)
    missing = [f for f, r in rows.items() if r == 0]
    if missing:
        raise ValueError(f"autoquant: sensitivity='fisher' found no gradient reaching {missing} (their output does "
                         "not reach the model's output); pass sensitivity='layer' or leave them out with filter_fn")
    bad = [f for f, v in sums.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"autoquant: sensitivity='fisher' got NaN or inf gradients at layer '{bad[0]}' from "
                         f"calibration items 0..{len(items) - 1} (the model's output or its gradient overflows); "
                         "check the model's float forward on them, or pass sensitivity='layer'")
    return {f: factor * sums[f] / rows[f] for f in layers}


def _in_model_units(model, layers, choices, candidates, items: list, sensitivity: str,
                    progress: bool) -> list[LayerChoice]:
    """Each layer's losses times div(model with its smallest candidate alone) / e(smallest candidate).

    One float pass caches the reference outputs and every block's output; a layer in block b is then measured
    with blocks 0..b-1 replaying their cached outputs (module docstring)."""
    runs = _stacked(items, len(items))
    found = _blocks(model, layers)
    blocks, where = found if found is not None else ([], dict.fromkeys(layers))
    cache: list[list] = [[] for _ in blocks]
    handles = [b.register_forward_hook(lambda _m, _a, out, j=j: cache[j].append(out)) for j, b in enumerate(blocks)]
    try:
        with torch.inference_mode():
            reference = [[((t, torch.softmax(t, -1)) if kld else t, kld) for t, kld in
                          _split(_output(_call(model, item, i), sensitivity), sizes)] for i, item, sizes in runs]
    finally:
        for h in handles:
            h.remove()
    scaled = []
    for c in _bar(choices, progress, "autoquant: sensitivity"):
        layer = layers[c.fqn]
        # the smallest candidate that needs no H (GPTQ's is gone by now; the ratio div / e is what is used)
        usable = [j for j in c.options() if not isinstance(candidates[j], GPTQConfig)]
        if not usable:
            raise ValueError(f"autoquant: sensitivity={sensitivity!r} applies a layer's smallest candidate without "
                             f"calibration data, and only GPTQConfig candidates can quantize {c.fqn}; add a plain "
                             "candidate for it, or pass sensitivity='fisher'")
        i = min(usable, key=lambda j, c=c: (c.bits[j], -c.loss[j]))
        w = layer.weight.data
        cand = candidates[i]
        if isinstance(cand, AlgorithmConfig):
            qw = cand.run(model, {c.fqn: layer}, None)[c.fqn].quantize_weight(w, layer)
        else:
            qw = cand.quantize_weight(w, layer)
        layer.weight.data = qw.dequantize(w.dtype)
        skipped = blocks[: where[c.fqn] or 0]
        run = [0]
        saved = [b.__dict__.get("forward") for b in skipped]
        for j, b in enumerate(skipped):  # replay: the block's cached float output for the current run
            b.forward = lambda *_a, j=j, run=run, **_k: cache[j][run[0]]
        try:
            divs = []
            with torch.inference_mode():
                for r, (k, item, sizes) in enumerate(runs):
                    run[0] = r
                    out = _split(_output(_call(model, item, k), sensitivity), sizes)
                    divs += [_divergence(ref, o) for ref, o in zip(reference[r], out, strict=True)]
            div = sum(divs) / len(divs)
            if not math.isfinite(div):
                raise ValueError(f"autoquant: sensitivity={sensitivity!r} measured a non-finite divergence ({div}) "
                                 f"with layer '{c.fqn}' quantized on calibration items 0..{len(items) - 1}: the "
                                 "model's output is NaN or inf; check its float forward, or pass "
                                 "sensitivity='layer'")
        finally:
            layer.weight.data = w
            for b, f in zip(skipped, saved, strict=True):
                del b.forward
                if f is not None:
                    b.forward = f
        gain = div / c.loss[i] if c.loss[i] > 0 else 0.0
        scaled.append(LayerChoice(c.fqn, c.numel, c.bits, tuple(None if v is None else v * gain for v in c.loss)))
    return scaled


def _split(out: tuple[torch.Tensor, bool], sizes) -> list[tuple[torch.Tensor, bool]]:
    """A stacked run's output cut back into its items' outputs (along dim 0)."""
    if sizes is None or len(sizes) == 1:
        return [out]
    return [(t, out[1]) for t in out[0].split(sizes)]


def _output(out, sensitivity: str) -> tuple[torch.Tensor, bool]:
    """(the tensor autoquant compares, whether to compare it by KLD): `.logits` of a language model output, else
    `.last_hidden_state`, the first element of a tuple, or the output tensor itself."""
    if hasattr(out, "logits"):
        return out.logits.detach().float(), sensitivity != "mse"
    if hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"autoquant: sensitivity={sensitivity!r} needs a tensor output (or .logits / "
                         f".last_hidden_state), got {type(out).__name__}; pass sensitivity='layer'")
    return out.detach().float(), sensitivity == "kld"


def _divergence(ref: tuple, out: tuple[torch.Tensor, bool]) -> float:
    """Mean over tokens of KL(softmax(r) || softmax(o)) for logits (ref given as (r, softmax(r))); else
    ||o - r||^2 / ||r||^2.

    The KL in float32 (a vocabulary-wide pass per layer is this pass's cost) without its cancellation: with
    p = softmax(r) and d = o - r, KL = log sum p e^d - sum p d = log1p(sum p expm1(d)) - sum p d, both terms
    accurate for small d (a log-softmax difference would carry the log-sum-exp's rounding, ~1e-7 of its size)."""
    if ref[1]:
        (r, p), o = ref[0], out[0]
        d = o - r
        a = (p * d).sum(-1, dtype=torch.float64)
        b = torch.log1p((p * torch.expm1(d)).sum(-1, dtype=torch.float64))
        return float((b - a).mean())
    r, o = ref[0].double(), out[0].double()
    return float(((o - r) ** 2).sum() / (r**2).sum().clamp_min(1e-300))


def _knapsack(choices: Sequence[LayerChoice], budget_bits: float, resolution: int) -> list[int]:
    """Index of the chosen candidate per layer: min sum loss s.t. sum bits <= budget_bits * sum numel."""
    total = sum(c.numel for c in choices)
    capacity = budget_bits * total
    smallest = sum(c.smallest() for c in choices)
    if smallest > capacity:
        raise ValueError(f"autoquant: budget_bits={budget_bits} is below the smallest plan the candidates allow "
                         f"({smallest / total:.4f} bits per weight, every layer at its smallest candidate); raise "
                         "the budget or add a smaller candidate")
    best = [min(c.options(), key=lambda i, c=c: (c.loss[i], c.bits[i])) for c in choices]
    if sum(c.bits[i] for c, i in zip(choices, best, strict=True)) <= capacity:
        return best  # every layer's lowest-loss candidate fits
    # DP over the budget above the smallest plan, in `resolution` steps; extra bits rounded up to whole steps
    spare = capacity - smallest
    step = spare / resolution
    inf = float("inf")
    cost = torch.full((resolution + 1,), inf, dtype=torch.float64)
    cost[0] = 0.0
    back = []
    for c in choices:
        low = c.smallest()
        nxt = torch.full_like(cost, inf)
        arg = torch.zeros(resolution + 1, dtype=torch.int64)
        for i in c.options():
            loss, extra = c.loss[i], c.bits[i] - low
            units = 0 if extra == 0 else math.ceil(extra / step) if step > 0 else resolution + 1
            if units > resolution:
                continue
            cand = torch.full_like(cost, inf)
            cand[units:] = cost[: resolution + 1 - units] + loss
            better = cand < nxt
            nxt = torch.where(better, cand, nxt)
            arg = torch.where(better, torch.full_like(arg, i), arg)
        cost = nxt
        back.append(arg)
    end = int(torch.argmin(cost))
    picks = []
    for c, arg in zip(reversed(choices), reversed(back), strict=True):
        i = int(arg[end])
        picks.append(i)
        extra = c.bits[i] - c.smallest()
        end -= 0 if extra == 0 else math.ceil(extra / step)
    return picks[::-1]
