"""The linear-kernel registry and its observability, as a namespace: `affineq.kernels.register_linear_kernel`.

`record_kernels`, `set_strict`, `strict_kernels` and `KernelFallbackWarning` are also at the top level.
Definitions: `affineq.tensor.kernel_registry` (the ordered table and the choice rule), `affineq.tensor.fallback`.
"""

from affineq.tensor.fallback import (
    KernelFallbackError,
    KernelFallbackWarning,
    record_kernels,
    set_strict,
    strict_kernels,
)
from affineq.tensor.kernel_registry import LINEAR_KERNELS, register_linear_kernel, select_linear_kernel

__all__ = ["LINEAR_KERNELS", "KernelFallbackError", "KernelFallbackWarning", "record_kernels",
           "register_linear_kernel", "select_linear_kernel", "set_strict", "strict_kernels"]
