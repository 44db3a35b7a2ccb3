// torch op binding: argument checks, dtype/layout plumbing, autograd and registration.
// The schemas of affineq::lowbit_linear / affineq::lowbit_dequantize are defined from Python
// (affineq/cpp/__init__.py) so that the ops exist, with fake impls, even where this library cannot be
// built; this file adds the CPU kernels and the autograd kernel (in C++: a Python autograd kernel would add
// its overhead to every call, including no-grad inference; see benchmarks/README.md, kernel design
// measurements).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "lowbit_kernels.h"
#include "op_checks.h"

namespace affineq {
namespace {
std::atomic<bool> g_disabled{false};
}  // namespace

bool kernels_disabled() { return g_disabled.load(); }

int64_t packed_nbytes(int64_t n, int64_t k, int64_t bits) { return n * ((k + 7) / 8) * bits; }

// AFFINEQ_KERNELS_INT16_X: "1" lets the VNNI GEMM (m >= 3) round x to 16-bit fixed point for every input
// dtype, "0" never; unset ("auto"): only for bf16/fp16 x, whose output cast (2^-9 / 2^-12) dwarfs that error,
// so fp32 x keeps fp32-exact products.
bool allow_int16_x(at::ScalarType xt) {
  const char* v = std::getenv("AFFINEQ_KERNELS_INT16_X");
  const std::string mode = v != nullptr ? v : "auto";
  if (mode == "1" || mode == "always") return true;
  if (mode == "0" || mode == "never") return false;
  return xt != at::kFloat;  // "auto"
}

void check_bias(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == x.scalar_type() &&
                        bias->device().is_cpu()),
              op, ": bias must be a CPU tensor [n=", n, "] of x's dtype ", x.scalar_type(), ", got ",
              bias->scalar_type(), " ", bias->sizes());
}

namespace {

// codes: kCodesUint (any bits), a float8 kind (bits 8), fp4 (bits 4) or an fp6 kind (bits 6).
bool codes_ok(int64_t codes, int64_t bits) {
  switch (codes) {
    case kCodesUint: return true;
    case kCodesE4M3: case kCodesE5M2: return bits == 8;
    case kCodesFp4E2M1: return bits == 4;
    case kCodesFp6E2M3: case kCodesFp6E3M2: return bits == 6;
    default: return false;
  }
}

}  // namespace

// scale [n, k / group_size]: float32, bfloat16, float16, or uint8 e8m0 exponent bytes; offset: None or the same
// dtype and shape (not with e8m0). Without an offset the offset is scale * code_offset, which needs 16-bit or e8m0
// scales when code_offset != 0 (exact products; fp32 scales fold it into an offset tensor). Returns whether the
// qparams are e8m0.
bool check_qparams(const char* op, const at::Tensor& scale, const std::optional<at::Tensor>& offset_opt,
                   int64_t bits, int64_t codes, int64_t code_offset, int64_t n, int64_t G) {
  TORCH_CHECK(codes_ok(codes, bits), op,
              ": codes must be 0 (unsigned integers), 1 (float8_e4m3fn) or 2 (float8_e5m2, both with bits=8), 3 "
              "(fp4_e2m1, bits=4), 4 (fp6_e2m3) or 5 (fp6_e3m2, both bits=6), got codes=", codes, ", bits=", bits);
  const at::ScalarType st = scale.scalar_type();
  const bool e8m0 = st == at::kByte, half = st == at::kBFloat16 || st == at::kHalf;
  TORCH_CHECK((e8m0 || half || st == at::kFloat) && scale.device().is_cpu(), op,
              ": scale must be a float32, bfloat16, float16 or uint8 (e8m0) CPU tensor, got ", st, " on ",
              scale.device());
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.size(1) == G, op,
              ": scale must have shape [n, k // group_size] = [", n, ", ", G, "], got ", scale.sizes());
  const bool has_offset = offset_opt.has_value() && offset_opt->defined();
  if (has_offset) {
    const at::Tensor& offset = *offset_opt;
    TORCH_CHECK(!e8m0, op, ": e8m0 (uint8) scales store no offset: pass offset=None and the code offset as "
                "code_offset");
    TORCH_CHECK(offset.scalar_type() == st && offset.device().is_cpu() && offset.sizes() == scale.sizes(), op,
                ": offset must be a CPU tensor of scale's dtype ", st, " and shape ", scale.sizes(), ", got ",
                offset.scalar_type(), " ", offset.sizes(), " on ", offset.device());
    TORCH_CHECK(code_offset == 0, op, ": code_offset applies without an offset tensor only; fold it into offset");
  } else {
    TORCH_CHECK(code_offset == 0 || e8m0 || half, op, ": code_offset=", code_offset, " needs 16-bit or e8m0 "
                "scales (scale * code_offset exact); with float32 scales pass offset = scale * code_offset");
  }
  TORCH_CHECK(code_offset >= -(1 << 16) && code_offset <= (1 << 16), op, ": code_offset must be small, got ",
              code_offset);
  TORCH_CHECK(st != at::kBFloat16 || codes == kCodesUint, op,
              ": bfloat16 qparams (the W = scale * (u - 2^(bits-1)) + zero convention) need integer codes");
  return e8m0;
}

