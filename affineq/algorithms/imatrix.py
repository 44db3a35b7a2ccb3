"""Importance matrices (llama.cpp's imatrix): for each linear, the mean of x_k^2 over every calibration token
that reaches it, per input column k. With inputs x [T, K], the output error of a rounded weight W_r is
E||x (W - W_r)^T||^2, whose diagonal part weights column k's squared rounding error by E[x_k^2]; the
importance-weighted round-to-nearest (`importance.py`) and HQQ (`hqq.py`) minimise that weighted error.

    imatrix = collect_importance(model, calibration_batches)   # {fqn: float32 [in_features]}
    imatrix.save("imatrix.safetensors"); ImportanceMatrix.load("imatrix.safetensors")
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from affineq.algorithms._capture import record_linear_inputs
from affineq.eval import eval_mode
from affineq.model_inputs import call_model, progress

__all__ = ["ImportanceMatrix", "collect_importance", "checked_importance", "importance_of", "json_safe_importance",
           "resolve_importance"]

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
    A layer no item reaches is left out with a warning. The model is not changed (it runs in eval mode;
    each module's training flag is restored)."""
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

    # eval mode: "the model is not changed" includes BatchNorm running statistics (and dropout stays off)
    with record_linear_inputs(dict(layers), add), torch.no_grad(), eval_mode(model):
        for i, item in enumerate(progress(items, "importance", progress_bar)):
            call_model(model, item, i)
    missing = [f for f, t in tokens.items() if t == 0]
    if missing:
        warnings.warn(f"collect_importance: no calibration input reached {missing}; they have no importance",
                      stacklevel=2)
    return ImportanceMatrix({f: (sums[f] / tokens[f]).float() for f in layers if tokens[f]},
                            {f: t for f, t in tokens.items() if t})


def checked_importance(who: str, importance):
    """A config's `importance` argument validated: None, a path (str), or an ImportanceMatrix (a plain mapping
    of tensors is wrapped into one)."""
    if isinstance(importance, os.PathLike):
        return os.fspath(importance)
    if isinstance(importance, Mapping) and not isinstance(importance, ImportanceMatrix):
        return ImportanceMatrix(importance)
    if importance is None or isinstance(importance, (str, ImportanceMatrix)):
        return importance
    raise ValueError(f"{who}(importance={type(importance).__name__}) must be an ImportanceMatrix (collect_importance), "
                     "the path of a saved one, or None")


def resolve_importance(importance) -> Mapping[str, torch.Tensor]:
    """The matrix a config's checked `importance` names (a path is loaded)."""
    return ImportanceMatrix.load(importance) if isinstance(importance, str) else importance


def importance_of(who: str, imp: Mapping[str, torch.Tensor], fqn: str, in_features: int) -> torch.Tensor:
    """imp[fqn], checked to be [in_features] (ValueError naming the layer and the fix)."""
    if fqn not in imp:
        some = ", ".join(repr(k) for k in list(imp)[:3])
        raise ValueError(f"{who}: the importance matrix has no entry for {fqn!r} (it has {len(imp)}: {some}...); "
                         "collect it on this model (collect_importance(model, data)) or leave the layer out with "
                         "filter_fn")
    v = imp[fqn]
    if tuple(v.shape) != (in_features,):
        raise ValueError(f"{who}: importance[{fqn!r}] has shape {tuple(v.shape)}, the layer has {in_features} input "
                         "columns; collect it on this model")
    return v


def json_safe_importance(who: str, importance) -> None:
    """ValueError when `importance` is an in-memory matrix, which a config's JSON cannot hold."""
    if isinstance(importance, ImportanceMatrix):
        raise ValueError(f"{who} holds an in-memory ImportanceMatrix, which JSON cannot hold: save it with "
                         "imatrix.save('imatrix.safetensors') and pass importance='imatrix.safetensors'")
