// SIMD kernels for y = x @ W^T with W[n, k] = scale[n, g] * u[n, k] + offset[n, g], g = k / group_size,
// u unsigned `bits`-bit codes in the 16-row panel layout (documented in affineq/kernels/__init__.py), or
// float8 bytes (e4m3fn / e5m2, 8-bit layout) whose value replaces u. scale/offset are fp32, or bf16 with the
// offset holding the zero z of W = scale * (u - 2^(bits-1)) + z; either way they are turned into fp32
// scale/offset once per tile while being transposed, so the inner loops never see bf16.
//
// Three paths (chosen in run()):
//  1. fused GEMV (m <= 2 before path 3, else m <= 8; group_size % 8 == 0): decode codes straight into fp32
//     registers, 16 output rows per vector, FMA against broadcast x; scale/offset applied once per group:
//         y[n] = sum_g scale[n, g] * dot(x_g, u[n, g]) + offset[n, g] * sum(x_g).
//     Memory-bound at m = 1: the packed weights are streamed once, with software prefetch.
//  2. dequant + fp32 GEMM (any group_size; the large-m path where VNNI is missing): dequantize a [256 x 32]
//     slice of W^T into an L1-resident fp32 tile and run a 12x32 (AVX-512) / 6x16 (AVX2) outer-product
//     micro-kernel over all m rows, so each dequantized tile is reused m times.
//  3. dequant + int16 VNNI GEMM (AVX512-VNNI, m >= 3, only if the caller allows rounding x: by default for
//     fp16 x, and bf16 x without AVX512-BF16): like 2 but with exact int16 code pairs and x rounded to 16-bit
//     fixed point per block; vpdpwssd does two MACs per lane at the issue rate of an fp32 FMA.
//  4. dequant to bf16 + bf16 dot GEMM (AVX512-BF16, bf16 x, m >= 3): like 2 but the tile holds W rounded to
//     bf16 (scale and offset already applied) and vdpbf16ps multiplies it with x as given: no per-group
//     rescaling in the inner loop, so small groups cost no more than large ones.
//
// Only <ATen/Parallel.h> is included (compiles fast, no torch types); threads come from torch's OpenMP pool.
#include "lowbit_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    !defined(AFFINEQ_FORCE_AVX2) && !defined(AFFINEQ_FORCE_SCALAR)
#define AQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(AFFINEQ_FORCE_SCALAR)
#define AQ_AVX2 1
#endif

#if defined(__GNUC__)
#define AQ_INLINE inline __attribute__((always_inline))
#define AQ_OPAQUE(ptr) asm("" : "+r"(ptr))  // the compiler forgets where ptr points (no store forwarding)
#else
#define AQ_INLINE inline
#define AQ_OPAQUE(ptr) (void)(ptr)
#endif

namespace affineq {
namespace {

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
constexpr const char* kIsa = "avx512";
struct F16 { __m512 v; };
struct I16 { __m512i v; };
AQ_INLINE F16 fzero() { return {_mm512_setzero_ps()}; }
AQ_INLINE F16 fload(const float* p) { return {_mm512_loadu_ps(p)}; }
AQ_INLINE void fstore(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
AQ_INLINE F16 fload_n(const float* p, int w) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << w) - 1u), p)}; }
AQ_INLINE void fstore_n(float* p, F16 a, int w) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << w) - 1u), a.v); }
AQ_INLINE F16 fset1(float s) { return {_mm512_set1_ps(s)}; }
AQ_INLINE F16 ffma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
AQ_INLINE F16 fadd(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
AQ_INLINE I16 ld_u8x16(const uint8_t* p) {
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
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
constexpr const char* kIsa = "avx2";
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
AQ_INLINE F16 fadd(F16 x, F16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
AQ_INLINE I16 ld_u8x16(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
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
constexpr const char* kIsa = "scalar";
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
AQ_INLINE F16 fadd(F16 a, F16 b) { F16 r; AQ_L16 r.v[i] = a.v[i] + b.v[i]; return r; }
AQ_INLINE I16 ld_u8x16(const uint8_t* p) { I16 r; AQ_L16 r.v[i] = p[i]; return r; }
template <int S> AQ_INLINE I16 isrl(I16 a) { I16 r; AQ_L16 r.v[i] = (int32_t)((uint32_t)a.v[i] >> S); return r; }
template <int S> AQ_INLINE I16 isll(I16 a) { I16 r; AQ_L16 r.v[i] = (int32_t)((uint32_t)a.v[i] << S); return r; }
AQ_INLINE I16 iand(I16 a, int m) { I16 r; AQ_L16 r.v[i] = a.v[i] & m; return r; }
AQ_INLINE I16 ior(I16 a, I16 b) { I16 r; AQ_L16 r.v[i] = a.v[i] | b.v[i]; return r; }
AQ_INLINE F16 i2f(I16 a) { F16 r; AQ_L16 r.v[i] = (float)a.v[i]; return r; }
AQ_INLINE float fhsum(F16 a) { float s = 0.f; AQ_L16 s += a.v[i]; return s; }
#undef AQ_L16
#endif

// Template "widths" B: 1..8 are unsigned codes of that many bits; kBE4M3 / kBE5M2 are float8 bytes stored in
// the 8-bit layout. bits_of(B) is the storage width.
constexpr int kBE4M3 = 8 | 16, kBE5M2 = 8 | 32;
constexpr int bits_of(int B) { return B & 15; }
// The float8 decoders below return e4m3 values times 2^-8 (an exact re-bias into fp16); code_scale undoes it.
constexpr float code_scale(int B) { return B == kBE4M3 ? 256.f : 1.f; }

// Portable float8 -> float (also the reference for the SIMD decoders): e4m3fn has bias 7, no infinities and
// NaN at 0x7F/0xFF; e5m2 is the top byte of an IEEE fp16.
inline float fp8_to_float(uint8_t v, int codes) {
  const bool neg = (v & 0x80) != 0;
  float mag;
  if (codes == kCodesE5M2) {
    const int e = (v >> 2) & 31, m = v & 3;
    mag = e == 0 ? std::ldexp(static_cast<float>(m), -16)
        : e == 31 ? (m == 0 ? INFINITY : NAN)
                  : std::ldexp(static_cast<float>(4 + m), e - 17);
  } else {
    const int e = (v >> 3) & 15, m = v & 7;
    mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
        : (e == 15 && m == 7) ? NAN
                              : std::ldexp(static_cast<float>(8 + m), e - 10);
  }
  return neg ? -mag : mag;
}

// float8 -> fp16 bits, in 16-bit lanes holding the float8 byte in their high half: e5m2 bytes are fp16's top
// byte already; an e4m3 byte seeeemmm becomes s0eeeemmm0000000 (arithmetic shift by one duplicates s, the mask
// clears the copy), whose fp16 value is the e4m3 value times 2^-8, subnormals included (vcvtph2ps handles
// them in hardware). NaN bytes do not occur (quantization rejects non-finite weights).
#if AQ_AVX512 || (AQ_AVX2 && defined(__F16C__))
template <int B>
AQ_INLINE __m256i fp8_to_fp16_bits(__m256i hi_bytes) {
  if constexpr (B == kBE4M3)
    return _mm256_and_si256(_mm256_srai_epi16(hi_bytes, 1), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  else return hi_bytes;
}
#endif

// 16 float8 bytes -> 16 floats (AVX2 converts whole units instead, in decode_unit).
template <int B>
AQ_INLINE F16 fp8x16(const uint8_t* p) {
#if AQ_AVX512
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtph_ps(fp8_to_fp16_bits<B>(_mm256_slli_epi16(v, 8)))};
#else
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = fp8_to_float(p[i], B == kBE5M2 ? kCodesE5M2 : kCodesE4M3) / code_scale(B);
  return fload(t);
#endif
}

// ---------------------------------------------------------------------------------------------
// Decoding one unit (8 consecutive k of a 16-row panel, 16 * B bytes).
// decode_unit_i calls f(integral_constant<t>, v) with int32 v[j] = u[row j, 8 * unit + t] for t = 0..7;
// decode_unit hands over float(v). Single-plane widths (1, 2, 4, 8) hand each k over as soon as it is
// decoded (fewer live registers).
// ---------------------------------------------------------------------------------------------
#if AQ_AVX2 || AQ_AVX512
// Multi-plane widths on AVX2 and AVX-512: combining the planes in 32-bit lanes (the portable branch of
// decode_unit_i) costs ~8 ops per 8 codes and, on AVX2 (two ymm per 16 lanes, 16 registers), spilled. Here
// the planes are combined in byte lanes, 32 codes per op (ymm t holds k = t and k = 4 + t), and written out
// as an 8-bit unit that the 8-bit decoder widens with vpmovzxbd straight from L1 (AVX2 GEMV: int3 0.64 ->
// 0.51 ns per 8 weights; AVX-512: int7 0.54 -> 0.45, int3 0.37 -> 0.35). The 4-bit plane is loaded as [chunk t/2 | chunk t/2 + 2]
// so that its nibbles pair k like the 2-bit plane's [chunk 0 | chunk 1] and the 1-bit plane's [bits 0..3 |
// bits 4..7].
template <int B>
AQ_INLINE void decode_unit_bytes(const uint8_t* p, uint8_t* out) {
  static_assert(B == 3 || B == 5 || B == 6 || B == 7);
  const auto mask = [](int m) { return _mm256_set1_epi8(static_cast<char>(m)); };
  const auto ld128 = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  // Shift left by S >= 0 or right by -S in 16-bit lanes; callers mask to bits that stay within their byte.
  const auto shift = [](__m256i v, auto S_) {
    constexpr int S = AQ_CV(S_);
    if constexpr (S > 0) return _mm256_slli_epi16(v, S);
    else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
    else return v;
  };
  constexpr int kSh2 = (B & 4) ? 4 : 0;               // bit position of the 2-bit plane's codes
  constexpr int kSh1 = kSh2 + ((B & 2) ? 2 : 0);     // bit position of the 1-bit plane's codes
  constexpr int kOff2 = (B & 4) ? 64 : 0, kOff1 = kOff2 + ((B & 2) ? 32 : 0);
  __m256i v4[2], v2, v1;
  if constexpr ((B & 4) != 0)
    for (int h = 0; h < 2; ++h)
      v4[h] = _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(p + 16 * h)), ld128(p + 16 * h + 32), 1);
  if constexpr ((B & 2) != 0) v2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kOff2));
  if constexpr ((B & 1) != 0) {
    const __m256i b = _mm256_broadcastsi128_si256(ld128(p + kOff1));
    v1 = _mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4));
  }
  sfor<4>([&](auto T) {
    constexpr int t = AQ_CV(T);
    __m256i c;
    if constexpr ((B & 4) != 0) {
      c = _mm256_and_si256((t & 1) ? _mm256_srli_epi16(v4[t / 2], 4) : v4[t / 2], mask(15));
    }
    if constexpr ((B & 2) != 0) {
      const __m256i c2 = _mm256_and_si256(shift(v2, std::integral_constant<int, kSh2 - 2 * t>{}), mask(3 << kSh2));
      c = (B & 4) ? _mm256_or_si256(c, c2) : c2;
    }
    if constexpr ((B & 1) != 0)
      c = _mm256_or_si256(c, _mm256_and_si256(shift(v1, std::integral_constant<int, kSh1 - t>{}), mask(1 << kSh1)));
    // k = t and k = 4 + t, rows 0..15 each: the 8-bit unit layout
    _mm_store_si128(reinterpret_cast<__m128i*>(out + 16 * t), _mm256_castsi256_si128(c));
    _mm_store_si128(reinterpret_cast<__m128i*>(out + 16 * (t + 4)), _mm256_extracti128_si256(c, 1));
  });
}
#endif

