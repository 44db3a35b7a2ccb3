// A dense-format weight dequantized at memory speed (affineq::dense_dequantize), and the compute-bound linear
// built on it (affineq::dequant_linear): blocked_gemm.h's driver (W dequantized in blocks of output rows that
// stay in cache, each block multiplied with x by torch's own GEMM: oneDNN / MKL, which pick AMX, AVX-512 or AVX2
// themselves at run time) with the 16-row panels' decoder below. The packed weight is read once per call in its
// compact form; the arithmetic runs at the float GEMM's speed, which at large m beats the fused paths of
// dispatch.cpp.
//
// Values: the weight of a block is exactly what dense_dequantize returns (the values of the Python
// `Dense.dequantize`, bit for bit): w = fma(c(u), scale, offset) with one rounding, or, for fp32 qparams of
// integer codes with an INT / NONE zero point ("canonical"), w = (u + round(offset / scale)) * scale, the
// primitives' (q - zp) * scale. A bf16 result rounds that fp32 value to nearest even once.
//   dequant_linear, bf16_weight = false: F.linear(x.float(), W_fp32) cast to x.dtype (fp32 products and sums).
//   dequant_linear, bf16_weight = true (bf16 x): F.linear(x, W.to(bf16)), the bf16 GEMM with fp32 accumulation.
// Both equal dequantize-then-F.linear up to the GEMM's summation order.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "blocked_gemm.h"
#include "common.h"
#include "decode.h"
#include "op_checks.h"

namespace affineq {
namespace detail {
namespace {

// a * b + c rounded once (as std::fma and the PyTorch route): the hardware FMA, or std::fma in the portable
// build, whose plain a * b + c would round twice.
AQ_INLINE F16 fma1(F16 a, F16 b, F16 c) {
#if AQ_AVX512 || AQ_AVX2
  return ffma(a, b, c);
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
#endif
}

#if defined(__AVX2__) && !defined(AFFINEQ_FORCE_SCALAR)
#define AQ_DQ_AVX2 1

// r[i] = column i of the 8x8 block whose rows are a[0..7] (in place).
AQ_INLINE void transpose8(__m256* a) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  __m256 s[8];
  for (int h = 0; h < 2; ++h) {
    s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x20);
    a[4 + i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x31);
  }
}
#endif

// Writes tile[t * 16 + j] = W[row j, k0 + t] (t < 8) as rows of out: out[j * ldo + k0 + t] for j < rows,
// t < cols, in fp32 or bf16.
template <bool kBf16>
AQ_INLINE void store_unit(const float* tile, int rows, int cols, void* out, int64_t ldo, int64_t k0) {
#if AQ_DQ_AVX2
  if (cols == 8) {
    for (int h = 0; h < 2 && 8 * h < rows; ++h) {
      __m256 a[8];
      for (int t = 0; t < 8; ++t) a[t] = _mm256_load_ps(tile + t * 16 + 8 * h);
      transpose8(a);  // a[j] = row 8h + j, columns k0..k0+7
      const int nr = std::min(8, rows - 8 * h);
      for (int j = 0; j < nr; ++j) {
        const int64_t off = (8 * h + j) * ldo + k0;
        if constexpr (kBf16)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + off), to_bf16x8(a[j]));
        else
          _mm256_storeu_ps(static_cast<float*>(out) + off, a[j]);
      }
    }
    return;
  }
#endif
  for (int j = 0; j < rows; ++j)
    for (int t = 0; t < cols; ++t) {
      const float v = tile[t * 16 + j];
      if constexpr (kBf16) static_cast<uint16_t*>(out)[j * ldo + k0 + t] = float_to_bf16(v);
      else static_cast<float*>(out)[j * ldo + k0 + t] = v;
    }
}

// v (16 rows of one column) -> out[0 .. rows) as fp32 or bf16 (the bits of float_to_bf16): the W^T layout's store,
// contiguous, so no transpose.
template <bool kBf16>
AQ_INLINE void store_col(F16 v, int rows, void* out) {
  if constexpr (!kBf16) {
    if (rows == 16) fstore(static_cast<float*>(out), v);
    else fstore_n(static_cast<float*>(out), v, rows);
  } else {
#if AQ_AVX512
    _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << rows) - 1u), bf16_bits_exact(v.v));
#elif AQ_DQ_AVX2 && AQ_AVX2
    uint16_t* o = static_cast<uint16_t*>(out);
    if (rows == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16x8(v.a));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8), to_bf16x8(v.b));
    } else {
      alignas(64) float t[16];
      fstore(t, v);
      for (int j = 0; j < rows; ++j) o[j] = float_to_bf16(t[j]);
    }
