// Shared context of the kernels, the out-of-line part (declarations and inline helpers in common.h): the
// per-thread scratch buffers several paths use, and qparam loading (transposed fp32 scales / offsets).
#include <bit>

#include "common.h"

namespace affineq::detail {

thread_local Scratch tl_scale, tl_offset, tl_wbuf, tl_cbuf;
thread_local Scratch tl_xcall;

namespace {

thread_local Scratch tl_qconv;  // load_qparams' conversion buffer
thread_local Scratch tl_tail;             // panel_ptr's copy of the tail panel

#if AQ_AVX512
// dst[c * ldd + i] = r[i][c] for a 16 x 16 block of fp32 (row i of r: 16 consecutive groups).
AQ_INLINE void transpose16_store(const __m512* r, float* dst, int64_t ldd) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // c[R4][c'] (R4 = row quad): lane L holds column 4L + c' for rows 4*R4 .. 4*R4+3.
  __m512 c[4][4];
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d d = _mm512_castps_pd(t[4 * q + 2]), e = _mm512_castps_pd(t[4 * q + 3]);
    c[q][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, d));
    c[q][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, d));
    c[q][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    c[q][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int cc = 0; cc < 4; ++cc) {
    const __m512 u0 = _mm512_shuffle_f32x4(c[0][cc], c[1][cc], 0x44);
    const __m512 u1 = _mm512_shuffle_f32x4(c[0][cc], c[1][cc], 0xEE);
    const __m512 u2 = _mm512_shuffle_f32x4(c[2][cc], c[3][cc], 0x44);
    const __m512 u3 = _mm512_shuffle_f32x4(c[2][cc], c[3][cc], 0xEE);
    _mm512_storeu_ps(dst + (0 + cc) * ldd, _mm512_shuffle_f32x4(u0, u2, 0x88));
    _mm512_storeu_ps(dst + (4 + cc) * ldd, _mm512_shuffle_f32x4(u0, u2, 0xDD));
    _mm512_storeu_ps(dst + (8 + cc) * ldd, _mm512_shuffle_f32x4(u1, u3, 0x88));
    _mm512_storeu_ps(dst + (12 + cc) * ldd, _mm512_shuffle_f32x4(u1, u3, 0xDD));
  }
}

// The 16 x 16 transpose of 16-bit values as three stages of two-register permutes (vpermt2w). Eight registers
// hold the block, two rows or two columns each: register i, lane e is (row 2i + e / 16, column e % 16) before
// and (row e % 16, column 2i + e / 16) after. Each stage trades one bit of the register index (a row bit) for a
// lane bit (a column bit) between the register pairs that differ in it; idx[s][v] builds the partner with that
// bit v. Half the shuffles of the fp32 transpose, on half the bytes, and no conversion before it.
struct Transpose16x16w {
  __m512i idx[3][2];
  Transpose16x16w() {
    // A layout places the 8 index bits (row bits 0..3, column bits 0..3) at 3 register bits + 5 lane bits:
    // where[b] = position of bit b (0..4 lane bits, 5..7 register bits); bits 0..3 rows, 4..7 columns.
    const int layouts[4][8] = {
        {4, 5, 6, 7, 0, 1, 2, 3},  // before: row bit 0 in lane bit 4, rows 1..3 the register, columns lanes 0..3
        {4, 1, 6, 7, 0, 5, 2, 3},  // stage 0: row bit 1 <-> column bit 1
        {4, 1, 2, 7, 0, 5, 6, 3},  // stage 1: row bit 2 <-> column bit 2
        {0, 1, 2, 3, 4, 5, 6, 7},  // stage 2: row bit 3 <-> column bit 3; lanes (column bit 0, row)
    };
    for (int s = 0; s < 3; ++s)
      for (int v = 0; v < 2; ++v) {
        alignas(64) uint16_t t[32];
        for (int e = 0; e < 32; ++e) {
          const int out = (v << s) << 5 | e;  // register (bit s = v, others 0), lane e, in the stage's output
          int rc = 0;                         // which (row, column) sits there: 8 bits, rows low
          for (int b = 0; b < 8; ++b) rc |= (out >> layouts[s + 1][b] & 1) << b;
          int in = 0;
          for (int b = 0; b < 8; ++b) in |= (rc >> b & 1) << layouts[s][b];
          t[e] = static_cast<uint16_t>((in & 31) | ((in >> (5 + s) & 1) << 5));  // lane, and which partner
        }
        idx[s][v] = _mm512_load_si512(t);
      }
  }
  AQ_INLINE void operator()(__m512i (&r)[8]) const {
    for (int s = 0; s < 3; ++s)
      for (int i = 0; i < 8; ++i)
        if (!(i >> s & 1)) {
          const int j = i | 1 << s;
          const __m512i lo = _mm512_permutex2var_epi16(r[i], idx[s][0], r[j]);
          r[j] = _mm512_permutex2var_epi16(r[i], idx[s][1], r[j]);
          r[i] = lo;
        }
  }
};

