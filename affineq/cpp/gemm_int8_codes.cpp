// Int8CodesGemm: y = dequantize(int8 codes of x) @ W^T for a dense 8-bit integer weight, with the products of
// codes summed exactly in int32 by VNNI u8 x s8 dot products (vpdpbusd: 4 MACs per int32 lane, twice
// vpdpwssd's rate and four times an fp32 FMA's). The recurrence of a dynamically quantized LSTM / GRU
// (recurrent.cpp) multiplies the int8-quantized state by W_hh every step; this is that product.
//
// Layout read: a full 16-row panel of 8-bit codes is [k][16 rows] bytes (see affineq/cpp/__init__.py), so
// the four codes of k .. k + 3 for 16 rows are 64 consecutive bytes; one vpermb turns them into 16 int32 lanes
// of 4 consecutive-k bytes (the VNNI operand), reused by every row of x. Per group g of the weight:
//   I[m, n] = sum_{k in g} c[m, k] * u[n, k] - zp[m] * sum_{k in g} u[n, k]     (int32, exact)
//   S[m]    = sum_{k in g} c[m, k] - zp[m] * |g|                                 (int32, exact)
//   acc[m, n] += scale[n, g] * I + offset[n, g] * S                             (fp32, in registers)
//   y[m, n] = sx[m] * acc[m, n]
// which is sx * sum_k (c - zp) * (scale * u + offset), i.e. x_fake_quant @ W^T with exact code products.
// 4-bit weights: up to kFewRowsMax rows of x, gemv4 reads the packed 4-bit units in place; more rows share a
// widened 8-bit copy of each work item's panels (widen_panels) with the tiles above. Per-channel weights on a CPU
// with AMX: from kAmxMinRows rows, AMX int8 tiles (amx_tiles) instead of the VNNI tiles, the same values.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "amx.h"
#include "common.h"  // load_qparams
#include "lowbit_kernels.h"
#include "simd.h"

#if AQ_VNNI && defined(__AVX512VBMI__)
#define AQ_INT8_CODES 1
#endif

namespace affineq {

struct Int8CodesGemm::State {
  int64_t n = 0, k = 0, gs = 0, G = 0;
  int bits = 8;  // 8, or 4: each item's panels are widened to the 8-bit layout first (widen_panels)
  const uint8_t* packed = nullptr;
  LowbitProblem p;                // the weight (per_item: its qparams are read per work item)
  bool per_item = false, zero_points = false;
  std::vector<float> sT, oT;      // [G][n]: scale / offset transposed, so 16 rows' values are one load
  std::vector<int32_t> usumT;     // [G][n]: sum of the codes of each group (only when zero points occur)
  int8_t* codes = nullptr;        // [m][k] per-run scratch (the calling thread's, tl_codes)
  int8_t* codes4 = nullptr;       // [m][k] codes in gemv4's even / odd order (4-bit weights, few rows), or as
                                  // AMX A tiles (int8_quantize_rows's amx_tiles) (tl_codes4)
  std::vector<float> sx;          // [m]
  std::vector<int32_t> zp, csum;  // [m], [m][G]
  std::vector<float> S;           // [m][G]: csum - zp * gs, as fp32 (exact: |S| < 2^24)
  uint16_t* yb = nullptr;         // y as bf16 when the run writes bf16 (then the tiles' y is null)
  bool y_round = false;           // fp32 y written as its bf16 values (run's bf16_values)
  const float* bias = nullptr;    // [n], added to y as it is stored (run's bias)
};

namespace {
// Rows of x per register block. The tile is NP 16-row weight panels x MR rows of x: NP * MR int32 and as many
// fp32 accumulators plus NP weight registers, a broadcast and the vpermb index must fit the 32 zmm registers:
// NP * MR <= 12 (4 x 3, 2 x 6, 1 x 12).
constexpr int kRows = 12;
// AMX tiles (amx_tiles): rows of x per chunk of a work item (a multiple of 32): their A tiles, at most 512 KiB,
// stay in L2 (2 MiB on the AMX Xeons) while the item's panels pass over them.
inline int64_t amx_row_chunk(int64_t k) { return std::max<int64_t>(32, (int64_t{1} << 19) / k / 32 * 32); }
}  // namespace

#if AQ_INT8_CODES
namespace {

using detail::sfor;

using detail::quad_index;

// Rows [m0, m0 + MR) of x (their codes read in place: q = row m0 of the row-major [m][k] codes) against NP
// consecutive 16-row panels starting at panel p0 (weight rows 16 p0 ..); y rows have stride n. The NP * MR
// accumulators are independent dependency chains, so even MR = 1 keeps the VNNI unit busy when NP = 4.
// w0: panel p0's 8-bit codes ([k][16 rows] bytes per panel, the panels consecutive).
// Qparams of the tile's panels: scale, offset and (zero points) code-sum rows [G][ld], 16 per panel, from the
// tile's first panel on.
// s16 (per-item tiles of a weight with 16-bit scales and no offset array): the scales as stored, transposed
// (load_scales16), widened per use, and offset = scale * code_offset, the values load_qparams would have written
// (both exact), at half its bytes and without the offset tile.
struct TileQparams {
  const float *sT, *oT;
  const int32_t* us;
  int64_t ld;
  const uint16_t* s16 = nullptr;
  bool f16 = false;
  float code_offset = 0.f;
  TileQparams shifted(int64_t panels) const {
    return {sT ? sT + 16 * panels : sT, oT ? oT + 16 * panels : oT, us ? us + 16 * panels : us, ld,
            s16 ? s16 + 16 * panels : s16, f16, code_offset};
  }
  // The scales and offsets of group g's rows in panel j (16 lanes).
  AQ_INLINE __m512 scale(int64_t g, int j) const {
    if (s16 == nullptr) return _mm512_loadu_ps(sT + g * ld + 16 * j);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16 + g * ld + 16 * j));
    return f16 ? _mm512_cvtph_ps(h) : detail::bf16_widen(h);
  }
  AQ_INLINE __m512 offset(int64_t g, int j, __m512 sc) const {
    if (s16 == nullptr) return _mm512_loadu_ps(oT + g * ld + 16 * j);
    return code_offset == 0.f ? _mm512_setzero_ps() : _mm512_mul_ps(sc, _mm512_set1_ps(code_offset));
  }
};

