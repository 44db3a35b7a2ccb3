"""Moved: the float configs live in `affineq.configs` (module `affineq.configs.float`). Importing a name from
here still works for one release, with a DeprecationWarning naming its new place."""

import importlib
import warnings

_NAMES = ("FPX_FORMATS", "FPX_SCALE_TYPES", "FPxWeightOnlyConfig", "MXDynamicActivationMXWeightConfig",
          "MXWeightOnlyConfig", "MicroexpWeightOnlyConfig")


def __getattr__(name: str):
    if name in _NAMES:
        warnings.warn(f"affineq.configs_float.{name} moved: import it from affineq.configs (from affineq.configs "
                      f"import {name}); affineq.configs_float goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module("affineq.configs"), name)
    raise AttributeError(f"module 'affineq.configs_float' has no attribute {name!r}")


def __dir__():
    return sorted(_NAMES)