// r[i] = rows 2i and 2i + 1 of a 16 x 16 block of 16-bit values (row stride lds), transposed in place: r[k] =
// columns 2k (lanes 0..15) and 2k + 1 (lanes 16..31).
AQ_INLINE void load_transpose16w(const uint16_t* src, int64_t lds, __m512i (&r)[8]) {
  static const Transpose16x16w tr;
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i * lds))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (2 * i + 1) * lds)), 1);
  tr(r);
}
#endif

// dst[g * ldd + r] = src[r * lds + g] for r < rows, g < G; rows in [rows, R) are zero-filled.
// (Scales arrive as [n, G]; the kernels want 16 consecutive rows per vector, hence the transpose.)
void transpose_rows(const float* src, int64_t lds, int64_t rows, int64_t R, int64_t G, float* dst, int64_t ldd) {
  int64_t g0 = 0;
#if AQ_AVX512
  if (rows == R && R % 16 == 0) {
    for (; g0 + 16 <= G; g0 += 16)
      for (int64_t r0 = 0; r0 < R; r0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (r0 + i) * lds + g0);
        transpose16_store(r, dst + g0 * ldd + r0, ldd);
      }
  }
#elif AQ_AVX2
  // 8x8 blocks: with the scalar loop below, qparam loading took a large share of a small-group GEMV on AVX2
  // (see benchmarks/README.md, kernel design measurements).
  if (rows == R && R % 8 == 0) {
    for (; g0 + 8 <= G; g0 += 8) {
      for (int64_t r0 = 0; r0 < R; r0 += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (r0 + i) * lds + g0);
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // c[h][c']: in each 128-bit half, column c' (+4 in the high half) of rows 4h .. 4h+3.
        __m256 c[2][4];
        for (int h = 0; h < 2; ++h) {
          const __m256d a = _mm256_castps_pd(t[4 * h]), b = _mm256_castps_pd(t[4 * h + 1]);
          const __m256d d = _mm256_castps_pd(t[4 * h + 2]), e = _mm256_castps_pd(t[4 * h + 3]);
          c[h][0] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, d));
          c[h][1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, d));
          c[h][2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, e));
          c[h][3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, e));
        }
        for (int cc = 0; cc < 4; ++cc) {
          _mm256_storeu_ps(dst + (g0 + cc) * ldd + r0, _mm256_permute2f128_ps(c[0][cc], c[1][cc], 0x20));
          _mm256_storeu_ps(dst + (g0 + 4 + cc) * ldd + r0, _mm256_permute2f128_ps(c[0][cc], c[1][cc], 0x31));
        }
      }
    }
  }
#endif
  for (int64_t g = g0; g < G; ++g) {
    float* d = dst + g * ldd;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * lds + g];
    for (int64_t r = rows; r < R; ++r) d[r] = 0.f;
  }
}