// y[m, 16 c .. 16 c + 15] = v, as fp32, or rounded to bf16 (s.yb), or as those bf16 values widened (s.y_round);
// plus the bias where there is one, added to the stored value as a separate add of the bias would add it (bf16 y:
// rounded, the sum formed in fp32 and rounded again, as aten's bf16 add does).
AQ_INLINE void store_y(const Int8CodesGemm::State& s, float* y, int64_t m, int64_t c, __m512 v) {
  if (s.yb != nullptr) {
    __m256i r = detail::bf16_bits(v);
    if (s.bias != nullptr)
      r = detail::bf16_bits(_mm512_add_ps(detail::bf16_widen(r), _mm512_loadu_ps(s.bias + 16 * c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.yb + m * s.n + 16 * c), r);
    return;
  }
  if (s.y_round) v = detail::bf16_widen(detail::bf16_bits(v));
  if (s.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(s.bias + 16 * c));
  _mm512_storeu_ps(y + m * s.n + 16 * c, v);
}

// Group g's epilogue for NP panels x MR rows of int32 sums (us(j): panel j's code sums of the group, asked for
// only by rows with a zero point): I = acc - zp * usum, then facc += scale * I + offset * S, or (kOne) y written.
// It stays in registers (a y read-modify-write per group cost more than the dot products of a group of 32).
// Row m's int32 sums of a group less the zero point's share: I = acc - zp[m] * usum (usum(): the group's code sums
// of the 16 weight rows, read only for a row with a zero point).
template <class Usum>
AQ_INLINE __m512i less_zero_point(const Int8CodesGemm::State& s, int64_t m, __m512i acc, Usum usum) {
  const int32_t z = s.zp[m];
  return z == 0 ? acc : _mm512_sub_epi32(acc, _mm512_mullo_epi32(_mm512_set1_epi32(z), usum()));
}

// y[m, 16 c .. 16 c + 15] of a one-group (per-channel) weight from row m's sums I: sx * (scale * I + offset * S).
AQ_INLINE void store_one_group(const Int8CodesGemm::State& s, float* y, int64_t m, int64_t c, __m512 sc, __m512 of,
                               __m512i I) {
  const __m512 t = _mm512_fmadd_ps(of, _mm512_set1_ps(s.S[m * s.G]), _mm512_mul_ps(sc, _mm512_cvtepi32_ps(I)));
  store_y(s, y, m, c, _mm512_mul_ps(_mm512_set1_ps(s.sx[m]), t));
}

template <int NP, int MR, bool kOne, class Usum>
AQ_INLINE void group_epilogue(const Int8CodesGemm::State& s, const TileQparams& qp, int64_t g, int64_t p0,
                              int64_t m0, float* y, const __m512i (&acc)[NP][MR],
                              __m512 (&facc)[kOne ? 1 : NP][kOne ? 1 : MR], Usum us) {
  sfor<NP>([&](auto J_) {
    constexpr int j = AQ_CV(J_);
    const __m512 sc = qp.scale(g, j), of = qp.offset(g, j, sc);
    sfor<MR>([&](auto I_) {
      constexpr int i = AQ_CV(I_);
      const int64_t m = m0 + i;
      const __m512i prod = less_zero_point(s, m, acc[j][i], [&] { return us(j); });
      if constexpr (kOne) {
        store_one_group(s, y, m, p0 + j, sc, of, prod);
      } else {
        facc[j][i] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(prod), facc[j][i]);
        facc[j][i] = _mm512_fmadd_ps(of, _mm512_set1_ps(s.S[m * s.G + g]), facc[j][i]);
      }
    });
  });
}

// y = sx * facc for the tile's rows (several groups).
template <int NP, int MR>
AQ_INLINE void store_tile(const Int8CodesGemm::State& s, int64_t p0, int64_t m0, float* y, const __m512 (&facc)[NP][MR]) {
  sfor<NP>([&](auto J_) {
    constexpr int j = AQ_CV(J_);
    sfor<MR>([&](auto I_) {
      constexpr int i = AQ_CV(I_);
      const int64_t m = m0 + i;
      store_y(s, y, m, p0 + j, _mm512_mul_ps(_mm512_set1_ps(s.sx[m]), facc[j][i]));
    });
  });
}

