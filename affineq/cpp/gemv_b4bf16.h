// The 4-bit bf16-dot GEMV's tiles (gemv.cpp's gemv_path runs them): 4-bit codes against bf16 x by vdpbf16ps on
// the codes as bf16 16 + u (B4Bf16); store_rows writes a bf16 tile's results (the bf16-pair GEMV's too). Included
// by gemv.cpp alone.
#pragma once

#include <cstdint>

#include "common.h"
#include "gemv_groups.h"
#include "simd.h"

namespace affineq::detail {
namespace {

#if AQ_BF16DOT
// The first MR rows of a bf16 tile's results to y: fp32 (y_round: as their bf16 values), or bf16 into yb when set.
template <int MR, int P, int R>
AQ_INLINE void store_rows(const F16 (&tot)[R][P], float* y, uint16_t* yb, bool y_round, int64_t ldy, int64_t nvalid) {
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<P>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t w = nvalid - 16 * p;
      if (w <= 0) return;
      const __mmask16 keep = static_cast<__mmask16>(w >= 16 ? 0xFFFF : (1u << w) - 1);
      const __m512 t = tot[m][p].v;
      if (yb != nullptr) _mm256_mask_storeu_epi16(yb + m * ldy + 16 * p, keep, bf16_bits(t));
      else _mm512_mask_storeu_ps(y + m * ldy + 16 * p, keep, y_round ? bf16_widen(bf16_bits(t)) : t);
    });
  });
}
#endif

#if AQ_BF16DOT && defined(__AVX512VBMI__)
// 4-bit codes with bf16 x (m <= 2): bf16 dot products instead of int -> float conversions and fp32 FMAs. One
// vpermb gathers row j's four bytes of a unit (byte (s, j) holds the k-pair (2s, 2s + 1) of row j) into lane j, so
// lane j's low 16 bits hold row j's codes k = 0..3 and its high 16 bits k = 4..7, a nibble each. Vector n
// (n = 0..3) takes nibble n of each half into the top mantissa bits of a bf16 16.0: 16 + u exactly (n = 0 by a
// table lookup, n > 0 by a shift and one ternary-logic op), so with x's pair (x[n], x[n + 4]) (xpairs)
//     acc[j] += x[n] * (16 + u[j, n]) + x[n + 4] * (16 + u[j, n + 4])   (exact products, fp32 sums)
// and the bias leaves through the offset: y = scale * acc + (offset - 16 * scale) * sum(x_g).
struct B4Bf16 {
  __m512i idx, lut, hi, mask, bias;
  B4Bf16() {
    alignas(64) uint8_t t[64], l[64];
    for (int j = 0; j < 16; ++j)
      for (int s = 0; s < 4; ++s) t[4 * j + s] = static_cast<uint8_t>(16 * s + j);
    for (int i = 0; i < 64; ++i) l[i] = static_cast<uint8_t>(0x80 | (i & 15) << 3);  // bf16 low byte of 16 + u
    idx = _mm512_load_si512(t);
    lut = _mm512_load_si512(l);
    hi = _mm512_set1_epi16(0x4100);  // bf16 high byte of 16 + u
    mask = _mm512_set1_epi32(0x00780078);  // bits 3..6 of each half: the mantissa's top 4 bits
    bias = _mm512_set1_epi32(0x41804180);  // bf16 16.0 in each half
  }
  // Row j's bytes of a 64-byte unit in lane j.
  AQ_INLINE __m512i rows(__m512i unit) const { return _mm512_permutexvar_epi8(idx, unit); }
  // The bf16 pairs (u[j, n], u[j, n + 4]) of rows(unit) = r.
  template <int N>
  AQ_INLINE __m512i pairs(__m512i r) const {
    if constexpr (N == 0) {
      return _mm512_mask_permutexvar_epi8(hi, 0x5555555555555555ull, r, lut);  // the even bytes' low nibbles
    } else {
      return _mm512_ternarylogic_epi32(_mm512_srli_epi32(r, 4 * N - 3), mask, bias, 0xEA);  // (a & b) | c
    }
  }
};

// xp[m][4u + n] = the bf16 pair (x[m, 8u + n], x[m, 8u + n + 4]) that B4Bf16's vector n of unit u multiplies, for
// U units of each of M rows of x (row stride ldx).
void xpairs(const uint16_t* x, int64_t ldx, int64_t M, int64_t U, uint32_t* xp) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = static_cast<uint16_t>(i / 8 * 8 + i % 8 / 2 + 4 * (i % 2));
  const __m512i idx = _mm512_load_si512(t);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t e = 0; e < 8 * U; e += 32) {
      const int64_t n = std::min<int64_t>(32, 8 * U - e);
      const __mmask32 k = n == 32 ? ~0u : (1u << n) - 1;
      const __m512i v = _mm512_maskz_loadu_epi16(k, x + m * ldx + e);
      _mm512_mask_storeu_epi16(xp + m * 4 * U + e / 2, k, _mm512_permutexvar_epi16(idx, v));
    }
}

template <int MR, int P, class QP>
void gemv_tile_b4bf16(const B4Bf16& k4, const uint8_t* const* pan, const QP& qp, const uint32_t* xw, int64_t ldx2,
                      const float* xs, int64_t G, int64_t upg, float* y, uint16_t* yb, bool y_round, int64_t ldy,
                      int64_t nvalid, const NextItemPrefetch* pf) {
  F16 tot[MR][P];
  for_groups<MR, P, 2>(tot, qp, xs, G, upg, pf, [&](int64_t u0, int64_t u1, F16 (&acc)[MR][P][2]) AQ_INLINE_LAMBDA {
    for (int64_t u = u0; u < u1; ++u) {
      sfor<P>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
        __builtin_prefetch(pan[p] + (u + kPrefetchUnits) * 64, 0, 3);
        const __m512i r = k4.rows(_mm512_loadu_si512(pan[p] + u * 64));
        sfor<4>([&](auto S) {
          constexpr int s = AQ_CV(S);
          const __m512bh w = reinterpret_cast<__m512bh>(k4.pairs<s>(r));
          sfor<MR>([&](auto M_) {
            constexpr int m = AQ_CV(M_);
            // x's pair (s, s + 4) of unit u (xpairs), broadcast by the instruction: GCC's register broadcasts,
            // one per pair kept for the tile's panels, spilled the accumulators at 4 rows and measured slower at
            // every row count (benchmarks/README.md, kernel design measurements)
            acc[m][p][s % 2].v = dpbf16_bcst(acc[m][p][s % 2].v, w, xw + m * ldx2 + 4 * u + s);
          });
        });
      });
    }
  });
  store_rows<MR, P>(tot, y, yb, y_round, ldy, nvalid);
}

constexpr bool kB4Bf16 = true;
#else
constexpr bool kB4Bf16 = false;
#endif

}  // namespace
}  // namespace affineq::detail
