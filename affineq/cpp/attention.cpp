// affineq::kv_attention: attention of float queries over an int8 / int4 quantized KV cache, reading the codes
// directly (no float copy of the cache). Layout and math: affineq/cpp/kv_attention.py (the schema, the fake and
// the PyTorch reference live there).
//
// For each (batch b, query head h, query s), with kv head h / (H / KVH) and n = pos[s] + 1 slots:
//   score[t] = (q . K[t]) / sqrt(D) for slots t < n with valid[b, t], K[t, d] = scale[t, g(d)] * code[t, d]
//              [+ min[t, g(d)]]
//   p = softmax(score) over those slots (no slot: the output row is 0, as sdpa gives a fully masked row)
//   out = sum_t p[t] * V[t],  V[t, d] = v_scale[t, g(d)] * code[t, d] [+ v_min[t, g(d)]]
// fp32 products and accumulation. int8 codes: int8 [.., T, D], fp32 scales [.., T, D / G], value = scale * code.
// int4: uint8 [.., T, D / 2] with float16 (scale, min) pairs [.., T, 2 * D / G]; in group g of G elements, byte
// j < G / 2 holds element g*G + j in its low nibble and g*G + G/2 + j in its high nibble (llama.cpp's q4_1
// order), value = scale * nibble + min. Keys and values may have different group sizes.
//
// Fast path (groups of 16 dims or multiples, int4 groups of 16 or multiples of 32; all SIMD builds through
// simd.h's 16-lane vectors): one work item serves the H / KVH query heads that share a kv head (in blocks of up
// to 4), so each cache slot is decoded once per block, not once per query head; 16 dims of a slot are decoded
// to fp32 (scale applied) and multiplied into every query of the block; 16 slots' score vectors are summed
// across lanes together (reduce16). The slots are cut into chunks of kChunk: each chunk gives its softmax max m,
// sum l and unnormalised output o, and the chunks of a query are folded in slot order (fold), whether one item
// runs them one after another or, when (b, kv head, query) items are too few for the threads, each chunk is an
// item of its own: the result never depends on the thread count. Path 1 (tests) and other group sizes run the
// scalar loops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace affineq {
namespace {

struct Row {
  const void* codes;   // one cache slot of one kv head: D int8 codes or D / 2 int4 bytes
  const float* scale;  // its D / G group scales (int4: the slot's scales, converted from float16)
  const float* min;    // int4: its D / G group minimums; int8: unused
};

// The (scale, min) float16 pairs of one int4 slot as two fp32 arrays.
inline void unpack_pairs(const at::Half* pairs, int64_t ng, float* scale, float* min) {
  for (int64_t g = 0; g < ng; ++g) {
    scale[g] = float(pairs[2 * g]);
    min[g] = float(pairs[2 * g + 1]);
  }
}

// ---- scalar ---------------------------------------------------------------------------------------------
// qsum: the sum of q over each group (int4's min term)
float dot_scalar(const float* q, const float* qsum, Row r, int64_t D, int64_t G, bool int4) {
  float total = 0.f;
  for (int64_t g = 0; g < D / G; ++g) {
    float acc = 0.f;
    const float* qg = q + g * G;
    if (int4) {
      const uint8_t* c = static_cast<const uint8_t*>(r.codes) + g * G / 2;
      for (int64_t j = 0; j < G / 2; ++j) {
        acc += qg[j] * float(c[j] & 15);
        acc += qg[j + G / 2] * float(c[j] >> 4);
      }
      total += r.min[g] * qsum[g];
    } else {
      const int8_t* c = static_cast<const int8_t*>(r.codes) + g * G;
      for (int64_t j = 0; j < G; ++j) acc += qg[j] * float(c[j]);
    }
    total += acc * r.scale[g];
  }
  return total;
}

void axpy_scalar(float p, Row r, float* out, int64_t D, int64_t G, bool int4) {
  for (int64_t g = 0; g < D / G; ++g) {
    const float w = p * r.scale[g];
    float* og = out + g * G;
    if (int4) {
      const uint8_t* c = static_cast<const uint8_t*>(r.codes) + g * G / 2;
      const float m = p * r.min[g];
      for (int64_t j = 0; j < G / 2; ++j) {
        og[j] += w * float(c[j] & 15) + m;
        og[j + G / 2] += w * float(c[j] >> 4) + m;
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(r.codes) + g * G;
      for (int64_t j = 0; j < G; ++j) og[j] += w * float(c[j]);
    }
  }
}

// ---- fast path: 16 dims at a time through simd.h (AVX-512, AVX2 or the portable arrays) -----------------
using detail::F16;
using detail::I16;
using detail::sfor;

constexpr int64_t kChunk = 256;  // slots per softmax chunk (partial results folded in slot order)
constexpr int kRB = 4;           // query heads per block: 4 x 4 fp32 vectors of output stay in registers
constexpr int kDC = 4;           // 16-dim vectors of a value row per pass

// Where the 16 dims [16 c, 16 c + 16) of a slot's row live: int8 bytes, int4 low or high nibbles of 16 bytes, or
// (groups of 16) the low then high nibbles of 8 bytes; g = their group.
struct Chunk {
  int32_t byte;
  int32_t g;
  int8_t kind;  // 0 int8, 1 low nibbles, 2 high nibbles, 3 both nibbles of 8 bytes
};

bool fast_groups(bool int4, int64_t G) { return int4 ? (G == 16 || G % 32 == 0) : G % 16 == 0; }

std::vector<Chunk> chunk_table(bool int4, int64_t D, int64_t G) {
  std::vector<Chunk> t;
  for (int64_t e = 0; e < D; e += 16) {
    const int64_t g = e / G, e0 = e - g * G;
    if (!int4) t.push_back({int32_t(e), int32_t(g), 0});
    else if (G == 16) t.push_back({int32_t(g * 8), int32_t(g), 3});
    else if (e0 < G / 2) t.push_back({int32_t(g * G / 2 + e0), int32_t(g), 1});
    else t.push_back({int32_t(g * G / 2 + e0 - G / 2), int32_t(g), 2});
  }
  return t;
}

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

// The fp32 values of one 16-dim chunk of a slot: codes (sc: the slot's fp32 scales, int4 (scale, min) pairs).
template <bool I4>
AQ_INLINE F16 dequant16(const uint8_t* row, const float* sc, Chunk c) {
  using namespace detail;
  if constexpr (!I4) {
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
#else
  for (int i = 0; i < n; ++i) out[i] = detail::fhsum(detail::fload(m + 16 * i));
#endif
}

// s[i] = exp(s[i] - mx) for i < n; returns their sum. AVX-512: range reduction by ln 2 and a degree-7 Taylor
// polynomial (relative error ~1e-7, a few fp32 ulps), 2^k applied by vscalefps (underflow to 0, no overflow:
// s - mx <= 0); elsewhere std::exp. NaN stays NaN.
float exp_shifted(float* s, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0.f;
#if AQ_AVX512
  const __m512 lo = _mm512_set1_ps(-120.f), m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 x = _mm512_max_ps(lo, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m));  // -inf -> -120
    const __m512 kf = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 = hi + lo, hi * k exact
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    const __m512 e = _mm512_scalef_ps(p, kf);
    _mm512_mask_storeu_ps(s + i, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - mx));
#endif
  return sum;
}

// One side (keys or values) of the cache, for the fast path.
struct Side {
  const uint8_t* codes;  // slot t's row at codes + t * row_bytes
  int64_t row_bytes;
  const float* sf;       // int8: fp32 scales, `words` per slot
  const at::Half* sh;    // int4: float16 (scale, min) pairs, `words` per slot
  int64_t words;
  std::vector<Chunk> chunks;  // D / 16
  // The fp32 scale words of slots [t, t + nt): the tensor itself (int8) or converted into buf (int4).
  const float* scales(int64_t t, int64_t nt, detail::Scratch& buf) const {
    if (sh == nullptr) return sf + t * words;
    float* f = buf.get<float>(nt * words);
    const at::Half* h = sh + t * words;
    int64_t i = 0;
#if AQ_AVX512
    for (; i + 16 <= nt * words; i += 16)
      _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#endif
    for (; i < nt * words; ++i) f[i] = float(h[i]);
    return f;
  }
};

// s[r * ld + i] = q_r . K[t0 + i] for the RB queries q (RB rows of D, already scaled) and nt slots. NC: D / 16
// as a constant (the chunk loop unrolled, its table entries held in registers), or 0 (a loop over D / 16).
template <bool I4, int RB, int NC>
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
      const F16 x = dequant16<I4>(row, scl, c);
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
template <bool I4, int RB, int DC>
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
      const F16 x = dequant16<I4>(row, scl, v.chunks[c0 + AQ_CV(c)]);
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

thread_local detail::Scratch tl_kv_s, tl_kv_ks, tl_kv_vs;  // scores, key and value scales of a chunk

// The partial softmax of RB queries q over slots [t0, t1) of one (b, kv head) (t: absolute cache rows, ok:
// valid[b, ...] at t0): per query its max m (-inf: no slot), sum l and unnormalised output o [D].
template <bool I4, int RB>
void attend_chunk(const Side& k, const Side& v, int64_t t0, int64_t t1, const bool* ok, const float* q, int64_t D,
                  float* m, float* l, float* o) {
  const int64_t nt = t1 - t0, ld = (nt + 15) / 16 * 16;
  float* s = tl_kv_s.get<float>(RB * ld);
  const float* ksc = k.scales(t0, nt, tl_kv_ks);
  switch (D) {  // the head sizes of the models people run get the unrolled loop
    case 64: block_scores<I4, RB, 4>(k, t0, nt, ksc, q, D, s, ld); break;
    case 128: block_scores<I4, RB, 8>(k, t0, nt, ksc, q, D, s, ld); break;
    default: block_scores<I4, RB, 0>(k, t0, nt, ksc, q, D, s, ld); break;
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
      case 1: block_values<I4, RB, 1>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
      case 2: block_values<I4, RB, 2>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
      case 3: block_values<I4, RB, 3>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
      default: block_values<I4, RB, 4>(v, t0, nt, vsc, ok, s, ld, c0, o, D); break;
    }
  }
}