#else
    for (int j = 0; j < rows; ++j) static_cast<uint16_t*>(out)[j] = float_to_bf16(v.v[j]);
#endif
  }
}

// Rows [16 * p0, min(n, 16 * p1)) of W into out (row r at out + (r - 16 * p0) * ldo), k columns each.
// kWT: W^T instead, column kk of those rows at out + kk * ldo + (r - 16 * p0) (each decoded vector is 16 rows of
// one column: stored as is, no transpose).
template <int B, bool kBf16, bool kWT = false>
void dequant_panels(const Ctx& c, bool canonical, int64_t p0, int64_t p1, void* out, int64_t ldo) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, K = pr.k, es = kBf16 ? 2 : 4;
  const std::vector<int32_t> kg = group_of_k(pr, c.K8, G);
  // x * s + (-0): the exact product, including its sign when it is zero (as torch's (u + zq) * s)
  const F16 neg0 = fset1(-0.f);
  alignas(64) float tile[8 * 16];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t r0 = 16 * p, rows = std::min<int64_t>(16, c.N - r0);
    float *sT, *oT;  // [G + 1, 16]: scale (times code_scale(B)) and offset of each group, 16 rows per vector
    load_tile_qparams(pr, code_scale(B), r0, rows, 16, G, sT, oT);
    if (canonical)  // integer codes: the zero point round(offset / scale) replaces the offset (fp32 division);
      // a zero scale (an all-zero GGUF block) has no zero point: its weights are 0 whatever it is, not 0/0 = NaN
      for (int64_t i = 0; i < G * 16; ++i) oT[i] = sT[i] == 0.f ? 0.f : std::nearbyint(oT[i] / sT[i]);
    const uint8_t* pan = panel_ptr(c, p);
    if constexpr (kWT) {
      char* dst = static_cast<char*>(out) + (r0 - 16 * p0) * es;
      for (int64_t u = 0; u < c.U; ++u) {
        const int cols = static_cast<int>(std::min<int64_t>(8, K - 8 * u));
        decode_unit<B>(pan + u * 16 * bits_of(B), [&](auto T, F16 w) {
          constexpr int t = AQ_CV(T);
          if (t >= cols) return;
          const int64_t g = kg[8 * u + t];
          const F16 s = fload(sT + g * 16), o = fload(oT + g * 16);
          store_col<kBf16>(canonical ? fma1(fadd(w, o), s, neg0) : fma1(w, s, o), static_cast<int>(rows),
                           dst + (8 * u + t) * ldo * es);
        });
      }
      continue;
    }
    char* dst = static_cast<char*>(out) + (r0 - 16 * p0) * ldo * es;
    for (int64_t u = 0; u < c.U; ++u) {
      decode_unit<B>(pan + u * 16 * bits_of(B), [&](auto T, F16 w) {
        constexpr int t = AQ_CV(T);
        const int64_t g = kg[8 * u + t];
        const F16 s = fload(sT + g * 16), o = fload(oT + g * 16);
        fstore(tile + t * 16, canonical ? fma1(fadd(w, o), s, neg0) : fma1(w, s, o));
      });
      store_unit<kBf16>(tile, static_cast<int>(rows), static_cast<int>(std::min<int64_t>(8, K - 8 * u)), dst, ldo,
                        8 * u);
    }
  }
}

// All rows of W: panels in parallel, the whole weight written once.
template <int B, bool kBf16>
void dequant_all(const Ctx& c, bool canonical, void* out) {
  at::parallel_for(0, c.npan, grain_for(16 * c.K8), [&](int64_t p0, int64_t p1) {
    char* o = static_cast<char*>(out) + 16 * p0 * c.p->k * (kBf16 ? 2 : 4);
    dequant_panels<B, kBf16>(c, canonical, p0, p1, o, c.p->k);
  });
}

// Calls f(integral_constant<B>) for the template width of (bits, codes) (the same mapping as dispatch.cpp).
template <class F>
void with_width(int bits, int codes, F&& f) {
  using std::integral_constant;
  switch (bits) {
    case 1: f(integral_constant<int, 1>{}); break;
    case 2: f(integral_constant<int, 2>{}); break;
    case 3: f(integral_constant<int, 3>{}); break;
    case 4:
      if (codes == kCodesFp4E2M1) f(integral_constant<int, kBF4>{});
      else f(integral_constant<int, 4>{});
      break;
    case 5: f(integral_constant<int, 5>{}); break;
    case 6:
      if (codes == kCodesFp6E2M3) f(integral_constant<int, kBF6A>{});
      else if (codes == kCodesFp6E3M2) f(integral_constant<int, kBF6B>{});
      else f(integral_constant<int, 6>{});
      break;
    case 7: f(integral_constant<int, 7>{}); break;
    default:
      if (codes == kCodesE4M3) f(integral_constant<int, kBE4M3>{});
      else if (codes == kCodesE5M2) f(integral_constant<int, kBE5M2>{});
      else f(integral_constant<int, 8>{});
  }
}

}  // namespace
}  // namespace detail

