"""Quantized nn.LSTM / GRU / RNN and their cells through quantize_ (affineq/recurrent.py, cpp/recurrent.cpp)."""

import copy
import dataclasses
import warnings

import pytest
import torch
from conftest import save_load, sqnr
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import affineq
import affineq.recurrent as R
from affineq import (
    AffineQuantizedTensor,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    PerGroup,
    QuantizationError,
    quantize_,
)

RECURRENT = lambda m, fqn: isinstance(m, R.RECURRENT_TYPES)  # noqa: E731

FULL = {
    "lstm": lambda: nn.LSTM(32, 64, num_layers=2, bidirectional=True),
    "gru": lambda: nn.GRU(32, 64, num_layers=2, bidirectional=True),
}
CELLS = {
    "lstm_cell": lambda: nn.LSTMCell(32, 64),
    "gru_cell": lambda: nn.GRUCell(32, 64),
    "rnn_cell": lambda: nn.RNNCell(32, 64),
}


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _flat(out) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in _leaves(out)])


def _inputs(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    if isinstance(module, nn.RNNCellBase):
        return (torch.randn(8, 32, generator=g),)
    return (torch.randn(12, 4, 32, generator=g),)


def _ao_dynamic(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {type(model[0])}, dtype=torch.qint8)


# -- the twin computes what the float module computes ---------------------------------------------------


@pytest.mark.parametrize("make, args", [
    (lambda: nn.LSTM(10, 16, num_layers=2, bidirectional=True), "x"),
    (lambda: nn.LSTM(10, 16, num_layers=2, bidirectional=True, proj_size=5), "x,hproj"),
    (lambda: nn.LSTM(10, 16, num_layers=2, bidirectional=True, proj_size=5), "packed,hproj"),
    (lambda: nn.LSTM(10, 16, batch_first=True, bias=False), "x"),
    (lambda: nn.LSTM(10, 16), "unbatched"),
    (lambda: nn.GRU(10, 16, num_layers=3, bidirectional=True), "packed"),
    (lambda: nn.GRU(10, 16, num_layers=2), "x,h"),
    (lambda: nn.RNN(10, 16, num_layers=2, nonlinearity="relu", bidirectional=True), "x"),
    (lambda: nn.LSTMCell(10, 16), "cell"),
    (lambda: nn.LSTMCell(10, 16, bias=False), "cell,hc"),
    (lambda: nn.GRUCell(10, 16), "cell,h"),
    (lambda: nn.RNNCell(10, 16, nonlinearity="relu"), "cell1d"),
])
def test_float_twin_matches_torch(make, args):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(7, 3, 10)
    layers = getattr(module, "num_layers", 1) * (2 if getattr(module, "bidirectional", False) else 1)
    call = {
        "x": (x,), "unbatched": (x[:, 0],), "cell": (x[0],), "cell1d": (x[0, 0],),
        "packed": (pack_padded_sequence(x, torch.tensor([7, 3, 5]), enforce_sorted=False),),
    }[args.split(",")[0]]
    extra = args.split(",")[1:]
    if "hproj" in extra:
        call += ((torch.randn(layers, 3, 5), torch.randn(layers, 3, 16)),)
    elif "h" in extra:
        call += (torch.randn(layers, 3, 16),)
    elif "hc" in extra:
        call += ((torch.randn(3, 16), torch.randn(3, 16)),)
    if "h" in extra and isinstance(module, nn.RNNCellBase):
        call = (call[0], torch.randn(3, 16))
    twin = R.quantized_twin(module)
    assert type(twin).__name__ == "Quantized" + type(module).__name__
    with torch.no_grad():
        ref, out = module(*call), twin(*call)
    assert type(out) is type(ref)
    for a, b in zip(_leaves(ref), _leaves(out), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    if args.startswith("packed"):
        assert torch.equal(out[0].batch_sizes, ref[0].batch_sizes)
        assert torch.equal(out[0].unsorted_indices, ref[0].unsorted_indices)


# -- accuracy against float and torch.ao -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(FULL) + list(CELLS))
def test_int8_dynamic_sqnr_and_torch_ao(name):
    torch.manual_seed(0)
    model = nn.Sequential({**FULL, **CELLS}[name]()).eval()
    x = _inputs(model[0])
    q = quantize_(copy.deepcopy(model), Int8DynamicActivationInt8WeightConfig(), filter_fn=RECURRENT)
    ao = _ao_dynamic(model)
    with torch.no_grad():
        ref, out, ao_out = _flat(model(*x)), _flat(q(*x)), _flat(ao(*x))
    ours, theirs = sqnr(ref, out), sqnr(ref, ao_out)
    assert ours >= 30, f"{name}: {ours:.1f} dB"
    assert ours >= theirs - 1, f"{name}: affineq {ours:.1f} dB, torch.ao {theirs:.1f} dB"
    assert isinstance(q[0].weight_hh if hasattr(q[0], "weight_hh") else q[0].weight_hh_l0, AffineQuantizedTensor)


@pytest.mark.parametrize("name", list(FULL) + list(CELLS))
def test_int4_weight_only_sqnr(name):
    torch.manual_seed(0)
    model = nn.Sequential({**FULL, **CELLS}[name]()).eval()
    x = _inputs(model[0])
    q = quantize_(copy.deepcopy(model), Int4WeightOnlyConfig(group_size=32), filter_fn=RECURRENT)
    with torch.no_grad():
        assert sqnr(_flat(model(*x)), _flat(q(*x))) >= 15


def test_every_weight_config_quantizes_every_matrix():
    model = nn.Sequential(nn.LSTM(32, 64, num_layers=2, bidirectional=True, proj_size=16))
    for config in (Int8WeightOnlyConfig(), IntxWeightOnlyConfig(torch.int5, PerGroup(16)),
                   Int4WeightOnlyConfig(group_size=16), Int8DynamicActivationInt8WeightConfig()):
        q = quantize_(copy.deepcopy(model), config, filter_fn=RECURRENT)
        names = [n for n, p in q.named_parameters() if isinstance(p, AffineQuantizedTensor)]
        assert names == [n for n, _ in model.named_parameters() if ".weight_" in n]  # ih, hh and hr, biases float
        assert list(q.state_dict()) == list(model.state_dict())
        with torch.no_grad():
            out, (h, c) = q[0](torch.randn(5, 2, 32))
        assert out.shape == (5, 2, 32) and h.shape == (4, 2, 16) and c.shape == (4, 2, 64)


# -- the C++ recurrence -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [Int8DynamicActivationInt8WeightConfig(packing_format="dense"),
                                    Int4WeightOnlyConfig(group_size=16), Int8WeightOnlyConfig()],
                         ids=["int8dyn", "int4", "int8wo"])