namespace {

// lowbit_linear's argument checks (also lowbit_linear_multi's, per weight).
void check_lowbit_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                         int64_t k, int64_t codes, int64_t code_offset) {
  TORCH_CHECK(!g_disabled.load(),
              "affineq::lowbit_linear: the affineq C++ kernels are disabled (AFFINEQ_DISABLE_CPP_KERNELS=1 or "
              "affineq.kernels._set_disabled(True)); use affineq.kernels.lowbit_linear_reference instead");
  TORCH_CHECK(bits >= 1 && bits <= 8, "affineq::lowbit_linear: bits must be in [1, 8], got ", bits);
  TORCH_CHECK(n >= 0 && k > 0, "affineq::lowbit_linear: need n >= 0 and k > 0, got n=", n, ", k=", k);
  TORCH_CHECK(group_size > 0 && k % group_size == 0,
              "affineq::lowbit_linear: group_size must divide k, got group_size=", group_size, ", k=", k);
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "affineq::lowbit_linear: x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK(x.device().is_cpu(), "affineq::lowbit_linear: x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "affineq::lowbit_linear: x must have shape [..., k=", k, "], got ",
              x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.device().is_cpu(),
              "affineq::lowbit_linear: packed must be a uint8 CPU tensor (from pack_codes), got ",
              packed.scalar_type(), " on ", packed.device());
  TORCH_CHECK(packed.numel() == packed_nbytes(n, k, bits), "affineq::lowbit_linear: packed must hold ",
              packed_nbytes(n, k, bits), " bytes for n=", n, ", k=", k, ", bits=", bits, ", got ", packed.numel());
  check_qparams("affineq::lowbit_linear", scale, offset, bits, codes, code_offset, n, k / group_size);
}

at::Tensor lowbit_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                              int64_t k, int64_t codes, int64_t path, int64_t code_offset,
                              std::optional<at::ScalarType> compute_dtype,
                              const std::optional<at::Tensor>& bias = std::nullopt) {
  const bool bf16_compute = compute_dtype.has_value();
  TORCH_CHECK(!bf16_compute || (*compute_dtype == at::kBFloat16 &&
                                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)),
              "affineq::lowbit_linear: compute_dtype must be None or torch.bfloat16 with a float32 or bfloat16 x, "
              "got ", compute_dtype.value_or(at::kFloat), " with ", x.scalar_type());
  check_lowbit_linear(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset);
  check_bias("affineq::lowbit_linear", x, bias, n);
  const WeightTensors w(packed, scale, offset, code_offset, bits, codes, group_size, n, k);
  return run_weight_problem(x, w.p, path, bf16_compute, bias);
}

}  // namespace

WeightTensors::WeightTensors(const at::Tensor& packed_, const at::Tensor& scale_,
                             const std::optional<at::Tensor>& offset_, int64_t code_offset, int64_t bits,
                             int64_t codes, int64_t group_size, int64_t n, int64_t k)
    : packed(packed_.contiguous()), scale(scale_.contiguous()),
      offset(offset_.has_value() && offset_->defined() ? offset_->contiguous() : at::Tensor()) {
  set_weight(p, packed.const_data_ptr(), scale.const_data_ptr(), offset.defined() ? offset.const_data_ptr() : nullptr,
             scale.scalar_type(), code_offset, bits, codes, group_size, n, k);
}

void set_weight(LowbitProblem& p, const void* packed, const void* scale, const void* offset, at::ScalarType qdtype,
                int64_t code_offset, int64_t bits, int64_t codes, int64_t group_size, int64_t n, int64_t k) {
  p.packed = static_cast<const uint8_t*>(packed);
  p.scale = scale;
  p.offset = offset;
  p.qparams_bf16 = qdtype == at::kBFloat16;
  p.qparams_f16 = qdtype == at::kHalf;
  p.qparams_e8m0 = qdtype == at::kByte;
  p.code_offset = static_cast<int>(code_offset);
  p.bits = static_cast<int>(bits);
  p.codes = static_cast<int>(codes);
  p.group_size = group_size;
  p.n = n;
  p.k = k;
}

