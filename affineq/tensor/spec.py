"""Hashable metadata of a quantized tensor: what the codes mean (`QuantSpec`), how activations are quantized
(`ActivationQuant`) and the choices made when qparams are computed (`QParamOptions`).

All are frozen dataclasses of plain values (QTypes, dtypes, ints, tuples, enums, strings): no callables, so
`torch.compile` guards on them cheaply and `torch.load(weights_only=True)` can rebuild them. `QuantSpec`
also has a portable, versioned JSON form (`to_dict` / `from_dict`) for checkpoints outside torch.save.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from affineq.dtypes import QType, check_quant_range, qtype
from affineq.granularity import Granularity, PerGroup, PerTensor, PerToken
from affineq.mx import SCALE_MODES as _SCALE_MODES
from affineq.mx import mx_element
from affineq.primitives import MappingType, ZeroPointDomain, check_eps

__all__ = ["ActivationQuant", "QParamOptions", "QuantSpec", "SPEC_VERSION", "as_key", "from_key"]

#: Version of the `QuantSpec.to_dict` encoding; `from_dict` refuses newer ones.
SPEC_VERSION = 1

#: The stored names of the activation granularities (to_dict, pickles); "per_block" is PerGroup(block_size).
_GRANULARITY_NAMES = {PerToken: "per_token", PerTensor: "per_tensor", PerGroup: "per_block"}
#: The logical dtypes a stored spec may name: looked up here, never by getattr on torch.
_FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                 if isinstance(d, torch.dtype) and d.is_floating_point}

_KEYS = {"version", "shape", "dtype", "target", "block_size", "quant_min", "quant_max", "zero_point_domain",
         "mapping_type", "format", "transposed", "act_quant", "scale_type"}
#: Keys newer than version 1's first writers, written only when set (so older files and readers still agree).
_OPTIONAL_KEYS = {"compute_dtype": None}
#: The keys `ActivationQuant.to_dict` writes ("block_size" / "scale_mode" for MX only).
_ACT_KEYS = {"dtype", "mapping_type", "granularity", "zero_point_domain", "eps", "static", "block_size", "scale_mode"}
#: The dtypes a linear may compute in instead of its input's (`QuantSpec.compute_dtype`).
COMPUTE_DTYPES = (torch.bfloat16,)


def _compute_dtype_of(name) -> torch.dtype | None:
    """A stored compute_dtype name ("bfloat16") as its dtype; ValueError for anything else."""
    if name is None:
        return None
    dtype = _FLOAT_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"compute_dtype {name!r} is not a floating-point dtype name such as 'bfloat16'")
    return dtype


def check_compute_dtype(value, name: str = "compute_dtype") -> None:
    """ValueError unless `value` is None or one of COMPUTE_DTYPES."""
    if value is not None and value not in COMPUTE_DTYPES:
        raise ValueError(f"{name}={value!r}: use None (compute in the input's dtype) or torch.bfloat16 (float32 "
                         "inputs rounded to bf16 for the bf16 kernels)")


def _enum_member(name: str, value, cls: type[enum.Enum]):
    """`cls[value]` for a stored enum name, else ValueError naming the field and the members."""
    if not isinstance(value, str) or value not in cls.__members__:
        raise ValueError(f"{name}={value!r} is an unknown enum member of {cls.__name__}; use one of "
                         f"{list(cls.__members__)}")
    return cls[value]


def _scale_qtype(scale_type) -> QType | None:
    """The scale QType of QuantSpec.create's `scale_type`: None (float scales) or e8m0."""
    if scale_type is None:
        return None
    try:
        st = qtype(scale_type)
    except ValueError:
        st = None
    if st is None or st.name != "e8m0":
        raise ValueError(f"scale_type={scale_type!r}: use None (float scales) or 'e8m0' (powers of two)")
    return st


def _check_enum(name: str, value, cls: type[enum.Enum]) -> None:
    if not isinstance(value, cls):
        raise ValueError(f"{name}={value!r}: use one of {[f'{cls.__name__}.{m.name}' for m in cls]}")


def _set_checked_state(obj, state) -> None:
    """Unpickling (torch.load, weights_only too) of a frozen spec dataclass: exactly its fields, then its own
    checks (`__post_init__`), so a tampered checkpoint fails at load, naming the field, not at first use."""
    if isinstance(state, tuple) and len(state) == 2 and not state[1]:
        state = state[0]  # (dict, slots) as pickle may write it
    names = [f.name for f in dataclasses.fields(obj)]
    cls = type(obj).__name__
    if isinstance(state, dict):  # pickles from before an optional field existed
        state = {**{k: v for k, v in _OPTIONAL_KEYS.items() if k in names}, **state}
    if not isinstance(state, dict) or set(state) != set(names):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"cannot unpickle {cls}: expected the fields {names}, got {got}; the checkpoint was not "
                         f"written by affineq's {cls} (or was edited)")
    for name in names:
        object.__setattr__(obj, name, state[name])
    obj.__post_init__()


