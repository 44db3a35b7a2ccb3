// Path 4: dequant to bf16 + bf16 dot GEMM (AVX512-BF16, bf16 x, m >= 3). Each [<= 288 x 32] tile of W is
// dequantized once per pass in fp32 (w = scale * c(u) + offset), rounded to bf16 and stored as k-pairs;
// vdpbf16ps multiplies the pairs of one tile, or two at a time in long passes, with bf16 x pairs (x as given) and
// accumulates in fp32. The result is that of dequantize-to-bf16 then a bf16 matmul with fp32 accumulation
// (F.linear on the dequantized bf16 weight), at
// the CPU's bf16 dot-product rate; no per-group rescaling in the inner loop, so small groups cost no more than
// large ones. Compiles to nothing without AVX512-BF16 (path_for then never picks path 4).
#include "simd.h"  // defines AQ_BF16DOT

#if AQ_BF16DOT
#include <array>
#include <utility>
#include <vector>

#include "bf16_tiles.h"
#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

constexpr int kBMR = 12;  // x rows per micro-tile: 24 fp32 accumulators + 2 weight vectors + a broadcast
// Rows of x per pass: each pass dequantizes the item's tiles again, so 512 rows take one pass (the accumulators,
// 8 tiles x 516 rows x 32 fp32 = 528 KiB, stay in L2).
constexpr int64_t kBMC = 516;
static_assert(kBMC % kBMR == 0, "row chunks must hold whole bf16 row blocks");
// Longest k-slice of a dequantized tile (288 x 32 bf16 = 18 KiB; two in L1); K is cut into equal slices (576 = 2 x 288,
// not 256 + 256 + 64: every slice reloads and stores the 24 accumulators, which a short slice does not amortise).
// Slicing never changes a sum: each accumulator continues in k order across slices.
constexpr int64_t kBKC = 288;
// Passes of at least this many rows multiply two tiles per micro-kernel call (bmicro_pair); shorter ones one tile
// at a time with 12-row blocks. Cold 4096 x 4096 weights, 2 threads: the pair kernel is 3% faster at 512 rows,
// even at 256, and 1-18% slower at 8-128 rows (benchmarks/README.md).
constexpr int64_t kBPairRows = 256;

#if defined(__GNUC__)
#define AQ_DPBF16(acc, a, b) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#else
#define AQ_DPBF16(acc, a, b) (acc) = _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
#endif
#define AQ_B_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
// c[MR x 32] (+)= x[MR x 2 kc2] @ w[2 kc2 x 32]; c is a dense accumulator tile with row stride 32. x is read in
// place: row i's k-pair kp is the 32-bit word x[i * ldx2 + kp] of the row-major bf16 x (no packed copy), addressed
// from four row pointers and one stride so the loop needs few registers.
template <int MR>
void bmicro(const uint32_t* x, int64_t ldx2, const uint32_t* w, int64_t kc2, float* c, bool init) {
  static_assert(MR >= 1 && MR <= kBMR, "bmicro handles up to kBMR rows");
#define AQ_DECL(i)                                                            \
  __m512 acc##i##0 = _mm512_setzero_ps(), acc##i##1 = _mm512_setzero_ps();    \
  if constexpr (MR > i) {                                                     \
    if (!init) {                                                              \
      acc##i##0 = _mm512_loadu_ps(c + (i) * 32);                              \
      acc##i##1 = _mm512_loadu_ps(c + (i) * 32 + 16);                         \
    }                                                                         \
  }
  AQ_B_ROWS(AQ_DECL)
#undef AQ_DECL
  const uint32_t* xr[4] = {x, x + 3 * ldx2, x + 6 * ldx2, x + 9 * ldx2};
#pragma GCC unroll 2
  for (int64_t kp = 0; kp < kc2; ++kp, w += 32) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 16);
