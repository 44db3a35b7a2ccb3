"""Migrating from torch.ao.quantization to affineq: every torch.ao entry point next to its affineq equivalent.

python tutorials/migrating_from_torch_ao.py          # a few seconds; each section asserts the two agree

torch.ao.quantization is deprecated upstream. affineq keeps the model's own modules (nn.Linear stays
nn.Linear) and swaps their weights for one tensor type, `AffineQuantizedTensor`, that carries its format,
qparams and (for static quantization) calibrated activation qparams; it saves with `torch.save` /
`torch.load(weights_only=True)` or safetensors and compiles. Sections:

  1. quantize_dynamic                      -> affineq.quantize_dynamic (same call) or quantize_ + a config
  2. eager static prepare / convert        -> affineq.prepare_ / run_calibration / convert_ (no stubs)
  3. QConfigMapping, per-module qconfigs   -> affineq.FqnToConfig, or Quark's layered affineq.Config
  4. fuse_modules                          -> affineq.fuse_modules_
  5. observers                             -> affineq.observers (the same qparams, bit for bit)
  6. torch.quantize_per_tensor / _channel  -> AffineQuantizedTensor.from_torch_quantized / to_torch_quantized
"""

import copy
import warnings

import torch
from torch import nn

import affineq
from affineq import (
    AffineQuantizedTensor,
    FqnToConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    MappingType,
)
from affineq.quark import Config, Dtype, QSchemeType, QuantizationConfig, QuantizationSpec

warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.ao says it is deprecated at every call
warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
import torch.ao.quantization as tq  # noqa: E402  (after the filters)
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx  # noqa: E402

