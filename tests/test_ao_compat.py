"""affineq.quantize_dynamic (torch.ao's signature and meaning), its qconfig mapping, F.embedding_bag on
quantized weights, and the torch.ao migration tutorial."""

import copy
import io
import runpy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import affineq
from affineq import (
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MappingType,
    PerAxis,
    QuantizationError,
    ZeroPointDomain,
    quantize_dynamic,
)
from affineq.ao_compat import config_for_dtype, config_for_qconfig
from affineq.tensor.affine import AffineQuantizedTensor as AQT

with warnings.catch_warnings():  # torch.ao.quantization is deprecated; we compare against it on purpose
    warnings.simplefilter("ignore")
    import torch.ao.quantization as tq

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "migrating_from_torch_ao.py"


def ao_quantize_dynamic(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.quantize_dynamic(*args, **kwargs)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


def is_q(p) -> bool:
    return isinstance(p, AQT)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.emb = nn.Embedding(50, 32)
        self.bag = nn.EmbeddingBag(50, 32, mode="sum")
        self.head = nn.Linear(32, 8)

    def forward(self, x, ids, bag_ids, offsets):
        return self.head(self.block(x) + self.emb(ids) + self.bag(bag_ids, offsets))


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


def inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4, 32, generator=g), torch.randint(0, 50, (4,), generator=g),
            torch.randint(0, 50, (12,), generator=g), torch.tensor([0, 3, 7, 9]))


def quantized(model) -> set[str]:
    return {n for n, p in model.named_parameters() if is_q(p)}


# -- semantics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,expected,target", [
    (torch.qint8, {"block.0.weight", "block.2.weight", "head.weight"}, torch.int8),
    (torch.quint8, {"emb.weight", "bag.weight"}, torch.uint8),
    (torch.quint4x2, {"bag.weight"}, torch.uint4),
])
def test_none_uses_torch_ao_default_types_per_dtype(net, dtype, expected, target):
    before = copy.deepcopy(net.state_dict())
    q = quantize_dynamic(net, dtype=dtype)
    assert q is not net and quantized(q) == expected
    assert all(q.get_parameter(n).spec.target_dtype == target for n in expected)
    assert not quantized(net) and all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    # torch.ao quantizes the same modules
    ao = ao_quantize_dynamic(net, dtype=dtype)
    swapped = {n for n, m in ao.named_modules() if type(m).__module__.startswith("torch.ao.nn")
               and "_packed_params" not in n}
    assert swapped == {n.rsplit(".", 1)[0] for n in expected}


def test_set_of_types_maps_to_int8_dynamic_per_tensor_activations(net):
    q = quantize_dynamic(net, {nn.Linear}, dtype=torch.qint8)
    assert quantized(q) == {"block.0.weight", "block.2.weight", "head.weight"}
    spec = q.head.weight.spec
    assert spec.act_quant is not None and spec.act_quant.granularity == affineq.granularity.PerTensor()
    assert spec.act_quant.dtype == affineq.dtypes.qtype(torch.int8) and spec.block_size == (1, 32)  # per output channel
    assert not q.training


def test_dict_of_types_with_qconfigs(net):
    q = quantize_dynamic(net, {nn.Linear: tq.per_channel_dynamic_qconfig,
                               nn.EmbeddingBag: tq.float_qparams_weight_only_qconfig_4bit})
    assert quantized(q) == {"block.0.weight", "block.2.weight", "head.weight", "bag.weight"}
    assert q.bag.weight.spec.target_dtype == torch.uint4 and q.head.weight.spec.act_quant is not None
    # dtypes are accepted as dict values too
    q2 = quantize_dynamic(net, {nn.Embedding: torch.quint8, "head": torch.qint8})
    assert quantized(q2) == {"emb.weight", "head.weight"}


def test_dict_of_names_propagates_to_children_and_names_beat_types(net):
    q = quantize_dynamic(net, {"block": tq.default_dynamic_qconfig, "block.2": None})
    assert quantized(q) == {"block.0.weight"}
    q = quantize_dynamic(net, {nn.Linear: tq.default_dynamic_qconfig, "head": None})
    assert quantized(q) == {"block.0.weight", "block.2.weight"}
    ao = ao_quantize_dynamic(net, {nn.Linear: tq.default_dynamic_qconfig, "head": None})
    assert type(ao.head) is nn.Linear and type(ao.block[0]) is not nn.Linear
    # a parent's type passes its qconfig down, as torch.ao's propagate_qconfig_ does
    q = quantize_dynamic(net, {nn.Sequential: tq.default_dynamic_qconfig})
    assert quantized(q) == {"block.0.weight", "block.2.weight"}


