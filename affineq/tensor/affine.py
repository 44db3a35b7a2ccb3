"""`AffineQuantizedTensor`: the one public tensor type of affineq.

A wrapper subclass whose shape and dtype are those of the float tensor it replaces. It stores the tensors
its packing format produced (`affineq.tensor.formats`), optional activation tensors (names starting with
``act_``: see `ACT_TENSORS`) and a hashable `QuantSpec`. Every op goes through the class's op tables
(filled by `affineq.tensor.ops` through `AffineQuantizedTensor.implements`; a subclass inherits them and
may override entries): `__torch_function__` catches `F.linear` and friends before they decompose,
`__torch_dispatch__` handles aten ops, and anything in no table runs on the dequantized tensor with a
one-time notice (`affineq.tensor.dispatch`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import pickle
import warnings
from pathlib import Path
from typing import ClassVar

import torch

from affineq.blocks import Blocks
from affineq.dtypes import QType
from affineq.mx import pow2_scale_exponent
from affineq.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, quantize_affine
from affineq.process_memory import release_float_copy
from affineq.tensor import dispatch
from affineq.tensor.format_experts import format_of
from affineq.tensor.spec import ActivationQuant, QParamOptions, QuantSpec

__all__ = ["ACT_TENSORS", "AffineQuantizedTensor"]

#: Activation tensors a weight may carry, applied by `linear` to its input (never by the packing format):
#: act_pre_scale [K]: x -> x * act_pre_scale (AWQ / SmoothQuant input scaling, per input channel);
#: act_scale, act_zero_point [1]: calibrated per-tensor activation qparams (`ActivationQuant(static=True)`);
#: act_out_scale [1] float32, act_out_zero_point [1] int32 (optional): the layer's output is quantized to int8
#: with these calibrated qparams (static output quantization) before it is returned.
ACT_TENSORS = ("act_pre_scale", "act_scale", "act_zero_point", "act_out_scale", "act_out_zero_point")
#: Every stored tensor name an AffineQuantizedTensor was built with in this process (see `__dir__`).
_SEEN_NAMES: set[str] = set(ACT_TENSORS)


@functools.cache
def _source_digest() -> str:
    """Digest of the Python sources that run inside a compiled graph (affineq/**/*.py)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def _check_act_tensors(t: dict[str, torch.Tensor], spec: QuantSpec) -> None:
    """ValueError unless the activation tensors in `t` fit `spec` (names, shapes, dtypes, static qparams)."""
    unknown = [n for n in t if n.startswith("act_") and n not in ACT_TENSORS]
    if unknown:
        raise ValueError(f"unknown activation tensors {unknown}; use one of {list(ACT_TENSORS)}")
    pre = t.get("act_pre_scale")
    if pre is not None and (pre.dim() != 1 or pre.shape[0] != spec.shape[-1] or not pre.dtype.is_floating_point):
        raise ValueError(f"act_pre_scale must be a float tensor of shape [{spec.shape[-1]}] (one per input "
                         f"channel), got {pre.dtype} {tuple(pre.shape)}")
    out_scale, out_zp = t.get("act_out_scale"), t.get("act_out_zero_point")
    if out_zp is not None and out_scale is None:
        raise ValueError("act_out_zero_point needs act_out_scale (the calibrated output scale)")
    if out_scale is not None and (out_scale.numel() != 1 or out_scale.dtype != torch.float32):
        raise ValueError(f"act_out_scale must be one float32 value, got {out_scale.dtype} {tuple(out_scale.shape)}")
    if out_zp is not None and (out_zp.numel() != 1 or out_zp.dtype != torch.int32):
        raise ValueError(f"act_out_zero_point must be one int32 value, got {out_zp.dtype} {tuple(out_zp.shape)}")
    aq = spec.act_quant
    static = aq is not None and aq.static
    for name in ("act_scale", "act_zero_point"):
        x = t.get(name)
        if x is not None and not static:
            raise ValueError(f"{name} is given but the spec has no static activation quantization; set "
                             "act_quant=ActivationQuant(..., static=True)")
        if x is not None and x.numel() != 1:
            raise ValueError(f"{name} must hold one value (per-tensor activation qparams), got shape {tuple(x.shape)}")
    if static:
        if "act_scale" not in t:
            raise ValueError("ActivationQuant(static=True) needs a calibrated act_scale tensor")
        needs_zp = not aq.dtype.is_float and aq.zero_point_domain is not ZeroPointDomain.NONE
        if needs_zp != ("act_zero_point" in t):
            raise ValueError(f"static {aq.zero_point_domain.name}-domain activation quantization "
                             f"{'needs' if needs_zp else 'takes no'} act_zero_point")


