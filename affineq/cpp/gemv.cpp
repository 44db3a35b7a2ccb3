// Path 1: fused GEMV (up to the rows dispatch.cpp's path_for gives it; group_size % 8 == 0). Codes are decoded
// straight into fp32 registers, 16 output rows per vector, and multiplied (FMA) against broadcast x; scale and
// offset are applied once per group:
//     y[n] = sum_g scale[n, g] * dot(x_g, u[n, g]) + offset[n, g] * sum(x_g).
// Memory-bound at m = 1: the packed weights are streamed once, with software prefetch. 4-bit codes take bf16 dot
// products instead with bf16 x (gemv_b4bf16.h); so do the other widths but float8 from 3 rows of bf16 x
// (gemv_tile_bf16w). One row of fp32 x (and of bf16 x on large weights of some widths) takes integer dot products
// on its exact digits instead (gemv_digits.h, use_x_digits).
#include <cstring>
#include <iterator>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "decode.h"
#include "gemv_b4bf16.h"
#include "gemv_digits.h"
#include "gemv_groups.h"

namespace affineq::detail {
namespace {

// xs[m * ldxs + g] = sum(x[m, g * gs : (g + 1) * gs]) for the offset term (vectorized: M * K adds per call); T is
// float or bf16 bits (the same fp32 values as x widened: the same adds in the same order either way).
template <class T>
void group_sums(const T* x, int64_t ldx, int64_t M, int64_t G, int64_t gs, float* xs, int64_t ldxs) {
  const auto ld = [](const T* q, int n) {  // n <= 16 values as fp32
    if constexpr (std::is_same_v<T, float>) {
      return n == 16 ? fload(q) : fload_n(q, n);
    } else {
#if AQ_AVX512
      const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), q);
      return F16{bf16_widen(h)};
#else
      static_assert(std::is_same_v<T, float>, "bf16 group sums are built for AVX-512 only");
      return fzero();
#endif
    }
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const T* xr = x + m * ldx + g * gs;
      F16 acc0 = fzero(), acc1 = fzero();
      int64_t i = 0;
      for (; i + 32 <= gs; i += 32) {
        acc0 = fadd(acc0, ld(xr + i, 16));
        acc1 = fadd(acc1, ld(xr + i + 16, 16));
      }
      for (; i + 16 <= gs; i += 16) acc0 = fadd(acc0, ld(xr + i, 16));
      if (i < gs) acc1 = fadd(acc1, ld(xr + i, static_cast<int>(gs - i)));
      xs[m * ldxs + g] = fhsum(fadd(acc0, acc1));
    }
}

// Whether the fp32 GEMV's tiles of MR rows decode w = 2^B + u (decode_unit_biased, one vpermb per 16 codes;
// the bias leaves through the group sums or per unit, below): the multi-plane widths always, 4-bit codes at
// 1-2 rows, where the decoder's ops per weight bound the GEMV (from 3 rows each decode serves enough FMAs that
// it measured no faster). The biased sums run larger than the codes' own, and so do their rounding errors (still
// fp32 sums; see benchmarks/README.md, kernel design measurements).
template <int B>
constexpr bool gemv_biased(int64_t mr) { return biased_decode_ok<B>() && (multi_plane(B) || mr <= 2); }
// 4-bit codes take the bias off each accumulator chain per unit of 8 k (ub, unit_bias_sums) rather than per
// group: the biased partial sums would otherwise grow over the group to ~3x the unbiased decoder's, and their
// rounding errors with them; per unit they stay within the unbiased decoder's error bound (tests/
// test_gemv_fp32_x.py) for one add per chain and unit. gemv_bias: the bias left for the group sums.
template <int B>
constexpr bool gemv_unit_bias(int64_t mr) { return B == 4 && gemv_biased<B>(mr); }
template <int B>
constexpr float gemv_bias(int64_t mr) {
  return gemv_biased<B>(mr) && !gemv_unit_bias<B>(mr) ? static_cast<float>(1 << B) : 0.f;
}

// The fp32 GEMV's decoder for tiles of MR rows: biased (gemv_biased), else the codes themselves.
template <int B, int MR, class F>
AQ_INLINE void decode_unit_gemv(const uint8_t* p, F&& f) {
#if AQ_AVX512 && defined(__AVX512VBMI__)
  if constexpr (gemv_biased<B>(MR)) {
    decode_unit_biased<B>(p, f);
    return;
  }
#endif
  decode_unit<B>(p, f);
}