// kOne: one group (a per-channel weight): y is written straight from the int32 sums, with no fp32 accumulators
// (more rows per tile: NP * MR <= 24).
template <int NP, int MR, bool kOne>
void tile(const Int8CodesGemm::State& s, const TileQparams& qp, const int8_t* q, const uint8_t* w0, int64_t p0,
          int64_t m0, float* y) {
  // Four row pointers and one stride address the 12 rows with few registers.
  const int8_t* xr[4] = {q, q + 3 * s.k, q + 6 * s.k, q + 9 * s.k};
  const __m512i idx = quad_index();
  __m512 facc[kOne ? 1 : NP][kOne ? 1 : MR];
  if constexpr (!kOne)
    sfor<NP>([&](auto J_) { sfor<MR>([&](auto I_) { facc[AQ_CV(J_)][AQ_CV(I_)] = _mm512_setzero_ps(); }); });
  for (int64_t g = 0; g < s.G; ++g) {
    __m512i acc[NP][MR];
    sfor<NP>([&](auto J_) {
      sfor<MR>([&](auto I_) { acc[AQ_CV(J_)][AQ_CV(I_)] = _mm512_setzero_si512(); });
    });
    const int64_t q0 = g * s.gs / 4, q1 = q0 + s.gs / 4;
    for (int64_t kq = q0; kq < q1; ++kq) {
      __m512i w[NP];
      sfor<NP>([&](auto J_) {
        constexpr int j = AQ_CV(J_);
        w[j] = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(w0 + j * 16 * s.k + 64 * kq));
      });
      sfor<MR>([&](auto I_) {
        constexpr int i = AQ_CV(I_);
        int32_t quad;
        std::memcpy(&quad, xr[i / 3] + (i % 3) * s.k + 4 * kq, sizeof(quad));
        const __m512i b = _mm512_set1_epi32(quad);
        sfor<NP>([&](auto J_) {
          constexpr int j = AQ_CV(J_);
          acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], w[j], b);
        });
      });
    }
    group_epilogue<NP, MR, kOne>(s, qp, g, p0, m0, y, acc, facc,
                                 [&](int j) { return _mm512_loadu_si512(qp.us + g * qp.ld + 16 * j); });
  }
  if constexpr (!kOne) store_tile<NP, MR>(s, p0, m0, y, facc);
}

// 4-bit weights at few rows of x (up to kFewRowsMax, MR <= 6 per call: a widened copy per item would cost more
// than the dot products): the dense 4-bit units are read in place. A unit is 64 bytes, 8 k x 16 rows, its slot t holding k = 2t in the
// low nibbles and 2t + 1 in the high ones; one vpermb gives lane j row j's four slot bytes, whose low and high
// nibbles are two VNNI operands against x's even-k and odd-k quads (q4: each row's codes with every 8 k ordered
// 0 2 4 6 1 3 5 7, `even_odd_codes`). The code sums a zero point needs come from one more dot product per unit
// (low + high nibbles against ones) instead of a pass over the codes. The int32 sums and the epilogue are the
// widened tile's, so the outputs are bit-identical to it.
// pf (or null): what the thread's next work item starts with, prefetched a little per group.
template <int NP, int MR, bool kOne>
void gemv4(const Int8CodesGemm::State& s, const TileQparams& qp, const int8_t* q4, const uint8_t* w0, int64_t p0,
           int64_t m0, float* y, const detail::NextItemPrefetch* pf) {
  const __m512i idx = quad_index(), lo4 = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
  bool zero_point = false;
  for (int i = 0; i < MR; ++i) zero_point |= s.zp[m0 + i] != 0;
  __m512 facc[kOne ? 1 : NP][kOne ? 1 : MR];
  if constexpr (!kOne)
    sfor<NP>([&](auto J_) { sfor<MR>([&](auto I_) { facc[AQ_CV(J_)][AQ_CV(I_)] = _mm512_setzero_ps(); }); });
  for (int64_t g = 0; g < s.G; ++g) {
    if (pf) pf->group(g);
    __m512i acc[NP][MR], us[NP];
    sfor<NP>([&](auto J_) {
      us[AQ_CV(J_)] = _mm512_setzero_si512();
      sfor<MR>([&](auto I_) { acc[AQ_CV(J_)][AQ_CV(I_)] = _mm512_setzero_si512(); });
    });
    for (int64_t u = g * s.gs / 8, u1 = u + s.gs / 8; u < u1; ++u) {
      sfor<NP>([&](auto J_) {
        constexpr int j = AQ_CV(J_);
        const uint8_t* unit = w0 + j * 8 * s.k + 64 * u;
        __builtin_prefetch(unit + 64 * detail::kPrefetchUnits, 0, 3);  // cold weights: the panel's stream ahead
        const __m512i w = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(unit));
        const __m512i lo = _mm512_and_si512(w, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4);
        if (zero_point) us[j] = _mm512_dpbusd_epi32(us[j], _mm512_add_epi8(lo, hi), ones);
        sfor<MR>([&](auto I_) {
          constexpr int i = AQ_CV(I_);
          int32_t even, odd;
          std::memcpy(&even, q4 + i * s.k + 8 * u, sizeof(even));
          std::memcpy(&odd, q4 + i * s.k + 8 * u + 4, sizeof(odd));
          acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], lo, _mm512_set1_epi32(even));
          acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], hi, _mm512_set1_epi32(odd));
        });
      });
    }
    group_epilogue<NP, MR, kOne>(s, qp, g, p0, m0, y, acc, facc, [&](int j) { return us[j]; });
  }
  if constexpr (!kOne) store_tile<NP, MR>(s, p0, m0, y, facc);
}