// The k-quant scales (offset=false, times mul) or offsets of rows [r0, r0 + rows) into t [rows, G], row-major:
// kquant_decode.h's kq_block formulas, 16 sub-blocks per AVX-512 vector, else one super-block at a time.
// With dst (AVX-512 only; rows % 16 == 0 and G % 16 == 0): straight into dst[g * ldd + r] instead, no staging.
template <int KIND>
void kq_rows(const LowbitProblem& p, bool offset, float mul, int64_t r0, int64_t rows, int64_t G, float* t,
             float* dst = nullptr, int64_t ldd = 0) {
  constexpr int64_t ns = kq_supers(KIND), gpb = kSuperBlock / kq_group(KIND);
  const int64_t nb = G / gpb;
  const uint8_t* sc = static_cast<const uint8_t*>(p.scale) + r0 * G;
  const uint8_t* mn = p.offset != nullptr ? static_cast<const uint8_t*>(p.offset) + r0 * G : sc;
  const uint16_t* sup = p.kq_super + r0 * nb * ns;
#if AQ_AVX512
  // 16 sub-blocks per vector (one or two super-blocks: their d, dmin broadcast per half); nb * gpb % 16 == 0 unless
  // gpb == 8 and nb is odd, whose last 8 sub-blocks take the loop below. vec(r, g0): the vector of row r.
  const int64_t G16 = G / 16 * 16;
  // The dst path converts every d / dmin of its rows to fp32 once (vcvtph2ps, 16 at a time) into sup32; the
  // row-major path converts each where it is used.
  const float* sup32 = nullptr;
  if (dst != nullptr) {
    const int64_t cnt = rows * nb * ns;
    float* t32 = tl_qconv.get<float>(cnt);
    int64_t i = 0;
    for (; i + 16 <= cnt; i += 16)
      _mm512_storeu_ps(t32 + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + i))));
    for (; i < cnt; ++i) t32[i] = f16_to_float(sup[i]);
    sup32 = t32;
  }
  const auto vec = [&](int64_t r, int64_t g0) {
    const uint8_t *br = sc + r * G, *mr = mn + r * G;
    const uint16_t* sr = sup + r * nb * ns;
    const int64_t b0 = g0 / gpb, b1 = (g0 + 15) / gpb;
    const auto pair = [&](int at) {  // the fp16 value `at` (0: d, 1: dmin) of super-blocks b0 | b1
      if (sup32 != nullptr) {
        const float* f = sup32 + r * nb * ns + at;
        if constexpr (gpb == 16) return _mm512_set1_ps(f[b0 * ns]);  // b1 == b0
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f[b0 * ns])), _mm256_set1_ps(f[b1 * ns]), 1);
      }
      return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f16_to_float(sr[b0 * ns + at]))),
                                _mm256_set1_ps(f16_to_float(sr[b1 * ns + at])), 1);
    };
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(br + g0));
    const __m512i u = KIND == 6 ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
    const __m512 dv = pair(0);
    __m512i q = u;
    if constexpr (KIND == 2) q = _mm512_and_si512(u, _mm512_set1_epi32(15));
    if constexpr (KIND == 3) q = _mm512_sub_epi32(u, _mm512_set1_epi32(32));
    const __m512 s = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q));
    __m512 v;
    if (!offset) {
      v = mul == 1.f ? s : _mm512_mul_ps(s, _mm512_set1_ps(mul));
    } else if constexpr (KIND == 3 || KIND == 6) {
      v = _mm512_mul_ps(_mm512_set1_ps(KIND == 3 ? -4.f : -32.f), s);
    } else {
      const __m512i m = KIND == 2 ? _mm512_srli_epi32(u, 4)
                                  : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mr + g0)));
      v = _mm512_xor_ps(_mm512_mul_ps(pair(1), _mm512_cvtepi32_ps(m)), _mm512_set1_ps(-0.f));  // -(dmin * m)
    }
    return v;
  };
  if (dst != nullptr) {  // whole 16 x 16 blocks straight into the transposed layout (the caller checked the shape)
    for (int64_t rb = 0; rb < rows; rb += 16)
      for (int64_t g0 = 0; g0 < G; g0 += 16) {
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = vec(rb + i, g0);
        transpose16_store(v, dst + g0 * ldd + rb, ldd);
      }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t *br = sc + r * G, *mr = mn + r * G;
    const uint16_t* sr = sup + r * nb * ns;
    float* out = t + r * G;
    for (int64_t g0 = 0; g0 < G16; g0 += 16) _mm512_storeu_ps(out + g0, vec(r, g0));
    for (int64_t g = G16; g < G; g += gpb) kq_block<KIND>(offset, mul, br + g, mr + g, sr + g / gpb * ns, out + g);
  }
#else
  for (int64_t i = 0; i < rows * nb; ++i)  // super-block i: row i / nb
    kq_block<KIND>(offset, mul, sc + i * gpb, mn + i * gpb, sup + i * ns, t + i * gpb);
#endif
}

}  // namespace

