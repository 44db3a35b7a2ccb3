"""Per-layer configs with FqnToConfig, and what quantize_ says when a config cannot apply.

python tutorials/02_per_layer_configs_and_errors.py
"""

from torch import nn

from affineq import FqnToConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig, QuantizationError, quantize_


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(576, 576)  # SmolLM2's hidden size: 128 does not divide 576
        self.up_proj = nn.Linear(576, 1536)
        self.down_proj = nn.Linear(1536, 576)


try:
    quantize_(Block(), Int4WeightOnlyConfig(group_size=128))
except QuantizationError as e:
    print(e, "\n")

model = quantize_(
    Block(),
    FqnToConfig(
        {
            "down_proj": Int4WeightOnlyConfig(group_size=128),  # 1536 = 12 * 128
            "re:.*_proj": Int4WeightOnlyConfig(group_size=64),  # the rest: 576 = 9 * 64
        }
    ),
)
for name, p in model.named_parameters():
    if name.endswith("weight"):
        print(f"{name:<18} {p.block_size} {p.packing_format}")
model = quantize_(Block(), FqnToConfig({"q_proj": None, "_default": Int8WeightOnlyConfig()}))
print("q_proj left float:", type(model.q_proj.weight).__name__)