template <int B, class F>
AQ_INLINE void decode_unit_i(const uint8_t* p, F&& f) {
#if AQ_AVX2 || AQ_AVX512
  if constexpr (B == 3 || B == 5 || B == 6 || B == 7) {
    alignas(32) uint8_t buf[128];
    decode_unit_bytes<B>(p, buf);
    // Keep the round trip through memory: left to itself the compiler widens in registers (vmovq, vpsrldq,
    // vextracti128 + vpmovzxbd: 2-3 shuffles per 8 codes instead of one vpmovzxbd from L1). Hiding the pointer
    // does it; an "m" operand on buf instead made GCC keep the caller's accumulators in memory (-15%).
    const uint8_t* q = buf;
    AQ_OPAQUE(q);
    decode_unit_i<8>(q, f);
    return;
  }
#endif
  if constexpr (B == 8) {
    sfor<8>([&](auto T) { f(T, ld_u8x16(p + 16 * AQ_CV(T))); });
  } else if constexpr (B == 4) {
    sfor<4>([&](auto S) {
      constexpr int s = AQ_CV(S);
      const I16 v = ld_u8x16(p + 16 * s);
      f(std::integral_constant<int, 2 * s>{}, iand(v, 15));
      f(std::integral_constant<int, 2 * s + 1>{}, isrl<4>(v));
    });
  } else if constexpr (B == 2) {
    sfor<2>([&](auto S) {
      constexpr int s = AQ_CV(S);
      const I16 v = ld_u8x16(p + 16 * s);
      sfor<4>([&](auto T) {
        constexpr int t = AQ_CV(T);
        f(std::integral_constant<int, 4 * s + t>{}, t == 3 ? isrl<6>(v) : iand(isrl<2 * t>(v), 3));
      });
    });
  } else if constexpr (B == 1) {
    const I16 v = ld_u8x16(p);
    sfor<8>([&](auto T) {
      constexpr int t = AQ_CV(T);
      f(T, t == 7 ? isrl<7>(v) : iand(isrl<t>(v), 1));
    });
  } else {
    // Multi-plane widths 3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1 (low bits in the widest plane).
    I16 u[8];
    constexpr int kSh2 = (B & 4) ? 4 : 0;
    constexpr int kSh1 = kSh2 + ((B & 2) ? 2 : 0);
    const uint8_t* q = p;
    if constexpr ((B & 4) != 0) {
      sfor<4>([&](auto S) {
        constexpr int s = AQ_CV(S);
        const I16 v = ld_u8x16(q + 16 * s);
        u[2 * s] = iand(v, 15);
        u[2 * s + 1] = isrl<4>(v);
      });
      q += 64;
    }
    if constexpr ((B & 2) != 0) {
      sfor<2>([&](auto S) {
        constexpr int s = AQ_CV(S);
        const I16 v = ld_u8x16(q + 16 * s);
        sfor<4>([&](auto T) {
          constexpr int t = AQ_CV(T);
          const I16 c = iand(isrl<2 * t>(v), 3);
          if constexpr ((B & 4) != 0) u[4 * s + t] = ior(u[4 * s + t], isll<kSh2>(c));
          else u[4 * s + t] = c;
        });
      });
      q += 32;
    }
    if constexpr ((B & 1) != 0) {
      const I16 v = ld_u8x16(q);
      sfor<8>([&](auto T) {
        constexpr int t = AQ_CV(T);
        u[t] = ior(u[t], isll<kSh1>(iand(isrl<t>(v), 1)));
      });
    }
    sfor<8>([&](auto T) { f(T, u[AQ_CV(T)]); });
  }
}

template <int B, class F>
AQ_INLINE void decode_unit(const uint8_t* p, F&& f) {
#if AQ_AVX2 && defined(__F16C__)
  if constexpr (B > 8) {
    // AVX2 float8: the fp16 bits of 32 codes per op (the bytes of k = 2j and 2j + 1 become words through
    // vpunpck*bw, within 128-bit lanes), then vcvtph2ps from L1: no vextracti128 per 16 codes as in registers.
    alignas(32) uint16_t buf[128];
    sfor<4>([&](auto J) {
      constexpr int j = AQ_CV(J);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)), z = _mm256_setzero_si256();
      // lo = [k = 2j rows 0-7 | k = 2j + 1 rows 0-7], hi = the same for rows 8-15
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32 * j), fp8_to_fp16_bits<B>(_mm256_unpacklo_epi8(z, v)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32 * j + 16),
                         fp8_to_fp16_bits<B>(_mm256_unpackhi_epi8(z, v)));
    });
    const uint16_t* q = buf;
    AQ_OPAQUE(q);  // see decode_unit_i
    sfor<8>([&](auto T) {
      constexpr int t = AQ_CV(T);
      const uint16_t* r = q + 32 * (t / 2) + 8 * (t % 2);
      f(T, F16{_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(r))),
               _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(r + 16)))});
    });
    return;
  }
#endif
  if constexpr (B > 8) sfor<8>([&](auto T) { f(T, fp8x16<B>(p + 16 * AQ_CV(T))); });
  else decode_unit_i<B>(p, [&](auto T, I16 v) { f(T, i2f(v)); });
}

// ---------------------------------------------------------------------------------------------
// Scratch buffers: one set per worker thread, grown on demand and kept (no malloc per call).
// ---------------------------------------------------------------------------------------------
struct Scratch {
  void* ptr = nullptr;
  size_t cap = 0;
  template <class T>
  T* get(size_t n) {
    const size_t bytes = ((n * sizeof(T)) + 63) / 64 * 64 + 64;
    if (bytes > cap) {
      std::free(ptr);
      ptr = std::aligned_alloc(64, bytes);
      if (ptr == nullptr) throw std::bad_alloc();
      cap = bytes;
    }
    return static_cast<T*>(ptr);
  }
  ~Scratch() { std::free(ptr); }
};
thread_local Scratch tl_scale, tl_offset, tl_tail, tl_wbuf, tl_xrow, tl_cbuf, tl_qconv, tl_qconv2;
thread_local Scratch tl_xcall, tl_sxcall, tl_xscall;  // per-call x buffers (owned by the calling thread)

