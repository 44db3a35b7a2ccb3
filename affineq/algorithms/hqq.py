"""HQQ: calibration-free half-quadratic optimisation of each group's zero point (and scale).

Badri and Shaji 2023, "Half-Quadratic Quantization of Large Machine Learning Models". Per group of `g`
weights `W` (one row of `[R, g]`), in code units (`s` the step, `z` the code that stands for 0)::

    W_q = clamp(round(W / s + z), qmin, qmax)          quantize
    W_r = s * (W_q - z)                                dequantize
    minimise  ||W - W_r||_p^p   with p = lp_norm < 1   (robust to the heavy tails of LLM weights)

The l_p loss is non-convex and non-smooth, so HQQ splits it with an extra variable `W_e` (the error) and a
quadratic coupling of weight `beta`::

    min_{z, W_e}  ||W_e||_p^p + beta/2 * ||W_e - (W - s (W_q - z))||_2^2

and alternates the two closed-form half-steps, with `beta <- kappa * beta` after each iteration:

1. shrinkage (the proximal operator of |.|^p, generalised soft-thresholding), elementwise::

       W_e = sign(E) * relu(|E| - |E|^(p-1) / beta),   E = W - W_r

   Small errors become 0 (they are "explained" by the quantizer); large ones (outliers) stay in W_e and
   do not pull the fit. `beta` is in weight units: with the defaults (beta=10, p=0.7) only |E| above
   beta^(-1/(2-p)) ~ 0.17 survive, so ordinary LLM weights get a plain least-squares fit, outliers not.
2. zero point, the least-squares fit of the target T = W - W_e with W_q fixed::

       z = mean(W_q - T / s)                      (optimize_scale=False: the paper's update)
       (s, z) = argmin ||T - s (W_q - z)||^2      (optimize_scale=True: a linear regression of T on W_q,
              s = cov(W_q, T) / var(W_q),  z = mean(W_q) - mean(T) / s; kept where s > 0)

   A symmetric base has no free zero point (z = 0, or the fixed middle code of unsigned codes): HQQ then
   fits the scale only, s = <T, W_q - z> / <W_q - z, W_q - z>, which needs optimize_scale=True.

Every iterate is first rounded to what the packing format stores (`represent_qparams`: bf16 scales, an
integer zero point rounded and clamped to the code range for ZeroPointDomain.INT, the FLOAT-domain offset
`zp = s (mid - z)`), and W_q / W_r / the error are computed from the stored values with the primitives' own
formulas. Each group keeps its best stored iterate (iterate 0 is min-max round-to-nearest, so no group ends
worse than RTN in that measure) by `keep_best_by`: "mse" (default), sum (W - W_r)^2, or "lp", the l_p loss
above (the paper's objective). Why MSE by default: on SmolLM2-135M (int3 g64, INT zero point) keeping the
l_p-best iterate raised perplexity above RTN (ppl 39.1 vs 36.1 on 2048 tokens) while keeping the MSE-best
lowered it (34.1): p < 1 forgives a few large errors, and the large (clipped) weights are the ones that
matter to the model. The weight is then quantized with `from_qparams` using the kept qparams, so
`dequantize()` is exactly the W_r that was measured. Everything is vectorised over the
`[R, g]` groups of a weight; one Python loop over the iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from affineq.algorithms._base import AlgorithmConfig, Precomputed, represent_qparams
from affineq.algorithms.imatrix import (
    ImportanceMatrix,
    checked_importance,
    importance_of,
    json_safe_importance,
    resolve_importance,
)
from affineq.configs import (
    QuantConfig,
)
from affineq.expert_weights import expert_parameter_names, is_expert_module, quantize_expert_weight
from affineq.model_inputs import progress as _progress
from affineq.primitives import MappingType, ZeroPointDomain, default_eps, fake_quantize_unchecked
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QParamOptions, QuantSpec

__all__ = ["HQQConfig", "hqq_quantize", "hqq_qparams"]


@dataclass(frozen=True)
class HQQConfig(AlgorithmConfig):
    """Calibration-free HQQ around a weight config (see the module docstring for the formulation).

    base_config: a config with min/max integer qparams per row or group (`AlgorithmConfig.cannot_wrap`), e.g.
        Int4WeightOnlyConfig (asymmetric, float zero point: the natural fit), IntxWeightOnlyConfig
        (int1..int8; asymmetric with an INT or FLOAT zero point, or symmetric: scale only),
        Int8WeightOnlyConfig or Int8DynamicActivationInt4WeightConfig (symmetric: scale only).
    iters: half-quadratic iterations per weight (20). lp_norm: p of the l_p loss, in (0, 1] (0.7).
    beta: initial coupling weight, in weight units (10). kappa: beta's growth per iteration, >= 1 (1.01).
    optimize_scale: also refit the scale at each step (True), or the zero point only as in the paper
        (False; not allowed for symmetric bases, whose only free parameter is the scale; with an INT
        zero point, which is rounded to a code, the zero point alone rarely moves off round-to-nearest).
    keep_best_by: "mse" (default) or "lp": the error by which each group keeps its best iterate.
    importance: None (every weight counts alike), or an importance matrix (`collect_importance`, or the path of
        a saved one): column k's errors are weighted by imp[k] / mean(imp) in the coupling, the fit and the
        keep-best error (see `hqq_qparams`). HQQ stays calibration-free: the matrix is computed beforehand.
    progress: a tqdm bar over the layers when tqdm is installed.

        quantize_(model, HQQConfig(Int4WeightOnlyConfig(group_size=64)), filter_fn=...)  # no data
    """

    needs_data: ClassVar[bool] = False
    expert_weights: ClassVar[bool] = True
    iters: int = 20
    lp_norm: float = 0.7
    beta: float = 1e1
    kappa: float = 1.01
    optimize_scale: bool = True
    keep_best_by: str = "mse"
    importance: ImportanceMatrix | str | None = None
    progress: bool = True

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "importance", checked_importance(type(self).__name__, self.importance))
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"HQQConfig(iters={self.iters!r}) must be an int >= 0 (20 is the paper's; 0 keeps "
                             "round-to-nearest)")
        for name, lo, hi in (("lp_norm", 0.0, 1.0), ("beta", 0.0, None), ("kappa", 1.0, None)):
            v = getattr(self, name)
            bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            if not bad:
                bad = (v <= lo if name != "kappa" else v < lo) or (hi is not None and v > hi)
            if bad:
                want = {"lp_norm": "a number in (0, 1], e.g. 0.7", "beta": "a positive number, e.g. 10.0",
                        "kappa": "a number >= 1, e.g. 1.01"}[name]
                raise ValueError(f"HQQConfig({name}={v!r}) must be {want}")
        if self.keep_best_by not in ("mse", "lp"):
            raise ValueError(f"HQQConfig(keep_best_by={self.keep_best_by!r}) must be 'mse' (default) or 'lp' (the "
                             "l_p loss of the splitting, as in the paper)")
        for name in ("optimize_scale", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HQQConfig({name}={getattr(self, name)!r}) must be True or False")
        if not self.optimize_scale and _zero_point_is_fixed(self.base_config):
            raise ValueError(f"HQQConfig(optimize_scale=False) with a symmetric {type(self.base_config).__name__}: "
                             "its zero point is fixed, so only the scale can be optimised; pass "
                             "optimize_scale=True or an asymmetric base config")

    def to_dict(self) -> dict:
        json_safe_importance(type(self).__name__, self.importance)
        return super().to_dict()

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        out: dict[str, QuantConfig] = {}
        imp = None if self.importance is None else resolve_importance(self.importance)
        for fqn, layer in _progress(layers.items(), "HQQ", self.progress, total=len(layers)):
            if is_expert_module(layer):  # each expert's [N, K] weight alone, stacked: one config per parameter
                if imp is not None:
                    raise ValueError(f"HQQConfig(importance=...) has per-Linear importance vectors; {fqn} holds MoE "
                                     "expert weights: run HQQ on the experts without importance")
                for pname in expert_parameter_names(layer):
                    qw = quantize_expert_weight(_PerExpert(self), layer._parameters[pname].detach(), layer)
                    out[f"{fqn}.{pname}"] = Precomputed(base=self.base_config, weight=qw)
                continue
            w = layer.weight.detach()
            spec = self.base_config.weight_spec(w, layer)
            col = None if imp is None else importance_of(type(self).__name__, imp, fqn, w.shape[1])
            qw = hqq_quantize(w, spec, self.base_config.qparam_options(), iters=self.iters, lp_norm=self.lp_norm,
                              beta=self.beta, kappa=self.kappa, optimize_scale=self.optimize_scale,
                              keep_best_by=self.keep_best_by, importance=col)
            out[fqn] = Precomputed(base=self.base_config, weight=qw)
        return out


class _PerExpert:
    """`quantize_weight(w, linear)` of one expert's [N, K] weight with HQQ (for `quantize_expert_weight`)."""

    def __init__(self, cfg: HQQConfig) -> None:
        self.cfg = cfg
        self.packing_format = getattr(cfg.base_config, "packing_format", None)

    def quantize_weight(self, w: torch.Tensor, linear: nn.Module) -> AffineQuantizedTensor:
        c, base = self.cfg, self.cfg.base_config
        return hqq_quantize(w, base.weight_spec(w, linear), base.qparam_options(), iters=c.iters, lp_norm=c.lp_norm,
                            beta=c.beta, kappa=c.kappa, optimize_scale=c.optimize_scale, keep_best_by=c.keep_best_by)


