"""The package version: `affineq.__version__` and the version written into safetensors headers."""

__version__ = "0.1.0"  # keep equal to pyproject.toml [project] version
