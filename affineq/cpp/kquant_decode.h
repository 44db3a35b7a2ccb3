// llama.cpp's k-quant super-blocks (256 weights; layouts in affineq/tensor/format_kquant.py, checked against
// gguf.quants.dequantize) as the k-quant formats store them: the codes bit-packed in the dense layout, and per
// sub-block j one sub-scale byte sc_j (and for q4_k / q5_k one min byte m_j), per super-block the fp16 d (and
// dmin). kq_qparam gives the scale s and offset o of weight = u * s + o for the unsigned code u:
//   q2_k: s = d * (b & 15), o = -(dmin * (b >> 4))      (b: the sub-scale byte, sc | m << 4)
//   q4_k, q5_k: s = d * sc_j, o = -(dmin * m_j)
//   q3_k: s = d * (b - 32), o = -4 * s;  q6_k: s = d * int8(b), o = -32 * s   (signed codes q = u + o / s)
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

// fp16 values per super-block (d, and dmin for the kinds with mins): kind 2..6.
constexpr int64_t kq_supers(int64_t kind) { return kind == 3 || kind == 6 ? 1 : 2; }
// Weights per sub-block (one scale each).
constexpr int64_t kq_group(int64_t kind) { return kind == 4 || kind == 5 ? 32 : 16; }

// (s, o) of one sub-block: sub-scale byte b, min byte m (q4_k / q5_k), the super-block's d and dmin.
AQ_INLINE void kq_qparam(int kind, uint8_t b, uint8_t m, float d, float dmin, float& s, float& o) {
  if (kind == 2) {
    s = d * static_cast<float>(b & 15);
    o = -(dmin * static_cast<float>(b >> 4));
  } else if (kind == 4 || kind == 5) {
    s = d * static_cast<float>(b);
    o = -(dmin * static_cast<float>(m));
  } else {
    s = d * static_cast<float>(kind == 3 ? static_cast<int>(b) - 32 : static_cast<int>(static_cast<int8_t>(b)));
    o = (kind == 3 ? -4.f : -32.f) * s;
  }
}

}  // namespace
}  // namespace affineq::detail
