"""Weight configs, one module per family: `base` (QuantConfig, the JSON form, shared checks), `integer`
(int4 / int8 / intx weight-only, W8A8, 8da4w), `float` (float8, FPx, MX, microexponents), `kquant` (llama.cpp's
k-quant super-blocks).

`from affineq.configs import Int4WeightOnlyConfig` imports from here whatever the family; the static
calibrated config (`Int8StaticActivationInt8WeightConfig`) lives with its workflow in `affineq.calibration`.
"""

from affineq.configs.base import (  # noqa: F401 (the private names: see below)
    _CONFIGS,
    _POW2_SCALE_MODES,
    QuantConfig,
    _auto_float_codes,
    check_choice,
    config_from_dict,
    decode_field,
    encode_field,
    resolve_format,
    row_block,
)
from affineq.configs.float import (
    FPX_FORMATS,
    FPX_SCALE_TYPES,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    MicroexpWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
)
from affineq.configs.integer import (
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
)
from affineq.configs.kquant import KQuantConfig, quantize_kquant

__all__ = [
    "QuantConfig",
    "Int4WeightOnlyConfig",
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8DynamicActivationInt4WeightConfig",
    "IntxWeightOnlyConfig",
    "Float8WeightOnlyConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "FPxWeightOnlyConfig",
    "MXWeightOnlyConfig",
    "MXDynamicActivationMXWeightConfig",
    "MicroexpWeightOnlyConfig",
    "KQuantConfig",
    "quantize_kquant",
    "FPX_FORMATS",
    "FPX_SCALE_TYPES",
    "config_from_dict",
    "check_choice",
    "row_block",
    "encode_field",
    "decode_field",
    "resolve_format",
]

# The helpers' names from before the split into a package (with _CONFIGS, _POW2_SCALE_MODES and
# _auto_float_codes imported above), for modules written against them; new code imports the public names.
_check_choice, _row_block, _encode, _decode = check_choice, row_block, encode_field, decode_field
