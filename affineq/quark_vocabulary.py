"""What AMD Quark's layered config (`affineq.quark_config`) may name: its enums (JSON stores member names), what
each Dtype maps to in affineq (`DTYPE_TARGETS`, `MX_ELEMENTS`), and the classes a config dict may name (observers,
layer types), found in registries only: reading JSON never imports a module or walks attributes. Shared by the
config's validation and its mapping to affineq configs (`affineq._quark_mapping`)."""

from __future__ import annotations

import enum
import threading

import torch
from torch import nn

# -- enums (JSON: member names) --------------------------------------------------------------------------


class Dtype(str, enum.Enum):
    int8 = "int8"
    uint8 = "uint8"
    int4 = "int4"
    uint4 = "uint4"
    int2 = "int2"
    int3 = "int3"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"
    fp6_e3m2 = "fp6_e3m2"
    fp6_e2m3 = "fp6_e2m3"
    fp4 = "fp4"
    mx = "mx"
    mx6 = "mx6"
    mx9 = "mx9"


class QSchemeType(str, enum.Enum):
    per_tensor = "per_tensor"
    per_channel = "per_channel"
    per_group = "per_group"


class ScaleType(str, enum.Enum):
    float = "float"
    pof2 = "pof2"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class RoundType(str, enum.Enum):
    round = "round"
    floor = "floor"
    half_even = "half_even"


class ZeroPointType(str, enum.Enum):
    int32 = "int32"
    float32 = "float32"


class DeviceType(str, enum.Enum):
    CPU = "CPU"
    IPU = "IPU"


class QuantizationMode(str, enum.Enum):
    eager_mode = "eager_mode"
    fx_graph_mode = "fx_graph_mode"


#: Dtype -> affineq target (a torch dtype or a qtype name); absent members are not usable as targets.
DTYPE_TARGETS: dict[Dtype, torch.dtype | str] = {
    Dtype.int8: torch.int8, Dtype.uint8: torch.uint8, Dtype.int4: torch.int4, Dtype.uint4: torch.uint4,
    Dtype.int2: torch.int2, Dtype.int3: torch.int3, Dtype.fp8_e4m3: torch.float8_e4m3fn,
    Dtype.fp8_e5m2: torch.float8_e5m2, Dtype.fp6_e3m2: "fp6_e3m2", Dtype.fp6_e2m3: "fp6_e2m3",
    Dtype.fp4: "fp4_e2m1",
}
#: Dtypes that mean "leave this tensor float": refused as targets, with the fix.
UNUSABLE_DTYPES = {
    Dtype.bfloat16: "bfloat16 means 'leave float in bfloat16': call model.to(torch.bfloat16) and leave this "
                    "tensor's spec None",
    Dtype.float16: "float16 means 'leave float in float16': call model.to(torch.float16) and leave this "
                   "tensor's spec None",
}
#: OCP MX element types (QuantizationSpec.mx_element_dtype with dtype=Dtype.mx) -> affineq element dtype.
MX_ELEMENTS: dict[Dtype, torch.dtype | str] = {
    Dtype.fp8_e4m3: torch.float8_e4m3fn, Dtype.fp8_e5m2: torch.float8_e5m2, Dtype.fp6_e3m2: "fp6_e3m2",
    Dtype.fp6_e2m3: "fp6_e2m3", Dtype.fp4: "fp4_e2m1", Dtype.int8: torch.int8,
}
#: Dtypes of float formats (their codes are not integers: symmetric only, round half to even).
FLOAT_DTYPES = {Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.fp6_e3m2, Dtype.fp6_e2m3, Dtype.fp4, Dtype.mx,
                 Dtype.mx6, Dtype.mx9, Dtype.bfloat16, Dtype.float16}
INT8_DTYPES = {Dtype.int8, Dtype.uint8}


