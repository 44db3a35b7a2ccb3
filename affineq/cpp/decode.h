// Code decoders shared by the kernel translation units: the template widths B (integer codes of 1..8 bits and
// the float8 formats), float8 -> fp32 / fp16 conversions, and decode_unit / decode_unit_i, which turn one unit
// of the panel layout (8 consecutive k of 16 rows; layout in affineq/cpp/__init__.py) into 8 vectors of 16
// values. All templates and always-inlined functions: each path inlines them into its own hot loop.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "decode_fpx.h"
#include "lowbit_kernels.h"
#include "simd.h"

namespace affineq::detail {
// Internal linkage (each translation unit has its own copy; all of it is inlined anyway): with external linkage,
// GCC compiled the hot loops that inline these functions differently (seen in the disassembly).
namespace {

// Template "widths" B: 1..8 are unsigned codes of that many bits; kBE4M3 / kBE5M2 are float8 bytes stored in
// the 8-bit layout; kBF4 / kBF6A / kBF6B (decode_fpx.h) are fp4 / fp6 bit patterns in the 4- / 6-bit layout.
// bits_of(B) is the storage width.
inline constexpr int kBE4M3 = 8 | 16, kBE5M2 = 8 | 32;
constexpr int bits_of(int B) { return B & 15; }
// Integer widths stored as several bit planes (4 + 2 + 1: the low bits in the widest).
constexpr bool multi_plane(int B) { return B == 3 || B == 5 || B == 6 || B == 7; }
constexpr bool is_fp8(int B) { return B == kBE4M3 || B == kBE5M2; }
// Widths path 3 (exact int16 codes) serves: integers, and fp4 / fp6 times int16_mult (float8 values are not
// small integers).
constexpr bool int16_ok(int B) { return !is_fp8(B); }
// Path 3's scale multiplier: codes reach it as value * int16_mult(B).
constexpr float int16_code_scale(int B) { return 1.f / static_cast<float>(int16_mult(B)); }
// The float8 decoders below return e4m3 values times 2^-8 (an exact re-bias into fp16), and the AVX2 fp4 / fp6
// decoders values times 2^(bias - 15) (fp16 re-bias, see decode_unit); code_scale undoes it.
constexpr float code_scale(int B) {
#if AQ_AVX2 && defined(__F16C__)
  if (is_fpx(B)) return B == kBF6B ? 4096.f : 16384.f;  // 2^(15 - bias): bias 3 (e3m2), 1 (e2m1, e2m3)
#endif
  return B == kBE4M3 ? 256.f : 1.f;
}
// X(B) for every width a path is instantiated for (explicit instantiations in the path files; dispatch.cpp
// maps (bits, codes) to these).
#define AQ_FOR_EACH_UINT_WIDTH(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#define AQ_FOR_EACH_INT16_WIDTH(X) AQ_FOR_EACH_UINT_WIDTH(X) X(kBF4) X(kBF6A) X(kBF6B)
#define AQ_FOR_EACH_WIDTH(X) AQ_FOR_EACH_INT16_WIDTH(X) X(kBE4M3) X(kBE5M2)

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
// as an 8-bit unit that the 8-bit decoder widens with vpmovzxbd straight from L1: a faster GEMV for the
// multi-plane widths on both ISAs (see benchmarks/README.md, kernel design measurements). The 4-bit plane is
// loaded as [chunk t/2 | chunk t/2 + 2] so that its nibbles pair k like the 2-bit plane's [chunk 0 | chunk 1]
// and the 1-bit plane's [bits 0..3 | bits 4..7].
// g(integral_constant<t>, c) for t = 0..3 with c = the byte codes of [k = t (rows 0-15) | k = 4 + t (rows 0-15)].
template <int B, class G>
AQ_INLINE void decode_unit_bytes_ymm(const uint8_t* p, G&& g) {
  static_assert(multi_plane(B));
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
    g(T, c);
  });
}

