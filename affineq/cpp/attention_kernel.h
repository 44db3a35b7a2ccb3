// The vector path of affineq::kv_attention and affineq::float_kv_attention (attention_kernel.cpp; the ops, their
// checks and the scalar loop: attention.cpp). Math and cache layouts: affineq/cpp/kv_attention.py.
//
// One work item serves the H / KVH query heads that share a kv head (in blocks of up to 4), so each cache slot is
// decoded once per block, not once per query head; 16 dims of a slot are decoded to fp32 (scale applied) and
// multiplied into every query of the block; 16 slots' score vectors are summed across lanes together. The slots
// are cut into chunks of 256: each chunk gives its softmax max m, sum l and unnormalised output o, and the
// chunks of a query are folded in slot order, whether one item runs them one after another or, when (b, kv
// head, query) items are too few for the threads, each chunk is an item of its own: the result never depends on
// the thread count. All of it goes through simd.h's 16-lane vectors (AVX-512, AVX2 or the portable arrays).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace affineq::detail {
struct Scratch;
}

namespace affineq::kv {

// Cache element kinds of the fast path: int8 / int4 codes with their scales, or float32 / bfloat16 / float16
// values (affineq::float_kv_attention: a float cache, no scales).
enum Kind : int { kI8, kI4, kF32, kBF16, kF16 };

// Where the 16 dims [16 c, 16 c + 16) of a slot's row live: int8 bytes, int4 low or high nibbles of 16 bytes, or
// (groups of 16) the low then high nibbles of 8 bytes; g = their group. Float kinds: byte = the first element's.
struct Chunk {
  int32_t byte;
  int32_t g;
  int8_t kind;  // 0 int8, 1 low nibbles, 2 high nibbles, 3 both nibbles of 8 bytes
};

// Whether a group size takes the vector path: int8 groups of 16 dims or multiples, int4 groups of 16 or multiples
// of 32 (a 16-dim piece then lies in one group's low or high nibbles).
bool fast_groups(bool int4, int64_t G);

// Where each 16-dim piece of a row of D lives, for element kind `kind` and group size G (float kinds: any G).
std::vector<Chunk> chunk_table(int kind, int64_t D, int64_t G);

// One side (keys or values) of the cache.
struct Side {
  const uint8_t* codes;  // slot t's row at codes + t * row_bytes
  int64_t row_bytes;
  const float* sf;       // int8: fp32 scales, `words` per slot (else null)
  const at::Half* sh;    // int4: float16 (scale, min) pairs, `words` per slot (else null)
  int64_t words;         // 0 for a float cache
  std::vector<Chunk> chunks;  // D / 16 (chunk_table)
  // The fp32 scale words of slots [t, t + nt): the tensor itself (int8) or converted into buf (int4).
  const float* scales(int64_t t, int64_t nt, detail::Scratch& buf) const;
};

// Query / output element types of attend_fast.
enum QType : int { kQF32, kQBF16, kQF16 };

// out [B, H, S, D] (q's type) = attention of the queries q [B, H, S, D] (float32 / bfloat16 / float16, qtype), each
// taken to fp32 and times `scale` (logits (q . k) * scale), over the cache sides k / v [B, KVH, T, ...]: query s of
// batch row b reads the slots t <= P[s] with V[b * T + t]; a query with no slot gives 0. fp32 products and sums,
// the output rounded once to q's type. sinks: null, or one fp32 logit per query [B, H, S] that joins its softmax's
// denominator only (p_t = exp(s_t) / (sum_u exp(s_u) + exp(sink)), gpt-oss).
void attend_fast(int kind, const Side& k, const Side& v, const void* q, int qtype, float scale, const int64_t* P,
                 const bool* V, int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t T, int64_t D, void* out,
                 const float* sinks);

}  // namespace affineq::kv
