// affineq::kv_attention: attention of float queries over an int8 / int4 quantized KV cache, reading the codes
// directly (no float copy of the cache). Layout and math: affineq/cpp/kv_attention.py (the schema, the fake and
// the PyTorch reference live there).
//
// For each (batch b, query head h, query s), with kv head h / (H / KVH) and n = pos[s] + 1 slots:
//   score[t] = (q . K[t]) / sqrt(D) for slots t < n with valid[b, t], where q . K[t] = sum_g k_scale[t, g] *
//              (q_g . codes_g)  (the code sum of a group is scaled once)
//   p = softmax(score) over those slots (no slot: the output row is 0, as sdpa gives a fully masked row)
//   out = sum_t p[t] * V[t],  V[t, d] = v_scale[t, g(d)] * code[t, d]
// fp32 products and accumulation. int8 codes: int8 [.., T, D], value = scale * code. int4: uint8 [.., T, D / 2];
// in group g of G elements, byte j < G / 2 holds element g*G + j in its low nibble and g*G + G/2 + j in its
// high nibble (llama.cpp's q4_0 order), value = scale * (nibble - 8).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// AVX2 + FMA (also on AVX-512 CPUs); AFFINEQ_FORCE_SCALAR builds the portable loops only.
#if defined(__AVX2__) && defined(__FMA__) && !defined(AFFINEQ_FORCE_SCALAR)
#define AQ_KV_AVX2 1
#endif

namespace affineq {
namespace {

struct Row {
  const void* codes;   // one cache slot of one kv head: D int8 codes or D / 2 int4 bytes
  const float* scale;  // its D / G group scales
};

// ---- scalar ---------------------------------------------------------------------------------------------
float dot_scalar(const float* q, Row r, int64_t D, int64_t G, bool int4) {
  float total = 0.f;
  for (int64_t g = 0; g < D / G; ++g) {
    float acc = 0.f;
    const float* qg = q + g * G;
    if (int4) {
      const uint8_t* c = static_cast<const uint8_t*>(r.codes) + g * G / 2;
      for (int64_t j = 0; j < G / 2; ++j) {
        acc += qg[j] * float((c[j] & 15) - 8);
        acc += qg[j + G / 2] * float((c[j] >> 4) - 8);
      }
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
      for (int64_t j = 0; j < G / 2; ++j) {
        og[j] += w * float((c[j] & 15) - 8);
        og[j + G / 2] += w * float((c[j] >> 4) - 8);
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(r.codes) + g * G;
      for (int64_t j = 0; j < G; ++j) og[j] += w * float(c[j]);
    }
  }
}

// ---- AVX2: 8 codes at a time, widened to int32 then fp32 (G % 8 == 0 for int8, G % 16 == 0 for int4) -------
#if AQ_KV_AVX2
inline __m256 codes8_i8(const int8_t* c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}
// 8 bytes -> (low nibbles - 8, high nibbles - 8) as fp32
inline void codes8_i4(const uint8_t* c, __m256* lo, __m256* hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  const __m256i eight = _mm256_set1_epi32(8);
  *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
  *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

float dot_avx2(const float* q, Row r, int64_t D, int64_t G, bool int4) {
  __m256 total = _mm256_setzero_ps();
  for (int64_t g = 0; g < D / G; ++g) {
    __m256 acc = _mm256_setzero_ps();
    const float* qg = q + g * G;
    if (int4) {
      const uint8_t* c = static_cast<const uint8_t*>(r.codes) + g * G / 2;
      for (int64_t j = 0; j < G / 2; j += 8) {
        __m256 lo, hi;
        codes8_i4(c + j, &lo, &hi);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), lo, acc);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + G / 2 + j), hi, acc);
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(r.codes) + g * G;
      for (int64_t j = 0; j < G; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), codes8_i8(c + j), acc);
    }
    total = _mm256_fmadd_ps(acc, _mm256_set1_ps(r.scale[g]), total);
  }
  return hsum(total);
}

void axpy_avx2(float p, Row r, float* out, int64_t D, int64_t G, bool int4) {
  for (int64_t g = 0; g < D / G; ++g) {
    const __m256 w = _mm256_set1_ps(p * r.scale[g]);
    float* og = out + g * G;
    if (int4) {
      const uint8_t* c = static_cast<const uint8_t*>(r.codes) + g * G / 2;
      for (int64_t j = 0; j < G / 2; j += 8) {
        __m256 lo, hi;
        codes8_i4(c + j, &lo, &hi);
        _mm256_storeu_ps(og + j, _mm256_fmadd_ps(w, lo, _mm256_loadu_ps(og + j)));
        _mm256_storeu_ps(og + G / 2 + j, _mm256_fmadd_ps(w, hi, _mm256_loadu_ps(og + G / 2 + j)));
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(r.codes) + g * G;
      for (int64_t j = 0; j < G; j += 8)
        _mm256_storeu_ps(og + j, _mm256_fmadd_ps(w, codes8_i8(c + j), _mm256_loadu_ps(og + j)));
    }
  }
}
#endif

using DotFn = float (*)(const float*, Row, int64_t, int64_t, bool);
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
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.dim() == 4 && k_scale.sizes() == v_scale.sizes() && k_scale.size(0) == B &&
                  k_scale.size(1) == KVH && k_scale.size(2) == T && k_scale.size(3) > 0 && D % k_scale.size(3) == 0,
              op, ": k_scale and v_scale must be float32 [B, KVH, T, D / group_size], got ", k_scale.scalar_type(),
              " ", k_scale.sizes(), " and ", v_scale.scalar_type(), " ", v_scale.sizes());
  const int64_t G = D / k_scale.size(3);
  TORCH_CHECK(!int4 || G % 2 == 0, op, ": int4 groups must have an even size, got ", G);
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

  DotFn dot = dot_scalar;
  AxpyFn axpy = axpy_scalar;
#if AQ_KV_AVX2
  if (path == 0 && G % (int4 ? 16 : 8) == 0) {
    dot = dot_avx2;
    axpy = axpy_avx2;
  }
#endif
  const int64_t row_bytes = int4 ? D / 2 : D, ng = D / G, rep = H / KVH;
  const auto* kcp = static_cast<const uint8_t*>(kc.data_ptr());
  const auto* vcp = static_cast<const uint8_t*>(vc.data_ptr());
  const float* ksp = ks.data_ptr<float>();
  const float* vsp = vs.data_ptr<float>();
  const bool* V = vl.data_ptr<bool>();
  const float* Q = qf.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float sm = 1.f / std::sqrt(float(D));

  at::parallel_for(0, B * H * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(T), qs(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % S, h = (item / S) % H, b = item / (S * H);
      const int64_t kv = h / rep, n = P[s] + 1;
      const int64_t base = (b * KVH + kv) * T;  // slot 0 of this (b, kv head)
      for (int64_t d = 0; d < D; ++d) qs[d] = Q[item * D + d] * sm;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) {
        if (!V[b * T + t]) continue;
        score[t] = dot(qs.data(), Row{kcp + (base + t) * row_bytes, ksp + (base + t) * ng}, D, G, int4);
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
        axpy(score[t] * inv, Row{vcp + (base + t) * row_bytes, vsp + (base + t) * ng}, o, D, G, int4);
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
