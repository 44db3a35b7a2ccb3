"""affineq: affine quantization for PyTorch built on one tensor subclass.

    import affineq
    affineq.quantize_(model, affineq.Int4WeightOnlyConfig(group_size=128))

Importing affineq registers its tensor class, enums, granularities and metadata as safe globals, so
`torch.load(path, weights_only=True)` reads quantized checkpoints with no user action.
"""

import importlib
import warnings

import torch

from affineq import (
    eval,  # noqa: F401  (eval.compare: perplexity / KL divergence against a reference model)
    experts,  # noqa: F401  (MoE experts modules run grouped_linear once quantize_ quantized them)
    graph,  # noqa: F401  (graph mode: affineq.graph.prepare / convert)
    kernels,  # noqa: F401  (namespace: the linear-kernel registry)
    quark,  # noqa: F401  (namespace: AMD Quark's layered Config)
    safetensors,  # noqa: F401  (save_file / load_file; the safetensors package is imported lazily)
)
from affineq import granularity as _granularity
from affineq._hf_register import install as _install_hf
from affineq._version import __version__  # noqa: F401
from affineq.algorithms import AWQConfig, GPTQConfig, HQQConfig, SmoothQuantConfig
from affineq.ao_compat import quantize_dynamic
from affineq.autoquant import autoquant  # noqa: F401  (affineq.autoquant(model, bits, data) -> FqnToConfig)
from affineq.calibration import Int8StaticActivationInt8WeightConfig, convert_, prepare_, run_calibration
from affineq.configs import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FPxWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MicroexpWeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
    QuantConfig,
    config_from_dict,
)
from affineq.configs.kquant import KQuantConfig  # noqa: F401  (llama.cpp k-quant super-blocks, q2_k .. q6_k)
from affineq.distributed import dcp_load, dcp_save, parallelize_quantized
from affineq.dtypes import qtype as _qtype
from affineq.fusion import fuse_modules_
from affineq.granularity import PerAxis, PerGroup
from affineq.primitives import MappingType, ZeroPointDomain
from affineq.qat import FakeQuantizeConfig, QATConfig
from affineq.quantize import (
    FqnToConfig,
    QuantizationError,
    quantize_,
    quantized_weights,
    register_quantize_module_handler,
)
from affineq.streaming import load_quantized, quantize_checkpoint
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.fallback import KernelFallbackWarning, record_kernels, set_strict, strict_kernels
from affineq.tensor.spec import ActivationQuant, QParamOptions, QuantSpec

_install_hf()  # registers quant_method="affineq" with transformers when (and if) transformers is imported

#: The public API, first tier (product names). The second tier lives in namespaces: affineq.quark,
#: affineq.observers, affineq.mx, affineq.microexp, affineq.primitives, affineq.granularity, affineq.dtypes,
#: affineq.qat, affineq.fusion, affineq.kernels, affineq.plan, affineq.streaming, affineq.distributed.
__all__ = [
    # quantize a model
    "quantize_", "autoquant", "FqnToConfig", "QuantConfig", "config_from_dict", "QuantizationError",
    "register_quantize_module_handler", "quantized_weights",
    # weight (and activation) configs
    "Int4WeightOnlyConfig", "Int8WeightOnlyConfig", "IntxWeightOnlyConfig", "Int8DynamicActivationInt4WeightConfig",
    "Int8DynamicActivationInt8WeightConfig", "Int8StaticActivationInt8WeightConfig", "Float8WeightOnlyConfig",
    "Float8DynamicActivationFloat8WeightConfig", "FPxWeightOnlyConfig", "MXWeightOnlyConfig",
    "MXDynamicActivationMXWeightConfig", "MicroexpWeightOnlyConfig",
    "MappingType", "ZeroPointDomain", "PerGroup", "PerAxis",
    # accuracy algorithms, QAT, calibration, torch.ao, graph mode, fusion
    "AWQConfig", "GPTQConfig", "HQQConfig", "SmoothQuantConfig", "QATConfig", "FakeQuantizeConfig",
    "prepare_", "convert_", "run_calibration", "quantize_dynamic", "graph", "fuse_modules_",
    # the tensor
    "AffineQuantizedTensor", "QuantSpec", "QParamOptions", "ActivationQuant",
    # which kernel runs
    "record_kernels", "set_strict", "strict_kernels", "KernelFallbackWarning",
    # files, checkpoints larger than memory, transformers, tensor parallelism
    "quantize_checkpoint", "load_quantized", "AffineqConfig", "dcp_save", "dcp_load", "parallelize_quantized",
]

#: Names that left the top level -> the module that holds them now. `affineq.<name>` still works for one
#: release, with a DeprecationWarning naming the new spelling.
MOVED = {
    **dict.fromkeys(["Config", "DeviceType", "Dtype", "QSchemeType", "QuantizationConfig", "QuantizationMode",
                     "QuantizationSpec", "RoundType", "ScaleType", "ZeroPointType"], "affineq.quark"),
    **dict.fromkeys(["MovingAveragePerChannelMinMaxObserver", "MovingAveragePerTensorMinMaxObserver", "Observer",
                     "PerChannelMinMaxObserver", "PerGroupMinMaxObserver", "PerTensorHistogramObserver",
                     "PerTensorMSEObserver", "PerTensorMinMaxObserver", "PerTensorPercentileObserver"],
                    "affineq.observers"),
    **dict.fromkeys(["SCALE_MODES", "dequantize_mx", "fake_quantize_mx", "quantize_mx"], "affineq.mx"),
    **dict.fromkeys(["dequantize_microexp", "microexp_tensor", "quantize_microexp"], "affineq.microexp"),
    **dict.fromkeys(["choose_qparams_affine", "dequantize_affine", "fake_quantize_affine", "quantize_affine"],
                    "affineq.primitives"),
    **dict.fromkeys(["Granularity", "PerBlock", "PerRow", "PerTensor", "PerToken", "get_block_size",
                     "parse_granularity"], "affineq.granularity"),
    **dict.fromkeys(["QTYPES", "FloatFormat", "IntFormat", "QType", "qtype", "register_qtype"], "affineq.dtypes"),
    **dict.fromkeys(["FakeQuantizedConv2d", "FakeQuantizedEmbedding", "FakeQuantizedLinear", "FakeQuantizer",
                     "TQTThresholdInitMeth", "initialize_fake_quantizers"], "affineq.qat"),
    **dict.fromkeys(["ConvReLU", "LinearReLU", "fold_batch_norm"], "affineq.fusion"),
    **dict.fromkeys(["KernelFallbackError", "register_linear_kernel", "select_linear_kernel"], "affineq.kernels"),
    **dict.fromkeys(["QuantizedCheckpoint", "is_linear_weight"], "affineq.streaming"),
    "quantized_state_dict": "affineq.distributed",
    "ModelConfig": "affineq.plan",
    "ACT_TENSORS": "affineq.tensor.affine",
}


def __getattr__(name: str):
    if name == "AffineqConfig":  # affineq.hf imports transformers (seconds): only when asked for
        from affineq.hf import AffineqConfig

        return AffineqConfig
    if name in MOVED:
        where = MOVED[name]
        warnings.warn(f"affineq.{name} moved to {where}.{name} (from {where} import {name}); the top-level name "
                      "goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module 'affineq' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *MOVED])


torch.serialization.add_safe_globals(
    [AffineQuantizedTensor, QuantSpec, ActivationQuant, MappingType, ZeroPointDomain, _qtype, _granularity.PerTensor,
     PerAxis, PerGroup, _granularity.PerToken, _granularity.PerRow, _granularity.PerBlock]
)