using ChunkFn = void (*)(const Side&, const Side&, int64_t, int64_t, const bool*, const float*, int64_t, float*,
                         float*, float*);
template <bool I4>
ChunkFn chunk_fn(int rb) {
  switch (rb) {
    case 1: return &attend_chunk<I4, 1>;
    case 2: return &attend_chunk<I4, 2>;
    case 3: return &attend_chunk<I4, 3>;
    default: return &attend_chunk<I4, 4>;
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

// The fast path: out [B, H, S, D] fp32 from the scaled fp32 queries qs [B, H, S, D].
void attend_fast(bool int4, const Side& k, const Side& v, const float* qs, const int64_t* P, const bool* V,
                 int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t T, int64_t D, float* out) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t rep = H / KVH, items = B * KVH * S, w = D + 2;  // a partial: m, l, o[D]
  const int nrb = int((rep + kRB - 1) / kRB);
  int64_t maxn = 0;
  for (int64_t s = 0; s < S; ++s) maxn = std::max(maxn, P[s] + 1);
  const int64_t nch = (maxn + kChunk - 1) / kChunk;
  // Chunks as items of their own only when the (b, kv head, query) items cannot keep the threads busy.
  const bool split = nch > 1 && items < 4 * at::get_num_threads();
  std::vector<float> part(split ? items * nch * rep * w : 0);
  // The partial softmax (m, l, o) of chunk c of item `it` for each of its query heads into dst (rep x w).
  auto run = [&](int64_t it, int64_t c, float* dst) {
    const int64_t s = it % S, kv = (it / S) % KVH, b = it / (S * KVH), n = P[s] + 1;
    const int64_t t0 = c * kChunk, t1 = std::min(n, t0 + kChunk), base = (b * KVH + kv) * T;
    for (int rb = 0; rb < nrb; ++rb) {
      const int64_t r0 = rb * kRB, nr = std::min<int64_t>(kRB, rep - r0);
      float m[kRB], l[kRB];
      thread_local std::vector<float> qb, ob;
      qb.resize(kRB * D), ob.resize(kRB * D);
      for (int64_t r = 0; r < nr; ++r)
        std::copy_n(qs + ((b * H + kv * rep + r0 + r) * S + s) * D, D, qb.data() + r * D);
      std::fill(m, m + kRB, kNone);
      if (t0 < t1)
        (int4 ? chunk_fn<true>(int(nr)) : chunk_fn<false>(int(nr)))(k, v, base + t0, base + t1, V + b * T + t0,
                                                                    qb.data(), D, m, l, ob.data());
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
    std::vector<float> acc(w);
    for (int64_t r = 0; r < rep; ++r) {
      acc[0] = kNone, acc[1] = 0.f;
      for (int64_t c = 0; c < count; ++c) {
        const float* pc = src(c) + r * w;
        fold(acc[0], acc[1], acc.data() + 2, pc[0], pc[1], pc + 2, D);
      }
      float* y = out + ((b * H + kv * rep + r) * S + s) * D;
      if (acc[0] == kNone) {  // no slot: 0, as sdpa gives a fully masked row
        std::fill(y, y + D, 0.f);
        continue;
      }
      const float inv = 1.f / acc[1];
      for (int64_t d = 0; d < D; ++d) y[d] = acc[2 + d] * inv;
    }
  };
  if (split) {
    detail::parallel_dynamic(items * nch, 1, [&](int64_t i, int64_t) { run(i / nch, i % nch, &part[i * rep * w]); });
    detail::parallel_dynamic(items, 1, [&](int64_t it, int64_t) {
      finish(it, nch, [&](int64_t c) { return &part[(it * nch + c) * rep * w]; });
    });
    return;
  }
  detail::parallel_dynamic(items, 1, [&](int64_t it, int64_t) {
    const int64_t n = P[it % S] + 1, count = (n + kChunk - 1) / kChunk;
    thread_local std::vector<float> buf;
    buf.resize(count * rep * w);
    for (int64_t c = 0; c < count; ++c) run(it, c, buf.data() + c * rep * w);
    finish(it, count, [&](int64_t c) { return buf.data() + c * rep * w; });
  });
}

using DotFn = float (*)(const float*, const float*, Row, int64_t, int64_t, bool);
using AxpyFn = void (*)(float, Row, float*, int64_t, int64_t, bool);

// path: 0 = best for this build and shape, 1 = scalar (tests compare the two)
at::Tensor kv_attention_impl(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                             const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& pos,
                             const at::Tensor& valid, int64_t path) {
  constexpr const char* op = "affineq::kv_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, H, S, D], got ", q.sizes());
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, op,
              ": q must be float32, bfloat16 or float16, got ", qt);
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const bool int4 = k_codes.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || k_codes.scalar_type() == at::kChar, op, ": k_codes must be int8 (int8 cache) or uint8 "
              "(int4 cache), got ", k_codes.scalar_type());
  TORCH_CHECK(v_codes.scalar_type() == k_codes.scalar_type() && v_codes.sizes() == k_codes.sizes(), op,
              ": v_codes must match k_codes, got ", v_codes.scalar_type(), " ", v_codes.sizes(), " and ",
              k_codes.scalar_type(), " ", k_codes.sizes());
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(0) == B && k_codes.size(3) == (int4 ? D / 2 : D) &&
                  H % k_codes.size(1) == 0,
              op, ": k_codes must be [B, KVH, T, ", (int4 ? "D / 2" : "D"), "] with KVH dividing H, got ",
              k_codes.sizes(), " for q ", q.sizes());
  const int64_t KVH = k_codes.size(1), T = k_codes.size(2);
  // int8: fp32 scales [B, KVH, T, D / G]; int4: float16 (scale, min) pairs [B, KVH, T, 2 * D / G]
  const auto st = int4 ? at::kHalf : at::kFloat;
  const int64_t per_group = int4 ? 2 : 1;
  for (const at::Tensor* t : {&k_scale, &v_scale})
    TORCH_CHECK(t->scalar_type() == st && t->dim() == 4 && t->size(0) == B && t->size(1) == KVH &&
                    t->size(2) == T && t->size(3) > 0 && t->size(3) % per_group == 0 &&
                    D % (t->size(3) / per_group) == 0,
                op, ": k_scale and v_scale must be ",
                (int4 ? "float16 [B, KVH, T, 2 * D / group_size] (scale, min pairs) for an int4 cache"
                      : "float32 [B, KVH, T, D / group_size] for an int8 cache"),
                ", got ", t->scalar_type(), " ", t->sizes());
  const int64_t ngk = k_scale.size(3) / per_group, ngv = v_scale.size(3) / per_group;
  const int64_t Gk = D / ngk, Gv = D / ngv;
  TORCH_CHECK(!int4 || (Gk % 2 == 0 && Gv % 2 == 0), op, ": int4 groups must have an even size, got ", Gk,
              " and ", Gv);
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == S, op,
              ": pos must be int64 [S] = [", S, "], got ", pos.scalar_type(), " ", pos.sizes());
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 2 && valid.size(0) == B && valid.size(1) == T, op,
              ": valid must be bool [B, T] = [", B, ", ", T, "], got ", valid.scalar_type(), " ", valid.sizes());
  for (const at::Tensor* t : {&q, &k_codes, &k_scale, &v_codes, &v_scale, &pos, &valid})
    TORCH_CHECK(t->device().is_cpu(), op, ": every tensor must be on the CPU, got ", t->device());

  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor kc = k_codes.contiguous(), vc = v_codes.contiguous();
  const at::Tensor ks = k_scale.contiguous(), vs = v_scale.contiguous();
  const at::Tensor ps = pos.contiguous(), vl = valid.contiguous();
  const int64_t* P = ps.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(P[s] >= 0 && P[s] < T, op, ": pos[", s, "] = ", P[s], " is outside the cache [0, ", T, ")");
  at::Tensor out = at::empty({B, H, S, D}, qf.options());

  const int64_t row_bytes = int4 ? D / 2 : D, rep = H / KVH;
  const int64_t ksw = ngk * per_group, vsw = ngv * per_group;  // scale words per slot
  const auto* kcp = static_cast<const uint8_t*>(kc.data_ptr());
  const auto* vcp = static_cast<const uint8_t*>(vc.data_ptr());
  const bool* V = vl.data_ptr<bool>();
  const float* Q = qf.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float sm = 1.f / std::sqrt(float(D));
  // One slot's scales (and int4 mins) as fp32 pointers: int8 reads the tensor, int4 converts its pairs into buf.
  const float* ksf = int4 ? nullptr : ks.data_ptr<float>();
  const float* vsf = int4 ? nullptr : vs.data_ptr<float>();
  const at::Half* ksh = int4 ? ks.data_ptr<at::Half>() : nullptr;
  const at::Half* vsh = int4 ? vs.data_ptr<at::Half>() : nullptr;
  if (path == 0 && fast_groups(int4, Gk) && fast_groups(int4, Gv)) {
    const Side kside{kcp, row_bytes, ksf, ksh, ksw, chunk_table(int4, D, Gk)};
    const Side vside{vcp, row_bytes, vsf, vsh, vsw, chunk_table(int4, D, Gv)};
    at::Tensor qsc = qf.mul(sm);  // the queries scaled once: scores are q . k / sqrt(D), as the scalar loop's
    attend_fast(int4, kside, vside, qsc.data_ptr<float>(), P, V, B, H, KVH, S, T, D, O);
    return qt == at::kFloat ? out : out.to(qt);
  }
  DotFn dot = dot_scalar;
  AxpyFn axpy = axpy_scalar;
  auto slot_row = [&](const uint8_t* codes, const float* sf, const at::Half* sh, int64_t words, int64_t ng,
                      int64_t slot, float* buf) -> Row {
    if (!int4) return Row{codes + slot * row_bytes, sf + slot * words, nullptr};
    unpack_pairs(sh + slot * words, ng, buf, buf + ng);
    return Row{codes + slot * row_bytes, buf, buf + ng};
  };

  at::parallel_for(0, B * H * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(T), qs(D), qsum(ngk), kbuf(2 * ngk), vbuf(2 * ngv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % S, h = (item / S) % H, b = item / (S * H);
      const int64_t kv = h / rep, n = P[s] + 1;
      const int64_t base = (b * KVH + kv) * T;  // slot 0 of this (b, kv head)
      for (int64_t d = 0; d < D; ++d) qs[d] = Q[item * D + d] * sm;
      for (int64_t g = 0; g < ngk; ++g) {
        float acc = 0.f;
        for (int64_t j = 0; j < Gk; ++j) acc += qs[g * Gk + j];
        qsum[g] = acc;
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) {
        if (!V[b * T + t]) continue;
        const Row kr = slot_row(kcp, ksf, ksh, ksw, ngk, base + t, kbuf.data());
        score[t] = dot(qs.data(), qsum.data(), kr, D, Gk, int4);
        mx = std::max(mx, score[t]);
      }
      float* o = O + item * D;
      std::fill(o, o + D, 0.f);
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // no key (a pad query): 0, as sdpa
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        if (!V[b * T + t]) continue;
        score[t] = std::exp(score[t] - mx);
        sum += score[t];
      }
      const float inv = 1.f / sum;
      for (int64_t t = 0; t < n; ++t) {
        if (!V[b * T + t]) continue;
        axpy(score[t] * inv, slot_row(vcp, vsf, vsh, vsw, ngv, base + t, vbuf.data()), o, D, Gv, int4);
      }
    }
  });
  return qt == at::kFloat ? out : out.to(qt);
}

at::Tensor kv_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                            const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& pos,
                            const at::Tensor& valid) {
  return kv_attention_impl(q, k_codes, k_scale, v_codes, v_scale, pos, valid, 0);
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) { m.impl("kv_attention", &affineq::kv_attention_cpu); }

TORCH_LIBRARY_FRAGMENT(affineq_cpp, m) {
  m.def("kv_attention_path(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, Tensor pos, "
        "Tensor valid, int path) -> Tensor",
        &affineq::kv_attention_impl);
}
