// Decoders of llama.cpp's k-quant super-blocks (256 weights; layouts in affineq/tensor/format_kquant.py, which
// is checked against gguf.quants.dequantize). kq_decode<KIND> turns one block into small integer codes c[256]
// and per-16-weight fp32 (s[16], o[16]) with weight i = c[i] * s[i / 16] + o[i / 16]:
//   KIND 2, 4, 5 (q2_k, q4_k, q5_k): c = u in [0, 2^bits), s = d * sc_j, o = -(dmin * m_j)
//   KIND 3, 6    (q3_k, q6_k):       c = u - 2^(bits-1) (signed), s = d * sc_j, o = -0
// d * sc (an fp16 significand of 11 bits times an integer of <= 8 bits) and c * s (times <= 6 bits) are exact
// in fp32, so c * s + o rounds once, exactly as format_kquant's u * scale + offset (a sum with -0 keeps the
// product's sign: the signed kinds' q * scale bit for bit). The byte loops are written so that GCC vectorizes
// them at -O3; the portable build runs the same code.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "simd.h"

namespace affineq::detail {
namespace {

inline constexpr int kSuperBlock = 256;

// Bytes of one super-block of kind 2..6 (q2_k .. q6_k); 0 for any other kind.
constexpr int64_t kq_type_size(int64_t kind) {
  return kind == 2 ? 84 : kind == 3 ? 110 : kind == 4 ? 144 : kind == 5 ? 176 : kind == 6 ? 210 : 0;
}

// The fp16 at p (unaligned) -> fp32, exact.
AQ_INLINE float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// Q4_K / Q5_K's 12 scale bytes -> 8 six-bit sub-scales and 8 six-bit mins.
AQ_INLINE void scale_min_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((q[j + 8] & 0x0F) | ((q[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
  }
}

// Per-32 (s, o) of Q4_K / Q5_K, written per 16.
AQ_INLINE void qparams_k4(const uint8_t* b, float* s, float* o) {
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  for (int j = 0; j < 8; ++j) {
    s[2 * j] = s[2 * j + 1] = d * static_cast<float>(sc[j]);
    o[2 * j] = o[2 * j + 1] = -(dmin * static_cast<float>(mn[j]));
  }
}

// Q3_K's 16 six-bit sub-scales (unsigned, bias 32) from its 12 packed bytes: low nibbles of bytes 0..7 for
// j < 8, high nibbles for j >= 8, and the top two bits from bytes 8..11.
AQ_INLINE void q3k_scales(const uint8_t* sb, int sc[16]) {
  for (int j = 0; j < 8; ++j) {
    sc[j] = sb[j] & 15;
    sc[j + 8] = sb[j] >> 4;
  }
  for (int t = 0; t < 4; ++t)
    for (int l = 0; l < 4; ++l) sc[4 * t + l] |= ((sb[8 + l] >> (2 * t)) & 3) << 4;
}

template <int KIND>
AQ_INLINE void kq_decode(const uint8_t* b, int8_t* c, float* s, float* o) {
  static_assert(KIND >= 2 && KIND <= 6);
  if constexpr (KIND == 4) {  // d, dmin, scales[12], qs[128]: chunk h of 64 = low nibbles | high nibbles
    const uint8_t* qs = b + 16;
    for (int h = 0; h < 4; ++h)
      for (int l = 0; l < 32; ++l) {
        c[64 * h + l] = static_cast<int8_t>(qs[32 * h + l] & 15);
        c[64 * h + 32 + l] = static_cast<int8_t>(qs[32 * h + l] >> 4);
      }
    qparams_k4(b, s, o);
  } else if constexpr (KIND == 5) {  // d, dmin, scales[12], qh[32], qs[128]: bit i / 32 of qh[i % 32] is bit 4
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int h = 0; h < 4; ++h)
      for (int l = 0; l < 32; ++l) {
        c[64 * h + l] = static_cast<int8_t>((qs[32 * h + l] & 15) | (((qh[l] >> (2 * h)) & 1) << 4));
        c[64 * h + 32 + l] = static_cast<int8_t>((qs[32 * h + l] >> 4) | (((qh[l] >> (2 * h + 1)) & 1) << 4));
      }
    qparams_k4(b, s, o);
  } else if constexpr (KIND == 6) {  // ql[128], qh[64], int8 scales[16], d: weight 128h + 32t + l
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const int lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hi = qh[32 * h + l];
        int8_t* ch = c + 128 * h + l;
        ch[0] = static_cast<int8_t>(((lo0 & 15) | ((hi & 3) << 4)) - 32);
        ch[32] = static_cast<int8_t>(((lo1 & 15) | (((hi >> 2) & 3) << 4)) - 32);
        ch[64] = static_cast<int8_t>(((lo0 >> 4) | (((hi >> 4) & 3) << 4)) - 32);
        ch[96] = static_cast<int8_t>(((lo1 >> 4) | (((hi >> 6) & 3) << 4)) - 32);
      }
    const float d = half_to_float(b + 208);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
      o[j] = -0.f;
    }
  } else if constexpr (KIND == 3) {  // hmask[32], qs[64], scales[12], d: u = 2 bits | hmask bit << 2, c = u - 4
    const uint8_t *hm = b, *qs = b + 32, *sb = b + 96;
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int l = 0; l < 32; ++l)
          c[128 * h + 32 * t + l] = static_cast<int8_t>(
              (((qs[32 * h + l] >> (2 * t)) & 3) | (((hm[l] >> (4 * h + t)) & 1) << 2)) - 4);
    const float d = half_to_float(b + 108);
    int sc[16];
    q3k_scales(sb, sc);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(sc[j] - 32);
      o[j] = -0.f;
    }
  } else {  // KIND == 2: scales[16] (sc | m << 4), qs[64], d, dmin
    const uint8_t *sc = b, *qs = b + 16;
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int l = 0; l < 32; ++l) c[128 * h + 32 * t + l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * t)) & 3);
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(sc[j] & 15);
      o[j] = -(dmin * static_cast<float>(sc[j] >> 4));
    }
  }
}