// x's codes [m][k] with every 8 k reordered 0 2 4 6 1 3 5 7 (gemv4's even / odd quads); k % 8 == 0.
void even_odd_codes(const int8_t* codes, int64_t m, int64_t k, int8_t* out) {
  alignas(64) uint8_t idx[64];
  for (int b = 0; b < 64; ++b) idx[b] = static_cast<uint8_t>((b & ~7) + (b % 8 < 4 ? 2 * (b % 4) : 2 * (b % 4) + 1));
  const __m512i perm = _mm512_load_si512(idx);
  const int64_t total = m * k, full = total / 64 * 64;  // rows are 8-aligned, so 64-byte blocks never split an 8
  for (int64_t i = 0; i < full; i += 64)
    _mm512_storeu_si512(out + i, _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(codes + i)));
  for (int64_t i = full; i < total; ++i) out[i] = codes[(i & ~int64_t{7}) + idx[i % 8]];
}

using TileFn = void (*)(const Int8CodesGemm::State&, const TileQparams&, const int8_t*, const uint8_t*, int64_t,
                        int64_t, float*);
template <int NP, bool kOne, int... Is>
constexpr std::array<TileFn, sizeof...(Is)> tile_table(std::integer_sequence<int, Is...>) {
  return {&tile<NP, Is + 1, kOne>...};
}
// Row blocks: grouped weights (fp32 accumulators) 4 panels x <= 3 rows, else 2 panels x <= 6 rows; one group
// 4 panels x <= 6 rows, else 2 panels x <= 12. Single panels: up to 12 rows.
struct TileSet {
  int wide, half;  // rows of the 4-panel and the 2-panel tiles
  const TileFn *t4, *t2, *t1;
};
constexpr auto kTiles4 = tile_table<4, false>(std::make_integer_sequence<int, 3>{});
constexpr auto kTiles2 = tile_table<2, false>(std::make_integer_sequence<int, 6>{});
constexpr auto kTiles1 = tile_table<1, false>(std::make_integer_sequence<int, kRows>{});
constexpr auto kOneTiles4 = tile_table<4, true>(std::make_integer_sequence<int, 6>{});
constexpr auto kOneTiles2 = tile_table<2, true>(std::make_integer_sequence<int, kRows>{});
constexpr auto kOneTiles1 = tile_table<1, true>(std::make_integer_sequence<int, kRows>{});
constexpr TileSet kGrouped{3, 6, kTiles4.data(), kTiles2.data(), kTiles1.data()};
constexpr TileSet kOneGroup{6, kRows, kOneTiles4.data(), kOneTiles2.data(), kOneTiles1.data()};

// gemv4 for 1..kFewRows4 rows: 4 panels x <= 2 rows, 2 panels x <= 4, single panels x <= 6 (the int32 and fp32
// accumulators, the panels' code sums, the decoded unit and the constants within the 32 zmm registers).
// Tables [kOne][rows - 1].
constexpr int kFewRows4 = 6;
// Up to this many rows of x, 4-bit weights take gemv4 (in blocks of kFewRows4 rows); from there on the rows of an
// item share one widened copy of its panels (the dot products then outweigh the decode).
constexpr int64_t kFewRowsMax = 8;
using Gemv4Fn = void (*)(const Int8CodesGemm::State&, const TileQparams&, const int8_t*, const uint8_t*, int64_t,
                         int64_t, float*, const detail::NextItemPrefetch*);
template <int NP, bool kOne, int... Is>
constexpr std::array<Gemv4Fn, sizeof...(Is)> gemv4_table(std::integer_sequence<int, Is...>) {
  return {&gemv4<NP, Is + 1, kOne>...};
}
template <int NP, int R>
constexpr std::array<Gemv4Fn, R> kGemv4[2] = {gemv4_table<NP, false>(std::make_integer_sequence<int, R>{}),
                                             gemv4_table<NP, true>(std::make_integer_sequence<int, R>{})};

#if AQ_AMX
// AMX int8 tiles for per-channel weights (one group: W8A8), from this many rows of x on (tdpbsud: s8 codes of x
// times u8 codes of W, 16 x 16 int32 sums of 16 x 64 products per instruction, 16 times vpdpbusd's work). The
// int32 sums and the epilogue are the VNNI tiles', so the outputs are bit-identical to them. Grouped weights
// (8da4w) keep the VNNI tiles: a group's epilogue per 32 or 128 k cost more than the tiles saved.
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kAmxK = 64;   // k per tile step (an A tile's 64 bytes)
constexpr int64_t kAmxKC = 512;  // k per slice: a slice's B tiles of 2 panels (16 KiB) stay in L1 for all rows

// Bytes of np panels' B tiles: the panel count rounded up to 2 (amx_tiles takes them in pairs).
inline int64_t b_tiles_bytes(int64_t np, int64_t k) { return (np + 1) / 2 * 2 * 16 * k; }

