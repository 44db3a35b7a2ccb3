// affineq::int8_fake_quant: dequantize(quantize(x)) for int8 activations, one row per token or one range for
// the whole tensor, in one pass over x instead of ~12 eager PyTorch ops (the per-call cost of 8da4w and of int8
// dynamic quantization with our kernel). Every step is the float32 operation of the PyTorch reference in
// affineq/tensor/activation.py, in the same order, so the result is bit-identical (tested): no FMA is formed
// (each product is rounded before the next operation, see AQ_ROUND_BARRIER), rounding is half-to-even. bf16 x
// is widened in registers as it is read (exact), so a row is read once per pass and never copied.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "lowbit_kernels.h"
#include "simd.h"  // AQ_AVX512, AQ_AVX2

namespace affineq {
namespace {

// Rounded to float here, so it cannot be contracted into a following add or subtract (x86: keep it in a
// register the compiler must materialize).
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define AQ_ROUND_BARRIER(v) asm("" : "+x"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define AQ_ROUND_BARRIER(v) asm("" : "+w"(v))
#else
#define AQ_ROUND_BARRIER(v) (void)(v)
#endif

inline float round_even(float v) {
#if defined(__GNUC__)
  return __builtin_roundevenf(v);
#else
  return std::nearbyint(v);  // the default rounding mode is to nearest, ties to even
#endif
}

// An fp32 element of x read as its bf16 value (x.to(bfloat16) as torch rounds: nearest even, subnormals kept,
// every NaN as 0x7FC0), for a weight computed in bf16.
struct RoundedF32 {
  float v;
};

// x's values in fp32: fp32 as it is, bf16 widened (exact), RoundedF32 rounded then widened, so a row is read
// once, in registers.
inline float value_of(float v) { return v; }
inline float value_of(uint16_t b) { return detail::bf16_to_float(b); }
inline float value_of(RoundedF32 r) { return detail::bf16_to_float(c10::BFloat16(r.v).x); }
#if AQ_AVX512
AQ_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AQ_INLINE __m512 load16(const uint16_t* p) {
  return detail::bf16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
AQ_INLINE __m512 load16(const RoundedF32* p) {
  return detail::bf16_widen(detail::bf16_bits_exact(_mm512_loadu_ps(&p->v)));
}
// y's stores: fp32 as it is, bf16 rounded as torch rounds (to nearest even, every NaN as 0x7FC0). `normal`: no
// value is subnormal, so vcvtneps2bf16 (which flushes subnormals) rounds as torch does, in one instruction.
AQ_INLINE void store16(float* p, __m512 v, bool) { _mm512_storeu_ps(p, v); }
AQ_INLINE void store16(uint16_t* p, __m512 v, [[maybe_unused]] bool normal) {
#if AQ_BF16DOT
  if (normal) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), detail::bf16_bits(v));
    return;
  }
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), detail::bf16_bits_exact(v));
}
#endif
#if AQ_AVX2
// The AVX2 loops' loads and stores (8 values), the same values as value_of and store_one.
AQ_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AQ_INLINE __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
AQ_INLINE void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
AQ_INLINE void store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), detail::to_bf16x8(v));  // torch's rounding, subnormals kept
}
#endif
inline void store_one(float* p, float v) { *p = v; }
inline void store_one(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

struct Qp {
  float scale, zp;  // zp = 0 for the symmetric modes
};

// mode 0: symmetric, scale = amax / 127.5; 1: symmetric without clipping, scale = max(-lo / 128, hi / 127);
// 2: asymmetric with an integer zero point, scale = (hi - lo) / 255 (halves where that overflows).
// AVX-512 loops below: min / max intrinsics with the operands in the order that gives std::min / std::max's
// result, NaN included ((x < lo) ? x : lo is _mm512_min_ps(x, lo)); only which zero of a +0 / -0 tie wins may
// differ, and every use of lo / hi ends the same for either (eps, zp -128).
template <class T>
Qp qparams(const T* x, int64_t n, int mode, float eps) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo, amax = 0.f;
  int64_t i0 = 0;
#if AQ_AVX512
  if (n >= 16) {
    // four independent pairs of running min / max: one pair would wait on min / max's latency every 16 values
    __m512 vlo[4], vhi[4];
    for (int j = 0; j < 4; ++j) {
      vlo[j] = _mm512_set1_ps(lo);
      vhi[j] = _mm512_set1_ps(hi);
    }
    for (; i0 + 64 <= n; i0 += 64)
      for (int j = 0; j < 4; ++j) {
        const __m512 v = load16(x + i0 + 16 * j);
        vlo[j] = _mm512_min_ps(v, vlo[j]);
        vhi[j] = _mm512_max_ps(v, vhi[j]);
      }
    for (; i0 + 16 <= n; i0 += 16) {
      const __m512 v = load16(x + i0);
      vlo[0] = _mm512_min_ps(v, vlo[0]);
      vhi[0] = _mm512_max_ps(v, vhi[0]);
    }
    // No NaN reaches the accumulators (a NaN v keeps the running value), so they reduce in any order: a tree,
    // not a chain of 32 dependent scalar steps (which cost more than the loop at k = 576).
    lo = _mm512_reduce_min_ps(_mm512_min_ps(_mm512_min_ps(vlo[0], vlo[1]), _mm512_min_ps(vlo[2], vlo[3])));
    hi = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vhi[0], vhi[1]), _mm512_max_ps(vhi[2], vhi[3])));
  }