// y (fp32 [M, n]) as x's dtype xt (bf16 or fp16), each value rounded as y.to(xt) rounds it, then, if b32 (fp32
// [n]) is defined, plus its bias with the sum rounded (as aten's add of two xt tensors): one pass, by loops (aten's
// cast costs microseconds, a 576-wide layer's whole GEMV), in threads only for large y.
at::Tensor to_dtype(const at::Tensor& y, at::ScalarType xt, const at::Tensor& b32) {
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(xt));
  const int64_t M = y.size(0), n = y.size(1);
  const float* src = y.const_data_ptr<float>();
  const float* b = b32.defined() ? b32.const_data_ptr<float>() : nullptr;
  const auto run = [&](auto* dst) {
    using T = std::remove_pointer_t<decltype(dst)>;
    at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, n)),
                     [&](int64_t m0, int64_t m1) {
                       for (int64_t m = m0; m < m1; ++m)
                         for (int64_t c = 0; c < n; ++c) {
                           const T v = static_cast<T>(src[m * n + c]);
                           dst[m * n + c] = b != nullptr ? static_cast<T>(static_cast<float>(v) + b[c]) : v;
                         }
                     });
  };
  if (xt == at::kBFloat16) run(out.mutable_data_ptr<at::BFloat16>());
  else run(out.mutable_data_ptr<at::Half>());
  return out;
}

at::Tensor run_weight_problems(const at::Tensor& x, std::vector<LowbitProblem> ps, int64_t path,
                               bool bf16_compute = false, const std::optional<at::Tensor>& bias = std::nullopt) {
  const int64_t k = ps[0].k;
  int64_t n = 0;
  for (const LowbitProblem& p : ps) n += p.n;
  const auto xt = x.scalar_type();
  const at::Tensor x2 = x.reshape({-1, k});
  const int64_t M = x2.size(0);
  // float32 x computed in bf16: the bf16 paths read x rounded (one bf16 copy) and write y's bf16 values widened
  // (no bf16 copy of y); any other path runs bf16 x as the caller's x.to(bf16) would, y widened after.
  const bool round_x = bf16_compute && xt == at::kFloat;
  const at::Tensor b32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // bf16 / fp16 values exact
  const int64_t K8 = (k + 7) / 8 * 8;
  static const uint16_t dummy = 0;
  bool path5_rounds = false;  // path 5 rounds float32 x's rows itself as it packs them (no bf16 copy of x)
  if (round_x) {
    LowbitProblem probe = ps[0];
    probe.m = M;
    probe.x_bf16 = &dummy;
    probe.allow_int16_x = allow_int16_x(at::kBFloat16);
    if (!lowbit_bf16_io(probe, static_cast<int>(path))) {
      at::Tensor y = run_weight_problems(x.to(at::kBFloat16), std::move(ps), path).to(at::kFloat);
      return bias ? y.add_(b32) : y;
    }
    path5_rounds = K8 == k && x2.is_contiguous() && lowbit_path(probe, static_cast<int>(path)) == 5;
  }
  // A few rows of bf16 x that a path reads as fp32 (one row on the digits GEMV: decode) are widened here, and y
  // rounded back below, by loops: aten's casts cost microseconds each, a 576-wide layer's whole GEMV.
  const bool small_bf16 = xt == at::kBFloat16 && M * K8 <= (int64_t{1} << 14) && x2.is_contiguous();
  // The kernels read whole 8-column units: x is zero-padded to K8 columns instead of special-casing the tail.
  const auto padded = [&](at::ScalarType dt) {
    if (small_bf16 && dt == at::kFloat) {
      at::Tensor t = at::empty({M, K8}, x2.options().dtype(at::kFloat));
      const auto* src = x2.const_data_ptr<at::BFloat16>();
      float* dst = t.mutable_data_ptr<float>();
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < K8; ++c) dst[r * K8 + c] = c < k ? static_cast<float>(src[r * k + c]) : 0.f;
      return t;
    }
    if (K8 == k) return x2.to(dt).contiguous();
    at::Tensor t = at::zeros({M, K8}, x2.options().dtype(dt));
    t.narrow(1, 0, k).copy_(x2);
    return t;
  };
  at::Tensor xb;  // bf16 x as given (or rounded: round_x), for the bf16 dot-product path
  if ((xt == at::kBFloat16 || round_x) && !path5_rounds) xb = padded(at::kBFloat16);
  for (LowbitProblem& p : ps) {
    p.x_bf16 = path5_rounds ? &dummy : xb.defined() ? reinterpret_cast<const uint16_t*>(xb.const_data_ptr()) : nullptr;
    p.x_round = path5_rounds ? x2.const_data_ptr<float>() : nullptr;
    p.m = M;
    p.ldx = K8;
    p.allow_int16_x = allow_int16_x(round_x ? at::kBFloat16 : xt);
  }
  // The bf16 paths read only x_bf16 and write y in bf16 (round_x: its values as fp32): no fp32 copy of x or y for
  // them (the problems share a configuration, so a path).
  const bool bf16_path = lowbit_bf16_io(ps[0], static_cast<int>(path));
  const bool y_bf16 = bf16_path && !round_x;
  const at::Tensor xf = bf16_path ? at::Tensor() : padded(at::kFloat);
  at::Tensor y = at::empty({M, n}, x2.options().dtype(y_bf16 ? at::kBFloat16 : at::kFloat));
  // The kernels add the bias where y is stored in x's dtype; an fp32 y for bf16 / fp16 x gets it as it is
  // converted below (after its rounding to x's dtype, as the separate add would see it).
  const bool kernel_bias = bias && (xt == at::kFloat || y_bf16);
  if (M > 0 && n > 0) {
    int64_t col = 0;  // each problem writes its columns of y
    for (LowbitProblem& p : ps) {
      p.x = xf.defined() ? xf.const_data_ptr<float>() : nullptr;
      p.bias = kernel_bias ? b32.const_data_ptr<float>() + col : nullptr;
      p.y_bf16_values = round_x;
      if (y_bf16) p.y_bf16 = reinterpret_cast<uint16_t*>(y.mutable_data_ptr()) + col;
      else p.y = y.mutable_data_ptr<float>() + col;
      p.ldy = n;
      col += p.n;
    }
    lowbit_linear_multi_f32(ps.data(), static_cast<int64_t>(ps.size()), static_cast<int>(path));
  }
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  if (bias && !kernel_bias) return to_dtype(y, xt, b32).view(out_sizes);  // fp32 y, bf16 / fp16 x
  if (small_bf16 && !y_bf16 && M * n <= (int64_t{1} << 16)) return to_dtype(y, xt, at::Tensor()).view(out_sizes);
  return y.to(xt).view(out_sizes);
}

