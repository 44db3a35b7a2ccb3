// affineq::kv_attention: attention of float queries over an int8 / int4 quantized KV cache, reading the codes
// directly (no float copy of the cache). Layout and math: affineq/cpp/kv_attention.py (the schema, the fake and
// the PyTorch reference live there).
//
// For each (batch b, query head h, query s), with kv head h / (H / KVH) and n = pos[s] + 1 slots:
//   score[t] = (q . K[t]) / sqrt(D) for slots t < n with valid[b, t], K[t, d] = scale[t, g(d)] * code[t, d]
//              [+ min[t, g(d)]]
//   p = softmax(score) over those slots (no slot: the output row is 0, as sdpa gives a fully masked row); with
//       sinks (one logit per query head, gpt-oss, or per query [B, H, S]) exp(sink) joins the softmax's
//       denominator only
//   out = sum_t p[t] * V[t],  V[t, d] = v_scale[t, g(d)] * code[t, d] [+ v_min[t, g(d)]]
// fp32 products and accumulation. int8 codes: int8 [.., T, D], fp32 scales [.., T, D / G], value = scale * code.
// int4: uint8 [.., T, D / 2] with float16 (scale, min) pairs [.., T, 2 * D / G]; in group g of G elements, byte
// j < G / 2 holds element g*G + j in its low nibble and g*G + G/2 + j in its high nibble (llama.cpp's q4_1
// order), value = scale * nibble + min. Keys and values may have different group sizes.
//
// affineq::float_kv_attention: the same over a float cache (float32 / bfloat16 / float16 k / v, no scales), logits
// (q . k) * scale: the compiled decoder's float-cache attention.
//
// The vector path (groups of 16 dims or multiples; float caches): attention_kernel.h / .cpp. Path 1 (tests) and
// other group sizes run the scalar loops here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include "attention_kernel.h"

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

using DotFn = float (*)(const float*, const float*, Row, int64_t, int64_t, bool);
using AxpyFn = void (*)(float, Row, float*, int64_t, int64_t, bool);

int qtype_of(at::ScalarType t) { return t == at::kFloat ? kv::kQF32 : t == at::kBFloat16 ? kv::kQBF16 : kv::kQF16; }

// The checks both ops share: q [B, H, S, D] float32 / bfloat16 / float16, pos int64 [S] inside [0, T), valid bool
// [B, T], every tensor on the CPU, sinks None or a float [H] or [B, H, S].
void check_common(const char* op, const at::Tensor& q, const at::Tensor& pos, const at::Tensor& valid, int64_t T,
                  std::initializer_list<const at::Tensor*> all, const std::optional<at::Tensor>& sinks) {
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, op,
              ": q must be float32, bfloat16 or float16, got ", qt);
  const int64_t B = q.size(0), S = q.size(2);
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == S, op,
              ": pos must be int64 [S] = [", S, "], got ", pos.scalar_type(), " ", pos.sizes());
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 2 && valid.size(0) == B && valid.size(1) == T, op,
              ": valid must be bool [B, T] = [", B, ", ", T, "], got ", valid.scalar_type(), " ", valid.sizes());
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->device().is_cpu(), op, ": every tensor must be on the CPU, got ", t->device());
  if (sinks) {
    const auto st = sinks->scalar_type();
    const bool per_head = sinks->dim() == 1 && sinks->size(0) == q.size(1);
    const bool per_query = sinks->dim() == 3 && sinks->sizes() == at::IntArrayRef({B, q.size(1), S});
    TORCH_CHECK((per_head || per_query) && (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf) &&
                    sinks->device().is_cpu(),
                op, ": sinks must be a float CPU tensor [H] = [", q.size(1), "] (one logit per query head) or [B, H, "
                "S] = [", B, ", ", q.size(1), ", ", S, "] (per query), or None; got ", st, " ", sinks->sizes(),
                " on ", sinks->device());
  }
  const at::Tensor ps = pos.contiguous();
  const int64_t* P = ps.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(P[s] >= 0 && P[s] < T, op, ": pos[", s, "] = ", P[s], " is outside the cache [0, ", T, ")");
}

// The sink logits as fp32 [B, H, S] (one per query), or an undefined tensor without sinks.
at::Tensor sinks_per_query(const std::optional<at::Tensor>& sinks, int64_t B, int64_t H, int64_t S) {
  if (!sinks) return at::Tensor();
  const at::Tensor f = sinks->to(at::kFloat);
  return (f.dim() == 1 ? f.view({1, H, 1}).expand({B, H, S}) : f).contiguous();
}

