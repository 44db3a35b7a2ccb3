// SIMD shims shared by every kernel translation unit: which ISA this build targets (AQ_AVX512 / AQ_AVX2 /
// neither, plus AQ_VNNI and AQ_BF16DOT for the optional GEMM paths), AQ_INLINE / AQ_OPAQUE, the compile-time
// loop sfor, and 16-lane fp32 / int32 vectors (F16 / I16) over AVX-512, AVX2 or plain arrays.
// Everything here is a macro, a type, a constant or an always-inlined function: no code of its own.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    !defined(AFFINEQ_FORCE_AVX2) && !defined(AFFINEQ_FORCE_SCALAR)
#define AQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(AFFINEQ_FORCE_SCALAR)
#define AQ_AVX2 1
#endif

// Path 3 (gemm_int16.cpp) needs AVX512-VNNI, path 4 (gemm_bf16.cpp) AVX512-BF16; without them those files
// compile to nothing and path_for never picks them.
#if AQ_AVX512 && defined(__AVX512VNNI__)
#define AQ_VNNI 1
#endif
#if AQ_AVX512 && defined(__AVX512BF16__)
#define AQ_BF16DOT 1
#endif
// Path 5 (gemm_amx.cpp) needs AMX tiles with bf16 dot products (and path 4's bf16 weight tiles).
#if AQ_BF16DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AQ_AMX 1
#endif

#if defined(__GNUC__)
#define AQ_INLINE inline __attribute__((always_inline))
#define AQ_INLINE_LAMBDA __attribute__((always_inline))  // [&](args) AQ_INLINE_LAMBDA { ... }
#define AQ_OPAQUE(ptr) asm("" : "+r"(ptr))  // the compiler forgets where ptr points (no store forwarding)
#else
#define AQ_INLINE inline
#define AQ_INLINE_LAMBDA
#define AQ_OPAQUE(ptr) (void)(ptr)
#endif

namespace affineq::detail {
// Internal linkage (each translation unit has its own copy; all of it is inlined anyway): with external linkage,
// GCC compiled the hot loops that inline these functions differently (seen in the disassembly).
namespace {

#if AQ_VNNI
// acc += the VNNI dot products of a (unsigned bytes) with the int32 at p broadcast (signed bytes), the broadcast
// embedded in the instruction's memory operand (as ffma_bcst).
AQ_INLINE __m512i dpbusd_bcst(__m512i acc, __m512i a, const void* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*static_cast<const int32_t*>(p)));
  return acc;
}
#endif
#if AQ_BF16DOT
// 16 fp32 -> their bf16 bits as torch rounds: to nearest even, every NaN as 0x7FC0 (vcvtneps2bf16 keeps the
// NaN's sign and payload).
AQ_INLINE __m256i bf16_bits(__m512 v) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm256_set1_epi16(0x7FC0));
}
// acc += the bf16 dot products of w with the bf16 pair at p broadcast, the broadcast embedded in the
// instruction's memory operand (as ffma_bcst).
AQ_INLINE __m512 dpbf16_bcst(__m512 acc, __m512bh w, const void* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*static_cast<const uint32_t*>(p)));
  return acc;
}
#endif
#if AQ_AVX512
// 16 fp32 -> their bf16 bits as torch rounds, in integer arithmetic: to nearest even, subnormals kept (where
// vcvtneps2bf16 flushes them), every NaN as 0x7FC0.
AQ_INLINE __m256i bf16_bits_exact(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
// The fp32 values of 16 bf16 bits (exact).
AQ_INLINE __m512 bf16_widen(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }
// vpermb index of the VNNI GEMVs (16 rows x 4 k as [k][row] bytes -> [row][k]): output byte 4 j + t = input byte
// 16 t + j, so int32 lane j holds row j's codes of 4 consecutive k.
AQ_INLINE __m512i quad_index() {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 16; ++j)
    for (int t = 0; t < 4; ++t) idx[4 * j + t] = static_cast<uint8_t>(16 * t + j);
  return _mm512_load_si512(idx);
}
#endif

