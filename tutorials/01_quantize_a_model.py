"""Quantize a small MLP three ways, check accuracy, see which kernel runs, save and reload.

python tutorials/01_quantize_a_model.py
"""

import copy
import io

import torch
from torch import nn

import affineq
from affineq import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup, quantize_

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).eval()
x = torch.randn(4, 1024)
with torch.inference_mode():
    ref = model(x)

for config in [
    Int8WeightOnlyConfig(),
    Int4WeightOnlyConfig(group_size=128),
    IntxWeightOnlyConfig(torch.int3, PerGroup(32)),
]:
    q = quantize_(copy.deepcopy(model), config)
    with torch.inference_mode(), affineq.record_kernels() as used:
        out = q(x)
    err = (out - ref).pow(2).mean() / ref.pow(2).mean()
    w = q[0].weight
    print(
        f"{type(config).__name__:<24} SQNR {-10 * torch.log10(err):5.1f} dB   "
        f"{w.storage_bytes() / w.numel():.3f} B/param   kernel: {used[0]}"
    )

# Save the quantized state dict; a fresh float model takes it with assign=True.
q = quantize_(copy.deepcopy(model), Int4WeightOnlyConfig(group_size=128))
buf = io.BytesIO()
torch.save(q.state_dict(), buf)
buf.seek(0)
fresh = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
with torch.inference_mode():
    print("reloaded model matches:", torch.equal(fresh(x), q(x)))
print(fresh[0].weight)
