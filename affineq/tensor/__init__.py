"""The tensor layer: one `AffineQuantizedTensor`, its packing formats, op tables and linear kernels.

This file is the one place that fills the tables. Python runs it before any module below it, so importing
`affineq.tensor.affine` (or any other module here) alone gives a tensor with every format, op and kernel:

| table                                         | filled by (the module's `register_*` lines / decorators) |
|-----------------------------------------------|----------------------------------------------------------|
| `formats.FORMATS` (name -> PackingFormat)     | `formats` (plain, dense, int4_*), format_microexp, format_kquant |
| `AffineQuantizedTensor._torch_function_table` | `ops` (`@implements(F.linear, ...)`)                     |
| `AffineQuantizedTensor._dispatch_table`       | `ops` (aten ops), `sharding` (collectives, empty_like)   |
| `kernel_registry.LINEAR_KERNELS` (ordered)    | `linear_kernels` (first registered, first tried)         |

No other module imports these for their side effect; a new format, op or kernel module is one line below.
`tests/test_architecture.py` pins each table's entries.
"""

from affineq.tensor import (
    format_kquant,  # noqa: F401  (q2_k .. q6_k: GGUF k-quant super-blocks)
    format_microexp,  # noqa: F401  (microexp)
    formats,  # noqa: F401  (plain, dense, int4_cpu, int4_cuda)
    linear_kernels,  # noqa: F401  (LINEAR_KERNELS, in the order they are tried)
    ops,  # noqa: F401  (the op tables of AffineQuantizedTensor)
    sharding,  # noqa: F401  (collectives and empty_like for DTensor)
)
