// affineq::lowbit_rnn_layer: one direction of one LSTM / GRU / RNN layer over every timestep, in C++. Per step
// the recurrent projection h @ W_hh^T runs through lowbit_linear_f32 (the dense format's kernel, the small-M
// paths), optionally on the int8 fake-quantized h (dynamic activation quantization, as linear does), and the
// cell's pointwise math runs in one fused pass; the input projection of all steps (gi) was computed before
// by one batched quantized matmul. Doing the loop here removes ~10 eager op calls per step, which dominate
// at small batch and hidden sizes. A weight computed in bf16 (QuantSpec.compute_dtype; the op
// lowbit_rnn_layer_bf16_compute) multiplies h rounded to bf16 and yields the product's bf16 values, as
// affineq::lowbit_linear_bf16_compute does. Rows follow the PackedSequence convention: step t updates the first
// batch_sizes[t] rows of the state (padded input is the case of equal batch sizes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include "lowbit_kernels.h"
#include "op_checks.h"

namespace affineq {
namespace {

constexpr int kCellLstm = 0, kCellGru = 1, kCellRnnTanh = 2, kCellRnnRelu = 3;

// e^x for x clamped to [-87, 87]: 2^n * p(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2], p the
// degree-7 Taylor polynomial (truncation error < 1e-8 relative). n comes from the 1.5 * 2^23 trick (the sum's
// low mantissa bits are n + 2^22), not floor or a float -> int conversion, which GCC does not vectorize without
// -fno-trapping-math: the loops below run 16 lanes at a time.
inline float exp_approx(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  x = std::min(std::max(x, -87.f), 87.f);
  const float t = x * 1.44269504088896341f + kMagic;
  const float n = t - kMagic;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln2 split in two parts
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t tb;
  std::memcpy(&tb, &t, sizeof(tb));
  const int32_t bits = (tb - 0x4B400000 + 127) << 23;  // 2^n
  float s;
  std::memcpy(&s, &bits, sizeof(s));
  return p * s;
}

inline void sigmoid_(float* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) v[j] = 1.f / (1.f + exp_approx(-v[j]));
}

// tanh(x) = 1 - 2 / (e^(2x) + 1): absolute error about 1e-7 near 0, relative error ~1e-7 elsewhere.
inline void tanh_(float* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) v[j] = 1.f - 2.f / (exp_approx(2.f * v[j]) + 1.f);
}

// One row of the cell. g: [G*H] gate pre-activations from x (gi row, biases included); y: [G*H] h @ W_hh^T;
// bhh: [G*H] or null; h: [H] state in/out (the row of the state buffer), c: [H] (LSTM); tmp: [G*H] scratch.
void cell_row(int cell, int64_t H, const float* g, const float* y, const float* bhh, float* h, float* c,
              float* tmp) {
  const int64_t gates = cell == kCellLstm ? 4 : cell == kCellGru ? 3 : 1;
  const int64_t n = gates * H;
  if (cell == kCellGru) {  // r, z = sig(g + y + b); n = tanh(g_n + r * (y_n + b_n)); h = n + z (h - n)
    for (int64_t j = 0; j < 2 * H; ++j) tmp[j] = g[j] + (y[j] + (bhh ? bhh[j] : 0.f));
    sigmoid_(tmp, 2 * H);
    float* nn = tmp + 2 * H;
    for (int64_t j = 0; j < H; ++j) nn[j] = g[2 * H + j] + tmp[j] * (y[2 * H + j] + (bhh ? bhh[2 * H + j] : 0.f));
    tanh_(nn, H);
    for (int64_t j = 0; j < H; ++j) h[j] = nn[j] + tmp[H + j] * (h[j] - nn[j]);
    return;
  }
  for (int64_t j = 0; j < n; ++j) tmp[j] = g[j] + y[j] + (bhh ? bhh[j] : 0.f);
  if (cell == kCellLstm) {  // i, f, g, o; c = sig(f) c + sig(i) tanh(g); h = sig(o) tanh(c)
    sigmoid_(tmp, 2 * H);
    tanh_(tmp + 2 * H, H);
    sigmoid_(tmp + 3 * H, H);
    for (int64_t j = 0; j < H; ++j) c[j] = tmp[H + j] * c[j] + tmp[j] * tmp[2 * H + j];
    for (int64_t j = 0; j < H; ++j) h[j] = c[j];
    tanh_(h, H);
    for (int64_t j = 0; j < H; ++j) h[j] *= tmp[3 * H + j];
  } else if (cell == kCellRnnTanh) {
    tanh_(tmp, H);
    std::memcpy(h, tmp, H * sizeof(float));
  } else {
    for (int64_t j = 0; j < H; ++j) h[j] = std::max(tmp[j], 0.f);
  }
}

