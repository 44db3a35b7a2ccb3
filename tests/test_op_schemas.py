"""The schemas of affineq's torch ops, pinned. torch.compile caches the code it generates for a graph (inductor's
FX graph cache, keyed by the graph, not by the ops' schemas); code compiled against an op's old schema calls it
with the old argument list, and a cpp-wrapper graph then reads past the stack (a crash in users' processes after
an upgrade, until they clear the cache). So an op's schema never changes: a new argument means a new op (as
`lowbit_linear_bf16_compute` beside `lowbit_linear`), and this table only grows."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import expecttest
import torch

import affineq.cpp as K
import affineq.cpp.grouped_ops  # noqa: F401  (every module that defines affineq ops)
import affineq.cpp.kv_attention  # noqa: F401
import affineq.tensor.activation  # noqa: F401
import affineq.tensor.compute_bound  # noqa: F401
import affineq.tensor.grouped  # noqa: F401
import affineq.tensor.kquant_kernel  # noqa: F401
import affineq.tensor.linear_kernels  # noqa: F401


def test_op_schemas_never_change():
    K.is_available()  # the C++ library defines the rest
    schemas = sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("affineq::"))
    names = {s.split("(")[0].removeprefix("affineq::") for s in schemas}
    src = "".join(p.read_text() for p in (Path(K.__file__).parents[1]).rglob("*.py"))
    defined = set(re.findall(r'custom_op\(\s*"affineq::(\w+)"', src)) | set(re.findall(r'\.define\(\s*"(\w+)\(', src))
    assert defined and defined <= names, f"import the module defining {defined - names} above"
    text = "\n".join(textwrap.fill(s, 110, subsequent_indent="    ", break_on_hyphens=False) for s in schemas)
    expecttest.assert_expected_inline(text, """\
affineq::dense_dequantize(Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n, int k,
    int codes, int code_offset, bool canonical, bool bf16) -> Tensor
affineq::dequant_linear(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int
    n, int k, int codes, int code_offset, bool canonical, bool bf16_weight, int min_rows=0) -> Tensor
affineq::fake_quantize_mx_activation(Tensor x, str aq) -> Tensor
affineq::float_kv_attention(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor valid, float scale) -> Tensor
affineq::float_kv_attention_sinks(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor valid, float scale, Tensor
    sinks) -> Tensor
affineq::grouped_dequantized_linear(Tensor x, Tensor expert_ids, Tensor[] tensors, str names, str spec) ->
    Tensor
affineq::grouped_float_linear(Tensor x, Tensor expert_ids, Tensor weight) -> Tensor
affineq::grouped_lowbit_linear(Tensor x, Tensor expert_ids, Tensor packed, Tensor scale, Tensor? offset, int
    bits, int group_size, int n, int k, int codes=0, int code_offset=0) -> Tensor
affineq::int8_codes_linear(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int group_size, int n, int
    k, bool per_token, int mode, float eps, int bits=8, int code_offset=0, int min_rows=0) -> Tensor
affineq::int8_codes_linear_bf16_compute(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int group_size,
    int n, int k, bool per_token, int mode, float eps, int bits=8, int code_offset=0, int min_rows=0) ->
    Tensor
affineq::int8_codes_linear_biased(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int group_size, int
    n, int k, bool per_token, int mode, float eps, int bits, int code_offset, int min_rows, bool bf16_compute,
    Tensor bias) -> Tensor
affineq::int8_dynamic_linear(Tensor x2, Tensor w_codes, Tensor w_scale, bool per_token, bool no_clipping,
    float eps) -> Tensor
affineq::int8_dynamic_onednn_linear(Tensor x2, Tensor w_codes, Tensor w_scale, bool per_token, bool
    no_clipping, float eps) -> Tensor
affineq::int8_fake_quant(Tensor x, bool per_token, int mode, float eps) -> Tensor
affineq::int8_static_linear(Tensor x2, Tensor w_codes, Tensor w_scale, Tensor x_scale, Tensor? x_zero_point)
    -> Tensor
affineq::int8_static_onednn_linear(Tensor x2, Tensor w_codes, Tensor w_scale, Tensor x_scale, Tensor?
    x_zero_point) -> Tensor
affineq::kquant_linear(Tensor x, Tensor qdata, Tensor scales, Tensor? mins, Tensor d, int kind, int n, int k)
    -> Tensor
affineq::kquant_linear_biased(Tensor x, Tensor qdata, Tensor scales, Tensor? mins, Tensor d, int kind, int n,
    int k, Tensor bias) -> Tensor
affineq::kv_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, Tensor pos,
    Tensor valid) -> Tensor
affineq::kv_attention_sinks(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, Tensor
    pos, Tensor valid, Tensor sinks) -> Tensor
affineq::lowbit_dequantize(Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n, int
    k, int codes=0, int code_offset=0) -> Tensor
affineq::lowbit_linear(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int n,
    int k, int codes=0, int code_offset=0) -> Tensor
affineq::lowbit_linear_bf16_compute(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int
    group_size, int n, int k, int codes=0, int code_offset=0) -> Tensor
affineq::lowbit_linear_biased(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size,
    int n, int k, int codes, int code_offset, bool bf16_compute, Tensor bias) -> Tensor
affineq::lowbit_linear_int8_act(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int
    group_size, int n, int k, int codes, int code_offset, bool per_token, int mode, float eps) -> Tensor
affineq::lowbit_linear_int8_act_bf16_compute(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits,
    int group_size, int n, int k, int codes, int code_offset, bool per_token, int mode, float eps) -> Tensor
affineq::lowbit_linear_multi(Tensor x, Tensor[] packed, Tensor[] scale, Tensor?[] offset, int bits, int
    group_size, int[] n, int k, int codes=0, int code_offset=0) -> Tensor
affineq::lowbit_rnn_layer(Tensor gi, int[] batch_sizes, Tensor h0, Tensor? c0, Tensor? bias_hh, Tensor packed,
    Tensor scale, Tensor? offset, int bits, int group_size, int codes, int code_offset, int act_mode, bool
    act_per_token, float act_eps, int cell, bool reverse) -> (Tensor, Tensor, Tensor)
affineq::lowbit_rnn_layer_bf16_compute(Tensor gi, int[] batch_sizes, Tensor h0, Tensor? c0, Tensor? bias_hh,
    Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int codes, int code_offset, int
    act_mode, bool act_per_token, float act_eps, int cell, bool reverse) -> (Tensor, Tensor, Tensor)
affineq::quantize_float_activation(Tensor x2, str aq) -> (Tensor, Tensor)
affineq::weight_int8pack_mm(Tensor x, Tensor w, Tensor scale) -> Tensor""")
