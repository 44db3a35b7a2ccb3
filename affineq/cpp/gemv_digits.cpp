// Path 1's GEMV on integer digits of x (the numerics: gemv_digits.h): when it runs, x's digits, and the tiles
// (4 panels, four int32 digit sums per panel in registers).
#include "gemv_digits.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "amx.h"
#include "decode.h"
#include "gemv_groups.h"

namespace affineq::detail {

bool use_x_digits(const LowbitProblem& p) {
#if AQ_X_DIGITS
  // One row only (at 2 rows it lost to the FMA GEMV). bf16 x on weights of 2^19 weights or more (below, the
  // bf16-dot and FMA GEMVs kept up): the caller hands it over widened to fp32 (exact) and rounds y. On AMX Xeons
  // every width, where vpdpbusd outruns the FMA GEMV's decode; on other CPUs (the Zen 5) the widths where it
  // measured faster there: 2- to 4-bit codes with fp32 x (k-quants: q2_k / q3_k on their super-block tiles, q4_k),
  // 2- and 3-bit codes with bf16 x (q2_k and q3_k too; 4-bit codes keep the bf16-dot GEMV, use_b4bf16); the others
  // kept the FMA GEMV (benchmarks/README.md, kernel design measurements).
  if (!(p.m == 1 && p.y_bf16 == nullptr && !p.y_bf16_values && digits_width(p.bits) &&
        (p.x_bf16 == nullptr || p.n * p.k >= (int64_t{1} << 19)) && p.codes == kCodesUint &&
        (p.qparams_kquant == 0 || p.qparams_kquant == p.bits) && !p.qparams_e8m0 && p.group_size % 8 == 0))
    return false;
  if (amx_cpu()) return true;
  const bool kq_ok = p.qparams_kquant == 0 || p.qparams_kquant == 2 || p.qparams_kquant == 3;
  if (p.x_bf16 == nullptr) return p.bits <= 4 && (kq_ok || p.bits == 4);
  return p.bits <= 3 && kq_ok;
#else
  (void)p;
  return false;
#endif
}

int64_t digit_block(const LowbitProblem& p) {
  if (p.qparams_kquant == 2 || p.qparams_kquant == 3) return kSuperBlock;  // tile_q2k, tile_q3k
  const int64_t gs = p.group_size;
  int64_t kb = std::min<int64_t>(gs, 512);
  while (gs % kb != 0) kb -= 8;
  return kb;
}

#if AQ_X_DIGITS
bool x_digits(const float* x, int64_t K8, int64_t kb, int B, XDigits& xd, bool sub_biases) {
  const int32_t bias = 1 << (B - 1);
  const int64_t nb = K8 / kb;
  xd.K8 = K8, xd.kb = kb, xd.nb = nb;
  sub_biases = sub_biases && kb % 16 == 0;
  xd.c_sub_hi.resize(sub_biases ? static_cast<size_t>(K8 / 16) : 0);
  xd.c_sub_lo.resize(xd.c_sub_hi.size());
  xd.d.resize(static_cast<size_t>(4 * K8));
  xd.fx.resize(static_cast<size_t>(nb));
  xd.c_hi.resize(static_cast<size_t>(nb));
  xd.c_lo.resize(static_cast<size_t>(nb));
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);  // two units
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kb;
    const auto mask = [&](int64_t i) { return static_cast<__mmask16>(kb - i >= 16 ? 0xFFFF : 0x00FF); };
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;  // lanes whose x - x is not 0: inf or NaN
    for (int64_t i = 0; i < kb; i += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(mask(i), xb + i);
      bad |= static_cast<__mmask16>(~_mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    if (bad != 0) return false;
    int e = 0;
    std::frexp(_mm512_reduce_max_ps(amax), &e);  // |x| < 2^e over the block (all zero: e = 0)
    if (e > 100) return false;
    e = std::max(e, -119);  // fx = 2^(e - 30) >= 2^-149: every subnormal is a multiple of it
    // x * 2^(30 - e) in two exact steps (30 - e reaches 149, past fp32's largest power of two)
    const int sh = 30 - e;
    const __m512 s1 = _mm512_set1_ps(std::ldexp(1.f, sh / 2)), s2 = _mm512_set1_ps(std::ldexp(1.f, sh - sh / 2));
    __m512i sum[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t i = 0; i < kb; i += 16) {
      int32_t S16[4];
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask(i), xb + i), s1), s2);
      __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // |q| < 2^30
      for (int t = 0; t < 4; ++t) {
        // digit t: the low byte of r as signed, then r = (r - digit) / 2^8 (exact); the last one is r itself
        const __m512i d = t < 3 ? _mm512_srai_epi32(_mm512_slli_epi32(r, 24), 24) : r;
        if (t < 3) r = _mm512_srai_epi32(_mm512_sub_epi32(r, d), 8);
        sum[t] = _mm512_add_epi32(sum[t], d);
        if (sub_biases) S16[t] = _mm512_reduce_add_epi32(d);
        const __m128i bytes = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(d), order);
        int8_t* dst = xd.d.data() + t * K8 + b * kb + i;
        if (kb - i >= 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bytes);
        else _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), bytes);
      }
      if (sub_biases) {
        xd.c_sub_hi[(b * kb + i) / 16] = bias * (256 * S16[3] + S16[2]);
        xd.c_sub_lo[(b * kb + i) / 16] = bias * (256 * S16[1] + S16[0]);
      }
    }
    int32_t S[4];
    for (int t = 0; t < 4; ++t) S[t] = _mm512_reduce_add_epi32(sum[t]);
    xd.fx[b] = std::ldexp(1.f, e - 30);
    xd.c_hi[b] = bias * (256 * S[3] + S[2]);
    xd.c_lo[b] = bias * (256 * S[1] + S[0]);
  }
  return true;
}

