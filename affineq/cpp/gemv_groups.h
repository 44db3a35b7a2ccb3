// The fp32 GEMVs' per-group accumulation (gemv.cpp, gemv_digits.cpp): the qparams of a work item as the tiles
// read them (TileQp: fp32 or 16-bit transposed tiles; KqQp: k-quant sub-scale bytes), add_group (one group's dot
// products times its scale, plus the offset term) and for_groups (the loop over a tile's groups). Templates and
// always-inlined functions only.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "simd.h"

namespace affineq::detail {

// A scale or offset tile as add_group reads it: fp32 (load_qparams), or the 16-bit qparams as stored
// (load_scales16: bf16, or fp16 with kF16), widened per use; a null pointer: no tile.
template <bool kF16>
struct Tile16 {
  const uint16_t* p;
  Tile16 operator+(int64_t i) const { return {p + i}; }
};
AQ_INLINE F16 load_scales(const float* p) { return fload(p); }
AQ_INLINE bool has_tile(const float* p) { return p != nullptr; }
template <bool kF16>
AQ_INLINE bool has_tile(Tile16<kF16> t) { return t.p != nullptr; }
#if AQ_AVX512
template <bool kF16>
AQ_INLINE F16 load_scales(Tile16<kF16> t) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.p));
  if constexpr (kF16) return {_mm512_cvtph_ps(h)};
  else return {bf16_widen(h)};
}
#endif

// The qparams of a tile of output rows as for_groups reads them; shifted(q): the same tile from panel q on.
// Transposed tiles [G][lds] (fp32 from load_qparams, or the 16-bit qparams as stored from load_scales16): group
// g's scale and offset of rows 16p .. 16p + 15, applied per group (add_group).
template <class T>
struct TileQp {
  static constexpr int64_t kBlock = 0;  // no super-blocks
  T s, o;
  int64_t lds;
  TileQp shifted(int64_t q) const { return {s + 16 * q, has_tile(o) ? o + 16 * q : o, lds}; }
  AQ_INLINE bool has_offset() const { return has_tile(o); }
  AQ_INLINE F16 scale(int64_t g, int p) const { return load_scales(s + (g * lds + 16 * p)); }
  AQ_INLINE F16 offset(int64_t g, int p) const { return load_scales(o + (g * lds + 16 * p)); }
};

// tot[m][p] += scale[g] * (sum_a acc[m][p][a] + xs_a) + offset[g] * xs_s: one group's contribution to 16 output
// rows per vector (xs [MR][2][G]: xs_s = sum(x[m] over group g), then xs_a, a multiple of it). Without an offset
// term of its own (offset = f * scale with one f for every group) xs_a = f * xs_s carries the whole offset term;
// with one, xs_a = -bias * xs_s takes away a bias the decoder added to every code. Either way no per-item pass
// over the tiles for it. A chunk of a long group before its last (last false) adds scale[g] * sum_a acc alone.
template <int MR, int P, int A, class QP>
AQ_INLINE void add_group(F16 (&tot)[MR][P], const F16 (&acc)[MR][P][A], const QP& qp, const float* xs, int64_t G,
                         int64_t g, bool last = true) {
  sfor<P>([&](auto P_) AQ_INLINE_LAMBDA {
    constexpr int p = AQ_CV(P_);
    const F16 s = qp.scale(g, p);
    sfor<MR>([&](auto M_) AQ_INLINE_LAMBDA {
      constexpr int m = AQ_CV(M_);
      F16 a = acc[m][p][0];
      sfor<A - 1>([&](auto A_) AQ_INLINE_LAMBDA { a = fadd(a, acc[m][p][AQ_CV(A_) + 1]); });
      const float* xm = xs + 2 * G * m;
      tot[m][p] = ffma(s, fadd(a, fset1(last ? xm[G + g] : 0.f)), tot[m][p]);
      if (last && qp.has_offset()) tot[m][p] = ffma(qp.offset(g, p), fset1(xm[g]), tot[m][p]);
    });
  });
}

