// The vector path of the KV-cache attention ops: see attention_kernel.h.
#include "attention_kernel.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#include "common.h"

namespace affineq::kv {
namespace {
using detail::F16;
using detail::I16;
using detail::sfor;

constexpr int64_t kChunk = 256;  // slots per softmax chunk (partial results folded in slot order)
constexpr int kRB = 4;           // query heads per block: 4 x 4 fp32 vectors of output stay in registers
constexpr int kDC = 4;           // 16-dim vectors of a value row per pass

// 16 nibbles of 8 bytes: lanes 0-7 the low nibbles, 8-15 the high ones (an int4 group of 16).
AQ_INLINE I16 nibbles_g16(const uint8_t* p) {
#if AQ_AVX512 || AQ_AVX2
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(15);
  const __m128i b = _mm_unpacklo_epi64(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
#if AQ_AVX512
  return {_mm512_cvtepu8_epi32(b)};
#else
  return {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
#endif
#else
  I16 r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i] & 15, r.v[i + 8] = p[i] >> 4;
  return r;
#endif
}

// 16 bfloat16 / float16 values as fp32 (exact).
AQ_INLINE F16 ld_bf16x16(const uint8_t* p) {
#if AQ_AVX512
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {detail::bf16_widen(h)};
#elif AQ_AVX2
  auto half = [](const uint8_t* q) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  return {half(p), half(p + 16)};
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = detail::bf16_to_float(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
  return r;
#endif
}
AQ_INLINE F16 ld_f16x16(const uint8_t* p) {
#if AQ_AVX512
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
#elif AQ_AVX2 && defined(__F16C__)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = detail::f16_to_float(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
  return r;
#endif
}

// The fp32 values of one 16-dim chunk of a slot: codes (sc: the slot's fp32 scales, int4 (scale, min) pairs) or
// float values.
template <int KIND>
AQ_INLINE F16 dequant16(const uint8_t* row, const float* sc, Chunk c) {
  using namespace detail;
  if constexpr (KIND == kF32) {
    return fload(reinterpret_cast<const float*>(row + c.byte));
  } else if constexpr (KIND == kBF16) {
    return ld_bf16x16(row + c.byte);
  } else if constexpr (KIND == kF16) {
    return ld_f16x16(row + c.byte);
  } else if constexpr (KIND == kI8) {
    return fmul(i2f(ld_s8x16(reinterpret_cast<const int8_t*>(row) + c.byte)), fset1(sc[c.g]));
  } else {
    const I16 u = c.kind == 3 ? nibbles_g16(row + c.byte)
                  : c.kind == 1 ? iand(ld_u8x16(row + c.byte), 15)
                                : isrl<4>(ld_u8x16(row + c.byte));
    return ffma(i2f(u), fset1(sc[2 * c.g]), fset1(sc[2 * c.g + 1]));
  }
}

// out[i] = sum of the 16 floats m[16 i .. 16 i + 15], i < n (m: 16 rows of 16, 64-byte aligned).
AQ_INLINE void reduce16(const float* m, int n, float* out) {
#if AQ_AVX512
  // Pairs of rows, then pairs of pairs, interleaved within 128-bit lanes, then across lanes: 45 ops for 16 sums
  // (a horizontal sum per row takes ~8).
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = _mm512_load_ps(m + 32 * i), y = _mm512_load_ps(m + 32 * i + 16);
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i]: lane k of 128 bits holds row 4i..4i+3's sums over their k-th 128 bits; now add the four lanes
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), d);
#elif AQ_AVX2
  // Per 8 rows: each row's two halves added, then a transposing tree of vhaddps (rows 0-3 and 4-7 summed over
  // their 128-bit lanes), the two lanes added: 17 ops for 8 sums (a horizontal sum per row takes ~7).
  for (int g = 0; g < 2 && 8 * g < n; ++g) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm256_add_ps(_mm256_load_ps(m + 16 * (8 * g + i)), _mm256_load_ps(m + 16 * (8 * g + i) + 8));
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 d = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    const int w = std::min(8, n - 8 * g);
    if (w == 8) {
      _mm256_storeu_ps(out + 8 * g, d);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, d);
      std::copy_n(t, w, out + 8 * g);
    }
  }