namespace {

// 2-bit units: slot s (16 bytes) holds k = 4 s + t in bits 2 t of row j's byte. two_bit_rows: lane j gathers
// (slot 0, slot 0, slot 1, slot 1) of row j; kTwoBitShifts<At> [even, odd][byte]: the vpmultishiftqb counts that
// bring each byte's field (k 0 2 4 6: bits 0 4 0 4 of the lane's bytes; k 1 3 5 7: 2 6 2 6) to bit At of its byte.
alignas(64) constexpr auto kTwoBitGather = [] {
  std::array<uint8_t, 64> a{};
  for (int j = 0; j < 16; ++j)
    for (int i = 0; i < 4; ++i) a[4 * j + i] = static_cast<uint8_t>(16 * (i / 2) + j);
  return a;
}();
template <int At>
alignas(64) constexpr auto kTwoBitShifts = [] {
  std::array<uint8_t, 128> a{};
  for (int b = 0; b < 64; ++b)
    for (int odd = 0; odd < 2; ++odd)
      a[64 * odd + b] = static_cast<uint8_t>((8 * (b % 8) + 4 * (b % 2) + 2 * odd - At + 64) % 64);
  return a;
}();
// 3-bit units: the 1-bit plane's 16 bytes (row j's byte: bit t = k t) spread so lane j holds row j's byte four
// times (kLaneBytes); kOneBitShifts [even, odd][byte]: the counts that bring bit 2 i (even) or 2 i + 1 (odd) of
// lane byte i to bit 2.
alignas(64) constexpr auto kLaneBytes = [] {
  std::array<uint8_t, 64> a{};
  for (int b = 0; b < 64; ++b) a[b] = static_cast<uint8_t>(b / 4);
  return a;
}();
alignas(64) constexpr auto kOneBitShifts = [] {
  std::array<uint8_t, 128> a{};
  for (int b = 0; b < 64; ++b)
    for (int odd = 0; odd < 2; ++odd)
      a[64 * odd + b] = static_cast<uint8_t>((8 * (b % 8) + 2 * (b % 4) + odd - 2 + 64) % 64);
  return a;
}();
AQ_INLINE __m512i two_bit_rows(const uint8_t* unit) {
  return _mm512_permutexvar_epi8(_mm512_load_si512(kTwoBitGather.data()),
                                 _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit))));
}