def test_module_qconfig_attribute_wins(net):
    net.head.qconfig = None
    assert quantized(quantize_dynamic(net, {nn.Linear})) == {"block.0.weight", "block.2.weight"}


def test_types_match_exactly_no_subclasses():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(8, 8), nn.Linear(8, 8))
    assert quantized(quantize_dynamic(model, {nn.Linear})) == {"1.weight"}
    ao = ao_quantize_dynamic(model, {nn.Linear})
    assert type(ao[0]) is MyLinear


def test_inplace_quantizes_the_model_itself(net):
    net.train()
    q = quantize_dynamic(net, {nn.Linear}, inplace=True)
    assert q is net and "head.weight" in quantized(net) and not net.training


def test_root_module_is_quantized():
    lin = nn.Linear(16, 4)
    q = quantize_dynamic(lin)
    assert is_q(q.weight) and not is_q(lin.weight)


def test_nothing_matched_warns(net):
    with pytest.warns(UserWarning, match="no module matched"):
        q = quantize_dynamic(net, {nn.LayerNorm: None})
    assert not quantized(q)


# -- the qconfig mapping ---------------------------------------------------------------------------------


def test_config_for_qconfig():
    dyn = Int8DynamicActivationInt8WeightConfig(act_granularity="per_tensor")
    assert config_for_qconfig(tq.default_dynamic_qconfig) == dyn
    assert config_for_qconfig(tq.per_channel_dynamic_qconfig, nn.Linear) == dyn
    floatq = dict(granularity=PerAxis(0), mapping_type=MappingType.ASYMMETRIC,
                  zero_point_domain=ZeroPointDomain.FLOAT, scale_dtype=torch.float32)
    assert config_for_qconfig(tq.float_qparams_weight_only_qconfig, nn.Embedding) == \
        IntxWeightOnlyConfig(weight_dtype=torch.uint8, **floatq)
    assert config_for_qconfig(tq.float_qparams_weight_only_qconfig_4bit, nn.EmbeddingBag) == \
        IntxWeightOnlyConfig(weight_dtype=torch.uint4, **floatq)
    weight_only = tq.QConfig(activation=tq.PlaceholderObserver, weight=tq.default_weight_observer)
    assert config_for_qconfig(weight_only, nn.Linear) == Int8WeightOnlyConfig()
    assert config_for_dtype(torch.qint8, nn.GRU) == dyn
    assert config_for_dtype(torch.quint4x2, nn.Embedding) == IntxWeightOnlyConfig(weight_dtype=torch.uint4, **floatq)


def test_config_for_qconfig_refusals():
    axis1 = tq.QConfig(activation=tq.default_dynamic_quant_observer,
                       weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, ch_axis=1,
                                                                    qscheme=torch.per_channel_symmetric))
    with pytest.raises(ValueError, match="ch_axis=0"):
        config_for_qconfig(axis1, nn.Linear)
    with pytest.raises(ValueError, match="where.*not a torch.ao qconfig"):
        config_for_qconfig(torch.qint8, nn.Linear, where="where")
    with pytest.raises(ValueError, match="cannot quantize nn.Conv2d"):
        config_for_qconfig(tq.default_dynamic_qconfig, nn.Conv2d)
    with pytest.raises(ValueError, match="dtype=torch.float16: affineq stores no float16 weights"):
        config_for_dtype(torch.float16, nn.Linear)