#else
  for (int i = 0; i < n; ++i) out[i] = detail::fhsum(detail::fload(m + 16 * i));
#endif
}

#if AQ_AVX512 || AQ_AVX2
// exp_shifted's polynomial on one vector V (__m512 or __m256, this build's): exp(x) = p * 2^kf with
// kf = round(x / ln 2) and p the degree-7 Taylor polynomial of r = x - kf ln 2 (ln 2 = hi + lo, hi * kf exact).
#if AQ_AVX512
using VExp = __m512;
AQ_INLINE VExp vset(float c) { return _mm512_set1_ps(c); }
AQ_INLINE VExp vround(VExp v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AQ_INLINE VExp vfma(VExp a, VExp b, VExp c) { return _mm512_fmadd_ps(a, b, c); }
AQ_INLINE VExp vfnma(VExp a, VExp b, VExp c) { return _mm512_fnmadd_ps(a, b, c); }
#else
using VExp = __m256;
AQ_INLINE VExp vset(float c) { return _mm256_set1_ps(c); }
AQ_INLINE VExp vround(VExp v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AQ_INLINE VExp vfma(VExp a, VExp b, VExp c) { return _mm256_fmadd_ps(a, b, c); }
AQ_INLINE VExp vfnma(VExp a, VExp b, VExp c) { return _mm256_fnmadd_ps(a, b, c); }
#endif
AQ_INLINE VExp exp_poly(VExp x, VExp& kf) {
  kf = vround(x * vset(1.44269504088896341f));
  const VExp r = vfnma(kf, vset(1.42860682030941723212e-6f), vfnma(kf, vset(0.693145751953125f), x));
  VExp p = vset(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = vfma(p, r, vset(c));
  return p;
}
#endif

// s[i] = exp(s[i] - mx) for i < n; returns their sum. AVX-512 and AVX2: range reduction by ln 2 and a degree-7
// Taylor polynomial (relative error ~1e-7, a few fp32 ulps), then 2^k (underflow to 0, no overflow: s - mx <= 0):
// by vscalefps, or on AVX2 as two exact power-of-two factors 2^(k + 64) * 2^-64, the second rounding once where
// the result is subnormal, as vscalefps does (the same values); elsewhere std::exp. NaN stays NaN.
float exp_shifted(float* s, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0.f;
#if AQ_AVX512
  const __m512 lo = _mm512_set1_ps(-120.f), m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 x = _mm512_max_ps(lo, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m));  // -inf -> -120
    __m512 kf;
    const __m512 e = _mm512_scalef_ps(exp_poly(x, kf), kf);
    _mm512_mask_storeu_ps(s + i, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif AQ_AVX2
  const __m256 lo = _mm256_set1_ps(-120.f), m = _mm256_set1_ps(mx), tiny = _mm256_set1_ps(0x1p-64f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 acc = _mm256_setzero_ps();
  for (; i < n; i += 8) {
    const bool whole = n - i >= 8;  // vmaskmovps only on the tail: Zen 1 microcodes its store
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n - i, 8))), lane);
    // -inf -> -120; NaN stays (vmaxps returns its second operand when either is NaN)
    const __m256 x = _mm256_max_ps(lo, _mm256_sub_ps(whole ? _mm256_loadu_ps(s + i) : _mm256_maskload_ps(s + i, k),
                                                     m));
    __m256 kf;
    const __m256 p = exp_poly(x, kf);
    // 2^(k + 64) is a normal float for k >= -173 (x >= -120)
    const __m256i e2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(kf), _mm256_set1_epi32(127 + 64)), 23);
    const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e2)), tiny);
    if (whole) {
      _mm256_storeu_ps(s + i, e);
      acc = _mm256_add_ps(acc, e);
    } else {
      _mm256_maskstore_ps(s + i, k, e);
      acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
  }
  sum = detail::fhsum(F16{acc, _mm256_setzero_ps()});