// A unit's codes as the VNNI operands of its 16 rows: the codes of its even k and of its odd k (4 per int32 lane).
template <int B>
AQ_INLINE void unit_quads(const uint8_t* unit, __m512i idx, __m512i& even, __m512i& odd) {
  if constexpr (B == 2) {
    const __m512i g = two_bit_rows(unit), m2 = _mm512_set1_epi8(3);
    even = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kTwoBitShifts<0>.data()), g), m2);
    odd = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kTwoBitShifts<0>.data() + 64), g), m2);
    (void)idx;
  } else if constexpr (B == 3) {
    // the 2-bit plane as B == 2's unit (fields to bits 0-1), the 1-bit plane's row byte spread to its lane and
    // each k's bit brought to bit 2; the byte's other bits are the shifts' neighbours, cleared by the mask
    const __m512i g = two_bit_rows(unit), c = _mm512_set1_epi8(3), m7 = _mm512_set1_epi8(7);
    const __m512i h = _mm512_permutexvar_epi8(_mm512_load_si512(kLaneBytes.data()),
                                              _mm512_castsi128_si512(_mm_loadu_si128(
                                                  reinterpret_cast<const __m128i*>(unit + 32))));
    const auto join = [&](int o) AQ_INLINE_LAMBDA {
      const __m512i lo = _mm512_multishift_epi64_epi8(_mm512_load_si512(kTwoBitShifts<0>.data() + 64 * o), g);
      const __m512i hi = _mm512_multishift_epi64_epi8(_mm512_load_si512(kOneBitShifts.data() + 64 * o), h);
      return _mm512_and_si512(_mm512_ternarylogic_epi32(lo, hi, c, 0xE4), m7);  // c ? lo : hi
    };
    even = join(0);
    odd = join(1);
    (void)idx;
  } else if constexpr (B == 4) {
    const __m512i w = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(unit)), lo4 = _mm512_set1_epi8(15);
    even = _mm512_and_si512(w, lo4);
    odd = _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4);
  } else {  // the planes joined into bytes, k = 2 s + h of row j at byte 16 s + j of z[h]
    __m512i z[2];
    combine_planes_vbmi<B, 0, false>(unit, z);
    even = _mm512_permutexvar_epi8(idx, z[0]);
    odd = _mm512_permutexvar_epi8(idx, z[1]);
  }
}

// s[i] += the VNNI dot products of unit u's codes (even, odd: unit_quads' operands) with x's digit i. kMem: x's
// digits as embedded broadcasts from memory (L1), else broadcast into registers, where the compiler keeps the
// unit's eight for all of a tile's panels. The k-quant tiles (tile_q2k, tile_q3k, and tile with KqQp's
// super-block sums) need the registers those eight take: with them their 16 digit sums spilled to the stack in
// the inner loop (benchmarks/README.md, kernel design measurements); with per-group qparams the tile keeps the
// register broadcasts, which measured faster there.
template <bool kMem>
AQ_INLINE void dot_digits(__m512i (&s)[4], __m512i even, __m512i odd, const XDigits& xd, int64_t u) {
  sfor<4>([&](auto I_) {
    constexpr int i = AQ_CV(I_);
    const int8_t* q = xd.d.data() + i * xd.K8 + 8 * u;
    if constexpr (kMem) {
      s[i] = dpbusd_bcst(s[i], even, q);
      s[i] = dpbusd_bcst(s[i], odd, q + 4);
    } else {
      int32_t qe, qo;
      std::memcpy(&qe, q, sizeof(qe));
      std::memcpy(&qo, q + 4, sizeof(qo));
      s[i] = _mm512_dpbusd_epi32(s[i], even, _mm512_set1_epi32(qe));
      s[i] = _mm512_dpbusd_epi32(s[i], odd, _mm512_set1_epi32(qo));
    }
  });
}

// fx * (2^16 hi + lo) in fp32: a digit block's exact int32 halves, converted (one rounding each) and scaled.
AQ_INLINE F16 halves_value(__m512i hi, __m512i lo, __m512 fx, __m512 fx16) {
  return F16{_mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), fx16, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), fx))};
}

// y[0 .. nvalid) = a tile's NP panels of 16 results.
template <int NP>
AQ_INLINE void store_panels(const F16* tot, float* y, int64_t nvalid) {
  sfor<NP>([&](auto P_) {
    constexpr int p = AQ_CV(P_);
    const int64_t w = nvalid - 16 * p;
    if (w >= 16) fstore(y + 16 * p, tot[p]);
    else if (w > 0) fstore_n(y + 16 * p, tot[p], static_cast<int>(w));
  });
}