namespace {

const char* const kDq = "affineq::dense_dequantize";
const char* const kDl = "affineq::dequant_linear";

// The weight problem (no x) of the ops' arguments, after the checks every entry point shares.
LowbitProblem weight_problem(const char* op, const at::Tensor& pk, const at::Tensor& sc, const at::Tensor& of,
                             int64_t bits, int64_t group_size, int64_t n, int64_t k, int64_t codes,
                             int64_t code_offset) {
  TORCH_CHECK(bits >= 1 && bits <= 8, op, ": bits must be in [1, 8], got ", bits);
  TORCH_CHECK(n >= 0 && k > 0 && group_size > 0 && k % group_size == 0, op,
              ": need n >= 0, k > 0 and group_size dividing k, got n=", n, ", k=", k, ", group_size=", group_size);
  TORCH_CHECK(pk.scalar_type() == at::kByte && pk.device().is_cpu() && pk.numel() == n * ((k + 7) / 8) * bits, op,
              ": packed must be a uint8 CPU tensor with ", n * ((k + 7) / 8) * bits, " elements (pack_codes output)");
  const int64_t G = k / group_size;
  const std::optional<at::Tensor> of_opt = of.defined() ? std::optional<at::Tensor>(of) : std::nullopt;
  check_qparams(op, sc, of_opt, bits, codes, code_offset, n, G);
  LowbitProblem p;
  set_weight(p, pk.const_data_ptr(), sc.const_data_ptr(), of.defined() ? of.const_data_ptr() : nullptr,
             sc.scalar_type(), code_offset, bits, codes, group_size, n, k);
  return p;
}

// canonical: (u + round(offset / scale)) * scale (fp32 qparams of integer codes only). 16-bit scales of integer
// codes without an offset array always dequantize so: scale * (u + code_offset), exact with the product's sign.
// Returns whether the canonical form applies.
bool canonical_for(const char* op, bool canonical, const LowbitProblem& p) {
  const bool fp32_qparams = !p.qparams_bf16 && !p.qparams_f16 && !p.qparams_e8m0;
  const bool half_no_offset = (p.qparams_bf16 || p.qparams_f16) && p.offset == nullptr && p.codes == kCodesUint;
  TORCH_CHECK(!canonical || (p.codes == kCodesUint && ((fp32_qparams && p.offset != nullptr) || half_no_offset)), op,
              ": canonical=True needs integer codes with float32 scale and offset, or 16-bit scales and no offset");
  return canonical || half_no_offset;
}

at::Tensor dense_dequantize_cpu(const at::Tensor& packed, const at::Tensor& scale,
                                const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                                int64_t k, int64_t codes, int64_t code_offset, bool canonical, bool bf16) {
  const at::Tensor pk = packed.contiguous(), sc = scale.contiguous();
  const at::Tensor of = offset.has_value() && offset->defined() ? offset->contiguous() : at::Tensor();
  LowbitProblem p = weight_problem(kDq, pk, sc, of, bits, group_size, n, k, codes, code_offset);
  canonical = canonical_for(kDq, canonical, p);
  at::Tensor w = at::empty({n, k}, sc.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (n == 0) return w;
  const detail::Ctx c = detail::make_ctx(p);
  detail::with_width(p.bits, p.codes, [&](auto B_) {
    constexpr int B = AQ_CV(B_);
    if (bf16) detail::dequant_all<B, true>(c, canonical, w.mutable_data_ptr());
    else detail::dequant_all<B, false>(c, canonical, w.mutable_data_ptr());
  });
  return w;
}

// Output rows of W a thread dequantizes at a time: about kBlockBytes of weight (it stays in the thread's L2 while
// its GEMM reads it), whole 16-row panels.
// AFFINEQ_DQ_BLOCK_KB overrides it (a tuning knob for benchmarks/tune_dequant_linear.py).
int64_t block_bytes() {
  static const int64_t bytes = [] {
    const char* v = std::getenv("AFFINEQ_DQ_BLOCK_KB");
    const long kb = v ? std::strtol(v, nullptr, 10) : 0;
    return kb > 0 ? int64_t{kb} << 10 : int64_t{1} << 20;
  }();
  return bytes;
}

int64_t block_panels(int64_t k, int64_t es) { return std::max<int64_t>(1, block_bytes() / (16 * k * es)); }

// Whether each block's GEMM writes a contiguous row slice of y^T [n, M] (W_blk @ x^T; y = (y^T)^T copied once)
// instead of a strided column slice of y [M, n] (x @ W_blk^T): torch's oneDNN bf16 GEMM takes only the former
// without a copy. AFFINEQ_DQ_TRANSPOSED=0 / 1 overrides the default (a tuning knob, as above).
bool transposed_output() {
  static const bool t = [] {
    const char* v = std::getenv("AFFINEQ_DQ_TRANSPOSED");
    return v ? std::strcmp(v, "0") != 0 : true;
  }();
  return t;
}

// Whether each block is dequantized as W^T [k, rows] (its decoded column vectors stored as they come, then
// multiplied as a transposed operand) rather than W [rows, k] (a transpose per 8x16 tile). AFFINEQ_DQ_WT=0 / 1
// overrides the default (a tuning knob, as above).
bool weight_transposed() {
  static const bool t = [] {
    const char* v = std::getenv("AFFINEQ_DQ_WT");
    return v ? std::strcmp(v, "0") != 0 : true;
  }();
  return t;
}

at::Tensor dequant_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t n,
                              int64_t k, int64_t codes, int64_t code_offset, bool canonical, bool bf16_weight,
                              int64_t min_rows) {
  const auto xt = x.scalar_type();
  if (x.dim() >= 1 && x.size(-1) == k && x.numel() / k < min_rows) {
    // Fewer rows than the threshold: the fused kernels (affineq::lowbit_linear), decided here so that a graph with
    // a symbolic M runs what eager runs.
    static auto lowbit = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("affineq::lowbit_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                                               int64_t, int64_t)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return lowbit.call(x, packed, scale, offset, bits, group_size, n, k, codes, code_offset);
  }
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, kDl,
              ": x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, kDl, ": x must be a CPU tensor [..., k=", k,
              "], got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(!bf16_weight || xt == at::kBFloat16, kDl, ": bf16_weight=True needs a bfloat16 x, got ", xt);
  const at::Tensor pk = packed.contiguous(), sc = scale.contiguous();
  const at::Tensor of = offset.has_value() && offset->defined() ? offset->contiguous() : at::Tensor();
  LowbitProblem p = weight_problem(kDl, pk, sc, of, bits, group_size, n, k, codes, code_offset);
  canonical = canonical_for(kDl, canonical, p);
  // The GEMMs below dispatch again: keep autograd out of them (this op has no derivative; its callers wrap it).
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::ScalarType ct = bf16_weight ? at::kBFloat16 : at::kFloat;  // compute dtype of x, W and the GEMM
  const at::Tensor x2 = x.detach().reshape({-1, k}).to(ct).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y;
  if (n == 0 || M == 0) return at::empty({M, n}, x2.options()).to(xt).view(detail::out_sizes(x, n));
  const detail::Ctx c = detail::make_ctx(p);
  const int64_t es = bf16_weight ? 2 : 4;
  const detail::BlockedGemmShape shape{16, block_panels(k, es), weight_transposed(), transposed_output()};
  detail::with_width(p.bits, p.codes, [&](auto B_) {
    constexpr int B = AQ_CV(B_);
    // one instantiation of the decoder per (layout, dtype): the panels' column vectors stored as they come
    // (W^T) or transposed per 8x16 tile (W)
    const auto run = [&](auto WT_, auto BF_) {
      constexpr bool kWT = AQ_CV(WT_), kBf = AQ_CV(BF_);
      y = detail::blocked_linear(x2, n, k, shape, [&](int64_t b0, int64_t b1, void* dst, int64_t ld) {
        detail::dequant_panels<B, kBf, kWT>(c, canonical, b0, b1, dst, ld);
      });
    };
    using T = std::true_type;
    using F = std::false_type;
    if (shape.weight_transposed && bf16_weight) run(T{}, T{});
    else if (shape.weight_transposed) run(T{}, F{});
    else if (bf16_weight) run(F{}, T{});
    else run(F{}, F{});
  });
  return y.to(xt).contiguous().view(detail::out_sizes(x, n));
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) {
  m.impl("dense_dequantize", &affineq::dense_dequantize_cpu);
  m.impl("dequant_linear", &affineq::dequant_linear_cpu);
}