at::Tensor run_weight_problem(const at::Tensor& x, LowbitProblem p, int64_t path, bool bf16_compute,
                              const std::optional<at::Tensor>& bias) {
  return run_weight_problems(x, {p}, path, bf16_compute, bias);
}

namespace {

// lowbit_linear_multi: lowbit_linear's checks for each weight, then one run over all of them (dispatch.cpp's
// lowbit_linear_multi_f32).
at::Tensor lowbit_linear_multi_cpu(const at::Tensor& x, at::TensorList packed, at::TensorList scale,
                                   const c10::List<std::optional<at::Tensor>>& offset, int64_t bits, int64_t group_size,
                                   at::IntArrayRef n, int64_t k, int64_t codes, int64_t code_offset) {
  const char* op = "affineq::lowbit_linear_multi";
  const size_t count = packed.size();
  TORCH_CHECK(count >= 1 && scale.size() == count && offset.size() == count && n.size() == count, op,
              ": packed, scale, offset and n must have one entry per weight (at least one), got ", packed.size(),
              ", ", scale.size(), ", ", offset.size(), ", ", n.size());
  std::vector<at::Tensor> keep;  // contiguous copies (if any) live until the run ends
  std::vector<LowbitProblem> ps(count);
  for (size_t i = 0; i < count; ++i) {
    const std::optional<at::Tensor> of = offset.get(i);
    const bool has_offset = of.has_value() && of->defined();
    check_lowbit_linear(x, packed[i], scale[i], of, bits, group_size, n[i], k, codes, code_offset);
    TORCH_CHECK(scale[i].scalar_type() == scale[0].scalar_type() && has_offset == (offset.get(0).has_value() &&
                offset.get(0)->defined()), op, ": every weight needs the same qparam dtype and offset presence");
    keep.push_back(packed[i].contiguous());
    keep.push_back(scale[i].contiguous());
    keep.push_back(has_offset ? of->contiguous() : at::Tensor());
    set_weight(ps[i], keep[3 * i].const_data_ptr(), keep[3 * i + 1].const_data_ptr(),
               has_offset ? keep[3 * i + 2].const_data_ptr() : nullptr, scale[i].scalar_type(), code_offset, bits,
               codes, group_size, n[i], k);
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // an inference op: no derivative
  return run_weight_problems(x.detach(), ps, 0);
}

}  // namespace

namespace {

at::Tensor lowbit_dequantize_cpu(const at::Tensor& packed, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                                 int64_t k, int64_t codes, int64_t code_offset) {
  TORCH_CHECK(bits >= 1 && bits <= 8, "affineq::lowbit_dequantize: bits must be in [1, 8], got ", bits);
  TORCH_CHECK(n >= 0 && k > 0 && group_size > 0 && k % group_size == 0,
              "affineq::lowbit_dequantize: need n >= 0, k > 0 and group_size dividing k, got n=", n, ", k=", k,
              ", group_size=", group_size);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == packed_nbytes(n, k, bits),
              "affineq::lowbit_dequantize: packed must be uint8 with ", packed_nbytes(n, k, bits), " elements");
  const bool e8m0 =
      check_qparams("affineq::lowbit_dequantize", scale, offset, bits, codes, code_offset, n, k / group_size);
  const at::Tensor pk = packed.contiguous(), sc = scale.contiguous();
  const bool has_offset = offset.has_value() && offset->defined();
  const at::Tensor of = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor w = at::empty({n, k}, scale.options().dtype(at::kFloat));
  if (n > 0)
    dequantize_f32(pk.const_data_ptr<uint8_t>(), sc.const_data_ptr(), has_offset ? of.const_data_ptr() : nullptr,
                   sc.scalar_type() == at::kBFloat16, sc.scalar_type() == at::kHalf, e8m0, static_cast<int>(code_offset), static_cast<int>(bits),
                   static_cast<int>(codes), group_size, n, k, w.mutable_data_ptr<float>());
  return w;
}

at::Tensor int8_fake_quant_cpu(const at::Tensor& x, bool per_token, int64_t mode, double eps) {
  TORCH_CHECK(x.dim() == 2, "affineq::int8_fake_quant: x must be 2-D [M, K], got ", x.dim(), "-D");
  TORCH_CHECK(mode >= 0 && mode <= 2, "affineq::int8_fake_quant: mode must be 0, 1 or 2, got ", mode);
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && x.scalar_type() != at::kDouble,
              "affineq::int8_fake_quant: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  if (x.scalar_type() == at::kBFloat16) {  // one pass, no fp32 copies of x and y
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty_like(xc);
    if (xc.numel() > 0)
      int8_fake_quant_bf16(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>()), xc.size(0),
                           xc.size(1), per_token, static_cast<int>(mode), static_cast<float>(eps),
                           reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>()));
    return y;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(xf);
  const double out_max = x.scalar_type() == at::kFloat      ? std::numeric_limits<float>::max()
                         : x.scalar_type() == at::kBFloat16 ? static_cast<double>(std::numeric_limits<c10::BFloat16>::max())
                                                            : static_cast<double>(std::numeric_limits<c10::Half>::max());
  if (xf.numel() > 0)
    int8_fake_quant_f32(xf.const_data_ptr<float>(), xf.size(0), xf.size(1), per_token, static_cast<int>(mode),
                        static_cast<float>(eps), static_cast<float>(out_max), y.mutable_data_ptr<float>());
  return y.to(x.scalar_type());
}