#else
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - mx));
#endif
  return sum;
}

// s[r * ld + i] = q_r . K[t0 + i] for the RB queries q (RB rows of D, already scaled) and nt slots. NC: D / 16
// as a constant (the chunk loop unrolled, its table entries held in registers), or 0 (a loop over D / 16).
template <int KIND, int RB, int NC>
void block_scores(const Side& k, int64_t t0, int64_t nt, const float* sc, const float* q, int64_t D, float* s,
                  int64_t ld) {
  alignas(64) float red[RB][16 * 16];
  Chunk ch[NC > 0 ? NC : 1];
  if constexpr (NC > 0) std::copy_n(k.chunks.data(), NC, ch);
  for (int64_t i = 0; i < nt; ++i) {
    const uint8_t* row = k.codes + (t0 + i) * k.row_bytes;
    const float* scl = sc + i * k.words;
    F16 acc[RB];
    sfor<RB>([&](auto r) AQ_INLINE_LAMBDA { acc[AQ_CV(r)] = detail::fzero(); });
    auto chunk = [&](Chunk c, int64_t d) AQ_INLINE_LAMBDA {
      const F16 x = dequant16<KIND>(row, scl, c);
      sfor<RB>([&](auto r) AQ_INLINE_LAMBDA {
        constexpr int j = AQ_CV(r);
        acc[j] = detail::ffma(detail::fload(q + j * D + d), x, acc[j]);
      });
    };
    if constexpr (NC > 0) {
      sfor<NC>([&](auto c) AQ_INLINE_LAMBDA { chunk(ch[AQ_CV(c)], 16 * AQ_CV(c)); });
    } else {
      for (int64_t c = 0; c < D / 16; ++c) chunk(k.chunks[c], 16 * c);
    }
    const int j = int(i & 15);
    sfor<RB>([&](auto r) AQ_INLINE_LAMBDA { detail::fstore(red[AQ_CV(r)] + 16 * j, acc[AQ_CV(r)]); });
    if (j == 15 || i == nt - 1)
      sfor<RB>([&](auto r) AQ_INLINE_LAMBDA { reduce16(red[AQ_CV(r)], j + 1, s + AQ_CV(r) * ld + i - j); });
  }
}

// o[r * D + 16 (c0 + c)] = sum_i p[r * ld + i] * V[t0 + i][16 (c0 + c) ..] for c < DC, over the slots with ok[i].
template <int KIND, int RB, int DC>
void block_values(const Side& v, int64_t t0, int64_t nt, const float* sc, const bool* ok, const float* p,
                  int64_t ld, int64_t c0, float* o, int64_t D) {
  F16 acc[RB][DC];
  sfor<RB>([&](auto r) AQ_INLINE_LAMBDA {
    sfor<DC>([&](auto c) AQ_INLINE_LAMBDA { acc[AQ_CV(r)][AQ_CV(c)] = detail::fzero(); });
  });
  for (int64_t i = 0; i < nt; ++i) {
    if (!ok[i]) continue;
    const uint8_t* row = v.codes + (t0 + i) * v.row_bytes;
    const float* scl = sc + i * v.words;
    F16 pr[RB];
    sfor<RB>([&](auto r) AQ_INLINE_LAMBDA { pr[AQ_CV(r)] = detail::fset1(p[AQ_CV(r) * ld + i]); });
    sfor<DC>([&](auto c) AQ_INLINE_LAMBDA {
      const F16 x = dequant16<KIND>(row, scl, v.chunks[c0 + AQ_CV(c)]);
      sfor<RB>([&](auto r) AQ_INLINE_LAMBDA {
        acc[AQ_CV(r)][AQ_CV(c)] = detail::ffma(pr[AQ_CV(r)], x, acc[AQ_CV(r)][AQ_CV(c)]);
      });
    });
  }
  sfor<RB>([&](auto r) AQ_INLINE_LAMBDA {
    sfor<DC>([&](auto c) AQ_INLINE_LAMBDA {
      detail::fstore(o + AQ_CV(r) * D + 16 * (c0 + AQ_CV(c)), acc[AQ_CV(r)][AQ_CV(c)]);
    });
  });
}

