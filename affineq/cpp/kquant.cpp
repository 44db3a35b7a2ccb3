// Linear layers on llama.cpp's k-quant super-blocks, read as stored (affineq::kquant_linear), and their fp32
// values (affineq::kquant_dequantize). The weight [n, k] is n rows of k / 256 blocks (kquant_decode.h).
//   m <= kGemvRows (q6_k: m = 1): fused GEMV, output rows in parallel. Each block is decoded once per pass
//     (q6_k, and q4_k / q5_k without AVX-512: into int8 codes in L1, then 16 codes at a time to fp32; q3_k, and
//     q2_k without AVX-512: straight from the bit planes into registers; q2_k / q4_k / q5_k on AVX-512: codes
//     index per-block tables of the exact weights; each measured the faster on its kinds), its weights
//     c * s + o formed in fp32 registers, exactly the dequantized values, and multiplied with every row of x
//     (fp32 FMA); at m >= 2 two output rows per pass share each block's slice of x in L1 (kq_gemv_R).
//     Memory-bound at real sizes: the packed bytes stream once.
//   m <= kTileMax: tile GEMM: the blocks of kRR output rows decoded once into an L1 tile by the same decoders and
//     multiplied with all rows of x (repacked by super-block) by a register-blocked micro-kernel.
//   larger m: blocked_gemm.h's driver with a k-quant block decoder: blocks of output rows are dequantized to
//     fp32 in a per-thread buffer that stays in L2 and multiplied with all of x by torch's GEMM (the driver the
//     dense format's dequant_linear runs on).
// Values: every weight is exactly format_kquant's dequantize (kquant_dequantize equals it bit for bit), so
// y = F.linear(x.float(), W) up to the order of the fp32 sums, cast to x's dtype.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "blocked_gemm.h"
#include "common.h"
#include "kquant_decode.h"

namespace affineq {
namespace detail {
namespace {

inline constexpr int64_t kGemvRows = 4;
// Output rows per pass of the GEMV at m >= 2 on AVX-512: two for the kinds decoded by table or in few registers,
// one for q3_k / q6_k (whose decoders hold more registers: two rows measured slower) and on AVX2 (16 ymm).
constexpr int kq_gemv_R([[maybe_unused]] int kind) {
#if AQ_AVX512
  return kind == 3 || kind == 6 ? 1 : 2;
#else
  return 1;
#endif
}
inline constexpr int64_t kTileMax = 256;  // above: the blocked driver with torch's GEMM

#if AQ_AVX512
// q4_k / q5_k on AVX-512: each sub-block's 16 (32) possible weights fma(u, s, o), exact, go into a table of one
// (two) zmm, and the codes index it (vpermps / vpermt2ps): one op per 16 weights where the conversion and the
// weight FMA cost two (measured faster). dot(integral_constant<V>, w) as kq_codes's f.
template <int KIND, class F>
AQ_INLINE void kq_lut_block(const uint8_t* b, F&& dot) {
  static_assert(KIND == 4 || KIND == 5);
  // the 8 six-bit sub-scales and mins (kquant_decode.h's scale_min_k4, four bytes per 32-bit word), in fp32
  uint32_t q[3];
  std::memcpy(q, b + 4, 12);
  const __m128i sc = _mm_setr_epi32(static_cast<int>(q[0] & 0x3F3F3F3Fu),
                                    static_cast<int>((q[2] & 0x0F0F0F0Fu) | ((q[0] >> 2) & 0x30303030u)), 0, 0);
  const __m128i mn = _mm_setr_epi32(static_cast<int>(q[1] & 0x3F3F3F3Fu),
                                    static_cast<int>(((q[2] >> 4) & 0x0F0F0F0Fu) | ((q[1] >> 2) & 0x30303030u)), 0, 0);
  alignas(32) float s[8], o[8];
  _mm256_store_ps(s, _mm256_mul_ps(_mm256_set1_ps(half_to_float(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
  _mm256_store_ps(o, _mm256_xor_ps(_mm256_set1_ps(-0.f),  // -(dmin * m), as the format (a zero keeps its sign)
                                   _mm256_mul_ps(_mm256_set1_ps(half_to_float(b + 2)),
                                                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)))));
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* qs = b + (KIND == 4 ? 16 : 48);
  [[maybe_unused]] __m512i qh[2];
  if constexpr (KIND == 5)
    for (int p = 0; p < 2; ++p)
      qh[p] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * p)));
  sfor<4>([&](auto H) {
    constexpr int h = AQ_CV(H);
    __m512 lut[2][2];  // [sub-block 2h, 2h + 1][codes 0-15, 16-31]
    for (int q = 0; q < 2; ++q) {
      const __m512 sv = _mm512_set1_ps(s[2 * h + q]), ov = _mm512_set1_ps(o[2 * h + q]);
      lut[q][0] = _mm512_fmadd_ps(iota, sv, ov);
      if constexpr (KIND == 5) lut[q][1] = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), sv, ov);
    }
    sfor<2>([&](auto P) {
      constexpr int half = AQ_CV(P);
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * h + 16 * half)));
      const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
      if constexpr (KIND == 4) {
        dot(std::integral_constant<int, 4 * h + half>{}, F16{_mm512_permutexvar_ps(lo, lut[0][0])});
        dot(std::integral_constant<int, 4 * h + 2 + half>{}, F16{_mm512_permutexvar_ps(hi, lut[1][0])});
      } else {
        const auto bit4 = [&](int at) {  // bit `at` of the qh byte, moved to bit 4
          return _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[half], at), _mm512_set1_epi32(1)), 4);
        };
        const __m512i lo5 = _mm512_or_si512(lo, bit4(2 * h)), hi5 = _mm512_or_si512(hi, bit4(2 * h + 1));
        dot(std::integral_constant<int, 4 * h + half>{}, F16{_mm512_permutex2var_ps(lut[0][0], lo5, lut[0][1])});
        dot(std::integral_constant<int, 4 * h + 2 + half>{}, F16{_mm512_permutex2var_ps(lut[1][0], hi5, lut[1][1])});
      }
    });
  });
}

