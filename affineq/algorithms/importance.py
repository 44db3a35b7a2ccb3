"""Importance-weighted quantization: an importance matrix from calibration data (llama.cpp's imatrix) and the
round-to-nearest whose per-group scale search minimises the error weighted by it.

For a linear y = x W^T with inputs x [T, K], the output error of a rounded weight W_r is
E||x (W - W_r)^T||^2, whose diagonal part is sum_k E[x_k^2] (W[n, k] - W_r[n, k])^2 per row n. The importance
of column k is that E[x_k^2] (`collect_importance`: the mean of x_k^2 over every calibration token reaching
the layer, as llama.cpp's `llama-imatrix` computes it). Per group G of a row (the spec's block (1, g)):

    minimise  sum_{k in G} imp[k] * (w[k] - dq(q(w[k])))^2

over candidate qparams: round-to-nearest's min/max qparams (always the first candidate, so no group ends worse
than RTN in this measure), min/max of w * r for each clipping ratio r in `ratios` (the range shrunk toward 0),
and with `refit` for each of these the weighted least-squares (scale, zero point) of the codes it gives:

    asymmetric (free zero point):  s = cov_a(q, w) / var_a(q),  z = mean_a(q) - mean_a(w) / s
    symmetric (fixed zero point z): s = sum a w (q - z) / sum a (q - z)^2       (a = imp, weighted moments)

Every candidate is rounded to what the base config's format stores (bf16 scales, integer zero points...) and
measured with `quantize_affine` / `dequantize_affine`, then the weight is stored with the winner through
`from_qparams`: codes and kernels are the base config's; only the qparams differ.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from affineq.algorithms._base import AlgorithmConfig, Precomputed
from affineq.algorithms._capture import call_model, progress, record_linear_inputs
from affineq.algorithms.gptq import _one_thread
from affineq.algorithms.hqq import _Stored
from affineq.configs import (
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    QuantConfig,
)
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QParamOptions, QuantSpec

__all__ = ["DEFAULT_RATIOS", "ImportanceMatrix", "ImportanceWeightedConfig", "collect_importance",
           "importance_weighted_qparams", "importance_weighted_quantize"]

#: Clipping ratios searched by default: the range of each group shrunk by 0 .. 30% in steps of 2%.
DEFAULT_RATIOS: tuple[float, ...] = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))

_FILE_FORMAT = "affineq.importance"
_FILE_VERSION = "1"


class ImportanceMatrix(Mapping):
    """{layer fqn: mean of x^2 per input column, float32 [in_features]} with the token count behind each
    entry. A read-only mapping (`dict(imatrix)` is a plain dict of tensors); `save(path)` / `load(path)`
    write and read a safetensors file. Equal only to itself (configs holding it hash by identity)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self, values: Mapping[str, torch.Tensor], tokens: Mapping[str, int] | None = None) -> None:
        if not isinstance(values, Mapping):
            raise ValueError(f"ImportanceMatrix(values=...) must map layer names to tensors, got "
                             f"{type(values).__name__}")
        checked = {}
        for fqn, v in values.items():
            if not isinstance(fqn, str) or not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.numel():
                raise ValueError(f"importance[{fqn!r}] must be a non-empty 1-D tensor (one value per input column) "
                                 f"keyed by the layer's name, got {type(v).__name__} "
                                 f"{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")
            v = v.detach().float()
            if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
                raise ValueError(f"importance[{fqn!r}] holds negative or non-finite values; importances are means "
                                 "of x^2 (>= 0, finite): collect them with collect_importance")
            checked[fqn] = v
        self._values = checked
        tokens = dict(tokens or {})
        if set(tokens) - set(checked):
            raise ValueError(f"ImportanceMatrix: token counts for layers without values: "
                             f"{sorted(set(tokens) - set(checked))}")
        self.tokens: dict[str, int] = {k: int(tokens.get(k, 0)) for k in checked}

    def __getitem__(self, fqn: str) -> torch.Tensor:
        return self._values[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ImportanceMatrix({len(self)} layers, {max(self.tokens.values(), default=0)} tokens)"

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file: one float32 tensor per layer, the token counts in the header."""
        st = _safetensors()
        meta = {"format": _FILE_FORMAT, "version": _FILE_VERSION, "tokens": json.dumps(self.tokens)}
        st.torch.save_file({k: v.contiguous() for k, v in self._values.items()}, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ImportanceMatrix:
        """Read a file written by `save` (ValueError naming the file when it is not one)."""
        st, where = _safetensors(), os.fspath(path)
        if not os.path.isfile(where):
            raise ValueError(f"importance file {where!r} does not exist; write it with ImportanceMatrix.save(path)")
        try:
            with st.safe_open(where, framework="pt") as f:
                meta = f.metadata() or {}
                values = {k: f.get_tensor(k) for k in f.keys()}
        except st.SafetensorError as e:
            raise ValueError(f"{where} is not a readable safetensors file ({e}); write it again") from None
        if meta.get("format") != _FILE_FORMAT or meta.get("version") != _FILE_VERSION:
            raise ValueError(f"{where} is not an affineq importance file (version {_FILE_VERSION}); its header says "
                             f"format={meta.get('format')!r}, version={meta.get('version')!r}")
        return cls(values, json.loads(meta.get("tokens", "{}")))


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("saving an importance matrix needs the safetensors package: pip install "
                          "safetensors") from None
    return safetensors


def collect_importance(model: nn.Module, calibration_data, *,
                       filter_fn: Callable[[nn.Module, str], bool] | None = None,
                       layers: Mapping[str, nn.Module] | None = None, progress_bar: bool = True) -> ImportanceMatrix:
    """The importance matrix of `model`'s linears: run `model` on every calibration item (a tensor: model(x),
    tuple: model(*x), dict: model(**x)) and average x^2 per input column over all tokens each linear receives.

    filter_fn(module, fqn): which modules (default every nn.Linear); or `layers`, {fqn: module} directly.
    A layer no item reaches is left out with a warning. The model is not changed."""
    if layers is None:
        layers = {fqn: m for fqn, m in model.named_modules()
                  if isinstance(m, nn.Linear) and (filter_fn is None or filter_fn(m, fqn))}
    elif filter_fn is not None:
        raise ValueError("collect_importance: pass filter_fn or layers, not both")
    if not layers:
        raise ValueError("collect_importance: no nn.Linear selected; check filter_fn")
    items = list(calibration_data) if calibration_data is not None else []
    if not items:
        raise ValueError("collect_importance: calibration_data is empty; pass an iterable of model inputs, e.g. "
                         "affineq.models.calibration_batches(tokenizer)")
    sums = {fqn: torch.zeros(m.in_features, dtype=torch.float64) for fqn, m in layers.items()}
    tokens = dict.fromkeys(layers, 0)

    def add(fqn: str, x: torch.Tensor) -> None:
        sums[fqn] += x.float().pow(2).sum(0).to("cpu", torch.float64)
        tokens[fqn] += x.shape[0]

    with record_linear_inputs(dict(layers), add), torch.no_grad():
        for i, item in enumerate(progress(items, "importance", progress_bar)):
            call_model(model, item, i)
    missing = [f for f, t in tokens.items() if t == 0]
    if missing:
        warnings.warn(f"collect_importance: no calibration input reached {missing}; they have no importance",
                      stacklevel=2)
    return ImportanceMatrix({f: (sums[f] / tokens[f]).float() for f in layers if tokens[f]},
                            {f: t for f, t in tokens.items() if t})


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

    base_config: Int4WeightOnlyConfig, IntxWeightOnlyConfig (float scales), Int8WeightOnlyConfig or
        Int8DynamicActivationInt4WeightConfig.
    importance: an `ImportanceMatrix` (from `collect_importance`), the path of one saved with
        `ImportanceMatrix.save`, or None: collected from `quantize_`'s calibration_data (then needed).
    ratios: clipping ratios searched, each in (0, 2] (`DEFAULT_RATIOS`: 1.0 down to 0.70).
    refit: also try each candidate's weighted least-squares scale (and zero point).
    progress: a tqdm bar over the layers when tqdm is installed.

        imatrix = collect_importance(model, batches)
        quantize_(model, ImportanceWeightedConfig(Int4WeightOnlyConfig(group_size=64), importance=imatrix))
    """

    base_types: ClassVar[tuple[type, ...]] = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, Int8WeightOnlyConfig,
                  Int8DynamicActivationInt4WeightConfig)
    importance: ImportanceMatrix | str | None = None
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    refit: bool = True
    progress: bool = True

    def __post_init__(self):
        super().__post_init__()
        imp = self.importance
        if isinstance(imp, os.PathLike):
            object.__setattr__(self, "importance", os.fspath(imp))
        elif isinstance(imp, Mapping) and not isinstance(imp, ImportanceMatrix):
            object.__setattr__(self, "importance", ImportanceMatrix(imp))
        elif not (imp is None or isinstance(imp, (str, ImportanceMatrix))):
            raise ValueError(f"ImportanceWeightedConfig(importance={type(imp).__name__}) must be an ImportanceMatrix "
                             "(collect_importance), the path of a saved one, or None (collected from "
                             "calibration_data)")
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

    @property
    def needs_data(self) -> bool:  # type: ignore[override]
        return self.importance is None

    def to_dict(self) -> dict:
        if isinstance(self.importance, ImportanceMatrix):
            raise ValueError("ImportanceWeightedConfig holds an in-memory ImportanceMatrix, which JSON cannot hold: "
                             "save it with imatrix.save('imatrix.safetensors') and pass "
                             "importance='imatrix.safetensors'")
        return super().to_dict()

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        imp = self._importance(model, layers, data)
        out: dict[str, QuantConfig] = {}
        options = self.base_config.qparam_options()
        for fqn, layer in progress(layers.items(), "importance-weighted RTN", self.progress, total=len(layers)):
            if fqn not in imp:
                some = ", ".join(repr(k) for k in list(imp)[:3])
                raise ValueError(f"ImportanceWeightedConfig: the importance matrix has no entry for {fqn!r} (it has "
                                 f"{len(imp)}: {some}...); collect it on this model (collect_importance(model, "
                                 "data)) or leave the layer out with filter_fn")
            w = layer.weight.detach()
            spec = self.base_config.weight_spec(w, layer)
            if tuple(imp[fqn].shape) != (w.shape[1],):
                raise ValueError(f"ImportanceWeightedConfig: importance[{fqn!r}] has shape {tuple(imp[fqn].shape)}, "
                                 f"the layer has {w.shape[1]} input columns; collect it on this model")
            qw = importance_weighted_quantize(w, imp[fqn], spec, options, ratios=self.ratios, refit=self.refit)
            out[fqn] = Precomputed(base=self.base_config, weight=qw)
        return out

    def _importance(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> Mapping:
        if isinstance(self.importance, str):
            return ImportanceMatrix.load(self.importance)
        if self.importance is not None:
            return self.importance
        imp = collect_importance(model, data, layers=layers, progress_bar=self.progress)
        missing = [f for f in layers if f not in imp]
        if missing:
            raise ValueError(f"ImportanceWeightedConfig: no calibration input reached {missing}; pass inputs that "
                             "run the layers being quantized, or leave them out with filter_fn")
        return imp