// v[i] = float(bf16(v[i])): torch's rounding (nearest even; NaN stays NaN).
void round_to_bf16_values(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(c10::BFloat16(v[i]));
}

// The x fields of p (p.m rows, p.y set) for h [m, H] computed in bf16: xb = bf16(h) (torch's rounding). Where the
// kernel's path reads bf16 x alone, it writes y's bf16 values itself (y_bf16_values); otherwise it runs on xb's
// values widened into xf, and the caller rounds y (round_to_bf16_values): either way y = float(bf16(h @ W^T)) as
// run_weight_problem's bf16_compute gives it for float32 x.
void bf16_x(LowbitProblem& p, const float* h, int64_t m, int64_t H, uint16_t* xb, float* xf) {
  for (int64_t i = 0; i < m * H; ++i) xb[i] = c10::BFloat16(h[i]).x;
  p.x_bf16 = xb;
  p.allow_int16_x = allow_int16_x(at::kBFloat16);
  p.y_bf16_values = lowbit_bf16_io(p, 0);
  if (p.y_bf16_values) {
    p.x = nullptr;
    return;
  }
  for (int64_t i = 0; i < m * H; ++i) xf[i] = static_cast<float>(c10::BFloat16(xb[i], c10::BFloat16::from_bits()));
  p.x = xf;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rnn_layer(
    const at::Tensor& gi, at::IntArrayRef batch_sizes, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
    const std::optional<at::Tensor>& bias_hh, const at::Tensor& packed, const at::Tensor& scale,
    const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t codes, int64_t code_offset,
    int64_t act_mode, bool act_per_token, double act_eps, int64_t cell, bool reverse, bool bf16_compute) {
  const char* op = bf16_compute ? "affineq::lowbit_rnn_layer_bf16_compute" : "affineq::lowbit_rnn_layer";
  TORCH_CHECK(cell >= 0 && cell <= 3, op, ": cell must be 0 (LSTM), 1 (GRU), 2 (RNN tanh) or 3 (RNN relu)");
  TORCH_CHECK(act_mode >= -1 && act_mode <= 2, op, ": act_mode must be -1 (float h) or an int8_fake_quant mode");
  TORCH_CHECK(!(bf16_compute && act_mode >= 0), op,
              ": bf16_compute is for float h (weight-only configs); dynamic int8 h takes act_mode alone");
  const int64_t gates = cell == kCellLstm ? 4 : cell == kCellGru ? 3 : 1;
  TORCH_CHECK(h0.dim() == 2 && h0.scalar_type() == at::kFloat && h0.device().is_cpu(), op,
              ": h0 must be a float32 CPU tensor [batch, hidden]");
  const int64_t B = h0.size(0), H = h0.size(1), n = gates * H;
  TORCH_CHECK(H % 8 == 0, op, ": hidden_size must be a multiple of 8, got ", H);
  TORCH_CHECK(gi.dim() == 2 && gi.size(1) == n && gi.scalar_type() == at::kFloat && gi.device().is_cpu(), op,
              ": gi must be a float32 CPU tensor [N, ", n, "], got ", gi.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == n * H / 8 * bits, op,
              ": packed must hold the [", n, ", ", H, "] recurrent weight, ", n * H / 8 * bits, " bytes");
  int64_t total = 0;
  for (const int64_t b : batch_sizes) {
    TORCH_CHECK(b >= 1 && b <= B, op, ": batch sizes must be in [1, ", B, "], got ", b);
    total += b;
  }
  TORCH_CHECK(total == gi.size(0), op, ": the batch sizes sum to ", total, " but gi has ", gi.size(0), " rows");
  const bool lstm = cell == kCellLstm;
  TORCH_CHECK(!lstm || (c0.has_value() && c0->sizes() == h0.sizes() && c0->scalar_type() == at::kFloat), op,
              ": an LSTM needs c0 like h0");
  const bool has_bhh = bias_hh.has_value() && bias_hh->defined();
  TORCH_CHECK(!has_bhh || (bias_hh->numel() == n && bias_hh->scalar_type() == at::kFloat), op,
              ": bias_hh must be float32 with ", n, " elements");
  const bool has_offset = offset.has_value() && offset->defined();
  const at::Tensor pk = packed.contiguous(), sc = scale.contiguous();
  const at::Tensor of = has_offset ? offset->contiguous() : at::Tensor();
  const at::Tensor g = gi.contiguous();
  const at::Tensor bh = has_bhh ? bias_hh->contiguous() : at::Tensor();
  at::Tensor h = h0.contiguous().clone();
  at::Tensor c = lstm ? c0->contiguous().clone() : at::empty({0}, h0.options());
  at::Tensor out = at::empty({total, H}, h0.options());
  at::Tensor y = at::empty({B, n}, h0.options());
  at::Tensor xq = at::empty({act_mode >= 0 || bf16_compute ? B : 0, H}, h0.options());
  at::Tensor xb = at::empty({bf16_compute ? B : 0, H}, h0.options().dtype(at::kBFloat16));
  at::Tensor tmp = at::empty({B, n}, h0.options());
  std::vector<int64_t> starts(batch_sizes.size());
  for (size_t t = 0, s = 0; t < batch_sizes.size(); s += batch_sizes[t], ++t) starts[t] = static_cast<int64_t>(s);

  LowbitProblem p;
  p.ldx = H;
  set_weight(p, pk.const_data_ptr(), sc.const_data_ptr(), has_offset ? of.const_data_ptr() : nullptr,
             sc.scalar_type(), code_offset, bits, codes, group_size, n, H);
  p.ldy = n;
  p.y = y.mutable_data_ptr<float>();
  float* hp = h.mutable_data_ptr<float>();
  float* cp = lstm ? c.mutable_data_ptr<float>() : nullptr;
  const float* gp = g.const_data_ptr<float>();
  const float* bp = has_bhh ? bh.const_data_ptr<float>() : nullptr;
  float* op_ = out.mutable_data_ptr<float>();
  float* tp = tmp.mutable_data_ptr<float>();
  const int64_t steps = static_cast<int64_t>(batch_sizes.size());
  // Dynamic int8 state with an 8-bit integer weight: exact int8 code products (gemm_int8_codes.cpp).
  std::unique_ptr<Int8CodesGemm> i8;
  if (act_mode >= 0 && p.bits == 8 && Int8CodesGemm::supported(p)) i8 = std::make_unique<Int8CodesGemm>(p, act_mode == 2);
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t t = reverse ? steps - 1 - i : i;
    const int64_t b = batch_sizes[t], s = starts[t];
    if (i8) {
      i8->run(hp, b, act_per_token, static_cast<int>(act_mode), static_cast<float>(act_eps), p.y);
    } else if (act_mode >= 0) {
      int8_fake_quant_f32(hp, b, H, act_per_token, static_cast<int>(act_mode), static_cast<float>(act_eps),
                          std::numeric_limits<float>::max(), xq.mutable_data_ptr<float>());
      p.x = xq.const_data_ptr<float>();
    } else if (bf16_compute) {
      p.m = b;
      bf16_x(p, hp, b, H, reinterpret_cast<uint16_t*>(xb.mutable_data_ptr()), xq.mutable_data_ptr<float>());
    } else {
      p.x = hp;
    }
    p.m = b;
    if (!i8) lowbit_linear_f32(p, 0);
    if (bf16_compute && !p.y_bf16_values) round_to_bf16_values(p.y, b * n);
    const float* yp = p.y;
    at::parallel_for(0, b, std::max<int64_t>(1, 8192 / n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        cell_row(static_cast<int>(cell), H, gp + (s + r) * n, yp + r * n, bp, hp + r * H,
                 lstm ? cp + r * H : nullptr, tp + r * n);
    });
    std::memcpy(op_ + s * H, hp, b * H * sizeof(float));
  }
  return {out, h, c};
}

// The two ops (their schemas never change: a new argument is a new op), kBf16: lowbit_rnn_layer_bf16_compute.
template <bool kBf16>
std::tuple<at::Tensor, at::Tensor, at::Tensor> rnn_layer_op(
    const at::Tensor& gi, at::IntArrayRef batch_sizes, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
    const std::optional<at::Tensor>& bias_hh, const at::Tensor& packed, const at::Tensor& scale,
    const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t codes, int64_t code_offset,
    int64_t act_mode, bool act_per_token, double act_eps, int64_t cell, bool reverse) {
  return rnn_layer(gi, batch_sizes, h0, c0, bias_hh, packed, scale, offset, bits, group_size, codes, code_offset,
                   act_mode, act_per_token, act_eps, cell, reverse, kBf16);
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) {
  m.impl("lowbit_rnn_layer", &affineq::rnn_layer_op<false>);
  m.impl("lowbit_rnn_layer_bf16_compute", &affineq::rnn_layer_op<true>);
}
