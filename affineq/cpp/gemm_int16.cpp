// Path 3: dequant + int16 GEMM (AVX512-VNNI, m >= 3, only if the caller allows rounding x: by default for
// fp16 x, and bf16 x without AVX512-BF16). vpdpwssd multiplies int16 pairs and accumulates exactly in int32 at
// the issue rate of an fp32 FMA, i.e. twice the MACs (the same rate as the bf16 dot products oneDNN uses).
// Codes are exact int16. x is quantized per (row, block of qb <= 256 columns inside one group) to 16-bit
// fixed point, x ~= sx * xq with |xq| <= 32767: an absolute error <= 2^-16 * max|x_block| per element
// (for comparison, bf16 F.linear rounds every x and W element to 2^-9 relative).
//   per block: y[m, n] += scale[n, g] * sx[m, b] * float(sum_k u[n, k] * xq[m, k])   (int32, exact)
//   per group: y[m, n] += offset[n, g] * sum(x[m, group g])                           (fp32, from x)
// Compiles to nothing without AVX512-VNNI (path_for then never picks path 3).
#include "simd.h"  // defines AQ_VNNI

#if AQ_VNNI
#include <array>
#include <utility>

#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

thread_local Scratch tl_xrow, tl_sxcall, tl_xscall;  // quantize_x16's row buffer; per-call sx and x sums

static_assert(kMC % 6 == 0, "row chunks must hold whole VNNI row blocks");
constexpr int kQMR = 6;         // x rows per micro-tile: 12 fp32 + 12 int32 accumulators + 2 weight vectors
constexpr int64_t kQKC = 256;   // k per dequantized tile (rounded to a multiple of the block)

// ibuf[(kp - 4 * u0) * 32 + 16 * p + j] = u[row j of panel p, 2 kp] | u[row j, 2 kp + 1] << 16
template <int B>
void dequant_pairs(const uint8_t* const* pan, int64_t u0, int64_t nu, int32_t* ibuf) {
  for (int64_t u = u0; u < u0 + nu; ++u) {
    int32_t* bu = ibuf + (u - u0) * 4 * 32;
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      if (pan[p] == nullptr) {
        for (int i = 0; i < 4; ++i) _mm512_storeu_si512(bu + i * 32 + 16 * p, _mm512_setzero_si512());
        return;
      }
      if constexpr (B == 4) {
        // Slot s holds k = 2s (low nibble) and 2s + 1 (high nibble): one shift and one ternary-logic op
        // ((v | v << 12) & 0x000F000F) turn the zero-extended bytes into the int16 pairs.
        const uint8_t* src = pan[p] + u * 64;
        const __m512i mask = _mm512_set1_epi32(0x000F000F);
        for (int s4 = 0; s4 < 4; ++s4) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * s4)));
          _mm512_storeu_si512(bu + s4 * 32 + 16 * p,
                              _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), mask, 0xA8));
        }
        return;
      }
      I16 lo{};
      decode_unit_i<bits_of(B)>(pan[p] + u * (16 * bits_of(B)), [&](auto T, I16 v) {
        constexpr int t = AQ_CV(T);
        if constexpr (is_fpx(B)) v.v = icode<B>(v.v);  // signed: the pair is blended, not or-ed
        if constexpr (t % 2 == 0) {
          lo = v;
        } else if constexpr (is_fpx(B)) {
          _mm512_storeu_si512(bu + (t / 2) * 32 + 16 * p,
                              _mm512_mask_blend_epi16(0xAAAAAAAA, lo.v, _mm512_slli_epi32(v.v, 16)));
        } else {
          _mm512_storeu_si512(bu + (t / 2) * 32 + 16 * p, _mm512_or_si512(lo.v, _mm512_slli_epi32(v.v, 16)));
        }
      });
    });
  }
}

