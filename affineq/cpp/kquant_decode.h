// llama.cpp's k-quant super-blocks (256 weights; layouts in affineq/tensor/format_kquant.py, checked against
// gguf.quants.dequantize) as the k-quant formats store them: the codes bit-packed in the dense layout, and each
// super-block's header (its non-code bytes, in block order) in a `scales` array [n, k / 256, kq_header_size].
// kq_header_qparams turns one header into the per-group (sub-block) scale s and offset o of weight = u * s + o
// for the unsigned code u:
//   q2_k, q4_k, q5_k: s = d * sc_j, o = -(dmin * m_j)
//   q3_k, q6_k (signed codes q = u - 2^(bits-1)): s = d * sc_j, o = -2^(bits-1) * s
// Every product is exact in fp32 (an fp16 significand of 11 bits times an integer of <= 8 bits, times a code
// of <= 6 bits), so u * s + o rounds once, as format_kquant's dequantize.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "simd.h"

namespace affineq::detail {
namespace {

inline constexpr int kSuperBlock = 256;

// Header bytes per super-block of kind 2..6 (q2_k .. q6_k): q2_k scales[16] d dmin; q3_k scales[12] d; q4_k /
// q5_k d dmin scales[12]; q6_k int8 scales[16] d. 0 for any other kind.
constexpr int64_t kq_header_size(int64_t kind) {
  return kind == 2 ? 20 : kind == 3 ? 14 : kind == 4 || kind == 5 ? 16 : kind == 6 ? 18 : 0;
}
// Weights per sub-block (one scale each).
constexpr int64_t kq_group(int64_t kind) { return kind == 4 || kind == 5 ? 32 : 16; }

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

// The kSuperBlock / kq_group(kind) per-group (s, o) of one header h (see the top of the file).
inline void kq_header_qparams(int kind, const uint8_t* h, float* s, float* o) {
  if (kind == 4 || kind == 5) {
    uint8_t sc[8], mn[8];
    scale_min_k4(h + 4, sc, mn);
    const float d = half_to_float(h), dmin = half_to_float(h + 2);
    for (int j = 0; j < 8; ++j) {
      s[j] = d * static_cast<float>(sc[j]);
      o[j] = -(dmin * static_cast<float>(mn[j]));
    }
  } else if (kind == 6) {
    const float d = half_to_float(h + 16);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(static_cast<int8_t>(h[j]));
      o[j] = -32.f * s[j];
    }
  } else if (kind == 3) {
    int sc[16];
    q3k_scales(h, sc);
    const float d = half_to_float(h + 12);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(sc[j] - 32);
      o[j] = -4.f * s[j];
    }
  } else {  // kind == 2
    const float d = half_to_float(h + 16), dmin = half_to_float(h + 18);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(h[j] & 15);
      o[j] = -(dmin * static_cast<float>(h[j] >> 4));
    }
  }
}

}  // namespace
}  // namespace affineq::detail