@pytest.mark.parametrize("make", [lambda: nn.LSTM(16, 32, 2, bidirectional=True), lambda: nn.GRU(16, 32, 2),
                                  lambda: nn.RNN(16, 32, nonlinearity="relu", bidirectional=True),
                                  lambda: nn.LSTMCell(16, 32), lambda: nn.GRUCell(16, 32)])
def test_cpp_recurrence_matches_the_python_loop(make, config, monkeypatch):
    if not affineq.cpp.is_available():
        pytest.skip(f"the affineq C++ kernels are unavailable here: {affineq.cpp.unavailable_reason()}")
    torch.manual_seed(0)
    q = quantize_(nn.Sequential(make()), config, filter_fn=RECURRENT)
    x = torch.randn(9, 3, 16)
    inputs = [(x[0],)] if isinstance(make(), nn.RNNCellBase) else [
        (x,), (pack_padded_sequence(x, torch.tensor([9, 4, 6]), enforce_sorted=False),)]
    for args in inputs:
        with torch.no_grad(), affineq.record_kernels() as used:
            fused = _flat(q(*args))
        assert "affineq.lowbit_rnn_layer" in used
        monkeypatch.setattr(R, "_fused_ok", lambda *a: False)
        with torch.no_grad(), affineq.record_kernels() as used:
            loop = _flat(q(*args))
        monkeypatch.undo()
        assert "affineq.lowbit_rnn_layer" not in used
        if config.__class__ is Int8DynamicActivationInt8WeightConfig:
            # h is re-quantized every step: a 1e-7 difference of the fused sigmoid may flip one int8 code
            assert sqnr(loop, fused) > 55
        else:
            torch.testing.assert_close(fused, loop, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(group_size=16, compute_dtype=torch.bfloat16),
                                    Int8WeightOnlyConfig(compute_dtype=torch.bfloat16),
                                    Float8WeightOnlyConfig(compute_dtype=torch.bfloat16)],
                         ids=["int4", "int8", "float8"])
