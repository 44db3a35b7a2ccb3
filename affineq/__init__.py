"""affineq: affine quantization for PyTorch built on one tensor subclass.

    import affineq
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=128))

Importing affineq registers its tensor class, enums, granularities and metadata as safe globals, so
`torch.load(path, weights_only=True)` reads quantized checkpoints with no user action.
"""

import torch

from affineq import (
    eval,  # noqa: F401  (eval.compare: perplexity / KL divergence against a reference model)
    graph,  # noqa: F401  (graph mode: affineq.graph.prepare / convert)
    safetensors,  # noqa: F401  (save_file / load_file; the safetensors package is imported lazily)
)
from affineq._hf_register import install as _install_hf
from affineq.algorithms import AWQConfig, GPTQConfig, HQQConfig, SmoothQuantConfig
from affineq.ao_compat import quantize_dynamic
from affineq.autoquant import autoquant  # noqa: F401  (affineq.autoquant(model, bits, data) -> FqnToConfig)
from affineq.calibration import Int8StaticActivationInt8WeightConfig, convert_, prepare_, run_calibration
from affineq.configs import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    QuantConfig,
    config_from_dict,
)
from affineq.configs_float import (
    FPxWeightOnlyConfig,
    MicroexpWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
)
from affineq.distributed import dcp_load, dcp_save, parallelize_quantized, quantized_state_dict
from affineq.dtypes import QTYPES, FloatFormat, IntFormat, QType, qtype, register_qtype
from affineq.fusion import ConvReLU, LinearReLU, fold_batch_norm, fuse_modules_
from affineq.granularity import (
    Granularity,
    PerAxis,
    PerBlock,
    PerGroup,
    PerRow,
    PerTensor,
    PerToken,
    get_block_size,
    parse_granularity,
)
from affineq.microexp import dequantize_microexp, microexp_tensor, quantize_microexp
from affineq.mx import SCALE_MODES, dequantize_mx, fake_quantize_mx, quantize_mx
from affineq.observers import (
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    Observer,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorHistogramObserver,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)
from affineq.primitives import (
    MappingType,
    ZeroPointDomain,
    choose_qparams_affine,
    dequantize_affine,
    fake_quantize_affine,
    quantize_affine,
)
from affineq.qat import (
    FakeQuantizeConfig,
    FakeQuantizedConv2d,
    FakeQuantizedEmbedding,
    FakeQuantizedLinear,
    FakeQuantizer,
    QATConfig,
    TQTThresholdInitMeth,
    initialize_fake_quantizers,
)
from affineq.quantize import (
    FqnToConfig,
    ModelConfig,
    QuantizationError,
    quantize_,
    quantized_weights,
    register_quantize_module_handler,
)
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
)
from affineq.streaming import QuantizedCheckpoint, is_linear_weight, load_quantized, quantize_checkpoint
from affineq.tensor import linear_kernels as _linear_kernels  # noqa: F401  (registers the kernels)
from affineq.tensor import ops as _ops  # noqa: F401  (fills the op tables)
from affineq.tensor.affine import ACT_TENSORS, AffineQuantizedTensor
from affineq.tensor.fallback import (
    KernelFallbackError,
    KernelFallbackWarning,
    record_kernels,
    set_strict,
    strict_kernels,
)
from affineq.tensor.kernel_registry import register_linear_kernel, select_linear_kernel
from affineq.tensor.spec import ActivationQuant, QParamOptions, QuantSpec

_install_hf()  # registers quant_method="affineq" with transformers when (and if) transformers is imported

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "AffineqConfig":  # affineq.hf imports transformers (seconds): only when asked for
        from affineq.hf import AffineqConfig

        return AffineqConfig
    raise AttributeError(f"module 'affineq' has no attribute {name!r}")

__all__ = [
    "graph",
    "FPxWeightOnlyConfig",
    "MXDynamicActivationMXWeightConfig",
    "MXWeightOnlyConfig",
    "MicroexpWeightOnlyConfig",
    "SCALE_MODES",
    "dequantize_microexp",
    "dequantize_mx",
    "fake_quantize_mx",
    "microexp_tensor",
    "quantize_microexp",
    "quantize_mx",
    "AWQConfig",
    "GPTQConfig",
    "HQQConfig",
    "SmoothQuantConfig",
    "FakeQuantizeConfig",
    "FakeQuantizedConv2d",
    "FakeQuantizedEmbedding",
    "FakeQuantizedLinear",
    "FakeQuantizer",
    "QATConfig",
    "TQTThresholdInitMeth",
    "initialize_fake_quantizers",
    "AffineqConfig",
    "MovingAveragePerChannelMinMaxObserver",
    "MovingAveragePerTensorMinMaxObserver",
    "Observer",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerTensorHistogramObserver",
    "PerTensorMSEObserver",
    "PerTensorMinMaxObserver",
    "PerTensorPercentileObserver",
    "ACT_TENSORS",
    "ActivationQuant",
    "ConvReLU",
    "Config",
    "DeviceType",
    "Dtype",
    "ModelConfig",
    "QSchemeType",
    "QuantizationConfig",
    "QuantizationMode",
    "QuantizationSpec",
    "RoundType",
    "ScaleType",
    "ZeroPointType",
    "AffineQuantizedTensor",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8WeightOnlyConfig",
    "FloatFormat",
    "FqnToConfig",
    "Granularity",
    "Int4WeightOnlyConfig",
    "Int8DynamicActivationInt4WeightConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8StaticActivationInt8WeightConfig",
    "Int8WeightOnlyConfig",
    "IntFormat",
    "IntxWeightOnlyConfig",
    "KernelFallbackError",
    "KernelFallbackWarning",
    "LinearReLU",
    "MappingType",
    "PerAxis",
    "PerBlock",
    "PerGroup",
    "PerRow",
    "PerTensor",
    "PerToken",
    "QParamOptions",
    "QTYPES",
    "QType",
    "QuantConfig",
    "QuantSpec",
    "QuantizationError",
    "ZeroPointDomain",
    "choose_qparams_affine",
    "config_from_dict",
    "dcp_load",
    "dcp_save",
    "convert_",
    "dequantize_affine",
    "fake_quantize_affine",
    "fold_batch_norm",
    "fuse_modules_",
    "get_block_size",
    "parallelize_quantized",
    "parse_granularity",
    "prepare_",
    "quantize_",
    "quantize_dynamic",
    "quantize_affine",
    "quantized_state_dict",
    "quantized_weights",
    "quantize_checkpoint",
    "load_quantized",
    "is_linear_weight",
    "QuantizedCheckpoint",
    "qtype",
    "record_kernels",
    "register_linear_kernel",
    "register_qtype",
    "run_calibration",
    "register_quantize_module_handler",
    "select_linear_kernel",
    "set_strict",
    "strict_kernels",
]

torch.serialization.add_safe_globals(
    [AffineQuantizedTensor, QuantSpec, ActivationQuant, MappingType, ZeroPointDomain, qtype,
     PerTensor, PerAxis, PerGroup, PerToken, PerRow, PerBlock]
)