def need_enum(owner: str, name: str, value, cls: type[enum.Enum], optional: bool = True) -> None:
    """ValueError naming `owner.name` unless `value` is a member of `cls` (or None when optional)."""
    if value is None and optional:
        return
    if not isinstance(value, cls):
        raise ValueError(f"{owner}.{name}={value!r}: use a {cls.__name__} member, e.g. "
                         f"{cls.__name__}.{next(iter(cls)).name}{' (or None)' if optional else ''}")


# -- the classes a dict may name (JSON never imports or walks attributes: it looks names up here) ------------

_REGISTRY_LOCK = threading.Lock()
_OBSERVERS: dict[tuple[str, str], type] = {}  # (module, qualname) -> observer class; filled lazily
_LAYER_TYPES: dict[tuple[str, str], type] = {}  # (module, qualname) -> torch.nn module class; filled lazily


def _class_key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def observer_registry() -> dict[tuple[str, str], type]:
    """(module, qualname) -> observer class: affineq.observers' public observers and those registered."""
    if not _OBSERVERS:
        from affineq import observers

        with _REGISTRY_LOCK:
            for name in observers.__all__:
                cls = getattr(observers, name)  # a fixed module's own public names, not a name from a dict
                if isinstance(cls, type) and issubclass(cls, observers.Observer) and cls is not observers.Observer:
                    _OBSERVERS.setdefault(_class_key(cls), cls)
    return _OBSERVERS


def layer_type_registry() -> dict[tuple[str, str], type]:
    """(module, qualname) -> class, for the torch.nn module classes a layer-type key may name."""
    if not _LAYER_TYPES:
        with _REGISTRY_LOCK:
            for cls in vars(nn).values():
                if isinstance(cls, type) and issubclass(cls, nn.Module):
                    _LAYER_TYPES.setdefault(_class_key(cls), cls)
    return _LAYER_TYPES


def register_observer(cls: type) -> type:
    """Allow `cls` (a subclass of `affineq.observers.Observer`) as a `QuantizationSpec.observer_cls` read back by
    `from_dict`. JSON names a class by {"module", "qualname"}; only affineq's observers and registered classes
    are found, nothing is imported. Returns `cls` (usable as a class decorator)."""
    from affineq.observers import Observer

    if not (isinstance(cls, type) and issubclass(cls, Observer)):
        raise ValueError(f"register_observer({cls!r}): pass a subclass of affineq.observers.Observer (it turns "
                         "what it saw into qparams through the primitives)")
    registry = observer_registry()
    with _REGISTRY_LOCK:
        other = registry.get(_class_key(cls))
        if other is not None and other is not cls:
            raise ValueError(f"register_observer: another class is registered as {cls.__module__}."
                             f"{cls.__qualname__}; give the observer a distinct module or name")
        registry[_class_key(cls)] = cls
    return cls


def load_class(ref, what: str, registry: dict[tuple[str, str], type], allowed: str) -> type:
    """The class `ref` ({"module": ..., "qualname": ...}, as to_dict writes it) names in `registry`; ValueError
    for anything else. Nothing is imported and no attribute is looked up: only registered names resolve."""
    if not (isinstance(ref, dict) and set(ref) == {"module", "qualname"} and isinstance(ref["module"], str)
            and isinstance(ref["qualname"], str)):
        raise ValueError(f"{what}={ref!r}: expected {{'module': ..., 'qualname': ...}} as to_dict writes it")
    cls = registry.get((ref["module"], ref["qualname"]))
    if cls is None:
        raise ValueError(f"{what}: refusing to load {ref['module']}.{ref['qualname']}: it is not one of the "
                         f"{allowed}")
    return cls


OBSERVERS_ALLOWED = ("observers of affineq.observers or a class registered with "
                     "affineq.quark.register_observer (set observer_cls in code for other classes)")


def load_observer(ref, what: str) -> type:
    """The observer class `ref` ({"module": ..., "qualname": ...}) names among affineq's observers and the classes
    given to `register_observer`; ValueError naming `what` otherwise."""
    return load_class(ref, what, observer_registry(), OBSERVERS_ALLOWED)