// q2_k on AVX-512: the exact weights fma(u, s, o) of 4 sub-blocks (4 codes each) per zmm table, 4 tables built
// once per block, indexed by code | position of the sub-block in its table (vpermps): one op per 16 weights where
// the int -> float conversion and the weight FMA cost two. (q3_k's 8 tables of 2 sub-blocks measured slower than
// its register decode.)
template <class F>
AQ_INLINE void kq_q2k_lut_block(const uint8_t* b, F&& dot) {
  alignas(64) float s[16], o[16];
  kq_qparams16<2>(b, s, o);
  const __m512 sv = _mm512_load_ps(s), ov = _mm512_load_ps(o);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 code = _mm512_cvtepi32_ps(_mm512_and_si512(lane, _mm512_set1_epi32(3)));
  __m512 lut[4];  // lut[p] lane i: sub-block 4 p + i / 4, code i % 4
  sfor<4>([&](auto P_) {
    const __m512i sub = _mm512_add_epi32(_mm512_srli_epi32(lane, 2), _mm512_set1_epi32(4 * AQ_CV(P_)));
    lut[AQ_CV(P_)] = _mm512_fmadd_ps(code, _mm512_permutexvar_ps(sub, sv), _mm512_permutexvar_ps(sub, ov));
  });
  kq_codes<2>(b, [&](auto V_, I16 u) {
    constexpr int V = AQ_CV(V_);
    const __m512i idx = _mm512_or_si512(u.v, _mm512_set1_epi32((V % 4) << 2));
    dot(V_, F16{_mm512_permutexvar_ps(idx, lut[V / 4])});
  });
}
#endif