def _zero_point_is_fixed(cfg: QuantConfig) -> bool:
    """True for bases whose zero point is not free (symmetric mappings)."""
    return getattr(cfg, "mapping_type", MappingType.SYMMETRIC) is not MappingType.ASYMMETRIC


def hqq_quantize(weight: torch.Tensor, spec: QuantSpec, options: QParamOptions | None = None, *,
                 iters: int = 20, lp_norm: float = 0.7, beta: float = 1e1, kappa: float = 1.01,
                 optimize_scale: bool = True, keep_best_by: str = "mse",
                 importance: torch.Tensor | None = None) -> AffineQuantizedTensor:
    """`weight` [N, K] quantized as `spec` (block (1, g)) with HQQ-optimised qparams: an
    AffineQuantizedTensor whose dequantize() is the reconstruction HQQ kept."""
    scale, zero_point = hqq_qparams(weight, spec, options, iters=iters, lp_norm=lp_norm, beta=beta, kappa=kappa,
                                    optimize_scale=optimize_scale, keep_best_by=keep_best_by, importance=importance)
    return AffineQuantizedTensor.from_qparams(weight, scale, zero_point, spec)


class _Stored:
    """The qparams of `spec` as its format stores them, and the primitives' quantize/dequantize with them."""

    def __init__(self, spec: QuantSpec, options: QParamOptions):
        self.spec = spec
        self.domain = spec.zero_point_domain
        self.qmin, self.qmax = float(spec.quant_min), float(spec.quant_max)
        self.mid = (self.qmax + self.qmin + 1) / 2
        self.scale_dtype = options.scale_dtype or torch.float32
        self.eps = options.eps or default_eps(self.scale_dtype)
        zp_dtype = options.zero_point_dtype
        self.zp_dtype = zp_dtype or (torch.int32 if self.domain is ZeroPointDomain.INT else self.scale_dtype)

    def store(self, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Code-unit (s, z) [R, 1] -> (scale, zero_point) [n_blocks] as the format stores them."""
        scale = s.clamp_min(self.eps).to(self.scale_dtype)
        if self.domain is ZeroPointDomain.INT:
            zp = torch.round(z).clamp(self.qmin, self.qmax).to(self.zp_dtype)
        elif self.domain is ZeroPointDomain.FLOAT:
            zp = (scale.float() * (self.mid - z)).to(self.zp_dtype)
        else:
            zp = None
        return represent_qparams(self.spec, scale, zp)

    def as_code_units(self, scale: torch.Tensor, zp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored (scale, zero_point) -> float32 (s, z) [R, 1] with W_r = s (W_q - z)."""
        s = scale.float().reshape(-1, 1)
        if self.domain is ZeroPointDomain.INT:
            return s, zp.float().reshape(-1, 1)
        if self.domain is ZeroPointDomain.FLOAT:
            return s, self.mid - zp.float().reshape(-1, 1) / s
        return s, torch.zeros_like(s)

    def roundtrip(self, w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, rounding: str = "half_even"):
        """(W_q, W_r) of groups w [R, g] exactly as quantize_affine / dequantize_affine compute them."""
        s = scale.float().reshape(-1, 1)
        z = None if zp is None else zp.float().reshape(-1, 1)
        return fake_quantize_unchecked(w, s, z, self.domain, self.qmin, self.qmax, rounding)


def _shrink_lp(e: torch.Tensor, beta: float | torch.Tensor, p: float) -> torch.Tensor:
    """Proximal operator of |.|^p / beta: sign(e) * relu(|e| - |e|^(p-1) / beta) (0 stays 0; beta 0: all 0)."""
    a = e.abs()
    return torch.sign(e) * torch.relu(a - a.clamp_min(1e-30).pow(p - 1) / beta)


def _column_weights(importance: torch.Tensor, shape: torch.Size, g: int) -> torch.Tensor:
    """a = imp / mean(imp) per column, laid out as the weight's groups [R, g] float32."""
    k = shape[1]
    if not isinstance(importance, torch.Tensor) or tuple(importance.shape) != (k,):
        got = tuple(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"hqq_qparams(importance=...) must be a tensor [in_features] = [{k}], got {got}")
    imp = importance.detach().float()
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()) or not bool((imp > 0).any()):
        raise ValueError("hqq_qparams(importance=...) must be finite, >= 0 and not all 0 (means of x^2 from "
                         "collect_importance)")
    return (imp / imp.mean()).reshape(1, k).expand(shape).reshape(-1, g)