SECTIONS = ["quantize_dynamic", "static", "qconfig_mapping", "fusion", "observers", "quantized_tensors"]
SECTIONS_DONE: list[str] = []
torch.manual_seed(0)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `x` against `ref`, in dB (higher is closer)."""
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()


x = torch.randn(32, 64)

# ---------------------------------------------------------------------------------------------------------
# 1. Dynamic quantization.
#
#   torch.ao:  qmodel = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
#   affineq:   qmodel = affineq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
#
# Same signature and meaning (qconfig_spec None / a set of types / a dict of types or names -> qconfigs;
# inplace=False copies). Each qconfig maps to an affineq config; the one for default_dynamic_qconfig is
# Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor"): int8 weights (per output channel,
# where torch.ao's default is per tensor) and int8 activations quantized at run time, one scale per call.
# The same thing spelled natively is quantize_ with that config (nn.Linear is quantize_'s default filter).
# dtype=torch.quint8 / torch.quint4x2 quantize nn.Embedding / nn.EmbeddingBag per row, as torch.ao does;
# dtype=torch.float16 is refused (affineq stores no fp16 weights) with the alternatives in the message.
model = mlp()
ref = model(x)
ao_dynamic = tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
aq_dynamic = affineq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
native = affineq.quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor"))
assert torch.equal(aq_dynamic(x), native(x))  # the same config, the same numbers
assert isinstance(aq_dynamic[0].weight, AffineQuantizedTensor) and type(aq_dynamic[0]) is nn.Linear
s_ao, s_aq = sqnr(ref, ao_dynamic(x)), sqnr(ref, aq_dynamic(x))
print(f"1. quantize_dynamic   SQNR vs float: torch.ao {s_ao:.1f} dB, affineq {s_aq:.1f} dB")
assert s_aq >= s_ao - 1.0 and sqnr(ao_dynamic(x), aq_dynamic(x)) > 30

# Embedding bags, 4-bit rows (torch.quint4x2): the same dequantized table as torch.ao.
bags = nn.Sequential(nn.EmbeddingBag(100, 16, mode="sum"))
ao_bags = tq.quantize_dynamic(bags, dtype=torch.quint4x2)
aq_bags = affineq.quantize_dynamic(bags, dtype=torch.quint4x2)
torch.testing.assert_close(aq_bags[0].weight.dequantize(), ao_bags[0].weight().dequantize(), atol=1e-6, rtol=0)

# Recurrent models, the classic use: {nn.LSTM, nn.Linear}. nn.LSTM / GRU / RNN and the cells are replaced by
# affineq.recurrent twins with the same parameter names and forward (packed sequences included); the input
# projection of all timesteps is one quantized matmul and the recurrence runs in C++.
# Natively: quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, (nn.LSTM, nn.Linear))).
class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(32, 64, num_layers=2, bidirectional=True), nn.Linear(128, 10)

    def forward(self, t):
        return self.head(self.lstm(t)[0])


tagger = Tagger().eval()
words = torch.randn(20, 4, 32)
ref = tagger(words)
ao_tagger = tq.quantize_dynamic(tagger, {nn.LSTM, nn.Linear}, dtype=torch.qint8)
aq_tagger = affineq.quantize_dynamic(tagger, {nn.LSTM, nn.Linear}, dtype=torch.qint8)
assert type(aq_tagger.lstm).__name__ == "QuantizedLSTM" and aq_tagger.state_dict().keys() == tagger.state_dict().keys()
s_ao, s_aq = sqnr(ref, ao_tagger(words)), sqnr(ref, aq_tagger(words))
print(f"   LSTM tagger        SQNR vs float: torch.ao {s_ao:.1f} dB, affineq {s_aq:.1f} dB")
assert s_aq >= s_ao - 1.0
SECTIONS_DONE.append("quantize_dynamic")

# ---------------------------------------------------------------------------------------------------------
# 2. Eager-mode static quantization (calibrated int8 activations).
#
#   torch.ao: wrap the model in QuantStub / DeQuantStub, set model.qconfig, prepare, run batches, convert:
#       model.qconfig = torch.ao.quantization.get_default_qconfig("x86")
#       tq.prepare(model, inplace=True); for b in batches: model(b); tq.convert(model, inplace=True)
#   affineq: no stubs; observers go on the inputs of the selected layers (nn.Linear by default):
#       affineq.prepare_(model, Int8StaticActivationInt8WeightConfig())
#       affineq.run_calibration(model, batches); affineq.convert_(model)
#   or in one call: affineq.quantize_(model, config, calibration_data=batches).
#
# torch.ao's converted model passes quint8 tensors from layer to layer, so each layer's output is quantized
# too: quantize_output=True reproduces that (the output is calibrated and rounded to int8 as well).
batches = [torch.randn(16, 64) for _ in range(8)]


class Stubbed(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.quant, self.body, self.dequant = tq.QuantStub(), body, tq.DeQuantStub()

    def forward(self, t):
        return self.dequant(self.body(self.quant(t)))


model = mlp()
ref = model(x)
ao_static = Stubbed(copy.deepcopy(model)).eval()
ao_static.qconfig = tq.get_default_qconfig("x86")
tq.prepare(ao_static, inplace=True)
for b in batches:
    ao_static(b)
tq.convert(ao_static, inplace=True)

static = Int8StaticActivationInt8WeightConfig(quantize_output=True)
aq_static = copy.deepcopy(model)
affineq.prepare_(aq_static, static)
affineq.run_calibration(aq_static, batches, progress=False)
affineq.convert_(aq_static)
one_call = affineq.quantize_(copy.deepcopy(model), static, calibration_data=batches)
assert torch.equal(one_call(x), aq_static(x))
assert aq_static[0].weight.act_quant.static  # the calibrated qparams live on the weight, saved with it
s_ao, s_aq = sqnr(ref, ao_static(x)), sqnr(ref, aq_static(x))
print(f"2. static int8        SQNR vs float: torch.ao {s_ao:.1f} dB, affineq {s_aq:.1f} dB")
assert s_aq >= s_ao - 1.5 and sqnr(ao_static(x), aq_static(x)) > 25
SECTIONS_DONE.append("static")

# ---------------------------------------------------------------------------------------------------------
# 3. Per-module qconfigs and QConfigMapping.
#
#   torch.ao (FX):   qconfig_mapping = QConfigMapping().set_global(default_dynamic_qconfig)
#                                                      .set_module_name("2", None)          # keep float
#                    model = convert_fx(prepare_fx(model, qconfig_mapping, example_inputs))
#   torch.ao (eager): model.qconfig = ...; model[2].qconfig = None
#   affineq:          quantize_(model, FqnToConfig({"0": config, "2": None}))
#                     FqnToConfig keys: exact module names, "re:<regex>" or "_default"; None keeps float;
#                     a parameter name ("rnn.weight_ih_l0") quantizes that parameter only.
#   or AMD Quark's layered Config (global, per layer type, per name pattern, exclude), which resolves to
#   the same FqnToConfig (`config.to_fqn_config(model)` shows the plan).
model = mlp()
ref = model(x)
mapping = tq.QConfigMapping().set_global(tq.default_dynamic_qconfig).set_module_name("2", None)
ao_fx = convert_fx(prepare_fx(copy.deepcopy(model), mapping, (x,)))

dynamic = Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")
per_name = affineq.quantize_(copy.deepcopy(model), FqnToConfig({"0": dynamic, "2": None}))
layered = Config(
    global_quant_config=QuantizationConfig(
        input_tensors=QuantizationSpec(Dtype.int8, is_dynamic=True, qscheme=QSchemeType.per_tensor, symmetric=True),
        weight=QuantizationSpec(Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0, symmetric=True),
    ),
    exclude=["2"],
)
assert layered.to_fqn_config(model) == FqnToConfig({"0": dynamic})  # the same plan
by_quark = affineq.quantize_(copy.deepcopy(model), layered)
assert torch.equal(by_quark(x), per_name(x))
assert not isinstance(per_name[2].weight, AffineQuantizedTensor)  # "2" stayed float, as in torch.ao
s_ao, s_aq = sqnr(ref, ao_fx(x)), sqnr(ref, per_name(x))
print(f"3. per-module configs SQNR vs float: torch.ao FX {s_ao:.1f} dB, affineq {s_aq:.1f} dB")
assert s_aq >= s_ao - 1.0 and sqnr(ao_fx(x), per_name(x)) > 30
SECTIONS_DONE.append("qconfig_mapping")

# ---------------------------------------------------------------------------------------------------------
# 4. Module fusion.
#
#   torch.ao:  fused = torch.ao.quantization.fuse_modules(model, [["0", "1", "2"]])      # conv, bn, relu
#   affineq:   affineq.fuse_modules_(model, [["0", "1", "2"]])  # in place; fuse_modules_(model): every pattern
#
# Both fold the eval-mode BatchNorm into the conv and keep conv + ReLU together (affineq.ConvReLU, an
# nn.Sequential whose child 0 is the folded nn.Conv2d, so quantize_ still finds the conv).
cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
with torch.no_grad():  # non-trivial BatchNorm statistics
    cnn[1].running_mean.uniform_(-0.5, 0.5)
    cnn[1].running_var.uniform_(0.5, 2.0)
    cnn[1].weight.uniform_(0.5, 1.5)
cnn.eval()
img = torch.randn(2, 3, 8, 8)
ao_fused = tq.fuse_modules(copy.deepcopy(cnn), [["0", "1", "2"]])
aq_fused = copy.deepcopy(cnn)
assert affineq.fuse_modules_(aq_fused, [["0", "1", "2"]]) == [["0", "1", "2"]]
assert isinstance(aq_fused[0], affineq.fusion.ConvReLU) and isinstance(aq_fused[1], nn.Identity)
torch.testing.assert_close(aq_fused(img), cnn(img), atol=1e-5, rtol=1e-5)
torch.testing.assert_close(aq_fused(img), ao_fused(img), atol=1e-5, rtol=1e-5)
print("4. fuse_modules       folded conv+bn+relu equals the float model and torch.ao's fusion")
SECTIONS_DONE.append("fusion")

# ---------------------------------------------------------------------------------------------------------
# 5. Observers.
#
#   torch.ao:  obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
#   affineq:   obs = affineq.PerTensorMinMaxObserver(dtype=torch.uint8, eps=torch.finfo(torch.float32).eps)
#   torch.ao:  PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
#   affineq:   PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, mapping_type=MappingType.SYMMETRIC, eps=...)
#   (also MovingAverage*, a histogram, percentile and MSE observers). Same interface: obs(x) records and
#   returns x, obs.calculate_qparams() -> (scale, zero_point). torch.ao's eps reproduces its qparams exactly.
eps = torch.finfo(torch.float32).eps
pairs = [
    (tq.MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine),
     affineq.observers.PerTensorMinMaxObserver(dtype=torch.uint8, eps=eps)),
    (tq.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
     affineq.observers.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, mapping_type=MappingType.SYMMETRIC,
                                                eps=eps)),
    (tq.MovingAverageMinMaxObserver(dtype=torch.quint8, averaging_constant=0.1),
     affineq.observers.MovingAveragePerTensorMinMaxObserver(dtype=torch.uint8, averaging_constant=0.1, eps=eps)),
]
for ao_obs, aq_obs in pairs:
    for b in batches:
        ao_obs(b)
        aq_obs(b)
    (ao_scale, ao_zp), (aq_scale, aq_zp) = ao_obs.calculate_qparams(), aq_obs.calculate_qparams()
    assert torch.equal(aq_scale.flatten(), ao_scale.flatten()), type(aq_obs).__name__
    assert torch.equal(aq_zp.flatten().long(), ao_zp.flatten().long()), type(aq_obs).__name__
print("5. observers          min-max, per-channel and moving-average qparams equal torch.ao's bit for bit")
SECTIONS_DONE.append("observers")

# ---------------------------------------------------------------------------------------------------------
# 6. torch's quantized tensors.
#
#   torch:    qt = torch.quantize_per_tensor(w, scale, zero_point, torch.qint8)   (or quantize_per_channel)
#   affineq:  aqt = AffineQuantizedTensor.from_torch_quantized(qt)   # same codes, same dequantize(), bit for bit
#             qt2 = aqt.to_torch_quantized()                         # and back
#   affineq.quantize_affine(w, block_size, scale, zero_point, torch.int8) gives the same codes directly.
w = torch.randn(16, 32)
for qt in (torch.quantize_per_tensor(w, 0.02, 3, torch.qint8),
           torch.quantize_per_channel(w, w.abs().amax(1).double() / 127, torch.zeros(16, dtype=torch.long), 0,
                                      torch.qint8)):
    aqt = AffineQuantizedTensor.from_torch_quantized(qt)
    assert torch.equal(aqt.codes(), qt.int_repr()) and torch.equal(aqt.dequantize(), qt.dequantize())
    back = aqt.to_torch_quantized()
    assert back.qscheme() == qt.qscheme() and torch.equal(back.int_repr(), qt.int_repr())
codes = affineq.primitives.quantize_affine(w, (16, 32), torch.tensor([0.02]), torch.tensor([3]), torch.int8)
assert torch.equal(codes, torch.quantize_per_tensor(w, 0.02, 3, torch.qint8).int_repr())
print("6. quantized tensors  from_torch_quantized / to_torch_quantized: the same codes and dequantize()")
SECTIONS_DONE.append("quantized_tensors")

assert SECTIONS_DONE == SECTIONS
print("all sections agree with torch.ao")