// y[mi * ldy + r] = sum_k x[mi * k + k'] * W[r, k'] for rows r in [r0, r1), mi < M, R rows at a time: each
// block's slice of x (M x 256) is read from L1 for all R rows (one row at a time, x's M rows stream from L2 for
// every row once M * k no longer fits L1).
template <int KIND, int M, int R>
void kq_gemv_rows(const uint8_t* w, int64_t nb, const float* x, int64_t k, float* y, int64_t ldy, int64_t r0,
                  int64_t r1) {
  constexpr int64_t ts = kq_type_size(KIND);
  alignas(64) int8_t c[kSuperBlock];
  alignas(64) float s[16], o[16];
  // Two independent FMA chains per (row, row of x): 16 dependent FMAs per block on one chain would be
  // latency-bound at m = 1 (4 measured no faster); kept at every m, so each output sums in the same order
  // whatever R (the results of R = 1, bit for bit).
  constexpr int A = 2;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    F16 acc[R][M][A];
    sfor<R>([&](auto Q_) {
      for (int mi = 0; mi < M; ++mi)
        for (int a = 0; a < A; ++a) acc[AQ_CV(Q_)][mi][a] = fzero();
    });
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* xb = x + blk * kSuperBlock;
      sfor<R>([&](auto Q_) {
        constexpr int q = AQ_CV(Q_);
        const uint8_t* b = w + ((r + q) * nb + blk) * ts;
        const auto dot = [&](auto V_, F16 wv) {  // wv: weights 16 V .. 16 V + 15
          constexpr int V = AQ_CV(V_);
          for (int mi = 0; mi < M; ++mi)
            acc[q][mi][V % A] = ffma(wv, fload(xb + mi * k + 16 * V), acc[q][mi][V % A]);
        };
#if AQ_AVX512
        if constexpr (KIND == 4 || KIND == 5) {
          kq_lut_block<KIND>(b, dot);
          return;
        } else if constexpr (KIND == 2) {
          kq_q2k_lut_block(b, dot);
          return;
        }
#endif
        if constexpr (KIND == 2 || KIND == 3) {  // 2-bit planes: decoded in registers (measured faster)
          kq_qparams16<KIND>(b, s, o);
          kq_codes<KIND>(b, [&](auto V_, I16 u) {
            constexpr int j = AQ_CV(V_);
            dot(V_, ffma(i2f(u), fset1(s[j]), fset1(o[j])));  // the weights, exact (see kquant_decode.h)
          });
        } else {  // nibble planes: decoded to int8 codes in L1 first (measured faster)
          kq_decode<KIND>(b, c, s, o);
          for (int j = 0; j < 16; j += 2) {  // a plain loop: fully unrolled, it measured slower
            const F16 w0 = kq_weights16(c, s, o, j), w1 = kq_weights16(c, s, o, j + 1);
            for (int mi = 0; mi < M; ++mi) {
              acc[q][mi][0] = ffma(w0, fload(xb + mi * k + 16 * j), acc[q][mi][0]);
              acc[q][mi][1] = ffma(w1, fload(xb + mi * k + 16 * j + 16), acc[q][mi][1]);
            }
          }
        }
      });
    }
    sfor<R>([&](auto Q_) {
      constexpr int q = AQ_CV(Q_);
      for (int mi = 0; mi < M; ++mi) {
        F16 t = acc[q][mi][0];
        for (int a = 1; a < A; ++a) t = fadd(t, acc[q][mi][a]);
        y[mi * ldy + r + q] = fhsum(t);
      }
    });
  }
  if constexpr (R > 1)
    if (r < r1) kq_gemv_rows<KIND, M, 1>(w, nb, x, k, y, ldy, r, r1);
}

// Rows [r0, r1) of W as fp32 into out (row r at out + (r - r0) * k).
template <int KIND>
void kq_dequant_rows(const uint8_t* w, int64_t nb, int64_t r0, int64_t r1, float* out) {
  constexpr int64_t ts = kq_type_size(KIND);
  alignas(64) int8_t c[kSuperBlock];
  alignas(64) float s[16], o[16];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * nb * ts;
    float* dst = out + (r - r0) * nb * kSuperBlock;
    for (int64_t blk = 0; blk < nb; ++blk) {
      kq_decode<KIND>(row + blk * ts, c, s, o);
      for (int j = 0; j < 16; ++j) fstore(dst + blk * kSuperBlock + 16 * j, kq_weights16(c, s, o, j));
    }
  }
}

