"""The per-weight math of AWQ (`affineq.algorithms.awq`), shared by its linear and MoE-experts passes:
fake quantization as the stored tensor dequantizes, the candidate scales of the alpha grid, the clipping search.
"""

from __future__ import annotations

import torch

from affineq.primitives import fake_quantize_unchecked
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["candidate_scale", "fake_quant", "qparams", "search_clip", "weight_mean"]


def _clip_to(w: torch.Tensor, group: int, ratio: torch.Tensor | None) -> torch.Tensor:
    """w [O, I] with each (row, group) clamped to ratio * [its min, its max]; ratio [O, I // group]."""
    if ratio is None:
        return w
    o, i = w.shape
    wg = w.reshape(o, i // group, group)
    r = ratio.reshape(o, i // group, 1)
    lo, hi = wg.amin(-1, keepdim=True) * r, wg.amax(-1, keepdim=True) * r
    return torch.maximum(torch.minimum(wg, hi), lo).reshape(o, i)


def qparams(w: torch.Tensor, spec, opts, ratio: torch.Tensor | None = None):
    """(scale, zero_point) of `spec` for w [O, I] (clipped by `ratio` first), as the format stores them."""
    return AffineQuantizedTensor.stored_qparams(_clip_to(w, spec.block_size[-1], ratio), spec, opts)


def fake_quant(w: torch.Tensor, spec, opts, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(quantize(w)) in float32 as the stored tensor will dequantize: the primitives' own code and
    dequant math on w's [O, I // g, g] view (their input checks and overflow widening skipped: the search
    calls this thousands of times, and weights are far from float32's range)."""
    scale, zp = qparams(w, spec, opts, ratio)
    o, i = w.shape
    g = spec.block_size[-1]
    wg = w.float().reshape(o, i // g, g)
    scale = scale.float().reshape(o, i // g, 1)
    zp = None if zp is None else zp.float().reshape(o, i // g, 1)
    _, deq = fake_quantize_unchecked(wg, scale, zp, spec.zero_point_domain, spec.quant_min, spec.quant_max)
    return deq.reshape(o, i)


def weight_mean(w: torch.Tensor, group: int) -> torch.Tensor:
    """mean over rows of |w| / (max |w| of its quantization group): [in_features]."""
    o, i = w.shape
    wg = w.abs().reshape(o, i // group, group)
    return (wg / wg.amax(-1, keepdim=True).clamp_min(1e-12)).reshape(o, i).mean(0)


def candidate_scale(a: float, x_mean: torch.Tensor, w_mean: torch.Tensor | None) -> torch.Tensor:
    """s(alpha) = mean|X|^a (/ mean|W~|^(1 - a) with duo scaling), clamped to >= 1e-4 and normalised by
    sqrt(max(s) min(s)): [in_features]."""
    s = x_mean.pow(a) / w_mean.pow(1 - a) if w_mean is not None else x_mean.pow(a)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_clip(w: torch.Tensor, x: torch.Tensor, spec, opts, n_clip: int, max_shrink: float) -> torch.Tensor:
    """Per (row, group) ratio r in {1 - max_shrink * k / n_clip} minimising || x_g (w_g - Q_r(w_g))^T ||^2 over
    the sampled tokens x [T, I]; w [O, I] float32 -> ratio [O, I // g]."""
    o, i = w.shape
    g = spec.block_size[-1]
    xg = x.reshape(x.shape[0], i // g, g)
    best = torch.full((o, i // g), float("inf"), device=w.device)
    ratio = torch.ones(o, i // g, device=w.device)
    ref_out = torch.einsum("ngk,ogk->ogn", xg, w.reshape(o, i // g, g))
    for k in range(n_clip):
        r = 1.0 - max_shrink * k / n_clip
        rt = torch.full((o, i // g), r, device=w.device)
        wq = fake_quant(w, spec, opts, rt).reshape(o, i // g, g)
        err = (ref_out - torch.einsum("ngk,ogk->ogn", xg, wq)).pow(2).mean(-1)
        better = err < best
        best = torch.where(better, err, best)
        ratio = torch.where(better, rt, ratio)
    return ratio