// NP panels: per digit block, four int32 sums (one per digit) per panel, then the block's sum of (u - 2^(B-1)) x
// in fp32 into the group's accumulator; for_groups / add_group (or KqQp) apply the qparams.
template <int B, int NP, class QP>
void tile(const uint8_t* const* pan, const QP& qp, const XDigits& xd, const float* xs, int64_t G, int64_t upg,
          float* y, int64_t nvalid, const NextItemPrefetch* pf) {
  const int64_t upb = xd.kb / 8;
  constexpr int64_t kUnit = 16 * B;  // bytes of a unit: 8 k x 16 rows
  const __m512i idx = quad_index();
  F16 tot[1][NP];
  // Whole groups (kChunk 0): each digit block's sum is exact, so acc adds one fp32 value per 512 k.
  for_groups<1, NP, 1, 0>(tot, qp, xs, G, upg, pf, [&](int64_t ub, int64_t ue, F16 (&acc)[1][NP][1]) AQ_INLINE_LAMBDA {
    for (int64_t u0 = ub; u0 < ue; u0 += upb) {
      __m512i s[NP][4];
      sfor<NP>([&](auto P_) { sfor<4>([&](auto I_) { s[AQ_CV(P_)][AQ_CV(I_)] = _mm512_setzero_si512(); }); });
      for (int64_t u = u0; u < u0 + upb; ++u) {
        sfor<NP>([&](auto P_) {
          constexpr int p = AQ_CV(P_);
          const uint8_t* unit = pan[p] + kUnit * u;
#if defined(__GNUC__)
          for (int64_t l = 0; l < kUnit; l += 64) __builtin_prefetch(unit + kUnit * kPrefetchUnits + l, 0, 3);
#endif
          __m512i even, odd;
          unit_quads<B>(unit, idx, even, odd);
          dot_digits<(QP::kBlock > 0)>(s[p], even, odd, xd, u);
        });
      }
      const int64_t b = u0 / upb;
      const __m512 fx = _mm512_set1_ps(xd.fx[b]), fx16 = _mm512_set1_ps(xd.fx[b] * 65536.f);
      const __m512i chi = _mm512_set1_epi32(xd.c_hi[b]), clo = _mm512_set1_epi32(xd.c_lo[b]);
      sfor<NP>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
        const __m512i hi = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s[p][3], 8), s[p][2]), chi);
        const __m512i lo = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s[p][1], 8), s[p][0]), clo);
        acc[0][p][0] = fadd(acc[0][p][0], halves_value(hi, lo, fx, fx16));
      });
    }
  });
  store_panels<NP>(tot[0], y, nvalid);
}

// f(P_, u, unit) for the two units u of k-quant sub-block g (16 k) in each of NP panels (kUnit bytes per unit),
// prefetching each panel kPrefetchUnits units ahead.
template <int NP, int64_t kUnit, class F>
AQ_INLINE void sub_block_units(const uint8_t* const* pan, int64_t g, F&& f) {
  for (int64_t u = 2 * g; u < 2 * g + 2; ++u)
    sfor<NP>([&](auto P_) {
      const uint8_t* unit = pan[AQ_CV(P_)] + kUnit * u;
#if defined(__GNUC__)
      __builtin_prefetch(unit + kUnit * kPrefetchUnits, 0, 3);
#endif
      f(P_, u, unit);
    });
}