// path: 0 = best for this build and shape, 1 = scalar (tests compare the two)
at::Tensor kv_attention_impl(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                             const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& pos,
                             const at::Tensor& valid, int64_t path, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "affineq::kv_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, H, S, D], got ", q.sizes());
  const auto qt = q.scalar_type();
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
  check_common(op, q, pos, valid, T, {&q, &k_codes, &k_scale, &v_codes, &v_scale, &pos, &valid}, sinks);
  const at::Tensor sk = sinks_per_query(sinks, B, H, S);
  const float* SK = sinks ? sk.data_ptr<float>() : nullptr;

  const at::Tensor kc = k_codes.contiguous(), vc = v_codes.contiguous();
  const at::Tensor ks = k_scale.contiguous(), vs = v_scale.contiguous();
  const at::Tensor ps = pos.contiguous(), vl = valid.contiguous();
  const int64_t* P = ps.data_ptr<int64_t>();
  const int64_t row_bytes = int4 ? D / 2 : D, rep = H / KVH;
  const int64_t ksw = ngk * per_group, vsw = ngv * per_group;  // scale words per slot
  const auto* kcp = static_cast<const uint8_t*>(kc.data_ptr());
  const auto* vcp = static_cast<const uint8_t*>(vc.data_ptr());
  const bool* V = vl.data_ptr<bool>();
  const float sm = 1.f / std::sqrt(float(D));
  // One slot's scales (and int4 mins) as fp32 pointers: int8 reads the tensor, int4 converts its pairs into buf.
  const float* ksf = int4 ? nullptr : ks.data_ptr<float>();
  const float* vsf = int4 ? nullptr : vs.data_ptr<float>();
  const at::Half* ksh = int4 ? ks.data_ptr<at::Half>() : nullptr;
  const at::Half* vsh = int4 ? vs.data_ptr<at::Half>() : nullptr;
  if (path == 0 && kv::fast_groups(int4, Gk) && kv::fast_groups(int4, Gv)) {
    const int kind = int4 ? kv::kI4 : kv::kI8;
    const kv::Side kside{kcp, row_bytes, ksf, ksh, ksw, kv::chunk_table(kind, D, Gk)};
    const kv::Side vside{vcp, row_bytes, vsf, vsh, vsw, kv::chunk_table(kind, D, Gv)};
    const at::Tensor qc = q.contiguous();
    at::Tensor y = at::empty({B, H, S, D}, qc.options());  // scores q . k / sqrt(D), as the scalar loop's
    kv::attend_fast(kind, kside, vside, qc.data_ptr(), qtype_of(qt), sm, P, V, B, H, KVH, S, T, D, y.data_ptr(),
                    SK);
    return y;
  }
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, H, S, D}, qf.options());
  const float* Q = qf.data_ptr<float>();
  float* O = out.data_ptr<float>();
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
      if (SK != nullptr) mx = std::max(mx, SK[item]);  // item = (b * H + h) * S + s
      float sum = SK != nullptr ? std::exp(SK[item] - mx) : 0.f;
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
  return kv_attention_impl(q, k_codes, k_scale, v_codes, v_scale, pos, valid, 0, std::nullopt);
}

// affineq::kv_attention_sinks: kv_attention with sink logits (an op of its own: schemas never change)
at::Tensor kv_attention_sinks_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                  const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& pos,
                                  const at::Tensor& valid, const at::Tensor& sinks) {
  return kv_attention_impl(q, k_codes, k_scale, v_codes, v_scale, pos, valid, 0, sinks);
}

// affineq::float_kv_attention: the fast path over a float cache, k / v [B, KVH, T, D] float32 / bfloat16 / float16
// (one dtype, D % 16 == 0), logits (q . k) * scale, fp32 products and sums, sinks as kv_attention_sinks'; [B, H, S,
// D] in q's dtype.
at::Tensor float_kv_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& pos, const at::Tensor& valid, double scale,
                                   const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "affineq::float_kv_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, H, S, D], got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const auto kt = k.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf, op,
              ": k must be float32, bfloat16 or float16, got ", kt);
  TORCH_CHECK(v.scalar_type() == kt && v.sizes() == k.sizes(), op, ": v must match k, got ", v.scalar_type(), " ",
              v.sizes(), " and ", kt, " ", k.sizes());
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(3) == D && k.size(1) > 0 && H % k.size(1) == 0, op,
              ": k must be [B, KVH, T, D] with KVH dividing H, got ", k.sizes(), " for q ", q.sizes());
  TORCH_CHECK(D % 16 == 0, op, ": the head size must be a multiple of 16, got ", D,
              " (other sizes: scaled_dot_product_attention)");
  const int64_t KVH = k.size(1), T = k.size(2);
  check_common(op, q, pos, valid, T, {&q, &k, &v, &pos, &valid}, sinks);
  const at::Tensor sk = sinks_per_query(sinks, B, H, S);
  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), ps = pos.contiguous(), vl = valid.contiguous();
  at::Tensor out = at::empty({B, H, S, D}, qc.options());
  const int kind = kt == at::kFloat ? kv::kF32 : kt == at::kBFloat16 ? kv::kBF16 : kv::kF16;
  const int64_t row_bytes = D * k.element_size();
  const auto table = kv::chunk_table(kind, D, D);
  const kv::Side kside{static_cast<const uint8_t*>(kc.data_ptr()), row_bytes, nullptr, nullptr, 0, table};
  const kv::Side vside{static_cast<const uint8_t*>(vc.data_ptr()), row_bytes, nullptr, nullptr, 0, table};
  kv::attend_fast(kind, kside, vside, qc.data_ptr(), qtype_of(q.scalar_type()), float(scale), ps.data_ptr<int64_t>(),
                  vl.data_ptr<bool>(), B, H, KVH, S, T, D, out.data_ptr(), sinks ? sk.data_ptr<float>() : nullptr);
  return out;
}

at::Tensor float_kv_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                                  const at::Tensor& valid, double scale) {
  return float_kv_attention_impl(q, k, v, pos, valid, scale, std::nullopt);
}

// affineq::float_kv_attention_sinks: float_kv_attention with sink logits
at::Tensor float_kv_attention_sinks_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& pos, const at::Tensor& valid, double scale,
                                        const at::Tensor& sinks) {
  return float_kv_attention_impl(q, k, v, pos, valid, scale, sinks);
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) {
  m.impl("kv_attention", &affineq::kv_attention_cpu);
  m.impl("kv_attention_sinks", &affineq::kv_attention_sinks_cpu);
  m.impl("float_kv_attention", &affineq::float_kv_attention_cpu);
  m.impl("float_kv_attention_sinks", &affineq::float_kv_attention_sinks_cpu);
}

TORCH_LIBRARY_FRAGMENT(affineq_cpp, m) {
  m.def("kv_attention_path(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, Tensor pos, "
        "Tensor valid, int path, Tensor? sinks=None) -> Tensor",
        &affineq::kv_attention_impl);
}
