"""Quantization-aware training: fake-quantize weights and activations while fine-tuning, then convert to
real quantized weights with the same codes.

    quantize_(model, QATConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), step="prepare"))
    ... train ...
    quantize_(model, QATConfig(Int8DynamicActivationInt4WeightConfig(group_size=32), step="convert"))
"""

from affineq.qat.config import FakeQuantizeConfig, TQTThresholdInitMeth
from affineq.qat.experts import ExpertWeightFakeQuantizer
from affineq.qat.fake_quantizer import FakeQuantizer, tqt_threshold
from affineq.qat.initialize import initialize_fake_quantizers
from affineq.qat.modules import FakeQuantizedConv2d, FakeQuantizedEmbedding, FakeQuantizedLinear
from affineq.qat.qat_config import QAT_BASE_CONFIGS, QATConfig, fake_quantize_configs

__all__ = [
    "ExpertWeightFakeQuantizer",
    "FakeQuantizeConfig",
    "FakeQuantizedConv2d",
    "FakeQuantizedEmbedding",
    "FakeQuantizedLinear",
    "FakeQuantizer",
    "QATConfig",
    "QAT_BASE_CONFIGS",
    "TQTThresholdInitMeth",
    "fake_quantize_configs",
    "initialize_fake_quantizers",
    "tqt_threshold",
]