@pytest.mark.parametrize("call,match", [
    (lambda m: quantize_dynamic(m, dtype=torch.float16), "float16.*Float8WeightOnlyConfig"),
    (lambda m: quantize_dynamic(m, {nn.Linear: tq.float16_dynamic_qconfig}), r"qconfig_spec\[nn.Linear\].*float16"),
    (lambda m: quantize_dynamic(m, dtype=torch.int32), "dtype=torch.int32.*torch.qint8"),
    (lambda m: quantize_dynamic(m, dtype="qint8"), "dtype='qint8' must be a torch dtype"),
    (lambda m: quantize_dynamic(m, {nn.Linear: tq.default_qconfig}), "static.*Int8StaticActivationInt8WeightConfig"),
    (lambda m: quantize_dynamic(m, {nn.Conv2d}), r"cannot quantize \['nn.Conv2d'\]"),
    (lambda m: quantize_dynamic(m, {"blokc": tq.default_dynamic_qconfig}), r"does not have: \['blokc'\]"),
    (lambda m: quantize_dynamic(m, {"block.1": tq.default_dynamic_qconfig}), r"cannot quantize 'block.1'.*ReLU"),
    (lambda m: quantize_dynamic(m, {nn.Embedding: tq.default_dynamic_qconfig}), "float_qparams_weight_only_qconfig"),
    (lambda m: quantize_dynamic(m, {nn.Linear}, dtype=torch.quint8), "torch.qint8 for Linear"),
    (lambda m: quantize_dynamic(m, {"head": "int8"}), "not a torch.ao qconfig"),
    (lambda m: quantize_dynamic(m, [nn.Linear]), "must be None, a set of module types or a dict"),
    (lambda m: quantize_dynamic(m, {nn.Linear}, mapping={nn.Linear: nn.Linear}), "custom mapping"),
    (lambda m: quantize_dynamic(m, {nn.Linear}, inplace=1), "inplace must be True or False"),
])
def test_refusals_name_the_parameter_and_change_nothing(net, call, match):
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        call(net)
    assert not quantized(net) and all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_default_mapping_subset_restricts_types(net):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization.quantization_mappings import get_default_dynamic_quant_module_mappings
    mapping = {nn.Linear: get_default_dynamic_quant_module_mappings()[nn.Linear]}
    assert quantized(quantize_dynamic(net, {"block": tq.default_dynamic_qconfig}, mapping=mapping)) == \
        {"block.0.weight", "block.2.weight"}


def test_all_or_nothing_when_quantize_fails(net):
    torch.nn.utils.parametrizations.weight_norm(net.head)  # quantize_ refuses a parametrized weight
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(QuantizationError, match="(?s)quantize_dynamic: .*head.*parametrized"):
        quantize_dynamic(net, {nn.Linear}, inplace=True)
    assert not quantized(net) and all(torch.equal(before[k], v) for k, v in net.state_dict().items())


# -- numerics vs torch.ao --------------------------------------------------------------------------------


def test_linear_int8_numerics_match_torch_ao():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(16, 64)
    ref = model(x)
    ours = quantize_dynamic(model, {nn.Linear})(x)
    theirs = ao_quantize_dynamic(model, {nn.Linear})(x)
    s_ours, s_theirs = sqnr(ref, ours), sqnr(ref, theirs)
    # per-channel weights and 8-bit activations: at least as accurate, and not a different answer
    assert s_theirs > 30 and s_ours >= s_theirs - 1.0, (s_ours, s_theirs)
    assert sqnr(theirs, ours) > 30


@pytest.mark.parametrize("dtype", [torch.quint8, torch.quint4x2])
def test_embedding_bag_numerics_match_torch_ao(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(100, 32, mode="sum"))
    ours, theirs = quantize_dynamic(model, dtype=dtype), ao_quantize_dynamic(model, dtype=dtype)
    # same per-row float qparams: the dequantized tables agree to float rounding
    torch.testing.assert_close(ours[0].weight.dequantize(), theirs[0].weight().dequantize(), atol=1e-6, rtol=0)
    ids, offsets = torch.randint(0, 100, (40,)), torch.tensor([0, 7, 20, 33])
    out = ours[0](ids, offsets)
    ref = F.embedding_bag(ids, theirs[0].weight().dequantize(), offsets, mode="sum")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # torch.ao's 4-bit kernel keeps fp16 row scale/bias (not its dequantize()'s fp32): 1e-2 off in a sum of 13 rows
    torch.testing.assert_close(out, theirs[0](ids, offsets), atol=1e-5 if dtype == torch.quint8 else 1e-2, rtol=0)


