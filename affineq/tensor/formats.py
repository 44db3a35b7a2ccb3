"""Packing formats: how the integer codes and their qparams are laid out in memory (pack / unpack only).

Every format turns (codes, scale, zero_point) into a dict of stored tensors and back. Which kernels can
multiply a format lives in `affineq.tensor.linear_kernels`; the op table never looks inside a format.

| format    | codes layout                                      | qparams stored                       | shapes      |
|-----------|---------------------------------------------------|--------------------------------------|-------------|
| plain     | one code per element (int8/uint8/int16/int32/fp8) | scale, zero_point (reduced shape)    | any rank    |
| dense     | 1-8 bit codes, fp8 / fp6 / fp4 codes, bit-packed  | scale, offset [N, K/g]: fp32 or bf16;| 2-D, (1, g) |
|           |                                                   | fp6 / fp4: fp32 scale, no offset;    |             |
|           |                                                   | e8m0: scale bytes [N, K/g], no offset|             |
| int4_cpu  | aten `_convert_weight_to_int4pack_for_cpu`        | scale_and_zero [K/g, N, 2]           | 2-D, (1, g) |
| int4_cuda | aten `_convert_weight_to_int4pack` (CUDA)         | scale_and_zero [K/g, N, 2] bf16      | 2-D, (1, g) |

2-D formats also hold 3-D expert weights [E, N, K] (block (1, 1, g)): each stored tensor gets a leading expert dim,
expert e's slice being exactly its 2-D tensor (`affineq.tensor.format_experts`).

Each format declares the tensors it stores (`layout`: name -> shape and allowed dtypes, checked by
`validate`, which `AffineQuantizedTensor.from_tensors` and `__tensor_unflatten__` call). Device-specific
layouts name a `portable` format that holds the same codes and qparams exactly (`int4_cpu` / `int4_cuda`
-> `plain`), so checkpoints need not be tied to a device.

`dense` and `int4_*` store the dequantization as an affine map of the unsigned code u = q - quant_min:
    w = scale * u + offset                                  (dense, fp32 qparams)
    w = scale * (u - 2**(bits-1)) + zero                    (dense with bf16 qparams; see `Dense`)
    w = scale * (u - 8) + zero,  zero = offset + 8 * scale  (int4 tinygemm layout)
with offset derived from the zero-point domain (see `_offset`), so one kernel serves INT, FLOAT and NONE.
Float8 / fp6 / fp4 codes in `dense` are their bit patterns, u = the float value, offset 0 (float8 stores the
zeros, fp6 / fp4 do not: fp4 with an fp32 scale per 32 costs 5 bits per element). With
`scale_type` e8m0 (OCP MX) `dense` stores one exponent byte per group and no offset:
    w = 2**(b - 127) * (c(u) + code_offset),  code_offset = quant_min (integer codes), 0 (float codes)
which is exact, so MXFP4 costs 4 + 8/32 = 4.25 bits per element, MXFP6 6.25, MXFP8 and MXINT8 8.25.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from affineq import cpp as _cpp
from affineq.bitpack import pack_codes, unpack_code_rows, unpack_codes
from affineq.primitives import MappingType, ZeroPointDomain, dequantize_affine
from affineq.tensor.spec import QuantSpec

Tensors = dict[str, torch.Tensor]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class TensorLayout:
    """What a format stores under one name: its shape (None = any) and the dtypes allowed."""

    shape: tuple[int, ...] | None
    dtypes: tuple[torch.dtype, ...]
    optional: bool = False  # may be absent (then the format's documented default applies)


class PackingFormat:
    """Base class: subclasses set `name` and implement `check`, `layout`, `pack`, `codes`, `qparams`.

    `portable`: the format a checkpoint should use instead of this device-specific one (None: this one).
    `any_rank`: whether it holds tensors of any rank itself; a 2-D-only format holds 3-D expert weights one expert
    at a time (`affineq.tensor.format_experts`)."""

    name: str = ""
    portable: str | None = None
    any_rank: bool = False

    def check(self, spec: QuantSpec) -> str | None:
        """Why this format cannot hold `spec` (a sentence), or None if it can."""
        return None

    def layout(self, spec: QuantSpec) -> dict[str, TensorLayout]:
        """The stored tensors of `spec` by name, in storage order."""
        raise NotImplementedError

    def validate(self, t: Tensors, spec: QuantSpec) -> None:
        """Raise ValueError unless `t` has exactly the names, shapes and dtypes `layout(spec)` declares. Strides are
        not checked: the loaders (`AffineQuantizedTensor.from_tensors`, unpickling) copy a strided tensor to the
        contiguous layout the kernels read."""
        why = self.check(spec)
        if why is not None:
            raise ValueError(f"packing_format={self.name!r} cannot hold this spec: {why}")
        want = self.layout(spec)
        required = {name for name, lay in want.items() if not lay.optional}
        if not required <= set(t) <= set(want):
            raise ValueError(f"format {self.name!r} stores tensors {list(want)}, got {sorted(t)}: pass the "
                             "tensors as AffineQuantizedTensor.tensors returned them")
        for name, lay in want.items():
            if name not in t:
                continue
            x = t[name]
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"format {self.name!r}: tensors[{name!r}] must be a torch.Tensor, got "
                                 f"{type(x).__name__}")
            if x.dtype not in lay.dtypes:
                raise ValueError(f"format {self.name!r}: tensors[{name!r}] has dtype {x.dtype}; it must be one of "
                                 f"{[str(d) for d in lay.dtypes]} for this spec")
            if lay.shape is not None and tuple(x.shape) != lay.shape:
                raise ValueError(f"format {self.name!r}: tensors[{name!r}] has shape {tuple(x.shape)}; it must be "
                                 f"{lay.shape} for logical shape {spec.shape} and block_size {spec.block_size}")

    def pack(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
             spec: QuantSpec) -> Tensors:
        raise NotImplementedError

    def codes(self, t: Tensors, spec: QuantSpec) -> torch.Tensor:
        """Codes in the target's container dtype, shape `spec.shape`."""
        raise NotImplementedError

    def qparams(self, t: Tensors, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero_point) in the reduced shape `spec.num_blocks`."""
        raise NotImplementedError

    def represent_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor | None,
                          spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero_point) exactly as `pack` will store them. Constructors quantize with these, so the
        codes are the best ones for the stored (possibly rounded) qparams. Default: stored as given."""
        return scale, zero_point

    def dequantize(self, t: Tensors, spec: QuantSpec, output_dtype: torch.dtype) -> torch.Tensor:
        scale, zp = self.qparams(t, spec)
        return dequantize_affine(
            self.codes(t, spec), spec.block_size, scale, zp, spec.target, spec.quant_min,
            spec.quant_max, spec.zero_point_domain, output_dtype=output_dtype,
        )

    def dequantize_rows(self, t: Tensors, spec: QuantSpec, rows: torch.Tensor,
                        output_dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` (int64 [R]) of a 2-D tensor with one qparam row per row (block (1, g)): [R, K]."""
        scale, zp = self.qparams(t, spec)
        return dequantize_affine(
            self.codes(t, spec)[rows], spec.block_size, scale[rows], None if zp is None else zp[rows],
            spec.target, spec.quant_min, spec.quant_max, spec.zero_point_domain,
            output_dtype=output_dtype,
        )


FORMATS: dict[str, PackingFormat] = {}


def register_format(fmt: PackingFormat) -> PackingFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> PackingFormat:
    if not isinstance(name, str) or name not in FORMATS:
        close = difflib.get_close_matches(name, list(FORMATS), n=1) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown packing_format {name!r}{hint}; use one of {sorted(FORMATS)}")
    return FORMATS[name]


# -- helpers shared by the affine-map formats --------------------------------------------------------


def _mid(spec: QuantSpec) -> float:
    return (spec.quant_max + spec.quant_min + 1) / 2


def _unsigned_codes(codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """codes - quant_min as uint8 (codes of at most 8 bits). One-byte containers subtract in uint8 arithmetic:
    the result is exact modulo 256 and lies in [0, 255], so it needs no int32 copy (4 bytes per weight, the
    peak of packing a large weight)."""
    if codes.dtype in (torch.int8, torch.uint8):
        return codes.view(torch.uint8) - (spec.quant_min % 256)
    return (codes.to(torch.int32) - spec.quant_min).to(torch.uint8)


def _offset(scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """fp32 offset such that w = scale * (q - quant_min) + offset reproduces the domain's dequantization."""
    s = scale.float()
    qmin = spec.quant_min
    if spec.zero_point_domain is ZeroPointDomain.INT:
        return s * (qmin - zp.float())
    if spec.zero_point_domain is ZeroPointDomain.FLOAT:
        return zp.float() + s * (qmin - _mid(spec))
    return s * qmin


def _zero_point(scale: torch.Tensor, offset: torch.Tensor, spec: QuantSpec) -> torch.Tensor | None:
    """Inverse of `_offset`: the canonical zero point (int32 for INT, fp32 for FLOAT, None for NONE)."""
    if spec.zero_point_domain is ZeroPointDomain.INT:
        return torch.round(spec.quant_min - offset / scale).to(torch.int32)
    if spec.zero_point_domain is ZeroPointDomain.FLOAT:
        return offset - scale * (spec.quant_min - _mid(spec))
    return None


def _check_rowwise_groups(spec: QuantSpec, name: str, allow_float8: bool = False,
                          allow_e8m0: bool = False) -> str | None:
    if len(spec.shape) != 2:
        return f"{name} packs 2-D weights only (got shape {spec.shape})"
    if spec.block_size[0] != 1:
        return f"{name} needs one scale per output row and group: block_size (1, g), got {spec.block_size}"
    if spec.target.is_float and not allow_float8:
        return f"{name} holds integer codes, not {spec.target}"
    if spec.scale_type is not None and not allow_e8m0:
        return f"{name} stores float scales; scale_type={spec.scale_type} needs packing_format='plain'"
    return None


# -- power-of-two (e8m0) scales: exponent bytes in `plain` ------------------------------------------------

_E8M0_BIAS = 127


def _round_scale_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= scale (so no value clips), within e8m0's 2**-127..2**127, in fp32."""
    # frexp, not ceil(log2): fp32 log2 rounds 2**e * (1 + 2**-23) down to e, which would clip that scale
    m, e = torch.frexp(scale.float())  # scale = m * 2**e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e).float()
    return torch.exp2(torch.where(scale > 0, e, -_E8M0_BIAS).clamp(-_E8M0_BIAS, _E8M0_BIAS))


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    return (torch.log2(scale.float()).round() + _E8M0_BIAS).to(torch.uint8)


def _e8m0_values(b: torch.Tensor) -> torch.Tensor:
    return _cpp.e8m0_values(b)  # 2**(b - 127), 0xFF = NaN (OCP MX), as the C++ kernels decode them


# -- formats ------------------------------------------------------------------------------------------


class Plain(PackingFormat):
    """One code per element in its container dtype; qparams as the primitives return them (reduced shape).

    With `scale_type` e8m0 the scales are rounded up to powers of two and stored as exponent bytes (uint8,
    value 2**(b - 127))."""

    name = "plain"
    any_rank = True

    def layout(self, spec):
        blocks = spec.num_blocks
        out = {"qdata": TensorLayout(spec.shape, (spec.target.container,)),
               "scale": TensorLayout(blocks, (torch.uint8,) if spec.scale_type is not None else _FLOATS)}
        if spec.zero_point_domain is ZeroPointDomain.INT:
            out["zero_point"] = TensorLayout(blocks, _INTS + _FLOATS)
        elif spec.zero_point_domain is ZeroPointDomain.FLOAT:
            out["zero_point"] = TensorLayout(blocks, _FLOATS)
        return out

    def represent_qparams(self, scale, zero_point, spec):
        if spec.scale_type is not None:
            return _round_scale_to_pow2(scale), zero_point
        return scale, zero_point

    def pack(self, codes, scale, zero_point, spec):
        if spec.scale_type is not None:
            scale = _e8m0_bytes(scale)
        t = {"qdata": codes.to(spec.target.container), "scale": scale}
        if zero_point is not None:
            t["zero_point"] = zero_point
        return t

    def codes(self, t, spec):
        return t["qdata"]

    def qparams(self, t, spec):
        scale = _e8m0_values(t["scale"]) if spec.scale_type is not None else t["scale"]
        return scale, t.get("zero_point")

    def dequantize(self, t, spec, output_dtype):
        if t["scale"].dtype != torch.float64 or spec.target.is_float or spec.zero_point_domain is ZeroPointDomain.FLOAT:
            return super().dequantize(t, spec, output_dtype)
        # float64 scales (torch's per-channel qparams, `torch_quantized`): as torch computes it, q - zp in float32
        # then times scale in float64, so both dequantize bit for bit alike (exact for 8-bit codes)
        scale, zp = t["scale"], t.get("zero_point")
        for d, b in enumerate(spec.block_size):
            scale = scale.repeat_interleave(b, dim=d)
            zp = None if zp is None else zp.repeat_interleave(b, dim=d)
        q = t["qdata"].float()
        return ((q if zp is None else q - zp.float()).double() * scale).to(output_dtype)


def dense_code_offset(spec: QuantSpec, has_offset: bool = False) -> int:
    """The `code_offset` of the lowbit ops for a `dense` weight: 0 with an offset tensor; without one (e8m0 or
    16-bit scales of symmetric codes, float codes) w = scale * (c(u) + code_offset), u = q - quant_min for integer
    codes (so quant_min), u = the bit pattern for float codes (0)."""
    return 0 if has_offset or spec.target.is_float else int(spec.quant_min)


def dense_is_canonical(scale: torch.Tensor, spec: QuantSpec, has_offset: bool = True) -> bool:
    """Whether a `dense` weight with this stored scale dequantizes as (u + round(offset / scale)) * scale
    (fp32 qparams of integer codes with an INT or NONE zero point; 16-bit scales of symmetric codes without an
    offset tensor, offset = scale * quant_min), the primitives' (q - zp) * scale, rather than scale * c(u) + offset
    rounded once (see `Dense.dequantize`). A zero scale's zero point is taken as 0 in C++ (the weights are 0 either
    way), so no per-call check is needed on the kernel path."""
    if spec.target.is_float:
        return False
    if not has_offset:
        return scale.dtype in (torch.bfloat16, torch.float16)
    return scale.dtype == torch.float32 and spec.zero_point_domain is not ZeroPointDomain.FLOAT


def dense_affine_map(t: Tensors, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scale, offset) [N, K/g] of a `dense` weight's w = scale * c(u) + offset, whichever convention its
    qparams are stored in (fp32 / fp16 as given, bf16 tinygemm, no offset tensor, e8m0)."""
    return Dense._fp32_scale_offset(t, spec)


def _has_zero_scale(scale: torch.Tensor) -> bool:
    """A zero scale (an all-zero GGUF block): `Dense.dequantize` takes the PyTorch route for such a canonical tensor,
    which keeps ggml's signed zeros bit for bit. Eager only (a host sync)."""
    return (not torch.compiler.is_compiling() and scale.device.type != "meta" and scale.numel() > 0
            and bool((scale == 0).any()))


class Dense(PackingFormat):
    """1-8 bit codes (or float8 / fp6 / fp4 bit patterns) bit-packed by `affineq.bitpack.pack_codes`
    (ceil(N*K*bits/8) bytes), with scale and offset [N, K/g]. This is the layout the `affineq::lowbit_linear` CPU
    kernel reads directly.

    With `scale_type` e8m0 (zero point 0: the NONE domain or symmetric INT codes) the scale is one uint8
    exponent byte per group (value 2**(b - 127), rounded up to a power of two by `represent_qparams` unless it
    is one) and there is no offset: the kernel computes w = scale * (c(u) + quant_min) for integer codes
    u = q - quant_min, scale * c(u) for float codes, both exact.

    Qparams are fp32 (w = scale * u + offset), except:
    - a bf16 scale with a float zero point over the full code range (the tinygemm scheme of
      Int4WeightOnlyConfig): scale and zero point are stored as they are, in bf16, and the kernel reads
      w = scale * (u - 2**(bits-1)) + zero_point, which halves their cost (0.0625 B/param at group 64, not 0.125);
    - a bf16 or fp16 scale of symmetric codes (no zero point, quant_min = -2**(bits-1)): the scale alone, and
      w = scale * (u + quant_min) = scale * q, exact (4.5 bits per weight for int4 g32, GGUF's Q4_0);
    - fp16 scale and offset given as such (GGUF's Q4_1 / Q5_1: w = d * u + m): stored as given, one rounding.
    """

    name = "dense"

    def check(self, spec):
        if spec.scale_type is not None:
            symmetric = spec.mapping_type in (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)
            if not (spec.zero_point_domain is ZeroPointDomain.NONE
                    or (spec.zero_point_domain is ZeroPointDomain.INT and symmetric)):
                return ("dense stores e8m0 scales without a zero point: use mapping_type=SYMMETRIC or "
                        "zero_point_domain=NONE, or packing_format='plain'")
        if spec.target.is_float:
            if spec.target.torch_dtype is None and _cpp.codes_kind(spec.target) == _cpp.CODES_UINT:
                return f"dense has no decoder for {spec.target} codes yet; use packing_format='plain'"
            return _check_rowwise_groups(spec, "dense", allow_float8=True, allow_e8m0=True)
        why = _check_rowwise_groups(spec, "dense", allow_e8m0=True)
        if why is None and spec.target.bits > 8:
            why = f"dense packs 1-8 bit codes, not {spec.target}"
        return why

    def layout(self, spec):
        n, k = spec.shape
        bits = spec.target.bits
        qdata = TensorLayout((n, -(-k // 8) * bits), (torch.uint8,))
        if spec.scale_type is not None:  # e8m0 exponent bytes, no offset
            return {"qdata": qdata, "scale": TensorLayout((n, k // spec.block_size[1]), (torch.uint8,))}
        if self._scale_only(spec):
            return {"qdata": qdata, "scale": TensorLayout((n, k // spec.block_size[1]), (torch.float32,))}
        qp = TensorLayout((n, k // spec.block_size[1]), (torch.float32, torch.bfloat16, torch.float16))
        return {"qdata": qdata, "scale": qp,
                "offset": TensorLayout(qp.shape, qp.dtypes, optional=self._symmetric_full_range(spec))}

    @staticmethod
    def _symmetric_full_range(spec: QuantSpec) -> bool:
        """Integer codes without a zero point from -2**(bits-1): a 16-bit scale needs no offset tensor."""
        return (not spec.target.is_float and spec.zero_point_domain is ZeroPointDomain.NONE
                and spec.quant_min == -(2 ** (spec.target.bits - 1)))

    def validate(self, t, spec):
        super().validate(t, spec)
        if "offset" in t and t["scale"].dtype != t["offset"].dtype:
            raise ValueError(f"format 'dense': scale ({t['scale'].dtype}) and offset ({t['offset'].dtype}) must "
                             "share one dtype (fp32, fp16, or bf16 in the tinygemm convention)")
        if ("offset" not in t and t["scale"].dtype == torch.float32 and not spec.target.is_float
                and spec.scale_type is None):
            raise ValueError("format 'dense': float32 scales of integer codes need an offset tensor (only bf16 / "
                             "fp16 scales of symmetric codes are stored without one)")

    @staticmethod
    def _bf16(scale: torch.Tensor, spec: QuantSpec) -> bool:
        """True when the qparams are stored in bf16 (the tinygemm convention w = scale * (u - 2**(bits-1)) +
        zero, see the class docstring): a FLOAT-domain zero point over the full code range, or no zero point
        with codes starting at -2**(bits-1) (symmetric signed codes: w = scale * q, zero = 0). Both are
        exact in bf16; an integer zero point is not (scale * (mid - zp) needs more mantissa), so INT-domain
        qparams stay fp32."""
        if scale.dtype != torch.bfloat16 or spec.target.is_float:
            return False
        half = 2 ** (spec.target.bits - 1)
        if spec.zero_point_domain is ZeroPointDomain.FLOAT:
            return _mid(spec) - spec.quant_min == half
        return spec.zero_point_domain is ZeroPointDomain.NONE and spec.quant_min == -half

    def represent_qparams(self, scale, zero_point, spec):
        if spec.scale_type is not None:  # the same rule as `plain`: a power of two >= scale (exact if one)
            return _round_scale_to_pow2(scale), zero_point
        if self._bf16(scale, spec) and zero_point is not None:
            return scale, zero_point.to(torch.bfloat16)
        return scale, zero_point

    def pack(self, codes, scale, zero_point, spec):
        n, k = spec.shape
        if spec.scale_type is not None:
            if (zero_point is not None and not torch.compiler.is_compiling()
                    and bool((zero_point != 0).any())):
                raise ValueError("packing_format='dense' with e8m0 scales stores no zero point, got nonzero "
                                 "zero points: use mapping_type=SYMMETRIC, or packing_format='plain'")
            u = codes.view(torch.uint8) if spec.target.is_float else _unsigned_codes(codes, spec)
            t = {"qdata": pack_codes(u, spec.target.bits),
                 "scale": _e8m0_bytes(scale).reshape(n, -1).contiguous()}
            self._check_representable(t, spec)
            return t
        if self._half_symmetric(scale, zero_point, spec):  # the scale alone: w = scale * (u + quant_min)
            t = {"qdata": pack_codes(_unsigned_codes(codes, spec), spec.target.bits),
                 "scale": scale.reshape(n, -1).contiguous()}
            self._check_representable(t, spec)
            return t
        if spec.target.is_float:
            u, offset = codes.view(torch.uint8), torch.zeros_like(scale, dtype=torch.float32)
        else:
            u = _unsigned_codes(codes, spec)
            if self._bf16(scale, spec):
                offset = torch.zeros_like(scale) if zero_point is None else zero_point
            else:
                offset = _offset(scale, zero_point, spec)
        qdtype = torch.bfloat16 if self._bf16(scale, spec) else torch.float32
        t = {
            "qdata": pack_codes(u, spec.target.bits),
            "scale": scale.to(qdtype).reshape(n, -1).contiguous(),
            "offset": offset.to(qdtype).reshape(n, -1).contiguous(),
        }
        if self._scale_only(spec):
            del t["offset"]
        self._check_representable(t, spec)
        return t

    def _half_symmetric(self, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: QuantSpec) -> bool:
        """A bf16 / fp16 scale of symmetric full-range codes: stored alone (see the class docstring)."""
        return (scale.dtype in (torch.bfloat16, torch.float16) and self._symmetric_full_range(spec)
                and (zero_point is None or torch.compiler.is_compiling() or scale.device.type == "meta"
                     or not bool((zero_point != 0).any())))

    @staticmethod
    def _scale_only(spec: QuantSpec) -> bool:
        """fp4 / fp6 codes with fp32 scales store no offset (it is 0; the kernel takes offset=None): 4 + 32 / g
        bits per element. (float8 keeps its stored zeros: the layout of existing checkpoints.)"""
        return spec.scale_type is None and spec.target.is_float and spec.target.torch_dtype is None

    def _check_representable(self, t: Tensors, spec: QuantSpec) -> None:
        """ValueError unless w = scale * u + offset stays finite in fp32 for every code u (the C++ kernel and
        the PyTorch dequantize compute scale * u first): weights near the fp32 limit (|w| ~ 1e38) could
        otherwise dequantize to inf although their qparams are finite."""
        if torch.compiler.is_compiling() or t["scale"].device.type == "meta":
            return
        s, offset = self._fp32_scale_offset(t, spec)
        umax = float(spec.target.qmax) if spec.target.is_float else float(spec.quant_max - spec.quant_min)
        top = s * umax
        edges = torch.stack([s, offset, top, top + offset])
        if not bool(torch.isfinite(edges).all()):
            raise ValueError(
                f"packing_format='dense' cannot hold these weights: w = scale * u + offset (u up to {umax:g}) "
                f"overflows float32 for scales up to {float(s.abs().max()):.3g} (weights near the float32 limit); "
                "use packing_format='plain', or scale the weights down before quantizing"
            )

    @staticmethod
    def _fp32_scale_offset(t: Tensors, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, offset) of w = scale * c(u) + offset in fp32, whichever convention is stored."""
        if t["scale"].dtype == torch.uint8:
            s = _e8m0_values(t["scale"])
            return s, s * dense_code_offset(spec)
        s = t["scale"].float()
        if "offset" not in t:
            return s, s * dense_code_offset(spec)
        if t["scale"].dtype == torch.bfloat16:
            return s, t["offset"].float() - 2 ** (spec.target.bits - 1) * s
        return s, t["offset"].float()

    def codes(self, t, spec):
        n, k = spec.shape
        u = unpack_codes(t["qdata"], spec.target.bits, n, k)
        if spec.target.is_float:
            return u.view(spec.target.container)
        return (u.to(torch.int32) + spec.quant_min).to(spec.target.container)

    def qparams(self, t, spec):
        if t["scale"].dtype == torch.uint8:  # e8m0: zero point 0 (None in the NONE domain)
            s = _e8m0_values(t["scale"])
            zp = torch.zeros_like(s, dtype=torch.int32) if spec.zero_point_domain is ZeroPointDomain.INT else None
            return s, zp
        if spec.target.is_float:
            return t["scale"], None
        if "offset" not in t:  # 16-bit scale of symmetric codes: no zero point
            return t["scale"], None
        if t["scale"].dtype == torch.bfloat16:  # stored as given: the FLOAT-domain zero point, or 0 for NONE
            return t["scale"], None if spec.zero_point_domain is ZeroPointDomain.NONE else t["offset"]
        if t["scale"].dtype == torch.float16:  # GGUF's d and m: the zero point of w = d * u + m, in fp32
            return t["scale"], _zero_point(t["scale"].float(), t["offset"].float(), spec)
        return t["scale"], _zero_point(t["scale"], t["offset"], spec)

    def dequantize(self, t, spec, output_dtype):
        n, k = spec.shape
        code_offset = dense_code_offset(spec, "offset" in t)
        canonical = self._canonical(t, spec)
        if t["qdata"].device.type == "cpu" and _cpp.is_available() and not (
                canonical and _has_zero_scale(t["scale"])):  # (a zero scale: the PyTorch route keeps ggml's signs)
            # C++ (cpp/dequant_gemm.cpp): the values of the PyTorch route below, bit for bit, at memory speed
            w = torch.ops.affineq.dense_dequantize(
                t["qdata"], t["scale"], t.get("offset"), spec.target.bits, spec.block_size[1], n, k,
                _cpp.codes_kind(spec.target), code_offset, canonical, output_dtype == torch.bfloat16,
            )
            return w.to(output_dtype)
        if "offset" not in t:  # e8m0 / 16-bit scales: scale * (c(u) + code_offset), exact as the C++ op computes it
            w = torch.ops.affineq.lowbit_dequantize(
                t["qdata"], t["scale"], None, spec.target.bits, spec.block_size[1], n, k,
                _cpp.codes_kind(spec.target), code_offset,
            )
            return w.to(output_dtype)
        scale, offset = (torch.ones_like(t["scale"]), torch.zeros_like(t["offset"])) if canonical else (
            t["scale"], t.get("offset"))
        w = torch.ops.affineq.lowbit_dequantize(  # C++ when built, the same math in PyTorch otherwise
            t["qdata"], scale, offset, spec.target.bits, spec.block_size[1], n, k, _cpp.codes_kind(spec.target),
        )
        if canonical:  # w holds the codes u as floats
            w = self._centered_times_scale(w.view(n, -1, spec.block_size[1]), t["scale"], t["offset"],
                                           spec).view(n, k)
        return w.to(output_dtype)

    @staticmethod
    def _canonical(t: Tensors, spec: QuantSpec) -> bool:
        """fp32 qparams of integer codes with an INT or NONE zero point: `scale * u + offset` would round
        differently from the primitives' `(q - zp) * scale` (by an ulp), so dequantize computes the latter,
        exactly: offset = scale * (qmin - zp) gives q - zp = u + round(offset / scale). bf16 qparams
        (`scale * (u - 2**(bits-1)) + zero`) and float8 codes (`scale * c`) already round as the primitives."""
        return dense_is_canonical(t["scale"], spec, "offset" in t)

    @staticmethod
    def _centered_times_scale(u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                              spec: QuantSpec) -> torch.Tensor:
        """(u + round(offset / scale)) * scale per group: u [R, G, g] float codes, scale/offset [R, G]. A zero
        scale (a GGUF block of zeros) takes quant_min as its step, not 0 / 0, so its zeros keep ggml's signs."""
        step = torch.where(scale == 0, float(spec.quant_min), torch.round(offset / scale))
        return (u + step.unsqueeze(-1)) * scale.unsqueeze(-1)

    def dequantize_rows(self, t, spec, rows, output_dtype):
        n, k = spec.shape
        u = unpack_code_rows(t["qdata"], spec.target.bits, n, k, rows)
        g = spec.block_size[1]
        u = _cpp.code_values(u, _cpp.codes_kind(spec.target)).view(-1, k // g, g)
        if self._canonical(t, spec) and "offset" not in t:  # 16-bit scale of symmetric codes: scale * q, exact
            w = (u + spec.quant_min) * t["scale"][rows].float().unsqueeze(-1)
        elif self._canonical(t, spec):
            w = self._centered_times_scale(u, t["scale"][rows], t["offset"][rows], spec)
        else:
            scale, offset = self._fp32_scale_offset(t, spec)
            w = u * scale[rows].float().unsqueeze(-1) + offset[rows].unsqueeze(-1)
        return w.view(-1, k).to(output_dtype)


class Int4Tinygemm(PackingFormat):
    """The int4 layout of aten's tinygemm kernels: w = (u - 8) * scale + zero, u in [0, 16)."""

    portable = "plain"

    def __init__(self, name: str, device_type: str, convert):
        self.name = name
        self.device_type = device_type
        self._convert = convert

    def check(self, spec):
        why = _check_rowwise_groups(spec, self.name)
        if why:
            return why
        if spec.quant_max - spec.quant_min != 15:
            return f"{self.name} holds 4-bit codes (16 levels), got range [{spec.quant_min}, {spec.quant_max}]"
        n, k = spec.shape
        g = spec.block_size[1]
        if k % 2:
            return f"{self.name} needs an even in_features K to pack two 4-bit codes per byte (got K={k})"
        if g not in (32, 64, 128, 256):
            return f"{self.name} needs group_size 32, 64, 128 or 256 (got {g})"
        if n % 16:
            return f"{self.name} needs out_features N divisible by 16 (got N={n})"
        return None

    def layout(self, spec):
        n, k = spec.shape
        if self.device_type == "cpu":
            qdata = TensorLayout((n, k // 2), (torch.uint8,))
        else:  # aten's CUDA tile layout: [N/8, K/(16 t), 32, t/2] int32 for a K-dependent t
            qdata = TensorLayout(None, (torch.int32,))
        sz = TensorLayout((k // spec.block_size[1], n, 2), (torch.bfloat16, torch.float16, torch.float32))
        return {"qdata": qdata, "scale_and_zero": sz}

    def pack(self, codes, scale, zero_point, spec):
        n, k = spec.shape
        u = (codes.to(torch.int32) - spec.quant_min)
        s = scale.reshape(n, -1)
        zero = _offset(scale, zero_point, spec).reshape(n, -1) + 8 * s.float()
        sz = torch.stack([s.float(), zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        return {"qdata": self._convert(u), "scale_and_zero": sz.to(scale.dtype)}

    def _scale_offset(self, t):
        sz = t["scale_and_zero"].float().transpose(0, 1)  # [N, K/g, 2]
        s = sz[..., 0].contiguous()
        return s, sz[..., 1] - 8 * s

    def codes(self, t, spec):
        n, k = spec.shape
        packed = t["qdata"]
        nibbles = _nibbles(packed).to(torch.int32)
        u = torch.empty(n * k, dtype=torch.int32, device=packed.device)
        u[self._nibble_source(n, k, packed.device)] = nibbles
        return (u.view(n, k) + spec.quant_min).to(spec.target.container)

    def _nibble_source(self, n: int, k: int, device) -> torch.Tensor:
        """For each packed nibble (low then high, byte order), the flat index n*K+k of the code it holds.

        aten documents no inverse of its packing, so the permutation is read back by packing the base-16
        digits of every element's flat index: pack(digit_j(i)) puts digit j of i where element i lands.
        """
        idx = torch.arange(n * k, dtype=torch.int64, device=device)
        source = torch.zeros(n * k, dtype=torch.int64, device=device)
        digit = 0
        while 16**digit < n * k or digit == 0:
            d = ((idx >> (4 * digit)) & 15).to(torch.int32).view(n, k)
            p = self._convert(d)
            source += _nibbles(p).to(torch.int64) << (4 * digit)
            digit += 1
        return source

    def qparams(self, t, spec):
        # In the stored dtype (bf16 by default), so a slice re-packed from them (a tensor-parallel shard) keeps
        # 16-bit qparams; exact: zero - 8 s + 8 s of bf16 values is exact in fp32.
        s, offset = self._scale_offset(t)
        zp = _zero_point(s, offset, spec)
        dtype = t["scale_and_zero"].dtype
        return s.to(dtype), (zp if zp is None or not zp.is_floating_point() else zp.to(dtype))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit fields of a packed int4 tensor, flat, lowest bits of each element first: 2 per uint8 (aten's CPU
    layout), 8 per int32 (aten's CUDA tile layout)."""
    per = packed.element_size() * 2
    shifts = torch.arange(0, 4 * per, 4, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 15).flatten()


def _convert_cpu(u: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)


def _convert_cuda(u: torch.Tensor) -> torch.Tensor:
    u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
    k = u.shape[1]
    inner_k_tiles = next((t for t in (8, 4, 2) if k % (t * 16) == 0), 2)
    return torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), inner_k_tiles)


register_format(Plain())
register_format(Dense())
register_format(Int4Tinygemm("int4_cpu", "cpu", _convert_cpu))
register_format(Int4Tinygemm("int4_cuda", "cuda", _convert_cuda))