void load_qparams(const LowbitProblem& p, bool offset, float mul, int64_t r0, int64_t rows, int64_t R, int64_t G,
                  float* dst, int64_t ldd) {
  if (p.qparams_kquant) {  // from the sub-scale / min bytes and the super-block d, dmin (kquant_decode.h)
#if AQ_AVX512
    if (rows == R && R % 16 == 0 && G % 16 == 0) {  // straight into dst (a large share of the GEMV's time staged)
      switch (p.qparams_kquant) {
        case 2: kq_rows<2>(p, offset, mul, r0, rows, G, nullptr, dst, ldd); break;
        case 3: kq_rows<3>(p, offset, mul, r0, rows, G, nullptr, dst, ldd); break;
        case 4: kq_rows<4>(p, offset, mul, r0, rows, G, nullptr, dst, ldd); break;
        case 5: kq_rows<5>(p, offset, mul, r0, rows, G, nullptr, dst, ldd); break;
        default: kq_rows<6>(p, offset, mul, r0, rows, G, nullptr, dst, ldd); break;
      }
      return;
    }
#endif
    float* t = tl_qconv.get<float>(rows * G);
    switch (p.qparams_kquant) {
      case 2: kq_rows<2>(p, offset, mul, r0, rows, G, t); break;
      case 3: kq_rows<3>(p, offset, mul, r0, rows, G, t); break;
      case 4: kq_rows<4>(p, offset, mul, r0, rows, G, t); break;
      case 5: kq_rows<5>(p, offset, mul, r0, rows, G, t); break;
      default: kq_rows<6>(p, offset, mul, r0, rows, G, t); break;
    }
    transpose_rows(t, G, rows, R, G, dst, ldd);
    return;
  }
  if (offset && p.offset == nullptr) {  // no offset array: scale * code_offset (exact, see lowbit_kernels.h)
    if (p.code_offset != 0) return load_qparams(p, false, static_cast<float>(p.code_offset), r0, rows, R, G, dst, ldd);
    for (int64_t g = 0; g < G; ++g) std::fill(dst + g * ldd, dst + g * ldd + R, 0.f);
    return;
  }
#if AQ_AVX512
  // 16-bit qparams of a whole tile go straight into the transposed fp32 layout, 16 rows x 16 groups at a time:
  // the values of the loops below, without their fp32 staging copy (a large share of a small-group GEMV).
  if ((p.qparams_bf16 || p.qparams_f16) && rows == R && R % 16 == 0 && G % 16 == 0) {
    const uint16_t* s16 = static_cast<const uint16_t*>(p.scale) + r0 * G;
    const uint16_t* z16 = static_cast<const uint16_t*>(p.offset) + r0 * G;
    const bool bf = p.qparams_bf16;
    const auto f32 = [bf](__m256i h) {  // 16 qparams as fp32 (exact)
      return bf ? bf16_widen(h) : _mm512_cvtph_ps(h);
    };
    const __m512 half = _mm512_set1_ps(static_cast<float>(1 << (p.bits - 1))), vm = _mm512_set1_ps(mul);
    const bool zs = offset && bf;  // bf16 offsets come as z - 2^(b-1) s: both blocks are needed
    for (int64_t g0 = 0; g0 < G; g0 += 16)
      for (int64_t rb = 0; rb < R; rb += 16) {
        __m512i a[8], sc[8];
        load_transpose16w((offset ? z16 : s16) + rb * G + g0, G, a);
        if (zs) load_transpose16w(s16 + rb * G + g0, G, sc);
        for (int k = 0; k < 8; ++k)
          for (int h = 0; h < 2; ++h) {  // column 2k + h: lanes 16h .. 16h + 15 of register k
            const auto col = [h](__m512i v) {
              return h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
            };
            __m512 v = f32(col(a[k]));
            if (!offset) v = _mm512_mul_ps(v, vm);
            else if (zs) v = _mm512_sub_ps(v, _mm512_mul_ps(half, f32(col(sc[k]))));  // z - 2^(b-1) s
            _mm512_storeu_ps(dst + (g0 + 2 * k + h) * ldd + rb, v);
          }
      }
    return;
  }
#endif
  const float* src = static_cast<const float*>(offset ? p.offset : p.scale) + r0 * G;
  // Straight-line loops per case: the per-element qparam_at would not vectorize (see benchmarks/README.md,
  // kernel design measurements).
  const int64_t cnt = rows * G;
  if (p.qparams_e8m0) {  // exponent bytes -> fp32 (exact), times mul (exact: a power of two, or code_offset)
    float* t = tl_qconv.get<float>(cnt);
    const uint8_t* b = static_cast<const uint8_t*>(p.scale) + r0 * G;
    for (int64_t i = 0; i < cnt; ++i) t[i] = e8m0_to_float(b[i]) * mul;
    src = t;
  } else if (p.qparams_f16) {  // fp16 -> fp32 (exact; vcvtph2ps where built with F16C)
    float* t = tl_qconv.get<float>(cnt);
    const uint16_t* h = static_cast<const uint16_t*>(offset ? p.offset : p.scale) + r0 * G;
    const float f = offset ? 1.f : mul;
    int64_t i = 0;
#if defined(__F16C__) && (AQ_AVX2 || AQ_AVX512)
    for (; i + 8 <= cnt; i += 8)  // vcvtph2ps: 8 at a time (the scalar conversion does not vectorize)
      _mm256_storeu_ps(t + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))),
                                            _mm256_set1_ps(f)));
