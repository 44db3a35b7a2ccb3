"""Automatic per-layer precision under a bits-per-weight budget.

    plan = affineq.autoquant(model, 4.5, calibration_batches)     # an FqnToConfig: inspect, save, apply
    json.dump(plan.to_dict(), f);  quantize_(model, plan)

1. Cost: each candidate config quantizes each selected linear's weight; its bits are counted from the stored
   tensors (codes + qparams), `storage_bytes() * 8`.
2. Sensitivity: the output error of the layer alone quantized with the candidate, on the calibration inputs it
   receives in the float model: with H = X^T X / T over its input rows x [T, K] and D = W - W_q [N, K],

       e(layer, candidate) = mean_x ||x D^T||^2 = trace(D H D^T)      (per token, summed over outputs)

   sensitivity="layer": loss = e. Otherwise a layer's output error costs the model more or less depending on
   where it sits, so each layer's e is put in model units by one measured forward: its smallest candidate alone
   applied, the divergence of the model's output from the float one,

       loss(layer, c) = e(layer, c) * div(layer, c_min) / e(layer, c_min)

   div, "kld": the mean over tokens of KL(p_float || p_quant), p = softmax of the output's last dim (logits);
   "mse": the output's squared error relative to its energy, ||y_q - y||^2 / ||y||^2 (an encoder's embeddings);
   "auto" (default): "kld" for an output with `.logits` (a language model), else "mse".

3. Choice: one candidate per layer minimising sum loss subject to sum bits <= budget_bits * sum weights
   (a multiple-choice knapsack), by dynamic programming over the bit budget in `resolution` steps, each
   choice's bits rounded up to a whole step (so the plan never exceeds the budget; it may leave less than a step
   of it unused per layer). When the lowest-loss candidate of every layer fits, that is the plan.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from affineq.algorithms import AlgorithmConfig
from affineq.configs import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, QuantConfig
from affineq.granularity import PerGroup
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.quantize import FqnToConfig

__all__ = ["DEFAULT_CANDIDATES", "LayerChoice", "autoquant", "autoquant_report"]


def _default_candidates() -> tuple[QuantConfig, ...]:
    def intx(dtype: torch.dtype, group: int) -> QuantConfig:  # bf16 scale and float zero point: 32 bits a group
        return IntxWeightOnlyConfig(dtype, PerGroup(group), MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT)

    return (intx(torch.int2, 32), intx(torch.int3, 64), intx(torch.int3, 32), Int4WeightOnlyConfig(group_size=128),
            Int4WeightOnlyConfig(group_size=64), Int4WeightOnlyConfig(group_size=32), intx(torch.int5, 32),
            intx(torch.int6, 32), Int8WeightOnlyConfig())


#: The candidates tried when none are given: 3 to 8 bits per weight (+ qparams) at SmolLM2's shapes.
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


def autoquant(model: nn.Module, budget_bits: float, calibration_data, *,
              candidates: Sequence[QuantConfig] | None = None,
              filter_fn: Callable[[nn.Module, str], bool] | None = None,
              resolution: int = 4096, progress: bool = True, report: list | None = None,
              sensitivity: str = "auto", sensitivity_items: int = 4) -> FqnToConfig:
    """A config per selected linear of `model` minimising the summed output error (module docstring) with at
    most `budget_bits` bits per weight on average over those layers' weights, bits counted from each candidate's
    stored tensors. The model is not changed.

    calibration_data: model inputs (a tensor: model(x), tuple: model(*x), dict: model(**x)), as for quantize_.
    candidates: weight configs (default DEFAULT_CANDIDATES), or calibration-free algorithm configs around one
        (HQQConfig, ImportanceWeightedConfig(importance=...)). A candidate that cannot quantize a layer (its
        `check` says why, e.g. a group size not dividing the width) is no choice there; every layer needs one.
    filter_fn(module, fqn): the layers to plan (default: every nn.Linear except one named lm_head).
    resolution: steps of the knapsack's bit budget (more: closer to the budget, slower).
    report: a list to which the measured `LayerChoice`s are appended (to inspect the trade-off).
    sensitivity: "auto", "kld" or "mse" (each layer's error scaled by its measured effect on the model's output,
        module docstring: one extra pass over calibration_data per layer), or "layer" (its own error only).
    sensitivity_items: how many calibration items (the first ones) those extra passes use.
    Returns FqnToConfig({fqn: chosen candidate}); apply it with quantize_(model, plan).
    """
    candidates = tuple(DEFAULT_CANDIDATES if candidates is None else candidates)
    _check_args(budget_bits, candidates, resolution)
    if sensitivity not in ("auto", "kld", "mse", "layer"):
        raise ValueError(f"autoquant: sensitivity={sensitivity!r} must be 'auto', 'kld' or 'mse' (the layer's "
                         "measured effect on the model's output) or 'layer' (its own output error)")
    layers = _select(model, filter_fn, candidates)
    hessians = _input_covariances(model, layers, calibration_data, progress)
    choices = [_measure(model, fqn, layers[fqn], hessians.pop(fqn), candidates) for fqn in layers]
    if isinstance(sensitivity_items, bool) or not isinstance(sensitivity_items, int) or sensitivity_items < 1:
        raise ValueError(f"autoquant: sensitivity_items={sensitivity_items!r} must be an int >= 1")
    if sensitivity != "layer":
        items = list(calibration_data)[:sensitivity_items]
        choices = _in_model_units(model, layers, choices, candidates, items, sensitivity, progress)
    if report is not None:
        report.extend(choices)
    picks = _knapsack(choices, budget_bits, resolution)
    return FqnToConfig({c.fqn: candidates[i] for c, i in zip(choices, picks, strict=True)})


def autoquant_report(plan: FqnToConfig, choices: Sequence[LayerChoice], candidates: Sequence[QuantConfig]) -> dict:
    """{"bpw": bits per weight of the plan, "loss": its summed loss, "counts": {candidate repr: layers}}."""
    idx = {c.fqn: list(candidates).index(plan.fqn_to_config[c.fqn]) for c in choices}
    bits = sum(c.bits[idx[c.fqn]] for c in choices)
    counts: dict[str, int] = {}
    for c in choices:
        key = repr(candidates[idx[c.fqn]])
        counts[key] = counts.get(key, 0) + 1
    return {"bpw": bits / sum(c.numel for c in choices), "loss": sum(c.loss[idx[c.fqn]] for c in choices),
            "counts": counts}


# -- steps -----------------------------------------------------------------------------------------------


def _check_args(budget_bits, candidates, resolution) -> None:
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float)) or not (
            math.isfinite(budget_bits) and budget_bits > 0):
        raise ValueError(f"autoquant: budget_bits={budget_bits!r} must be a positive number of bits per weight, "
                         "e.g. 4.5")
    if not candidates:
        raise ValueError("autoquant: candidates is empty; pass weight configs, or None for DEFAULT_CANDIDATES")
    for c in candidates:
        if not isinstance(c, QuantConfig) or isinstance(c, FqnToConfig) or getattr(c, "needs_data", False):
            raise ValueError(f"autoquant: candidate {c!r} must be a weight config such as "
                             "Int4WeightOnlyConfig(group_size=64), or a calibration-free algorithm around one "
                             "(HQQConfig, ImportanceWeightedConfig with its importance given); not an algorithm "
                             "needing calibration data, nor FqnToConfig")
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


def _input_covariances(model, layers, calibration_data, progress) -> dict[str, torch.Tensor]:
    """H = X^T X / T float64 [K, K] of the inputs each layer receives in the float model."""
    items = list(calibration_data) if calibration_data is not None else []
    if not items:
        raise ValueError("autoquant: calibration_data is empty; pass an iterable of model inputs, e.g. "
                         "affineq.models.calibration_batches(tokenizer)")
    sums = {f: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for f, m in layers.items()}
    tokens = dict.fromkeys(layers, 0)

    def hook(fqn):
        def add(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[fqn] += (x.T @ x).to("cpu", torch.float64)
            tokens[fqn] += x.shape[0]
        return add

    handles = [m.register_forward_pre_hook(hook(f)) for f, m in layers.items()]
    try:
        with torch.no_grad():
            for i, item in enumerate(_bar(items, progress)):
                _call(model, item, i)
    finally:
        for h in handles:
            h.remove()
    missing = [f for f, t in tokens.items() if t == 0]
    if missing:
        raise ValueError(f"autoquant: no calibration input reached {missing}; pass inputs that run them, or leave "
                         "them out with filter_fn")
    return {f: sums[f] / tokens[f] for f in layers}


def _call(model: nn.Module, item, index: int):
    if isinstance(item, torch.Tensor):
        return model(item)
    if isinstance(item, tuple):
        return model(*item)
    if isinstance(item, dict):
        return model(**item)
    raise ValueError(f"autoquant: calibration item {index} is a {type(item).__name__}: pass tensors (model(x)), "
                     "tuples (model(*x)) or dicts (model(**x))")


def _bar(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # an optional extra: no bar without it
        return items
    return tqdm(items, desc="autoquant", file=sys.stderr, leave=False)


def _measure(model: nn.Module, fqn: str, layer: nn.Linear, h: torch.Tensor, candidates) -> LayerChoice:
    w = layer.weight.detach()
    bits, loss = [], []
    for c in candidates:
        if c.check(layer) is not None:
            bits.append(None)
            loss.append(None)
            continue
        if isinstance(c, AlgorithmConfig):  # calibration-free (HQQ, importance given): its run on this layer alone
            qw = c.run(model, {fqn: layer}, None)[fqn].quantize_weight(w, layer)
        else:
            qw = c.quantize_weight(w, layer)
        d = (w.double() - qw.dequantize(torch.float64))
        bits.append(int(qw.storage_bytes()) * 8)
        loss.append(float(((d @ h) * d).sum()))
    return LayerChoice(fqn, w.numel(), tuple(bits), tuple(loss))


def _in_model_units(model, layers, choices, candidates, items: list, sensitivity: str,
                    progress: bool) -> list[LayerChoice]:
    """Each layer's losses times div(model with its smallest candidate alone) / e(smallest candidate)."""
    with torch.no_grad():
        reference = [_output(_call(model, item, i), sensitivity) for i, item in enumerate(items)]
    scaled = []
    for c in _bar(choices, progress):
        layer = layers[c.fqn]
        i = min(c.options(), key=lambda j, c=c: (c.bits[j], -c.loss[j]))
        w = layer.weight.data
        cand = candidates[i]
        if isinstance(cand, AlgorithmConfig):
            qw = cand.run(model, {c.fqn: layer}, None)[c.fqn].quantize_weight(w, layer)
        else:
            qw = cand.quantize_weight(w, layer)
        layer.weight.data = qw.dequantize(w.dtype)
        try:
            with torch.no_grad():
                div = sum(_divergence(ref, _output(_call(model, item, k), sensitivity))
                          for k, (ref, item) in enumerate(zip(reference, items, strict=True))) / len(items)
        finally:
            layer.weight.data = w
        gain = div / c.loss[i] if c.loss[i] > 0 else 0.0
        scaled.append(LayerChoice(c.fqn, c.numel, c.bits, tuple(None if v is None else v * gain for v in c.loss)))
    return scaled


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


def _divergence(ref: tuple[torch.Tensor, bool], out: tuple[torch.Tensor, bool]) -> float:
    """Mean over tokens of KL(softmax(ref) || softmax(out)) for logits; else ||out - ref||^2 / ||ref||^2."""
    r, o = ref[0].double(), out[0].double()
    if ref[1]:
        lp, lq = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
        return float((lp.exp() * (lp - lq)).sum(-1).mean())
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