// dst[g * ldd + r] = src[r * lds + g] for r < rows, g < G; rows in [rows, R) are zero-filled.
// (Scales arrive as [n, G]; the kernels want 16 consecutive rows per vector, hence the transpose.)
void transpose_rows(const float* src, int64_t lds, int64_t rows, int64_t R, int64_t G, float* dst, int64_t ldd) {
  int64_t g0 = 0;
#if AQ_AVX512
  if (rows == R && R % 16 == 0) {
    for (; g0 + 16 <= G; g0 += 16) {
      for (int64_t r0 = 0; r0 < R; r0 += 16) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (r0 + i) * lds + g0);
        for (int i = 0; i < 8; ++i) {
          t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // c[R4][c'] (R4 = row quad): lane L holds column 4L + c' for rows 4*R4 .. 4*R4+3.
        __m512 c[4][4];
        for (int q = 0; q < 4; ++q) {
          const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
          const __m512d d = _mm512_castps_pd(t[4 * q + 2]), e = _mm512_castps_pd(t[4 * q + 3]);
          c[q][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, d));
          c[q][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, d));
          c[q][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
          c[q][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
        }
        for (int cc = 0; cc < 4; ++cc) {
          const __m512 u0 = _mm512_shuffle_f32x4(c[0][cc], c[1][cc], 0x44);
          const __m512 u1 = _mm512_shuffle_f32x4(c[0][cc], c[1][cc], 0xEE);
          const __m512 u2 = _mm512_shuffle_f32x4(c[2][cc], c[3][cc], 0x44);
          const __m512 u3 = _mm512_shuffle_f32x4(c[2][cc], c[3][cc], 0xEE);
          _mm512_storeu_ps(dst + (g0 + 0 + cc) * ldd + r0, _mm512_shuffle_f32x4(u0, u2, 0x88));
          _mm512_storeu_ps(dst + (g0 + 4 + cc) * ldd + r0, _mm512_shuffle_f32x4(u0, u2, 0xDD));
          _mm512_storeu_ps(dst + (g0 + 8 + cc) * ldd + r0, _mm512_shuffle_f32x4(u1, u3, 0x88));
          _mm512_storeu_ps(dst + (g0 + 12 + cc) * ldd + r0, _mm512_shuffle_f32x4(u1, u3, 0xDD));
        }
      }
    }
  }
#elif AQ_AVX2
  // 8x8 blocks (the scalar loop below made qparam loading ~40% of a g32 GEMV on AVX2).
  if (rows == R && R % 8 == 0) {
    for (; g0 + 8 <= G; g0 += 8) {
      for (int64_t r0 = 0; r0 < R; r0 += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (r0 + i) * lds + g0);
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // c[h][c']: in each 128-bit half, column c' (+4 in the high half) of rows 4h .. 4h+3.
        __m256 c[2][4];
        for (int h = 0; h < 2; ++h) {
          const __m256d a = _mm256_castps_pd(t[4 * h]), b = _mm256_castps_pd(t[4 * h + 1]);
          const __m256d d = _mm256_castps_pd(t[4 * h + 2]), e = _mm256_castps_pd(t[4 * h + 3]);
          c[h][0] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, d));
          c[h][1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, d));
          c[h][2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, e));
          c[h][3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, e));
        }
        for (int cc = 0; cc < 4; ++cc) {
          _mm256_storeu_ps(dst + (g0 + cc) * ldd + r0, _mm256_permute2f128_ps(c[0][cc], c[1][cc], 0x20));
          _mm256_storeu_ps(dst + (g0 + 4 + cc) * ldd + r0, _mm256_permute2f128_ps(c[0][cc], c[1][cc], 0x31));
        }
      }
    }
  }
#endif
  for (int64_t g = g0; g < G; ++g) {
    float* d = dst + g * ldd;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * lds + g];
    for (int64_t r = rows; r < R; ++r) d[r] = 0.f;
  }
}

AQ_INLINE float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Element i of an [n, G] qparam array as the kernels use it: the fp32 scale times `mul`, or the fp32 offset
// (for bf16 qparams: z - 2^(bits-1) * scale).
AQ_INLINE float qparam_at(const LowbitProblem& p, bool offset, float mul, int64_t i) {
  if (!p.qparams_bf16) return static_cast<const float*>(offset ? p.offset : p.scale)[i] * mul;
  const float s = bf16_to_float(static_cast<const uint16_t*>(p.scale)[i]);
  if (!offset) return s * mul;
  return bf16_to_float(static_cast<const uint16_t*>(p.offset)[i]) - static_cast<float>(1 << (p.bits - 1)) * s;
}

// dst[g * ldd + r] = qparam_at(r0 + r, g) for r < rows (zero up to R): the scales (offset=false, times `mul`)
// or offsets of rows [r0, r0 + rows), transposed so 16 consecutive rows form one vector.
void load_qparams(const LowbitProblem& p, bool offset, float mul, int64_t r0, int64_t rows, int64_t R, int64_t G,
                  float* dst, int64_t ldd) {
  const float* src = static_cast<const float*>(offset ? p.offset : p.scale) + r0 * G;
  if (p.qparams_bf16 || mul != 1.f) {
    // Straight-line loops per case (the per-element qparam_at would not vectorize: ~1.5 ns per element).
    const int64_t cnt = rows * G;
    float* t = tl_qconv.get<float>(cnt);
    const uint16_t* s16 = static_cast<const uint16_t*>(p.scale) + r0 * G;
    const uint16_t* z16 = static_cast<const uint16_t*>(p.offset) + r0 * G;
    const auto widen = [](uint16_t b) { return static_cast<uint32_t>(b) << 16; };
    if (!p.qparams_bf16) {
      for (int64_t i = 0; i < cnt; ++i) t[i] = src[i] * mul;
    } else if (!offset) {
      uint32_t* tb = reinterpret_cast<uint32_t*>(t);
      for (int64_t i = 0; i < cnt; ++i) tb[i] = widen(s16[i]);
      if (mul != 1.f)
        for (int64_t i = 0; i < cnt; ++i) t[i] *= mul;
    } else {
      const float half = static_cast<float>(1 << (p.bits - 1));
      float* sc = tl_qconv2.get<float>(cnt);
      uint32_t* tb = reinterpret_cast<uint32_t*>(t);
      uint32_t* sb = reinterpret_cast<uint32_t*>(sc);
      for (int64_t i = 0; i < cnt; ++i) {
        tb[i] = widen(z16[i]);
        sb[i] = widen(s16[i]);
      }
      for (int64_t i = 0; i < cnt; ++i) t[i] -= half * sc[i];
    }
    src = t;
  }
  transpose_rows(src, G, rows, R, G, dst, ldd);
}

// Transposed fp32 scales and offsets of rows [r0, r0 + rows) for the GEMM tiles (thread-local, R columns),
// plus an all-zero group G that the padding columns k >= K point at (see group_of_k).
void load_tile_qparams(const LowbitProblem& p, float mul, int64_t r0, int64_t rows, int64_t R, int64_t G, float*& sT,
                       float*& oT) {
  sT = tl_scale.get<float>((G + 1) * R);
  oT = tl_offset.get<float>((G + 1) * R);
  load_qparams(p, false, mul, r0, rows, R, G, sT, R);
  load_qparams(p, true, 1.f, r0, rows, R, G, oT, R);
  std::fill(sT + G * R, sT + (G + 1) * R, 0.f);
  std::fill(oT + G * R, oT + (G + 1) * R, 0.f);
}

// Group index of each of the K8 (padded) columns; padding columns get the extra all-zero group G.
std::vector<int32_t> group_of_k(const LowbitProblem& p, int64_t K8, int64_t G) {
  std::vector<int32_t> kg(static_cast<size_t>(K8));
  for (int64_t k = 0; k < K8; ++k) kg[k] = static_cast<int32_t>(k < p.k ? k / p.group_size : G);
  return kg;
}

// xs[m * G + g] = sum(x[m, g * gs : (g + 1) * gs]) for the offset term (vectorized: M * K adds per call).
void group_sums(const float* x, int64_t ldx, int64_t M, int64_t G, int64_t gs, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xr = x + m * ldx + g * gs;
      F16 acc0 = fzero(), acc1 = fzero();
      int64_t i = 0;
      for (; i + 32 <= gs; i += 32) {
        acc0 = fadd(acc0, fload(xr + i));
        acc1 = fadd(acc1, fload(xr + i + 16));
      }
      for (; i + 16 <= gs; i += 16) acc0 = fadd(acc0, fload(xr + i));
      if (i < gs) acc1 = fadd(acc1, fload_n(xr + i, static_cast<int>(gs - i)));
      xs[m * G + g] = fhsum(fadd(acc0, acc1));
    }
}

// Prefetch units [u0, u0 + nu) of `np` panels into L2 (null panels skipped).
void prefetch_units(const uint8_t* const* pan, int np, int64_t u0, int64_t nu, int B) {
#if defined(__GNUC__)
  for (int p = 0; p < np; ++p) {
    if (pan[p] == nullptr) continue;
    const uint8_t* b = pan[p] + u0 * 16 * B;
    for (int64_t off = 0; off < nu * 16 * B; off += 64) __builtin_prefetch(b + off, 0, 2);
  }
#endif
}

// y[m, c] = cbuf[m * ldc + c] for c < cols (writes back a dense accumulator tile).
void store_tile(const float* cbuf, int64_t ldc, int64_t rows, int64_t cols, float* y, int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) std::memcpy(y + m * ldy, cbuf + m * ldc, sizeof(float) * cols);
}

// Grain for at::parallel_for: enough items that one chunk carries >= ~2^17 multiply-adds, so small layers
// run inline instead of paying an OpenMP fork/join (several microseconds) for a few microseconds of work.
int64_t grain_for(int64_t macs_per_item) {
  constexpr int64_t kMinMacs = int64_t{1} << 17;
  return std::max<int64_t>(1, kMinMacs / std::max<int64_t>(1, macs_per_item));
}