at::Tensor lowbit_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                             int64_t k, int64_t codes, int64_t code_offset) {
  return lowbit_linear_impl(x, packed, scale, offset, bits, group_size, n, k, codes, 0, code_offset, std::nullopt);
}

// affineq::lowbit_linear_int8_act: lowbit_linear(int8_fake_quant(x, per_token, mode, eps), ...) bit for bit, for
// x [..., k]. Where path 5 runs (bf16 x, AMX) the rows are quantized as the GEMM packs them (gemm_amx.cpp): no
// quantized copy of x is written to memory and read back, and no second op call; elsewhere the two ops in turn.
// bf16_compute (affineq::lowbit_linear_int8_act_bf16_compute): float32 x is rounded to bf16 first and the bf16
// result returned widened to float32, written so by path 5 itself (no bf16 copy of y).
at::Tensor int8_act_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                         int64_t k, int64_t codes, int64_t code_offset, bool per_token, int64_t mode, double eps,
                         bool bf16_compute) {
  const char* op = bf16_compute ? "affineq::lowbit_linear_int8_act_bf16_compute" : "affineq::lowbit_linear_int8_act";
  check_lowbit_linear(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset);
  TORCH_CHECK(mode >= 0 && mode <= 2, op, ": mode must be an int8_fake_quant mode (0, 1 or 2), got ", mode);
  TORCH_CHECK(!bf16_compute || x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16 (it is computed in bfloat16), got ", x.scalar_type());
  const bool round_x = bf16_compute && x.scalar_type() == at::kFloat;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  // float32 x computing in bf16 on path 5: run_weight_problems has the GEMM round each row as it packs it (before
  // the quantization) and write y widened; only per-tensor qparams need x's bf16 values first, to choose them.
  const at::Tensor xq = round_x && !per_token ? x2.to(at::kBFloat16) : x2;
  if ((x2.scalar_type() == at::kBFloat16 || round_x) && x2.size(0) > 0) {
    static const uint16_t dummy = 0;
    WeightTensors w(packed, scale, offset, code_offset, bits, codes, group_size, n, k);
    LowbitProblem& p = w.p;
    const auto* xb = xq.scalar_type() == at::kBFloat16
                         ? reinterpret_cast<const uint16_t*>(xq.const_data_ptr<at::BFloat16>())
                         : &dummy;  // per token: int8_x_quant reads no x
    p.m = x2.size(0);
    p.x_bf16 = xb;
    p.allow_int16_x = allow_int16_x(at::kBFloat16);
    if (lowbit_path(p) == 5) {
      const Int8XQuant q = int8_x_quant(xb, x2.size(0), k, per_token, static_cast<int>(mode), static_cast<float>(eps));
      p.x_quant = &q;
      return run_weight_problems(x2, {p}, 5, round_x).view(sizes);
    }
  }
  const at::Tensor xr = round_x ? (per_token ? x2.to(at::kBFloat16) : xq) : x2;
  const at::Tensor y = lowbit_linear_cpu(int8_fake_quant_cpu(xr, per_token, mode, eps), packed, scale, offset, bits,
                                         group_size, n, k, codes, code_offset);
  return (round_x ? y.to(at::kFloat) : y).view(sizes);
}

at::Tensor lowbit_linear_int8_act_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                      const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size,
                                      int64_t n, int64_t k, int64_t codes, int64_t code_offset, bool per_token,
                                      int64_t mode, double eps) {
  return int8_act_impl(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, per_token, mode, eps,
                       false);
}