struct QArgs {
  const int32_t* xp;                // quantized x pairs of this row block, [k / 2][kQMR], offset to k0
  const float* sx; int64_t nb;      // [rows][nb] block scales (row-offset only)
  const float* xs; int64_t G;       // [rows][G] group sums of x (row-offset only)
  const int32_t* w;                 // code pairs of this micro-tile, [kc / 2][32]
  int64_t kc, k0, qb, gs;
  const float* sT; const float* oT; int64_t lds;  // transposed scale/offset, offset to the tile's columns
  float* y; int64_t ldy; bool init; int64_t nvalid;
};

// Accumulators are named variables updated through a "+v" asm operand: with arrays and/or the intrinsic,
// GCC 12 bounces every vpdpwssd accumulator through an extra register move (or the stack).
#if defined(__GNUC__)
#define AQ_DPWSSD(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#else
#define AQ_DPWSSD(acc, a, b) (acc) = _mm512_dpwssd_epi32((acc), (a), (b))
#endif
#define AQ_Q_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int MR>
void qmicro(const QArgs& a) {
  static_assert(MR >= 1 && MR <= 6, "qmicro handles up to 6 rows");
  __m512 C[MR][2];
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = a.nvalid - 16 * p;
      if (a.init || cols <= 0) C[m][p] = _mm512_setzero_ps();
      else if (cols >= 16) C[m][p] = _mm512_loadu_ps(a.y + m * a.ldy + 16 * p);
      else C[m][p] = fload_n(a.y + m * a.ldy + 16 * p, static_cast<int>(cols)).v;
    });
  });
  for (int64_t b0 = 0; b0 < a.kc; b0 += a.qb) {
#define AQ_DECL(i) __m512i acc##i##0 = _mm512_setzero_si512(), acc##i##1 = _mm512_setzero_si512();
    AQ_Q_ROWS(AQ_DECL)
#undef AQ_DECL
    const int32_t* wb = a.w + (b0 / 2) * 32;
    const int32_t* xb = a.xp + (b0 / 2) * kQMR;
#pragma GCC unroll 2
    for (int64_t kp = 0; kp < a.qb / 2; ++kp, wb += 32, xb += kQMR) {
      const __m512i w0 = _mm512_loadu_si512(wb), w1 = _mm512_loadu_si512(wb + 16);
#define AQ_STEP(i)                                                           \
  if constexpr (MR > i) {                                                    \
    const __m512i xv = _mm512_set1_epi32(xb[i]);                             \
    AQ_DPWSSD(acc##i##0, w0, xv);                                            \
    AQ_DPWSSD(acc##i##1, w1, xv);                                            \
  }
      AQ_Q_ROWS(AQ_STEP)
#undef AQ_STEP
    }
    const int64_t kabs = a.k0 + b0, g = kabs / a.gs, bi = kabs / a.qb;
    const __m512 s0 = _mm512_loadu_ps(a.sT + g * a.lds), s1 = _mm512_loadu_ps(a.sT + g * a.lds + 16);
    const bool group_end = (kabs + a.qb) % a.gs == 0;
    const __m512 o0 = _mm512_loadu_ps(a.oT + g * a.lds), o1 = _mm512_loadu_ps(a.oT + g * a.lds + 16);
#define AQ_FLUSH(i)                                                                           \
  if constexpr (MR > i) {                                                                     \
    const __m512 f = _mm512_set1_ps(a.sx[i * a.nb + bi]);                                     \
    C[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc##i##0), _mm512_mul_ps(s0, f), C[i][0]);  \
    C[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc##i##1), _mm512_mul_ps(s1, f), C[i][1]);  \
    if (group_end) {                                                                          \
      const __m512 xsv = _mm512_set1_ps(a.xs[i * a.G + g]);                                   \
      C[i][0] = _mm512_fmadd_ps(o0, xsv, C[i][0]);                                            \
      C[i][1] = _mm512_fmadd_ps(o1, xsv, C[i][1]);                                            \
    }                                                                                         \
  }
    AQ_Q_ROWS(AQ_FLUSH)
#undef AQ_FLUSH
  }
  sfor<MR>([&](auto M_) {
    constexpr int m = AQ_CV(M_);
    sfor<2>([&](auto P_) {
      constexpr int p = AQ_CV(P_);
      const int64_t cols = a.nvalid - 16 * p;
      if (cols >= 16) _mm512_storeu_ps(a.y + m * a.ldy + 16 * p, C[m][p]);
      else if (cols > 0) fstore_n(a.y + m * a.ldy + 16 * p, F16{C[m][p]}, static_cast<int>(cols));
    });
  });
}
#undef AQ_Q_ROWS

using QMicroFn = void (*)(const QArgs&);
template <int... Is>
constexpr std::array<QMicroFn, sizeof...(Is)> qmicro_table(std::integer_sequence<int, Is...>) {
  return {&qmicro<Is + 1>...};
}
constexpr auto kQMicro = qmicro_table(std::make_integer_sequence<int, kQMR>{});

// x [m, k] fp32 -> int16 (round to nearest) with one scale sx[m, b] per block of qb columns, stored as int32
// pairs interleaved by row blocks so the micro-kernel reads one sequential stream (padding rows are zero):
//   xp[((m / kQMR) * (K / 2) + k / 2) * kQMR + m % kQMR] = xq[m, k] | xq[m, k + 1] << 16
// Also xs[m, g] = sum(x[m, group g]) (sum of the block sums; qb divides gs).
void quantize_x16(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t qb, int64_t gs, int32_t* xp,
                  float* sx, float* xs) {
  const int64_t nb = K / qb, nmb = (M + kQMR - 1) / kQMR, G = K / gs;
  at::parallel_for(0, nmb, grain_for(kQMR * K * 64), [&](int64_t mb0, int64_t mb1) {
    int16_t* row = tl_xrow.get<int16_t>(K);
    for (int64_t mb = mb0; mb < mb1; ++mb) {
      int32_t* dst = xp + mb * (K / 2) * kQMR;
      for (int r = 0; r < kQMR; ++r) {
        const int64_t m = mb * kQMR + r;
        if (m >= M) {
          for (int64_t kp = 0; kp < K / 2; ++kp) dst[kp * kQMR + r] = 0;
          continue;
        }
        for (int64_t g = 0; g < G; ++g) xs[m * G + g] = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const float* xr = x + m * ldx + b * qb;
          __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < qb; i += 16) {
            const __mmask16 mk = static_cast<__mmask16>(qb - i >= 16 ? 0xFFFF : (1u << (qb - i)) - 1u);
            const __m512 v = _mm512_maskz_loadu_ps(mk, xr + i);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            sum = _mm512_add_ps(sum, v);
          }
          xs[m * G + b * qb / gs] += _mm512_reduce_add_ps(sum);
          const float amax = _mm512_reduce_max_ps(mx);
          sx[m * nb + b] = amax / 32767.f;
          const __m512 vinv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
          for (int64_t i = 0; i < qb; i += 16) {
            const __mmask16 mk = static_cast<__mmask16>(qb - i >= 16 ? 0xFFFF : (1u << (qb - i)) - 1u);
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + i), vinv));
            _mm256_mask_storeu_epi16(row + b * qb + i, mk, _mm512_cvtsepi32_epi16(q));
          }
        }
        for (int64_t kp = 0; kp < K / 2; ++kp) {
          int32_t pair;
          std::memcpy(&pair, row + 2 * kp, sizeof(pair));
          dst[kp * kQMR + r] = pair;
        }
      }
    }
  });
}

}  // namespace