// 16-bit floats -> fp32, exact (subnormals, infinities and NaN included).
AQ_INLINE float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
#if defined(__AVX2__) && !defined(AFFINEQ_FORCE_SCALAR)
// 8 floats -> 8 bf16 (round to nearest even, subnormals kept, NaN -> 0x7FC0), the same bits as float_to_bf16.
AQ_INLINE __m128i to_bf16x8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // [0-3 0-3 | 4-7 4-7] (values fit 16 bits: no saturation)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif
// fp32 -> bf16 bits as torch rounds (c10::BFloat16): to nearest even, every NaN as 0x7FC0. A select, not a
// branch, so that loops over it vectorize.
AQ_INLINE uint16_t float_to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  const auto r = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  return f != f ? uint16_t{0x7FC0} : r;
}
AQ_INLINE float f16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t bits;
  if (e == 0) {  // zero or subnormal m * 2^-24: normalise (exact in fp32)
    if (m == 0) {
      bits = sign;
    } else {
      int sh = 0;
      uint32_t mm = m;
      while (!(mm & 0x400u)) mm <<= 1, ++sh;
      bits = sign | ((113u - sh) << 23) | ((mm & 0x3FFu) << 13);
    }
  } else {
    bits = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Compile-time loop: f(std::integral_constant<int, i>) for i in [0, N). Keeps register arrays scalarized.
template <int... Is, class F>
AQ_INLINE void sfor_impl(std::integer_sequence<int, Is...>, F&& f) {
  (f(std::integral_constant<int, Is>{}), ...);
}
template <int N, class F>
AQ_INLINE void sfor(F&& f) {
  sfor_impl(std::make_integer_sequence<int, N>{}, f);
}
#define AQ_CV(T) decltype(T)::value

// ---------------------------------------------------------------------------------------------
// 16-lane fp32 / int32 vectors: one zmm (AVX-512), two ymm (AVX2) or a plain array (portable).
// ---------------------------------------------------------------------------------------------
#if AQ_AVX512
inline constexpr const char* kIsa = "avx512";
struct F16 { __m512 v; };
struct I16 { __m512i v; };
AQ_INLINE F16 fzero() { return {_mm512_setzero_ps()}; }
AQ_INLINE F16 fload(const float* p) { return {_mm512_loadu_ps(p)}; }
AQ_INLINE void fstore(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
AQ_INLINE F16 fload_n(const float* p, int w) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << w) - 1u), p)}; }
AQ_INLINE void fstore_n(float* p, F16 a, int w) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << w) - 1u), a.v); }
AQ_INLINE F16 fset1(float s) { return {_mm512_set1_ps(s)}; }
AQ_INLINE F16 ffma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// ffma(fset1(*p), b, c) with the broadcast embedded in the FMA's memory operand (GCC otherwise broadcasts into a
// register of its own, kept while it is reused, which can push a tile's accumulators to the stack).
AQ_INLINE F16 ffma_bcst(const float* p, F16 b, F16 c) {
  __m512 r = c.v;
  asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(r) : "v"(b.v), "m"(*p));
  return {r};
}
AQ_INLINE F16 fadd(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
AQ_INLINE F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
AQ_INLINE I16 ld_u8x16(const uint8_t* p) {
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
AQ_INLINE I16 ld_s8x16(const int8_t* p) {
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
template <int S> AQ_INLINE I16 isrl(I16 a) {
  if constexpr (S == 0) return a; else return {_mm512_srli_epi32(a.v, S)};
}
template <int S> AQ_INLINE I16 isll(I16 a) {
  if constexpr (S == 0) return a; else return {_mm512_slli_epi32(a.v, S)};
}
AQ_INLINE I16 iand(I16 a, int m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
AQ_INLINE I16 ior(I16 a, I16 b) { return {_mm512_or_si512(a.v, b.v)}; }
AQ_INLINE F16 i2f(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
AQ_INLINE float fhsum(F16 a) { return _mm512_reduce_add_ps(a.v); }
#elif AQ_AVX2
inline constexpr const char* kIsa = "avx2";
struct F16 { __m256 a, b; };
struct I16 { __m256i a, b; };
AQ_INLINE F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AQ_INLINE F16 fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
AQ_INLINE void fstore(float* p, F16 x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
AQ_INLINE F16 fload_n(const float* p, int w) {
  alignas(32) float t[16] = {};
  std::memcpy(t, p, sizeof(float) * w);
  return fload(t);
}
AQ_INLINE void fstore_n(float* p, F16 x, int w) {
  alignas(32) float t[16];
  fstore(t, x);
  std::memcpy(p, t, sizeof(float) * w);
}
AQ_INLINE F16 fset1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
AQ_INLINE F16 ffma(F16 x, F16 y, F16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
AQ_INLINE F16 ffma_bcst(const float* p, F16 b, F16 c) { return ffma(fset1(*p), b, c); }
AQ_INLINE F16 fadd(F16 x, F16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
AQ_INLINE F16 fmul(F16 x, F16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
AQ_INLINE I16 ld_u8x16(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
AQ_INLINE I16 ld_s8x16(const int8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
template <int S> AQ_INLINE I16 isrl(I16 x) {
  if constexpr (S == 0) return x; else return {_mm256_srli_epi32(x.a, S), _mm256_srli_epi32(x.b, S)};
}
template <int S> AQ_INLINE I16 isll(I16 x) {
  if constexpr (S == 0) return x; else return {_mm256_slli_epi32(x.a, S), _mm256_slli_epi32(x.b, S)};
}
AQ_INLINE I16 iand(I16 x, int m) {
  const __m256i mm = _mm256_set1_epi32(m);
  return {_mm256_and_si256(x.a, mm), _mm256_and_si256(x.b, mm)};
}
AQ_INLINE I16 ior(I16 x, I16 y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
AQ_INLINE F16 i2f(I16 x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
AQ_INLINE float fhsum(F16 x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}
#else
// Portable path: plain loops the compiler may auto-vectorize for whatever ISA it targets.
inline constexpr const char* kIsa = "scalar";
struct F16 { float v[16]; };
struct I16 { int32_t v[16]; };
#define AQ_L16 for (int i = 0; i < 16; ++i)
AQ_INLINE F16 fzero() { F16 r; AQ_L16 r.v[i] = 0.f; return r; }
AQ_INLINE F16 fload(const float* p) { F16 r; AQ_L16 r.v[i] = p[i]; return r; }
AQ_INLINE void fstore(float* p, F16 a) { AQ_L16 p[i] = a.v[i]; }
AQ_INLINE F16 fload_n(const float* p, int w) { F16 r; AQ_L16 r.v[i] = i < w ? p[i] : 0.f; return r; }
AQ_INLINE void fstore_n(float* p, F16 a, int w) { for (int i = 0; i < w; ++i) p[i] = a.v[i]; }
AQ_INLINE F16 fset1(float s) { F16 r; AQ_L16 r.v[i] = s; return r; }
AQ_INLINE F16 ffma(F16 a, F16 b, F16 c) { F16 r; AQ_L16 r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
AQ_INLINE F16 ffma_bcst(const float* p, F16 b, F16 c) { return ffma(fset1(*p), b, c); }
AQ_INLINE F16 fadd(F16 a, F16 b) { F16 r; AQ_L16 r.v[i] = a.v[i] + b.v[i]; return r; }
AQ_INLINE F16 fmul(F16 a, F16 b) { F16 r; AQ_L16 r.v[i] = a.v[i] * b.v[i]; return r; }
AQ_INLINE I16 ld_u8x16(const uint8_t* p) { I16 r; AQ_L16 r.v[i] = p[i]; return r; }
AQ_INLINE I16 ld_s8x16(const int8_t* p) { I16 r; AQ_L16 r.v[i] = p[i]; return r; }
template <int S> AQ_INLINE I16 isrl(I16 a) { I16 r; AQ_L16 r.v[i] = (int32_t)((uint32_t)a.v[i] >> S); return r; }
template <int S> AQ_INLINE I16 isll(I16 a) { I16 r; AQ_L16 r.v[i] = (int32_t)((uint32_t)a.v[i] << S); return r; }
AQ_INLINE I16 iand(I16 a, int m) { I16 r; AQ_L16 r.v[i] = a.v[i] & m; return r; }
AQ_INLINE I16 ior(I16 a, I16 b) { I16 r; AQ_L16 r.v[i] = a.v[i] | b.v[i]; return r; }
AQ_INLINE F16 i2f(I16 a) { F16 r; AQ_L16 r.v[i] = (float)a.v[i]; return r; }
AQ_INLINE float fhsum(F16 a) { float s = 0.f; AQ_L16 s += a.v[i]; return s; }
#undef AQ_L16
#endif

}  // namespace
}  // namespace affineq::detail
