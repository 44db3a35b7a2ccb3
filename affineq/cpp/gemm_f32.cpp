// Path 2: dequant + fp32 GEMM (any group_size; the large-m path where VNNI is missing). A [256 x 32] slice of
// W^T is dequantized into an L1-resident fp32 tile and a 12x32 (AVX-512) / 6x16 (AVX2) outer-product
// micro-kernel runs over all m rows, so each dequantized tile is reused m times.
#include <array>
#include <utility>
#include <vector>

#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

#if AQ_AVX512
constexpr int kNP = 2;    // panels per micro-tile: 32 output columns = 2 zmm
constexpr int kMR = 12;   // x rows per micro-tile: 24 accumulators + 2 weight vectors + broadcast
#elif AQ_AVX2
constexpr int kNP = 1;
constexpr int kMR = 6;
#else
constexpr int kNP = 1;
constexpr int kMR = 4;
#endif

// buf[(k - 8 * u0) * (16 * NP) + 16 * p + j] = W[row j of panel p, k] for units [u0, u0 + nu).
template <int B, int NP>
void dequant(const uint8_t* const* pan, const float* sT, const float* oT, int64_t lds, const int32_t* kg,
             int64_t u0, int64_t nu, float* buf) {
  for (int64_t u = u0; u < u0 + nu; ++u) {
    float* bu = buf + (u - u0) * 8 * (16 * NP);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      if (pan[p] == nullptr) {
        for (int t = 0; t < 8; ++t) fstore(bu + t * (16 * NP) + 16 * p, fzero());
        return;
      }
      decode_unit<B>(pan[p] + u * (16 * bits_of(B)), [&](auto T, F16 w) {
        constexpr int t = AQ_CV(T);
        const int64_t g = kg[8 * u + t];
        fstore(bu + t * (16 * NP) + 16 * p, ffma(w, fload(sT + g * lds + 16 * p), fload(oT + g * lds + 16 * p)));
      });
    });
  }
}

// y[MR x 16*NP] (+)= x[MR x kc] @ w[kc x 16*NP]; only the first nvalid columns of y are touched.
template <int MR, int NP>
void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy, bool init,
                  int64_t nvalid) {
  F16 acc[MR][NP];
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = nvalid - 16 * p;
      if (init || cols <= 0) acc[m][p] = fzero();
      else if (cols >= 16) acc[m][p] = fload(y + m * ldy + 16 * p);
      else acc[m][p] = fload_n(y + m * ldy + 16 * p, static_cast<int>(cols));
    });
  });
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    F16 wv[NP];
    sfor<NP>([&](auto P_) { wv[AQ_CV(P_)] = fload(w + k * (16 * NP) + 16 * AQ_CV(P_)); });
    sfor<MR>([&](auto M_) {
      constexpr int m = AQ_CV(M_);
      const F16 xb = fset1(x[m * ldx + k]);
      sfor<NP>([&](auto P_) { acc[m][AQ_CV(P_)] = ffma(xb, wv[AQ_CV(P_)], acc[m][AQ_CV(P_)]); });
    });
  }
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<NP>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = nvalid - 16 * p;
      if (cols >= 16) fstore(y + m * ldy + 16 * p, acc[m][p]);
      else if (cols > 0) fstore_n(y + m * ldy + 16 * p, acc[m][p], static_cast<int>(cols));
    });
  });
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, int64_t);
template <int... Is>
constexpr std::array<MicroFn, sizeof...(Is)> micro_table(std::integer_sequence<int, Is...>) {
  return {&micro_kernel<Is + 1, kNP>...};
}
constexpr auto kMicro = micro_table(std::make_integer_sequence<int, kMR>{});

}  // namespace

template <int B>
void gemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K8 = c.K8;
  constexpr int64_t TW = 16 * kNP;  // columns per micro-tile
  const std::vector<int32_t> kg = group_of_k(pr, K8, G);
  const GemmSplit sp = split_gemm((c.npan + kNP - 1) / kNP, M, kMR);
  at::parallel_for(0, sp.items(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t0 = sp.tile0(it), nt = sp.tiles(it), mlo = sp.row0(it), mhi = sp.row1(it);
      const int64_t R = nt * TW, r0 = t0 * TW, rows = std::min(R, c.N - r0);
      float *sT, *oT;
      load_tile_qparams(pr, code_scale(B), r0, rows, R, G, sT, oT);
      std::vector<const uint8_t*> pan(static_cast<size_t>(nt * kNP));
      for (int64_t q = 0; q < nt * kNP; ++q) pan[q] = panel_ptr(c, t0 * kNP + q);
      float* wbuf = tl_wbuf.get<float>(nt * kKC * TW);
      const int64_t mcs = row_chunk(mhi - mlo, kMR);
      for (int64_t mc0 = mlo; mc0 < mhi; mc0 += mcs) {
        const int64_t mc = std::min(mcs, mhi - mc0);
        float* cbuf = tl_cbuf.get<float>(nt * mc * TW);
        for (int64_t k0 = 0; k0 < K8; k0 += kKC) {
          const int64_t kc = std::min(kKC, K8 - k0);
          for (int64_t t = 0; t < nt; ++t)
            dequant<B, kNP>(pan.data() + t * kNP, sT + t * TW, oT + t * TW, R, kg.data(), k0 / 8, kc / 8,
                            wbuf + t * kKC * TW);
          if (k0 + kc < K8)  // the next k-slice of all tiles arrives while this one computes
            prefetch_units(pan.data(), static_cast<int>(nt * kNP), (k0 + kc) / 8,
                           std::min(kKC, K8 - k0 - kc) / 8, bits_of(B));
          for (int64_t t = 0; t < nt; ++t) {  // tile-outer: the dequantized tile stays in L1
            if (t * TW >= rows) break;
            for (int64_t m0 = 0; m0 < mc; m0 += kMR) {
              const MicroFn fn = kMicro[std::min<int64_t>(kMR, mc - m0) - 1];
              fn(pr.x + (mc0 + m0) * pr.ldx + k0, pr.ldx, wbuf + t * kKC * TW, kc, cbuf + (t * mc + m0) * TW, TW,
                 k0 == 0, TW);
            }
          }
        }
        store_tiles_f32(cbuf, TW, mc, rows, pr.y + mc0 * pr.ldy + r0, pr.ldy,
                        pr.bias ? pr.bias + r0 : nullptr);
      }
    }
  });
}

// The instantiations dispatch.cpp calls (declared in common.h).
#define AQ_INSTANTIATE(B) template void gemm_path<B>(const Ctx& c);
AQ_FOR_EACH_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE

}  // namespace affineq::detail
