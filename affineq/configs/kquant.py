"""k-quant weights from float: `KQuantConfig(kind="q4_k")` and `quantize_kquant(weight, kind, importance=None)`.

The weight [N, K] (K a multiple of 256) becomes llama.cpp super-blocks of 256 (`format_kquant`: the GGUF bytes,
read by `affineq.kquant_linear`, written by `affineq.gguf.save_model` as the matching GGUF type). The search
follows llama.cpp's idea (make_qkx2_quants / make_qx_quants), written here for whole tensors at once:

1. per sub-block j (32 weights for q4_k / q5_k, 16 for q2_k / q3_k / q6_k), minimise the weighted error
   sum_i a_i (w_i - dq(q(w_i)))^2 over candidate scales:
   - asymmetric (q2_k, q4_k, q5_k: w = s * u - m, u in [0, nmax]): for each of 21 inverse scales
     (nmax + delta) / (max - min), delta in -1 .. 1 step 0.1, round u = clamp(round(iscale * (w - min))) and refit
     (s, m) by weighted least squares (m >= 0 kept: min clamped to <= 0);
   - symmetric (q3_k, q6_k: w = s * q, q in [-nmax, nmax - 1]): for each of 19 inverse scales
     -(nmax + 0.1 t) / amax_signed, t in -9 .. 9, round q and refit s = sum a w q / sum a q^2; the extreme
     weight maps to -nmax, the wider side of the range.
   a_i: with an importance vector imp [K] (llama.cpp's imatrix: per input column mean of x^2, from
   `affineq.algorithms.collect_importance`), imp_i * sqrt(sigma^2 + w_i^2) (sigma^2 the super-block's mean
   square); without, llama.cpp's defaults: rms(sub-block) + |w_i| (asymmetric), w_i^2 (symmetric).
2. the sub-scales (and mins) of a super-block are quantized to the format's integers: d = max_j s_j / smax
   (smax 63 six-bit, 15 four-bit; signed q6_k: -max / 128, q3_k: -max / 32) stored as fp16, sc_j =
   round(s_j / d) clamped;
3. the codes are rounded again against the stored sub-scales d * sc_j (and dmin * mn_j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from affineq.configs.base import QuantConfig, check_choice
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.format_kquant import KQUANT_TYPES, SUPER_BLOCK, from_blocks, kquant_spec
from affineq.tensor.kquant_encode import encode

__all__ = ["KQUANT_KINDS", "KQuantConfig", "quantize_kquant"]

KQUANT_KINDS = tuple(KQUANT_TYPES)
#: (sub-scale integer max, signed sub-scales' negative end) per kind
_SUB_SCALE = {"q2_k": 15, "q3_k": 32, "q4_k": 63, "q5_k": 63, "q6_k": 128}


def _weighted_lsq_asym(x: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, lo) minimising sum a (s u + lo - x)^2 per row, with lo <= 0 (refit at lo = 0 where it would be > 0)."""
    sw, sl, sl2 = a.sum(-1), (a * u).sum(-1), (a * u * u).sum(-1)
    sx, sxl = (a * x).sum(-1), (a * u * x).sum(-1)
    det = sw * sl2 - sl * sl
    ok = det > 0
    s = torch.where(ok, (sw * sxl - sx * sl) / torch.where(ok, det, 1), 0)
    lo = torch.where(ok, (sl2 * sx - sl * sxl) / torch.where(ok, det, 1), 0)
    pos = lo > 0
    s = torch.where(pos, sxl / sl2.clamp_min(1e-30), s)
    return s, torch.where(pos, torch.zeros_like(lo), lo)