// dst[d] = float(q[i + d]) * scale, d < D, q float32 / bfloat16 / float16 (qtype: kQF32 / kQBF16 / kQF16).
void load_row(const void* q, int qtype, int64_t i, int64_t D, float scale, float* dst) {
  for (int64_t d = 0; d < D; ++d)
    dst[d] = (qtype == kQF32    ? static_cast<const float*>(q)[i + d]
              : qtype == kQBF16 ? float(static_cast<const c10::BFloat16*>(q)[i + d])
                                : float(static_cast<const c10::Half*>(q)[i + d])) * scale;
}
// out[i + d] = src[d] in out's type (rounded to nearest even, as Tensor.to does).
void store_row(const float* src, int64_t D, void* out, int qtype, int64_t i) {
  for (int64_t d = 0; d < D; ++d) {
    if (qtype == kQF32) static_cast<float*>(out)[i + d] = src[d];
    else if (qtype == kQBF16) static_cast<c10::BFloat16*>(out)[i + d] = c10::BFloat16(src[d]);
    else static_cast<c10::Half*>(out)[i + d] = c10::Half(src[d]);
  }
}

thread_local detail::Scratch tl_kv_s, tl_kv_ks, tl_kv_vs;  // scores, key and value scales of a chunk

// The partial softmax of RB queries q over slots [t0, t1) of one (b, kv head) (t: absolute cache rows, ok:
// valid[b, ...] at t0): per query its max m (-inf: no slot), sum l and unnormalised output o [D].
template <int KIND, int RB>
void attend_chunk(const Side& k, const Side& v, int64_t t0, int64_t t1, const bool* ok, const float* q, int64_t D,
                  float* m, float* l, float* o) {
  const int64_t nt = t1 - t0, ld = (nt + 15) / 16 * 16;
  float* s = tl_kv_s.get<float>(RB * ld);
  const float* ksc = k.scales(t0, nt, tl_kv_ks);
  switch (D) {  // the head sizes of the models people run get the unrolled loop
    case 64: block_scores<KIND, RB, 4>(k, t0, nt, ksc, q, D, s, ld); break;
    case 128: block_scores<KIND, RB, 8>(k, t0, nt, ksc, q, D, s, ld); break;
    default: block_scores<KIND, RB, 0>(k, t0, nt, ksc, q, D, s, ld); break;
  }
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  if (std::none_of(ok, ok + nt, [](bool b) { return b; })) {  // no slot here for any query of the block
    std::fill(m, m + RB, kNone);
    return;
  }
  for (int r = 0; r < RB; ++r) {
    float mx = kNone;
    float* sr = s + r * ld;
    for (int64_t i = 0; i < nt; ++i) {
      if (!ok[i]) sr[i] = kNone;
      mx = std::max(mx, sr[i]);
    }
    // A slot but no finite max: NaN scores (std::max skips them); keep them NaN, as the reference's softmax.
    m[r] = mx == kNone ? std::numeric_limits<float>::quiet_NaN() : mx;
    l[r] = exp_shifted(sr, nt, m[r]);
  }
  const float* vsc = v.scales(t0, nt, tl_kv_vs);
  for (int64_t c0 = 0; c0 < D / 16; c0 += kDC) {
    switch (std::min<int64_t>(kDC, D / 16 - c0)) {
      case 1: block_values<KIND, RB, 1>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
      case 2: block_values<KIND, RB, 2>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
      case 3: block_values<KIND, RB, 3>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
      default: block_values<KIND, RB, 4>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
    }
  }
}

using ChunkFn = void (*)(const Side&, const Side&, int64_t, int64_t, const bool*, const float*, int64_t, float*,
                         float*, float*);
