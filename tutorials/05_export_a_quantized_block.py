"""Export a quantized SmolLM2 decoder block with torch.export, save it, load it, run it, compare with eager.

python tutorials/05_export_a_quantized_block.py            # export, save, load, run (~10 s)
python tutorials/05_export_a_quantized_block.py --aoti     # also compile it ahead of time with AOTInductor

Uses SmolLM2-135M's first decoder block (`pip install "affineq[models]"` provides it offline); without it, a
block of affineq's seeded TinyLM. The exported program keeps affineq's packed kernels as graph ops
(`affineq.lowbit_linear` for int4; for 8da4w on CPU `affineq.int8_codes_linear` where the build has VNNI + VBMI,
else `affineq.lowbit_linear` after `affineq.int8_fake_quant`), not a dequantize-then-matmul.
"""

import argparse
import collections
import os
import tempfile

import torch
from torch import nn

import affineq
from affineq.models import available_models, build_tiny_lm, load_smollm2

parser = argparse.ArgumentParser()
parser.add_argument("--aoti", action="store_true", help="also compile with AOTInductor (~30 s on 2 cores)")
args = parser.parse_args()
torch.manual_seed(0)


class SmolLM2Block(nn.Module):
    """One LlamaDecoderLayer with its rotary embedding: hidden states [B, S, 576] -> [B, S, 576] (causal)."""

    def __init__(self, model: nn.Module, index: int = 0):
        super().__init__()
        self.layer = model.model.layers[index]
        self.rotary = model.model.rotary_emb

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        out = self.layer(h, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


if available_models()["smollm2"]:
    block, name = SmolLM2Block(load_smollm2()[0]).eval(), "SmolLM2-135M block 0"
else:  # no model package installed: the same steps on a TinyLM block
    block, name = build_tiny_lm().layers[0].eval(), "TinyLM block 0 (SmolLM2 not installed)"
dim = next(m for m in block.modules() if isinstance(m, nn.Linear)).in_features

# 1. Quantize: int4 weights (group 64) for attention, 8da4w (int8 dynamic activations x int4 weights) for the MLP.
affineq.quantize_(block, affineq.FqnToConfig({
    r"re:.*self_attn\..*": affineq.Int4WeightOnlyConfig(group_size=64),
    "_default": affineq.Int8DynamicActivationInt4WeightConfig(group_size=32),
}))
h = torch.randn(2, 16, dim)
with torch.no_grad(), affineq.record_kernels() as used:
    ref = block(h)
print(f"{name}: eager kernels {collections.Counter(used)}")

# 2. Export with a dynamic batch and sequence length (seq >= 2: attention is causal for S > 1).
batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", min=2, max=2048)
with torch.no_grad():
    ep = torch.export.export(block, (h,), dynamic_shapes=({0: batch, 1: seq},))
ops = collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
print("packed ops in the graph:", {op: n for op, n in ops.items() if "affineq" in op or "_mm" in op})
print("float matmuls in the graph:", {op: n for op, n in ops.items() if op in ("aten.linear.default",
                                                                               "aten.mm.default")} or "none")

# 3. Save, load (another process would `import affineq` first: it registers the ops), run at a new shape.
path = os.path.join(tempfile.mkdtemp(), "block.pt2")
torch.export.save(ep, path)
loaded = torch.export.load(path)
print(f"saved {os.path.getsize(path) / 1e6:.1f} MB to {path}")
h2 = torch.randn(3, 40, dim)
with torch.no_grad():
    same = torch.equal(loaded.module()(h), ref) and torch.equal(loaded.module()(h2), block(h2))
print("loaded program equals eager (batch 2 x seq 16, batch 3 x seq 40):", same)
assert same

# 4. Optional: AOTInductor compiles the program to a shared library in a .pt2 package.
if args.aoti:
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(os.path.dirname(path), "aoti.pt2"))
    runner = torch._inductor.aoti_load_package(pkg)
    with torch.no_grad():
        out, want = runner(h2), block(h2)
    # Not bit-exact here: inductor fuses the float ops around the packed kernels (RMSNorm, rotary, attention),
    # which moves some values by an ulp, and an int8 activation code near a rounding boundary can then flip.
    rel = ((out - want).norm() / want.norm()).item()
    print(f"AOTInductor package {pkg}: relative error vs eager {rel:.2e}, "
          f"max |diff| {(out - want).abs().max().item():.3g} (output max {want.abs().max().item():.3g})")
    assert rel < 2e-3
