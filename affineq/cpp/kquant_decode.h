// llama.cpp's k-quant super-blocks (256 weights; layouts in affineq/tensor/format_kquant.py, checked against
// gguf.quants.dequantize) as the k-quant formats store them: the codes bit-packed in the dense layout, and per
// sub-block j one sub-scale byte sc_j (and for q4_k / q5_k one min byte m_j), per super-block the fp16 d (and
// dmin). kq_block gives the scale s and offset o of weight = u * s + o for the unsigned code u:
//   q2_k: s = d * (b & 15), o = -(dmin * (b >> 4))      (b: the sub-scale byte, sc | m << 4)
//   q4_k, q5_k: s = d * sc_j, o = -(dmin * m_j)
//   q3_k: s = d * (b - 32), o = -4 * s;  q6_k: s = d * int8(b), o = -32 * s   (signed codes q = u + o / s)
// Every product is exact in fp32 (an fp16 significand of 11 bits times an integer of <= 8 bits, times a code
// of <= 6 bits), so u * s + o rounds once, as format_kquant's dequantize.
#pragma once

#include <cstdint>

#include "simd.h"

namespace affineq::detail {
namespace {

inline constexpr int kSuperBlock = 256;

// fp16 values per super-block (d, and dmin for the kinds with mins): kind 2..6.
constexpr int64_t kq_supers(int64_t kind) { return kind == 3 || kind == 6 ? 1 : 2; }
// Weights per sub-block (one scale each).
constexpr int64_t kq_group(int64_t kind) { return kind == 4 || kind == 5 ? 32 : 16; }

// One super-block's gpb = 256 / kq_group(KIND) scales (offset=false, times mul) or offsets into out, from its
// sub-scale bytes b, min bytes m (q4_k / q5_k) and its fp16 d (and dmin) at sup.
template <int KIND>
AQ_INLINE void kq_block(bool offset, float mul, const uint8_t* b, const uint8_t* m, const uint16_t* sup, float* out) {
  constexpr int64_t gpb = kSuperBlock / kq_group(KIND);
  const auto sub_scale = [](uint8_t v) {  // the integer sub-scale of a byte, as a float
    if constexpr (KIND == 2) return static_cast<float>(v & 15);
    else if constexpr (KIND == 3) return static_cast<float>(static_cast<int>(v) - 32);
    else if constexpr (KIND == 6) return static_cast<float>(static_cast<int8_t>(v));
    else return static_cast<float>(v);
  };
  const float d = f16_to_float(sup[0]);
  if (!offset) {
    for (int64_t j = 0; j < gpb; ++j) out[j] = d * sub_scale(b[j]) * mul;
  } else if constexpr (KIND == 3 || KIND == 6) {  // -2^(bits-1) * s, exact
    for (int64_t j = 0; j < gpb; ++j) out[j] = (KIND == 3 ? -4.f : -32.f) * (d * sub_scale(b[j]));
  } else {
    const float dmin = f16_to_float(sup[1]);
    for (int64_t j = 0; j < gpb; ++j) out[j] = -(dmin * static_cast<float>(KIND == 2 ? b[j] >> 4 : m[j]));
  }
}

}  // namespace
}  // namespace affineq::detail