def _search_asym(x: torch.Tensor, a: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [S, g]: (scale >= 0, m >= 0) of w = scale * u - m, u in [0, nmax] (step 1 of the docstring)."""
    lo = x.amin(-1).clamp_max(0)
    hi = x.amax(-1)
    span = (hi - lo).clamp_min(1e-30)
    best_err = torch.full_like(lo, float("inf"))
    best_s, best_lo = (hi - lo) / nmax, lo.clone()
    for step in range(21):
        iscale = (nmax - 1.0 + 0.1 * step) / span
        u = torch.round((x - lo[:, None]) * iscale[:, None]).clamp_(0, nmax)
        s, m = _weighted_lsq_asym(x, a, u)
        s = s.clamp_min(0)
        err = (a * (s[:, None] * u + m[:, None] - x) ** 2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_lo = torch.where(better, s, best_s), torch.where(better, m, best_lo)
    flat = hi == lo
    return torch.where(flat, 0, best_s), torch.where(flat, -lo, -best_lo)


def _search_sym(x: torch.Tensor, a: torch.Tensor, nmax: int) -> torch.Tensor:
    """Per row of x [S, g]: the signed scale of w = scale * q, q in [-nmax, nmax - 1] (step 1)."""
    idx = x.abs().argmax(-1, keepdim=True)
    amax = x.gather(-1, idx).squeeze(-1)  # the largest magnitude, with its sign
    safe = torch.where(amax == 0, 1, amax)
    best_score = torch.full_like(amax, -1.0)
    best_s = torch.zeros_like(amax)
    for t in range(-9, 10):
        iscale = -(nmax + 0.1 * t) / safe
        q = torch.round(x * iscale[:, None]).clamp_(-nmax, nmax - 1)
        sxq, sq2 = (a * x * q).sum(-1), (a * q * q).sum(-1)
        ok = sq2 > 0
        score = torch.where(ok, sxq * sxq / torch.where(ok, sq2, 1), -1)
        better = score > best_score
        best_score = torch.where(better, score, best_score)
        best_s = torch.where(better & ok, sxq / torch.where(ok, sq2, 1), best_s)
    return torch.where(amax == 0, 0, best_s)


def _weights(x: torch.Tensor, imp: torch.Tensor | None, symmetric: bool) -> torch.Tensor:
    """a [B, 256 / g, g] for super-blocks x [B, 256 / g, g] (imp [B, 256 / g, g] or None)."""
    if imp is not None:
        sigma2 = (x * x).mean((-2, -1), keepdim=True)
        return imp * torch.sqrt(sigma2 + x * x)
    if symmetric:
        return x * x
    return torch.sqrt((x * x).mean(-1, keepdim=True)) + x.abs()


def _quantize_sub_scales(s: torch.Tensor, smax: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(d fp32 [B] as stored in fp16, integer sub-scales [B, J]) with d * sc_j ~ s_j (step 2)."""
    if signed:  # the largest magnitude maps to -smax (q6_k: -128, q3_k: -32)
        idx = s.abs().argmax(-1, keepdim=True)
        big = s.gather(-1, idx).squeeze(-1)
        d = (-big / smax).to(torch.float16).float()
        lo, hi = -smax, smax - 1
    else:
        d = (s.amax(-1) / smax).to(torch.float16).float()
        lo, hi = 0, smax
    inv = torch.where(d == 0, 0, 1 / torch.where(d == 0, 1, d))
    return d, torch.round(s * inv[:, None]).clamp_(lo, hi).to(torch.int32)


def quantize_kquant(weight: torch.Tensor, kind: str = "q4_k", importance: torch.Tensor | None = None
                    ) -> AffineQuantizedTensor:
    """The k-quant tensor of `weight` [N, K] (K a multiple of 256), format `kind` ("q2_k" .. "q6_k"), searched as
    the module docstring says; `importance` [K] (>= 0, e.g. a layer's entry of `collect_importance`) weights each
    input column's squared error. The result has weight's logical dtype and shape."""
    if kind not in KQUANT_TYPES:
        raise ValueError(f"quantize_kquant(kind={kind!r}) must be one of {list(KQUANT_KINDS)}")
    if weight.dim() != 2 or weight.shape[1] % SUPER_BLOCK or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize_kquant: weight must be a 2-D float tensor [N, K] with K a multiple of "
                         f"{SUPER_BLOCK}, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if importance is not None:
        if tuple(importance.shape) != (k,) or not bool((importance >= 0).all()):
            raise ValueError(f"quantize_kquant: importance must be [K={k}] with values >= 0 (collect_importance's "
                             f"per-column mean of x^2), got shape {tuple(importance.shape)}")
    w = weight.detach().float().cpu()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_kquant: weight has non-finite values (inf / nan); k-quants store finite weights")
    t = KQUANT_TYPES[kind]
    g, nsub, symmetric = t.group, SUPER_BLOCK // t.group, not t.asymmetric
    x = w.reshape(-1, nsub, g)  # [B, J, g]
    imp = None
    if importance is not None:
        imp = importance.detach().float().cpu().expand(n, k).reshape(-1, nsub, g)
    a = _weights(x, imp, symmetric).reshape(-1, g)
    xs = x.reshape(-1, g)
    smax = _SUB_SCALE[kind]
    if symmetric:
        nmax = -t.quant_min
        s = _search_sym(xs, a, nmax).view(-1, nsub)
        d, sc = _quantize_sub_scales(s, smax, signed=True)
        step = (d[:, None] * sc).unsqueeze(-1)  # the stored sub-scales, exact in fp32
        q = torch.round(x / torch.where(step == 0, 1, step)).clamp_(-nmax, nmax - 1)
        u = torch.where(step == 0, 0, q) + nmax
        blocks = encode(kind, u.reshape(-1, SUPER_BLOCK).to(torch.uint8), d, sc)
    else:
        s, m = _search_asym(xs, a, t.quant_max)
        d, sc = _quantize_sub_scales(s.view(-1, nsub), smax, signed=False)
        dmin, mn = _quantize_sub_scales(m.view(-1, nsub), smax, signed=False)
        step = (d[:, None] * sc).unsqueeze(-1)
        low = (dmin[:, None] * mn).unsqueeze(-1)
        u = torch.round((x + low) / torch.where(step == 0, 1, step)).clamp_(0, t.quant_max)
        u = torch.where(step == 0, 0, u)
        blocks = encode(kind, u.reshape(-1, SUPER_BLOCK).to(torch.uint8), d, sc, dmin, mn)
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"quantize_kquant: a super-block scale overflows fp16 (|weight| up to "
                         f"{float(w.abs().max()):.3g}); k-quants store d in fp16: scale the weight down first")
    spec = kquant_spec(kind, (n, k), weight.dtype)
    return AffineQuantizedTensor.from_tensors(from_blocks(kind, blocks.reshape(n, -1)), spec)