// Panels per tile (P) and split accumulators per panel (A) for MR rows of x: enough independent FMA
// chains to hide latency without spilling (32 zmm / 16 ymm registers).
#if AQ_AVX512
constexpr int kItemPanels = 4;
static_assert(kItemPanels <= kMaxItemPanels);
constexpr int gemv_P(int mr, int B) { return mr <= 2 ? 4 : multi_plane(B) ? 1 : 2; }  // multi-plane: spills
constexpr int gemv_A(int mr, int B) { return mr == 1 || (multi_plane(B) && mr <= 4) ? 2 : 1; }
#elif AQ_AVX2
constexpr int kItemPanels = 2;
// Multi-plane and float8 decoding hold more registers: one panel per tile is faster for them. A = 1 at m = 1
// was FMA-latency bound. Both tuned by measurement (see benchmarks/README.md, kernel design measurements).
constexpr int gemv_P(int mr, int B) { return mr == 1 && (B == 1 || B == 2 || B == 4 || B == 8) ? 2 : 1; }
constexpr int gemv_A(int mr, int) { return mr <= 2 ? 2 : 1; }
#else
constexpr int kItemPanels = 1;
constexpr int gemv_P(int, int) { return 1; }
constexpr int gemv_A(int, int) { return 1; }
#endif
// The accumulator chains of a one-panel tile (gemv_rows' leftover panels), and of every 4-bit tile of 1-2 rows
// (unit_bias_sums lays its sums out for them).
constexpr int gemv_unit_chains(int mr) { return mr == 1 ? 2 : 1; }
// Rows of x per pass over the weights (fp32 x reaches the GEMV up to m = 8 on every build: each pass decodes
// the weights again, so 4 rows per pass; the bf16-dot 4-bit tiles take 2, 3 from 5 rows (kB4MR3From: fewer
// passes over the weights at 8-16 rows), and 4 when m % 4 == 0 (one pass at 4 rows: cold weights no longer
// streamed twice; hot, 4 rows ran as fast in two passes of 2), the bf16-pair tiles
// kBf16wMR: 8 rows in one pass held more accumulators than registers and ran slower than two passes of 4).
// From 8 rows the 4-bit tiles and 8-bit codes' bf16-pair tiles take passes of kWideRows rows over one panel at a
// time first (one panel's accumulators for 8 rows fit the registers): half the passes over cold weights at 8-16 rows.
constexpr int kGemvMR = 4;
constexpr int kBf16wMR = 4;
constexpr int kB4MR3From = 5;
constexpr int kWideRows = 8;

// Whether a GEMV tile takes x's values as the FMA's / dot product's embedded broadcasts (ffma_bcst, dpbf16_bcst)
// rather than broadcast into registers, which GCC keeps for all of the tile's panels: one row of x, or k-quant
// qparams (their super-block sums take registers too). Measured faster there (up to 15% cold at one row); at 2 to
// 4 rows of per-group qparams either way within a few percent (benchmarks/README.md, kernel design measurements).
template <int MR, class QP>
constexpr bool x_from_memory() { return MR == 1 || QP::kBlock > 0; }

template <int B, int MR, int P, int A, class QP>
void gemv_tile(const uint8_t* const* pan, const QP& qp, const float* x, int64_t ldx, const float* xs, int64_t G,
               int64_t upg, float* y, int64_t ldy, int64_t nvalid, const NextItemPrefetch* pf, const float* ub,
               int64_t ldub) {
  F16 tot[MR][P];
  for_groups<MR, P, A>(tot, qp, xs, G, upg, pf, [&](int64_t u0, int64_t u1, F16 (&acc)[MR][P][A]) AQ_INLINE_LAMBDA {
    for (int64_t u = u0; u < u1; ++u) {
      const float* xk = x + 8 * u;
      if constexpr (gemv_unit_bias<B>(MR)) {  // chain a: -2^B * sum of the unit's x[k] with k % A == a
        sfor<MR>([&](auto M_) {
          sfor<A>([&](auto A_) {
            constexpr int m = AQ_CV(M_), a = AQ_CV(A_);
            const F16 b = fset1(ub[m * ldub + A * u + a]);
            sfor<P>([&](auto P_) { acc[m][AQ_CV(P_)][a] = fadd(acc[m][AQ_CV(P_)][a], b); });
          });
        });
      }
      sfor<P>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
#if defined(__GNUC__)
        for (int l = 0; l < 16 * bits_of(B); l += 64)
          __builtin_prefetch(pan[p] + (u + kPrefetchUnits) * (16 * bits_of(B)) + l, 0, 3);
#endif
        decode_unit_gemv<B, MR>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
          constexpr int t = AQ_CV(T);
          sfor<MR>([&](auto M_) {
            constexpr int m = AQ_CV(M_);
            if constexpr (x_from_memory<MR, QP>()) acc[m][p][t % A] = ffma_bcst(xk + m * ldx + t, w, acc[m][p][t % A]);
            else acc[m][p][t % A] = ffma(fset1(xk[m * ldx + t]), w, acc[m][p][t % A]);
          });
        });
      });
    }
  });
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<P>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t w = nvalid - 16 * p;
      if (w >= 16) fstore(y + m * ldy + 16 * p, tot[m][p]);
      else if (w > 0) fstore_n(y + m * ldy + 16 * p, tot[m][p], static_cast<int>(w));
    });
  });
}