// np panels (w0: 8-bit codes, [k][16 rows] bytes each) as B tiles (b_tiles_bytes), with a zero panel to make a
// pair: bw[(j * k / 4 + kq) * 64 + 4 c + t] = u[row c of panel j, 4 kq + t].
void pack_b_tiles(const uint8_t* w0, int64_t np, int64_t k, uint8_t* bw) {
  const __m512i idx = quad_index();
  for (int64_t j = 0; j < b_tiles_bytes(np, k) / (16 * k); ++j)
    for (int64_t kq = 0; kq < k / 4; ++kq)
      _mm512_storeu_si512(bw + (j * k / 4 + kq) * 64,
                          j < np ? _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(w0 + j * 16 * k + 64 * kq))
                                 : _mm512_setzero_si512());
}

// Panels [p0, p0 + np) of a per-channel weight (bw: their B tiles, pack_b_tiles) for rows [m0, me) of x
// (m0 % 32 == 0; xa: its codes as A tiles, int8_quantize_rows's amx_tiles layout), in blocks of 32 rows x 2
// panels: tiles 0..3 sum C[row half][panel] over k-slices, carried across slices through memory, then one
// epilogue.
void amx_tiles(const Int8CodesGemm::State& s, const TileQparams& qp, const int8_t* xa, const uint8_t* bw, int64_t p0,
               int64_t np, int64_t m0, int64_t me, float* y) {
  thread_local std::vector<int32_t> cacc;  // [block][panel][32 rows][16]: the int32 sums
  const int64_t k = s.k, steps = k / kAmxK, nb = (me - m0 + 31) / 32;
  cacc.resize(nb * 1024);
  for (int64_t j0 = 0; j0 < np; j0 += 2) {
    const uint8_t* b0 = bw + j0 * 16 * k;
    const uint8_t* b1 = b0 + 16 * k;
    for (int64_t k0 = 0; k0 < k; k0 += kAmxKC) {
      const int64_t k1 = std::min(k, k0 + kAmxKC);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t mb = m0 + 32 * b;
        const int8_t* a0 = xa + (mb / 16) * steps * 1024;
        const int8_t* a1 = a0 + steps * 1024;
        int32_t* c = cacc.data() + b * 1024;  // [panel][row][column]
        if (k0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c, 64);
          _tile_loadd(1, c + 512, 64);
          _tile_loadd(2, c + 256, 64);
          _tile_loadd(3, c + 768, 64);
        }
        for (int64_t kk = k0; kk < k1; kk += kAmxK) {
          _tile_loadd(4, a0 + kk * 16, kAmxK);
          _tile_loadd(5, a1 + kk * 16, kAmxK);
          _tile_loadd(6, b0 + 16 * kk, 64);
          _tile_loadd(7, b1 + 16 * kk, 64);
          _tile_dpbsud(0, 4, 6);
          _tile_dpbsud(1, 4, 7);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 512, 64);
        _tile_stored(2, c + 256, 64);
        _tile_stored(3, c + 768, 64);
        if (k1 < k) continue;
        // group_epilogue<kOne>'s operations on the stored sums, so the VNNI tiles' values
        for (int64_t jj = 0; jj < std::min<int64_t>(2, np - j0); ++jj) {
          const int j = static_cast<int>(j0 + jj);
          const __m512 sc = qp.scale(0, j), of = qp.offset(0, j, sc);
          for (int64_t i = 0; i < std::min<int64_t>(32, me - mb); ++i) {
            const __m512i sums = _mm512_loadu_si512(c + (jj * 32 + i) * 16);
            const __m512i prod = less_zero_point(s, mb + i, sums, [&] { return _mm512_loadu_si512(qp.us + 16 * j); });
            store_one_group(s, y, mb + i, p0 + j, sc, of, prod);
          }
        }
      }
    }
  }
}
#endif

// np 4-bit panels (the dense layout: 64-byte units of 8 k x 16 rows, slot t of a unit holding k = 2t in the low
// nibbles and 2t + 1 in the high ones) as 8-bit panels ([k][16 rows] bytes): the codes unchanged.
void widen_panels(const uint8_t* src, int64_t np, int64_t k, uint8_t* dst) {
  const __m512i lo4 = _mm512_set1_epi8(15);
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t u = 0; u < np * k / 8; ++u) {  // the units of consecutive panels are consecutive too
    const __m512i unit = _mm512_loadu_si512(src + 64 * u);
    const __m512i lo = _mm512_and_si512(unit, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(unit, 4), lo4);
    _mm512_storeu_si512(dst + 128 * u, _mm512_permutex2var_epi64(lo, first, hi));        // k 0, 1, 2, 3
    _mm512_storeu_si512(dst + 128 * u + 64, _mm512_permutex2var_epi64(lo, second, hi));  // k 4, 5, 6, 7
  }
}

}  // namespace
#endif  // AQ_INT8_CODES

bool Int8CodesGemm::built() {
#if AQ_INT8_CODES
  return true;
#else
  return false;
#endif
}

bool Int8CodesGemm::supported(const LowbitProblem& p) {
#if AQ_INT8_CODES
  return (p.bits == 8 || p.bits == 4) && p.codes == kCodesUint && !p.qparams_e8m0 && !p.qparams_kquant &&
         p.n % 16 == 0 && p.group_size % 8 == 0 && p.k % p.group_size == 0;
#else
  (void)p;
  return false;
#endif
}

