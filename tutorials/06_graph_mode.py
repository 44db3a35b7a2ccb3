"""Graph-mode quantization: trace with torch.export, calibrate, convert (affineq.graph).

python tutorials/06_graph_mode.py        # a few seconds

Eager `quantize_` finds nn.Linear modules. Graph mode reads the traced graph instead, so it also quantizes
weights used as `F.linear(x, self.w)`, `h @ self.w` or `self.w @ h`, folds BatchNorms, and places static
observers on graph edges (shared by `cat` inputs and residual `add` inputs).
"""

import collections
import copy

import torch
import torch.nn.functional as F
from torch import nn

import affineq
from affineq import graph
from affineq.quark_config import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationMode, QuantizationSpec

torch.manual_seed(0)


def sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


# 1. A module whose weights are not all nn.Linear: a bare parameter through F.linear, an nn.Linear, and `h @ W`.
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(128, 64) / 8)
        self.lin = nn.Linear(128, 128)
        self.w2 = nn.Parameter(torch.randn(128, 32) / 11)

    def forward(self, x):
        h = F.relu(F.linear(x, self.w1))
        h = self.lin(h) + h
        return h @ self.w2  # reduces over w2's dim 0: graph mode quantizes w2.t() as an [out, in] weight


mixed = Mixed().eval()
x = torch.randn(8, 64)
prepared = graph.prepare(mixed, affineq.Int4WeightOnlyConfig(group_size=32), (x,))  # weight-only: no calibration
qmixed = graph.convert(prepared)  # a GraphModule; `mixed` itself is unchanged
with torch.no_grad(), affineq.record_kernels() as used:
    out = qmixed(x)
print("quantized weights:", sorted(n for n, p in qmixed.named_parameters()
                                   if isinstance(p, affineq.AffineQuantizedTensor)))
print(f"int4 g32 kernels: {collections.Counter(used)}, SQNR {sqnr(mixed(x).detach(), out):.1f} dB")

# 2. Static int8 on a small CNN (conv+bn+relu, pool, linear): graph mode vs eager mode on the same batches.
cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                    nn.Flatten(), nn.Linear(32, 10)).eval()
batches = [torch.randn(2, 3, 8, 8) for _ in range(4)]
static = affineq.Int8StaticActivationInt8WeightConfig()

prepared = graph.prepare(cnn, static, (batches[0],))  # BatchNorm folded here; observers on conv / linear inputs
with torch.no_grad():
    for b in batches:  # calibration
        prepared(b)
qcnn = graph.convert(prepared)

eager = copy.deepcopy(cnn)  # the eager route: fuse, prepare_, calibrate, convert_
affineq.fuse_modules_(eager, [["0", "1", "2"]])
affineq.prepare_(eager, static, filter_fn=lambda m, fqn: isinstance(m, (nn.Conv2d, nn.Linear)))
affineq.run_calibration(eager, batches, progress=False)
affineq.convert_(eager)
with torch.no_grad():
    same = torch.equal(qcnn(batches[0]), eager(batches[0]))
print(f"graph mode equals eager static quantization: {same}")
print(qcnn.code.strip().split("\n", 1)[1])  # the converted graph: conv / linear read quantized weights

# 3. Quark's layered Config in graph mode: int8 per channel everywhere, uint4 g32 for w2, `lin` left float.
w8 = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)
u4 = QuantizationSpec(Dtype.uint4, qscheme=QSchemeType.per_group, ch_axis=1, group_size=32, symmetric=False)
quark = Config(QuantizationConfig(weight=w8), layer_quant_config={"w2": QuantizationConfig(weight=u4)},
               exclude=["lin"], quant_mode=QuantizationMode.fx_graph_mode)
qq = graph.convert(graph.prepare(mixed, quark, (x,)))
print("Quark Config:", {n: p.spec.target.name for n, p in qq.named_parameters()
                        if isinstance(p, affineq.AffineQuantizedTensor)})