// The multi-plane widths at 5..8 rows of x (biased decoder): each unit decoded once into an L1 buffer of fp32
// weights that every row reads. In registers the decoder's constants and 8 rows' accumulators spilled; as two
// passes of 4 rows each unit was decoded twice.
template <int B>
constexpr bool gemv_buffered(int64_t mr) {
  return multi_plane(B) && biased_decode_ok<B>() && mr > kGemvMR && mr <= 2 * kGemvMR;
}

template <int B, int MR, class QP>
void gemv_tile_buffered(const uint8_t* pan, const QP& qp, const float* x, int64_t ldx, const float* xs, int64_t G,
                        int64_t upg, float* y, int64_t ldy, int64_t nvalid, const NextItemPrefetch* pf) {
  alignas(64) float buf[8 * 16];
  F16 tot[MR][1];
  for_groups<MR, 1, 1>(tot, qp, xs, G, upg, pf, [&](int64_t u0, int64_t u1, F16 (&acc)[MR][1][1]) AQ_INLINE_LAMBDA {
    for (int64_t u = u0; u < u1; ++u) {
#if defined(__GNUC__)
      for (int l = 0; l < 16 * bits_of(B); l += 64)
        __builtin_prefetch(pan + (u + kPrefetchUnits) * (16 * bits_of(B)) + l, 0, 3);
#endif
      decode_unit_gemv<B, MR>(pan + u * (16 * bits_of(B)), [&](auto T, F16 w) { fstore(buf + 16 * AQ_CV(T), w); });
      const float* wb = buf;
      AQ_OPAQUE(wb);  // read back from L1 (see decode_unit_i)
      const float* xk = x + 8 * u;
      sfor<8>([&](auto T) {
        constexpr int t = AQ_CV(T);
        const F16 w = fload(wb + 16 * t);
        sfor<MR>([&](auto M_) {
          constexpr int m = AQ_CV(M_);
          acc[m][0][0] = ffma(fset1(xk[m * ldx + t]), w, acc[m][0][0]);
        });
      });
    }
  });
  const int64_t w = std::min<int64_t>(nvalid, 16);
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    if (w >= 16) fstore(y + m * ldy, tot[m][0]);
    else if (w > 0) fstore_n(y + m * ldy, tot[m][0], static_cast<int>(w));
  });
}

#if AQ_BF16DOT
// Any width with bf16 x, up to kBf16wMR rows per pass (gemv_tile_bf16w): each unit decoded once into fp32
// vectors as the fp32 GEMV decodes it, each pair of them (k = 2s, 2s + 1) rounded to one vector of bf16 pairs,
// lane j = (w[j, 2s], w[j, 2s + 1]) -- exact: every decoded value (codes, 2^B + u, float8 / fp6 / fp4 values)
// has at most 8 significant bits -- and multiplied with x's pair (x[2s], x[2s + 1]) by vdpbf16ps: one dot
// product per 32 weights and row where the fp32 GEMV issues two FMAs, so more rows share each decode.
template <int B, int MR, int P, int A, class QP>
void gemv_tile_bf16w(const uint8_t* const* pan, const QP& qp, const uint16_t* x, int64_t ldx, const float* xs,
                     int64_t G, int64_t upg, float* y, uint16_t* yb, bool y_round, int64_t ldy, int64_t nvalid,
                     const NextItemPrefetch* pf) {
  alignas(64) uint16_t t[32];
  for (int j = 0; j < 16; ++j) t[2 * j] = static_cast<uint16_t>(j), t[2 * j + 1] = static_cast<uint16_t>(16 + j);
  const __m512i pairs = _mm512_load_si512(t);  // [k even rows 0-15 | k odd rows 0-15] -> (even, odd) per row
  F16 tot[MR][P];
  for_groups<MR, P, A>(tot, qp, xs, G, upg, pf, [&](int64_t u0, int64_t u1, F16 (&acc)[MR][P][A]) AQ_INLINE_LAMBDA {
    for (int64_t u = u0; u < u1; ++u) {
      sfor<P>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
        for (int l = 0; l < 16 * bits_of(B); l += 64)
          __builtin_prefetch(pan[p] + (u + kPrefetchUnits) * (16 * bits_of(B)) + l, 0, 3);
        F16 even;
        decode_unit_gemv<B, MR>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
          constexpr int k = AQ_CV(T);
          if constexpr (k % 2 == 0) {
            even = w;
          } else {
            const __m512bh wp = reinterpret_cast<__m512bh>(
                _mm512_permutexvar_epi16(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w.v, even.v))));
            sfor<MR>([&](auto M_) {
              constexpr int m = AQ_CV(M_);
              const uint16_t* xq = x + m * ldx + 8 * u + k - 1;  // x's bf16 pair (k - 1, k) of row m
              if constexpr (x_from_memory<MR, QP>()) {
                acc[m][p][k / 2 % A].v = dpbf16_bcst(acc[m][p][k / 2 % A].v, wp, xq);
              } else {
                uint32_t xp;
                std::memcpy(&xp, xq, sizeof xp);
                acc[m][p][k / 2 % A].v = _mm512_dpbf16_ps(
                    acc[m][p][k / 2 % A].v, wp, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp))));
              }
            });
          }
        });
      });
    }
  });
  store_rows<MR, P>(tot, y, yb, y_round, ldy, nvalid);
}