#endif
    for (; i < cnt; ++i) t[i] = f16_to_float(h[i]) * f;
    src = t;
  } else if (p.qparams_bf16 || mul != 1.f) {
    float* t = tl_qconv.get<float>(cnt);
    const uint16_t* s16 = static_cast<const uint16_t*>(p.scale) + r0 * G;
    const uint16_t* z16 = static_cast<const uint16_t*>(p.offset) + r0 * G;
    if (!p.qparams_bf16) {
      for (int64_t i = 0; i < cnt; ++i) t[i] = src[i] * mul;
    } else if (!offset) {
      for (int64_t i = 0; i < cnt; ++i) t[i] = bf16_to_float(s16[i]) * mul;
    } else {
      // fp32 offset of w = scale * u + offset: z - 2^(bits-1) * scale (the product is exact)
      const float half = static_cast<float>(1 << (p.bits - 1));
      for (int64_t i = 0; i < cnt; ++i) t[i] = bf16_to_float(z16[i]) - half * bf16_to_float(s16[i]);
    }
    src = t;
  }
  transpose_rows(src, G, rows, R, G, dst, ldd);
}

namespace {

// dst[g * ldd + r] = src[r * lds + g] + add (mod 256) for r < rows, g < G; rows in [rows, R) are zero.
void transpose_bytes(const uint8_t* src, int64_t lds, int64_t rows, int64_t R, int64_t G, uint8_t add, uint8_t* dst,
                     int64_t ldd) {
  int64_t g0 = 0;
#if defined(__SSE2__)
  if (rows == R && R % 16 == 0) {
    const __m128i va = _mm_set1_epi8(static_cast<char>(add));
    for (; g0 + 16 <= G; g0 += 16)
      for (int64_t rb = 0; rb < R; rb += 16) {
        __m128i x[16], t[16];
        for (int i = 0; i < 16; ++i)
          x[i] = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (rb + i) * lds + g0)), va);
        // Register i, byte j holds (row, column) with the 8 index bits (i, j). Interleaving registers i and i + 8
        // rotates those bits left by one; four rounds swap the row and column halves: x[c], byte r = (r, c).
        for (int round = 0; round < 4; ++round) {
          for (int i = 0; i < 8; ++i) {
            t[2 * i] = _mm_unpacklo_epi8(x[i], x[i + 8]);
            t[2 * i + 1] = _mm_unpackhi_epi8(x[i], x[i + 8]);
          }
          for (int i = 0; i < 16; ++i) x[i] = t[i];
        }
        for (int i = 0; i < 16; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (g0 + i) * ldd + rb), x[i]);
      }
  }
#endif
  for (int64_t g = g0; g < G; ++g) {
    uint8_t* d = dst + g * ldd;
    for (int64_t r = 0; r < rows; ++r) d[r] = static_cast<uint8_t>(src[r * lds + g] + add);
    for (int64_t r = rows; r < R; ++r) d[r] = 0;
  }
}

}  // namespace

void load_kq_qparams(const LowbitProblem& p, int64_t r0, int64_t rows, int64_t R, int64_t G, uint8_t* scT,
                     uint8_t* mnT, float* dT, int64_t ldd) {
  const int kind = p.qparams_kquant;
  const int64_t ns = kq_supers(kind), cols = p.k / kSuperBlock * ns;
  const uint8_t add = kind == 3 ? static_cast<uint8_t>(256 - 32) : 0;  // q3_k's sub-scale is b - 32
  transpose_bytes(static_cast<const uint8_t*>(p.scale) + r0 * G, G, rows, R, G, add, scT, ldd);
  if (kind == 4 || kind == 5) transpose_bytes(static_cast<const uint8_t*>(p.offset) + r0 * G, G, rows, R, G, 0, mnT, ldd);
  // d (and -dmin: the offset is -(dmin * m), exact either way) of every super-block, then transposed.
  const uint16_t* sup = p.kq_super + r0 * cols;
  float* t = tl_qconv.get<float>(rows * cols);
  int64_t i = 0;
#if defined(__F16C__) && (AQ_AVX2 || AQ_AVX512)
  if (ns == 1) {  // 8 at a time (the scalar conversion does not vectorize)
    for (; i + 8 <= rows * cols; i += 8)
      _mm256_storeu_ps(t + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + i))));
  } else {  // pairs (d, dmin): dmin negated
    const __m256 sign = _mm256_castsi256_ps(_mm256_set_epi32(INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0));
    for (; i + 8 <= rows * cols; i += 8)
      _mm256_storeu_ps(t + i, _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + i))),
                                            sign));
  }