struct Ctx {
  const LowbitProblem* p;
  int B;
  int64_t K8, U, G, N, M;
  int64_t nfull, tail_w, npan;  // full 16-row panels, rows in the narrower last panel, panels in total
  int64_t panel_bytes;          // bytes of one full panel = 16 * U * B
};

// Pointer to panel `pi` in the 16-wide layout; the narrower tail panel is re-spread into 16-byte slots.
const uint8_t* panel_ptr(const Ctx& c, int64_t pi) {
  if (pi >= c.npan) return nullptr;
  const uint8_t* base = c.p->packed + pi * c.panel_bytes;
  if (pi < c.nfull) return base;
  const int64_t w = c.tail_w, slots = c.U * c.B;  // a unit of a w-row panel is B slots of w bytes
  uint8_t* t = tl_tail.get<uint8_t>(slots * 16);
  for (int64_t s = 0; s < slots; ++s) {
    std::memcpy(t + s * 16, base + s * w, w);
    std::memset(t + s * 16 + w, 0, 16 - w);
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Fused GEMV path.
// ---------------------------------------------------------------------------------------------
// Panels per tile (P) and split accumulators per panel (A) for MR rows of x: enough independent FMA
// chains to hide latency without spilling (32 zmm / 16 ymm registers).
#if AQ_AVX512
constexpr int kItemPanels = 4;
constexpr int gemv_P(int mr, int) { return mr <= 2 ? 4 : 2; }
constexpr int gemv_A(int mr) { return mr == 1 ? 2 : 1; }
#elif AQ_AVX2
constexpr int kItemPanels = 2;
// Multi-plane and float8 decoding hold more registers: one panel per tile measured 4% faster for them.
constexpr int gemv_P(int mr, int B) { return mr == 1 && (B == 1 || B == 2 || B == 4 || B == 8) ? 2 : 1; }
constexpr int gemv_A(int mr) { return mr <= 2 ? 2 : 1; }  // A=1 at m=1 was FMA-latency bound (-45%)
#else
constexpr int kItemPanels = 1;
constexpr int gemv_P(int, int) { return 1; }
constexpr int gemv_A(int) { return 1; }
#endif
// Rows of x per pass over the weights. With VNNI the GEMV only serves m <= 2 (path 3 wins from m = 3), so
// only those variants are compiled (shorter build).
#if AQ_AVX512 && defined(__AVX512VNNI__)
constexpr int kGemvMR = 2;
#else
constexpr int kGemvMR = 4;
#endif

// Software prefetch distance (units ahead on each panel stream): at m = 1 the kernel streams the weights from
// DRAM and the hardware prefetchers alone left ~10% of the bandwidth unused (measured 16..48, 24 best).
constexpr int64_t kPrefetchUnits = 24;

// Prefetches the raw qparams of the next work item, a few cache lines per group of the current one. Without
// it load_qparams read them from DRAM through 16..32 strided streams: ~25% of a g32 GEMV's time on AVX2.
struct QparamPrefetch {
  const char* src[2] = {nullptr, nullptr};  // scale and offset rows of the next item (contiguous)
  int64_t bytes = 0, lines_per_group = 0;
  QparamPrefetch(const LowbitProblem& p, int64_t r0, int64_t rows, int64_t G) {
    const int64_t esz = p.qparams_bf16 ? 2 : 4;
    src[0] = static_cast<const char*>(p.scale) + r0 * G * esz;
    src[1] = static_cast<const char*>(p.offset) + r0 * G * esz;
    bytes = rows * G * esz;
    lines_per_group = ((bytes + 63) / 64 + G - 1) / G;
  }
  AQ_INLINE void group(int64_t g) const {
#if defined(__GNUC__)
    for (int64_t l = g * lines_per_group, e = std::min(l + lines_per_group, (bytes + 63) / 64); l < e; ++l) {
      __builtin_prefetch(src[0] + 64 * l, 0, 2);
      __builtin_prefetch(src[1] + 64 * l, 0, 2);
    }
#endif
  }
};

template <int B, int MR, int P, int A>
void gemv_tile(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds, const float* x,
               int64_t ldx, const float* xs, int64_t G, int64_t upg, float* y, int64_t ldy, int64_t nvalid,
               const QparamPrefetch* pf) {
  F16 tot[MR][P];
  sfor<MR>([&](auto M_) { sfor<P>([&](auto P_) { tot[AQ_CV(M_)][AQ_CV(P_)] = fzero(); }); });
  for (int64_t g = 0; g < G; ++g) {
    if (pf) pf->group(g);
    F16 acc[MR][P][A];
    sfor<MR>([&](auto M_) {
      sfor<P>([&](auto P_) { sfor<A>([&](auto A_) { acc[AQ_CV(M_)][AQ_CV(P_)][AQ_CV(A_)] = fzero(); }); });
    });
    for (int64_t u = g * upg, ue = u + upg; u < ue; ++u) {
      const float* xk = x + 8 * u;
      sfor<P>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
#if defined(__GNUC__)
        for (int l = 0; l < 16 * bits_of(B); l += 64)
          __builtin_prefetch(pan[p] + (u + kPrefetchUnits) * (16 * bits_of(B)) + l, 0, 3);
#endif
        decode_unit<B>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
          constexpr int t = AQ_CV(T);
          sfor<MR>([&](auto M_) {
            constexpr int m = AQ_CV(M_);
            acc[m][p][t % A] = ffma(fset1(xk[m * ldx + t]), w, acc[m][p][t % A]);
          });
        });
      });
    }
    sfor<P>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const F16 s = fload(sT + g * lds + 16 * p), o = fload(oT + g * lds + 16 * p);
      sfor<MR>([&](auto M_) {
        constexpr int m = AQ_CV(M_);
        F16 a = acc[m][p][0];
        sfor<A - 1>([&](auto A_) { a = fadd(a, acc[m][p][AQ_CV(A_) + 1]); });
        tot[m][p] = ffma(o, fset1(xs[m * G + g]), ffma(s, a, tot[m][p]));
      });
    });
  }
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<P>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t w = nvalid - 16 * p;
      if (w >= 16) fstore(y + m * ldy + 16 * p, tot[m][p]);
      else if (w > 0) fstore_n(y + m * ldy + 16 * p, tot[m][p], static_cast<int>(w));
    });
  });
}

template <int B, int MR>
void gemv_rows(const Ctx& c, const uint8_t* const* pan, int64_t cnt, const float* sT, const float* oT,
               const float* x, const float* xs, float* y, int64_t nvalid, const QparamPrefetch* pf) {
  constexpr int P = gemv_P(MR, B), A = gemv_A(MR);
  const LowbitProblem& pr = *c.p;
  const int64_t lds = 16 * cnt, upg = pr.group_size / 8;
  if (cnt % P == 0) {
    for (int64_t q = 0; q < cnt; q += P)
      gemv_tile<B, MR, P, A>(pan + q, sT + 16 * q, oT + 16 * q, lds, x, pr.ldx, xs, c.G, upg, y + 16 * q,
                             pr.ldy, nvalid - 16 * q, q == 0 ? pf : nullptr);
  } else {
    for (int64_t q = 0; q < cnt; ++q)
      gemv_tile<B, MR, 1, (MR == 1 ? 2 : 1)>(pan + q, sT + 16 * q, oT + 16 * q, lds, x, pr.ldx, xs, c.G, upg,
                                             y + 16 * q, pr.ldy, nvalid - 16 * q, q == 0 ? pf : nullptr);
  }
}

