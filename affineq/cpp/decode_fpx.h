// Decoders of the OCP MX element codes fp4 E2M1, fp6 E2M3 and fp6 E3M2 (bit patterns, sign in the top bit;
// no Inf/NaN): the template widths that name them, their value tables (computed from the format, at compile
// time), and the register decoders from int32 codes (I16, as decode_unit_i hands them over) to
//   fcode<B>:  their fp32 values (paths 1, 2 and 4), a table lookup in registers;
//   icode<B>:  their values times int16_mult(B), exact small integers (path 3's int16 code pairs).
// AVX-512: one vpermps (fp4, 16 entries) or vpermt2ps over the 5-bit magnitude plus a sign xor (fp6);
// portable: an array. (AVX2 with F16C converts whole units through fp16 bits instead, in decode.h.)
// The sign xor needs no mask: each table entry is stored xor (index << (31 - mag_bits)), so xoring the whole
// code shifted to put its sign bit at bit 31 cancels the magnitude bits it drags along and flips the sign.
#pragma once

#include <bit>
#include <cstdint>

#include "lowbit_kernels.h"
#include "simd.h"

namespace affineq::detail {
namespace {

// Widths: storage bits in the low 4 bits (bits_of), a kind flag above (see decode.h for the others).
inline constexpr int kBF4 = 4 | 64, kBF6A = 6 | 128, kBF6B = 6 | 256;  // fp4 e2m1, fp6 e2m3, fp6 e3m2
constexpr bool is_fpx(int B) { return B == kBF4 || B == kBF6A || B == kBF6B; }
constexpr int fpx_bits(int B) { return B & 15; }

struct FpxFormat { int ebits, mbits, bias; };
constexpr FpxFormat fpx_format(int B) {
  return B == kBF4 ? FpxFormat{2, 1, 1} : B == kBF6A ? FpxFormat{2, 3, 1} : FpxFormat{3, 2, 3};
}
constexpr int fpx_width(int codes) {
  return codes == kCodesFp4E2M1 ? kBF4 : codes == kCodesFp6E2M3 ? kBF6A : codes == kCodesFp6E3M2 ? kBF6B : 0;
}

// Value of magnitude code `mag` (exponent and mantissa bits) times 2^s; exact in float (at most 5 bits).
constexpr float fpx_mag_scaled(int B, int mag, int s) {
  const FpxFormat f = fpx_format(B);
  const int e = mag >> f.mbits, m = mag & ((1 << f.mbits) - 1);
  const int sig = e == 0 ? m : (1 << f.mbits) + m;         // subnormals: 0.m * 2^(1 - bias)
  int ex = (e == 0 ? 1 : e) - f.bias - f.mbits + s;        // value = sig * 2^ex
  float v = static_cast<float>(sig);
  for (; ex > 0; --ex) v *= 2.f;
  for (; ex < 0; ++ex) v *= 0.5f;
  return v;
}
constexpr float fpx_value(int B, int code) {
  const int mb = fpx_bits(B) - 1;
  const float v = fpx_mag_scaled(B, code & ((1 << mb) - 1), 0);
  return (code >> mb) & 1 ? -v : v;
}
// Path 3 multiplies codes by this so that every value is an integer: fp4 x 2 (max 12), e2m3 x 8 (max 60),
// e3m2 x 16 (max 448); the scale is multiplied by its inverse (exact, a power of two).
constexpr int int16_mult(int B) { return B == kBF4 ? 2 : B == kBF6A ? 8 : B == kBF6B ? 16 : 1; }

// Portable decode (dequantize_f32 and the scalar build): the value of `code` for a codes kind.
inline float fpx_to_float(uint8_t code, int codes) {
  switch (fpx_width(codes)) {
    case kBF4: return fpx_value(kBF4, code & 15);
    case kBF6A: return fpx_value(kBF6A, code & 63);
    default: return fpx_value(kBF6B, code & 63);
  }
}

// Tables: f32[i] = the bits of magnitude i's value, pre-xored as the header says (AVX-512 fp6); i32: values
// times int16_mult (path 3); val: the plain signed value of every code (AVX-512 fp4, portable decoders).
template <int B>
struct FpxTables {
  static constexpr int kMagBits = fpx_bits(B) - 1;
  alignas(64) static constexpr uint32_t f32[32] = {
#define AQ_E(i) \
  (i < (1 << kMagBits) ? std::bit_cast<uint32_t>(fpx_mag_scaled(B, i, 0)) ^ (uint32_t{i} << (31 - kMagBits)) : 0u)
      AQ_E(0),  AQ_E(1),  AQ_E(2),  AQ_E(3),  AQ_E(4),  AQ_E(5),  AQ_E(6),  AQ_E(7),  AQ_E(8),  AQ_E(9),  AQ_E(10),
      AQ_E(11), AQ_E(12), AQ_E(13), AQ_E(14), AQ_E(15), AQ_E(16), AQ_E(17), AQ_E(18), AQ_E(19), AQ_E(20), AQ_E(21),
      AQ_E(22), AQ_E(23), AQ_E(24), AQ_E(25), AQ_E(26), AQ_E(27), AQ_E(28), AQ_E(29), AQ_E(30), AQ_E(31)};
#undef AQ_E
  // Signed values of all 2^bits codes (fp4: 16; fp6 only its 32 magnitudes are used, see icode).
  alignas(64) static constexpr int32_t i32[32] = {
#define AQ_I(i) static_cast<int32_t>(fpx_value(B, i) * int16_mult(B))
      AQ_I(0),  AQ_I(1),  AQ_I(2),  AQ_I(3),  AQ_I(4),  AQ_I(5),  AQ_I(6),  AQ_I(7),  AQ_I(8),  AQ_I(9),  AQ_I(10),
      AQ_I(11), AQ_I(12), AQ_I(13), AQ_I(14), AQ_I(15), AQ_I(16), AQ_I(17), AQ_I(18), AQ_I(19), AQ_I(20), AQ_I(21),
      AQ_I(22), AQ_I(23), AQ_I(24), AQ_I(25), AQ_I(26), AQ_I(27), AQ_I(28), AQ_I(29), AQ_I(30), AQ_I(31)};
#undef AQ_I
  // Plain signed values of every code (the portable decoder).
  alignas(64) static constexpr float val[64] = {
#define AQ_V(i) (i < (2 << kMagBits) ? fpx_value(B, i) : 0.f)
#define AQ_V8(j) AQ_V(8 * j), AQ_V(8 * j + 1), AQ_V(8 * j + 2), AQ_V(8 * j + 3), AQ_V(8 * j + 4), AQ_V(8 * j + 5), \
                 AQ_V(8 * j + 6), AQ_V(8 * j + 7)
      AQ_V8(0), AQ_V8(1), AQ_V8(2), AQ_V8(3), AQ_V8(4), AQ_V8(5), AQ_V8(6), AQ_V8(7)};
#undef AQ_V8
#undef AQ_V
};

// int32 codes in [0, 2^bits) -> fp32 values.
template <int B>
AQ_INLINE F16 fcode(I16 v) {
  using T = FpxTables<B>;
#if AQ_AVX512
  constexpr int kSignShift = 31 - T::kMagBits;  // code << kSignShift puts the sign bit at bit 31
  if constexpr (B == kBF4) {
    return {_mm512_permutexvar_ps(v.v, _mm512_load_ps(T::val))};  // all 16 signed codes: no sign step
  } else {
    const __m512 lo = _mm512_castsi512_ps(_mm512_load_si512(T::f32)),
                 hi = _mm512_castsi512_ps(_mm512_load_si512(T::f32 + 16));
    const __m512 r = _mm512_permutex2var_ps(lo, v.v, hi);  // index bits 0..4: the magnitude
    return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(r), _mm512_slli_epi32(v.v, kSignShift)))};
  }
#elif AQ_AVX2
  // Only reached without F16C: AVX2 with F16C decodes whole units through fp16 bits instead (decode_unit).
  alignas(32) int32_t c[16];
  alignas(32) float t[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), v.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(c + 8), v.b);
  for (int i = 0; i < 16; ++i) t[i] = T::val[c[i]];
  return fload(t);
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = T::val[v.v[i]];
  return r;
#endif
}

#if AQ_AVX512
// int32 codes in [0, 2^bits) -> value * int16_mult(B), exact int32 (path 3).
template <int B>
AQ_INLINE __m512i icode(__m512i v) {
  using T = FpxTables<B>;
  if constexpr (B == kBF4) {
    return _mm512_permutexvar_epi32(v, _mm512_load_si512(T::i32));
  } else {
    const __m512i r = _mm512_permutex2var_epi32(_mm512_load_si512(T::i32), v, _mm512_load_si512(T::i32 + 16));
    return _mm512_mask_sub_epi32(r, _mm512_test_epi32_mask(v, _mm512_set1_epi32(32)), _mm512_setzero_si512(), r);
  }
}
#endif

}  // namespace
}  // namespace affineq::detail