def test_embedding_numerics_match_torch_ao():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32))
    ours, theirs = quantize_dynamic(model, dtype=torch.quint8), ao_quantize_dynamic(model, dtype=torch.quint8)
    ids = torch.randint(0, 100, (3, 9))
    torch.testing.assert_close(ours(ids), theirs(ids), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rnn_type", [nn.LSTM, nn.GRU])
def test_recurrent_modules_by_exact_name(rnn_type):
    torch.manual_seed(0)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn_type(16, 32, batch_first=True)
            self.fc = nn.Linear(32, 4)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    model, x = Seq(), torch.randn(2, 5, 16)
    ref = model(x)
    q = quantize_dynamic(model, {rnn_type, nn.Linear}, dtype=torch.qint8)
    assert is_q(q.fc.weight) and any(is_q(p) for p in q.rnn.parameters())
    assert {n for n, _ in q.rnn.named_parameters()} == {n for n, _ in model.rnn.named_parameters()}
    theirs = ao_quantize_dynamic(model, {rnn_type, nn.Linear})(x)
    assert sqnr(ref, q(x)) >= sqnr(ref, theirs) - 1.0


# -- save / load -----------------------------------------------------------------------------------------


def test_state_dict_round_trip_weights_only(net):
    q = quantize_dynamic(net)
    q_emb = quantize_dynamic(q, dtype=torch.quint8)
    buf = io.BytesIO()
    torch.save(q_emb.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    torch.manual_seed(123)
    fresh = quantize_dynamic(quantize_dynamic(Net()), dtype=torch.quint8)
    fresh.load_state_dict(sd)
    x = inputs()
    assert quantized(fresh) == quantized(q_emb) == {n for n, _ in net.named_parameters() if n.endswith("weight")}
    assert torch.equal(fresh(*x), q_emb(*x))


# -- F.embedding_bag on a quantized weight ----------------------------------------------------------------


def _uint8_bag(**kwargs):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(40, 8, **kwargs)
    affineq.quantize_(bag, config_for_dtype(torch.quint8, nn.EmbeddingBag),
                      filter_fn=lambda m, fqn: isinstance(m, nn.EmbeddingBag))
    return bag


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding_bag_equals_float_op_on_dequantized_weight(mode, padding_idx):
    bag = _uint8_bag(mode=mode, padding_idx=padding_idx)
    w = bag.weight.dequantize()
    ids = torch.tensor([3, 5, 3, 39, 0, 7, 7, 12, 3])
    offsets = torch.tensor([0, 2, 5])
    psw = torch.rand(ids.shape) if mode == "sum" else None
    with affineq.strict_kernels():  # no dequantize-everything fallback
        out = bag(ids, offsets, per_sample_weights=psw)
        out2d = bag(ids[:8].view(2, 4))
    ref = F.embedding_bag(ids, w, offsets, mode=mode, per_sample_weights=psw, padding_idx=bag.padding_idx)
    assert torch.equal(out, ref)
    assert torch.equal(out2d, F.embedding_bag(ids[:8].view(2, 4), w, mode=mode, padding_idx=bag.padding_idx))
    last = F.embedding_bag(ids, bag.weight, torch.tensor([0, 2, 5, 9]), mode=mode, include_last_offset=True)
    assert torch.equal(last, F.embedding_bag(ids, w, torch.tensor([0, 2, 5, 9]), mode=mode,
                                             include_last_offset=True))


def test_embedding_bag_bad_input():
    bag = _uint8_bag(mode="sum")
    with pytest.raises(IndexError, match="index 40 is out of range"):
        bag(torch.tensor([1, 40]), torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="max_norm=None"):
        F.embedding_bag(torch.tensor([1, 2]), bag.weight, torch.tensor([0]), max_norm=1.0)


# -- the tutorial ----------------------------------------------------------------------------------------


def test_migration_tutorial_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = runpy.run_path(str(TUTORIAL), run_name="__main__")
    assert ns["SECTIONS_DONE"] == ns["SECTIONS"]


def test_embedding_bag_compiles():
    bag = _uint8_bag(mode="mean")
    ids, offsets = torch.tensor([1, 5, 5, 9, 30]), torch.tensor([0, 2])
    torch._dynamo.reset()
    out = torch.compile(bag, fullgraph=True, backend="eager")(ids, offsets)
    assert torch.equal(out, F.embedding_bag(ids, bag.weight.dequantize(), offsets, mode="mean"))


def test_recurrent_root_module_returns_the_quantized_copy():
    torch.manual_seed(0)
    lstm, x = nn.LSTM(16, 32), torch.randn(5, 2, 16)
    q = quantize_dynamic(lstm)
    assert type(q).__name__ == "QuantizedLSTM" and type(lstm) is nn.LSTM and not is_q(lstm.weight_ih_l0)
    with torch.no_grad():
        assert sqnr(lstm(x)[0], q(x)[0]) >= 30
    with pytest.raises(ValueError, match="inplace=False"):
        quantize_dynamic(lstm, inplace=True)
