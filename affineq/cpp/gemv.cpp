// Path 1: fused GEMV (m <= 2 where path 3 or 4 applies, else m <= 8; group_size % 8 == 0). Codes are decoded
// straight into fp32 registers, 16 output rows per vector, and multiplied (FMA) against broadcast x; scale and
// offset are applied once per group:
//     y[n] = sum_g scale[n, g] * dot(x_g, u[n, g]) + offset[n, g] * sum(x_g).
// Memory-bound at m = 1: the packed weights are streamed once, with software prefetch.
#include <optional>
#include <utility>
#include <vector>

#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

// xs[m * G + g] = sum(x[m, g * gs : (g + 1) * gs]) for the offset term (vectorized: M * K adds per call).
void group_sums(const float* x, int64_t ldx, int64_t M, int64_t G, int64_t gs, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xr = x + m * ldx + g * gs;
      F16 acc0 = fzero(), acc1 = fzero();
      int64_t i = 0;
      for (; i + 32 <= gs; i += 32) {
        acc0 = fadd(acc0, fload(xr + i));
        acc1 = fadd(acc1, fload(xr + i + 16));
      }
      for (; i + 16 <= gs; i += 16) acc0 = fadd(acc0, fload(xr + i));
      if (i < gs) acc1 = fadd(acc1, fload_n(xr + i, static_cast<int>(gs - i)));
      xs[m * G + g] = fhsum(fadd(acc0, acc1));
    }
}

// Panels per tile (P) and split accumulators per panel (A) for MR rows of x: enough independent FMA
// chains to hide latency without spilling (32 zmm / 16 ymm registers).
#if AQ_AVX512
constexpr int kItemPanels = 4;
constexpr int gemv_P(int mr, int) { return mr <= 2 ? 4 : 2; }
constexpr int gemv_A(int mr) { return mr == 1 ? 2 : 1; }
#elif AQ_AVX2
constexpr int kItemPanels = 2;
// Multi-plane and float8 decoding hold more registers: one panel per tile is faster for them. A = 1 at m = 1
// was FMA-latency bound. Both tuned by measurement (see benchmarks/README.md, kernel design measurements).
constexpr int gemv_P(int mr, int B) { return mr == 1 && (B == 1 || B == 2 || B == 4 || B == 8) ? 2 : 1; }
constexpr int gemv_A(int mr) { return mr <= 2 ? 2 : 1; }
#else
constexpr int kItemPanels = 1;
constexpr int gemv_P(int, int) { return 1; }
constexpr int gemv_A(int) { return 1; }
#endif
// Rows of x per pass over the weights. With VNNI the GEMV only serves m <= 2 (path 3 wins from m = 3), so
// only those variants are compiled (shorter build).
#if AQ_VNNI
constexpr int kGemvMR = 2;
#else
constexpr int kGemvMR = 4;
#endif

// Software prefetch distance (units ahead on each panel stream): at m = 1 the kernel streams the weights from
// DRAM and the hardware prefetchers alone left part of the bandwidth unused. Tuned by measurement (see
// benchmarks/README.md, kernel design measurements).
constexpr int64_t kPrefetchUnits = 24;

// Prefetches the raw qparams of the next work item, a few cache lines per group of the current one. Without
// it load_qparams read them from DRAM through 16..32 strided streams, a large share of a small-group GEMV's
// time on AVX2 (see benchmarks/README.md, kernel design measurements).
struct QparamPrefetch {
  const char* src[2] = {nullptr, nullptr};  // scale and offset rows of the next item (contiguous)
  int64_t bytes = 0, lines_per_group = 0;
  QparamPrefetch(const LowbitProblem& p, int64_t r0, int64_t rows, int64_t G) {
    const int64_t row_bytes = qparam_row_bytes(p, G);
    src[0] = static_cast<const char*>(p.scale) + r0 * row_bytes;
    src[1] = p.offset != nullptr ? static_cast<const char*>(p.offset) + r0 * row_bytes : src[0];  // none
    bytes = rows * row_bytes;
    lines_per_group = ((bytes + 63) / 64 + G - 1) / G;
  }
  AQ_INLINE void group(int64_t g) const {
#if defined(__GNUC__)
    for (int64_t l = g * lines_per_group, e = std::min(l + lines_per_group, (bytes + 63) / 64); l < e; ++l) {
      __builtin_prefetch(src[0] + 64 * l, 0, 2);
      __builtin_prefetch(src[1] + 64 * l, 0, 2);
    }
#endif
  }
};