// One super-block's 256 weights as fp32 into dst (the values of dequantize, up to the sign of q3_k's zeros),
// by the GEMV's decoder of the kind.
template <int KIND>
AQ_INLINE void kq_block_to_f32(const uint8_t* b, float* dst) {
#if AQ_AVX512
  if constexpr (KIND == 4 || KIND == 5) {
    kq_lut_block<KIND>(b, [&](auto V_, F16 wv) { fstore(dst + 16 * AQ_CV(V_), wv); });
    return;
  } else if constexpr (KIND == 2) {
    kq_q2k_lut_block(b, [&](auto V_, F16 wv) { fstore(dst + 16 * AQ_CV(V_), wv); });
    return;
  }
#endif
  alignas(64) float s[16], o[16];
  if constexpr (KIND == 2 || KIND == 3) {
    kq_qparams16<KIND>(b, s, o);
    kq_codes<KIND>(b, [&](auto V_, I16 u) {
      constexpr int j = AQ_CV(V_);
      fstore(dst + 16 * j, ffma(i2f(u), fset1(s[j]), fset1(o[j])));
    });
  } else {
    alignas(64) int8_t c[kSuperBlock];
    kq_decode<KIND>(b, c, s, o);
    for (int j = 0; j < 16; ++j) fstore(dst + 16 * j, kq_weights16(c, s, o, j));
  }
}

// The tile GEMM (the GEMV's limit < m <= kTileMax): each super-block of kRR output rows is decoded once into an
// L1 tile and multiplied with every row of x, up to kMR rows at a time, into 16-lane partial sums acc[m][rr] kept in an
// L1 buffer (summed across lanes once, at the end of the row). Per 16 k a micro-tile loads kRR weight and kMR x
// vectors for kMR * kRR FMAs.
#if AQ_AVX512
inline constexpr int kRR = 8, kMR = 3;  // 24 zmm accumulators + 8 weight vectors + an x vector
#else
inline constexpr int kRR = 2, kMR = 2;  // AVX2: 4 accumulators, 2 weight vectors, an x vector (14 ymm)
#endif

// acc[(m * kRR + rr) * 16 ..] += x[m, 0:256] * wt[rr, 0:256] (per lane) for m < MR, rr < kRR.
template <int MR>
void kq_micro(const float* x, int64_t ldx, const float* wt, float* acc) {
  F16 a[MR][kRR];
  sfor<MR>([&](auto M_) { sfor<kRR>([&](auto R_) {
    a[AQ_CV(M_)][AQ_CV(R_)] = fload(acc + (AQ_CV(M_) * kRR + AQ_CV(R_)) * 16);
  }); });
  for (int v = 0; v < kSuperBlock / 16; ++v) {
    F16 wv[kRR];
    sfor<kRR>([&](auto R_) { wv[AQ_CV(R_)] = fload(wt + AQ_CV(R_) * kSuperBlock + 16 * v); });
    sfor<MR>([&](auto M_) {
      constexpr int m = AQ_CV(M_);
      const F16 xv = fload(x + m * ldx + 16 * v);
      sfor<kRR>([&](auto R_) { a[m][AQ_CV(R_)] = ffma(xv, wv[AQ_CV(R_)], a[m][AQ_CV(R_)]); });
    });
  }
  sfor<MR>([&](auto M_) { sfor<kRR>([&](auto R_) {
    fstore(acc + (AQ_CV(M_) * kRR + AQ_CV(R_)) * 16, a[AQ_CV(M_)][AQ_CV(R_)]);
  }); });
}

using KqMicroFn = void (*)(const float*, int64_t, const float*, float*);
template <int... Is>
constexpr std::array<KqMicroFn, sizeof...(Is)> kq_micro_table(std::integer_sequence<int, Is...>) {
  return {&kq_micro<Is + 1>...};
}
inline constexpr auto kKqMicro = kq_micro_table(std::make_integer_sequence<int, kMR>{});