template <int B>
void gemv_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M;
  // Per-group sums of x for the offset term.
  std::vector<float> xs(static_cast<size_t>(M * G));
  group_sums(pr.x, pr.ldx, M, G, pr.group_size, xs.data());
  // Work items: blocks of kItemPanels full panels, then single leftover panels (incl. the tail panel).
  const int64_t nblk = c.nfull / kItemPanels;
  const int64_t nitems = nblk + (c.npan - nblk * kItemPanels);
  const auto first_panel = [&](int64_t it) {
    return it < nblk ? it * kItemPanels : nblk * kItemPanels + (it - nblk);
  };
  const auto row_range = [&](int64_t it) {  // {first row, rows} of item it
    const int64_t r0 = 16 * first_panel(it);
    return std::pair<int64_t, int64_t>{r0, std::min<int64_t>(16 * (it < nblk ? kItemPanels : 1), c.N - r0)};
  };
  at::parallel_for(0, nitems, grain_for(16 * kItemPanels * c.K8 * M), [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t p0 = first_panel(it), cnt = it < nblk ? kItemPanels : 1;
      const auto [r0, rows] = row_range(it);
      const uint8_t* pan[kItemPanels];
      for (int64_t q = 0; q < cnt; ++q) pan[q] = panel_ptr(c, p0 + q);
      float* sT = tl_scale.get<float>(G * 16 * cnt);
      float* oT = tl_offset.get<float>(G * 16 * cnt);
      load_qparams(pr, false, code_scale(B), r0, rows, 16 * cnt, G, sT, 16 * cnt);
      load_qparams(pr, true, 1.f, r0, rows, 16 * cnt, G, oT, 16 * cnt);
      std::optional<QparamPrefetch> pf;
      if (it + 1 < i1) {
        const auto [nr0, nrows] = row_range(it + 1);
        pf.emplace(pr, nr0, nrows, G);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kGemvMR) {
        const float* x = pr.x + m0 * pr.ldx;
        const float* xsm = xs.data() + m0 * G;
        float* y = pr.y + m0 * pr.ldy + r0;
        const int64_t mr = std::min<int64_t>(kGemvMR, M - m0);
        const QparamPrefetch* pfm = m0 == 0 && pf ? &*pf : nullptr;
        if (mr == 1) gemv_rows<B, 1>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
        else if (mr == 2) gemv_rows<B, 2>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
        else if constexpr (kGemvMR == 4) {
          if (mr == 3) gemv_rows<B, 3>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
          else gemv_rows<B, 4>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Dequant + GEMM path.
// ---------------------------------------------------------------------------------------------
#if AQ_AVX512
constexpr int kNP = 2;    // panels per micro-tile: 32 output columns = 2 zmm
constexpr int kMR = 12;   // x rows per micro-tile: 24 accumulators + 2 weight vectors + broadcast
#elif AQ_AVX2
constexpr int kNP = 1;
constexpr int kMR = 6;
#else
constexpr int kNP = 1;
constexpr int kMR = 4;
#endif
constexpr int64_t kKC = 256;  // k-slice per dequantized tile: 256 x 32 fp32 = 32 KiB
constexpr int64_t kNCB = 8;   // micro-tiles dequantized together per k-slice (x block reused across them)
// Rows of x per pass. Accumulators live in a dense [kMC x 32] buffer per micro-tile rather than in y, whose
// row stride (often 16 KiB) would make all rows alias to the same cache sets.
constexpr int64_t kMC = 240;
// Rows per pass for m rows: at most kMC, split evenly (a multiple of `mult`) so no pass is a small remainder.
int64_t row_chunk(int64_t m, int64_t mult) {
  const int64_t passes = (m + kMC - 1) / kMC;
  return std::min(kMC, ((m + passes - 1) / passes + mult - 1) / mult * mult);
}

// buf[(k - 8 * u0) * (16 * NP) + 16 * p + j] = W[row j of panel p, k] for units [u0, u0 + nu).
template <int B, int NP>
void dequant(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds, const int32_t* kg,
             int64_t u0, int64_t nu, float* buf) {
  for (int64_t u = u0; u < u0 + nu; ++u) {
    float* bu = buf + (u - u0) * 8 * (16 * NP);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      if (pan[p] == nullptr) {
        for (int t = 0; t < 8; ++t) fstore(bu + t * (16 * NP) + 16 * p, fzero());
        return;
      }
      decode_unit<B>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
        constexpr int t = AQ_CV(T);
        const int64_t g = kg[8 * u + t];
        fstore(bu + t * (16 * NP) + 16 * p, ffma(w, fload(sT + g * lds + 16 * p), fload(oT + g * lds + 16 * p)));
      });
    });
  }
}

// y[MR x 16*NP] (+)= x[MR x kc] @ w[kc x 16*NP]; only the first nvalid columns of y are touched.
template <int MR, int NP>
void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy, bool init,
                  int64_t nvalid) {
  F16 acc[MR][NP];
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = nvalid - 16 * p;
      if (init || cols <= 0) acc[m][p] = fzero();
      else if (cols >= 16) acc[m][p] = fload(y + m * ldy + 16 * p);
      else acc[m][p] = fload_n(y + m * ldy + 16 * p, static_cast<int>(cols));
    });
  });
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    F16 wv[NP];
    sfor<NP>([&](auto P_) { wv[AQ_CV(P_)] = fload(w + k * (16 * NP) + 16 * AQ_CV(P_)); });
    sfor<MR>([&](auto M_) {
      constexpr int m = AQ_CV(M_);
      const F16 xb = fset1(x[m * ldx + k]);
      sfor<NP>([&](auto P_) { acc[m][AQ_CV(P_)] = ffma(xb, wv[AQ_CV(P_)], acc[m][AQ_CV(P_)]); });
    });
  }
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = nvalid - 16 * p;
      if (cols >= 16) fstore(y + m * ldy + 16 * p, acc[m][p]);
      else if (cols > 0) fstore_n(y + m * ldy + 16 * p, acc[m][p], static_cast<int>(cols));
    });
  });
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, int64_t);
template <int... Is>
constexpr std::array<MicroFn, sizeof...(Is)> micro_table(std::integer_sequence<int, Is...>) {
  return {&micro_kernel<Is + 1, kNP>...};
}
constexpr auto kMicro = micro_table(std::make_integer_sequence<int, kMR>{});

template <int B>
void gemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K8 = c.K8;
  constexpr int64_t TW = 16 * kNP;  // columns per micro-tile
  const std::vector<int32_t> kg = group_of_k(pr, K8, G);
  const int64_t ntiles = (c.npan + kNP - 1) / kNP;
  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t ncb = std::max<int64_t>(1, std::min<int64_t>(kNCB, (ntiles + nthreads - 1) / nthreads));
  const int64_t nblocks = (ntiles + ncb - 1) / ncb;
  at::parallel_for(0, nblocks, grain_for(ncb * TW * K8 * M), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = b * ncb, nt = std::min(ncb, ntiles - t0);
      const int64_t R = nt * TW, r0 = t0 * TW, rows = std::min(R, c.N - r0);
      float *sT, *oT;
      load_tile_qparams(pr, code_scale(B), r0, rows, R, G, sT, oT);
      std::vector<const uint8_t*> pan(static_cast<size_t>(nt * kNP));
      for (int64_t q = 0; q < nt * kNP; ++q) pan[q] = panel_ptr(c, t0 * kNP + q);
      float* wbuf = tl_wbuf.get<float>(nt * kKC * TW);
      const int64_t mcs = row_chunk(M, kMR);
      for (int64_t mc0 = 0; mc0 < M; mc0 += mcs) {
        const int64_t mc = std::min(mcs, M - mc0);
        float* cbuf = tl_cbuf.get<float>(nt * mc * TW);
        for (int64_t k0 = 0; k0 < K8; k0 += kKC) {
          const int64_t kc = std::min(kKC, K8 - k0);
          for (int64_t t = 0; t < nt; ++t)
            dequant<B, kNP>(pan.data() + t * kNP, sT + t * TW, oT + t * TW, R, kg.data(), k0 / 8, kc / 8,
                            wbuf + t * kKC * TW);
          if (k0 + kc < K8)  // the next k-slice of all tiles arrives while this one computes
            prefetch_units(pan.data(), static_cast<int>(nt * kNP), (k0 + kc) / 8,
                           std::min(kKC, K8 - k0 - kc) / 8, B);
          for (int64_t t = 0; t < nt; ++t) {  // tile-outer: the dequantized tile stays in L1
            if (t * TW >= rows) break;
            for (int64_t m0 = 0; m0 < mc; m0 += kMR) {
              const MicroFn fn = kMicro[std::min<int64_t>(kMR, mc - m0) - 1];
              fn(pr.x + (mc0 + m0) * pr.ldx + k0, pr.ldx, wbuf + t * kKC * TW, kc, cbuf + (t * mc + m0) * TW, TW,
                 k0 == 0, TW);
            }
          }
        }
        for (int64_t t = 0; t < nt && t * TW < rows; ++t)
          store_tile(cbuf + t * mc * TW, TW, mc, std::min(TW, rows - t * TW), pr.y + mc0 * pr.ldy + r0 + t * TW,
                     pr.ldy);
      }
    }
  });
}

#if AQ_AVX512 && defined(__AVX512VNNI__)
#define AQ_VNNI 1
// ---------------------------------------------------------------------------------------------
// Integer GEMM path (AVX512-VNNI). vpdpwssd multiplies int16 pairs and accumulates exactly in int32 at the
// issue rate of an fp32 FMA, i.e. twice the MACs (the same rate as the bf16 dot products oneDNN uses).
// Codes are exact int16. x is quantized per (row, block of qb <= 256 columns inside one group) to 16-bit
// fixed point, x ~= sx * xq with |xq| <= 32767: an absolute error <= 2^-16 * max|x_block| per element
// (for comparison, bf16 F.linear rounds every x and W element to 2^-9 relative).
//   per block: y[m, n] += scale[n, g] * sx[m, b] * float(sum_k u[n, k] * xq[m, k])   (int32, exact)
//   per group: y[m, n] += offset[n, g] * sum(x[m, group g])                           (fp32, from x)
// ---------------------------------------------------------------------------------------------
static_assert(kMC % 6 == 0, "row chunks must hold whole VNNI row blocks");
constexpr int kQMR = 6;         // x rows per micro-tile: 12 fp32 + 12 int32 accumulators + 2 weight vectors
constexpr int64_t kQKC = 256;   // k per dequantized tile (rounded to a multiple of the block)