@dataclass(frozen=True)
class ActivationQuant:
    """How `linear` quantizes its input before the matmul.

    dtype: the activation target (torch.int8, torch.float8_e4m3fn, a QType or its name; stored as a QType).
    granularity: PerToken() (one scale per row of the flattened [M, K] input) or PerTensor().
    static: False = qparams computed from each input (dynamic); True = the weight carries calibrated
    `act_scale` / `act_zero_point` tensors (per tensor) and every input uses them.
    For float targets `mapping_type` must be SYMMETRIC and `zero_point_domain` NONE.
    granularity PerGroup(block_size) is OCP MX (`affineq.mx`): blocks of `block_size` along K, each with a shared
    E8M0 scale chosen by `scale_mode` ("floor", "ceil", "even", "rceil"); x -> dequantize_mx(quantize_mx(x)).
    It needs an MX element dtype (float8, fp6, fp4, int8 = MXINT8), SYMMETRIC, and is dynamic only.
    The names "per_token", "per_tensor" and "per_block" (with `block_size`), which `to_dict` and pickles
    store, are accepted and converted, so specs saved before granularities were objects load unchanged.
    """

    dtype: Any = torch.int8
    mapping_type: MappingType = MappingType.SYMMETRIC
    granularity: Granularity = PerToken()
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT
    eps: float | None = None
    static: bool = False
    block_size: int | None = None
    scale_mode: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "granularity", self._granularity())
        mx = self.is_mx  # MX element types also go by their aliases ("mxfp4", "mxint8")
        object.__setattr__(self, "dtype", mx_element(self.dtype, "ActivationQuant.dtype") if mx else qtype(self.dtype))
        _check_enum("ActivationQuant.mapping_type", self.mapping_type, MappingType)
        _check_enum("ActivationQuant.zero_point_domain", self.zero_point_domain, ZeroPointDomain)
        if self.eps is not None:  # the activation scales are float32: choose_qparams_affine's rule for them
            object.__setattr__(self, "eps", check_eps("ActivationQuant", self.eps, torch.float32))
        if not isinstance(self.static, bool):
            raise ValueError(f"ActivationQuant.static={self.static!r}: must be a bool (True: calibrated per-tensor "
                             "act_scale / act_zero_point, False: dynamic)")
        if self.static and not isinstance(self.granularity, PerTensor):
            raise ValueError("ActivationQuant(static=True) needs granularity=PerTensor() ('per_tensor': one calibrated "
                             "scale)")
        if mx:
            self._check_mx()
        elif self.block_size is not None or self.scale_mode is not None:
            raise ValueError("ActivationQuant.block_size / scale_mode apply to MX granularity (PerGroup(32), stored "
                             "as 'per_block') only; leave them None or set granularity=PerGroup(block_size)")

    def _granularity(self) -> Granularity:
        """`granularity` as an object: a stored name converted (with `block_size` for "per_block")."""
        g = self.granularity
        if isinstance(g, str) and g in _GRANULARITY_NAMES.values():
            if g != "per_block":
                return PerToken() if g == "per_token" else PerTensor()
            b = self.block_size
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"ActivationQuant.block_size={b!r}: granularity='per_block' needs a positive int "
                                 "(32 for OCP MX)")
            return PerGroup(b)
        if type(g) not in _GRANULARITY_NAMES:
            raise ValueError(f"ActivationQuant.granularity={g!r}: use PerToken(), PerTensor() or PerGroup(32) (MX "
                             "blocks along K), from affineq.granularity")
        if isinstance(g, PerGroup):
            if self.block_size is None:
                object.__setattr__(self, "block_size", g.group_size)
            elif self.block_size != g.group_size:
                raise ValueError(f"ActivationQuant: granularity={g!r} and block_size={self.block_size!r} differ; "
                                 "leave block_size None (PerGroup says it)")
        return g

    @property
    def is_mx(self) -> bool:
        """OCP MX blocks along K (granularity PerGroup)."""
        return isinstance(self.granularity, PerGroup)

    @property
    def per_token(self) -> bool:
        """One scale per row of the flattened [M, K] input (granularity PerToken)."""
        return isinstance(self.granularity, PerToken)

    @property
    def granularity_name(self) -> str:
        """The stored name of the granularity: "per_token", "per_tensor" or "per_block"."""
        return _GRANULARITY_NAMES[type(self.granularity)]

    def __getstate__(self) -> dict:
        # the granularity pickles by its name, so pickles keep the format they had before it was an object
        state = dict(self.__dict__)
        if type(state.get("granularity")) in _GRANULARITY_NAMES:
            state["granularity"] = _GRANULARITY_NAMES[type(state["granularity"])]
        return state

    def __setstate__(self, state) -> None:
        _set_checked_state(self, state)

    def _check_mx(self) -> None:
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"ActivationQuant.block_size={b!r}: granularity='per_block' needs a positive int "
                             "(32 for OCP MX)")
        if self.scale_mode not in _SCALE_MODES:
            raise ValueError(f"ActivationQuant.scale_mode={self.scale_mode!r}: use one of {list(_SCALE_MODES)}")
        if self.mapping_type is not MappingType.SYMMETRIC:
            raise ValueError("ActivationQuant granularity='per_block' (MX) is symmetric: use MappingType.SYMMETRIC")

    def to_dict(self) -> dict:
        d = {"dtype": self.dtype.name, "mapping_type": self.mapping_type.name, "granularity": self.granularity_name,
             "zero_point_domain": self.zero_point_domain.name, "eps": self.eps, "static": self.static}
        if self.is_mx:  # only MX writes the new keys: older dicts stay as they were
            d.update(block_size=self.block_size, scale_mode=self.scale_mode)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ActivationQuant:
        if not isinstance(d, dict):
            raise ValueError(f"act_quant must be a dict from ActivationQuant.to_dict() or None, got {d!r}")
        missing = [k for k in ("dtype", "mapping_type", "granularity", "zero_point_domain") if k not in d]
        unknown = sorted(set(d) - _ACT_KEYS, key=str)
        if missing:
            raise ValueError(f"act_quant dict is missing keys {missing}; pass the dict ActivationQuant.to_dict() "
                             "wrote")
        if unknown:
            raise ValueError(f"act_quant dict has unknown keys {unknown}; pass the dict ActivationQuant.to_dict() "
                             "wrote")
        try:
            dtype = qtype(d["dtype"])
        except ValueError as e:
            raise ValueError(f"act_quant.dtype: {e}") from None
        return cls(dtype, _enum_member("act_quant.mapping_type", d["mapping_type"], MappingType), d["granularity"],
                   _enum_member("act_quant.zero_point_domain", d["zero_point_domain"], ZeroPointDomain),
                   d.get("eps"), d.get("static", False), d.get("block_size"), d.get("scale_mode"))


