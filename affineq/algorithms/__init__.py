"""Accuracy algorithms that compute better quantized weights than round-to-nearest: GPTQ, AWQ, SmoothQuant
and HQQ. Each is a wrapper config around a weight config; the result is an ordinary quantized model.

    quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=64)), calibration_data=batches)
"""

from affineq.algorithms._base import AlgorithmConfig, Precomputed
from affineq.algorithms._migrate import PreScaled
from affineq.algorithms.awq import AWQConfig
from affineq.algorithms.gptq import GPTQConfig
from affineq.algorithms.hqq import HQQConfig
from affineq.algorithms.smoothquant import SmoothQuantConfig

__all__ = ["AWQConfig", "AlgorithmConfig", "GPTQConfig", "HQQConfig", "Precomputed", "PreScaled",
           "SmoothQuantConfig"]