#endif
  for (; i < rows * cols; ++i) t[i] = ns == 2 && i % 2 == 1 ? -f16_to_float(sup[i]) : f16_to_float(sup[i]);
  transpose_rows(t, cols, rows, R, cols, dT, ldd);
}

#if AQ_AVX512
void load_scales16(const LowbitProblem& p, bool offset, int64_t r0, int64_t rows, int64_t R, int64_t G,
                   uint16_t* dst, int64_t ldd) {
  const uint16_t* s16 = static_cast<const uint16_t*>(offset ? p.offset : p.scale) + r0 * G;
  if (rows < R) {  // the tail panel: its rows padded with zeros first
    uint16_t* t = tl_qconv.get<uint16_t>(R * G);
    std::memcpy(t, s16, sizeof(uint16_t) * rows * G);
    std::memset(t + rows * G, 0, sizeof(uint16_t) * (R - rows) * G);
    s16 = t;
  }
  for (int64_t g0 = 0; g0 < G; g0 += 16)
    for (int64_t rb = 0; rb < R; rb += 16) {
      __m512i a[8];
      load_transpose16w(s16 + rb * G + g0, G, a);
      for (int k = 0; k < 8; ++k) {  // columns 2k, 2k + 1: the two halves of a[k]
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (g0 + 2 * k) * ldd + rb), _mm512_castsi512_si256(a[k]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (g0 + 2 * k + 1) * ldd + rb),
                            _mm512_extracti64x4_epi64(a[k], 1));
      }
    }
}
#endif

void load_tile_qparams(const LowbitProblem& p, float mul, int64_t r0, int64_t rows, int64_t R, int64_t G, float*& sT,
                       float*& oT) {
  sT = tl_scale.get<float>((G + 1) * R);
  oT = tl_offset.get<float>((G + 1) * R);
  load_qparams(p, false, mul, r0, rows, R, G, sT, R);
  load_qparams(p, true, 1.f, r0, rows, R, G, oT, R);
  std::fill(sT + G * R, sT + (G + 1) * R, 0.f);
  std::fill(oT + G * R, oT + (G + 1) * R, 0.f);
}

std::vector<int32_t> group_of_k(const LowbitProblem& p, int64_t K8, int64_t G) {
  std::vector<int32_t> kg(static_cast<size_t>(K8));
  for (int64_t k = 0; k < K8; ++k) kg[k] = static_cast<int32_t>(k < p.k ? k / p.group_size : G);
  return kg;
}

Ctx make_ctx(const LowbitProblem& p) {
  Ctx c;
  c.p = &p;
  c.B = p.bits;
  c.K8 = (p.k + 7) / 8 * 8;
  c.U = c.K8 / 8;
  c.G = p.k / p.group_size;
  c.N = p.n;
  c.M = p.m;
  c.nfull = p.n / 16;
  c.tail_w = p.n % 16;
  c.npan = c.nfull + (c.tail_w > 0 ? 1 : 0);
  c.panel_bytes = 16 * c.U * p.bits;
  return c;
}

const uint8_t* panel_ptr(const Ctx& c, int64_t pi) {
  if (pi >= c.npan) return nullptr;
  const uint8_t* base = c.p->packed + pi * c.panel_bytes;
  if (pi < c.nfull) return base;
  const int64_t w = c.tail_w, slots = c.U * c.B;  // a unit of a w-row panel is B slots of w bytes
  uint8_t* t = tl_tail.get<uint8_t>(slots * 16);
  for (int64_t s = 0; s < slots; ++s) {
    std::memcpy(t + s * 16, base + s * w, w);
    std::memset(t + s * 16 + w, 0, 16 - w);
  }
  return t;
}

}  // namespace affineq::detail