@dataclass(frozen=True)
class KQuantConfig(QuantConfig):
    """Weight-only llama.cpp k-quant: super-blocks of 256 weights with 6-bit (q4_k, q5_k), 4-bit (q2_k), int8
    (q6_k) or signed 6-bit (q3_k) quantized sub-scales; bits per weight 2.625 (q2_k), 3.4375, 4.5, 5.5, 6.5625.
    Each nn.Linear whose in_features is a multiple of 256 is quantized with `quantize_kquant` (no importance:
    llama.cpp's default weighting; for an importance matrix call `quantize_kquant` per layer). The weight runs
    on `affineq.kquant_linear` and saves to GGUF as the matching type.

        quantize_(model, KQuantConfig(kind="q4_k"))
    """

    kind: str = "q4_k"

    def __post_init__(self):
        super().__post_init__()
        check_choice("kind", self.kind, KQUANT_KINDS)

    def _block_size(self, shape, module):
        if len(shape) != 2 or shape[1] % SUPER_BLOCK:
            raise ValueError(f"{self.kind} needs a 2-D weight whose input dimension is a multiple of {SUPER_BLOCK}, "
                             f"got shape {tuple(shape)}: leave this layer out (filter_fn) or use a group-wise config")
        return (1, KQUANT_TYPES[self.kind].group)

    def weight_spec(self, weight: torch.Tensor, module: nn.Module):
        return kquant_spec(self.kind, tuple(weight.shape), weight.dtype)

    def quantize_weight(self, weight: torch.Tensor, module: nn.Module) -> AffineQuantizedTensor:
        return quantize_kquant(weight, self.kind)