at::Tensor lowbit_linear_int8_act_bf16_compute_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                   const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                                                   int64_t bits, int64_t group_size, int64_t n, int64_t k,
                                                   int64_t codes, int64_t code_offset, bool per_token, int64_t mode,
                                                   double eps) {
  return int8_act_impl(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset, per_token, mode, eps,
                       true);
}

// lowbit_linear for x.to(bf16), widened back to x's dtype: float32 x is rounded and y widened by the bf16 kernels
// themselves (run_weight_problems). Its own op: a changed lowbit_linear schema would break graphs that
// torch.compile cached calling the old one.
at::Tensor lowbit_linear_bf16_compute_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                          const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size,
                                          int64_t n, int64_t k, int64_t codes, int64_t code_offset) {
  const char* op = "affineq::lowbit_linear_bf16_compute";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16 (it is computed in bfloat16), got ", x.scalar_type());
  TORCH_CHECK(!(x.requires_grad() && at::GradMode::is_enabled()), op,
              ": an inference op (no derivative): for a gradient call affineq::lowbit_linear on x.to(torch.bfloat16)");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return lowbit_linear_impl(x, packed, scale, offset, bits, group_size, n, k, codes, 0, code_offset,
                            at::kBFloat16);
}

// dL/dx = dL/dy @ W (W dequantized to fp32); codes, scale and offset get no gradient.
// Both directions go through the dispatcher, so fake tensors (torch.compile / AOTAutograd) work too.
class LowbitLinearFunction : public torch::autograd::Function<LowbitLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scale, const std::optional<at::Tensor>& offset, int64_t bits,
                            int64_t group_size, int64_t n, int64_t k, int64_t codes, int64_t code_offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("affineq::lowbit_linear", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                                           int64_t, int64_t)>();
    ctx->save_for_backward({packed, scale, offset.value_or(at::Tensor())});  // undefined: e8m0 (no offset)
    ctx->saved_data["meta"] = std::vector<int64_t>{bits, group_size, n, k, codes, code_offset};
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto deq = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("affineq::lowbit_dequantize", "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t)>();
    const auto saved = ctx->get_saved_variables();
    const auto meta = ctx->saved_data["meta"].toIntVector();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    at::Tensor gx;
    if (ctx->needs_input_grad(0)) {
      const std::optional<at::Tensor> off = saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
      const at::Tensor w = deq.call(saved[0], saved[1], off, meta[0], meta[1], meta[2], meta[3], meta[4], meta[5]);
      gx = grads[0].to(at::kFloat).matmul(w).to(dtype);
    }
    return {gx,           at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// affineq::lowbit_linear_biased: lowbit_linear (bf16_compute: lowbit_linear_bf16_compute) + bias, bit for bit,
// with bias [n] in x's dtype added as the kernels store y (run_weight_problem): no separate pass over y. An
// inference op: the route that takes it (linear_kernels.py) keeps the add outside while autograd records.
at::Tensor lowbit_linear_biased_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                    const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size,
                                    int64_t n, int64_t k, int64_t codes, int64_t code_offset, bool bf16_compute,
                                    const at::Tensor& bias) {
  const char* op = "affineq::lowbit_linear_biased";
  TORCH_CHECK(!bf16_compute || x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16 with bf16_compute (it is computed in bfloat16), got ", x.scalar_type());
  TORCH_CHECK(!((x.requires_grad() || bias.requires_grad()) && at::GradMode::is_enabled()), op,
              ": an inference op (no derivative): for a gradient call affineq::lowbit_linear and add the bias");
  check_bias(op, x, bias, n);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return lowbit_linear_impl(x, packed, scale, offset, bits, group_size, n, k, codes, 0, code_offset,
                            bf16_compute ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt, bias);
}

at::Tensor lowbit_linear_autograd(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size,
                                  int64_t n, int64_t k, int64_t codes, int64_t code_offset) {
  return LowbitLinearFunction::apply(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset);
}

// Which path lowbit_linear would run for x and a `bits`-bit [n, x.size(-1)] weight (tests assert it; the kernel
// itself decides in lowbit_path).
int64_t lowbit_path_for(const at::Tensor& x, int64_t group_size, int64_t codes, int64_t path, int64_t bits,
                        int64_t n) {
  LowbitProblem p;
  p.bits = static_cast<int>(bits);
  p.n = n;
  p.k = x.size(-1);
  p.m = x.numel() / std::max<int64_t>(1, x.size(-1));
  p.group_size = group_size;
  p.codes = static_cast<int>(codes);
  p.allow_int16_x = allow_int16_x(x.scalar_type());
  static const uint16_t dummy = 0;
  p.x_bf16 = x.scalar_type() == at::kBFloat16 ? &dummy : nullptr;
  return lowbit_path(p, static_cast<int>(path));
}

// affineq::int8_codes_linear: y = int8_fake_quant(x) @ W^T for an 8- or 4-bit integer dense weight,
// through Int8CodesGemm (exact int32 sums of the code products, gemm_int8_codes.cpp). bf16_compute
// (affineq::int8_codes_linear_bf16_compute): float32 x is read as x.to(bf16) and y written as the bf16 result's
// values widened, by the kernel itself (no bf16 copy of x or y).
at::Tensor int8_codes_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const std::optional<at::Tensor>& offset, int64_t group_size, int64_t n, int64_t k,
                           bool per_token, int64_t mode, double eps, int64_t bits, int64_t code_offset,
                           int64_t min_rows, bool bf16_compute, const std::optional<at::Tensor>& bias = std::nullopt) {
  const char* op = bias ? "affineq::int8_codes_linear_biased"
                        : bf16_compute ? "affineq::int8_codes_linear_bf16_compute" : "affineq::int8_codes_linear";
  TORCH_CHECK(!g_disabled.load(), op, ": the affineq C++ kernels are disabled");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.device().is_cpu(),
              op, ": x must be a float32 or bfloat16 CPU tensor [m, k=", k, "], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(mode >= 0 && mode <= 2, op, ": mode must be an int8_fake_quant mode (0, 1 or 2), got ", mode);
  TORCH_CHECK(group_size > 0 && k % group_size == 0, op, ": group_size must divide k, got group_size=",
              group_size, ", k=", k);
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == packed_nbytes(n, k, bits), op,
              ": packed must be uint8 with ", packed_nbytes(n, k, bits), " elements (", bits, "-bit codes)");
  check_qparams(op, scale, offset, bits, kCodesUint, code_offset, n, k / group_size);
  const WeightTensors w(packed, scale, offset, code_offset, bits, kCodesUint, group_size, n, k);
  const LowbitProblem& p = w.p;  // e8m0: refused by supported()
  TORCH_CHECK(Int8CodesGemm::supported(p), op, ": this build or weight is not one the kernel reads (AVX512-VNNI "
              "and VBMI builds; fp32 / bf16 / fp16 qparams, n % 16 == 0, group_size % 8 == 0); use "
              "affineq::lowbit_linear");
  check_bias(op, x, bias, n);  // in y's dtype (x's), added as y is stored: the values of a separate add after the op
  if (x.size(0) < min_rows) {  // the fused GEMV on the fake-quantized x: the same product, faster at few rows
    at::Tensor y = int8_act_impl(x, packed, scale, offset, bits, group_size, n, k, kCodesUint, code_offset, per_token,
                                 mode, eps, bf16_compute);
    return bias ? y.add_(*bias) : y;
  }
  // The int8 path quantizes x in fp32 (bf16 x widened row by row: the same codes as int8_fake_quant computes)
  // and rounds y to x's dtype as it stores it; the fallback above runs in x's dtype.
  const at::Tensor xc = x.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({x.size(0), n}, xc.options());
  if (x.size(0) > 0 && n > 0) {
    Int8CodesGemm gemm(p, mode == 2, /*per_item=*/true);
    const auto* xb = bf16 ? reinterpret_cast<const uint16_t*>(xc.const_data_ptr()) : nullptr;
    auto* yb = bf16 ? reinterpret_cast<uint16_t*>(y.mutable_data_ptr()) : nullptr;
    const at::Tensor b32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // bf16 values exact in fp32
    gemm.run(bf16 ? nullptr : xc.const_data_ptr<float>(), xb, x.size(0), per_token, static_cast<int>(mode),
             static_cast<float>(eps), bf16 ? nullptr : y.mutable_data_ptr<float>(), yb, bf16_compute && !bf16,
             bias ? b32.const_data_ptr<float>() : nullptr);
  }
  return y;
}