template <int B>
AQ_INLINE void decode_unit_bytes(const uint8_t* p, uint8_t* out) {
  decode_unit_bytes_ymm<B>(p, [&](auto T, __m256i c) {
    constexpr int t = AQ_CV(T);
    // k = t and k = 4 + t, rows 0..15 each: the 8-bit unit layout
    _mm_store_si128(reinterpret_cast<__m128i*>(out + 16 * t), _mm256_castsi256_si128(c));
    _mm_store_si128(reinterpret_cast<__m128i*>(out + 16 * (t + 4)), _mm256_extracti128_si256(c, 1));
  });
}
#endif

#if AQ_AVX512 && defined(__AVX512VBMI__)
// Multi-plane widths (and the one plane of 4-bit codes) with AVX-512 VBMI: the planes are combined in byte lanes
// of two zmm, z[h] holding the codes of k = 2s + h (rows 0-15) in its 128-bit chunk s, 64 codes per op and no trip
// through memory; then one vpermb per k moves a chunk's 16 bytes into int32 lanes. Each plane's field is brought
// to its bit position by a 32-bit rotate (per-chunk counts; no field leaves its byte, so the mask never mixes
// bytes) and merged with one ternary-logic op: about 10 ops per unit where the ymm byte path below takes ~36 (see
// benchmarks/README.md, kernel design measurements). The codes land shifted left by S, with bit 7 set when Top
// (decode_unit_biased).
template <int B, int S, bool Top>
AQ_INLINE void combine_planes_vbmi(const uint8_t* p, __m512i (&z)[2]) {
  static_assert(multi_plane(B) || B == 4);
  constexpr int kSh2 = (B & 4) ? 4 : 0;            // bit position of the 2-bit plane's codes (before S)
  constexpr int kSh1 = kSh2 + ((B & 2) ? 2 : 0);  // bit position of the 1-bit plane's codes
  constexpr int kOff2 = (B & 4) ? 64 : 0, kOff1 = kOff2 + ((B & 2) ? 32 : 0);
  const auto bytes = [](int m) { return _mm512_set1_epi8(static_cast<char>(m)); };
  // Per-chunk rotation counts (mod 32: a right rotate by r is a left one by 32 - r).
  const auto rot = [](__m512i v, int c0, int c1, int c2, int c3) {
    const auto m = [](int c) { return ((c % 32) + 32) % 32; };
    return _mm512_rolv_epi32(v, _mm512_setr_epi32(m(c0), m(c0), m(c0), m(c0), m(c1), m(c1), m(c1), m(c1), m(c2),
                                                   m(c2), m(c2), m(c2), m(c3), m(c3), m(c3), m(c3)));
  };
  // The widest plane writes z[h] (and sets bit 7 when Top), the others OR into it.
  const auto merge = [&](int h, __m512i r, int mask, bool first) {
    if (!first) z[h] = _mm512_ternarylogic_epi32(z[h], r, bytes(mask), 0xF8);          // a | (b & c)
    else if (Top) z[h] = _mm512_ternarylogic_epi32(r, bytes(mask), bytes(0x80), 0xEA);  // (a & b) | c
    else z[h] = _mm512_and_si512(r, bytes(mask));
  };
  if constexpr ((B & 4) != 0) {
    const __m512i n = _mm512_loadu_si512(p);  // slot s: k = 2s (low nibbles), 2s + 1 (high)
    merge(0, S == 0 ? n : rot(n, S, S, S, S), 15 << S, true);
    merge(1, S == 4 ? n : rot(n, S - 4, S - 4, S - 4, S - 4), 15 << S, true);
  }
  if constexpr ((B & 2) != 0) {
    // chunks [slot 0, slot 0, slot 1, slot 1]: chunk s holds k = 2s + h in field 2 (s % 2) + h of slot s / 2
    const __m512i q = _mm512_permutexvar_epi64(
        _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kOff2))));
    constexpr int c = S + kSh2;
    merge(0, rot(q, c, c - 4, c, c - 4), 3 << c, (B & 4) == 0);
    merge(1, rot(q, c - 2, c - 6, c - 2, c - 6), 3 << c, (B & 4) == 0);
  }
  if constexpr ((B & 1) != 0) {
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kOff1)));
    constexpr int c = S + kSh1;  // bit 2s + h of each byte -> bit c
    merge(0, rot(b, c, c - 2, c - 4, c - 6), 1 << c, false);  // B = 1 has no biased decode
    merge(1, rot(b, c - 1, c - 3, c - 5, c - 7), 1 << c, false);
  }
}