// 16 int8 codes -> 16 fp32 values.
AQ_INLINE F16 i8x16_to_f(const int8_t* p) {
#if AQ_AVX512
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
#elif AQ_AVX2
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
#endif
}

// Weights 16 j .. 16 j + 15 of a decoded block: c * s + o (the product is exact, so one rounding either way).
AQ_INLINE F16 kq_weights16(const int8_t* c, const float* s, const float* o, int j) {
  return ffma(i8x16_to_f(c + 16 * j), fset1(s[j]), fset1(o[j]));
}


// ---------------------------------------------------------------------------------------------
// The GEMV's fused decode of the 2-bit-plane kinds (q2_k, q3_k): codes straight from the block's bytes into
// 16 int32 lanes, no byte round trip. kq_qparams16<KIND> writes s16 / o16 per 16 weights with weight =
// u * s16 + o16 for the unsigned code u (q3_k's o16 = -4 * s16, an exact product, so fma(u, s, o) is q * s
// exactly, up to the sign of a zero); kq_codes<KIND>(b, f) calls f(integral_constant<V>, u) with the codes of
// weights 16 V .. 16 V + 15 (weight 128 h + 32 t + l: bits 2t of qs[32 h + l], | bit 4h + t of hmask[l] << 2).
// ---------------------------------------------------------------------------------------------
template <int KIND>
AQ_INLINE void kq_qparams16(const uint8_t* b, float* s16, float* o16) {
  static_assert(KIND == 2 || KIND == 3);
  if constexpr (KIND == 3) {
    const uint8_t* sb = b + 96;
    const float d = half_to_float(b + 108);
    int sc[16];
    q3k_scales(sb, sc);
    for (int j = 0; j < 16; ++j) {
      s16[j] = d * static_cast<float>(sc[j] - 32);
      o16[j] = -4.f * s16[j];
    }
  } else {
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int j = 0; j < 16; ++j) {
      s16[j] = d * static_cast<float>(b[j] & 15);
      o16[j] = -(dmin * static_cast<float>(b[j] >> 4));
    }
  }
}

template <int KIND, class F>
AQ_INLINE void kq_codes(const uint8_t* b, F&& f) {
  static_assert(KIND == 2 || KIND == 3);
  const uint8_t* qs = b + (KIND == 3 ? 32 : 16);
  [[maybe_unused]] I16 hm[2];
  if constexpr (KIND == 3) hm[0] = ld_u8x16(b), hm[1] = ld_u8x16(b + 16);
  sfor<2>([&](auto H) {
    constexpr int h = AQ_CV(H);
    sfor<2>([&](auto P) {
      constexpr int half = AQ_CV(P);
      const I16 v = ld_u8x16(qs + 32 * h + 16 * half);
      sfor<4>([&](auto T) {
        constexpr int t = AQ_CV(T);
        I16 u = iand(isrl<2 * t>(v), 3);
        if constexpr (KIND == 3) u = ior(u, isll<2>(iand(isrl<4 * h + t>(hm[half]), 1)));
        f(std::integral_constant<int, 8 * h + 2 * t + half>{}, u);
      });
    });
  });
}

}  // namespace
}  // namespace affineq::detail