// ibuf[(kp - 4 * u0) * 32 + 16 * p + j] = u[row j of panel p, 2 kp] | u[row j, 2 kp + 1] << 16
template <int B>
void dequant_pairs(const uint8_t* const* pan, int64_t u0, int64_t nu, int32_t* ibuf) {
  for (int64_t u = u0; u < u0 + nu; ++u) {
    int32_t* bu = ibuf + (u - u0) * 4 * 32;
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      if (pan[p] == nullptr) {
        for (int i = 0; i < 4; ++i) _mm512_storeu_si512(bu + i * 32 + 16 * p, _mm512_setzero_si512());
        return;
      }
      if constexpr (B == 4) {
        // Slot s holds k = 2s (low nibble) and 2s + 1 (high nibble): one shift and one ternary-logic op
        // ((v | v << 12) & 0x000F000F) turn the zero-extended bytes into the int16 pairs.
        const uint8_t* src = pan[p] + u * 64;
        const __m512i mask = _mm512_set1_epi32(0x000F000F);
        for (int s4 = 0; s4 < 4; ++s4) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * s4)));
          _mm512_storeu_si512(bu + s4 * 32 + 16 * p,
                              _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), mask, 0xA8));
        }
        return;
      }
      I16 lo{};
      decode_unit_i<B>(pan[p] + u * (16 * B), [&](auto T, I16 v) {
        constexpr int t = AQ_CV(T);
        if constexpr (t % 2 == 0) lo = v;
        else _mm512_storeu_si512(bu + (t / 2) * 32 + 16 * p, _mm512_or_si512(lo.v, _mm512_slli_epi32(v.v, 16)));
      });
    });
  }
}

struct QArgs {
  const int32_t* xp;                // quantized x pairs of this row block, [k / 2][kQMR], offset to k0
  const float* sx; int64_t nb;      // [rows][nb] block scales (row-offset only)
  const float* xs; int64_t G;       // [rows][G] group sums of x (row-offset only)
  const int32_t* w;                 // code pairs of this micro-tile, [kc / 2][32]
  int64_t kc, k0, qb, gs;
  const float* sT; const float* oT; int64_t lds;  // transposed scale/offset, offset to the tile's columns
  float* y; int64_t ldy; bool init; int64_t nvalid;
};

// Accumulators are named variables updated through a "+v" asm operand: with arrays and/or the intrinsic,
// GCC 12 bounces every vpdpwssd accumulator through an extra register move (or the stack).
#if defined(__GNUC__)
#define AQ_DPWSSD(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#else
#define AQ_DPWSSD(acc, a, b) (acc) = _mm512_dpwssd_epi32((acc), (a), (b))
#endif
#define AQ_Q_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int MR>
void qmicro(const QArgs& a) {
  static_assert(MR >= 1 && MR <= 6, "qmicro handles up to 6 rows");
  __m512 C[MR][2];
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = a.nvalid - 16 * p;
      if (a.init || cols <= 0) C[m][p] = _mm512_setzero_ps();
      else if (cols >= 16) C[m][p] = _mm512_loadu_ps(a.y + m * a.ldy + 16 * p);
      else C[m][p] = fload_n(a.y + m * a.ldy + 16 * p, static_cast<int>(cols)).v;
    });
  });
  for (int64_t b0 = 0; b0 < a.kc; b0 += a.qb) {
#define AQ_DECL(i) __m512i acc##i##0 = _mm512_setzero_si512(), acc##i##1 = _mm512_setzero_si512();
    AQ_Q_ROWS(AQ_DECL)
#undef AQ_DECL
    const int32_t* wb = a.w + (b0 / 2) * 32;
    const int32_t* xb = a.xp + (b0 / 2) * kQMR;
#pragma GCC unroll 2
    for (int64_t kp = 0; kp < a.qb / 2; ++kp, wb += 32, xb += kQMR) {
      const __m512i w0 = _mm512_loadu_si512(wb), w1 = _mm512_loadu_si512(wb + 16);
#define AQ_STEP(i)                                                           \
  if constexpr (MR > i) {                                                    \
    const __m512i xv = _mm512_set1_epi32(xb[i]);                             \
    AQ_DPWSSD(acc##i##0, w0, xv);                                            \
    AQ_DPWSSD(acc##i##1, w1, xv);                                            \
  }
      AQ_Q_ROWS(AQ_STEP)
#undef AQ_STEP
    }
    const int64_t kabs = a.k0 + b0, g = kabs / a.gs, bi = kabs / a.qb;
    const __m512 s0 = _mm512_loadu_ps(a.sT + g * a.lds), s1 = _mm512_loadu_ps(a.sT + g * a.lds + 16);
    const bool group_end = (kabs + a.qb) % a.gs == 0;
    const __m512 o0 = _mm512_loadu_ps(a.oT + g * a.lds), o1 = _mm512_loadu_ps(a.oT + g * a.lds + 16);
#define AQ_FLUSH(i)                                                                           \
  if constexpr (MR > i) {                                                                     \
    const __m512 f = _mm512_set1_ps(a.sx[i * a.nb + bi]);                                     \
    C[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc##i##0), _mm512_mul_ps(s0, f), C[i][0]);  \
    C[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc##i##1), _mm512_mul_ps(s1, f), C[i][1]);  \
    if (group_end) {                                                                          \
      const __m512 xsv = _mm512_set1_ps(a.xs[i * a.G + g]);                                   \
      C[i][0] = _mm512_fmadd_ps(o0, xsv, C[i][0]);                                            \
      C[i][1] = _mm512_fmadd_ps(o1, xsv, C[i][1]);                                            \
    }                                                                                         \
  }
    AQ_Q_ROWS(AQ_FLUSH)
#undef AQ_FLUSH
  }
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = a.nvalid - 16 * p;
      if (cols >= 16) _mm512_storeu_ps(a.y + m * a.ldy + 16 * p, C[m][p]);
      else if (cols > 0) fstore_n(a.y + m * a.ldy + 16 * p, F16{C[m][p]}, static_cast<int>(cols));
    });
  });
}
#undef AQ_Q_ROWS

using QMicroFn = void (*)(const QArgs&);
template <int... Is>
constexpr std::array<QMicroFn, sizeof...(Is)> qmicro_table(std::integer_sequence<int, Is...>) {
  return {&qmicro<Is + 1>...};
}
constexpr auto kQMicro = qmicro_table(std::make_integer_sequence<int, kQMR>{});

// x [m, k] fp32 -> int16 (round to nearest) with one scale sx[m, b] per block of qb columns, stored as int32
// pairs interleaved by row blocks so the micro-kernel reads one sequential stream (padding rows are zero):
//   xp[((m / kQMR) * (K / 2) + k / 2) * kQMR + m % kQMR] = xq[m, k] | xq[m, k + 1] << 16
// Also xs[m, g] = sum(x[m, group g]) (sum of the block sums; qb divides gs).
void quantize_x16(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t qb, int64_t gs, int32_t* xp,
                  float* sx, float* xs) {
  const int64_t nb = K / qb, nmb = (M + kQMR - 1) / kQMR, G = K / gs;
  at::parallel_for(0, nmb, grain_for(kQMR * K * 64), [&](int64_t mb0, int64_t mb1) {
    int16_t* row = tl_xrow.get<int16_t>(K);
    for (int64_t mb = mb0; mb < mb1; ++mb) {
      int32_t* dst = xp + mb * (K / 2) * kQMR;
      for (int r = 0; r < kQMR; ++r) {
        const int64_t m = mb * kQMR + r;
        if (m >= M) {
          for (int64_t kp = 0; kp < K / 2; ++kp) dst[kp * kQMR + r] = 0;
          continue;
        }
        for (int64_t g = 0; g < G; ++g) xs[m * G + g] = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const float* xr = x + m * ldx + b * qb;
          __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < qb; i += 16) {
            const __mmask16 mk = static_cast<__mmask16>(qb - i >= 16 ? 0xFFFF : (1u << (qb - i)) - 1u);
            const __m512 v = _mm512_maskz_loadu_ps(mk, xr + i);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            sum = _mm512_add_ps(sum, v);
          }
          xs[m * G + b * qb / gs] += _mm512_reduce_add_ps(sum);
          const float amax = _mm512_reduce_max_ps(mx);
          sx[m * nb + b] = amax / 32767.f;
          const __m512 vinv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
          for (int64_t i = 0; i < qb; i += 16) {
            const __mmask16 mk = static_cast<__mmask16>(qb - i >= 16 ? 0xFFFF : (1u << (qb - i)) - 1u);
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + i), vinv));
            _mm256_mask_storeu_epi16(row + b * qb + i, mk, _mm512_cvtsepi32_epi16(q));
          }
        }
        for (int64_t kp = 0; kp < K / 2; ++kp) {
          int32_t pair;
          std::memcpy(&pair, row + 2 * kp, sizeof(pair));
          dst[kp * kQMR + r] = pair;
        }
      }
    }
  });
}

