"""Quantization-aware training on a small model in seconds: float vs round-to-nearest vs QAT-then-convert.

A small MLP learns a regression task in float; int2 weights (IntxWeightOnlyConfig, groups of 16) after
training hurt it a lot. QAT fine-tunes with the weights fake-quantized exactly as convert will store them,
then convert swaps in real packed weights with the very codes the last forward used.

python tutorials/04_qat_small_model.py
"""

import copy

import torch
from torch import nn

from affineq import IntxWeightOnlyConfig, PerGroup, quantize_
from affineq.qat import FakeQuantizedLinear, QATConfig, initialize_fake_quantizers

torch.set_num_threads(1)  # tensors this small: thread start-up would cost more than the math
torch.manual_seed(0)
x_train, x_test = torch.randn(1024, 32), torch.randn(256, 32)
teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
y_train, y_test = teacher(x_train).detach(), teacher(x_test).detach()


def fit(model: nn.Module, steps: int, lr: float) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(x_train), (128,))
        loss = (model(x_train[idx]) - y_train[idx]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_mse(model: nn.Module) -> float:
    with torch.no_grad():
        return (model(x_test) - y_test).square().mean().item()


model = fit(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 4)), 800, 5e-3)
base = IntxWeightOnlyConfig(torch.int2, PerGroup(16))

ptq = quantize_(copy.deepcopy(model), base)  # round-to-nearest

qat = copy.deepcopy(model)
quantize_(qat, QATConfig(base, step="prepare"))  # nn.Linear -> FakeQuantizedLinear (same Parameters)
assert isinstance(qat[0], FakeQuantizedLinear)
fit(qat, 300, 1e-3)
fake_mse = test_mse(qat)
quantize_(qat, QATConfig(base, step="convert"))  # -> nn.Linear with packed int2 weights

# Range learning: the scales become parameters (LSQ), initialised from one batch before the optimizer exists.
lsq = copy.deepcopy(model)
quantize_(lsq, QATConfig(base, step="prepare", range_learning="lsq"))
initialize_fake_quantizers(lsq, x_train[:128])
print("learned qparams:", [n for n, _ in lsq.named_parameters() if "scale" in n])
fit(lsq, 300, 1e-3)
quantize_(lsq, QATConfig(base, step="convert"))

f, p, q, r = test_mse(model), test_mse(ptq), test_mse(qat), test_mse(lsq)
print(f"test MSE  float {f:.5f}   int2 PTQ {p:.5f}   int2 QAT {q:.5f} (fake-quantized {fake_mse:.5f})   "
      f"int2 QAT+LSQ {r:.5f}")
print(f"QAT recovered {(p - q) / (p - f):.0%} of the PTQ loss (LSQ: {(p - r) / (p - f):.0%}); "
      f"converted weight: {qat[0].weight}")