namespace {

void load_code_sums(const Int8CodesGemm::State& s, int64_t p0, int64_t np, int32_t* us, int64_t ld);

// The fp32 scale and offset of w = scale * u + offset of panels [p0, p0 + np), transposed to [G][ld] (the dense
// kernels' qparam loading), and with zero points (us not null) the code sums (load_code_sums).
void load_panel_qparams(const Int8CodesGemm::State& s, int64_t p0, int64_t np, float* sT, float* oT, int32_t* us,
                        int64_t ld) {
  detail::load_qparams(s.p, false, 1.f, 16 * p0, 16 * np, 16 * np, s.G, sT, ld);
  detail::load_qparams(s.p, true, 1.f, 16 * p0, 16 * np, 16 * np, s.G, oT, ld);
  if (us != nullptr) load_code_sums(s, p0, np, us, ld);
}

// us[g][16 q + j]: the sum of the codes of row j of panel p0 + q in group g (zero points' term), per k of an
// 8-bit panel (16 bytes), per unit of a 4-bit one (its 8 k are in one group: gs % 8 == 0).
void load_code_sums(const Int8CodesGemm::State& s, int64_t p0, int64_t np, int32_t* us, int64_t ld) {
#if AQ_INT8_CODES
  for (int64_t g = 0; g < s.G; ++g) std::fill(us + g * ld, us + g * ld + 16 * np, 0);
  const __m512i lo4 = _mm512_set1_epi8(15);
  for (int64_t q = 0; q < np; ++q) {
    const int64_t pn = p0 + q;
    for (int64_t k0 = 0; k0 < s.k; k0 += 8) {
      __m512i t;
      if (s.bits == 8) {
        t = _mm512_setzero_si512();
        for (int64_t k = k0; k < k0 + 8; ++k)
          t = _mm512_add_epi32(t, _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(s.packed + pn * 16 * s.k + 16 * k))));
      } else {  // the 4 slots' low + high nibbles (<= 120 per row: bytes suffice), then widened
        const __m512i unit = _mm512_loadu_si512(s.packed + pn * 8 * s.k + 8 * k0);
        __m512i b = _mm512_add_epi8(_mm512_and_si512(unit, lo4), _mm512_and_si512(_mm512_srli_epi16(unit, 4), lo4));
        b = _mm512_add_epi8(b, _mm512_shuffle_i64x2(b, b, 0x4E));  // slots 0 + 2, 1 + 3
        b = _mm512_add_epi8(b, _mm512_shuffle_i64x2(b, b, 0xB1));  // all four
        t = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(b));
      }
      int32_t* dst = us + (k0 / s.gs) * ld + 16 * q;
      _mm512_storeu_si512(dst, _mm512_add_epi32(_mm512_loadu_si512(dst), t));
    }
  }
#else
  (void)s, (void)p0, (void)np, (void)us, (void)ld;
#endif
}

// Work item tile pi's panels (first, count): quads of 4 panels, then the panels past the last quad one by one.
inline std::pair<int64_t, int64_t> panels_of(int64_t pi, int64_t nquad) {
  return pi < nquad ? std::pair<int64_t, int64_t>{4 * pi, 4} : std::pair<int64_t, int64_t>{4 * nquad + (pi - nquad), 1};
}

thread_local std::vector<float> tl_item_s, tl_item_o;  // per-item qparams (per_item)
thread_local std::vector<int32_t> tl_item_us;
thread_local std::vector<uint16_t> tl_item_s16;         // per-item 16-bit scales (TileQparams::s16)


}  // namespace

Int8CodesGemm::Int8CodesGemm(const LowbitProblem& p, bool zero_points, bool per_item) : s_(new State) {
  if (!supported(p)) {
    delete s_;
    throw std::invalid_argument("Int8CodesGemm: unsupported weight (check Int8CodesGemm::supported first)");
  }
  State& s = *s_;
  s.n = p.n, s.k = p.k, s.gs = p.group_size, s.G = p.k / p.group_size, s.packed = p.packed, s.bits = p.bits;
  s.p = p, s.per_item = per_item, s.zero_points = zero_points;
  if (per_item) return;
  s.sT.resize(s.G * s.n);
  s.oT.resize(s.G * s.n);
  if (zero_points) s.usumT.resize(s.G * s.n);
  load_panel_qparams(s, 0, s.n / 16, s.sT.data(), s.oT.data(), zero_points ? s.usumT.data() : nullptr, s.n);
}

Int8CodesGemm::~Int8CodesGemm() { delete s_; }

void Int8CodesGemm::run(const float* x, int64_t m, bool per_token, int mode, float eps, float* y) {
  run(x, nullptr, m, per_token, mode, eps, y, nullptr);
}