// gemv_tile_bf16w over an item's cnt panels for mr (1 .. kBf16wMR) rows of x.
template <int B, class QP>
void gemv_rows_bf16w(const uint8_t* const* pan, int64_t cnt, const QP& qp, const uint16_t* x, int64_t ldx, int64_t mr,
                     const float* xs, int64_t G, int64_t upg, float* y, uint16_t* yb, bool y_round, int64_t ldy,
                     int64_t nvalid, const NextItemPrefetch* pf) {
  static_assert(kBf16wMR == 4 && kWideRows == 8, "gemv_rows_bf16w instantiates 1 to 4 and 8 rows");
  const auto rows = [&](auto MR_) {
    constexpr int MR = AQ_CV(MR_), P = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;  // accumulators and totals: 3 * MR * P zmm
    const int64_t step = cnt % P == 0 ? P : 1;
    for (int64_t q = 0; q < cnt; q += step) {
      const auto tile = step == P ? &gemv_tile_bf16w<B, MR, P, 2, QP> : &gemv_tile_bf16w<B, MR, 1, 2, QP>;
      tile(pan + q, qp.shifted(q), x, ldx, xs, G, upg, y ? y + 16 * q : nullptr, yb ? yb + 16 * q : nullptr, y_round,
           ldy, nvalid - 16 * q, q == 0 ? pf : nullptr);
    }
  };
  switch (mr) {
    case 1: rows(std::integral_constant<int, 1>{}); break;
    case 2: rows(std::integral_constant<int, 2>{}); break;
    case 3: rows(std::integral_constant<int, 3>{}); break;
    case 4: rows(std::integral_constant<int, 4>{}); break;
    default:  // kWideRows: 8-bit codes only (gemv_path's wide passes)
      if constexpr (B == 8) rows(std::integral_constant<int, kWideRows>{});
      break;
  }
}
#endif

// Whether the 4-bit bf16-dot GEMV serves p (all of its passes: at most 2 rows each): 4-bit integer codes, bf16 x,
// but one row on the digits (faster where they run: benchmarks/README.md).
bool use_b4bf16(const LowbitProblem& p) {
  return kB4Bf16 && p.bits == 4 && p.codes == kCodesUint && p.x_bf16 != nullptr && !use_x_digits(p);
}

// Whether the bf16-pair GEMV (gemv_tile_bf16w) serves p: bf16 x of kBf16wMinRows rows or more, any width the 4-bit
// bf16-dot GEMV does not take but float8. At 1-2 rows the fp32 GEMV issues as few operations per weight (the
// pair's rounding and interleave cost what its second FMA saves); float8's decoder (fp16 bits, then a
// conversion) dominates either way, and measured a few percent slower through the pairs.
#if AQ_BF16DOT
constexpr bool kBf16w = true;
#else
constexpr bool kBf16w = false;
#endif
constexpr int64_t kBf16wMinRows = 3;
bool use_bf16w(const LowbitProblem& p) {
  return kBf16w && !use_b4bf16(p) && p.codes != kCodesE4M3 && p.codes != kCodesE5M2 && p.x_bf16 != nullptr &&
         p.m >= kBf16wMinRows;
}