template <int B>
void qgemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K = pr.k, gs = pr.group_size;
  // Block: the largest multiple of 8 dividing the group and <= 256, so |int32 sums| <= 256 * 255 * 32767 < 2^31.
  int64_t qb = 8;
  for (int64_t d = 256; d >= 8; d -= 8)
    if (gs % d == 0) { qb = d; break; }
  const int64_t nb = K / qb, kcq = std::max(qb, kQKC / qb * qb);
  const int64_t nmb = (M + kQMR - 1) / kQMR;
  // Per-call buffers from the calling thread's scratch: no zero-fill, no fresh pages on every call.
  int32_t* xp = tl_xcall.get<int32_t>(nmb * (K / 2) * kQMR);
  float* sx = tl_sxcall.get<float>(M * nb);
  float* xs = tl_xscall.get<float>(M * G);
  quantize_x16(pr.x, pr.ldx, M, K, qb, gs, xp, sx, xs);
  constexpr int64_t TW = 32;
  const int64_t ntiles = (c.npan + 1) / 2;
  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t ncb = std::max<int64_t>(1, std::min<int64_t>(kNCB, (ntiles + nthreads - 1) / nthreads));
  const int64_t nblocks = (ntiles + ncb - 1) / ncb;
  at::parallel_for(0, nblocks, grain_for(ncb * TW * K * M), [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * ncb, nt = std::min(ncb, ntiles - t0);
      const int64_t R = nt * TW, r0 = t0 * TW, rows = std::min(R, c.N - r0);
      float* sT = tl_scale.get<float>(G * R);
      float* oT = tl_offset.get<float>(G * R);
      load_qparams(pr, false, code_scale(B), r0, rows, R, G, sT, R);
      load_qparams(pr, true, 1.f, r0, rows, R, G, oT, R);
      const uint8_t* pan[2 * kNCB];
      for (int64_t q = 0; q < nt * 2; ++q) pan[q] = panel_ptr(c, t0 * 2 + q);
      int32_t* ibuf = tl_wbuf.get<int32_t>(kcq * 16);
      const int64_t mcs = row_chunk(M, kQMR);  // a multiple of kQMR: passes start on row-block boundaries
      for (int64_t mc0 = 0; mc0 < M; mc0 += mcs) {
        const int64_t mc = std::min(mcs, M - mc0);
        float* cbuf = tl_cbuf.get<float>(nt * mc * TW);
        for (int64_t k0 = 0; k0 < K; k0 += kcq) {
          const int64_t kc = std::min(kcq, K - k0);
          // Tile-outer: each 16 KiB tile of code pairs is expanded into L1 and stays there while the rows of
          // x stream past it.
          for (int64_t t = 0; t < nt; ++t) {
            if (t * TW >= rows) break;
            dequant_pairs<B>(pan + 2 * t, k0 / 8, kc / 8, ibuf);
            // The codes of the next tile arrive from DRAM while this one computes (tiles are short, scattered
            // streams that the hardware prefetchers do not pick up on their own).
            if (t + 1 < nt && (t + 1) * TW < rows)
              prefetch_units(pan + 2 * (t + 1), 2, k0 / 8, kc / 8, B);
            else if (k0 + kc < K)
              prefetch_units(pan, 2, (k0 + kc) / 8, std::min(kcq, K - k0 - kc) / 8, B);
            for (int64_t m0 = mc0; m0 < mc0 + mc; m0 += kQMR) {
              const QMicroFn fn = kQMicro[std::min<int64_t>(kQMR, mc0 + mc - m0) - 1];
              QArgs a{xp + (m0 / kQMR) * (K / 2) * kQMR + (k0 / 2) * kQMR,
                      sx + m0 * nb, nb, xs + m0 * G, G, ibuf, kc, k0, qb, gs, sT + t * TW, oT + t * TW, R,
                      cbuf + (t * mc + (m0 - mc0)) * TW, TW, k0 == 0, TW};
              fn(a);
            }
          }
        }
        for (int64_t t = 0; t < nt && t * TW < rows; ++t)
          store_tile(cbuf + t * mc * TW, TW, mc, std::min(TW, rows - t * TW), pr.y + mc0 * pr.ldy + r0 + t * TW,
                     pr.ldy);
      }
    }
  });
}
#endif  // AQ_VNNI

#if AQ_AVX512 && defined(__AVX512BF16__)
#define AQ_BF16DOT 1
// ---------------------------------------------------------------------------------------------
// bf16 dot-product GEMM (AVX512-BF16, bf16 x). Each [256 x 32] tile of W is dequantized once in fp32
// (w = scale * c(u) + offset), rounded to bf16 and stored as k-pairs; vdpbf16ps multiplies the pairs with bf16
// x pairs and accumulates in fp32. The result is that of dequantize-to-bf16 then a bf16 matmul with fp32
// accumulation (F.linear on the dequantized bf16 weight), at the CPU's bf16 dot-product rate.
// ---------------------------------------------------------------------------------------------
constexpr int kBMR = 12;  // x rows per micro-tile: 24 fp32 accumulators + 2 weight vectors + a broadcast
static_assert(kMC % kBMR == 0, "row chunks must hold whole bf16 row blocks");

// wb[(kp - 4 * u0) * 32 + 16 * p + j] = bf16(W[row j of panel p, 2 kp]) | bf16(W[row j, 2 kp + 1]) << 16
template <int B>
void dequant_bf16_pairs(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds, const int32_t* kg,
                        int64_t u0, int64_t nu, uint32_t* wb) {
  // vcvtne2ps2bf16 puts bf16(even k) in 16-bit lanes 0..15 and bf16(odd k) in 16..31; interleave them.
  alignas(64) static constexpr int16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  for (int64_t u = u0; u < u0 + nu; ++u) {
    uint32_t* bu = wb + (u - u0) * 4 * 32;
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      if (pan[p] == nullptr) {
        for (int i = 0; i < 4; ++i) _mm512_storeu_si512(bu + i * 32 + 16 * p, _mm512_setzero_si512());
        return;
      }
      __m512 even = _mm512_setzero_ps();
      decode_unit<B>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
        constexpr int t = AQ_CV(T);
        const int64_t g = kg[8 * u + t];
        const __m512 v = _mm512_fmadd_ps(w.v, _mm512_loadu_ps(sT + g * lds + 16 * p), _mm512_loadu_ps(oT + g * lds + 16 * p));
        if constexpr (t % 2 == 0) {
          even = v;
        } else {
          const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v, even));
          _mm512_storeu_si512(bu + (t / 2) * 32 + 16 * p, _mm512_permutexvar_epi16(idx, both));
        }
      });
    });
  }
}

// xp[((m / kBMR) * K2 + kp) * kBMR + m % kBMR] = x[m, 2 kp] | x[m, 2 kp + 1] << 16 (bf16 bits; padding rows 0)
void pack_x_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K2, uint32_t* xp) {
  const int64_t nmb = (M + kBMR - 1) / kBMR;
  at::parallel_for(0, nmb, grain_for(kBMR * K2 * 64), [&](int64_t mb0, int64_t mb1) {
    for (int64_t mb = mb0; mb < mb1; ++mb) {
      uint32_t* dst = xp + mb * K2 * kBMR;
      for (int r = 0; r < kBMR; ++r) {
        const int64_t m = mb * kBMR + r;
        if (m >= M) {
          for (int64_t kp = 0; kp < K2; ++kp) dst[kp * kBMR + r] = 0;
          continue;
        }
        const uint16_t* row = x + m * ldx;
        for (int64_t kp = 0; kp < K2; ++kp) {
          uint32_t pair;
          std::memcpy(&pair, row + 2 * kp, sizeof(pair));
          dst[kp * kBMR + r] = pair;
        }
      }
    }
  });
}

#if defined(__GNUC__)
#define AQ_DPBF16(acc, a, b) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#else
#define AQ_DPBF16(acc, a, b) (acc) = _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
#endif
#define AQ_B_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
// c[MR x 32] (+)= x[MR x 2 kc2] @ w[2 kc2 x 32]; c is a dense accumulator tile with row stride 32.
template <int MR>
void bmicro(const uint32_t* xp, const uint32_t* w, int64_t kc2, float* c, bool init) {
  static_assert(MR >= 1 && MR <= kBMR, "bmicro handles up to kBMR rows");
#define AQ_DECL(i)                                                            \
  __m512 acc##i##0 = _mm512_setzero_ps(), acc##i##1 = _mm512_setzero_ps();    \
  if constexpr (MR > i) {                                                     \
    if (!init) {                                                              \
      acc##i##0 = _mm512_loadu_ps(c + (i) * 32);                              \
      acc##i##1 = _mm512_loadu_ps(c + (i) * 32 + 16);                         \
    }                                                                         \
  }
  AQ_B_ROWS(AQ_DECL)
#undef AQ_DECL
#pragma GCC unroll 2
  for (int64_t kp = 0; kp < kc2; ++kp, w += 32, xp += kBMR) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 16);
#define AQ_STEP(i)                                            \
  if constexpr (MR > i) {                                     \
    const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[i])); \
    AQ_DPBF16(acc##i##0, xv, w0);                             \
    AQ_DPBF16(acc##i##1, xv, w1);                             \
  }
    AQ_B_ROWS(AQ_STEP)
#undef AQ_STEP
  }
