"""Importance-weighted round-to-nearest: each group's qparams searched to minimise the rounding error weighted
by an importance matrix (`imatrix.py`: imp[k] = E[x_k^2] of the layer's input column k, llama.cpp's imatrix).
Per group G of a row (the spec's block (1, g)):

    minimise  sum_{k in G} imp[k] * (w[k] - dq(q(w[k])))^2

over candidate qparams: round-to-nearest's min/max qparams (always the first candidate, so no group ends worse
than RTN in this measure), min/max of w * r for each clipping ratio r in `ratios` (the range shrunk toward 0),
and with `refit` for each of these the weighted least-squares (scale, zero point) of the codes it gives:

    asymmetric (free zero point):  s = cov_a(q, w) / var_a(q),  z = mean_a(q) - mean_a(w) / s
    symmetric (fixed zero point z): s = sum a w (q - z) / sum a (q - z)^2       (a = imp, weighted moments)

Every candidate is rounded to what the base config's format stores (bf16 scales, integer zero points...) and
measured with the math of `quantize_affine` / `dequantize_affine` (unvalidated, for speed); the weight is then
stored with the winner through `from_qparams`: codes and kernels are the base config's, only the qparams differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from affineq.algorithms._base import AlgorithmConfig, Precomputed
from affineq.algorithms.gptq import _one_thread
from affineq.algorithms.hqq import _Stored
from affineq.algorithms.imatrix import (
    ImportanceMatrix,
    checked_importance,
    collect_importance,
    importance_of,
    json_safe_importance,
    resolve_importance,
)
from affineq.configs import QuantConfig
from affineq.configs.kquant import KQuantConfig, quantize_kquant
from affineq.model_inputs import progress
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QParamOptions, QuantSpec

__all__ = ["DEFAULT_RATIOS", "ImportanceWeightedConfig", "importance_weighted_qparams",
           "importance_weighted_quantize"]

#: Clipping ratios searched by default: the range of each group shrunk by 0 .. 30% in steps of 2%.
DEFAULT_RATIOS: tuple[float, ...] = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))

# -- the per-weight search -------------------------------------------------------------------------------


def importance_weighted_qparams(weight: torch.Tensor, importance: torch.Tensor, spec: QuantSpec,
                                options: QParamOptions | None = None, *, ratios: tuple[float, ...] = DEFAULT_RATIOS,
                                refit: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero_point) [n_blocks], as `spec`'s format stores them, minimising each group's
    sum imp[k] (w[k] - dq(q(w[k])))^2 over the candidates of the module docstring.

    weight: [N, K] float; importance: [K] (>= 0); spec: integer codes in row-wise blocks (1, g); options: the base
    config's `qparam_options()` (scale dtype, rounding...)."""
    options = options or QParamOptions()
    _check_weight(weight, importance, spec)
    if weight.numel() <= _SMALL:
        with _one_thread():
            return _search(weight, importance, spec, options, ratios, refit)
    return _search(weight, importance, spec, options, ratios, refit)


#: weights up to this many elements are searched on one thread: their ops are too small to split, and the
#: thread hand-offs cost milliseconds per op on a loaded machine
_SMALL = 1 << 16


def _search(weight, importance, spec, options, ratios, refit):
    g = spec.block_size[1]
    w = weight.detach().float()
    wg = w.reshape(-1, g)
    a = importance.detach().to(w.device, torch.float32).reshape(1, -1).expand(w.shape).reshape(-1, g)
    st = _Stored(spec, options)

    def measure(scale, zp):
        q, w_r = st.roundtrip(wg, scale, zp, options.rounding)  # the primitives' math, unvalidated (fast)
        d = wg - w_r
        return q, (a * d * d).sum(1, dtype=torch.float64)

    best = AffineQuantizedTensor.stored_qparams(weight.detach(), spec, options)  # round-to-nearest first
    _, best_err = measure(*best)

    def keep(cand, err):
        nonlocal best, best_err
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = (_pick(better, cand[0], best[0]), None if cand[1] is None else _pick(better, cand[1], best[1]))

    for r in ratios:
        cand = AffineQuantizedTensor.stored_qparams(w * r, spec, options)
        q, err = measure(*cand)
        keep(cand, err)
        if refit:
            fit = _refit(st, spec, wg, a, cand, q)
            keep(fit, measure(*fit)[1])
    return best