// ub [M][2U] for gemv_unit_bias: row m, unit u, chain a < A = gemv_unit_chains(mr) at ub[m][A u + a] =
// -2^B * sum of x[m][8u + t] over t < 8 with t % A == a, for the rows whose pass of mr rows takes the unit bias.
template <int B>
void unit_bias_sums(const float* x, int64_t ldx, int64_t M, int64_t k, int64_t U, int64_t mstep, float* ub) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t mr = std::min(mstep, M - m / mstep * mstep), A = gemv_unit_chains(static_cast<int>(mr));
    if (!gemv_unit_bias<B>(mr)) continue;
    for (int64_t u = 0; u < U; ++u)
      for (int64_t a = 0; a < A; ++a) {
        float sum = 0.f;
        for (int64_t t = a; t < 8 && 8 * u + t < k; t += A) sum += x[m * ldx + 8 * u + t];
        ub[m * 2 * U + A * u + a] = -static_cast<float>(1 << B) * sum;
      }
  }
}

template <int B, int MR, class QP>
void gemv_rows(const Ctx& c, const uint8_t* const* pan, int64_t cnt, const QP& qp, const float* x, const float* xs,
               float* y, int64_t nvalid, const NextItemPrefetch* pf, const float* ub) {
  constexpr int P = gemv_P(MR, B), A = gemv_A(MR, B);
  static_assert(!gemv_unit_bias<B>(MR) || A == gemv_unit_chains(MR), "unit_bias_sums' chains");
  const LowbitProblem& pr = *c.p;
  const int64_t upg = pr.group_size / 8, ldub = 2 * c.U;
  if constexpr (gemv_buffered<B>(MR)) {
    for (int64_t q = 0; q < cnt; ++q)
      gemv_tile_buffered<B, MR>(pan[q], qp.shifted(q), x, pr.ldx, xs, c.G, upg, y + 16 * q, pr.ldy, nvalid - 16 * q,
                                q == 0 ? pf : nullptr);
  } else if (cnt % P == 0) {
    for (int64_t q = 0; q < cnt; q += P)
      gemv_tile<B, MR, P, A>(pan + q, qp.shifted(q), x, pr.ldx, xs, c.G, upg, y + 16 * q, pr.ldy, nvalid - 16 * q,
                             q == 0 ? pf : nullptr, ub, ldub);
  } else {
    for (int64_t q = 0; q < cnt; ++q)
      gemv_tile<B, MR, 1, gemv_unit_chains(MR)>(pan + q, qp.shifted(q), x, pr.ldx, xs, c.G, upg, y + 16 * q, pr.ldy,
                                                nvalid - 16 * q, q == 0 ? pf : nullptr, ub, ldub);
  }
}

// A per-item buffer of the k-quant GEMV: d and -dmin per super-block (load_kq_qparams).
thread_local Scratch tl_kq_super;

}  // namespace