// vpermb's index for k-slot s: byte `at` of int32 lane j <- byte 16 s + j.
template <int s, int at>
AQ_INLINE __m512i chunk_to_lanes() {
  const auto l = [](int j) { return (16 * s + j) << (8 * at); };
  return _mm512_setr_epi32(l(0), l(1), l(2), l(3), l(4), l(5), l(6), l(7), l(8), l(9), l(10), l(11), l(12), l(13),
                           l(14), l(15));
}

// decode_unit_biased (the fp32 GEMV's multi-plane and 4-bit decoder): f(integral_constant<t>, w) with w = 2^B + u
// as fp32, built without a conversion: the codes sit in their bytes shifted to the top mantissa bits (7 - B) under
// the exponent's low bit, and one merge-masked vpermb per k drops that byte into byte 2 of each int32 lane of a
// constant holding the rest of the exponent (byte 3): the fp32 bits of 2^B * (1 + u / 2^B), exact. One op per
// 16 codes instead of vpermb + vcvtdq2ps; the caller takes the bias away through the group sums (y += scale *
// (acc - 2^B * sum(x_g))), as the bf16-dot GEMV does with 16 + u.
template <int B, class F>
AQ_INLINE void decode_unit_biased(const uint8_t* p, F&& f) {
  constexpr int kExp = 127 + B;
  __m512i z[2];
  combine_planes_vbmi<B, 7 - B, (kExp & 1) != 0>(p, z);
  const __m512i e = _mm512_set1_epi32((kExp >> 1) << 24);
  sfor<8>([&](auto T) {
    constexpr int t = AQ_CV(T);
    const __m512i v = _mm512_mask_permutexvar_epi8(e, 0x4444444444444444ull, chunk_to_lanes<t / 2, 2>(), z[t % 2]);
    f(T, F16{_mm512_castsi512_ps(v)});
  });
}
template <int B>
constexpr bool biased_decode_ok() { return multi_plane(B) || B == 4; }
#else
template <int B>
constexpr bool biased_decode_ok() { return false; }
#endif

