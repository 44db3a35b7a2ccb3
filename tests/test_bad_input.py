"""Issue #11: a catalogue of bad inputs beyond the primitives (configs, quantize_, tensor ops, the
AffineQuantizedTensor API, serialization).

Each case is a callable that must raise, the exception type, and a regex the message must match. The regex
checks both that the message names what is wrong (the parameter, field, key or op) and that it says what to
do instead ("use", "pass", "call", "must be", "one of", "choose", "... first", or the alternative itself). A
case that goes through `quantize_` is a `Q` (model factory, config, keyword arguments): the model must also be
left exactly as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from conftest import TiedLM, assert_unchanged, snapshot_model
from torch import nn

import affineq
from affineq import (
    AffineQuantizedTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt4WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    MappingType,
    PerAxis,
    PerGroup,
    QuantizationError,
    QuantSpec,
    ZeroPointDomain,
    config_from_dict,
    quantize_,
    set_strict,
    strict_kernels,
)
from affineq.granularity import PerTensor
from affineq.tensor.spec import QParamOptions

AQT = AffineQuantizedTensor


@dataclass
class Q:
    """A quantize_ call on a fresh model: quantize_(model(), config, **kw)."""

    model: Callable[[], nn.Module]
    config: object
    kw: dict = field(default_factory=dict)


# -- building blocks ----------------------------------------------------------------------------------------------


def _w(shape=(32, 64)):
    torch.manual_seed(0)
    return torch.randn(*shape)


def _q8():  # int8 per row, plain
    return AQT.from_spec(_w(), (1, 64), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                         zero_point_domain=ZeroPointDomain.NONE)


def _qg():  # int8 groups of 32, plain
    return AQT.from_spec(_w(), (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                         zero_point_domain=ZeroPointDomain.NONE)


def _q4_dense():
    return AQT.from_spec(_w(), (1, 32), QParamOptions(scale_dtype=torch.float32), target=torch.uint4,
                         mapping_type=MappingType.ASYMMETRIC, packing_format="dense")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def _quantized_mlp(config=None):
    return quantize_(_mlp(), config or Int8WeightOnlyConfig())


def _with_nan():
    m = _mlp()
    with torch.no_grad():
        m[2].weight[3, 3] = float("nan")
    return m


def _near_fp32_limit():
    m = _mlp()
    with torch.no_grad():
        m[2].weight.copy_(torch.randn(32, 64).sign() * 3e38)
    return m


def _odd_out_features():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.Linear(128, 24))


def _linear_then_conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Conv2d(3, 8, 3))


def _parametrized():
    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    m = _mlp()
    torch.nn.utils.parametrize.register_parametrization(m[2], "weight", Double())
    return m


def _weight_norm():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), torch.nn.utils.weight_norm(nn.Linear(16, 16)))


def _spec_dict(**changes):
    return {**_q8().spec.to_dict(), **changes}


def _load(ckpt_config, target: Callable[[], nn.Module]):
    def run():
        torch.manual_seed(0)
        sd = quantize_(nn.Sequential(nn.Linear(64, 32)), ckpt_config).state_dict() if ckpt_config else (
            nn.Sequential(nn.Linear(64, 32)).state_dict())
        target().load_state_dict(sd)
    return run


def _float_linear():
    return nn.Sequential(nn.Linear(64, 32))


def _int4_linear():
    return quantize_(nn.Sequential(nn.Linear(64, 32)), Int4WeightOnlyConfig(group_size=32))


def _int8_linear():
    return quantize_(nn.Sequential(nn.Linear(64, 32)), Int8WeightOnlyConfig())


def _frozen_weight_requiring_grad():
    m = _quantized_mlp()
    m[0].weight.requires_grad_(True)
    return m(torch.randn(2, 64)).sum().backward()  # the forward runs; the weight's gradient is refused


def _embedding_lookup(index):
    emb = quantize_(nn.Sequential(nn.Embedding(10, 64)), Int8WeightOnlyConfig(),
                    filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    return emb[0](torch.tensor([index]))


_INT4 = r"\['auto', 'dense', 'int4_cpu', 'int4_cuda', 'plain'\]"

# -- the catalogue -------------------------------------------------------------------------------------------------

CASES = [
    # configs: group_size
    pytest.param(lambda: Int4WeightOnlyConfig(group_size=0), ValueError,
                 r"group_size must be a positive int \(32, 64, 128 or 256 are typical\), got 0", id="int4-group-0"),
    pytest.param(lambda: Int8WeightOnlyConfig(group_size=-1), ValueError,
                 r"group_size must be a positive int or None \(per channel\), got -1", id="int8-group-negative"),
    pytest.param(lambda: Int4WeightOnlyConfig(group_size=True), ValueError,
                 r"group_size must be a positive int.*got True", id="int4-group-bool"),
    pytest.param(lambda: Int8DynamicActivationInt4WeightConfig(group_size="64"), ValueError,
                 r"group_size must be a positive int.*got '64'", id="8da4w-group-str"),
    pytest.param(lambda: Int4WeightOnlyConfig(group_size=None), ValueError,
                 r"Int4WeightOnlyConfig needs a group_size: pass group_size=32", id="int4-group-none"),
    pytest.param(lambda: Int4WeightOnlyConfig(group_size=16, packing_format="int4_cpu"), ValueError,
                 r"packing_format='int4_cpu' needs group_size 32, 64, 128 or 256", id="int4_cpu-group-16"),
    # configs: packing_format
    pytest.param(lambda: Int4WeightOnlyConfig(packing_format="denze"), ValueError,
                 rf"packing_format='denze' is not one of {_INT4}; did you mean 'dense'\?", id="int4-format-typo"),
    pytest.param(lambda: Int8DynamicActivationInt8WeightConfig(packing_format="int4_cpu"), ValueError,
                 r"packing_format='int4_cpu' is not one of \['auto', 'dense', 'plain'\]", id="int8dyn-format"),
    pytest.param(lambda: Float8WeightOnlyConfig(packing_format="Dense"), ValueError,
                 r"packing_format='Dense' is not one of .*did you mean 'dense'", id="fp8-format-case"),
    pytest.param(lambda: IntxWeightOnlyConfig(packing_format=1), ValueError,
                 r"packing_format=1 must be a str, not int: use e\.g\. 'auto'", id="intx-format-int"),
    # configs: dtypes, enums, bools
    pytest.param(lambda: Int4WeightOnlyConfig(packing_format="int4_cpu", scale_dtype=torch.float32), ValueError,
                 r"packing_format='int4_cpu' stores bf16 scales: use scale_dtype=torch\.bfloat16",
                 id="int4_cpu-fp32-scale"),
    pytest.param(lambda: Int4WeightOnlyConfig(scale_dtype=torch.float16), ValueError,
                 r"scale_dtype=torch\.float16 is not one of \[torch\.bfloat16, torch\.float32\]", id="scale-fp16"),
    pytest.param(lambda: Int4WeightOnlyConfig(scale_dtype="bf16"), ValueError,
                 r"scale_dtype='bf16' must be a dtype, not str: use e\.g\. torch\.bfloat16", id="scale-str"),
    pytest.param(lambda: IntxWeightOnlyConfig(mapping_type="ASYMMETRIC"), ValueError,
                 r"mapping_type='ASYMMETRIC' must be a MappingType.*use e\.g\. MappingType\.ASYMMETRIC",
                 id="mapping-str"),
    pytest.param(lambda: IntxWeightOnlyConfig(zero_point_domain="INT"), ValueError,
                 r"zero_point_domain='INT' must be a ZeroPointDomain.*use e\.g\. ZeroPointDomain\.FLOAT",
                 id="domain-str"),
    pytest.param(lambda: Int4WeightOnlyConfig(preserve_zero=1), ValueError,
                 r"preserve_zero=1 must be a bool, not int: use e\.g\. True or False", id="preserve-zero-int"),
    pytest.param(lambda: IntxWeightOnlyConfig(torch.float16), ValueError,
                 r"weight_dtype=torch\.float16: use an integer dtype of 1-8 bits", id="intx-float-dtype"),
    pytest.param(lambda: IntxWeightOnlyConfig(torch.int16), ValueError,
                 r"weight_dtype=torch\.int16: use an integer dtype of 1-8 bits", id="intx-int16"),
    pytest.param(lambda: IntxWeightOnlyConfig(torch.int1), ValueError,
                 r"weight_dtype=torch\.int1 with mapping_type=.*use mapping_type=MappingType\.ASYMMETRIC",
                 id="intx-int1-symmetric"),
    pytest.param(lambda: Float8WeightOnlyConfig(torch.int8), ValueError,
                 r"weight_dtype=torch\.int8: use torch\.float8_e4m3fn or torch\.float8_e5m2", id="fp8-int8"),
    pytest.param(lambda: Float8DynamicActivationFloat8WeightConfig(activation_dtype=torch.int8), ValueError,
                 r"activation_dtype=torch\.int8: use torch\.float8_e4m3fn", id="fp8dyn-activation-int8"),
    # configs: granularity
    pytest.param(lambda: IntxWeightOnlyConfig(torch.int4, PerTensor()), ValueError,
                 r"granularity=PerTensor\(\): use PerGroup\(group_size\) or PerAxis\(0\)", id="intx-per-tensor"),
    pytest.param(lambda: IntxWeightOnlyConfig(torch.int4, PerAxis(1)), ValueError,
                 r"granularity=PerAxis\(axis\) must use axis=0", id="intx-per-axis-1"),
    pytest.param(lambda: IntxWeightOnlyConfig(torch.int4, "per_group:32"), ValueError,
                 r"granularity='per_group:32' must be a Granularity.*use e\.g\. PerGroup\(32\)", id="intx-gran-str"),
    pytest.param(lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerGroup(32)), ValueError,
                 r"granularity=PerGroup\(group_size=32\): use PerTensor\(\) or PerRow\(\)", id="fp8dyn-per-group"),
    pytest.param(lambda: PerGroup(0), ValueError, r"group_size must be >= 1, got 0", id="per-group-0"),
    # configs: param_names
    pytest.param(lambda: Int8WeightOnlyConfig(param_names="weight"), ValueError,
                 r"param_names='weight' must be a non-empty tuple of parameter names, e\.g\. \('weight',\)",
                 id="param-names-str"),
    pytest.param(lambda: Int8WeightOnlyConfig(param_names=()), ValueError,
                 r"param_names=\(\) must be a non-empty tuple", id="param-names-empty"),
    pytest.param(lambda: Int8WeightOnlyConfig(param_names=("weight", 3)), ValueError,
                 r"param_names=\('weight', 3\) must be a non-empty tuple of parameter names", id="param-names-int"),
    # configs: JSON
    pytest.param(lambda: config_from_dict({"type": ["Int4WeightOnlyConfig"]}), ValueError,
                 r"unknown config type \['Int4WeightOnlyConfig'\]: 'type' must be one of", id="dict-type-list"),
    pytest.param(lambda: config_from_dict({"type": "Int4WeightOnlyConfig", "group_sise": 3}), ValueError,
                 r"no fields \['group_sise'\]; use its fields: \['compute_dtype', 'group_size'",
                 id="dict-unknown-field"),
    pytest.param(lambda: config_from_dict({"type": "Int4WeightOnlyConfig", "scale_dtype": {"dtype": "nope"}}),
                 ValueError, r"scale_dtype: unknown torch dtype 'nope'; use a torch dtype name", id="dict-dtype"),
    pytest.param(lambda: config_from_dict({"type": "IntxWeightOnlyConfig",
                                           "mapping_type": {"enum": "MappingType", "name": "SIDEWAYS"}}),
                 ValueError, r"mapping_type: MappingType has no member 'SIDEWAYS'; use one of", id="dict-enum"),
    pytest.param(lambda: config_from_dict({"type": "FqnToConfig", "fqn_to_config": {"lm_head": {"type": "Nope"}}}),
                 ValueError, r"FqnToConfig\['lm_head'\]: unknown config type 'Nope': 'type' must be one of",
                 id="dict-fqn-value"),
    # quantize_: arguments
    pytest.param(lambda: quantize_({"0.weight": _w()}, Int8WeightOnlyConfig()), TypeError,
                 r"model must be an nn\.Module, got dict; pass the module itself", id="quantize-non-module"),
    pytest.param(lambda: quantize_(_mlp(), "int8"), TypeError,
                 r"config must be an affineq config \(e\.g\. Int4WeightOnlyConfig\(\)\), got 'int8'",
                 id="quantize-non-config"),
    pytest.param(lambda: quantize_(_mlp(), Int8WeightOnlyConfig), TypeError,
                 r"got the class Int8WeightOnlyConfig; call it: Int8WeightOnlyConfig\(\)", id="quantize-config-class"),
    pytest.param(lambda: quantize_(_mlp(), Int8WeightOnlyConfig(), filter_fn="Linear"), TypeError,
                 r"filter_fn must be a callable filter_fn\(module, fqn\) -> bool", id="quantize-filter-str"),
    pytest.param(lambda: quantize_(_mlp(), Int8WeightOnlyConfig(), device="tpu"), ValueError,
                 r"device='tpu' is not a torch device.*pass e\.g\. 'cpu'", id="quantize-bad-device"),
    pytest.param(lambda: affineq.register_quantize_module_handler(int), TypeError,
                 r"config_cls=<class 'int'>\): config_cls must be a QuantConfig subclass", id="register-non-config"),
    # quantize_: modules the config cannot take (the model must stay as it was)
    pytest.param(Q(lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), Int8WeightOnlyConfig(),
                   {"filter_fn": lambda m, fqn: fqn in ("0", "1")}), QuantizationError,
                 r"1: Int8WeightOnlyConfig quantizes Linear.*not LayerNorm.*pass filter_fn", id="filter-layernorm"),
    pytest.param(Q(_mlp, Int4WeightOnlyConfig(group_size=128)), QuantizationError,
                 r"group_size=128 does not divide the last dim 64.*Ways out: pick a group_size",
                 id="group-not-dividing"),
    pytest.param(Q(_quantized_mlp, Int8WeightOnlyConfig()), QuantizationError,
                 r"its weight is already quantized; quantize_ a float model", id="already-quantized"),
    pytest.param(Q(_parametrized, Int8WeightOnlyConfig()), QuantizationError,
                 r"weight is parametrized.*call torch\.nn\.utils\.parametrize\.remove_parametrizations",
                 id="parametrized"),
    pytest.param(Q(_weight_norm, Int8WeightOnlyConfig()), QuantizationError,
                 r"weight_norm.*call torch\.nn\.utils\.remove_weight_norm\(module, 'weight'\)", id="weight-norm"),
    pytest.param(Q(lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(0, 8)), Int8WeightOnlyConfig()),
                 QuantizationError, r"1: its weight is empty.*Ways out.*filter_fn", id="zero-size"),
    pytest.param(Q(_mlp, Int8WeightOnlyConfig(param_names=("weight_ih",))), QuantizationError,
                 r"no parameter 'weight_ih' \(parameters: \['weight', 'bias'\]\)", id="param-names-missing"),
    pytest.param(Q(_odd_out_features, Int4WeightOnlyConfig(group_size=32, packing_format="int4_cpu")),
                 QuantizationError,
                 r"'1'.*int4_cpu needs out_features N divisible by 16.*choose another packing_format",
                 id="int4_cpu-odd-out-features"),
    pytest.param(Q(_linear_then_conv, Int8WeightOnlyConfig(packing_format="dense"),
                   {"filter_fn": lambda m, fqn: isinstance(m, (nn.Linear, nn.Conv2d))}), QuantizationError,
                 r"'1'.*packing_format='dense'.*2-D weights only.*choose another packing_format", id="dense-conv"),
    pytest.param(Q(_with_nan, Int8WeightOnlyConfig()), QuantizationError,
                 r"'2'.*NaN or Inf.*clean the tensor", id="nan-weight"),
    pytest.param(Q(_near_fp32_limit, Int4WeightOnlyConfig(group_size=32)), QuantizationError,
                 r"'2'.*packing_format='dense' cannot hold these weights.*overflows float32.*"
                 r"use packing_format='plain'", id="dense-range-overflows"),
    pytest.param(Q(_near_fp32_limit, IntxWeightOnlyConfig(torch.int4)), QuantizationError,
                 r"'2'.*packing_format='dense' cannot hold these weights.*use packing_format='plain'",
                 id="dense-overflows"),
    # quantize_: FqnToConfig
    pytest.param(Q(_mlp, FqnToConfig({"lm_head": Int8WeightOnlyConfig()})), QuantizationError,
                 r"does not have: \['lm_head'\]\. Use names from model\.named_modules\(\)", id="fqn-missing-name"),
    pytest.param(lambda: FqnToConfig({"re:layers.(": Int8WeightOnlyConfig()}), ValueError,
                 r"key 're:layers\.\(' is not a valid regex.*fix the pattern", id="fqn-bad-regex"),
    pytest.param(lambda: FqnToConfig({"block": FqnToConfig({})}), ValueError,
                 r"FqnToConfig\['block'\]: FqnToConfig cannot nest; put its entries in the outer", id="fqn-nested"),
    pytest.param(lambda: FqnToConfig({0: Int8WeightOnlyConfig()}), ValueError,
                 r"FqnToConfig keys must be module names \(str\), got 0", id="fqn-int-key"),
    pytest.param(lambda: FqnToConfig({"0": "int8"}), ValueError,
                 r"FqnToConfig\['0'\] must be a config or None, got 'int8'", id="fqn-str-value"),
    pytest.param(lambda: FqnToConfig([("0", Int8WeightOnlyConfig())]), ValueError,
                 r"fqn_to_config=\.\.\.\) must be a dict of name -> config, got list", id="fqn-list"),
    pytest.param(Q(TiedLM, FqnToConfig({"embed": Int8WeightOnlyConfig(), "head": IntxWeightOnlyConfig(torch.int4)})),
                 QuantizationError, r"embed\.weight and head\.weight are the same \(tied\) parameter.*"
                 r"Int8WeightOnlyConfig.*IntxWeightOnlyConfig.*Give both names the same config", id="tied-two-configs"),
    pytest.param(Q(TiedLM, FqnToConfig({"embed": None, "head": Int8WeightOnlyConfig()})), QuantizationError,
                 r"leaves embed\.weight float \(None\) and gives head\.weight .*Give both names the same config",
                 id="tied-float-and-quantized"),
    # tensor ops
    pytest.param(lambda: torch.cat([_q8(), _q4_dense()]), ValueError,
                 r"cat: AffineQuantizedTensors must share target.*Dequantize them first", id="cat-mixed"),
    pytest.param(lambda: _qg()[:, 16:56], ValueError,
                 r"aten\.slice\.Tensor .*cut its quantization blocks unevenly \(block_size \(1, 32\)\); slice, index "
                 r"and reshape along whole blocks", id="slice-uneven"),
    pytest.param(lambda: AQT.from_spec(_w((24, 64)), (1, 64), target=torch.int8,
                                       mapping_type=MappingType.SYMMETRIC).reshape(16, 96),
                 ValueError, r"aten\.view\.default .*cut its quantization blocks unevenly.*call \.dequantize\(\) first",
                 id="reshape-cuts-blocks"),
    pytest.param(lambda: _q8().add_(1), NotImplementedError,
                 r"in-place op aten\.add_\.Tensor .*call \.dequantize\(\) first", id="inplace-add"),
    pytest.param(lambda: _q8().mul_(2), NotImplementedError,
                 r"in-place op aten\.mul_\.Tensor .*call \.dequantize\(\) first", id="inplace-mul"),
    pytest.param(lambda: _q8().to(torch.int8), ValueError,
                 r"cannot cast an AffineQuantizedTensor to torch\.int8.*use \.codes\(\)", id="cast-int8"),
    pytest.param(lambda: _q8().copy_(_qg()), ValueError,
                 r"copy_: source .*block_size=\(1, 32\).* does not match destination .*quantize the model with the "
                 r"checkpoint's config", id="copy-mismatched-specs"),
    pytest.param(lambda: _q8().copy_(_w()), ValueError,
                 r"copy_: cannot copy a float tensor into quantized.*quantize the model after loading float weights",
                 id="copy-float-into-quantized"),
    pytest.param(lambda: _w().copy_(_q8()), ValueError,
                 r"copy_: cannot copy quantized .* into a plain tensor.*assign=True", id="copy-quantized-into-float"),
    pytest.param(lambda: _q8()[0, 0], ValueError,
                 r"aten\.select\.int: a 0-d result .*call \.dequantize\(\) first", id="zero-dim-result"),
    pytest.param(lambda: F.linear(torch.randn(2, 63), _q8()), RuntimeError,
                 r"input of shape \(2, 63\).*last dim must be in_features=64; pass an input of shape \[\.\.\., 64\]",
                 id="linear-wrong-in-features"),
    pytest.param(_frozen_weight_requiring_grad, RuntimeError,
                 r"requires_grad=True.*Call weight\.requires_grad_\(False\)", id="weight-requires-grad"),
    pytest.param(lambda: _embedding_lookup(10), IndexError,
                 r"index 10 is out of range for a quantized embedding of 10 rows \(valid: 0\.\.9\)",
                 id="embedding-index"),
    # AffineQuantizedTensor API
    pytest.param(lambda: AQT.from_tensors({"qdata": _q8().qdata, "scales": _q8().scale}, _q8().spec), ValueError,
                 r"stores tensors \['qdata', 'scale'\], got \['qdata', 'scales'\]: pass the tensors as",
                 id="from-tensors-names"),
    pytest.param(lambda: AQT.from_tensors({**_q8().tensors, "scale": _q8().scale[:3]}, _q8().spec), ValueError,
                 r"tensors\['scale'\] has shape \(3, 1\); it must be \(32, 1\)", id="from-tensors-shape"),
    pytest.param(lambda: AQT.from_tensors({**_q8().tensors, "qdata": _q8().qdata.float()}, _q8().spec), ValueError,
                 r"tensors\['qdata'\] has dtype torch\.float32; it must be one of \['torch\.int8'\]",
                 id="from-tensors-dtype"),
    pytest.param(lambda: AQT.from_tensors(list(_q8().tensors.values()), _q8().spec), ValueError,
                 r"tensors must be a dict of name -> tensor \(as AffineQuantizedTensor\.tensors returns",
                 id="from-tensors-list"),
    pytest.param(lambda: AQT.from_tensors(_q8().tensors, _q8().spec.to_dict()), ValueError,
                 r"spec must be a QuantSpec \(use QuantSpec\.from_dict", id="from-tensors-spec-dict"),
    pytest.param(lambda: AQT.from_tensors({**_q8().tensors, "scale": [1.0]}, _q8().spec), ValueError,
                 r"tensors\['scale'\] must be a torch\.Tensor, got list", id="from-tensors-list-value"),
    pytest.param(lambda: _q8().with_act_tensors(act_bias=torch.ones(64)), ValueError,
                 r"unknown activation tensor 'act_bias'; use one of \['act_pre_scale'", id="act-unknown"),
    pytest.param(lambda: _q8().with_act_tensors(act_pre_scale=torch.ones(32)), ValueError,
                 r"act_pre_scale must be a float tensor of shape \[64\]", id="act-pre-scale-shape"),
    pytest.param(lambda: _q8().with_act_tensors(act_scale=torch.ones(1)), ValueError,
                 r"act_scale is given .*set act_quant=ActivationQuant\(\.\.\., static=True\)", id="act-scale-dynamic"),
    pytest.param(lambda: QuantSpec.create((32, 64), torch.float32, torch.int8, (1,)), ValueError,
                 r"block_size \(1,\) must have one entry per dim of shape \(32, 64\), e\.g\. \(1, 64\)",
                 id="spec-block-size-length"),
    pytest.param(lambda: QuantSpec.create((32, 64), torch.float32, torch.int8, (1, 64), scale_type="fp8"),
                 ValueError, r"scale_type='fp8': use None \(float scales\) or 'e8m0'", id="spec-scale-type"),
    pytest.param(lambda: QuantSpec.create((32, 64), torch.float32, "int99", (1, 64)), ValueError,
                 r"target='int99': .*not a known quantization type.*use one of these names", id="spec-target"),
    pytest.param(lambda: QuantSpec.create((32, 64), torch.float32, torch.int8, (1, 64), mapping_type="SYMMETRIC"),
                 ValueError, r"mapping_type='SYMMETRIC': use one of \['MappingType\.SYMMETRIC'", id="spec-mapping-str"),
    pytest.param(lambda: QuantSpec.from_dict(_spec_dict(version=99)), ValueError,
                 r"QuantSpec version 99 is not supported.*upgrade affineq", id="spec-dict-version"),
    pytest.param(lambda: QuantSpec.from_dict(_spec_dict(colour="red")), ValueError,
                 r"unknown keys \['colour'\]; pass the dict QuantSpec\.to_dict\(\) wrote", id="spec-dict-unknown-key"),
    pytest.param(lambda: QuantSpec.from_dict(_spec_dict(mapping_type="SIDEWAYS")), ValueError,
                 r"mapping_type='SIDEWAYS' is an unknown enum member of MappingType; use one of",
                 id="spec-dict-enum"),
    pytest.param(lambda: QuantSpec.from_dict(_spec_dict(dtype="int8")), ValueError,
                 r"dtype 'int8' is not a floating-point torch dtype; it must be the logical float dtype",
                 id="spec-dict-dtype"),
    pytest.param(lambda: QuantSpec.from_dict(_spec_dict(act_quant={"dtype": "int8"})), ValueError,
                 r"act_quant dict is missing keys \['mapping_type'.*pass the dict ActivationQuant\.to_dict\(\) wrote",
                 id="spec-dict-act-quant"),
    pytest.param(lambda: QuantSpec.from_dict(_spec_dict(shape="32x64")), ValueError,
                 r"shape must be a list of ints, got '32x64'", id="spec-dict-shape"),
    pytest.param(lambda: AQT.from_spec(_w((24, 64)), (1, 32), target=torch.uint4, mapping_type=MappingType.ASYMMETRIC,
                                       packing_format="int4_cpu"), ValueError,
                 r"packing_format='int4_cpu' cannot hold this tensor: .*N divisible by 16.*"
                 r"choose another packing_format",
                 id="from-float-int4_cpu"),
    pytest.param(lambda: AQT.from_spec(_w(), (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                                       packing_format="packed"),
                 ValueError, r"unknown packing_format 'packed'; use one of \['dense'", id="unknown-format"),
    pytest.param(lambda: AQT.from_spec(_w(), (1, 32), target=torch.int8, mapping_type=MappingType.SYMMETRIC,
                                       packing_format="dence"),
                 ValueError, r"unknown packing_format 'dence' \(did you mean 'dense'\?\)", id="format-typo"),
    pytest.param(lambda: _q8().to_format("int4_cpu"), ValueError,
                 r"packing_format='int4_cpu' cannot hold this tensor: .*4-bit codes.*choose another packing_format",
                 id="to-format"),
    # integer inputs and dtypes: dequantizing to an integer dtype would truncate every weight silently
    pytest.param(lambda: F.linear(torch.randint(-3, 4, (2, 64)), _q8()), TypeError,
                 r"linear: the input of a quantized weight must be floating point, got torch\.int64; pass x\.float\(\)",
                 id="linear-int-input"),
    pytest.param(lambda: _q8().dequantize(torch.int8), TypeError,
                 r"dequantize: output_dtype must be a floating-point torch\.dtype .* got torch\.int8",
                 id="dequantize-int"),
    pytest.param(lambda: _q8().dequantize("float32"), TypeError,
                 r"dequantize: output_dtype must be a floating-point torch\.dtype .* got 'float32'",
                 id="dequantize-str"),
    pytest.param(lambda: F.linear(torch.randn(2, 64), _q8(), torch.zeros(64)), RuntimeError,
                 r"linear: bias of shape \(64,\) does not fit the quantized weight of shape \(32, 64\): pass a bias of "
                 r"shape \(32,\)", id="linear-bias-shape"),
    # the kernel registry's extension API
    pytest.param(lambda: affineq.kernels.register_linear_kernel("mine", "dense", lambda x, w: None, lambda x, w, b: x),
                 TypeError, r"formats must be a tuple of packing format names, e\.g\. \('dense',\), got 'dense'",
                 id="register-kernel-formats-str"),
    pytest.param(lambda: affineq.kernels.register_linear_kernel("mine", ("dense",), None, lambda x, w, b: x),
                 TypeError, r"register_linear_kernel\('mine'\): check must be callable", id="register-kernel-check"),
    pytest.param(lambda: affineq.kernels.register_linear_kernel("mine", ("dense",), lambda x, w: None,
                                                                lambda x, w, b: x, bind="spec"),
                 TypeError, r"register_linear_kernel\('mine'\): bind must be callable, got 'spec'",
                 id="register-kernel-bind"),
    pytest.param(lambda: affineq.kernels.select_linear_kernel(torch.randn(2, 64), torch.randn(32, 64)), TypeError,
                 r"w an AffineQuantizedTensor, got Tensor and Tensor", id="select-kernel-plain-weight"),
    # strict mode
    pytest.param(lambda: set_strict("False"), TypeError,
                 r"strict flag must be True or False, got 'False' \(str\)", id="set-strict-str"),
    pytest.param(lambda: strict_kernels(1).__enter__(), TypeError,
                 r"strict flag must be True or False, got 1 \(int\)", id="strict-kernels-int"),
    # serialization
    pytest.param(_load(Int8WeightOnlyConfig(), _float_linear), RuntimeError,
                 r'"0\.weight".*cannot copy quantized .*model\.load_state_dict\(state_dict, assign=True\)',
                 id="load-quantized-into-float"),
    pytest.param(_load(Int8WeightOnlyConfig(), _int4_linear), RuntimeError,
                 r'"0\.weight".*does not match destination.*quantize the model with the checkpoint\'s config',
                 id="load-other-config"),
    pytest.param(_load(None, _int8_linear), RuntimeError,
                 r'"0\.weight".*cannot copy a float tensor into quantized.*quantize the model after loading',
                 id="load-float-into-quantized"),
]


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("make", "exc", "pattern"), CASES)
def test_bad_input(make, exc, pattern):
    if isinstance(make, Q):
        model = make.model()
        snap = snapshot_model(model)
        with pytest.raises(exc) as info:
            quantize_(model, make.config, **make.kw)
        assert_unchanged(model, snap)
    else:
        with pytest.raises(exc) as info:
            make()
    assert type(info.value) is exc or issubclass(type(info.value), exc)
    assert re.search(pattern, str(info.value), re.S), f"message does not match {pattern!r}:\n{info.value}"