void Int8CodesGemm::run(const float* x, const uint16_t* x_bf16, int64_t m, bool per_token, int mode, float eps,
                        float* y, uint16_t* y_bf16, bool bf16_values, const float* bias) {
  State& s = *s_;
#if AQ_INT8_CODES && AQ_AMX
  const bool use_amx = s.G == 1 && s.k % kAmxK == 0 && m >= kAmxMinRows && detail::amx_cpu();
#else
  constexpr bool use_amx = false;
#endif
  // The codes live in the calling thread's buffers, kept between calls: a fresh [m][k] vector per call cost a
  // zero fill and page faults on the calling thread while the workers waited. The AMX tiles read them as A tiles,
  // written so by the quantization itself, with the rows of the last 32-row block past m zero.
  thread_local detail::Scratch tl_codes, tl_codes4;
  const int64_t mp = (m + 31) / 32 * 32;
  int8_t* codes = use_amx ? (s.codes4 = tl_codes4.get<int8_t>(mp * s.k)) : (s.codes = tl_codes.get<int8_t>(m * s.k));
  s.sx.resize(m);
  s.zp.resize(m);
  s.csum.resize(m * s.G);
  s.yb = y_bf16;
  s.y_round = bf16_values && y_bf16 == nullptr;
  s.bias = bias;
  if (x_bf16 != nullptr) {
    int8_quantize_rows_bf16(x_bf16, m, s.k, per_token, mode, eps, codes, s.sx.data(), s.zp.data(), s.csum.data(),
                            s.gs, use_amx);
  } else if (bf16_values) {
    int8_quantize_rows_rounded(x, m, s.k, per_token, mode, eps, codes, s.sx.data(), s.zp.data(), s.csum.data(), s.gs,
                               use_amx);
  } else {
    int8_quantize_rows(x, m, s.k, per_token, mode, eps, codes, s.sx.data(), s.zp.data(), s.csum.data(), s.gs,
                       use_amx);
  }
  if (use_amx)
    for (int64_t r = m; r < mp; ++r)
      for (int64_t st = 0; st < s.k / 64; ++st)
        std::memset(codes + ((r / 16) * (s.k / 64) + st) * 1024 + (r % 16) * 64, 0, 64);
  s.S.resize(m * s.G);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < s.G; ++g)
      s.S[r * s.G + g] = static_cast<float>(s.csum[r * s.G + g] - s.zp[r] * static_cast<int32_t>(s.gs));