at::Tensor int8_codes_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& offset, int64_t group_size, int64_t n, int64_t k,
                                 bool per_token, int64_t mode, double eps, int64_t bits, int64_t code_offset,
                                 int64_t min_rows) {
  return int8_codes_impl(x, packed, scale, offset, group_size, n, k, per_token, mode, eps, bits, code_offset,
                         min_rows, false);
}

at::Tensor int8_codes_linear_bf16_compute_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                              const std::optional<at::Tensor>& offset, int64_t group_size, int64_t n,
                                              int64_t k, bool per_token, int64_t mode, double eps, int64_t bits,
                                              int64_t code_offset, int64_t min_rows) {
  return int8_codes_impl(x, packed, scale, offset, group_size, n, k, per_token, mode, eps, bits, code_offset,
                         min_rows, true);
}

at::Tensor int8_codes_linear_biased_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& offset, int64_t group_size, int64_t n,
                                       int64_t k, bool per_token, int64_t mode, double eps, int64_t bits,
                                       int64_t code_offset, int64_t min_rows, bool bf16_compute,
                                       const at::Tensor& bias) {
  return int8_codes_impl(x, packed, scale, offset, group_size, n, k, per_token, mode, eps, bits, code_offset,
                         min_rows, bf16_compute, bias);
}

