// The bf16 weight tiles of the bf16 GEMM paths (gemm_bf16.cpp: AVX512-BF16 dot products; gemm_amx.cpp: AMX
// tiles): a [kc x 32] slice of W dequantized in fp32 and rounded to bf16 k-pairs, the layout both vdpbf16ps and
// an AMX B tile (16 k-pairs x 16 columns, 128-byte row stride) read; and the bf16 store of a row of y.
#pragma once

#include "simd.h"  // defines AQ_BF16DOT

#if AQ_BF16DOT
#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

// Unit u of the tile into bu (4 k-pairs x 32 columns): W = scale * c(u) + offset rounded to bf16. kOneGroup: the
// unit's 8 k share one group (the usual case), so its scale and offset are loaded once, not per k.
template <int B, bool kOneGroup>
AQ_INLINE void dequant_unit_bf16(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds,
                                 const int32_t* kg, int64_t u, uint32_t* bu, __m512i idx) {
  sfor<2>([&](auto P_) {
    constexpr int p = AQ_CV(P_);
    if (pan[p] == nullptr) {
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(bu + i * 32 + 16 * p, _mm512_setzero_si512());
      return;
    }
    const int64_t g0 = kg[8 * u];
    const __m512 s0 = _mm512_loadu_ps(sT + g0 * lds + 16 * p), o0 = _mm512_loadu_ps(oT + g0 * lds + 16 * p);
    __m512 even = _mm512_setzero_ps();
    decode_unit<B>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
      constexpr int t = AQ_CV(T);
      __m512 v;
      if constexpr (kOneGroup) {
        v = _mm512_fmadd_ps(w.v, s0, o0);
      } else {
        const int64_t g = kg[8 * u + t];
        v = _mm512_fmadd_ps(w.v, _mm512_loadu_ps(sT + g * lds + 16 * p), _mm512_loadu_ps(oT + g * lds + 16 * p));
      }
      if constexpr (t % 2 == 0) {
        even = v;
      } else {
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v, even));
        _mm512_storeu_si512(bu + (t / 2) * 32 + 16 * p, _mm512_permutexvar_epi16(idx, both));
      }
    });
  });
}

// wb[(kp - 4 * u0) * 32 + 16 * p + j] = bf16(W[row j of panel p, 2 kp]) | bf16(W[row j, 2 kp + 1]) << 16.
// `next` (two panels, or null): prefetched from unit next_u0 on, one unit's lines per unit decoded.
template <int B>
void dequant_bf16_pairs(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds, const int32_t* kg,
                        int64_t u0, int64_t nu, uint32_t* wb, const uint8_t* const* next = nullptr,
                        int64_t next_u0 = 0) {
  // vcvtne2ps2bf16 puts bf16(even k) in 16-bit lanes 0..15 and bf16(odd k) in 16..31; interleave them.
  alignas(64) static constexpr int16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  for (int64_t u = u0; u < u0 + nu; ++u) {
    uint32_t* bu = wb + (u - u0) * 4 * 32;
    if (next != nullptr)  // the same unit of the next two panels, one unit's lines at a time
      for (int p = 0; p < 2; ++p)
        if (next[p] != nullptr)
          for (int64_t off = 0; off < 16 * bits_of(B); off += 64)
            __builtin_prefetch(next[p] + (next_u0 + u - u0) * 16 * bits_of(B) + off, 0, 2);
    if (kg[8 * u] == kg[8 * u + 7]) dequant_unit_bf16<B, true>(pan, sT, oT, lds, kg, u, bu, idx);
    else dequant_unit_bf16<B, false>(pan, sT, oT, lds, kg, u, bu, idx);
  }
}

// A work item of the bf16 GEMMs: nt tiles of 32 columns from tile t0 (R = 32 nt columns, the first `rows` of them
// real), their transposed fp32 scale and offset times `mul` (sT / oT, row stride R; load_tile_qparams) and their
// 16-row panels.
struct ItemTiles {
  int64_t R, r0, rows;
  float *sT, *oT;
  const uint8_t* pan[2 * kNCB];
  ItemTiles(const Ctx& c, float mul, int64_t t0, int64_t nt) : R(32 * nt), r0(32 * t0), rows(std::min(R, c.N - r0)) {
    load_tile_qparams(*c.p, mul, r0, rows, R, c.G, sT, oT);
    for (int64_t q = 0; q < nt * 2; ++q) pan[q] = panel_ptr(c, t0 * 2 + q);
  }
};

// y[c] = bf16(cr[c]) for c < cols (<= 32): torch's float -> bf16 (nearest even; every NaN as 0x7FC0), stored as
// bf16 bits (yb) or widened back to fp32 (yf: the same values, LowbitProblem::y_bf16_values).
inline void store_row_bf16(const float* cr, int64_t cols, uint16_t* yb, float* yf) {
  const __mmask16 lo = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  const __mmask16 hi = static_cast<__mmask16>(cols <= 16 ? 0 : cols >= 32 ? 0xFFFF : (1u << (cols - 16)) - 1);
  for (int h = 0; h < 2; ++h) {
    const __m256i b = bf16_bits(_mm512_loadu_ps(cr + 16 * h));
    if (yb != nullptr) _mm256_mask_storeu_epi16(yb + 16 * h, h ? hi : lo, b);
    else _mm512_mask_storeu_ps(yf + 16 * h, h ? hi : lo, bf16_widen(b));
  }
}

}  // namespace
}  // namespace affineq::detail
#endif  // AQ_BF16DOT
