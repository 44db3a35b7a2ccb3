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
#include "simd.h"  // AQ_AVX512

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

// x's values in fp32: fp32 as it is, bf16 widened (exact), so a bf16 row is read once, in registers.
inline float value_of(float v) { return v; }
inline float value_of(uint16_t b) { return detail::bf16_to_float(b); }
#if AQ_AVX512
AQ_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AQ_INLINE __m512 load16(const uint16_t* p) {
  return detail::bf16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (; i0 + 16 <= n; i0 += 16) {
      const __m512 v = load16(x + i0);
      vlo = _mm512_min_ps(v, vlo);
      vhi = _mm512_max_ps(v, vhi);
    }
    alignas(64) float l[16], h[16];
    _mm512_store_ps(l, vlo);
    _mm512_store_ps(h, vhi);
    for (int j = 0; j < 16; ++j) {
      lo = std::min(lo, l[j]);
      hi = std::max(hi, h[j]);
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
template <class T, class O>
void fake_quant_row(const T* x, int64_t n, Qp q, float out_max, O* y) {
  const float inv = 1.f / q.scale;
  int64_t i0 = 0;
#if AQ_AVX512
  const __m512 vinv = _mm512_set1_ps(inv), vzp = _mm512_set1_ps(q.zp), vs = _mm512_set1_ps(q.scale);
  const __m512 vmax = _mm512_set1_ps(out_max), vmin = _mm512_set1_ps(-out_max);
  // Every y is 0 or (an integer code difference) * scale, so none is subnormal when scale is normal.
  const bool normal = q.scale >= std::numeric_limits<float>::min();
  const auto row = [&](auto normal_c) AQ_INLINE_LAMBDA {
    for (; i0 + 16 <= n; i0 += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_sub_ps(codes16(load16(x + i0), vinv, vzp), vzp), vs);
      store16(y + i0, _mm512_min_ps(vmax, _mm512_max_ps(vmin, v)), decltype(normal_c)::value);
    }
  };
  if (normal)
    row(std::true_type{});
  else
    row(std::false_type{});
#endif
  for (int64_t i = i0; i < n; ++i) {
    const float code = code_of(value_of(x[i]), inv, q.zp);
    float v = (code - q.zp) * q.scale;
    store_one(y + i, std::min(std::max(v, -out_max), out_max));
  }
}

// Row r's codes (and group sums) with qparams q: one row of int8_quantize_rows.
template <class T>
void quantize_row(const T* xr, int64_t k, Qp q, int8_t* codes, int32_t* csum, int64_t gs) {
  const float inv = 1.f / q.scale;
  int64_t i0 = 0;
#if AQ_AVX512
  const __m512 vinv = _mm512_set1_ps(inv), vzp = _mm512_set1_ps(q.zp);
  for (; i0 + 16 <= k; i0 += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i0),
                     _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(codes16(load16(xr + i0), vinv, vzp))));
#endif
  for (int64_t i = i0; i < k; ++i) codes[i] = static_cast<int8_t>(code_of(value_of(xr[i]), inv, q.zp));
  if (csum != nullptr)
    for (int64_t g = 0; g < k / gs; ++g) {
      int32_t t = 0;
      for (int64_t i = g * gs; i < (g + 1) * gs; ++i) t += codes[i];  // vectorizes (int8 -> int32)
      csum[g] = t;
    }
}

// int8_quantize_rows for fp32 or bf16 rows (one range for all of x when not per_token).
template <class T>
void quantize_rows(const T* x, int64_t m, int64_t k, bool per_token, int mode, float eps, int8_t* codes, float* scale,
                   int32_t* zp, int32_t* csum, int64_t gs) {
  const Qp all = per_token ? Qp{} : qparams(x, m * k, mode, eps);
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      const Qp q = per_token ? qparams(xr, k, mode, eps) : all;
      quantize_row(xr, k, q, codes + r * k, csum ? csum + r * (k / gs) : nullptr, gs);
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
                        float* scale, int32_t* zp, int32_t* csum, int64_t gs) {
  quantize_rows(x, m, k, per_token, mode, eps, codes, scale, zp, csum, gs);
}

void int8_fake_quant_bf16(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                          uint16_t* y) {
  fake_quant_rows(x, m, k, per_token, mode, eps, static_cast<float>(std::numeric_limits<c10::BFloat16>::max()), y);
}

void int8_quantize_rows_bf16(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                             int8_t* codes, float* scale, int32_t* zp, int32_t* csum, int64_t gs) {
  quantize_rows(x, m, k, per_token, mode, eps, codes, scale, zp, csum, gs);
}

}  // namespace affineq