template <int B, int MR, int P, int A>
void gemv_tile(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds, const float* x,
               int64_t ldx, const float* xs, int64_t G, int64_t upg, float* y, int64_t ldy, int64_t nvalid,
               const QparamPrefetch* pf) {
  F16 tot[MR][P];
  sfor<MR>([&](auto M_) { sfor<P>([&](auto P_) { tot[AQ_CV(M_)][AQ_CV(P_)] = fzero(); }); });
  for (int64_t g = 0; g < G; ++g) {
    if (pf) pf->group(g);
    F16 acc[MR][P][A];
    sfor<MR>([&](auto M_) {
      sfor<P>([&](auto P_) { sfor<A>([&](auto A_) { acc[AQ_CV(M_)][AQ_CV(P_)][AQ_CV(A_)] = fzero(); }); });
    });
    for (int64_t u = g * upg, ue = u + upg; u < ue; ++u) {
      const float* xk = x + 8 * u;
      sfor<P>([&](auto P_) {
        constexpr int p = AQ_CV(P_);
#if defined(__GNUC__)
        for (int l = 0; l < 16 * bits_of(B); l += 64)
          __builtin_prefetch(pan[p] + (u + kPrefetchUnits) * (16 * bits_of(B)) + l, 0, 3);
#endif
        decode_unit<B>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
          constexpr int t = AQ_CV(T);
          sfor<MR>([&](auto M_) {
            constexpr int m = AQ_CV(M_);
            acc[m][p][t % A] = ffma(fset1(xk[m * ldx + t]), w, acc[m][p][t % A]);
          });
        });
      });
    }
    sfor<P>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const F16 s = fload(sT + g * lds + 16 * p), o = fload(oT + g * lds + 16 * p);
      sfor<MR>([&](auto M_) {
        constexpr int m = AQ_CV(M_);
        F16 a = acc[m][p][0];
        sfor<A - 1>([&](auto A_) { a = fadd(a, acc[m][p][AQ_CV(A_) + 1]); });
        tot[m][p] = ffma(o, fset1(xs[m * G + g]), ffma(s, a, tot[m][p]));
      });
    });
  }
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

template <int B, int MR>
void gemv_rows(const Ctx& c, const uint8_t* const* pan, int64_t cnt, const float* sT, const float* oT,
               const float* x, const float* xs, float* y, int64_t nvalid, const QparamPrefetch* pf) {
  constexpr int P = gemv_P(MR, B), A = gemv_A(MR);
  const LowbitProblem& pr = *c.p;
  const int64_t lds = 16 * cnt, upg = pr.group_size / 8;
  if (cnt % P == 0) {
    for (int64_t q = 0; q < cnt; q += P)
      gemv_tile<B, MR, P, A>(pan + q, sT + 16 * q, oT + 16 * q, lds, x, pr.ldx, xs, c.G, upg, y + 16 * q,
                             pr.ldy, nvalid - 16 * q, q == 0 ? pf : nullptr);
  } else {
    for (int64_t q = 0; q < cnt; ++q)
      gemv_tile<B, MR, 1, (MR == 1 ? 2 : 1)>(pan + q, sT + 16 * q, oT + 16 * q, lds, x, pr.ldx, xs, c.G, upg,
                                             y + 16 * q, pr.ldy, nvalid - 16 * q, q == 0 ? pf : nullptr);
  }
}

}  // namespace

template <int B>
void gemv_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M;
  // Per-group sums of x for the offset term.
  std::vector<float> xs(static_cast<size_t>(M * G));
  group_sums(pr.x, pr.ldx, M, G, pr.group_size, xs.data());
  // Work items: blocks of kItemPanels full panels, then single leftover panels (incl. the tail panel).
  const int64_t nblk = c.nfull / kItemPanels;
  const int64_t nitems = nblk + (c.npan - nblk * kItemPanels);
  const auto first_panel = [&](int64_t it) {
    return it < nblk ? it * kItemPanels : nblk * kItemPanels + (it - nblk);
  };
  const auto row_range = [&](int64_t it) {  // {first row, rows} of item it
    const int64_t r0 = 16 * first_panel(it);
    return std::pair<int64_t, int64_t>{r0, std::min<int64_t>(16 * (it < nblk ? kItemPanels : 1), c.N - r0)};
  };
  at::parallel_for(0, nitems, grain_for(16 * kItemPanels * c.K8 * M), [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t p0 = first_panel(it), cnt = it < nblk ? kItemPanels : 1;
      const auto [r0, rows] = row_range(it);
      const uint8_t* pan[kItemPanels];
      for (int64_t q = 0; q < cnt; ++q) pan[q] = panel_ptr(c, p0 + q);
      float* sT = tl_scale.get<float>(G * 16 * cnt);
      float* oT = tl_offset.get<float>(G * 16 * cnt);
      load_qparams(pr, false, code_scale(B), r0, rows, 16 * cnt, G, sT, 16 * cnt);
      load_qparams(pr, true, 1.f, r0, rows, 16 * cnt, G, oT, 16 * cnt);
      std::optional<QparamPrefetch> pf;
      if (it + 1 < i1) {
        const auto [nr0, nrows] = row_range(it + 1);
        pf.emplace(pr, nr0, nrows, G);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kGemvMR) {
        const float* x = pr.x + m0 * pr.ldx;
        const float* xsm = xs.data() + m0 * G;
        float* y = pr.y + m0 * pr.ldy + r0;
        const int64_t mr = std::min<int64_t>(kGemvMR, M - m0);
        const QparamPrefetch* pfm = m0 == 0 && pf ? &*pf : nullptr;
        if (mr == 1) gemv_rows<B, 1>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
        else if (mr == 2) gemv_rows<B, 2>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
        else if constexpr (kGemvMR == 4) {
          if (mr == 3) gemv_rows<B, 3>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
          else gemv_rows<B, 4>(c, pan, cnt, sT, oT, x, xsm, y, rows, pfm);
        }
      }
    }
  });
}

// The instantiations dispatch.cpp calls (declared in common.h).
#define AQ_INSTANTIATE(B) template void gemv_path<B>(const Ctx& c);
AQ_FOR_EACH_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE

}  // namespace affineq::detail
