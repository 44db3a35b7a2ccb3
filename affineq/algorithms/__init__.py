"""Accuracy algorithms that compute better quantized weights than round-to-nearest: GPTQ, AWQ, SmoothQuant,
HQQ and importance-weighted round-to-nearest (an importance matrix from calibration data). Each is a wrapper
config around a weight config; the result is an ordinary quantized model.

    quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=64)), calibration_data=batches)
"""

from affineq.algorithms._base import AlgorithmConfig, Precomputed
from affineq.algorithms._migrate import PreScaled
from affineq.algorithms.awq import AWQConfig
from affineq.algorithms.gptq import GPTQConfig
from affineq.algorithms.hqq import HQQConfig
from affineq.algorithms.imatrix import ImportanceMatrix, collect_importance
from affineq.algorithms.importance import ImportanceWeightedConfig
from affineq.algorithms.smoothquant import SmoothQuantConfig

__all__ = ["AWQConfig", "AlgorithmConfig", "GPTQConfig", "HQQConfig", "ImportanceMatrix", "ImportanceWeightedConfig",
           "Precomputed", "PreScaled", "SmoothQuantConfig", "collect_importance"]