// k-quant qparams from load_kq_qparams' byte tiles (kquant_decode.h's formulas), applied per super-block of kBlock
// groups: the integer sub-scales per group, d once per super-block,
//     tot += d * sum_j sc_j * (acc_j + xs_a_j)   and   tot += -dmin * sum_j m_j * xs_j  (offsets(), ahead of the
// codes: they depend on x alone). q3_k / q6_k have no offsets of their own (-4 / -32 x the scale: on xs_a).
template <int KIND>
struct KqQp {
  static constexpr int64_t kBlock = kSuperBlock / kq_group(KIND), kNs = kq_supers(KIND);
  static constexpr bool kMins = KIND == 2 || KIND == 4 || KIND == 5;
  const uint8_t *sc, *mn;
  const float* d;  // [super-block][d, -dmin][lds]
  int64_t lds;
  KqQp shifted(int64_t q) const { return {sc + 16 * q, mn + 16 * q, d + 16 * q, lds}; }
  AQ_INLINE F16 sup(int64_t g, int p, int s) const { return fload(d + (g / kBlock * kNs + s) * lds + 16 * p); }
  AQ_INLINE F16 sub_scale(int64_t g, int p) const {
    const uint8_t* b = sc + g * lds + 16 * p;
    if constexpr (KIND == 3 || KIND == 6) return i2f(ld_s8x16(reinterpret_cast<const int8_t*>(b)));
    else if constexpr (KIND == 2) return i2f(iand(ld_u8x16(b), 15));
    else return i2f(ld_u8x16(b));
  }
  // tot[m][p] = -sum_b dmin_b * sum_j m_bj * xs[m][j] (tot is zero before).
  template <int MR, int P>
  AQ_INLINE void offsets(F16 (&tot)[MR][P], const float* xs, int64_t G) const {
    if constexpr (kMins) {
      sfor<P>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
        for (int64_t g0 = 0; g0 < G; g0 += kBlock) {
          F16 t[MR];
          sfor<MR>([&](auto M_) { t[AQ_CV(M_)] = fzero(); });
          for (int64_t g = g0; g < g0 + kBlock; ++g) {
            const uint8_t* b = (KIND == 2 ? sc : mn) + g * lds + 16 * p;
            const F16 m = i2f(KIND == 2 ? isrl<4>(ld_u8x16(b)) : ld_u8x16(b));
            sfor<MR>([&](auto M_) { t[AQ_CV(M_)] = ffma(m, fset1(xs[2 * G * AQ_CV(M_) + g]), t[AQ_CV(M_)]); });
          }
          const F16 ndmin = sup(g0, p, 1);
          sfor<MR>([&](auto M_) { tot[AQ_CV(M_)][p] = ffma(ndmin, t[AQ_CV(M_)], tot[AQ_CV(M_)][p]); });
        }
      });
    }
  }
  // tb[m][p] += sc_g * (sum_a acc[m][p][a] + xs_a): group g within its super-block.
  template <int MR, int P, int A>
  AQ_INLINE void add(F16 (&tb)[MR][P], const F16 (&acc)[MR][P][A], const float* xs, int64_t G, int64_t g) const {
    sfor<P>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const F16 s = sub_scale(g, p);
      sfor<MR>([&](auto M_) {
        constexpr int m = AQ_CV(M_);
        F16 a = acc[m][p][0];
        sfor<A - 1>([&](auto A_) { a = fadd(a, acc[m][p][AQ_CV(A_) + 1]); });
        tb[m][p] = ffma(s, fadd(a, fset1(xs[2 * G * m + G + g])), tb[m][p]);
      });
    });
  }
  // tot[m][p] += d * tb[m][p] for the super-block from group g0.
  template <int MR, int P>
  AQ_INLINE void finish(F16 (&tot)[MR][P], const F16 (&tb)[MR][P], int64_t g0) const {
    sfor<P>([&](auto P_) {
      const F16 dv = sup(g0, AQ_CV(P_), 0);
      sfor<MR>([&](auto M_) { tot[AQ_CV(M_)][AQ_CV(P_)] = ffma(dv, tb[AQ_CV(M_)][AQ_CV(P_)], tot[AQ_CV(M_)][AQ_CV(P_)]); });
    });
  }
};

// Units (8 k) per chunk of a long group. An accumulator lane sums one output row's products in sequence, so its
// rounding error grows with the number of products it holds; a group longer than kChunkUnits units (a
// per-channel weight: one group of k) is summed chunk by chunk, each chunk's sum added into tot times the group's
// scale (add_group, last false) before the next starts: blocked summation, as short groups get from add_group anyway.
constexpr int64_t kChunkUnits = 32;

// tot = the tile's result: body(u0, u1, acc) sums the dot products of units [u0, u1) of one group (upg units per
// group) into acc (zeroed for it), and qp's rule adds them up: per group (add_group; groups over kChunk units in
// chunks), or per super-block (KqQp). kChunk = 0: whole groups (a body whose sums are exact per block).
template <int MR, int P, int A, int64_t kChunk = kChunkUnits, class QP, class Body>
AQ_INLINE void for_groups(F16 (&tot)[MR][P], const QP& qp, const float* xs, int64_t G, int64_t upg,
                          const NextItemPrefetch* pf, Body&& body) {
  const auto zero = [](auto& arr) {
    sfor<MR>([&](auto M_) { sfor<P>([&](auto P_) { arr[AQ_CV(M_)][AQ_CV(P_)] = fzero(); }); });
  };
  const auto part = [&](int64_t u0, int64_t u1, auto&& fold) AQ_INLINE_LAMBDA {
    F16 acc[MR][P][A];
    sfor<MR>([&](auto M_) {
      sfor<P>([&](auto P_) { sfor<A>([&](auto A_) { acc[AQ_CV(M_)][AQ_CV(P_)][AQ_CV(A_)] = fzero(); }); });
    });
    body(u0, u1, acc);
    fold(acc);
  };
  zero(tot);
  if constexpr (QP::kBlock == 0) {
    // One loop over the chunks (cpg per group, upc units each but the last), as over whole groups: a nested loop
    // of chunks spilled the 4-row tiles' accumulators (AVX2).
    const int64_t cpg = kChunk > 0 && upg > kChunk ? (upg + kChunk - 1) / kChunk : 1, upc = (upg + cpg - 1) / cpg;
    for (int64_t g = 0, j = 0; g < G;) {
      if (j == 0 && pf) pf->group(g);
      const int64_t u0 = g * upg + j * upc, u1 = std::min(u0 + upc, (g + 1) * upg);
      const bool last = ++j == cpg;
      part(u0, u1, [&](const auto& acc) AQ_INLINE_LAMBDA { add_group<MR, P, A>(tot, acc, qp, xs, G, g, last); });
      if (last) j = 0, ++g;
    }
  } else {
    qp.offsets(tot, xs, G);
    for (int64_t g0 = 0; g0 < G; g0 += QP::kBlock) {
      F16 tb[MR][P];
      zero(tb);
      for (int64_t g = g0; g < g0 + QP::kBlock; ++g) {
        if (pf) pf->group(g);
        part(g * upg, (g + 1) * upg,
             [&](const auto& acc) AQ_INLINE_LAMBDA { qp.template add<MR, P, A>(tb, acc, xs, G, g); });
      }
      qp.finish(tot, tb, g0);
    }
  }
}

}  // namespace affineq::detail