template <int B, class F>
AQ_INLINE void decode_unit_i(const uint8_t* p, F&& f) {
#if AQ_AVX2 || AQ_AVX512
  if constexpr (multi_plane(B)) {
    alignas(32) uint8_t buf[128];
    decode_unit_bytes<B>(p, buf);
    // Keep the round trip through memory: left to itself the compiler widens in registers (vmovq, vpsrldq,
    // vextracti128 + vpmovzxbd: 2-3 shuffles per 8 codes instead of one vpmovzxbd from L1). Hiding the pointer
    // does it; an "m" operand on buf instead made GCC keep the caller's accumulators in memory, which was
    // slower (see benchmarks/README.md, kernel design measurements).
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
  if constexpr (is_fpx(B)) {
    // AVX2 fp4 / fp6: the table decoder (fcode) needs 1 (fp4) or 4 (fp6) vpermps plus blends per 8 codes, which
    // made fp6 slower than fp32 F.linear at m = 1. Instead, as for float8: a code s|mag becomes the fp16 bits
    // s << 15 | mag << (10 - mbits), whose value is the code's times 2^(bias - 15) for normals and subnormals
    // alike (both formats are IEEE-style; code_scale undoes the factor), 32 codes per few integer ops, then
    // vcvtph2ps from L1. Each ymm of byte codes holds [k = ka (rows 0-15) | k = kb (rows 0-15)].
    alignas(32) uint16_t buf[128];
    const __m256i z = _mm256_setzero_si256();
    const auto bytes = [](int v) { return _mm256_set1_epi8(static_cast<char>(v)); };
    // c: 32 byte codes [ka | kb] -> their fp16 bits in buf[32 i, 32 i + 32), built as a low and a high byte per
    // code (byte-lane ops, 32 codes each; no shift crosses a byte) and interleaved by the in-lane unpacks:
    // lo = [ka rows 0-7 | kb rows 0-7], hi = rows 8-15.
    const auto to_fp16 = [&](int i, __m256i c) {
      __m256i lo = z, hi;
      if constexpr (B == kBF4) {
        // fp16 = s << 15 | mag << 9: the high byte s << 7 | mag << 1, one 16-entry byte table
        const __m256i lut = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -128, -126, -124, -122, -120, -118, -116,
                                             -114, 0, 2, 4, 6, 8, 10, 12, 14, -128, -126, -124, -122, -120, -118,
                                             -116, -114);
        hi = _mm256_shuffle_epi8(lut, c);
      } else {
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, bytes(32)), 2);  // bit 5 -> bit 7
        if constexpr (B == kBF6B) {  // fp16 = s << 15 | mag << 8: the high byte s << 7 | mag
          hi = _mm256_or_si256(_mm256_and_si256(c, bytes(31)), sign);
        } else {  // e2m3: fp16 = s << 15 | mag << 7: high byte s << 7 | mag >> 1, low byte (mag & 1) << 7
          hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 1), bytes(15)), sign);
          lo = _mm256_slli_epi16(_mm256_and_si256(c, bytes(1)), 7);
        }
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32 * i), _mm256_unpacklo_epi8(lo, hi));
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32 * i + 16), _mm256_unpackhi_epi8(lo, hi));
    };
    if constexpr (bits_of(B) == 6) {
      decode_unit_bytes_ymm<6>(p, [&](auto T, __m256i c) { to_fp16(AQ_CV(T), c); });  // pairs (t, t + 4)
    } else {
      // 4-bit unit: slot s holds k = 2s (low nibbles) and 2s + 1 (high); a ymm of slots (2j, 2j + 1) gives the
      // pairs (4j, 4j + 2) (low nibbles) and (4j + 1, 4j + 3) (high nibbles).
      const __m256i lo4 = _mm256_set1_epi8(15);
      sfor<2>([&](auto J) {
        constexpr int j = AQ_CV(J);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j));
        to_fp16(2 * j, _mm256_and_si256(v, lo4));
        to_fp16(2 * j + 1, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
      });
    }
    const uint16_t* q = buf;
    AQ_OPAQUE(q);  // see decode_unit_i
    sfor<8>([&](auto T) {
      constexpr int k = AQ_CV(T);
      // where k's 16 fp16 values start: its pair, + 8 when k is the pair's kb
      constexpr int off = bits_of(B) == 6 ? 32 * (k % 4) + 8 * (k / 4) : 32 * (2 * (k / 4) + k % 2) + 8 * ((k % 4) / 2);
      const uint16_t* r = q + off;
      f(T, F16{_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(r))),
               _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(r + 16)))});
    });
    return;
  }
  if constexpr (is_fp8(B)) {
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
  if constexpr (is_fp8(B)) sfor<8>([&](auto T) { f(T, fp8x16<B>(p + 16 * AQ_CV(T))); });
  else if constexpr (is_fpx(B)) decode_unit_i<bits_of(B)>(p, [&](auto T, I16 v) { f(T, fcode<B>(v)); });
  else decode_unit_i<B>(p, [&](auto T, I16 v) { f(T, i2f(v)); });
}

}  // namespace
}  // namespace affineq::detail