def _as_kernels_read(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Loaded stored tensors in the layout the kernels read: contiguous (aten's int4 / int8 packed matmuls read
    the bytes in order, ignoring strides), and plain int8 CPU codes 16-byte aligned (aten's `_weight_int8pack_mm`
    reads them with aligned loads and crashes on a view at another offset; safetensors aligns to 8 bytes). A copy
    only where needed: the tensors every writer stores are kept as loaded."""
    out = {k: v.contiguous() for k, v in tensors.items()}
    q = out.get("qdata")
    if spec.fmt == "plain" and q is not None and q.dtype == torch.int8 and q.device.type == "cpu" \
            and q.data_ptr() % 16:
        out["qdata"] = q.clone()
    return out


def _check_finite_qparams(scale: torch.Tensor, zero_point: torch.Tensor | None) -> None:
    """ValueError for inf / NaN qparams (e.g. a finite tensor whose range max - min overflows the scale
    dtype): they would dequantize to NaN. Skipped while tracing and on meta tensors."""
    if torch.compiler.is_compiling() or scale.device.type == "meta":
        return
    bad = [name for name, q in (("scale", scale), ("zero_point", zero_point))
           if q is not None and q.dtype.is_floating_point and not bool(torch.isfinite(q).all())]
    if bad:
        raise ValueError(
            f"the qparams ({' and '.join(bad)}) are not finite: the tensor's range overflows {scale.dtype} "
            "(|values| near the float limit, or inf/NaN qparams passed in), so it would dequantize to NaN; "
            "scale the tensor down before quantizing, or pass finite qparams"
        )


def _row_chunks(input: torch.Tensor, spec: QuantSpec, rows: int) -> bool:
    """Whether `from_spec(..., chunk_rows=rows)` quantizes `input` by row chunks: 2-D, row-local qparams, and
    more than one chunk."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"chunk_rows must be a positive int (rows per chunk), got {rows!r}")
    return input.dim() == 2 and spec.block_size[0] == 1 and not spec.transposed and input.shape[0] > rows


def _min_max_qparams(input: torch.Tensor, spec: QuantSpec, o: QParamOptions):
    if spec.scale_type is not None and o.scale_mode is not None:
        return _pow2_qparams(input, spec, o.scale_mode), None
    return choose_qparams_affine(input, spec.mapping_type, spec.block_size, spec.target, spec.quant_min,
                                 spec.quant_max, o.eps, o.scale_dtype, o.zero_point_dtype, o.preserve_zero,
                                 spec.zero_point_domain)


def _pow2_qparams(input: torch.Tensor, spec: QuantSpec, scale_mode: str) -> torch.Tensor:
    """fp32 power-of-two scales [n_blocks...] chosen by the MX rule `scale_mode` (`affineq.mx`) from each block's
    amax and the code range's positive end: the one place e8m0 scales with a `QParamOptions.scale_mode` are
    chosen, so from_spec, stored_qparams (GPTQ/AWQ/HQQ/QAT) and the configs agree."""
    if spec.zero_point_domain is not ZeroPointDomain.NONE or spec.mapping_type is MappingType.ASYMMETRIC:
        raise ValueError(f"scale_mode={scale_mode!r} picks a power-of-two scale for symmetric codes without a zero "
                         f"point; this spec is {spec.mapping_type.name} / {spec.zero_point_domain.name}: use "
                         "MappingType.SYMMETRIC with a signed target, or scale_mode=None")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(input).all()):
        raise ValueError("input contains NaN or Inf, which has no finite scale; clean the tensor (torch.nan_to_num) "
                         "first (affineq.mx.quantize_mx marks such blocks NaN instead)")
    amax = _block_amax(input, spec.block_size)
    return torch.exp2(pow2_scale_exponent(amax, spec.target, scale_mode, spec.quant_max).float())


