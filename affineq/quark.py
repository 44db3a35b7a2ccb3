"""AMD Quark's layered config vocabulary, as a namespace: `affineq.quark.Config(global_quant_config=...)`.

The definitions live in `affineq.quark_config` (resolution to affineq configs: `affineq._quark_mapping`).
"""

from affineq.quark_config import (
    Config,
    DeviceType,
    Dtype,
    QSchemeType,
    QuantizationConfig,
    QuantizationMode,
    QuantizationSpec,
    RoundType,
    ScaleType,
    ZeroPointType,
    register_observer,
)

__all__ = ["Config", "DeviceType", "Dtype", "QSchemeType", "QuantizationConfig", "QuantizationMode",
           "QuantizationSpec", "RoundType", "ScaleType", "ZeroPointType", "register_observer"]
