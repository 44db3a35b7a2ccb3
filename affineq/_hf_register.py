"""Make `import affineq` enough for transformers to load affineq checkpoints, without importing transformers.

transformers reads quant_method "affineq" from config.json and needs `affineq.hf` registered by then;
importing `affineq.hf` eagerly would make `import affineq` import transformers (seconds). `install()` instead
registers as soon as transformers itself is imported: at once if it already is, else through a one-shot
import hook that imports `affineq.hf` right after the `transformers` package has executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__all__ = ["install"]


def _register() -> None:
    try:
        import affineq.hf  # noqa: F401
    except ImportError:  # transformers too old or partly installed: `import affineq.hf` explains it
        pass


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Finds `transformers` with the other finders and wraps its loader to register affineq afterwards."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # one shot; also avoids recursion
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Register affineq's quantizer with transformers now (if imported) or when it is imported."""
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformers())