#elif AQ_AVX2
  if (n >= 8) {  // the same loop with 8 lanes (float x or bf16 x; RoundedF32 x takes the scalar loop)
    if constexpr (!std::is_same_v<T, RoundedF32>) {
      __m256 vlo[4], vhi[4];
      for (int j = 0; j < 4; ++j) {
        vlo[j] = _mm256_set1_ps(lo);
        vhi[j] = _mm256_set1_ps(hi);
      }
      for (; i0 + 32 <= n; i0 += 32)
        for (int j = 0; j < 4; ++j) {
          const __m256 v = load8(x + i0 + 8 * j);
          vlo[j] = _mm256_min_ps(v, vlo[j]);
          vhi[j] = _mm256_max_ps(v, vhi[j]);
        }
      for (; i0 + 8 <= n; i0 += 8) {
        const __m256 v = load8(x + i0);
        vlo[0] = _mm256_min_ps(v, vlo[0]);
        vhi[0] = _mm256_max_ps(v, vhi[0]);
      }
      alignas(32) float l8[8], h8[8];
      _mm256_store_ps(l8, _mm256_min_ps(_mm256_min_ps(vlo[0], vlo[1]), _mm256_min_ps(vlo[2], vlo[3])));
      _mm256_store_ps(h8, _mm256_max_ps(_mm256_max_ps(vhi[0], vhi[1]), _mm256_max_ps(vhi[2], vhi[3])));
      for (int j = 0; j < 8; ++j) {
        lo = std::min(lo, l8[j]);
        hi = std::max(hi, h8[j]);
      }
    }
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    lo = std::min(lo, value_of(x[i]));
    hi = std::max(hi, value_of(x[i]));
  }
  amax = std::max(-lo, hi);  // max |x|, exactly
  float scale;
  float zp = 0.f;
  if (mode == 0) {
    scale = amax / 127.5f;
  } else {
    lo = std::min(lo, 0.f);
    hi = std::max(hi, 0.f);
    if (mode == 1) {
      scale = std::max(lo / -128.f, hi / 127.f);
    } else {
      scale = (hi - lo) / 255.f;
      if (!std::isfinite(scale)) {
        float a = hi * 0.5f, b = lo * 0.5f;
        AQ_ROUND_BARRIER(a);
        AQ_ROUND_BARRIER(b);
        scale = (a - b) / 127.5f;
      }
    }
  }
  scale = std::max(scale, eps);
  if (mode == 2) zp = std::min(std::max(-128.f - round_even(lo / scale), -128.f), 127.f);
  return {scale, zp};
}

// The int8 code of v (as a float): clamp(round_half_even(v / scale) + zp, -128, 127), with 1 / scale precomputed.
inline float code_of(float v, float inv, float zp) {
  float t = v * inv;
  AQ_ROUND_BARRIER(t);
  return std::min(std::max(round_even(t) + zp, -128.f), 127.f);
}

#if AQ_AVX512
// 16 codes of code_of at once (the same float ops: a rounded product, round half to even, add, clamp).
inline __m512 codes16(__m512 v, __m512 inv, __m512 zp) {
  const __m512 r = _mm512_add_ps(_mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
  return _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-128.f), r));
}
#endif