template <int B>
void qgemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K = pr.k, gs = pr.group_size;
  // Block: the largest multiple of 8 dividing the group and <= 256 (128 for fp6 e3m2, whose codes reach 448),
  // so |int32 sums| <= qb * max|code| * 32767 < 2^31.
  constexpr int64_t kMaxQb = B == kBF6B ? 128 : 256;
  int64_t qb = 8;
  for (int64_t d = kMaxQb; d >= 8; d -= 8)
    if (gs % d == 0) { qb = d; break; }
  const int64_t nb = K / qb, kcq = std::max(qb, kQKC / qb * qb);
  const int64_t nmb = (M + kQMR - 1) / kQMR;
  // Per-call buffers from the calling thread's scratch: no zero-fill, no fresh pages on every call.
  int32_t* xp = tl_xcall.get<int32_t>(nmb * (K / 2) * kQMR);
  float* sx = tl_sxcall.get<float>(M * nb);
  float* xs = tl_xscall.get<float>(M * G);
  quantize_x16(pr.x, pr.ldx, M, K, qb, gs, xp, sx, xs);
  constexpr int64_t TW = 32;
  const GemmSplit sp = split_gemm((c.npan + 1) / 2, M, kQMR);
  at::parallel_for(0, sp.items(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t0 = sp.tile0(it), nt = sp.tiles(it), mlo = sp.row0(it), mhi = sp.row1(it);
      const int64_t R = nt * TW, r0 = t0 * TW, rows = std::min(R, c.N - r0);
      float* sT = tl_scale.get<float>(G * R);
      float* oT = tl_offset.get<float>(G * R);
      load_qparams(pr, false, int16_code_scale(B), r0, rows, R, G, sT, R);
      load_qparams(pr, true, 1.f, r0, rows, R, G, oT, R);
      const uint8_t* pan[2 * kNCB];
      for (int64_t q = 0; q < nt * 2; ++q) pan[q] = panel_ptr(c, t0 * 2 + q);
      int32_t* ibuf = tl_wbuf.get<int32_t>(kcq * 16);
      const int64_t mcs = row_chunk(mhi - mlo, kQMR);  // a multiple of kQMR: passes start on row-block boundaries
      for (int64_t mc0 = mlo; mc0 < mhi; mc0 += mcs) {
        const int64_t mc = std::min(mcs, mhi - mc0);
        float* cbuf = tl_cbuf.get<float>(nt * mc * TW);
        for (int64_t k0 = 0; k0 < K; k0 += kcq) {
          const int64_t kc = std::min(kcq, K - k0);
          // Tile-outer: each 16 KiB tile of code pairs is expanded into L1 and stays there while the rows of
          // x stream past it.
          for (int64_t t = 0; t < nt; ++t) {
            if (t * TW >= rows) break;
            dequant_pairs<B>(pan + 2 * t, k0 / 8, kc / 8, ibuf);
            // The codes of the next tile arrive from DRAM while this one computes (tiles are short, scattered
            // streams that the hardware prefetchers do not pick up on their own).
            if (t + 1 < nt && (t + 1) * TW < rows)
              prefetch_units(pan + 2 * (t + 1), 2, k0 / 8, kc / 8, bits_of(B));
            else if (k0 + kc < K)
              prefetch_units(pan, 2, (k0 + kc) / 8, std::min(kcq, K - k0 - kc) / 8, bits_of(B));
            for (int64_t m0 = mc0; m0 < mc0 + mc; m0 += kQMR) {
              const QMicroFn fn = kQMicro[std::min<int64_t>(kQMR, mc0 + mc - m0) - 1];
              QArgs a{xp + (m0 / kQMR) * (K / 2) * kQMR + (k0 / 2) * kQMR,
                      sx + m0 * nb, nb, xs + m0 * G, G, ibuf, kc, k0, qb, gs, sT + t * TW, oT + t * TW, R,
                      cbuf + (t * mc + (m0 - mc0)) * TW, TW, k0 == 0, TW};
              fn(a);
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
#define AQ_INSTANTIATE(B) template void qgemm_path<B>(const Ctx& c);
AQ_FOR_EACH_INT16_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE

}  // namespace affineq::detail
#endif  // AQ_VNNI