@dataclass(frozen=True)
class QParamOptions:
    """Choices made when qparams are computed (not stored: the stored tensors already reflect them).

    See `choose_qparams_affine`: eps (lower bound on scale), scale_dtype, zero_point_dtype, preserve_zero;
    rounding: how `quantize_affine` rounds the codes ("half_even", "half_away_from_zero", "floor").
    scale_mode: how a power-of-two scale is chosen when `QuantSpec.scale_type` is e8m0 (`affineq.mx`:
    "floor" = OCP MX, "ceil", "even", "rceil" = never clips); None = the min/max scale rounded up to a power
    of two by the format (the rceil rule on the primitives' scale). Ignored without a scale_type.
    """

    eps: float | None = None
    scale_dtype: torch.dtype | None = None
    zero_point_dtype: torch.dtype | None = None
    preserve_zero: bool = True
    rounding: str = "half_even"
    scale_mode: str | None = None

    def __post_init__(self) -> None:
        if self.scale_mode is not None and self.scale_mode not in _SCALE_MODES:
            raise ValueError(f"QParamOptions.scale_mode={self.scale_mode!r}: use None or one of {list(_SCALE_MODES)}")


@dataclass(frozen=True)
class QuantSpec:
    """Everything needed to interpret the stored tensors of an `AffineQuantizedTensor`.

    shape/dtype: the logical (float) tensor, untransposed; target: the code type (a `QType`: int4, uint4,
    int8, float8_e4m3fn, fp6_e3m2, ...); block_size: one entry per dim of `shape`; quant_min/quant_max: the
    code range; fmt: packing format name; transposed: a 2-D tensor (or 3-D expert weights [E, N, K]) viewed
    with its last two dims swapped without moving data; act_quant: activation quantization applied by linear,
    or None for weight-only; scale_type: None (scales are floats of their stored dtype) or a scale QType
    (`qtype("e8m0")`: powers of two); compute_dtype: None, or torch.bfloat16 for a linear that rounds a
    float32 input to bf16 and runs the bf16 kernels (`QuantConfig.compute_dtype` gives the numerics).

    Build one with `QuantSpec.create` (fills and checks the range, normalizes the target).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    target: QType
    block_size: tuple[int, ...]
    quant_min: int | float
    quant_max: int | float
    zero_point_domain: ZeroPointDomain
    mapping_type: MappingType
    fmt: str
    transposed: bool = False
    act_quant: ActivationQuant | None = None
    scale_type: QType | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        """Type and range checks of every field (cheap: isinstance tests), so a spec built from junk positional
        arguments, or unpickled from a tampered checkpoint, fails here naming the field."""
        def bad(name: str, want: str):
            return ValueError(f"QuantSpec.{name}={getattr(self, name)!r}: {want}; build specs with QuantSpec.create")

        for name in ("shape", "block_size"):
            v = getattr(self, name)
            low = 0 if name == "shape" else 1
            if not isinstance(v, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= low
                                                   for x in v):
                raise bad(name, f"must be a tuple of ints >= {low}")
        if len(self.block_size) != len(self.shape):
            raise bad("block_size", f"must have one entry per dim of shape {self.shape}")
        if any(n % b for n, b in zip(self.shape, self.block_size, strict=True)):
            raise bad("block_size", f"each entry must divide its dim of shape {self.shape} (quantize_affine's rule: "
                      "whole blocks only)")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise bad("dtype", "must be the logical floating-point torch dtype (torch.float32, torch.bfloat16, ...)")
        if not isinstance(self.target, QType):
            raise bad("target", "must be a QType (affineq.qtype('int4'))")
        for name in ("quant_min", "quant_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, "must be a number in the target's range")
        check_quant_range(self.target, self.quant_min, self.quant_max)
        _check_enum("QuantSpec.zero_point_domain", self.zero_point_domain, ZeroPointDomain)
        _check_enum("QuantSpec.mapping_type", self.mapping_type, MappingType)
        if not isinstance(self.fmt, str):
            raise bad("fmt", "must be a packing format name ('plain', 'dense', ...)")
        if not isinstance(self.transposed, bool) or (self.transposed and len(self.shape) not in (2, 3)):
            raise bad("transposed", "must be a bool, True only for a 2-D tensor or 3-D expert weights")
        if not (self.act_quant is None or isinstance(self.act_quant, ActivationQuant)):
            raise bad("act_quant", "must be an ActivationQuant or None")
        if not (self.scale_type is None or isinstance(self.scale_type, QType)):
            raise bad("scale_type", "must be None or a QType (qtype('e8m0'))")
        check_compute_dtype(self.compute_dtype, "QuantSpec.compute_dtype")

    def __setstate__(self, state) -> None:
        _set_checked_state(self, state)

    @classmethod
    def create(
        cls,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        target: QType | torch.dtype | str,
        block_size: tuple[int, ...],
        *,
        mapping_type: MappingType = MappingType.ASYMMETRIC,
        zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
        quant_min: int | float | None = None,
        quant_max: int | float | None = None,
        packing_format: str = "plain",
        act_quant: ActivationQuant | None = None,
        scale_type: QType | str | None = None,
        transposed: bool = False,
    ) -> QuantSpec:
        """The one way to build a spec: validates the target and its range (None = the full range); float
        targets always get ZeroPointDomain.NONE (they have no zero point)."""
        try:
            t = qtype(target)
        except ValueError as e:
            raise ValueError(f"target={target!r}: {e}; use one of these names or a torch dtype such as torch.int4 "
                             "(affineq.register_qtype adds new ones)") from None
        qmin, qmax = check_quant_range(t, quant_min, quant_max)
        _check_enum("mapping_type", mapping_type, MappingType)
        _check_enum("zero_point_domain", zero_point_domain, ZeroPointDomain)
        if len(block_size) != len(shape):
            example = (1,) * (len(shape) - 1) + (shape[-1],) if len(shape) else ()
            raise ValueError(f"block_size {tuple(block_size)} must have one entry per dim of shape {tuple(shape)}, "
                             f"e.g. {example} (one qparam per row)")
        st = _scale_qtype(scale_type)
        return cls(
            shape=tuple(int(s) for s in shape), dtype=dtype, target=t,
            block_size=tuple(int(b) for b in block_size), quant_min=qmin, quant_max=qmax,
            zero_point_domain=ZeroPointDomain.NONE if t.is_float else zero_point_domain,
            mapping_type=mapping_type, fmt=packing_format, transposed=transposed, act_quant=act_quant,
            scale_type=st,
        )

    def replace(self, **changes) -> QuantSpec:
        return dataclasses.replace(self, **changes)

    @property
    def target_dtype(self) -> torch.dtype | QType:
        """The target as a torch dtype where torch has one (torch.int4), else the QType (fp6_e3m2)."""
        return self.target.torch_dtype or self.target

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """Shape the user sees: `shape`, or `shape` with its last two dims swapped when `transposed`."""
        return (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transposed else self.shape

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(s // b for s, b in zip(self.shape, self.block_size, strict=False))

    # -- portable encoding --------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain JSON values: dtypes, QTypes and enums by name, tuples as lists, plus "version"."""
        return {
            "version": SPEC_VERSION,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "target": self.target.name,
            "block_size": list(self.block_size),
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "zero_point_domain": self.zero_point_domain.name,
            "mapping_type": self.mapping_type.name,
            "format": self.fmt,
            "transposed": self.transposed,
            "act_quant": None if self.act_quant is None else self.act_quant.to_dict(),
            "scale_type": None if self.scale_type is None else self.scale_type.name,
        } | ({} if self.compute_dtype is None else {"compute_dtype": str(self.compute_dtype).removeprefix("torch.")})

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        """Inverse of `to_dict`; ValueError for a newer version, a missing or unknown key, or a bad value."""
        if not isinstance(d, dict):
            raise ValueError(f"QuantSpec.from_dict expects a dict (from QuantSpec.to_dict), got {type(d).__name__}")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"QuantSpec dict has no integer 'version' (got {version!r}); it was not written by "
                             "QuantSpec.to_dict")
        if version > SPEC_VERSION or version < 1:
            raise ValueError(f"QuantSpec version {version} is not supported by this affineq (reads versions 1.."
                             f"{SPEC_VERSION}); upgrade affineq to read this checkpoint")
        missing, unknown = _KEYS - set(d), set(d) - _KEYS - set(_OPTIONAL_KEYS)
        if missing or unknown:
            raise ValueError(f"QuantSpec dict: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; pass "
                             "the dict QuantSpec.to_dict() wrote (or upgrade affineq if a newer one wrote it)")
        dtype = _FLOAT_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"QuantSpec dict: dtype {d['dtype']!r} is not a floating-point torch dtype; it must be "
                             "the logical float dtype, e.g. 'float32' or 'bfloat16'")
        for key in ("shape", "block_size"):
            if not isinstance(d[key], (list, tuple)) or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in d[key]):
                raise ValueError(f"QuantSpec dict: {key} must be a list of ints, got {d[key]!r}")
        if not all(b >= 1 for b in d["block_size"]) or not all(n >= 0 for n in d["shape"]):
            raise ValueError(f"QuantSpec dict: block_size {d['block_size']!r} must be positive and shape "
                             f"{d['shape']!r} non-negative; the spec was edited or corrupted")
        if not isinstance(d["transposed"], bool):  # bool("false") is True: no coercion of stored values
            raise ValueError(f"QuantSpec dict: transposed must be a JSON bool (true / false), got "
                             f"{d['transposed']!r}")
        for key in ("quant_min", "quant_max"):  # to_dict always writes the filled range: null is not "full"
            if isinstance(d[key], bool) or not isinstance(d[key], (int, float)):
                raise ValueError(f"QuantSpec dict: {key} must be a number (the code range to_dict wrote), got "
                                 f"{d[key]!r}")
        try:
            return cls.create(
                tuple(d["shape"]), dtype, d["target"], tuple(d["block_size"]),
                mapping_type=_enum_member("mapping_type", d["mapping_type"], MappingType),
                zero_point_domain=_enum_member("zero_point_domain", d["zero_point_domain"], ZeroPointDomain),
                quant_min=d["quant_min"], quant_max=d["quant_max"], packing_format=d["format"],
                act_quant=None if d["act_quant"] is None else ActivationQuant.from_dict(d["act_quant"]),
                scale_type=d["scale_type"], transposed=d["transposed"],
            ).replace(compute_dtype=_compute_dtype_of(d.get("compute_dtype")))
        except ValueError as e:
            raise ValueError(f"QuantSpec dict: {e}") from None


# A QuantSpec or ActivationQuant as the str argument of an opaque op (its to_dict() as sorted JSON), and back.
# `as_key` runs where dynamo traces (its only callers build traced op calls): a constant to it, called once.
@torch.compiler.assume_constant_result
def as_key(obj: QuantSpec | ActivationQuant) -> str:
    return json.dumps(obj.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=512)
def from_key(cls: type, key: str) -> Any:
    """`cls.from_dict` of the JSON `as_key` wrote (cached: the ops call it per run)."""
    return cls.from_dict(json.loads(key))