def hqq_qparams(weight: torch.Tensor, spec: QuantSpec, options: QParamOptions | None = None, *,
                iters: int = 20, lp_norm: float = 0.7, beta: float = 1e1, kappa: float = 1.01,
                optimize_scale: bool = True, keep_best_by: str = "mse",
                importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HQQ-optimised (scale, zero_point) [n_blocks] of `weight` for `spec`, as the format stores them.

    weight: [N, K] float, spec: an integer target with block (1, g) (per group or per row); options: the
    base config's `qparam_options()` (scale dtype, eps, preserve_zero for the min-max start).
    importance: None, or [K] >= 0 (an importance matrix's entry): with a_k = imp[k] / mean(imp), the coupling of
    column k is beta * a_k (shrinkage per element), the fit is the a-weighted least squares and the keep-best
    error is sum a_k |W - W_r|^p; a group whose columns all have importance 0 keeps round-to-nearest."""
    options = options or QParamOptions()
    if keep_best_by not in ("mse", "lp"):
        raise ValueError(f"keep_best_by={keep_best_by!r}: use 'mse' or 'lp'")
    if weight.dim() != 2 or spec.block_size[0] != 1 or spec.target.is_float:
        raise ValueError(f"HQQ quantizes 2-D weights with integer codes in row-wise groups (block (1, g)); got "
                         f"shape {tuple(weight.shape)}, block {spec.block_size}, target {spec.target}")
    g = spec.block_size[1]
    w = weight.detach().float().reshape(-1, g)  # [R, g], groups in the row-major order of the qparams
    st = _Stored(spec, options)
    scale, zp = AffineQuantizedTensor.stored_qparams(weight.detach(), spec, options)
    free_zero = st.domain is not ZeroPointDomain.NONE and spec.mapping_type is MappingType.ASYMMETRIC
    if not free_zero and not optimize_scale:
        raise ValueError("hqq_qparams(optimize_scale=False) with a symmetric spec leaves nothing to optimise "
                         "(its zero point is fixed); pass optimize_scale=True")

    sel_p = 2.0 if keep_best_by == "mse" else lp_norm
    a = None if importance is None else _column_weights(importance, weight.shape, g).to(w.device)
    a_sum = None if a is None else a.sum(1, keepdim=True)
    fits = torch.ones(w.shape[0], 1, dtype=torch.bool, device=w.device) if a is None else a_sum > 0  # any weight

    def loss_of(w_r: torch.Tensor) -> torch.Tensor:
        e = (w - w_r).abs().pow(sel_p)
        return (e if a is None else a * e).sum(dim=1)

    def total(x: torch.Tensor) -> torch.Tensor:
        return (x if a is None else a * x).sum(1, keepdim=True)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return x.mean(1, keepdim=True) if a is None else total(x) / a_sum.clamp_min(1e-30)

    best_scale, best_zp = scale, zp
    q, w_r = st.roundtrip(w, scale, zp)
    best_loss = loss_of(w_r)
    for _ in range(iters):
        s, z = st.as_code_units(scale, zp)
        target = w - _shrink_lp(w - w_r, beta if a is None else beta * a, lp_norm)
        if not free_zero:  # scale only: s = <T, W_q - z>_a / <W_q - z, W_q - z>_a
            c = q - z
            num, den = total(target * c), total(c * c)
            s = torch.where(fits & (den > 0) & (num > 0), num / den.clamp_min(1e-30), s)
        elif optimize_scale:  # (weighted) linear regression of T on W_q
            qm, tm = mean(q), mean(target)
            cov, var = mean((q - qm) * (target - tm)), mean((q - qm) ** 2)
            s = torch.where(fits & (var > 0) & (cov > 0), cov / var.clamp_min(1e-30), s)
            z = torch.where(fits, qm - tm / s, z)
        else:
            z = torch.where(fits, mean(q - target / s), z)
        beta *= kappa
        scale, zp = st.store(s, z)
        q, w_r = st.roundtrip(w, scale, zp)
        loss = loss_of(w_r)
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best_scale = torch.where(better, scale.reshape(-1), best_scale.reshape(-1)).reshape(scale.shape)
        if zp is not None:
            best_zp = torch.where(better, zp.reshape(-1), best_zp.reshape(-1)).reshape(zp.shape)
    return best_scale, best_zp