// q2_k with its integer sub-scales folded into the codes' VNNI operand: sc * u <= 15 * 3 fits a byte, so one
// table lookup (vpermb, index u << 4 | sc) turns each code into its product with its sub-block's sub-scale, and a
// super-block's four digit sums run in int32 over all of its 256 k (|D_i| <= 256 * 45 * 128 < 2^21; the top
// digit's |D_3| <= 256 * 45 * 65, so 2^8 D_3 + D_2 < 2^28): one epilogue per super-block instead of one per
// sub-block of 16 k,
//     tot += d * fx * (2^16 (2^8 D3 + D2) + (2^8 D1 + D0))   (no code bias: the products are unsigned),
// after KqQp::offsets' -dmin * sum_j m_j * sum(x_j). Needs x's digits in blocks of the super-block (digit_block).
template <int NP>
void tile_q2k(const uint8_t* const* pan, const KqQp<2>& qp, const XDigits& xd, const float* xs, int64_t G, float* y,
              int64_t nvalid, const NextItemPrefetch* pf) {
  constexpr int64_t kUnit = 32, kSub = 16;  // bytes of a 2-bit unit; sub-blocks per super-block
  const int64_t lds = qp.lds;
  alignas(64) static constexpr auto kTables = [] {
    std::array<uint8_t, 2 * 64> a{};  // the product table, the sub-scale spread
    for (int b = 0; b < 64; ++b) {
      a[b] = static_cast<uint8_t>((b >> 4) * (b & 15));  // u * sc for index u << 4 | sc
      a[64 + b] = static_cast<uint8_t>(b / 4);            // lane j: row j's sub-scale byte, four times
    }
    return a;
  }();
  const __m512i sh_even = _mm512_load_si512(kTwoBitShifts<4>.data()),  // the fields at bits 4-5
                sh_odd = _mm512_load_si512(kTwoBitShifts<4>.data() + 64), prod = _mm512_load_si512(kTables.data()),
                spread = _mm512_load_si512(kTables.data() + 64), field = _mm512_set1_epi8(0x30);
  F16 tot[1][NP];
  sfor<NP>([&](auto P_) { tot[0][AQ_CV(P_)] = fzero(); });
  qp.template offsets<1, NP>(tot, xs, G);
  for (int64_t g0 = 0; g0 < G; g0 += kSub) {
    __m512i s[NP][4];
    sfor<NP>([&](auto P_) { sfor<4>([&](auto I_) { s[AQ_CV(P_)][AQ_CV(I_)] = _mm512_setzero_si512(); }); });
    if (pf) pf->groups(g0, g0 + kSub);
    for (int64_t g = g0; g < g0 + kSub; ++g) {
      __m512i sc[NP];  // lane j: row j's sub-scale byte (low nibble: sc; the vpermb below ignores bits 6-7)
      sfor<NP>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
        sc[p] = _mm512_permutexvar_epi8(spread, _mm512_castsi128_si512(_mm_loadu_si128(
                                                    reinterpret_cast<const __m128i*>(qp.sc + g * lds + 16 * p))));
      });
      sub_block_units<NP, kUnit>(pan, g, [&](auto P_, int64_t u, const uint8_t* unit) AQ_INLINE_LAMBDA {
        constexpr int p = AQ_CV(P_);
        const __m512i r = two_bit_rows(unit);
        // index u << 4 | sc per code (bits 4-5 from the field, the rest from the sub-scale byte), then u * sc
        const __m512i even = _mm512_permutexvar_epi8(
            _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(sh_even, r), sc[p], field, 0xE4), prod);
        const __m512i odd = _mm512_permutexvar_epi8(
            _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(sh_odd, r), sc[p], field, 0xE4), prod);
        dot_digits<true>(s[p], even, odd, xd, u);
      });
    }
    const int64_t b = g0 / kSub;  // the digit block: this super-block
    const __m512 fx = _mm512_set1_ps(xd.fx[b]), fx16 = _mm512_set1_ps(xd.fx[b] * 65536.f);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const __m512i hi = _mm512_add_epi32(_mm512_slli_epi32(s[p][3], 8), s[p][2]);
      const __m512i lo = _mm512_add_epi32(_mm512_slli_epi32(s[p][1], 8), s[p][0]);
      tot[0][p] = ffma(qp.sup(g0, p, 0), halves_value(hi, lo, fx, fx16), tot[0][p]);
    });
  }
  store_panels<NP>(tot[0], y, nvalid);
}