// y = clamp((code_of(x) - zp) * scale, -out_max, out_max) over one row, rounded to y's type as it is stored.
// The vector loop computes the same values in fewer steps:
// - code - zp = clamp(round(x / scale), -128 - zp, 127 - zp) + 0: integers below 2^24 and the bounds are exact in
//   fp32, a rounded value past them clamps either way, and + 0 turns the -0 of a small negative x into the
//   reference's +0;
// - the clamp to +-out_max is skipped where no difference times the scale reaches it: |code - zp| <= 255, and
//   255 * scale rounded <= out_max bounds every rounded product (rounding is monotonic).
template <class T, class O>
void fake_quant_row(const T* x, int64_t n, Qp q, float out_max, O* y) {
  const float inv = 1.f / q.scale;
  int64_t i0 = 0;
#if AQ_AVX512
  const __m512 vinv = _mm512_set1_ps(inv), vs = _mm512_set1_ps(q.scale);
  const __m512 vlo = _mm512_set1_ps(-128.f - q.zp), vhi = _mm512_set1_ps(127.f - q.zp);
  const __m512 vmax = _mm512_set1_ps(out_max), vmin = _mm512_set1_ps(-out_max);
  // Every y is 0 or (an integer code difference) * scale, so none is subnormal when scale is normal.
  const bool normal = q.scale >= std::numeric_limits<float>::min();
  const bool bounded = 255.f * q.scale <= out_max;
  const auto row = [&](auto normal_c, auto bounded_c) AQ_INLINE_LAMBDA {
    for (; i0 + 16 <= n; i0 += 16) {
      // the operand order of codes16's clamp (a NaN stays NaN)
      const __m512 r =
          _mm512_roundscale_ps(_mm512_mul_ps(load16(x + i0), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 c = _mm512_add_ps(_mm512_min_ps(vhi, _mm512_max_ps(vlo, r)), _mm512_setzero_ps());
      __m512 v = _mm512_mul_ps(c, vs);
      if constexpr (!decltype(bounded_c)::value) v = _mm512_min_ps(vmax, _mm512_max_ps(vmin, v));
      store16(y + i0, v, decltype(normal_c)::value);
    }
  };
  if (normal && bounded)
    row(std::true_type{}, std::true_type{});
  else if (normal)
    row(std::true_type{}, std::false_type{});
  else
    row(std::false_type{}, std::false_type{});
#elif AQ_AVX2
  if constexpr (!std::is_same_v<T, RoundedF32>) {  // the AVX-512 loop's steps with 8 lanes
    const __m256 vinv = _mm256_set1_ps(inv), vs = _mm256_set1_ps(q.scale);
    const __m256 vlo = _mm256_set1_ps(-128.f - q.zp), vhi = _mm256_set1_ps(127.f - q.zp);
    const __m256 vmax = _mm256_set1_ps(out_max), vmin = _mm256_set1_ps(-out_max);
    const bool bounded = 255.f * q.scale <= out_max;
    for (; i0 + 8 <= n; i0 += 8) {
      const __m256 r =
          _mm256_round_ps(_mm256_mul_ps(load8(x + i0), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 c = _mm256_add_ps(_mm256_min_ps(vhi, _mm256_max_ps(vlo, r)), _mm256_setzero_ps());
      __m256 v = _mm256_mul_ps(c, vs);
      if (!bounded) v = _mm256_min_ps(vmax, _mm256_max_ps(vmin, v));
      store8(y + i0, v);
    }
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    const float code = code_of(value_of(x[i]), inv, q.zp);
    float v = (code - q.zp) * q.scale;
    store_one(y + i, std::min(std::max(v, -out_max), out_max));
  }
}

// Row r's codes (and group sums) with qparams q: one row of int8_quantize_rows. Code i goes to codes[(i / 64) *
// cs + i % 64]: cs = 64 is a row-major row, cs = 1024 the row's place in AMX A tiles (64-byte rows of 16-row tiles).
template <class T>
void quantize_row(const T* xr, int64_t k, Qp q, int8_t* codes, int64_t cs, int32_t* csum, int64_t gs) {
  const float inv = 1.f / q.scale;
  const auto at = [&](int64_t i) { return codes + (i / 64) * cs + i % 64; };
  int64_t i0 = 0;
  bool summed = false;  // csum written by the vector loop
#if AQ_AVX512
  const __m512 vinv = _mm512_set1_ps(inv), vzp = _mm512_set1_ps(q.zp);
  // Whole vectors per group (then k % 16 == 0): the sums ride along in the loop.
  summed = csum != nullptr && gs % 16 == 0;
  __m512i acc = _mm512_setzero_si512();
  for (; i0 + 16 <= k; i0 += 16) {
    const __m128i c = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(codes16(load16(xr + i0), vinv, vzp)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at(i0)), c);
    if (!summed) continue;
    acc = _mm512_add_epi32(acc, _mm512_cvtepi8_epi32(c));  // the stored bytes' values
    if ((i0 + 16) % gs == 0) {
      csum[i0 / gs] = _mm512_reduce_add_epi32(acc);
      acc = _mm512_setzero_si512();
    }
  }
#endif
  for (int64_t i = i0; i < k; ++i) *at(i) = static_cast<int8_t>(code_of(value_of(xr[i]), inv, q.zp));
  if (csum != nullptr && !summed)
    for (int64_t g = 0; g < k / gs; ++g) {
      int32_t t = 0;
      for (int64_t i = g * gs, end = (g + 1) * gs; i < end;) {  // runs of codes contiguous in memory
        const int64_t run = std::min(end - i, 64 - i % 64);
        const int8_t* c = at(i);
        for (int64_t j = 0; j < run; ++j) t += c[j];  // vectorizes (int8 -> int32)
        i += run;
      }
      csum[g] = t;
    }
}

// int8_quantize_rows for fp32 or bf16 rows (one range for all of x when not per_token); amx_tiles: see
// lowbit_kernels.h.
template <class T>
void quantize_rows(const T* x, int64_t m, int64_t k, bool per_token, int mode, float eps, int8_t* codes, float* scale,
                   int32_t* zp, int32_t* csum, int64_t gs, bool amx_tiles) {
  const Qp all = per_token ? Qp{} : qparams(x, m * k, mode, eps);
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      const Qp q = per_token ? qparams(xr, k, mode, eps) : all;
      int8_t* row = amx_tiles ? codes + (r / 16) * (k / 64) * 1024 + (r % 16) * 64 : codes + r * k;
      quantize_row(xr, k, q, row, amx_tiles ? 1024 : 64, csum ? csum + r * (k / gs) : nullptr, gs);
      scale[r] = q.scale;
      zp[r] = static_cast<int32_t>(q.zp);
    }
  });
}