template <int B>
void gemv_path(const Ctx* cs, int64_t count) {
  // The problems share x, M, k and the weight configuration (dispatch.cpp's lowbit_linear_multi_f32): one set of
  // group sums, one pool of work items over all of their panels.
  const LowbitProblem& p0 = *cs[0].p;
  const int64_t G = cs[0].G, M = cs[0].M;
  [[maybe_unused]] const int64_t K8 = cs[0].K8;
  // Per-group sums of x for the offset term, xs [M][2][G]: the sums, then the multiple add_group needs.
  std::vector<float> xs(static_cast<size_t>(2 * M * G));
  // The 4-bit bf16-dot GEMV and the bf16-pair GEMV read x as bf16 only (x_bf16), and y may be bf16 (y_bf16)
  const bool b4 = B == 4 && use_b4bf16(p0);
  const bool bw = use_bf16w(p0);
  // One row of x against 2- to 6-bit integer codes: x as integer digits through VNNI (gemv_digits.h)
  XDigits xd;
  const bool digits = digits_width(B) && !b4 && use_x_digits(p0) &&
                      x_digits(p0.x, K8, digit_block(p0), B, xd, p0.qparams_kquant == 3);
#if AQ_AVX512
  if (b4 || bw) group_sums(p0.x_bf16, p0.ldx, M, G, p0.group_size, xs.data(), 2 * G);
  else
#endif
    group_sums(p0.x, p0.ldx, M, G, p0.group_size, xs.data(), 2 * G);
  // Rows of x per pass over the weights: passes of mr = min(mstep, M - m0) rows from m0 = 0, mstep, ...; the
  // bf16-dot 4-bit tiles and the bf16-pair tiles of 8-bit codes first take passes of kWideRows rows over the first
  // M / kWideRows * kWideRows rows (wide), then the rest in passes of mstep.
  const auto b4_rows = [](int64_t m) -> int64_t { return m % 4 == 0 ? 4 : m >= kB4MR3From ? 3 : 2; };
  const int64_t wide = b4 || (bw && B == 8) ? M / kWideRows * kWideRows : 0;
  const int64_t mstep = b4 ? b4_rows(M - wide) : bw ? kBf16wMR : gemv_buffered<B>(M) ? M : kGemvMR;
  // The bf16-dot GEMV sees 16 + u for the codes u, the biased decoder 2^B + u (gemv_biased, by the rows of row
  // m's pass): the bias leaves through xs_a.
  // (the digits' tiles sum (u - 2^(B-1)) x: a bias of -2^(B-1))
  const auto bias = [&](int64_t m) {
    return b4 ? 16.f : digits ? -static_cast<float>(1 << (bits_of(B) - 1))
                              : gemv_bias<B>(std::min(mstep, M - m / mstep * mstep));
  };
  // Without an offset array, offset = f * scale for one f (lowbit_kernels.h: scale * code_offset), so the whole
  // offset term rides on xs_a and no offset tile is loaded. So do the signed k-quants' offsets (q3_k: -4 * scale,
  // q6_k: -32 * scale; kquant_decode.h).
  const bool kq = p0.qparams_kquant != 0;  // the k-quant qparams, formed per use (KqQp)
  const bool kq_signed = p0.qparams_kquant == 3 || p0.qparams_kquant == 6;
  const bool scale_only = (p0.offset == nullptr && !p0.qparams_kquant && code_scale(B) == 1.f) || kq_signed;
  const float f0 = kq_signed ? (p0.qparams_kquant == 3 ? -4.f : -32.f) : static_cast<float>(p0.code_offset);
  // The bf16-dot GEMV, the digits GEMV and the FMA GEMV of 4- and 8-bit codes at 1-2 rows (where load_qparams'
  // fp32 tiles took ~10% of the call), read 16-bit qparams as stored (transposed 16-bit words, widened per group):
  // half of load_qparams' work per item. A bf16 offset array holds the zero z of W = scale * (u - 2^(bits-1)) + z, so
  // its -2^(bits-1) * scale rides on xs_a too.
  constexpr bool kFma16 = B == 4 || B == 8;
  const bool fma16 = (kFma16 || digits) && !b4 && !bw && !kq && M <= 2;
  const bool q16 = (b4 || fma16) && scales16_tiles(p0, G);
  const float fz = q16 && p0.offset != nullptr && p0.qparams_bf16 ? -static_cast<float>(1 << (p0.bits - 1)) : 0.f;
  const float f = scale_only ? f0 : fz;
  std::vector<uint32_t> xp;  // x's bf16 pairs as the bf16-dot GEMV multiplies them
#if AQ_BF16DOT && defined(__AVX512VBMI__)
  if (b4) {
    xp.resize(static_cast<size_t>(4 * M * cs[0].U));
    xpairs(p0.x_bf16, p0.ldx, M, cs[0].U, xp.data());
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    const float fm = f - bias(m);
    for (int64_t g = 0; g < G; ++g) xs[2 * G * m + G + g] = fm * xs[2 * G * m + g];
  }
  std::vector<float> ub;  // the unit bias sums (gemv_unit_bias), for the FMA GEMV's passes that take them
  if (!b4 && !bw && !digits && gemv_unit_bias<B>(1)) {
    ub.resize(static_cast<size_t>(2 * M * cs[0].U));
    unit_bias_sums<B>(p0.x, p0.ldx, M, p0.k, cs[0].U, mstep, ub.data());
  }
  // Work items of each problem: blocks of kItemPanels full panels, then single leftover panels (incl. the tail
  // panel); numbered problem after problem.
  std::vector<int64_t> first_item(static_cast<size_t>(count + 1), 0);
  for (int64_t w = 0; w < count; ++w) {
    const int64_t nblk = cs[w].nfull / kItemPanels;
    first_item[w + 1] = first_item[w] + nblk + (cs[w].npan - nblk * kItemPanels);
  }
  struct Item {
    const Ctx* c;
    int64_t p0, cnt, r0, rows;  // first panel, panels, first row, rows
  };
  const auto item = [&](int64_t it) {
    int64_t w = 0;
    while (it >= first_item[w + 1]) ++w;
    const Ctx& c = cs[w];
    const int64_t i = it - first_item[w], nblk = c.nfull / kItemPanels;
    const int64_t p = i < nblk ? i * kItemPanels : nblk * kItemPanels + (i - nblk);
    const int64_t cnt = i < nblk ? kItemPanels : 1, r0 = 16 * p;
    return Item{&c, p, cnt, r0, std::min<int64_t>(16 * cnt, c.N - r0)};
  };
  const int64_t macs = 16 * kItemPanels * cs[0].K8 * M;
  parallel_dynamic(first_item[count], grain_for(macs), [&](int64_t it, int64_t next) {
    const Item ci = item(it);
    const Ctx& c = *ci.c;
    const LowbitProblem& pr = *c.p;
    const int64_t cnt = ci.cnt, r0 = ci.r0, rows = ci.rows;
    const uint8_t* pan[kItemPanels];
    for (int64_t q = 0; q < cnt; ++q) pan[q] = panel_ptr(c, ci.p0 + q);
    const int64_t lds = 16 * cnt;
    uint16_t *sT16 = nullptr, *oT16 = nullptr;  // the 16-bit tiles (q16)
    float *sT = nullptr, *oT = nullptr;         // the fp32 tiles; no offset tile: see add_group
    uint8_t *scT = nullptr, *mnT = nullptr;     // the k-quant byte tiles (kq), with d / -dmin in kdT
    float* kdT = nullptr;
    if (kq) {
      scT = tl_scale.get<uint8_t>(G * lds);
      mnT = tl_offset.get<uint8_t>(G * lds);
      kdT = tl_kq_super.get<float>(pr.k / kSuperBlock * kq_supers(pr.qparams_kquant) * lds);
      load_kq_qparams(pr, r0, rows, lds, G, scT, mnT, kdT, lds);
    } else
#if AQ_AVX512
    if (q16) {
      sT16 = tl_scale.get<uint16_t>(G * lds);
      load_scales16(pr, false, r0, rows, lds, G, sT16, lds);
      if (!scale_only) {
        oT16 = tl_offset.get<uint16_t>(G * lds);
        load_scales16(pr, true, r0, rows, lds, G, oT16, lds);
      }
    } else
#endif
    {
      sT = tl_scale.get<float>(G * lds);
      load_qparams(pr, false, code_scale(B), r0, rows, lds, G, sT, lds);
      if (!scale_only) {
        oT = tl_offset.get<float>(G * lds);
        load_qparams(pr, true, 1.f, r0, rows, lds, G, oT, lds);
      }
    }
    // f(qp) with the item's qparams as add_group reads them: k-quant bytes, or fp32 tiles (the bf16-dot GEMV also
    // 16-bit ones: with_qp16).
    const auto with_qp = [&](auto&& f) {
      if constexpr (B >= 2 && B <= 6) {
        if (kq) return f(KqQp<B>{scT, mnT, kdT, lds});
      }
      f(TileQp<const float*>{sT, oT, lds});
    };
    std::optional<NextItemPrefetch> pf;
    if (next >= 0) {
      const Item ni = item(next);
      const uint8_t* npan[kItemPanels];
      int64_t nq = 0;  // its full panels (panel_ptr would copy the tail panel now)
      for (; nq < ni.cnt && ni.p0 + nq < ni.c->nfull; ++nq) npan[nq] = ni.c->p->packed + (ni.p0 + nq) * ni.c->panel_bytes;
      pf.emplace(*ni.c->p, ni.r0, ni.rows, G, npan, nq, 16 * bits_of(B));
    }
    for (int64_t m0 = 0, mr; m0 < M; m0 += mr) {
      mr = m0 < wide ? kWideRows : std::min<int64_t>(mstep, M - m0);
      const float* xsm = xs.data() + 2 * G * m0;
      const NextItemPrefetch* pfm = m0 == 0 && pf ? &*pf : nullptr;
#if AQ_BF16DOT && defined(__AVX512VBMI__)
      if constexpr (B == 4) if (b4) {  // (its tiles are compiled for that width only)
        static const B4Bf16 k4;
        const uint32_t* xw = xp.data() + m0 * 4 * c.U;
        float* y = pr.y_bf16 ? nullptr : pr.y + m0 * pr.ldy + r0;
        uint16_t* yb = pr.y_bf16 ? pr.y_bf16 + m0 * pr.ldy + r0 : nullptr;
        const int64_t upg = pr.group_size / 8, ldx2 = 4 * c.U;
        // Three or four rows hold 2 panels' accumulators without spilling, kWideRows rows one's.
        const int step = mr == kWideRows ? 1 : mr >= 3 ? (cnt % 2 == 0 ? 2 : 1) : cnt % 4 == 0 ? 4 : 1;
        const auto run = [&](const auto& qp) {
          using QP = std::decay_t<decltype(qp)>;
          for (int64_t q = 0; q < cnt; q += step) {
            const auto tile =
                mr == 1   ? (step == 4 ? &gemv_tile_b4bf16<1, 4, QP> : &gemv_tile_b4bf16<1, 1, QP>)
                : mr == 3 ? (step == 2 ? &gemv_tile_b4bf16<3, 2, QP> : &gemv_tile_b4bf16<3, 1, QP>)
                : mr == 4 ? (step == 2 ? &gemv_tile_b4bf16<4, 2, QP> : &gemv_tile_b4bf16<4, 1, QP>)
                : mr == kWideRows ? &gemv_tile_b4bf16<kWideRows, 1, QP>
                          : (step == 4 ? &gemv_tile_b4bf16<2, 4, QP> : &gemv_tile_b4bf16<2, 1, QP>);
            tile(k4, pan + q, qp.shifted(q), xw, ldx2, xsm, G, upg, y ? y + 16 * q : nullptr,
                 yb ? yb + 16 * q : nullptr, pr.y_bf16_values, pr.ldy, rows - 16 * q, q == 0 ? pfm : nullptr);
          }
        };
        if (!q16) with_qp(run);
        else if (pr.qparams_bf16) run(TileQp<Tile16<false>>{{sT16}, {oT16}, lds});
        else run(TileQp<Tile16<true>>{{sT16}, {oT16}, lds});
        continue;
      }
#endif
#if AQ_BF16DOT
      if (bw) {
        float* y = pr.y_bf16 ? nullptr : pr.y + m0 * pr.ldy + r0;
        uint16_t* yb = pr.y_bf16 ? pr.y_bf16 + m0 * pr.ldy + r0 : nullptr;
        with_qp([&](const auto& qp) {
          gemv_rows_bf16w<B>(pan, cnt, qp, pr.x_bf16 + m0 * pr.ldx, pr.ldx, mr, xsm, G, pr.group_size / 8, y, yb,
                             pr.y_bf16_values, pr.ldy, rows, pfm);
        });
        continue;
      }
#endif
      const float* x = pr.x + m0 * pr.ldx;
      float* y = pr.y + m0 * pr.ldy + r0;
      const float* ubm = ub.empty() ? nullptr : ub.data() + m0 * 2 * c.U;
#if AQ_X_DIGITS
      if constexpr (digits_width(B)) if (digits) {
        const auto run = [&](const auto& qp) { gemv_digits<B>(pan, cnt, qp, xd, xsm, G, pr.group_size, y, rows, pfm); };
        if constexpr (B <= 6) {
          if (kq) {
            run(KqQp<B>{scT, mnT, kdT, lds});
            continue;
          }
        }
        if (!q16) run(TileQp<const float*>{sT, oT, lds});
        else if (pr.qparams_bf16) run(TileQp<Tile16<false>>{{sT16}, {oT16}, lds});
        else run(TileQp<Tile16<true>>{{sT16}, {oT16}, lds});
        continue;
      }
#endif
#if AQ_AVX512
      if constexpr (kFma16) if (q16) {  // 1-2 rows (fma16)
        const auto rows16 = [&](const auto& qp) {
          if (mr == 1) gemv_rows<B, 1>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
          else gemv_rows<B, 2>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
        };
        if (pr.qparams_bf16) rows16(TileQp<Tile16<false>>{{sT16}, {oT16}, lds});
        else rows16(TileQp<Tile16<true>>{{sT16}, {oT16}, lds});
        continue;
      }
#endif
      with_qp([&](const auto& qp) {
        if (mr == 1) gemv_rows<B, 1>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
        else if (mr == 2) gemv_rows<B, 2>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
        else if (mr == 3) gemv_rows<B, 3>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
        else if (mr == 4) gemv_rows<B, 4>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
        else if constexpr (gemv_buffered<B>(2 * kGemvMR)) {
          if (mr == 5) gemv_rows<B, 5>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
          else if (mr == 6) gemv_rows<B, 6>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
          else if (mr == 7) gemv_rows<B, 7>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
          else gemv_rows<B, 8>(c, pan, cnt, qp, x, xsm, y, rows, pfm, ubm);
        }
      });
    }
  });
}

// The instantiations dispatch.cpp calls (declared in common.h). _build.py compiles this file once per width
// (-DAQ_PART=i of AQ_PARTS, its _PARTS table), each object instantiating gemv_path for the i-th width alone, so
// the cores share what would be the build's longest compile; without AQ_PART one object instantiates them all.
#ifdef AQ_PART
#define AQ_WIDTH_ITEM(B) B,
constexpr int kWidths[] = {AQ_FOR_EACH_WIDTH(AQ_WIDTH_ITEM)};
#undef AQ_WIDTH_ITEM
static_assert(AQ_PARTS == std::size(kWidths), "_build.py's _PARTS['gemv.cpp'] must be the number of widths");
template void gemv_path<kWidths[AQ_PART]>(const Ctx* cs, int64_t count);
#else
#define AQ_INSTANTIATE(B) template void gemv_path<B>(const Ctx* cs, int64_t count);
AQ_FOR_EACH_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE
#endif

#if !defined(AQ_PART) || AQ_PART == 0
bool gemv_reads_bf16_only(const LowbitProblem& p) { return use_b4bf16(p) || use_bf16w(p); }
#endif

}  // namespace affineq::detail