def _pick(better: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new` where `better` [n_blocks], else `old` (qparams in any shape with n_blocks elements; old's kept)."""
    return torch.where(better, new.reshape(-1).to(old.dtype), old.reshape(-1)).reshape(old.shape)


def _refit(st: _Stored, spec: QuantSpec, wg: torch.Tensor, a: torch.Tensor, cand, q: torch.Tensor):
    """The weighted least-squares (scale, zero point) of groups wg [R, g] for their codes q [R, g], stored."""
    s, z = st.as_code_units(*cand)
    if spec.mapping_type is MappingType.ASYMMETRIC and st.domain is not ZeroPointDomain.NONE:
        sa = a.sum(1, keepdim=True)
        qm, wm = (a * q).sum(1, keepdim=True) / sa, (a * wg).sum(1, keepdim=True) / sa
        cov = (a * (q - qm) * (wg - wm)).sum(1, keepdim=True)
        var = (a * (q - qm) ** 2).sum(1, keepdim=True)
        ok = (sa > 0) & (var > 0) & (cov > 0)
        s_new = torch.where(ok, cov / var.clamp_min(1e-30), s)
        z = torch.where(ok, qm - wm / s_new, z)
    else:  # the zero point is fixed: scale only
        c = q - z
        num, den = (a * wg * c).sum(1, keepdim=True), (a * c * c).sum(1, keepdim=True)
        s_new = torch.where((den > 0) & (num > 0), num / den.clamp_min(1e-30), s)
    return st.store(s_new, z)


def importance_weighted_quantize(weight: torch.Tensor, importance: torch.Tensor, spec: QuantSpec,
                                 options: QParamOptions | None = None, *, ratios: tuple[float, ...] = DEFAULT_RATIOS,
                                 refit: bool = True) -> AffineQuantizedTensor:
    """`weight` [N, K] stored as `spec` with `importance_weighted_qparams`."""
    options = options or QParamOptions()
    scale, zp = importance_weighted_qparams(weight, importance, spec, options, ratios=ratios, refit=refit)
    return AffineQuantizedTensor.from_qparams(weight.detach(), scale, zp, spec, rounding=options.rounding)


def _check_weight(weight: torch.Tensor, importance: Any, spec: QuantSpec) -> None:
    if weight.dim() != 2 or len(spec.block_size) != 2 or spec.block_size[0] != 1 or spec.target.is_float:
        raise ValueError(f"importance-weighted quantization takes 2-D weights with integer codes in row-wise groups "
                         f"(block (1, g)); got shape {tuple(weight.shape)}, block {spec.block_size}, target "
                         f"{spec.target}")
    if spec.scale_type is not None:
        raise ValueError(f"importance-weighted quantization searches float scales; scale_type={spec.scale_type} "
                         "(power-of-two scales) is not supported: use scale_type=None")
    k = weight.shape[1]
    if not isinstance(importance, torch.Tensor) or tuple(importance.shape) != (k,):
        got = tuple(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"importance must be a tensor [in_features] = [{k}] for a weight of shape "
                         f"{tuple(weight.shape)}, got {got}")


# -- the config ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportanceWeightedConfig(AlgorithmConfig):
    """Round-to-nearest with each group's qparams searched to minimise the importance-weighted error (module
    docstring). The stored weight is the base config's format (its kernels run it).

    base_config: Int4WeightOnlyConfig, IntxWeightOnlyConfig (float scales), Int8WeightOnlyConfig,
        Int8DynamicActivationInt4WeightConfig, or KQuantConfig (its own weighted search, `quantize_kquant`;
        ratios and refit do not apply).
    importance: an `ImportanceMatrix` (from `collect_importance`), the path of one saved with
        `ImportanceMatrix.save`, or None: collected from `quantize_`'s calibration_data (then needed).
    ratios: clipping ratios searched, each in (0, 2] (`DEFAULT_RATIOS`: 1.0 down to 0.70).
    refit: also try each candidate's weighted least-squares scale (and zero point).
    progress: a tqdm bar over the layers when tqdm is installed.

        imatrix = collect_importance(model, batches)
        quantize_(model, ImportanceWeightedConfig(Int4WeightOnlyConfig(group_size=64), importance=imatrix))
    """

    importance: ImportanceMatrix | str | None = None
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    refit: bool = True
    progress: bool = True

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "importance", checked_importance(type(self).__name__, self.importance))
        if isinstance(self.ratios, list):
            object.__setattr__(self, "ratios", tuple(self.ratios))
        r = self.ratios
        if (not isinstance(r, tuple) or not r or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 2 for x in r)):
            raise ValueError(f"ImportanceWeightedConfig(ratios={r!r}) must be a non-empty tuple of clipping ratios "
                             "in (0, 2], e.g. (1.0, 0.95, 0.9)")
        for name in ("refit", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ImportanceWeightedConfig({name}={getattr(self, name)!r}) must be True or False")
        if getattr(self.base_config, "scale_type", None) is not None:
            raise ValueError(f"ImportanceWeightedConfig searches float scales; base_config.scale_type="
                             f"{self.base_config.scale_type!r} (power-of-two scales) is not supported")

    def cannot_wrap(self, base: QuantConfig) -> str | None:
        if isinstance(base, KQuantConfig):  # k-quants run their own weighted search (`quantize_kquant`)
            return None
        return super().cannot_wrap(base)

    @property
    def needs_data(self) -> bool:  # type: ignore[override]
        return self.importance is None

    def to_dict(self) -> dict:
        json_safe_importance(type(self).__name__, self.importance)
        return super().to_dict()

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        imp = self._importance(model, layers, data)
        out: dict[str, QuantConfig] = {}
        options = self.base_config.qparam_options()
        for fqn, layer in progress(layers.items(), "importance-weighted RTN", self.progress, total=len(layers)):
            w = layer.weight.detach()
            spec = self.base_config.weight_spec(w, layer)
            imp_w = importance_of(type(self).__name__, imp, fqn, w.shape[1])
            if isinstance(self.base_config, KQuantConfig):
                qw = quantize_kquant(w, self.base_config.kind, imp_w)
            else:
                qw = importance_weighted_quantize(w, imp_w, spec, options, ratios=self.ratios, refit=self.refit)
            out[fqn] = Precomputed(base=self.base_config, weight=qw)
        return out

    def _importance(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> Mapping:
        if self.importance is not None:
            return resolve_importance(self.importance)
        imp = collect_importance(model, data, layers=layers, progress_bar=self.progress)
        missing = [f for f in layers if f not in imp]
        if missing:
            raise ValueError(f"ImportanceWeightedConfig: no calibration input reached {missing}; pass inputs that "
                             "run the layers being quantized, or leave them out with filter_fn")
        return imp