def _block_amax(input: torch.Tensor, block_size: tuple[int, ...]) -> torch.Tensor:
    """max |x| per block, shape [d // b per dim]."""
    b = Blocks(input.shape, block_size)
    return input.abs().reshape(b.blocked).amax(dim=b.reduce_dims)


class AffineQuantizedTensor(torch.Tensor):
    """A float tensor stored as affine-quantized codes: x ~= dequantize(codes, scale, zero_point).

    Fields: `qdata` (packed codes), `scale`, `zero_point` (canonical qparams, shape = number of blocks per
    dim), `block_size`, `quant_min`, `quant_max`, `zero_point_domain`, `target` (a QType; `target_dtype` the
    torch dtype where one exists), `packing_format`, `act_quant`; `spec` holds them all. `tensors` are the
    stored tensors by name (format tensors, then activation tensors).
    """

    spec: QuantSpec
    _names: tuple[str, ...]
    _torch_function_table: ClassVar[dict] = {}
    _dispatch_table: ClassVar[dict] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._torch_function_table = {}  # own entries; lookups walk the MRO, so parents' entries are inherited
        cls._dispatch_table = {}

    @staticmethod
    def __new__(cls, tensors: dict[str, torch.Tensor], spec: QuantSpec, requires_grad: bool = False):
        device = tensors["qdata"].device
        # Never an inference tensor: a view op (detach, slice) under torch.inference_mode() on a normal quantized
        # weight sets its output's version counter, which an inference tensor does not have.
        inference = torch.is_inference_mode_enabled() and not torch.compiler.is_compiling()
        with torch.inference_mode(False) if inference else contextlib.nullcontext():
            return torch.Tensor._make_wrapper_subclass(
                cls, spec.logical_shape, dtype=spec.dtype, device=device, requires_grad=requires_grad
            )

    def __init__(self, tensors: dict[str, torch.Tensor], spec: QuantSpec, requires_grad: bool = False):
        self.spec = spec
        self._names = tuple(tensors)
        if not torch.compiler.is_compiling() and not _SEEN_NAMES.issuperset(self._names):  # no traced side effect
            _SEEN_NAMES.update(self._names)
        for name, t in tensors.items():
            setattr(self, "_" + name, t)

    def __dir__(self):
        # torch.export (2.13, non-strict) traces reads of the attributes it finds in dir() of the *first*
        # instance of a subclass as graph nodes, for every instance: list each stored tensor name any instance
        # has, else a weight storing one the first lacks (dense `offset` after a `plain` weight, say) has it
        # baked into the program as a constant, and export fails ("fake tensor in the constant's list").
        with torch._C.DisableTorchFunctionSubclass():
            names = torch.Tensor.__dir__(self)
        return sorted(set(names) | {"_" + n for n in _SEEN_NAMES})

    # -- op tables ------------------------------------------------------------------------------------

    @classmethod
    def implements(cls, *ops):
        """Register `fn(func, args, kwargs)` for torch functions (F.linear) or aten ops / overload packets
        on this class (a subclass overrides its parent's entry by registering its own)."""

        def register(fn):
            for op in ops:
                aten_op = isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                (cls._dispatch_table if aten_op else cls._torch_function_table)[op] = fn
            dispatch.forget_resolved()
            return fn

        return register

    @classmethod
    def op_handler(cls, op):
        """The registered handler of `op` for this class (or a parent), or None."""
        return dispatch.lookup(cls, op)

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, input: torch.Tensor, spec: QuantSpec | tuple[int, ...], options: QParamOptions | None = None,
                  *, target: torch.dtype | QType | str | None = None, chunk_rows: int | None = None,
                  **spec_args) -> AffineQuantizedTensor:
        """Quantize float `input` as `spec` describes: choose_qparams_affine (with `options`), quantize, pack.

        `spec`: a `QuantSpec`, or a block size with `target=` and `QuantSpec.create` keywords (mapping_type,
        zero_point_domain, quant_min, quant_max, packing_format, act_quant), as `from_qparams` takes them.
        `chunk_rows`: quantize a 2-D input whose qparams are row-local (block_size[0] == 1: per row, per group)
        `chunk_rows` rows at a time, bit-identical to the whole. The fp32 temporaries (~4x the input) shrink to
        one chunk plus the codes (one byte per weight), and each chunk's pages are given back once quantized
        (a memory-mapped weight read from safetensors: `affineq.streaming`). Other inputs are quantized whole."""
        spec = cls._as_spec(input.shape, input.dtype, spec, target, spec_args)
        o = options or QParamOptions()
        if chunk_rows is not None and _row_chunks(input, spec, chunk_rows):
            return cls._from_spec_by_rows(input, spec, o, chunk_rows)
        scale, zero_point = _min_max_qparams(input, spec, o)
        return cls.from_qparams(input, scale, zero_point, spec, rounding=o.rounding)

    @classmethod
    def _from_spec_by_rows(cls, input: torch.Tensor, spec: QuantSpec, o: QParamOptions, rows: int,
                           ) -> AffineQuantizedTensor:
        """`from_spec` chunk by chunk: `stored_qparams` + `quantize_affine` per chunk, as `from_qparams` computes
        them on the whole, then one pack."""
        codes: torch.Tensor | None = None  # filled in place: a list + torch.cat would hold the codes twice
        scales, zero_points = [], []
        for r in range(0, input.shape[0], rows):
            chunk = input[r:r + rows]
            scale, zero_point = cls.stored_qparams(chunk, spec.replace(shape=tuple(chunk.shape)), o)
            _check_finite_qparams(scale, zero_point)
            c = quantize_affine(chunk, spec.block_size, scale, zero_point, spec.target, spec.quant_min,
                                spec.quant_max, spec.zero_point_domain, rounding=o.rounding)
            if codes is None:
                codes = torch.empty(input.shape, dtype=c.dtype, device=c.device)
            codes[r:r + rows] = c
            release_float_copy(chunk)  # rows already quantized: their mmapped pages are not needed again
            scales.append(scale)
            zero_points.append(zero_point)
        zero_point = None if zero_points[0] is None else torch.cat(zero_points)
        return cls.from_codes(codes, torch.cat(scales), zero_point, spec)

    @staticmethod
    def stored_qparams(input: torch.Tensor, spec: QuantSpec, options: QParamOptions | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero_point) shaped [n_blocks...] that `from_spec(input, spec, options)` stores: min/max
        qparams with `options`, rounded as the format holds them (bf16 scales, e8m0...). Algorithms compute
        with these so that their results equal what the packed tensor dequantizes to."""
        scale, zero_point = _min_max_qparams(input, spec, options or QParamOptions())
        n = spec.num_blocks
        return format_of(spec).represent_qparams(
            scale.reshape(n), None if zero_point is None else zero_point.reshape(n), spec)

    @classmethod
    def from_float(
        cls,
        input: torch.Tensor,
        mapping_type: MappingType,
        block_size: tuple[int, ...],
        target_dtype: torch.dtype | QType | str,
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
        """Deprecated: `from_spec(input, block_size, QParamOptions(eps, scale_dtype, zero_point_dtype,
        preserve_zero), target=target_dtype, mapping_type=..., ...)` (one quantizing constructor)."""
        warnings.warn("AffineQuantizedTensor.from_float is deprecated: use AffineQuantizedTensor.from_spec(input, "
                      "block_size, QParamOptions(...), target=target_dtype, mapping_type=..., ...)",
                      DeprecationWarning, stacklevel=2)
        return cls.from_spec(input, block_size, QParamOptions(eps, scale_dtype, zero_point_dtype, preserve_zero),
                             target=target_dtype, mapping_type=mapping_type, zero_point_domain=zero_point_domain,
                             quant_min=quant_min, quant_max=quant_max, packing_format=packing_format,
                             act_quant=act_quant)

    @classmethod
    def from_qparams(cls, input: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                     spec: QuantSpec | tuple[int, ...], target: torch.dtype | QType | None = None,
                     *, rounding: str = "half_even", **spec_args) -> AffineQuantizedTensor:
        """Quantize `input` with precomputed qparams (from an observer, GPTQ, AWQ...) and pack.

        `spec`: a `QuantSpec`, or a block size followed by the target and `QuantSpec.create` keywords
        (quant_min, quant_max, zero_point_domain, mapping_type, packing_format, act_quant). A format that
        stores qparams in lower precision (dense with bf16 scales, e8m0 scales) rounds them first, and the
        codes are computed with the rounded values. `rounding`: as in `quantize_affine`."""
        spec = cls._as_spec(input.shape, input.dtype, spec, target, spec_args)
        n_blocks = spec.num_blocks
        scale, zero_point = cls._checked_format(spec).represent_qparams(
            scale.reshape(n_blocks), None if zero_point is None else zero_point.reshape(n_blocks), spec
        )
        _check_finite_qparams(scale, zero_point)
        codes = quantize_affine(input, spec.block_size, scale, zero_point, spec.target, spec.quant_min,
                                spec.quant_max, spec.zero_point_domain, rounding=rounding)
        return cls.from_codes(codes, scale, zero_point, spec.replace(dtype=input.dtype))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                   spec: QuantSpec | tuple[int, ...], target: torch.dtype | QType | None = None,
                   *, dtype: torch.dtype = torch.float32, **spec_args) -> AffineQuantizedTensor:
        """Wrap already-computed codes (as `quantize_affine` returns them). `spec`: a `QuantSpec` (its dtype
        is the logical dtype), or a block size, the target, the logical `dtype` and `QuantSpec.create`
        keywords."""
        spec = cls._as_spec(codes.shape, dtype, spec, target, spec_args)
        fmt = cls._checked_format(spec)
        n_blocks = spec.num_blocks
        scale = scale.reshape(n_blocks)
        zero_point = None if zero_point is None else zero_point.reshape(n_blocks)
        return cls(fmt.pack(codes, scale, zero_point, spec), spec)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> AffineQuantizedTensor:
        """Rebuild a tensor from stored tensors (as `.tensors` returns them) and its spec, e.g. from a
        safetensors file and `QuantSpec.from_dict`. Checks every name, shape and dtype against what the
        format declares (and the activation tensors against the spec); ValueError names what is wrong."""
        if not isinstance(spec, QuantSpec):
            raise ValueError(f"spec must be a QuantSpec (use QuantSpec.from_dict to read a stored one), got {spec!r}")
        if not isinstance(tensors, dict):
            raise ValueError(f"tensors must be a dict of name -> tensor (as AffineQuantizedTensor.tensors returns "
                             f"it), got {type(tensors).__name__}")
        fmt = format_of(spec)
        fmt.validate({k: v for k, v in tensors.items() if not k.startswith("act_")}, spec)
        _check_act_tensors(tensors, spec)
        return cls(_as_kernels_read(tensors, spec), spec)

    @staticmethod
    def _as_spec(shape, dtype, spec, target, spec_args: dict) -> QuantSpec:
        if isinstance(spec, QuantSpec):
            if target is not None or spec_args:
                raise ValueError("pass either a QuantSpec or a block size with its target and options, not both")
            if tuple(shape) != spec.shape:
                raise ValueError(f"input shape {tuple(shape)} does not match spec.shape {spec.shape}")
            return spec
        if target is None:
            raise ValueError("pass a QuantSpec, or a block size and the target (e.g. torch.int4)")
        return QuantSpec.create(tuple(shape), dtype, target, spec, **spec_args)

    @staticmethod
    def _checked_format(spec: QuantSpec):
        fmt = format_of(spec)
        why = fmt.check(spec)
        if why is not None:
            raise ValueError(f"packing_format={spec.fmt!r} cannot hold this tensor: {why}; choose another "
                             "packing_format ('plain' holds any tensor)")
        return fmt

    def with_act_tensors(self, **act: torch.Tensor | None) -> AffineQuantizedTensor:
        """A copy carrying activation tensors (`ACT_TENSORS`; None removes one), checked against the spec."""
        tensors = self.tensors
        for name, t in act.items():
            if name not in ACT_TENSORS:
                raise ValueError(f"unknown activation tensor {name!r}; use one of {list(ACT_TENSORS)}")
            if t is None:
                tensors.pop(name, None)
            else:
                tensors[name] = t.reshape(-1) if name == "act_pre_scale" else t.reshape(1)
        _check_act_tensors(tensors, self.spec)
        return type(self)(tensors, self.spec)

    def to_format(self, packing_format: str) -> AffineQuantizedTensor:
        """The same codes and qparams in another packing format (e.g. `plain` for a portable checkpoint)."""
        spec = self.spec.replace(fmt=packing_format, transposed=False)
        out = type(self).from_codes(self.codes(), self.scale, self.zero_point, spec)
        out = out.with_act_tensors(**self.act_tensors) if self.act_tensors else out
        return out._replace(spec=out.spec.replace(transposed=self.spec.transposed))

    @classmethod
    def from_torch_quantized(cls, qt: torch.Tensor) -> AffineQuantizedTensor:
        """The tensor holding a torch quantized tensor's codes and qparams (see `affineq.tensor.torch_quantized`)."""
        from affineq.tensor.torch_quantized import from_torch_quantized
        return from_torch_quantized(qt, cls)

    def to_torch_quantized(self) -> torch.Tensor:
        """A torch quantized tensor with equal `int_repr()` and `dequantize()` (`affineq.tensor.torch_quantized`)."""
        from affineq.tensor.torch_quantized import to_torch_quantized
        return to_torch_quantized(self)

    def to_portable(self) -> AffineQuantizedTensor:
        """This tensor in a device-independent format (`int4_cpu` / `int4_cuda` -> `plain`), else itself."""
        portable = format_of(self.spec).portable
        return self if portable is None else self.to_format(portable)

    # -- fields ---------------------------------------------------------------------------------------

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (the packing format's, then any activation tensors)."""
        return {name: getattr(self, "_" + name) for name in self._names}

    @property
    def act_tensors(self) -> dict[str, torch.Tensor]:
        """The activation tensors (`ACT_TENSORS`) this weight carries."""
        return {n: getattr(self, "_" + n) for n in self._names if n.startswith("act_")}

    @property
    def qdata(self) -> torch.Tensor:
        return self._qdata

    @property
    def scale(self) -> torch.Tensor:
        return format_of(self.spec).qparams(self.tensors, self.spec)[0]

    @property
    def zero_point(self) -> torch.Tensor | None:
        return format_of(self.spec).qparams(self.tensors, self.spec)[1]

    @property
    def block_size(self) -> tuple[int, ...]:
        return self.spec.block_size

    @property
    def target(self) -> QType:
        return self.spec.target

    @property
    def target_dtype(self) -> torch.dtype | QType:
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
        return format_of(self.spec).codes(self.tensors, self.spec)

    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float tensor these codes stand for, shape `self.shape`, dtype `output_dtype or self.dtype`.

        Activation tensors are not folded in: they transform the input of `linear`, not the weight."""
        if output_dtype is not None and not (isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point):
            raise TypeError(f"dequantize: output_dtype must be a floating-point torch.dtype (torch.float32, "
                            f"torch.bfloat16, torch.float16) or None, got {output_dtype!r}")
        out = format_of(self.spec).dequantize(self.tensors, self.spec, output_dtype or self.dtype)
        return out.transpose(-2, -1) if self.spec.transposed else out

    def storage_bytes(self) -> int:
        """Bytes held by the stored tensors (codes, qparams and activation tensors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self, *, tensor_contents=None) -> str:
        s = self.spec
        aq = s.act_quant
        extra = f", act_quant={aq.dtype}/{aq.granularity_name}{'/static' if aq.static else ''}" if aq else ""
        extra += f", scale_type={s.scale_type}" if s.scale_type is not None else ""
        extra += f", act_tensors={list(self.act_tensors)}" if self.act_tensors else ""
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
        tensors = {k[1:]: v for k, v in inner_tensors.items()}
        layout = format_of(spec).layout(spec)
        want = set(layout)
        have = {n for n in tensors if not n.startswith("act_")}
        if not {n for n, lay in layout.items() if not lay.optional} <= have <= want:
            raise ValueError(f"format {spec.fmt!r} stores tensors {sorted(want)}, got {sorted(have)}")
        return cls(tensors, spec)

    def __setstate__(self, state) -> None:
        """Unpickling (torch.load, weights_only=True too): the pickled spec and stored tensors are checked as
        `from_tensors` checks them (names, shapes, dtypes, activation tensors), and the tensor's own shape and
        dtype against the spec, so a tampered checkpoint fails at load with a ValueError naming what is wrong,
        not at first use."""
        attrs = state[0] if isinstance(state, tuple) and len(state) == 2 and not state[1] else state
        if not isinstance(attrs, dict):
            raise ValueError(f"cannot unpickle an AffineQuantizedTensor from a {type(state).__name__} state; the "
                             "checkpoint was not written by affineq (or was edited)")
        spec, names = attrs.get("spec"), attrs.get("_names")
        if not isinstance(spec, QuantSpec):
            raise ValueError(f"cannot unpickle an AffineQuantizedTensor: its spec is {type(spec).__name__}, not a "
                             "QuantSpec (the checkpoint was edited or not written by affineq)")
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"cannot unpickle an AffineQuantizedTensor: _names={names!r} is not a tuple of stored "
                             "tensor names")
        tensors = {n: attrs.get("_" + n) for n in names}
        bad = [n for n, t in tensors.items() if not isinstance(t, torch.Tensor)]
        shadow = [k for k in attrs if not isinstance(k, str) or hasattr(type(self), k)]
        if bad or shadow:
            raise ValueError(f"cannot unpickle an AffineQuantizedTensor: stored tensors {bad} are missing or not "
                             f"tensors, attributes {shadow} would replace the class's own")
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(torch.Tensor.size(self)), torch.Tensor.dtype.__get__(self)
        if shape != spec.logical_shape or dtype != spec.dtype:
            raise ValueError(f"cannot unpickle an AffineQuantizedTensor: it is {dtype} {shape}, but its spec "
                             f"describes {spec.dtype} {spec.logical_shape}")
        try:
            self._checked_format(spec).validate({k: v for k, v in tensors.items() if not k.startswith("act_")},
                                                spec)
            _check_act_tensors(tensors, spec)
        except ValueError as e:
            raise ValueError(f"cannot unpickle an AffineQuantizedTensor: {e}") from None
        attrs.update({"_" + n: t for n, t in _as_kernels_read(tensors, spec).items()})  # torch.save keeps views
        torch._utils._set_obj_state(self, state)

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
        return type(self)(new, spec or self.spec)

    def _apply_to_tensors(self, fn, spec: QuantSpec | None = None) -> AffineQuantizedTensor:
        return type(self)({k: fn(v) for k, v in self.tensors.items()}, spec or self.spec)

    # -- dispatch: tables filled by affineq.tensor.ops, entry points in affineq.tensor.dispatch ---------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch.torch_function(cls, func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch.torch_dispatch(cls, func, args, kwargs or {})