// q3_k: its signed integer sub-scales applied in int32, per sub-block of 16 k: the sub-block's centred digit sums
// (2^8 D3 + D2 - c_hi, 2^8 D1 + D0 - c_lo with the sub-block's own biases, x_digits' sub_biases) times sc, summed
// over the super-block (|.| <= (2^8 * 16 * 4 * 65 + 16 * 4 * 128) * 32 * 16 < 2^28), then one fp32 epilogue per
// super-block, tot += d * fx * (2^16 hi + lo): the weight d sc (u - 4) exactly, as the generic tile's bias.
template <int NP>
void tile_q3k(const uint8_t* const* pan, const KqQp<3>& qp, const XDigits& xd, int64_t G, float* y, int64_t nvalid,
              const NextItemPrefetch* pf) {
  constexpr int64_t kUnit = 48, kSub = 16;  // bytes of a 3-bit unit; sub-blocks per super-block
  const int64_t lds = qp.lds;
  const __m512i idx = quad_index();
  F16 tot[NP];
  sfor<NP>([&](auto P_) { tot[AQ_CV(P_)] = fzero(); });
  for (int64_t g0 = 0; g0 < G; g0 += kSub) {
    __m512i ahi[NP], alo[NP];
    sfor<NP>([&](auto P_) { ahi[AQ_CV(P_)] = alo[AQ_CV(P_)] = _mm512_setzero_si512(); });
    if (pf) pf->groups(g0, g0 + kSub);
    for (int64_t g = g0; g < g0 + kSub; ++g) {
      __m512i s[NP][4];
      sfor<NP>([&](auto P_) { sfor<4>([&](auto I_) { s[AQ_CV(P_)][AQ_CV(I_)] = _mm512_setzero_si512(); }); });
      sub_block_units<NP, kUnit>(pan, g, [&](auto P_, int64_t u, const uint8_t* unit) AQ_INLINE_LAMBDA {
        __m512i even, odd;
        unit_quads<3>(unit, idx, even, odd);
        dot_digits<true>(s[AQ_CV(P_)], even, odd, xd, u);
      });
      const __m512i chi = _mm512_set1_epi32(xd.c_sub_hi[g]), clo = _mm512_set1_epi32(xd.c_sub_lo[g]);
      sfor<NP>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
        const __m512i sc =
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp.sc + g * lds + 16 * p)));
        const __m512i hi = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s[p][3], 8), s[p][2]), chi);
        const __m512i lo = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s[p][1], 8), s[p][0]), clo);
        ahi[p] = _mm512_add_epi32(ahi[p], _mm512_mullo_epi32(hi, sc));
        alo[p] = _mm512_add_epi32(alo[p], _mm512_mullo_epi32(lo, sc));
      });
    }
    const int64_t b = g0 / kSub;  // the digit block: this super-block
    const __m512 fx = _mm512_set1_ps(xd.fx[b]), fx16 = _mm512_set1_ps(xd.fx[b] * 65536.f);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      tot[p] = ffma(qp.sup(g0, p, 0), halves_value(ahi[p], alo[p], fx, fx16), tot[p]);
    });
  }
  store_panels<NP>(tot, y, nvalid);
}

}  // namespace

template <int B, class QP>
void gemv_digits(const uint8_t* const* pan, int64_t cnt, const QP& qp, const XDigits& xd, const float* xs, int64_t G,
                 int64_t gs, float* y, int64_t nvalid, const NextItemPrefetch* pf) {
  // 4 panels per tile (16 int32 sums in registers), the leftover panels one by one
  const int64_t step = cnt % 4 == 0 ? 4 : 1;
  for (int64_t q = 0; q < cnt; q += step) {
    if constexpr (std::is_same_v<QP, KqQp<2>>) {
      const auto run = step == 4 ? &tile_q2k<4> : &tile_q2k<1>;
      run(pan + q, qp.shifted(q), xd, xs, G, y + 16 * q, nvalid - 16 * q, q == 0 ? pf : nullptr);
    } else if constexpr (std::is_same_v<QP, KqQp<3>>) {
      const auto run = step == 4 ? &tile_q3k<4> : &tile_q3k<1>;
      run(pan + q, qp.shifted(q), xd, G, y + 16 * q, nvalid - 16 * q, q == 0 ? pf : nullptr);
    } else {
      const auto run = step == 4 ? &tile<B, 4, QP> : &tile<B, 1, QP>;
      run(pan + q, qp.shifted(q), xd, xs, G, gs / 8, y + 16 * q, nvalid - 16 * q, q == 0 ? pf : nullptr);
    }
  }
}

#define AQ_DIGITS(B, QP)                                                                                        \
  template void gemv_digits<B, QP>(const uint8_t* const*, int64_t, const QP&, const XDigits&, const float*,      \
                                   int64_t, int64_t, float*, int64_t, const NextItemPrefetch*);
#define AQ_DIGITS_WIDTH(B)              \
  AQ_DIGITS(B, TileQp<const float*>)    \
  AQ_DIGITS(B, TileQp<Tile16<false>>)   \
  AQ_DIGITS(B, TileQp<Tile16<true>>)
AQ_DIGITS_WIDTH(2)
AQ_DIGITS_WIDTH(3)
AQ_DIGITS_WIDTH(4)
AQ_DIGITS_WIDTH(5)
AQ_DIGITS_WIDTH(6)
AQ_DIGITS(2, KqQp<2>)
AQ_DIGITS(3, KqQp<3>)
AQ_DIGITS(4, KqQp<4>)
AQ_DIGITS(5, KqQp<5>)
AQ_DIGITS(6, KqQp<6>)
#undef AQ_DIGITS_WIDTH
#undef AQ_DIGITS
#else
bool x_digits(const float*, int64_t, int64_t, int, XDigits&, bool) { return false; }
#endif  // AQ_X_DIGITS

}  // namespace affineq::detail
