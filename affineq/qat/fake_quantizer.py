"""`FakeQuantizer`: x -> dequantize(quantize(x)) in the forward pass, with straight-through gradients.

Four modes, by `FakeQuantizeConfig`:
- dynamic: qparams from every input with `choose_qparams_affine`, rounded as the packing format stores them
  (`represent_qparams`), then `fake_quantize_affine`: the very functions `AffineQuantizedTensor.from_spec`
  (convert) calls, so the codes a converted weight stores are the codes the forward used.
- static: qparams fixed by `initialize_fake_quantizers` (min-max of the first input), kept in buffers.
- LSQ range learning (Esser et al. 2019): `scale` (and `zero_point`) are parameters initialised like static
  ones. Per block, with v = x * (1 / s) and the unclamped code u = round(v) + z (INT domain):
      out = (clamp(u, qmin, qmax) - z) * s
      d out / d x = 1 if qmin <= u <= qmax else 0          (mask from the unclamped code)
      d out / d s = round(v) - v inside, (qmin or qmax) - z outside
      d out / d z = 0 inside, -s outside                     (z = round(zero_point) straight through)
  FLOAT-domain zero points (`m = z - s * (mid - qmin)`, u = round((x - m) / s) + qmin, out = (q - mid) * s + z)
  get d out / d s = round(.) - (.) inside, qmin - mid or qmax - mid outside, d out / d z = 0 inside, 1 outside.
  Both gradients are scaled by g = 1 / sqrt(N * Q_P) (N elements per block per step, Q_P the positive code
  span: qmax - zp_sym symmetric, qmax - qmin asymmetric), the LSQ gradient scale.
- TQT range learning (Jain et al. 2019): the parameter `scale_log2_threshold` holds log2 t per block and
      s = 2 ** ceil(log2 t) / 2 ** (bits - 1)      (an exact power of two)
      out = clamp(round(x / s), qmin - c, qmax - c) * s   (c = zp_sym, 0 for signed codes)
  with ceil and round straight through: d out / d log2 t = s * ln 2 * (round(x / s) - x / s) inside and
  s * ln 2 * (qmin - c or qmax - c) outside; d out / d x is the clipping mask.

The learned forward computes in float32 with the primitives' formulas and order (x * (1 / s), round, + z,
clamp; (q - z) * s), so at any step its values equal `fake_quantize_affine` with the current qparams, and
`quantized_qparams()` hands those qparams to convert.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from affineq.blocks import Blocks, midpoint
from affineq.dtypes import check_quant_range
from affineq.granularity import PerRow, PerToken
from affineq.primitives import ROUNDING, MappingType, ZeroPointDomain, fake_quantize_affine
from affineq.qat.config import FakeQuantizeConfig, TQTThresholdInitMeth, block_size_for
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QParamOptions, QuantSpec

__all__ = ["FakeQuantizer", "tqt_threshold"]


def _round_ste(t: torch.Tensor, rounding: str = "half_even") -> torch.Tensor:
    return t + (ROUNDING[rounding](t) - t).detach()


def _grad_scale(t: torch.Tensor, g: float) -> torch.Tensor:
    """t in the forward pass, exactly (convert stores the qparams the forward used: t*g + (t - t*g) can differ
    from t by an ulp in fp32), g * grad in the backward pass."""
    tg = t * g
    return t.detach() + (tg - tg.detach())


def _as_rows(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """x [*shape] -> [num_blocks, elements per block]."""
    b = Blocks(x.shape, block)
    n = len(x.shape)
    xb = x.reshape(b.blocked).permute(*range(0, 2 * n, 2), *range(1, 2 * n, 2))
    return xb.reshape(math.prod(b.reduced), -1)


def tqt_threshold(x: torch.Tensor, block_size: tuple[int, ...], method: TQTThresholdInitMeth,
                  quant_min: int, quant_max: int) -> torch.Tensor:
    """Initial TQT threshold per block of x (float32, shape = number of blocks per dim); formulas in
    `TQTThresholdInitMeth`. quant_min/quant_max: the symmetric code range (its centre is subtracted)."""
    rows = _as_rows(x.detach().float(), block_size)
    reduced = Blocks(x.shape, block_size).reduced
    tiny = torch.finfo(torch.float32).tiny
    if method is TQTThresholdInitMeth._3SD:
        t = rows.mean(1).abs() + 3 * rows.std(1, correction=0)
        return t.clamp(min=tiny).reshape(reduced)
    c = (quant_max + quant_min + 1) // 2
    lo, hi = quant_min - c, quant_max - c
    half = (quant_max - quant_min + 1) / 2
    m = rows.abs().amax(1, keepdim=True).clamp(min=tiny)
    bins = 512
    offsets = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1) * bins

    def hist(v: torch.Tensor) -> torch.Tensor:
        idx = ((v + m) / (2 * m) * bins).floor().clamp(0, bins - 1).long() + offsets
        ones = torch.ones(idx.numel(), device=rows.device)
        h = torch.zeros(rows.shape[0] * bins, device=rows.device).index_add_(0, idx.reshape(-1), ones)
        h = h.reshape(rows.shape[0], bins) + 1e-8
        return h / h.sum(1, keepdim=True)

    p = hist(rows)
    top = torch.ceil(torch.log2(m))
    best_j, best_t = None, None
    for k in range(8):
        t = torch.exp2(top - k)
        s = t / half
        q = hist(torch.clamp(torch.round(rows / s), lo, hi) * s)
        j = ((p - q) * torch.log(p / q)).sum(1, keepdim=True)
        better = j < best_j if best_j is not None else torch.ones_like(j, dtype=torch.bool)
        best_j = j if best_j is None else torch.where(better, j, best_j)
        best_t = t if best_t is None else torch.where(better, t, best_t)
    return best_t.reshape(reduced)


class FakeQuantizer(nn.Module):
    """Fake-quantizes a tensor as `config` says (see the module docstring for the four modes).

    activation: True views an input [..., K] as [M, K] (granularity per token / per tensor, as the kernels'
    activation quantization does). Learned qparams are parameters named `scale` / `zero_point` (LSQ) or
    `scale_log2_threshold` (TQT); static ones are buffers `scale` / `zero_point`. `enabled = False` makes the
    forward the identity.
    """

    def __init__(self, config: FakeQuantizeConfig, *, activation: bool = False) -> None:
        super().__init__()
        if not isinstance(config, FakeQuantizeConfig):
            raise ValueError(f"FakeQuantizer(config) needs a FakeQuantizeConfig, got {config!r}")
        if activation and not config.is_dynamic and isinstance(config.granularity, (PerToken, PerRow)):
            raise ValueError(f"static / range-learned activation qparams cannot be per token ({config.granularity}): "
                             "the number of tokens changes between inputs; use PerTensor() (or is_dynamic=True)")
        self.config = config
        self.activation = activation
        self.enabled = True
        self.packing_format = "plain"  # whose represent_qparams rounds the qparams (set by QATConfig prepare)
        self.quant_min, self.quant_max = check_quant_range(config.dtype)
        self._initialized = config.is_dynamic
        self.pending_init = False  # set by initialize_fake_quantizers: the next forward initialises
        if config.is_tqt:
            self.scale_log2_threshold = nn.Parameter(torch.empty(0))
        elif config.range_learning:
            self.scale = nn.Parameter(torch.empty(0))
            asym = config.zero_point_domain is not ZeroPointDomain.NONE
            self.zero_point = nn.Parameter(torch.empty(0)) if asym else None
        elif not config.is_dynamic:
            self.register_buffer("scale", torch.empty(0))
            self.register_buffer("zero_point", torch.empty(0))

    def extra_repr(self) -> str:
        c = self.config
        mode = "dynamic" if c.is_dynamic else (c.range_learning_method if c.range_learning else "static")
        return f"{c.dtype}, {c.granularity}, {c.mapping_type.name}, {mode}, format={self.packing_format}"

    # -- the spec of an input ---------------------------------------------------------------------------

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]) if self.activation and x.dim() != 2 else x

    def spec(self, x: torch.Tensor) -> QuantSpec:
        """The QuantSpec this quantizer applies to (the viewed) x: target, block size, range, domain."""
        c = self.config
        return QuantSpec.create(tuple(x.shape), x.dtype, c.dtype, block_size_for(c, tuple(x.shape), self.activation),
                                mapping_type=c.mapping_type, zero_point_domain=self._domain(),
                                packing_format=self.packing_format)

    def _domain(self) -> ZeroPointDomain:
        return self.config.zero_point_domain

    def _zp_dtype(self) -> torch.dtype:
        c = self.config
        if c.zero_point_domain is ZeroPointDomain.FLOAT and not c.zero_point_precision.is_floating_point:
            return c.scale_precision  # the int32 default cannot hold a FLOAT-domain zero point
        return c.zero_point_precision

    def choose_qparams(self, x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Min-max qparams of x exactly as convert computes and stores them (choose_qparams_affine with the
        config's options, then the packing format's represent_qparams), shape = number of blocks per dim."""
        c = self.config
        options = QParamOptions(c.eps, c.scale_precision, self._zp_dtype(), c.preserve_zero)
        return AffineQuantizedTensor.stored_qparams(x.detach(), spec, options)

    # -- forward ------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        shape = x.shape
        x = self._view(x)
        spec = self.spec(x)
        c = self.config
        if self.pending_init:
            self._initialize(x, spec)
        if c.is_dynamic:
            scale, zp = self.choose_qparams(x, spec)
            out = fake_quantize_affine(x, spec.block_size, scale, zp, c.dtype, spec.quant_min, spec.quant_max,
                                       spec.zero_point_domain, rounding=c.rounding)
        elif not self._initialized:
            raise RuntimeError(
                f"{type(self).__name__}({self.extra_repr()}) has static or range-learned qparams that were never "
                "initialised; call affineq.qat.initialize_fake_quantizers(model, example_inputs) after prepare "
                "and before building the optimizer")
        elif not c.range_learning:
            out = fake_quantize_affine(x, spec.block_size, self.scale, self.zero_point, c.dtype, spec.quant_min,
                                       spec.quant_max, spec.zero_point_domain, rounding=c.rounding)
        else:
            out = self._learned(x, spec)
        return out.reshape(shape)

    def _code_center(self) -> int:
        return (self.quant_max + self.quant_min + 1) // 2

    def _learned_qparams(self, n_per_block: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero point) of the learned parameters in float32 as the forward uses them: scale rounded to
        scale_precision, INT zero point rounded to an integer code, FLOAT one to zero_point_precision."""
        c = self.config
        domain = self._domain()
        if c.is_tqt:
            half = (self.quant_max - self.quant_min + 1) / 2
            e = self.scale_log2_threshold + (torch.ceil(self.scale_log2_threshold) - self.scale_log2_threshold).detach()
            scale = torch.exp2(e) / half
            zp = None if domain is ZeroPointDomain.NONE else torch.full_like(scale, self._code_center()).detach()
            return scale, zp
        asym = c.mapping_type is MappingType.ASYMMETRIC
        qp = (self.quant_max - self.quant_min) if asym else (self.quant_max - self._code_center())
        g = 1.0 / math.sqrt(max(n_per_block * qp, 1.0))
        eps = c.eps if c.eps is not None else torch.finfo(torch.float32).tiny
        s = _grad_scale(self.scale.clamp(min=eps), g)
        s = s.to(c.scale_precision).float()
        if self.zero_point is None:
            return s, None
        z = _grad_scale(self.zero_point, g)
        if domain is ZeroPointDomain.INT:
            z = torch.clamp(_round_ste(z), self.quant_min, self.quant_max)
        else:
            z = z.to(self._zp_dtype()).float()
        return s, z

    def _learned(self, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
        c = self.config
        b = Blocks(x.shape, spec.block_size)
        scale, zp = self._learned_qparams(x.numel() / max(self._param().numel(), 1))
        s = scale.reshape(b.qparam_view)
        xb = x.float().reshape(b.blocked)
        qmin, qmax = self.quant_min, self.quant_max
        domain = self._domain()
        if domain is ZeroPointDomain.FLOAT:
            z = zp.reshape(b.qparam_view)
            mid = midpoint(qmin, qmax)
            lo = z - s * (mid - qmin)
            q = torch.clamp(_round_ste((xb - lo) * (1.0 / s), c.rounding) + qmin, qmin, qmax)
            out = (q - mid) * s + z
        elif domain is ZeroPointDomain.INT and (zp is not None):
            z = zp.reshape(b.qparam_view)
            q = torch.clamp(_round_ste(xb * (1.0 / s), c.rounding) + z, qmin, qmax)
            out = (q - z) * s
        else:
            q = torch.clamp(_round_ste(xb * (1.0 / s), c.rounding), qmin, qmax)
            out = q * s
        return out.to(x.dtype).reshape(x.shape)

    def _param(self) -> torch.Tensor:
        return self.scale_log2_threshold if self.config.is_tqt else self.scale

    # -- initialisation and convert ------------------------------------------------------------------------

    def _initialize(self, x: torch.Tensor, spec: QuantSpec) -> None:
        """Fix the static / initial learned qparams from x (min-max as convert computes them; TQT: the
        threshold of `config.tqt_init`)."""
        self.pending_init = False
        c = self.config
        if c.is_dynamic:
            return
        with torch.no_grad():
            if c.is_tqt:
                t = tqt_threshold(x, spec.block_size, c.tqt_init, self.quant_min, self.quant_max)
                self.scale_log2_threshold = nn.Parameter(torch.log2(t).to(x.device))
            else:
                scale, zp = self.choose_qparams(x, spec)
                if c.range_learning:
                    self.scale = nn.Parameter(scale.float())
                    if self.zero_point is not None:
                        self.zero_point = nn.Parameter(zp.float())
                else:
                    self.scale, self.zero_point = scale, zp
        self._initialized = True

    @torch.no_grad()
    def quantized_qparams(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero point) the forward uses for x, as convert stores them: scale in scale_precision,
        an INT zero point as int32 codes, a FLOAT one in its precision; shape = number of blocks per dim."""
        c = self.config
        xv = self._view(x)
        spec = self.spec(xv)
        if c.is_dynamic:
            return self.choose_qparams(xv, spec)
        if not self._initialized:
            raise RuntimeError("this FakeQuantizer was never initialised: call initialize_fake_quantizers first")
        if not c.range_learning:
            return self.scale, self.zero_point
        scale, zp = self._learned_qparams(1.0)
        reduced = spec.num_blocks
        scale = scale.to(c.scale_precision).reshape(reduced)
        if zp is not None:
            zp = zp.to(torch.int32 if self._domain() is ZeroPointDomain.INT else self._zp_dtype()).reshape(reduced)
        return scale, zp

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # Qparams are sized at initialisation: take the saved shapes, so a fresh prepared model loads them.
        loaded = False
        for name in ("scale", "zero_point", "scale_log2_threshold"):
            key = prefix + name
            current = getattr(self, name, None)
            if key in state_dict and isinstance(current, torch.Tensor) and current.shape != state_dict[key].shape:
                new = torch.empty_like(state_dict[key], device=current.device)
                if isinstance(current, nn.Parameter):
                    setattr(self, name, nn.Parameter(new, requires_grad=current.requires_grad))
                else:
                    setattr(self, name, new)
            loaded |= key in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        if loaded:
            self._initialized = True