#if AQ_INT8_CODES
  // Work items: groups of 4 panels (64 weight rows; the panels past the last full group go one by one), shared
  // among the threads as the tiled paths share their tiles (split_gemm: x's rows split too when the groups alone
  // cannot be shared evenly, e.g. 9 groups of a 576-row weight on 2 threads).
  const int64_t npan = s.n / 16, nquad = npan / 4;
  // 4-bit weights at few rows read their units in place (gemv4); more rows share a widened copy per item.
  const bool few4 = s.bits == 4 && m <= kFewRowsMax;
  if (few4) {
    s.codes4 = tl_codes4.get<int8_t>(m * s.k);
    even_odd_codes(s.codes, m, s.k, s.codes4);
  }
  // Per-item tiles keep 16-bit scales 16-bit (TileQparams::s16) where the weight has no offset array.
  const bool scales16 = s.per_item && s.p.offset == nullptr && detail::scales16_tiles(s.p, s.G);
  const detail::GemmSplit sp = detail::split_gemm(nquad + npan % 4, m, use_amx ? 32 : few4 ? kFewRows4 : kRows);
  const int64_t item_macs = 64 * s.k * sp.rows_per_part * ((sp.ntiles + sp.nblocks - 1) / sp.nblocks);
  at::parallel_for(0, sp.items(), std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, item_macs)),
                   [&](int64_t i0, int64_t i1) {
#if AQ_AMX
    std::optional<detail::TileScope> tiles;
    if (use_amx) tiles.emplace(detail::TileConfig());
#endif
    thread_local std::vector<uint8_t> wide;  // this item's panels in the 8-bit layout (4-bit weights)
    [[maybe_unused]] thread_local detail::Scratch item_b;  // AMX: the item's panels (or a quad's) as B tiles
    for (int64_t it = i0; it < i1; ++it) {
      // AMX: the item's rows in chunks (amx_row_chunk) each run over all of the item's panels, so a chunk's A
      // tiles come from L2 after its first two panels (over the item's whole rows every two panels read them from
      // L3); with several chunks the item's panels are packed as B tiles once, before them (4-bit ones widened
      // first), else each quad's right before its tiles (still in L2). Otherwise one chunk.
      const int64_t r0 = sp.row0(it), r1 = sp.row1(it), chunk = use_amx ? amx_row_chunk(s.k) : r1 - r0;
      [[maybe_unused]] const bool pack_item = use_amx && r1 - r0 > chunk;
      [[maybe_unused]] uint8_t* bitem = nullptr;
      // Panels [p0, p0 + np)'s 8-bit codes: 4-bit ones widened into `wide`.
      const auto codes8 = [&](int64_t p0, int64_t np) -> const uint8_t* {
        if (s.bits != 4) return s.packed + p0 * 16 * s.k;
        wide.resize(np * 16 * s.k);
        widen_panels(s.packed + p0 * 8 * s.k, np, s.k, wide.data());
        return wide.data();
      };
#if AQ_AMX
      if (pack_item) {
        int64_t bytes = 0;
        for (int64_t pi = sp.tile0(it); pi < sp.tile0(it) + sp.tiles(it); ++pi)
          bytes += b_tiles_bytes(panels_of(pi, nquad).second, s.k);
        bitem = item_b.get<uint8_t>(bytes);
        for (int64_t pi = sp.tile0(it), off = 0; pi < sp.tile0(it) + sp.tiles(it); ++pi) {
          const auto [p0, np] = panels_of(pi, nquad);
          pack_b_tiles(codes8(p0, np), np, s.k, bitem + off);
          off += b_tiles_bytes(np, s.k);
        }
      }
#endif
      for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
        const int64_t c1 = std::min(r1, c0 + chunk);
        [[maybe_unused]] const uint8_t* bquad = bitem;  // this quad's B tiles in bitem (pack_item)
        for (int64_t pi = sp.tile0(it); pi < sp.tile0(it) + sp.tiles(it); ++pi) {
          const auto [p0, np] = panels_of(pi, nquad);
          TileQparams qp;
          if (scales16) {
            const int64_t ld = 16 * np;
            const bool sums = s.zero_points && !few4;  // gemv4 sums its own
            tl_item_s16.resize(s.G * ld), tl_item_us.resize(sums ? s.G * ld : 0);
            detail::load_scales16(s.p, false, 16 * p0, 16 * np, ld, s.G, tl_item_s16.data(), ld);
            if (sums) load_code_sums(s, p0, np, tl_item_us.data(), ld);
            qp = {nullptr, nullptr, sums ? tl_item_us.data() : nullptr, ld, tl_item_s16.data(), s.p.qparams_f16,
                  static_cast<float>(s.p.code_offset)};
          } else if (s.per_item) {
            const int64_t ld = 16 * np;
            tl_item_s.resize(s.G * ld), tl_item_o.resize(s.G * ld), tl_item_us.resize(s.zero_points ? s.G * ld : 0);
            qp = {tl_item_s.data(), tl_item_o.data(), s.zero_points ? tl_item_us.data() : nullptr, ld};
            load_panel_qparams(s, p0, np, tl_item_s.data(), tl_item_o.data(),
                               s.zero_points && !few4 ? tl_item_us.data() : nullptr, ld);  // gemv4 sums its own
          } else {
            qp = {s.sT.data() + 16 * p0, s.oT.data() + 16 * p0, s.zero_points ? s.usumT.data() + 16 * p0 : nullptr,
                  s.n};
          }
          if (few4) {
            const uint8_t* w4 = s.packed + p0 * 8 * s.k;
            const int one = s.G == 1;
            // The tile this thread runs next (within this item, else the next item of its range): cold weights
            // would start its qparams and each panel's stream with demand misses.
            const int64_t next = pi + 1 < sp.tile0(it) + sp.tiles(it) ? pi + 1 : it + 1 < i1 ? sp.tile0(it + 1) : -1;
            std::optional<detail::NextItemPrefetch> pf;
            if (next >= 0 && next != pi) {
              const auto [n0, nn] = panels_of(next, nquad);
              const uint8_t* npan[detail::kMaxItemPanels];
              for (int64_t h = 0; h < nn; ++h) npan[h] = s.packed + (n0 + h) * 8 * s.k;
              pf.emplace(s.p, 16 * n0, 16 * nn, s.G, npan, nn, 64);
            }
            for (int64_t m0 = c0, me = c1; m0 < me; m0 += kFewRows4) {
              const int64_t mr = std::min<int64_t>(kFewRows4, me - m0);
              const int8_t* q = s.codes4 + m0 * s.k;
              const detail::NextItemPrefetch* pfm = m0 == c0 && pf ? &*pf : nullptr;
              if (pi >= nquad) {
                kGemv4<1, kFewRows4>[one][mr - 1](s, qp, q, w4, p0, m0, y, pfm);
              } else if (mr <= 2) {
                kGemv4<4, 2>[one][mr - 1](s, qp, q, w4, p0, m0, y, pfm);
              } else {  // the quad's panels 2 or 1 at a time
                const int per = mr <= 4 ? 2 : 1;
                const Gemv4Fn f = per == 2 ? kGemv4<2, 4>[one][mr - 1] : kGemv4<1, kFewRows4>[one][mr - 1];
                for (int h = 0; h < 4; h += per)
                  f(s, qp.shifted(h), q, w4 + h * 8 * s.k, p0 + h, m0, y, h == 0 ? pfm : nullptr);
              }
            }
            continue;
          }
#if AQ_AMX
          if (use_amx) {
            const uint8_t* bw = bquad;
            if (!pack_item) {  // this quad's B tiles, packed right before its tiles read them
              uint8_t* own = item_b.get<uint8_t>(b_tiles_bytes(np, s.k));
              pack_b_tiles(codes8(p0, np), np, s.k, own);
              bw = own;
            }
            amx_tiles(s, qp, s.codes4, bw, p0, np, c0, c1, y);
            bquad += b_tiles_bytes(np, s.k);
            continue;
          }
#endif
          const uint8_t* w0 = codes8(p0, np);
          for (int64_t m0 = c0, me = c1; m0 < me; m0 += kRows) {
            const int64_t mr = std::min<int64_t>(kRows, me - m0);
            const int8_t* q = s.codes + m0 * s.k;
            const TileSet& ts = s.G == 1 ? kOneGroup : kGrouped;
            if (pi >= nquad) {
              ts.t1[mr - 1](s, qp, q, w0, p0, m0, y);
            } else if (mr <= ts.wide) {
              ts.t4[mr - 1](s, qp, q, w0, p0, m0, y);
            } else {
              for (int64_t h0 = 0; h0 < mr; h0 += ts.half) {
                const int64_t hr = std::min<int64_t>(ts.half, mr - h0);
                ts.t2[hr - 1](s, qp, q + h0 * s.k, w0, p0, m0 + h0, y);
                ts.t2[hr - 1](s, qp.shifted(2), q + h0 * s.k, w0 + 2 * 16 * s.k, p0 + 2, m0 + h0, y);
              }
            }
          }
        }
      }
    }
  });
#else
  (void)y;
  throw std::logic_error("Int8CodesGemm::run: not built");
#endif
}

}  // namespace affineq