// y[mi * ldy + r] = sum_k x[mi, k'] * W[r, k'] for the rows of row tiles [t0, t1) (kRR rows each, the last one
// clipped at n), all M rows of x. xb: x by super-block, xb[(blk * M + mi) * 256 + j] = x[mi, 256 blk + j] (one
// block's slice of x contiguous: x's own rows, a power-of-two stride apart, would share L1 sets).
template <int KIND>
void kq_tile_rows(const uint8_t* w, int64_t nb, int64_t n, const float* xb, int64_t M, float* y, int64_t ldy,
                  int64_t t0, int64_t t1) {
  constexpr int64_t ts = kq_type_size(KIND);
  alignas(64) float wt[kRR * kSuperBlock];
  std::vector<float> accv(static_cast<size_t>(M * kRR * 16 + 16));
  float* acc = accv.data();
  const int64_t mr = (M + (M + kMR - 1) / kMR - 1) / ((M + kMR - 1) / kMR);  // x rows per micro-tile, even split
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r0 = t * kRR, nr = std::min<int64_t>(kRR, n - r0);
    std::fill(accv.begin(), accv.end(), 0.f);
    for (int64_t blk = 0; blk < nb; ++blk) {
      for (int rr = 0; rr < kRR; ++rr)  // rows past n repeat the last row (their sums are not stored)
        kq_block_to_f32<KIND>(w + ((r0 + std::min<int64_t>(rr, nr - 1)) * nb + blk) * ts, wt + rr * kSuperBlock);
      for (int64_t m0 = 0; m0 < M; m0 += mr)
        kKqMicro[std::min<int64_t>(mr, M - m0) - 1](xb + (blk * M + m0) * kSuperBlock, kSuperBlock, wt,
                                                      acc + m0 * kRR * 16);
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t rr = 0; rr < nr; ++rr) y[m * ldy + r0 + rr] = fhsum(fload(acc + (m * kRR + rr) * 16));
  }
}

// f(integral_constant<KIND>) for a runtime kind 2..6.
template <class F>
void with_kind(int64_t kind, F&& f) {
  using std::integral_constant;
  switch (kind) {
    case 2: f(integral_constant<int, 2>{}); break;
    case 3: f(integral_constant<int, 3>{}); break;
    case 4: f(integral_constant<int, 4>{}); break;
    case 5: f(integral_constant<int, 5>{}); break;
    default: f(integral_constant<int, 6>{});
  }
}

}  // namespace
}  // namespace detail

namespace {

void check_blocks(const char* op, const at::Tensor& blocks, int64_t kind, int64_t n, int64_t k) {
  TORCH_CHECK_VALUE(kind >= 2 && kind <= 6, op, ": kind must be 2..6 (q2_k .. q6_k), got ", kind);
  TORCH_CHECK_VALUE(n >= 0 && k > 0 && k % detail::kSuperBlock == 0, op,
                    ": need n >= 0 and k a positive multiple of 256, got n=", n, ", k=", k);
  const int64_t nbytes = n * (k / detail::kSuperBlock) * detail::kq_type_size(kind);
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.device().is_cpu() && blocks.numel() == nbytes, op,
                    ": blocks must be a uint8 CPU tensor of n * k / 256 * ", detail::kq_type_size(kind), " = ",
                    nbytes, " bytes (the GGUF tensor's data), got ", blocks.scalar_type(), " with ", blocks.numel(),
                    " elements on ", blocks.device());
}

at::Tensor kquant_dequantize_cpu(const at::Tensor& blocks, int64_t kind, int64_t n, int64_t k) {
  check_blocks("affineq::kquant_dequantize", blocks, kind, n, k);
  const at::Tensor b = blocks.contiguous();
  at::Tensor w = at::empty({n, k}, b.options().dtype(at::kFloat));
  const int64_t nb = k / detail::kSuperBlock;
  const uint8_t* src = b.const_data_ptr<uint8_t>();
  float* dst = w.mutable_data_ptr<float>();
  detail::with_kind(kind, [&](auto K_) {
    constexpr int KIND = AQ_CV(K_);
    at::parallel_for(0, n, detail::grain_for(k), [&](int64_t r0, int64_t r1) {
      detail::kq_dequant_rows<KIND>(src, nb, r0, r1, dst + r0 * k);
    });
  });
  return w;
}