bool int8_codes_built() { return Int8CodesGemm::built(); }

void set_disabled(bool flag) { g_disabled.store(flag); }
std::string isa() { return kernel_isa(); }

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) {
  m.impl("lowbit_linear", &affineq::lowbit_linear_cpu);
  m.impl("lowbit_linear_bf16_compute", &affineq::lowbit_linear_bf16_compute_cpu);
  m.impl("lowbit_linear_biased", &affineq::lowbit_linear_biased_cpu);
  m.impl("lowbit_linear_multi", &affineq::lowbit_linear_multi_cpu);
  m.impl("lowbit_dequantize", &affineq::lowbit_dequantize_cpu);
  m.impl("int8_fake_quant", &affineq::int8_fake_quant_cpu);
  m.impl("int8_codes_linear", &affineq::int8_codes_linear_cpu);
  m.impl("int8_codes_linear_bf16_compute", &affineq::int8_codes_linear_bf16_compute_cpu);
  m.impl("int8_codes_linear_biased", &affineq::int8_codes_linear_biased_cpu);
  m.impl("lowbit_linear_int8_act", &affineq::lowbit_linear_int8_act_cpu);
  m.impl("lowbit_linear_int8_act_bf16_compute", &affineq::lowbit_linear_int8_act_bf16_compute_cpu);
}

TORCH_LIBRARY_IMPL(affineq, Autograd, m) { m.impl("lowbit_linear", &affineq::lowbit_linear_autograd); }

// Private helpers (tests/benchmarks): kill switch, compiled ISA, forcing a path (1 = GEMV, 2 = fp32 GEMM,
// 3 = int16 VNNI GEMM, 4 = bf16 dot GEMM), asking which path would run, and whether this build has the
// int8-codes kernel (gemm_int8_codes.cpp).
TORCH_LIBRARY(affineq_cpp, m) {
  m.def("set_disabled(bool flag) -> ()", &affineq::set_disabled);
  m.def("isa() -> str", &affineq::isa);
  m.def("lowbit_linear_path(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, "
        "int n, int k, int codes, int path, int code_offset=0, ScalarType? compute_dtype=None, Tensor? bias=None) "
        "-> Tensor",
        &affineq::lowbit_linear_impl);
  m.def("lowbit_path_for(Tensor x, int group_size, int codes, int path, int bits=8, int n=16) -> int",
        &affineq::lowbit_path_for);
  m.def("int8_codes_built() -> bool", &affineq::int8_codes_built);
}