#define AQ_STORE(i)                                \
  if constexpr (MR > i) {                          \
    _mm512_storeu_ps(c + (i) * 32, acc##i##0);      \
    _mm512_storeu_ps(c + (i) * 32 + 16, acc##i##1); \
  }
  AQ_B_ROWS(AQ_STORE)
#undef AQ_STORE
}
#undef AQ_B_ROWS

using BMicroFn = void (*)(const uint32_t*, const uint32_t*, int64_t, float*, bool);
template <int... Is>
constexpr std::array<BMicroFn, sizeof...(Is)> bmicro_table(std::integer_sequence<int, Is...>) {
  return {&bmicro<Is + 1>...};
}
constexpr auto kBMicro = bmicro_table(std::make_integer_sequence<int, kBMR>{});

template <int B>
void bgemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K8 = c.K8, K2 = K8 / 2;
  const int64_t nmb = (M + kBMR - 1) / kBMR;
  uint32_t* xp = tl_xcall.get<uint32_t>(nmb * K2 * kBMR);
  pack_x_bf16(pr.x_bf16, pr.ldx, M, K2, xp);
  const std::vector<int32_t> kg = group_of_k(pr, K8, G);
  constexpr int64_t TW = 32;
  const int64_t ntiles = (c.npan + 1) / 2;
  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t ncb = std::max<int64_t>(1, std::min<int64_t>(kNCB, (ntiles + nthreads - 1) / nthreads));
  const int64_t nblocks = (ntiles + ncb - 1) / ncb;
  at::parallel_for(0, nblocks, grain_for(ncb * TW * K8 * M), [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * ncb, nt = std::min(ncb, ntiles - t0);
      const int64_t R = nt * TW, r0 = t0 * TW, rows = std::min(R, c.N - r0);
      float *sT, *oT;
      load_tile_qparams(pr, code_scale(B), r0, rows, R, G, sT, oT);
      const uint8_t* pan[2 * kNCB];
      for (int64_t q = 0; q < nt * 2; ++q) pan[q] = panel_ptr(c, t0 * 2 + q);
      uint32_t* wb = tl_wbuf.get<uint32_t>(kKC / 2 * TW);
      const int64_t mcs = row_chunk(M, kBMR);
      for (int64_t mc0 = 0; mc0 < M; mc0 += mcs) {
        const int64_t mc = std::min(mcs, M - mc0);
        float* cbuf = tl_cbuf.get<float>(nt * mc * TW);
        for (int64_t k0 = 0; k0 < K8; k0 += kKC) {
          const int64_t kc = std::min(kKC, K8 - k0);
          for (int64_t t = 0; t < nt; ++t) {  // tile-outer: the 16 KiB bf16 tile stays in L1 for all rows
            if (t * TW >= rows) break;
            dequant_bf16_pairs<B>(pan + 2 * t, sT + t * TW, oT + t * TW, R, kg.data(), k0 / 8, kc / 8, wb);
            if (t + 1 < nt && (t + 1) * TW < rows)
              prefetch_units(pan + 2 * (t + 1), 2, k0 / 8, kc / 8, c.B);
            else if (k0 + kc < K8)
              prefetch_units(pan, 2, (k0 + kc) / 8, std::min(kKC, K8 - k0 - kc) / 8, c.B);
            for (int64_t m0 = mc0; m0 < mc0 + mc; m0 += kBMR) {
              const BMicroFn fn = kBMicro[std::min<int64_t>(kBMR, mc0 + mc - m0) - 1];
              fn(xp + (m0 / kBMR) * K2 * kBMR + (k0 / 2) * kBMR, wb, kc / 2, cbuf + (t * mc + (m0 - mc0)) * TW,
                 k0 == 0);
            }
          }
        }
        for (int64_t t = 0; t < nt && t * TW < rows; ++t)
          store_tile(cbuf + t * mc * TW, TW, mc, std::min(TW, rows - t * TW), pr.y + mc0 * pr.ldy + r0 + t * TW,
                     pr.ldy);
      }
    }
  });
}
#endif  // AQ_BF16DOT

#if AQ_VNNI
constexpr bool kHasVnni = true;
#else
constexpr bool kHasVnni = false;
#endif
#if AQ_BF16DOT
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// The path a problem runs (1..4, see the header), given force_path (0 = choose).
int path_for(const LowbitProblem& p, int force_path) {
  const bool gemv_ok = p.group_size % 8 == 0;  // the GEMV and the int16 GEMM step through groups 8 k at a time
  // The caller decides (x dtype, environment); float8 values are not int16 codes, so they never take it.
  const bool use_vnni = kHasVnni && p.allow_int16_x && p.codes == kCodesUint && gemv_ok;
  const bool use_bf16 = kHasBf16Dot && p.x_bf16 != nullptr;
  const int big = use_bf16 ? 4 : use_vnni ? 3 : 2;  // the GEMM path for this x
  int path = force_path;
  // Measured on Zen 5: the fused GEMV wins up to 2 rows against the VNNI / bf16 GEMMs and up to ~8 rows
  // against the fp32 GEMM (each extra row costs the GEMV another pass of FMAs over the decoded weights).
  if (path == 0) path = !gemv_ok ? big : p.m <= (big > 2 ? 2 : 8) ? 1 : big;
  if (path == 4 && !use_bf16) path = use_vnni ? 3 : 2;
  if (path == 3 && !(kHasVnni && p.codes == kCodesUint && gemv_ok)) path = 2;
  if (path == 1 && !gemv_ok) path = 2;
  return path;
}

template <int B>
void run(const Ctx& c, int force_path) {
  const int path = path_for(*c.p, force_path);
  if (path == 1) gemv_path<B>(c);
#if AQ_VNNI
  else if (path == 3) {
    if constexpr (B <= 8) qgemm_path<B>(c);
  }
#endif
#if AQ_BF16DOT
  else if (path == 4) bgemm_path<B>(c);
#endif
  else gemm_path<B>(c);
}

Ctx make_ctx(const LowbitProblem& p) {
  Ctx c;
  c.p = &p;
  c.B = p.bits;
  c.K8 = (p.k + 7) / 8 * 8;
  c.U = c.K8 / 8;
  c.G = p.k / p.group_size;
  c.N = p.n;
  c.M = p.m;
  c.nfull = p.n / 16;
  c.tail_w = p.n % 16;
  c.npan = c.nfull + (c.tail_w > 0 ? 1 : 0);
  c.panel_bytes = 16 * c.U * p.bits;
  return c;
}

}  // namespace

// The build compiles this file twice, with AQ_PART=1 (bits 1..4 + entry points) and AQ_PART=2 (bits 5..8),
// so the two halves of the template instantiations compile in parallel. Without AQ_PART it is one TU.
namespace detail {
void run_bits_1_to_4(const LowbitProblem& p, int force_path);
void run_bits_5_to_8(const LowbitProblem& p, int force_path);
}  // namespace detail

#if !defined(AQ_PART) || AQ_PART == 1
void detail::run_bits_1_to_4(const LowbitProblem& p, int force_path) {
  const Ctx c = make_ctx(p);
  switch (p.bits) {
    case 1: run<1>(c, force_path); break;
    case 2: run<2>(c, force_path); break;
    case 3: run<3>(c, force_path); break;
    case 4: run<4>(c, force_path); break;
    default: break;
  }
}

void lowbit_linear_f32(const LowbitProblem& p, int force_path) {
  if (p.bits >= 1 && p.bits <= 4) detail::run_bits_1_to_4(p, force_path);
  else if (p.bits >= 5 && p.bits <= 8) detail::run_bits_5_to_8(p, force_path);
  // other values are rejected by the caller
}

const char* kernel_isa() { return kIsa; }

int lowbit_path(const LowbitProblem& p, int force_path) { return path_for(p, force_path); }

void dequantize_f32(const uint8_t* packed, const void* scale, const void* offset, bool qparams_bf16, int bits,
                    int codes, int64_t group_size, int64_t n, int64_t k, float* w) {
  const int64_t U = (k + 7) / 8, G = k / group_size, panel_bytes = 16 * U * bits;
  LowbitProblem qp{};
  qp.scale = scale;
  qp.offset = offset;
  qp.qparams_bf16 = qparams_bf16;
  qp.bits = bits;
  at::parallel_for(0, (n + 15) / 16, grain_for(16 * k), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t width = std::min<int64_t>(16, n - 16 * p);
      const uint8_t* base = packed + p * panel_bytes;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t row = 16 * p + j;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t u = kk / 8, t = kk % 8;
          const uint8_t* unit = base + u * width * bits;
          int code = 0, shift = 0, slot0 = 0;  // planes: 8, or 4/2/1 for the set bits (low bits first)
          for (int q : {8, 4, 2, 1}) {
            if (bits == 8 ? q != 8 : (q == 8 || (bits & q) == 0)) continue;
            const int per = 8 / q;
            const int byte = unit[(slot0 + t / per) * width + j];
            code |= ((byte >> ((t % per) * q)) & ((1 << q) - 1)) << shift;
            shift += q;
            slot0 += q;
          }
          const int64_t g = kk / group_size;
          const float c = codes == kCodesUint ? static_cast<float>(code) : fp8_to_float(static_cast<uint8_t>(code), codes);
          w[row * k + kk] = qparam_at(qp, false, 1.f, row * G + g) * c + qparam_at(qp, true, 1.f, row * G + g);
        }
      }
    }
  });
}
#endif

#if !defined(AQ_PART) || AQ_PART == 2
void detail::run_bits_5_to_8(const LowbitProblem& p, int force_path) {
  const Ctx c = make_ctx(p);
  switch (p.bits) {
    case 5: run<5>(c, force_path); break;
    case 6: run<6>(c, force_path); break;
    case 7: run<7>(c, force_path); break;
    case 8:
      if (p.codes == kCodesE4M3) run<kBE4M3>(c, force_path);
      else if (p.codes == kCodesE5M2) run<kBE5M2>(c, force_path);
      else run<8>(c, force_path);
      break;
    default: break;
  }
}
#endif

}  // namespace affineq