def test_cpp_recurrence_computes_in_the_weights_compute_dtype(config, monkeypatch):
    """compute_dtype=bf16 reaches the recurrent product too: h rounded to bf16, the product's bf16 values. A relu RNN
    without biases adds in the same order on both routes, so the fused recurrence equals the Python loop (each step
    through F.linear, i.e. lowbit_linear_bf16_compute) bit for bit, over steps of 3, 2 and 1 rows (the bf16
    kernels' own rounding and the fp32 kernels on bf16 values, rounded after)."""
    if not affineq.cpp.is_available():
        pytest.skip(f"the affineq C++ kernels are unavailable here: {affineq.cpp.unavailable_reason()}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.RNN(16, 32, nonlinearity="relu", bias=False, bidirectional=True))
    q = quantize_(copy.deepcopy(model), config, filter_fn=RECURRENT)
    exact = quantize_(copy.deepcopy(model), dataclasses.replace(config, compute_dtype=None), filter_fn=RECURRENT)
    x = torch.randn(9, 3, 16)
    for args in [(x,), (pack_padded_sequence(x, torch.tensor([9, 4, 6]), enforce_sorted=False),)]:
        with torch.no_grad(), affineq.record_kernels() as used:
            fused = _flat(q(*args))
            fused_exact = _flat(exact(*args))
        assert "affineq.lowbit_rnn_layer" in used
        monkeypatch.setattr(R, "_fused_ok", lambda *a: False)
        with torch.no_grad():
            loop = _flat(q(*args))
        monkeypatch.undo()
        assert torch.equal(fused, loop)
        assert 25 < sqnr(fused_exact, fused) < 60  # bf16 rounding: neither exact nor far off


def test_cpp_recurrence_refuses_bf16_compute_with_int8_h():
    if not affineq.cpp.is_available():
        pytest.skip(f"the affineq C++ kernels are unavailable here: {affineq.cpp.unavailable_reason()}")
    h = torch.zeros(1, 8)
    packed = torch.zeros(8 * 8 // 8 * 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="bf16_compute is for float h"):
        torch.ops.affineq.lowbit_rnn_layer_bf16_compute(torch.zeros(1, 8), [1], h, None, None, packed,
                                                        torch.ones(8, 1), None, 8, 8, 0, -128, 0, True, 1e-5, 2, False)


def test_gradient_flows_to_the_input():
    q = quantize_(nn.Sequential(nn.GRU(16, 32)), Int8WeightOnlyConfig(), filter_fn=RECURRENT)
    x = torch.randn(5, 2, 16, requires_grad=True)
    out, _ = q(x)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


# -- save / load / compile ----------------------------------------------------------------------------------


def test_state_dict_round_trip_weights_only_is_exact():
    torch.manual_seed(0)
    config = Int4WeightOnlyConfig(group_size=32)
    model = quantize_(nn.Sequential(nn.LSTM(32, 64, 2, bidirectional=True), nn.LSTMCell(32, 64)), config,
                      filter_fn=RECURRENT)
    sd = save_load(model.state_dict())  # torch.load(weights_only=True)
    other = quantize_(nn.Sequential(nn.LSTM(32, 64, 2, bidirectional=True), nn.LSTMCell(32, 64)), config,
                      filter_fn=RECURRENT)
    other.load_state_dict(sd)
    x = torch.randn(6, 3, 32)
    with torch.no_grad():
        assert torch.equal(_flat(other[0](x)), _flat(model[0](x)))
        assert torch.equal(_flat(other[1](x[0])), _flat(model[1](x[0])))


def test_compile_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    q = quantize_(nn.Sequential(nn.LSTM(16, 32, bidirectional=True)),
                  Int8DynamicActivationInt8WeightConfig(), filter_fn=RECURRENT)
    x = torch.randn(6, 2, 16)
    with torch.no_grad():
        eager = _flat(q(x))
        compiled = _flat(torch.compile(q, fullgraph=True)(x))
    assert sqnr(eager, compiled) > 55


# -- selection and errors -----------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_default_filter_leaves_recurrent_modules_float():
    net = quantize_(_Net(), Int8WeightOnlyConfig())
    assert type(net.rnn) is nn.LSTM and isinstance(net.head.weight, AffineQuantizedTensor)


def test_fqn_parameter_key_quantizes_one_matrix():
    net = quantize_(_Net(), FqnToConfig({"rnn.weight_hh_l0": Int8WeightOnlyConfig()}))
    assert isinstance(net.rnn, R.QuantizedLSTM)
    assert isinstance(net.rnn.weight_hh_l0, AffineQuantizedTensor)
    assert not isinstance(net.rnn.weight_ih_l0, AffineQuantizedTensor)
    assert net(torch.randn(2, 5, 16)).shape == (2, 4)


def test_fqn_module_key_swaps_the_module():
    net = quantize_(_Net(), FqnToConfig({"rnn": Int4WeightOnlyConfig(group_size=16)}))
    assert isinstance(net.rnn, R.QuantizedLSTM) and not isinstance(net.head.weight, AffineQuantizedTensor)
    assert "QuantizedLSTM(16, 32, num_layers=1, batch_first=True)" in repr(net)


def test_root_recurrent_module_is_refused_unchanged():
    lstm = nn.LSTM(16, 32)
    before = {n: p for n, p in lstm.named_parameters()}
    with pytest.raises(QuantizationError, match=r"root module.*nn.Sequential\(module\)"):
        quantize_(lstm, Int8WeightOnlyConfig(), filter_fn=RECURRENT)
    assert {n: p for n, p in lstm.named_parameters()} == before


def test_static_activation_config_is_refused_with_the_alternative():
    with pytest.raises(QuantizationError, match="Int8DynamicActivationInt8WeightConfig"):
        quantize_(_Net(), Int8StaticActivationInt8WeightConfig(), filter_fn=RECURRENT,
                  calibration_data=[torch.randn(2, 5, 16)])


def test_subclass_is_refused():
    class MyLSTM(nn.LSTM):
        pass

    net = _Net()
    net.rnn = MyLSTM(16, 32, batch_first=True)
    with pytest.raises(QuantizationError, match="subclass of LSTM"):
        quantize_(net, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.LSTM))
    assert type(net.rnn) is MyLSTM and not isinstance(net.rnn.weight_ih_l0, AffineQuantizedTensor)


def test_bad_group_size_names_the_matrix():
    with pytest.raises(QuantizationError, match="group_size=64 does not divide"):
        quantize_(_Net(), Int4WeightOnlyConfig(group_size=64), filter_fn=RECURRENT)


def test_bad_state_shapes_are_explained():
    q = quantize_(nn.Sequential(nn.LSTM(16, 32, 2)), Int8WeightOnlyConfig(), filter_fn=RECURRENT)[0]
    x = torch.randn(5, 3, 16)
    with pytest.raises(ValueError, match=r"h_0 must have shape .* = \(2, 3, 32\), got \(1, 3, 32\)"):
        q(x, (torch.zeros(1, 3, 32), torch.zeros(2, 3, 32)))
    with pytest.raises(ValueError, match=r"hx must be a tuple \(h_0, c_0\)"):
        q(x, torch.zeros(2, 3, 32))
    with pytest.raises(ValueError, match="input_size=16"):
        q(torch.randn(5, 3, 8))


def test_packed_output_unpacks_like_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.GRU(16, 32, bidirectional=True, batch_first=True))
    q = quantize_(copy.deepcopy(model), Int8WeightOnlyConfig(), filter_fn=RECURRENT)
    x = torch.randn(3, 7, 16)
    packed = pack_padded_sequence(x, torch.tensor([4, 7, 2]), batch_first=True, enforce_sorted=False)
    with torch.no_grad():
        (ref, ref_len), (out, out_len) = (pad_packed_sequence(m[0](packed)[0], batch_first=True) for m in (model, q))
    assert torch.equal(ref_len, out_len)
    assert out[0, 4:].abs().sum() == 0 and out[2, 2:].abs().sum() == 0  # padding stays zero
    assert sqnr(ref, out) > 35