// int8_fake_quant for fp32 or bf16 rows, y of x's type.
template <class T>
void fake_quant_rows(const T* x, int64_t m, int64_t k, bool per_token, int mode, float eps, float out_max, T* y) {
  const Qp all = per_token ? Qp{} : qparams(x, m * k, mode, eps);
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      fake_quant_row(x + r * k, k, per_token ? qparams(x + r * k, k, mode, eps) : all, out_max, y + r * k);
  });
}

}  // namespace

void int8_fake_quant_f32(const float* x, int64_t m, int64_t k, bool per_token, int mode, float eps, float out_max,
                         float* y) {
  fake_quant_rows(x, m, k, per_token, mode, eps, out_max, y);
}

void int8_quantize_rows(const float* x, int64_t m, int64_t k, bool per_token, int mode, float eps, int8_t* codes,
                        float* scale, int32_t* zp, int32_t* csum, int64_t gs, bool amx_tiles) {
  quantize_rows(x, m, k, per_token, mode, eps, codes, scale, zp, csum, gs, amx_tiles);
}

void int8_quantize_rows_rounded(const float* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                                int8_t* codes, float* scale, int32_t* zp, int32_t* csum, int64_t gs, bool amx_tiles) {
  static_assert(sizeof(RoundedF32) == sizeof(float));
  quantize_rows(reinterpret_cast<const RoundedF32*>(x), m, k, per_token, mode, eps, codes, scale, zp, csum, gs,
                amx_tiles);
}

void int8_fake_quant_bf16(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                          uint16_t* y) {
  fake_quant_rows(x, m, k, per_token, mode, eps, static_cast<float>(std::numeric_limits<c10::BFloat16>::max()), y);
}

Int8XQuant int8_x_quant(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps) {
  Int8XQuant q{per_token, mode, eps, 0.f, 0.f};
  if (!per_token) {
    const Qp all = qparams(x, m * k, mode, eps);
    q.scale = all.scale;
    q.zp = all.zp;
  }
  return q;
}

void int8_fake_quant_row_bf16(const uint16_t* x, int64_t k, const Int8XQuant& q, uint16_t* y) {
  const Qp qp = q.per_token ? qparams(x, k, q.mode, q.eps) : Qp{q.scale, q.zp};
  fake_quant_row(x, k, qp, static_cast<float>(std::numeric_limits<c10::BFloat16>::max()), y);
}

void int8_quantize_rows_bf16(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                             int8_t* codes, float* scale, int32_t* zp, int32_t* csum, int64_t gs, bool amx_tiles) {
  quantize_rows(x, m, k, per_token, mode, eps, codes, scale, zp, csum, gs, amx_tiles);
}

}  // namespace affineq
