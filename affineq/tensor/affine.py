"""`AffineQuantizedTensor`: the one public tensor type of affineq.

A wrapper subclass whose shape and dtype are those of the float tensor it replaces. It stores the tensors
its packing format produced (`affineq.tensor.formats`) and a hashable `QuantSpec`. Every op goes through
the tables in `affineq.tensor.ops`: `__torch_function__` catches `F.linear` and friends before they
decompose, `__torch_dispatch__` handles aten ops, and anything not in a table runs on the dequantized
tensor with a one-time notice.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from pathlib import Path

import torch

from affineq.dtypes import check_quant_range, float_range, is_float_target
from affineq.primitives import (
    MappingType,
    ZeroPointDomain,
    choose_qparams_affine,
    quantize_affine,
)
from affineq.tensor.formats import get_format
from affineq.tensor.spec import ActivationQuant, QuantSpec

__all__ = ["AffineQuantizedTensor"]


@functools.cache
def _source_digest() -> str:
    """Digest of the Python sources that run inside a compiled graph (affineq/**/*.py)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


class AffineQuantizedTensor(torch.Tensor):
    """A float tensor stored as affine-quantized codes: x ~= dequantize(codes, scale, zero_point).

    Fields: `qdata` (packed codes), `scale`, `zero_point` (canonical qparams, shape = number of blocks per
    dim), `block_size`, `quant_min`, `quant_max`, `zero_point_domain`, `target_dtype`, `packing_format`,
    `act_quant` (dynamic activation quantization applied by linear, or None). `spec` holds them all.
    """

    spec: QuantSpec
    _names: tuple[str, ...]

    @staticmethod
    def __new__(cls, tensors: dict[str, torch.Tensor], spec: QuantSpec, requires_grad: bool = False):
        device = tensors["qdata"].device
        return torch.Tensor._make_wrapper_subclass(
            cls, spec.logical_shape, dtype=spec.dtype, device=device, requires_grad=requires_grad
        )

    def __init__(self, tensors: dict[str, torch.Tensor], spec: QuantSpec, requires_grad: bool = False):
        self.spec = spec
        self._names = tuple(tensors)
        for name, t in tensors.items():
            setattr(self, "_" + name, t)

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_float(
        cls,
        input: torch.Tensor,
        mapping_type: MappingType,
        block_size: tuple[int, ...],
        target_dtype: torch.dtype,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float | None = None,
        scale_dtype: torch.dtype | None = None,
        zero_point_dtype: torch.dtype | None = None,
        preserve_zero: bool = True,
        zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
        packing_format: str = "plain",
        act_quant: ActivationQuant | None = None,
    ) -> AffineQuantizedTensor:
        """Quantize a float tensor: choose_qparams_affine, then quantize_affine, then pack."""
        scale, zero_point = choose_qparams_affine(
            input, mapping_type, block_size, target_dtype, quant_min, quant_max, eps, scale_dtype,
            zero_point_dtype, preserve_zero, zero_point_domain,
        )
        return cls.from_qparams(
            input, scale, zero_point, block_size, target_dtype, quant_min, quant_max, zero_point_domain,
            packing_format=packing_format, mapping_type=mapping_type, act_quant=act_quant,
        )

    @classmethod
    def from_qparams(
        cls,
        input: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        block_size: tuple[int, ...],
        target_dtype: torch.dtype,
        quant_min: int | None = None,
        quant_max: int | None = None,
        zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
        *,
        packing_format: str = "plain",
        mapping_type: MappingType = MappingType.ASYMMETRIC,
        act_quant: ActivationQuant | None = None,
    ) -> AffineQuantizedTensor:
        """Quantize `input` with precomputed qparams (from an observer, GPTQ, AWQ...) and pack.

        A format that stores qparams in lower precision (dense with bf16 scales) rounds them first, and the
        codes are computed with the rounded values."""
        spec = cls._spec(tuple(input.shape), input.dtype, block_size, target_dtype, quant_min, quant_max,
                         zero_point_domain, packing_format, mapping_type, act_quant)
        n_blocks = spec.num_blocks
        scale, zero_point = cls._checked_format(spec).represent_qparams(
            scale.reshape(n_blocks), None if zero_point is None else zero_point.reshape(n_blocks), spec
        )
        codes = quantize_affine(
            input, block_size, scale, zero_point, target_dtype, quant_min, quant_max, zero_point_domain
        )
        return cls.from_codes(
            codes, scale, zero_point, block_size, target_dtype, quant_min, quant_max, zero_point_domain,
            dtype=input.dtype, packing_format=packing_format, mapping_type=mapping_type,
            act_quant=act_quant,
        )

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        block_size: tuple[int, ...],
        target_dtype: torch.dtype,
        quant_min: int | None = None,
        quant_max: int | None = None,
        zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
        *,
        dtype: torch.dtype = torch.float32,
        packing_format: str = "plain",
        mapping_type: MappingType = MappingType.ASYMMETRIC,
        act_quant: ActivationQuant | None = None,
    ) -> AffineQuantizedTensor:
        """Wrap already-computed codes (as `quantize_affine` returns them); `dtype` is the logical dtype."""
        spec = cls._spec(tuple(codes.shape), dtype, block_size, target_dtype, quant_min, quant_max,
                         zero_point_domain, packing_format, mapping_type, act_quant)
        fmt = cls._checked_format(spec)
        n_blocks = spec.num_blocks
        scale = scale.reshape(n_blocks)
        zero_point = None if zero_point is None else zero_point.reshape(n_blocks)
        return cls(fmt.pack(codes, scale, zero_point, spec), spec)

    @staticmethod
    def _spec(shape, dtype, block_size, target_dtype, quant_min, quant_max, zero_point_domain, packing_format,
              mapping_type, act_quant) -> QuantSpec:
        if is_float_target(target_dtype):
            lo, hi = float_range(target_dtype)
            qmin, qmax = (lo if quant_min is None else quant_min), (hi if quant_max is None else quant_max)
        else:
            qmin, qmax = check_quant_range(target_dtype, quant_min, quant_max)
        return QuantSpec(
            shape=shape, dtype=dtype, target_dtype=target_dtype, block_size=tuple(int(b) for b in block_size),
            quant_min=qmin, quant_max=qmax, zero_point_domain=zero_point_domain, mapping_type=mapping_type,
            fmt=packing_format, act_quant=act_quant,
        )

    @staticmethod
    def _checked_format(spec: QuantSpec):
        fmt = get_format(spec.fmt)
        why = fmt.check(spec)
        if why is not None:
            raise ValueError(f"packing_format={spec.fmt!r} cannot hold this tensor: {why}")
        return fmt

    # -- fields ---------------------------------------------------------------------------------------

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (what the packing format produced)."""
        return {name: getattr(self, "_" + name) for name in self._names}

    @property
    def qdata(self) -> torch.Tensor:
        return self._qdata

    @property
    def scale(self) -> torch.Tensor:
        return get_format(self.spec.fmt).qparams(self.tensors, self.spec)[0]

    @property
    def zero_point(self) -> torch.Tensor | None:
        return get_format(self.spec.fmt).qparams(self.tensors, self.spec)[1]

    @property
    def block_size(self) -> tuple[int, ...]:
        return self.spec.block_size

    @property
    def target_dtype(self) -> torch.dtype:
        return self.spec.target_dtype

    @property
    def quant_min(self) -> int | float:
        return self.spec.quant_min

    @property
    def quant_max(self) -> int | float:
        return self.spec.quant_max

    @property
    def zero_point_domain(self) -> ZeroPointDomain:
        return self.spec.zero_point_domain

    @property
    def packing_format(self) -> str:
        return self.spec.fmt

    @property
    def act_quant(self) -> ActivationQuant | None:
        return self.spec.act_quant

    def codes(self) -> torch.Tensor:
        """Unpacked codes in the target's container dtype (untransposed layout, shape `spec.shape`)."""
        return get_format(self.spec.fmt).codes(self.tensors, self.spec)

    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float tensor these codes stand for, shape `self.shape`, dtype `output_dtype or self.dtype`."""
        out = get_format(self.spec.fmt).dequantize(self.tensors, self.spec, output_dtype or self.dtype)
        return out.t() if self.spec.transposed else out

    def storage_bytes(self) -> int:
        """Bytes held by the stored tensors (codes and qparams)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self, *, tensor_contents=None) -> str:
        s = self.spec
        extra = f", act_quant={s.act_quant.dtype}/{s.act_quant.granularity}" if s.act_quant else ""
        extra += ", transposed" if s.transposed else ""
        return (
            f"AffineQuantizedTensor(shape={tuple(self.shape)}, dtype={s.dtype}, target={s.target_dtype}, "
            f"block_size={s.block_size}, format={s.fmt}, domain={s.zero_point_domain.name}{extra})"
        )

    # -- tracing and serialization --------------------------------------------------------------------

    def __tensor_flatten__(self):
        return ["_" + n for n in self._names], self.spec

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, spec, outer_size, outer_stride):
        return cls({k[1:]: v for k, v in inner_tensors.items()}, spec)

    def _stable_hash_for_caching(self) -> str:
        """Key for torch.compile's on-disk caches: spec, inner tensors' shapes/dtypes/devices, and a digest of
        affineq's own dispatch code, which those caches cannot see (an upgraded affineq must not reuse graphs
        traced through the old one)."""
        inner = [(n, tuple(t.shape), str(t.dtype), str(t.device)) for n, t in self.tensors.items()]
        payload = pickle.dumps((tuple(self.shape), self.requires_grad, self.spec, inner, _source_digest()))
        return hashlib.blake2b(payload, digest_size=16).hexdigest()

    def _replace(self, spec: QuantSpec | None = None, **tensors: torch.Tensor) -> AffineQuantizedTensor:
        new = self.tensors
        new.update(tensors)
        return AffineQuantizedTensor(new, spec or self.spec)

    def _apply_to_tensors(self, fn, spec: QuantSpec | None = None) -> AffineQuantizedTensor:
        return AffineQuantizedTensor({k: fn(v) for k, v in self.tensors.items()}, spec or self.spec)

    # -- dispatch: the tables live in affineq.tensor.ops ----------------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from affineq.tensor import ops

        return ops.torch_function(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from affineq.tensor import ops

        return ops.torch_dispatch(func, types, args, kwargs or {})