// Output rows a thread dequantizes per GEMM: about 1 MiB of fp32 weight (stays in L2 while the GEMM reads it).
int64_t gemm_block_rows(int64_t k) { return std::max<int64_t>(16, (int64_t{1} << 20) / (4 * k)); }

at::Tensor kquant_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, int64_t n, int64_t k) {
  const char* op = "affineq::kquant_linear";
  check_blocks(op, blocks, kind, n, k);
  const auto xt = x.scalar_type();
  TORCH_CHECK_VALUE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, op, ": x must be a CPU tensor [..., k=",
                    k, "], got ", x.sizes(), " on ", x.device());
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // no derivative here: callers wrap it
  const at::Tensor b = blocks.contiguous();
  const at::Tensor x2 = x.detach().reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t M = x2.size(0), nb = k / detail::kSuperBlock;
  const uint8_t* w = b.const_data_ptr<uint8_t>();
  at::Tensor y;
  if (M <= (kind == 6 ? 1 : detail::kGemvRows)) {  // q6_k: the tile GEMM measured faster from m = 2
    y = at::empty({M, n}, x2.options());
    const float* xp = x2.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    detail::with_kind(kind, [&](auto K_) {
      constexpr int KIND = AQ_CV(K_);
      at::parallel_for(0, n, detail::grain_for(k * std::max<int64_t>(M, 1)), [&](int64_t r0, int64_t r1) {
        switch (M) {
          case 0: break;
          case 1: detail::kq_gemv_rows<KIND, 1, 1>(w, nb, xp, k, yp, n, r0, r1); break;
          case 2: detail::kq_gemv_rows<KIND, 2, detail::kq_gemv_R(KIND)>(w, nb, xp, k, yp, n, r0, r1); break;
          case 3: detail::kq_gemv_rows<KIND, 3, detail::kq_gemv_R(KIND)>(w, nb, xp, k, yp, n, r0, r1); break;
          default: detail::kq_gemv_rows<KIND, 4, detail::kq_gemv_R(KIND)>(w, nb, xp, k, yp, n, r0, r1);
        }
      });
    });
  } else if (M <= detail::kTileMax) {
    y = at::empty({M, n}, x2.options());
    const at::Tensor xb = x2.view({M, nb, detail::kSuperBlock}).transpose(0, 1).contiguous();
    const float* xp = xb.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    const int64_t ntiles = (n + detail::kRR - 1) / detail::kRR;
    detail::with_kind(kind, [&](auto K_) {
      constexpr int KIND = AQ_CV(K_);
      at::parallel_for(0, ntiles, detail::grain_for(detail::kRR * k * M), [&](int64_t t0, int64_t t1) {
        detail::kq_tile_rows<KIND>(w, nb, n, xp, M, yp, n, t0, t1);
      });
    });
  } else {
    // blocked_gemm.h's driver, as the dense format's dequant_linear: blocks of br rows decoded to fp32 W
    // [rows, k], each multiplied into a contiguous row slice of y^T [n, M]
    const detail::BlockedGemmShape shape{gemm_block_rows(k), 1, false, true};
    detail::with_kind(kind, [&](auto K_) {
      constexpr int KIND = AQ_CV(K_);
      y = detail::blocked_linear(x2, n, k, shape, [&](int64_t q0, int64_t q1, void* dst, int64_t) {
        const int64_t r0 = q0 * shape.unit_rows, r1 = std::min(n, q1 * shape.unit_rows);
        detail::kq_dequant_rows<KIND>(w, nb, r0, r1, static_cast<float*>(dst));
      });
    });
  }
  return y.to(xt).contiguous().view(detail::out_sizes(x, n));
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) {
  m.impl("kquant_linear", &affineq::kquant_linear_cpu);
  m.impl("kquant_dequantize", &affineq::kquant_dequantize_cpu);
}