template <int KIND>
ChunkFn chunk_fn_of(int rb) {
  switch (rb) {
    case 1: return &attend_chunk<KIND, 1>;
    case 2: return &attend_chunk<KIND, 2>;
    case 3: return &attend_chunk<KIND, 3>;
    default: return &attend_chunk<KIND, 4>;
  }
}
ChunkFn chunk_fn(int kind, int rb) {
  switch (kind) {
    case kI8: return chunk_fn_of<kI8>(rb);
    case kI4: return chunk_fn_of<kI4>(rb);
    case kF32: return chunk_fn_of<kF32>(rb);
    case kBF16: return chunk_fn_of<kBF16>(rb);
    default: return chunk_fn_of<kF16>(rb);
  }
}

// (m, l, o) <- their fold with a later chunk's (mc, lc, oc): the running softmax rescaled to the larger max.
void fold(float& m, float& l, float* o, float mc, float lc, const float* oc, int64_t D) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  if (mc == kNone) return;
  if (m == kNone) {
    m = mc, l = lc;
    std::copy(oc, oc + D, o);
    return;
  }
  const float mx = std::max(m, mc), a = std::exp(m - mx), b = std::exp(mc - mx);
  l = l * a + lc * b;
  for (int64_t d = 0; d < D; ++d) o[d] = o[d] * a + oc[d] * b;
  m = mx;
}

}  // namespace

bool fast_groups(bool int4, int64_t G) { return int4 ? (G == 16 || G % 32 == 0) : G % 16 == 0; }

std::vector<Chunk> chunk_table(int kind, int64_t D, int64_t G) {
  std::vector<Chunk> t;
  for (int64_t e = 0; e < D; e += 16) {
    const int64_t g = e / G, e0 = e - g * G;
    if (kind == kF32) t.push_back({int32_t(4 * e), 0, 0});
    else if (kind == kBF16 || kind == kF16) t.push_back({int32_t(2 * e), 0, 0});
    else if (kind == kI8) t.push_back({int32_t(e), int32_t(g), 0});
    else if (G == 16) t.push_back({int32_t(g * 8), int32_t(g), 3});
    else if (e0 < G / 2) t.push_back({int32_t(g * G / 2 + e0), int32_t(g), 1});
    else t.push_back({int32_t(g * G / 2 + e0 - G / 2), int32_t(g), 2});
  }
  return t;
}

const float* Side::scales(int64_t t, int64_t nt, detail::Scratch& buf) const {
  if (sh == nullptr) return sf == nullptr ? nullptr : sf + t * words;
  float* f = buf.get<float>(nt * words);
  const at::Half* h = sh + t * words;
  int64_t i = 0;
#if AQ_AVX512
  for (; i + 16 <= nt * words; i += 16)
    _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#elif AQ_AVX2 && defined(__F16C__)
  for (; i + 8 <= nt * words; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < nt * words; ++i) f[i] = float(h[i]);
  return f;
}

