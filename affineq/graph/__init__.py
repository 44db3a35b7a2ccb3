"""Graph-mode quantization over `torch.export` graphs.

    prepared = affineq.graph.prepare(model, config, (x,))   # trace, fold BatchNorms, insert static observers
    for batch in calibration_batches:                        # static activation configs only
        prepared(batch)
    qmodel = affineq.graph.convert(prepared)                 # AffineQuantizedTensor weights, static qparams

`config`: any `quantize_` config (weights; dynamic activations; `Int8StaticActivationInt8WeightConfig`),
`FqnToConfig`, or Quark's `Config(..., quant_mode=QuantizationMode.fx_graph_mode)`. Linear-like ops on a
parameter (F.linear, `x @ W`, `W @ x`, addmm, conv) are quantized; those that cannot be stay float with one
`GraphModeWarning` naming the node and the reason.
"""

from affineq.graph.convert import QuantDequant, convert
from affineq.graph.prepare import prepare
from affineq.graph.trace import GraphModeWarning

__all__ = ["GraphModeWarning", "QuantDequant", "convert", "prepare"]