#define AQ_STEP(i)                                                                                       \
  if constexpr (MR > i) {                                                                                \
    const __m512i xv = _mm512_set1_epi32(static_cast<int>(xr[(i) / 3][((i) % 3) * ldx2 + kp]));          \
    AQ_DPBF16(acc##i##0, xv, w0);                                                                        \
    AQ_DPBF16(acc##i##1, xv, w1);                                                                        \
  }
    AQ_B_ROWS(AQ_STEP)
#undef AQ_STEP
  }
#define AQ_STORE(i)                                \
  if constexpr (MR > i) {                          \
    _mm512_storeu_ps(c + (i) * 32, acc##i##0);      \
    _mm512_storeu_ps(c + (i) * 32 + 16, acc##i##1); \
  }
  AQ_B_ROWS(AQ_STORE)
#undef AQ_STORE
}
#undef AQ_B_ROWS

// The same for two tiles at once: c_a / c_b (+)= x[MR x 2 kc2] @ w_a / w_b, MR <= 6: 24 accumulators, 4 weight
// vectors and one broadcast of x per k-pair for 24 dot products (the 12-row tile above broadcasts twice as often).
#define AQ_P_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int MR>
void bmicro_pair(const uint32_t* x, int64_t ldx2, const uint32_t* wa, const uint32_t* wb, int64_t kc2, float* ca,
                 float* cb, bool init) {
  static_assert(MR >= 1 && MR <= 6, "bmicro_pair handles up to 6 rows");
#define AQ_DECL(i)                                                                                             \
  __m512 acc##i##0 = _mm512_setzero_ps(), acc##i##1 = _mm512_setzero_ps(), acc##i##2 = _mm512_setzero_ps(),    \
         acc##i##3 = _mm512_setzero_ps();                                                                      \
  if constexpr (MR > i) {                                                                                      \
    if (!init) {                                                                                               \
      acc##i##0 = _mm512_loadu_ps(ca + (i) * 32);                                                              \
      acc##i##1 = _mm512_loadu_ps(ca + (i) * 32 + 16);                                                         \
      acc##i##2 = _mm512_loadu_ps(cb + (i) * 32);                                                              \
      acc##i##3 = _mm512_loadu_ps(cb + (i) * 32 + 16);                                                         \
    }                                                                                                          \
  }
  AQ_P_ROWS(AQ_DECL)
#undef AQ_DECL
  const uint32_t* xr[2] = {x, x + 3 * ldx2};
#pragma GCC unroll 2
  for (int64_t kp = 0; kp < kc2; ++kp, wa += 32, wb += 32) {
    const __m512i a0 = _mm512_loadu_si512(wa), a1 = _mm512_loadu_si512(wa + 16);
    const __m512i b0 = _mm512_loadu_si512(wb), b1 = _mm512_loadu_si512(wb + 16);
#define AQ_STEP(i)                                                                              \
  if constexpr (MR > i) {                                                                       \
    const __m512i xv = _mm512_set1_epi32(static_cast<int>(xr[(i) / 3][((i) % 3) * ldx2 + kp])); \
    AQ_DPBF16(acc##i##0, xv, a0);                                                               \
    AQ_DPBF16(acc##i##1, xv, a1);                                                               \
    AQ_DPBF16(acc##i##2, xv, b0);                                                               \
    AQ_DPBF16(acc##i##3, xv, b1);                                                               \
  }
    AQ_P_ROWS(AQ_STEP)
#undef AQ_STEP
  }
#define AQ_STORE(i)                                \
  if constexpr (MR > i) {                          \
    _mm512_storeu_ps(ca + (i) * 32, acc##i##0);      \
    _mm512_storeu_ps(ca + (i) * 32 + 16, acc##i##1); \
    _mm512_storeu_ps(cb + (i) * 32, acc##i##2);      \
    _mm512_storeu_ps(cb + (i) * 32 + 16, acc##i##3); \
  }
  AQ_P_ROWS(AQ_STORE)
#undef AQ_STORE
}
#undef AQ_P_ROWS

using BPairFn = void (*)(const uint32_t*, int64_t, const uint32_t*, const uint32_t*, int64_t, float*, float*, bool);
constexpr BPairFn kBPair[6] = {&bmicro_pair<1>, &bmicro_pair<2>, &bmicro_pair<3>,
                               &bmicro_pair<4>, &bmicro_pair<5>, &bmicro_pair<6>};

using BMicroFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, bool);
template <int... Is>
constexpr std::array<BMicroFn, sizeof...(Is)> bmicro_table(std::integer_sequence<int, Is...>) {
  return {&bmicro<Is + 1>...};
}
constexpr auto kBMicro = bmicro_table(std::make_integer_sequence<int, kBMR>{});

}  // namespace

template <int B>
void bgemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K8 = c.K8;
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(pr.x_bf16);  // k-pairs of x (ldx and K8 are even)
  const int64_t ldx2 = pr.ldx / 2;
  const std::vector<int32_t> kg = group_of_k(pr, K8, G);
  constexpr int64_t TW = 32;
  const GemmSplit sp = split_gemm((c.npan + 1) / 2, M, kBMR);
  at::parallel_for(0, sp.items(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t0 = sp.tile0(it), nt = sp.tiles(it), mlo = sp.row0(it), mhi = sp.row1(it);
      const ItemTiles item(c, code_scale(B), t0, nt);
      const int64_t R = item.R, r0 = item.r0, rows = item.rows;
      const float *sT = item.sT, *oT = item.oT;
      const uint8_t* const* pan = item.pan;
      const int64_t slices = (K8 + kBKC - 1) / kBKC, kcs = ((K8 + slices - 1) / slices + 7) / 8 * 8;
      uint32_t* wb = tl_wbuf.get<uint32_t>(kcs * TW);  // two tiles
      uint32_t* wb2 = wb + kcs / 2 * TW;
      const int64_t mcs = row_chunk(mhi - mlo, kBMR, kBMC);
      for (int64_t mc0 = mlo; mc0 < mhi; mc0 += mcs) {
        const int64_t mc = std::min(mcs, mhi - mc0);
        float* cbuf = tl_cbuf.get<float>(nt * mc * TW);
        for (int64_t k0 = 0; k0 < K8; k0 += kcs) {
          const int64_t kc = std::min(kcs, K8 - k0);
          // tile-outer: the bf16 tiles of a step (one, or two in long passes; <= 36 KiB) stay in L1 for all rows
          for (int64_t t = 0; t < nt && t * TW < rows;) {
            const int64_t nd = mc >= kBPairRows && t + 1 < nt && (t + 1) * TW < rows ? 2 : 1;
            for (int64_t d = 0; d < nd; ++d)
              dequant_bf16_pairs<B>(pan + 2 * (t + d), sT + (t + d) * TW, oT + (t + d) * TW, R, kg.data(), k0 / 8,
                                    kc / 8, d == 0 ? wb : wb2);
            const int64_t tn = t + nd;  // the next step's tiles, or the next k-slice's first ones: prefetched
            if (tn < nt && tn * TW < rows)
              prefetch_units(pan + 2 * tn, static_cast<int>(std::min(2 * nd, 2 * (nt - tn))), k0 / 8, kc / 8, c.B);
            else if (k0 + kc < K8)
              prefetch_units(pan, static_cast<int>(2 * nd), (k0 + kc) / 8, std::min(kcs, K8 - k0 - kc) / 8, c.B);
            float* ct = cbuf + t * mc * TW;  // the accumulators of tile t (of tile t + 1: mc rows further)
            if (nd == 2) {
              for (int64_t m0 = mc0; m0 < mc0 + mc; m0 += 6)
                kBPair[std::min<int64_t>(6, mc0 + mc - m0) - 1](xw + m0 * ldx2 + k0 / 2, ldx2, wb, wb2, kc / 2,
                                                                 ct + (m0 - mc0) * TW, ct + (mc + m0 - mc0) * TW,
                                                                 k0 == 0);
            } else {
              for (int64_t m0 = mc0; m0 < mc0 + mc; m0 += kBMR)
                kBMicro[std::min<int64_t>(kBMR, mc0 + mc - m0) - 1](xw + m0 * ldx2 + k0 / 2, ldx2, wb, kc / 2,
                                                                     ct + (m0 - mc0) * TW, k0 == 0);
            }
            t = tn;
          }
        }
        const int64_t y0 = mc0 * pr.ldy + r0;
        if (pr.y_bf16 == nullptr && !pr.y_bf16_values) {
          store_tiles_f32(cbuf, TW, mc, rows, pr.y + y0, pr.ldy, pr.bias ? pr.bias + r0 : nullptr);
        } else {
          store_tiles_by_row(cbuf, TW, mc, rows, [&](const float* cm, int64_t m, int64_t c0, int64_t n) {
            const int64_t yo = y0 + m * pr.ldy + c0;
            store_row_bf16(cm, n, pr.y_bf16 ? pr.y_bf16 + yo : nullptr, pr.y_bf16 ? nullptr : pr.y + yo);
          });
        }
      }
    }
  });
}

// The instantiations dispatch.cpp calls (declared in common.h).
#define AQ_INSTANTIATE(B) template void bgemm_path<B>(const Ctx& c);
AQ_FOR_EACH_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE

}  // namespace affineq::detail
#endif  // AQ_BF16DOT