void attend_fast(int kind, const Side& k, const Side& v, const void* q, int qtype, float scale, const int64_t* P,
                 const bool* V, int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t T, int64_t D, void* out,
                 const float* sinks) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t rep = H / KVH, items = B * KVH * S, w = D + 2;  // a partial: m, l, o[D]
  const int nrb = int((rep + kRB - 1) / kRB);
  int64_t maxn = 0;
  for (int64_t s = 0; s < S; ++s) maxn = std::max(maxn, P[s] + 1);
  const int64_t nch = (maxn + kChunk - 1) / kChunk;
  // Chunks as items of their own only when the (b, kv head, query) items cannot keep the threads busy; a call
  // too small to pay a fork / join (a short cache) runs on the calling thread.
  const bool split = nch > 1 && items < 4 * at::get_num_threads();
  const int64_t grain = detail::grain_for(2 * rep * std::min(maxn, split ? kChunk : maxn) * D);
  std::vector<float> part(split ? items * nch * rep * w : 0);
  // A sink logit is a chunk (sink, 1, o = 0) of the softmax, folded after the slots' chunks: a term of the
  // denominator with no value (gpt-oss); with no slot before it the output stays 0.
  const std::vector<float> no_value(sinks != nullptr ? D : 0, 0.f);
  // The partial softmax (m, l, o) of chunk c of item `it` for each of its query heads into dst (rep x w).
  auto run = [&](int64_t it, int64_t c, float* dst) {
    const int64_t s = it % S, kv = (it / S) % KVH, b = it / (S * KVH), n = P[s] + 1;
    const int64_t t0 = c * kChunk, t1 = std::min(n, t0 + kChunk), base = (b * KVH + kv) * T;
    for (int rb = 0; rb < nrb; ++rb) {
      const int64_t r0 = rb * kRB, nr = std::min<int64_t>(kRB, rep - r0);
      float m[kRB], l[kRB];
      thread_local std::vector<float> qb, ob;
      qb.resize(kRB * D), ob.resize(kRB * D);
      for (int64_t r = 0; r < nr; ++r)  // the query row in fp32, times scale (as q.float() * scale)
        load_row(q, qtype, ((b * H + kv * rep + r0 + r) * S + s) * D, D, scale, qb.data() + r * D);
      std::fill(m, m + kRB, kNone);
      if (t0 < t1)
        chunk_fn(kind, int(nr))(k, v, base + t0, base + t1, V + b * T + t0, qb.data(), D, m, l, ob.data());
      for (int64_t r = 0; r < nr; ++r) {
        float* pr = dst + (r0 + r) * w;
        pr[0] = m[r], pr[1] = m[r] == kNone ? 0.f : l[r];
        if (m[r] != kNone) std::copy_n(ob.data() + r * D, D, pr + 2);
      }
    }
  };
  // Fold the chunks of item `it` (chunk c's partial at src(c)) in slot order and write its output rows.
  auto finish = [&](int64_t it, int64_t count, auto src) {
    const int64_t s = it % S, kv = (it / S) % KVH, b = it / (S * KVH);
    thread_local std::vector<float> acc;
    acc.resize(w);
    for (int64_t r = 0; r < rep; ++r) {
      acc[0] = kNone, acc[1] = 0.f;
      for (int64_t c = 0; c < count; ++c) {
        const float* pc = src(c) + r * w;
        fold(acc[0], acc[1], acc.data() + 2, pc[0], pc[1], pc + 2, D);
      }
      const int64_t y = ((b * H + kv * rep + r) * S + s) * D;
      if (sinks != nullptr) fold(acc[0], acc[1], acc.data() + 2, sinks[y / D], 1.f, no_value.data(), D);
      const bool none = acc[0] == kNone;  // no slot: 0, as sdpa gives a fully masked row
      const float inv = none ? 0.f : 1.f / acc[1];
      for (int64_t d = 0; d < D; ++d) acc[2 + d] = none ? 0.f : acc[2 + d] * inv;
      store_row(acc.data() + 2, D, out, qtype, y);
    }
  };
  if (split) {
    detail::parallel_dynamic(items * nch, grain,
                             [&](int64_t i, int64_t) { run(i / nch, i % nch, &part[i * rep * w]); });
    detail::parallel_dynamic(items, items, [&](int64_t it, int64_t) {  // the folds: D floats per chunk, inline
      finish(it, nch, [&](int64_t c) { return &part[(it * nch + c) * rep * w]; });
    });
    return;
  }
  detail::parallel_dynamic(items, grain, [&](int64_t it, int64_t) {
    const int64_t n = P[it % S] + 1, count = (n + kChunk - 1) / kChunk;
    thread_local std::vector<float> buf;
    buf.resize(count * rep * w);
    for (int64_t c = 0; c < count; ++c) run(it, c, buf.data() + c * rep * w);
    finish(it, count, [&](int64_t c) { return buf.data() + c * rep * w; });
  });
}

}  // namespace affineq::kv
