"""`FakeQuantizeConfig`: how one tensor (a weight or a layer's input activation) is fake-quantized during QAT.

The granularity may be given as an object (`PerToken()`, `PerAxis(0)`, `PerGroup(32)`), a string
("per_token", "per_channel", "per_group") or implied by `group_size`; the mapping by `mapping_type` or
`is_symmetric`. Every spelling is normalised at construction, so spellings of one scheme compare equal, and
contradicting arguments raise ValueError naming both sides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from affineq.dtypes import is_integer_target
from affineq.granularity import Granularity, PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken
from affineq.primitives import ROUNDING, MappingType, ZeroPointDomain
from affineq.tensor.spec import ActivationQuant, QParamOptions, QuantSpec

__all__ = ["FakeQuantizeConfig", "TQTThresholdInitMeth"]

_INT_DTYPES = tuple(getattr(torch, f"{s}int{b}") for s in ("", "u") for b in range(1, 9))
_STRINGS = {"per_token": PerToken, "per_channel": lambda: PerAxis(0), "per_group": None}


class TQTThresholdInitMeth(enum.Enum):
    """How a TQT threshold t (per block of the tensor x) is initialised (the enum of AMD Quark):

    - `_3SD`: t = |mean(x)| + 3 * std(x) (population std), i.e. the larger end of mean +- 3 standard deviations.
    - `_LL_J`: Algorithm 1 of Settle et al. 2018: among the power-of-two thresholds t = 2**k, k from
      ceil(log2 max|x|) down 8 steps, pick the one minimising the symmetric Kullback-Leibler-J divergence
      J(P, Q) = sum (P - Q) log(P / Q) between the histogram P of x and the histogram Q of x fake-quantized
      with t (both over the same 512 bins spanning [-max|x|, max|x|], +1e-8 mass per bin before normalising).
    """

    _3SD = "3SD"
    _LL_J = "LL_J"


def _granularity(granularity, group_size) -> Granularity:
    """The granularity object for the (granularity, group_size) arguments; ValueError on a contradiction."""
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size <= 0):
        raise ValueError(f"group_size must be a positive int (e.g. 32), got {group_size!r}")
    if isinstance(granularity, str):
        if granularity not in _STRINGS:
            raise ValueError(f"granularity={granularity!r} is not a known granularity string; use one of "
                             f"{list(_STRINGS)} or an object such as PerGroup(32)")
        if granularity == "per_group":
            if group_size is None:
                raise ValueError("granularity='per_group' needs group_size: pass e.g. group_size=32")
            return PerGroup(group_size)
        granularity = _STRINGS[granularity]()
    if granularity is None:
        if group_size is None:
            raise ValueError("pass a granularity ('per_token', 'per_channel', 'per_group' or an object such as "
                             "PerToken()) or a group_size")
        return PerGroup(group_size)
    if not isinstance(granularity, Granularity):
        raise ValueError(f"granularity={granularity!r} must be a string or a Granularity object such as PerToken()")
    if group_size is not None and not (isinstance(granularity, PerGroup) and granularity.group_size == group_size):
        raise ValueError(f"group_size={group_size} contradicts granularity={granularity!r}: group_size implies "
                         f"PerGroup({group_size}); pass only one of them (or matching ones)")
    return granularity


def _mapping(mapping_type, is_symmetric) -> MappingType:
    if mapping_type is not None and not isinstance(mapping_type, MappingType):
        raise ValueError(f"mapping_type={mapping_type!r} must be a MappingType, e.g. MappingType.SYMMETRIC")
    if is_symmetric is None:
        return mapping_type or MappingType.SYMMETRIC
    if not isinstance(is_symmetric, bool):
        raise ValueError(f"is_symmetric must be True or False, got {is_symmetric!r}")
    implied = MappingType.SYMMETRIC if is_symmetric else MappingType.ASYMMETRIC
    symmetric = mapping_type in (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    if mapping_type is not None and symmetric != is_symmetric:
        raise ValueError(f"is_symmetric={is_symmetric} contradicts mapping_type={mapping_type}; pass only one of "
                         "them (or matching ones)")
    return mapping_type or implied


@dataclass(frozen=True, init=False)
class FakeQuantizeConfig:
    """How a tensor is fake-quantized: x -> dequantize(quantize(x)) with qparams per block of `granularity`.

    dtype: torch.int1..torch.int8 or torch.uint1..torch.uint8. granularity / group_size / mapping_type /
    is_symmetric: see the module docstring (default symmetric). scale_precision, zero_point_precision,
    zero_point_domain, eps: as in `choose_qparams_affine`. is_dynamic: qparams recomputed from every input
    (True) or fixed by `initialize_fake_quantizers` (False: static). range_learning: scale and zero point are
    trainable `nn.Parameter`s (needs is_dynamic=False).

    Keyword-only extras: range_learning_method "lsq" (learned scale and zero point, Esser et al. 2019) or
    "tqt" (learned log2 threshold, power-of-two scales, Jain et al. 2019; symmetric mappings only);
    tqt_init: a `TQTThresholdInitMeth` (default `_3SD`); preserve_zero and rounding as in
    `choose_qparams_affine` / `quantize_affine` (the base configs' `qparam_options`).
    """

    dtype: torch.dtype
    granularity: Granularity
    mapping_type: MappingType
    scale_precision: torch.dtype
    zero_point_precision: torch.dtype
    zero_point_domain: ZeroPointDomain
    is_dynamic: bool
    range_learning: bool
    eps: float | None
    range_learning_method: str
    tqt_init: TQTThresholdInitMeth
    preserve_zero: bool
    rounding: str

    def __init__(self, dtype: torch.dtype, granularity: Granularity | str | None = None,
                 mapping_type: MappingType | None = None, scale_precision: torch.dtype = torch.float32,
                 zero_point_precision: torch.dtype = torch.int32,
                 zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT, is_dynamic: bool = True,
                 range_learning: bool = False, eps: float | None = None, *, group_size: int | None = None,
                 is_symmetric: bool | None = None, range_learning_method: str = "lsq",
                 tqt_init: TQTThresholdInitMeth = TQTThresholdInitMeth._3SD, preserve_zero: bool = True,
                 rounding: str = "half_even") -> None:
        if dtype not in _INT_DTYPES or not is_integer_target(dtype):
            raise ValueError(f"dtype={dtype!r}: fake quantization targets integer codes of 1-8 bits; use "
                             "torch.int1..torch.int8 or torch.uint1..torch.uint8")
        gran = _granularity(granularity, group_size)
        mapping = _mapping(mapping_type, is_symmetric)
        for name, value in (("scale_precision", scale_precision), ("zero_point_precision", zero_point_precision)):
            if not isinstance(value, torch.dtype):
                raise ValueError(f"{name}={value!r} must be a torch dtype such as torch.float32")
        if not scale_precision.is_floating_point:
            raise ValueError(f"scale_precision={scale_precision} must be a floating-point dtype (torch.float32 or "
                             "torch.bfloat16)")
        if not isinstance(zero_point_domain, ZeroPointDomain):
            raise ValueError(f"zero_point_domain={zero_point_domain!r} must be a ZeroPointDomain")
        if mapping is MappingType.ASYMMETRIC and zero_point_domain is ZeroPointDomain.NONE:
            raise ValueError("an asymmetric mapping (is_symmetric=False) needs a zero point: use "
                             "zero_point_domain=ZeroPointDomain.INT or FLOAT, not NONE")
        if range_learning and is_dynamic:
            raise ValueError("range_learning=True contradicts is_dynamic=True: learned qparams are fixed between "
                             "optimizer steps; pass is_dynamic=False with range_learning=True")
        if range_learning_method not in ("lsq", "tqt"):
            raise ValueError(f"range_learning_method={range_learning_method!r}: use 'lsq' or 'tqt'")
        if range_learning_method == "tqt" and mapping is MappingType.ASYMMETRIC:
            raise ValueError("range_learning_method='tqt' learns a symmetric power-of-two threshold, which "
                             "contradicts mapping_type=ASYMMETRIC; use 'lsq' or a symmetric mapping")
        if not isinstance(tqt_init, TQTThresholdInitMeth):
            raise ValueError(f"tqt_init={tqt_init!r}: use TQTThresholdInitMeth._3SD or TQTThresholdInitMeth._LL_J")
        if rounding not in ROUNDING:
            raise ValueError(f"rounding={rounding!r}: use one of {list(ROUNDING)}")
        for name, value in (("is_dynamic", is_dynamic), ("range_learning", range_learning),
                            ("preserve_zero", preserve_zero)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        values = dict(dtype=dtype, granularity=gran, mapping_type=mapping, scale_precision=scale_precision,
                      zero_point_precision=zero_point_precision, zero_point_domain=zero_point_domain,
                      is_dynamic=is_dynamic, range_learning=range_learning, eps=eps,
                      range_learning_method=range_learning_method, tqt_init=tqt_init, preserve_zero=preserve_zero,
                      rounding=rounding)
        for k, v in values.items():
            object.__setattr__(self, k, v)

    @property
    def group_size(self) -> int | None:
        return self.granularity.group_size if isinstance(self.granularity, PerGroup) else None

    @property
    def is_symmetric(self) -> bool:
        return self.mapping_type is not MappingType.ASYMMETRIC

    @property
    def is_tqt(self) -> bool:
        return self.range_learning and self.range_learning_method == "tqt"

    @classmethod
    def from_spec(cls, spec: QuantSpec, options: QParamOptions | None = None) -> FakeQuantizeConfig:
        """The weight fake-quantization that gives exactly the codes of `AffineQuantizedTensor.from_spec(w, spec,
        options)`: the spec's integer target, blocks (as a granularity), mapping and zero-point domain; the
        options' eps, preserve_zero, rounding and dtypes (float scales of `options.scale_dtype`, else of the
        weight's dtype `spec.dtype`). ValueError for what fake quantization cannot express: a float target,
        power-of-two scales, a partial code range."""
        opts = options if options is not None else QParamOptions()
        if spec.target.is_float or spec.target.torch_dtype is None:
            raise ValueError(f"spec target {spec.target.name} has no FakeQuantizeConfig: it fake-quantizes onto "
                             "integer targets (torch.int1..int8, torch.uint1..uint8)")
        if spec.scale_type is not None:
            raise ValueError(f"power-of-two ({spec.scale_type}) scales have no QAT counterpart (FakeQuantizeConfig "
                             "learns float scales); train with scale_type=None and quantize with power-of-two scales "
                             "after training")
        full = QuantSpec.create(spec.shape, spec.dtype, spec.target, spec.block_size)
        if (spec.quant_min, spec.quant_max) != (full.quant_min, full.quant_max):
            raise ValueError(f"spec {spec.target} [{spec.quant_min}, {spec.quant_max}] has no FakeQuantizeConfig "
                             "(full integer ranges only)")
        scale_dtype = opts.scale_dtype or spec.dtype
        zp_dtype = opts.zero_point_dtype or (torch.int32 if spec.zero_point_domain is ZeroPointDomain.INT
                                             else scale_dtype)
        return cls(spec.target.torch_dtype, _block_granularity(spec.shape, spec.block_size), spec.mapping_type,
                   scale_dtype, zp_dtype, spec.zero_point_domain, eps=opts.eps, preserve_zero=opts.preserve_zero,
                   rounding=opts.rounding)

    @classmethod
    def from_activation_quant(cls, aq: ActivationQuant) -> FakeQuantizeConfig:
        """The fake quantization `quantize_activation` computes for a dynamic integer `aq` (its granularity,
        mapping and domain; float32 scales, int32 zero points). ValueError for static, float or MX activations."""
        if aq.static or aq.is_mx or aq.dtype.torch_dtype is None or aq.dtype.is_float:
            raise ValueError(f"activation quantization {aq} has no QAT counterpart (dynamic integer only)")
        return cls(aq.dtype.torch_dtype, aq.granularity, aq.mapping_type, torch.float32, torch.int32,
                   aq.zero_point_domain, eps=aq.eps)

    def replace(self, **changes) -> FakeQuantizeConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _block_granularity(shape: tuple[int, ...], block: tuple[int, ...]) -> Granularity:
    """The granularity whose blocks on `shape` are `block`."""
    if block == shape:
        return PerTensor()
    if block[0] == 1 and block[1:] == shape[1:]:
        return PerAxis(0)
    if all(b == 1 for b in block[:-1]) and shape[-1] % block[-1] == 0:
        return PerGroup(block[-1])
    return PerBlock(block)


def block_size_for(config: FakeQuantizeConfig, shape: tuple[int, ...], activation: bool) -> tuple[int, ...]:
    """block_size of `config.granularity` on a tensor of `shape` (an activation is viewed as [M, K])."""
    from affineq.granularity import get_block_size

    g = config.granularity
    if activation and isinstance(g, (PerToken, PerRow)):
        return (1,) * (len(shape) - 1) + (shape[-1],)
    if isinstance(g, PerBlock) and len(g.sizes) != len(shape):
        raise ValueError(f"granularity={g!r} has {len(g.sizes)} sizes for a {len(shape)}-D tensor {shape}")
    return get_block_size(shape, g)
