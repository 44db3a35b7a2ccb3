// Entry points of the weight-only low-bit linear kernels (declared in lowbit_kernels.h): the path choice and
// the dispatch on the bit width.
//
// y = x @ W^T with W[n, k] = scale[n, g] * u[n, k] + offset[n, g], g = k / group_size, u unsigned `bits`-bit
// codes in the 16-row panel layout (documented in affineq/cpp/__init__.py), or float8 bytes (e4m3fn / e5m2,
// 8-bit layout) or fp4 / fp6 bit patterns (4- / 6-bit layout, decode_fpx.h) whose value replaces u.
// scale/offset are fp32, or bf16 with the offset holding the zero z of W = scale * (u - 2^(bits-1)) + z; either
// way they are turned into fp32 scale/offset once per tile while being transposed (common.cpp), so the inner
// loops never see bf16; so are e8m0 exponent bytes (OCP MX scales, no offset array: offset = scale *
// code_offset).
//
// Five paths (chosen in path_for below), one file each:
//  1. gemv.cpp: fused GEMV (m <= 2 before path 3, 4 to 24 before path 4, 8 before path 2; group_size % 8 == 0):
//     decode codes straight into fp32 registers, 16 output rows per vector, FMA against broadcast x; scale/offset applied
//     once per group. Memory-bound at m = 1: the packed weights are streamed once, with software prefetch.
//     bf16 dot products instead for 4-bit codes with bf16 x and, from 3 rows of bf16 x, for the other widths but
//     float8 (decoded values as bf16 pairs); one row of fp32 x (of bf16 x too, on large weights of some widths) as
//     exact integer digits through VNNI dot products (gemv_digits.cpp).
//  2. gemm_f32.cpp: dequant + fp32 GEMM (any group_size; the large-m path where VNNI is missing): dequantize
//     a [256 x 32] slice of W^T into an L1-resident fp32 tile and run a 12x32 (AVX-512) / 6x16 (AVX2)
//     outer-product micro-kernel over all m rows, so each dequantized tile is reused m times.
//  3. gemm_int16.cpp: dequant + int16 VNNI GEMM (AVX512-VNNI, m >= 3, only if the caller allows rounding x: by
//     default for fp16 x, and bf16 x without AVX512-BF16): like 2 but with exact int16 code pairs and x
//     rounded to 16-bit fixed point per block; vpdpwssd does two MACs per lane at the issue rate of an fp32 FMA.
//  4. gemm_bf16.cpp: dequant to bf16 + bf16 dot GEMM (AVX512-BF16, bf16 x, past the GEMV's rows): like 2 but the tile
//     holds W rounded to bf16 (scale and offset already applied) and vdpbf16ps multiplies it with x as given: no
//     per-group rescaling in the inner loop, so small groups cost no more than large ones.
//  5. gemm_amx.cpp: path 4's bf16 tiles multiplied on AMX tiles (AMX-BF16 and the OS's permission, k % 32 == 0):
//     where path 4 would run, unless forced to 4.
// Shared code: simd.h (ISA shims), decode.h / decode_fpx.h (code decoders), common.h / common.cpp (scratch buffers, qparam
// loading, Ctx, GEMM tiling). Each path file instantiates its template for every width, so the files compile
// in parallel (see _build.py).
//
// Only <ATen/Parallel.h> is included (compiles fast, no torch types); threads come from torch's OpenMP pool.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "common.h"
#include "decode.h"

namespace affineq {
namespace detail {
namespace {

#if AQ_VNNI
constexpr bool kHasVnni = true;
#else
constexpr bool kHasVnni = false;
#endif
#if AQ_BF16DOT
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// Element i of an [n, G] qparam array as the kernels use it: the fp32 scale times `mul` (scale_at), or the fp32
// offset (for bf16 qparams: z - 2^(bits-1) * scale; without an offset array: scale * code_offset). Two functions,
// not one calling itself: GCC refuses to inline a recursive always_inline function at -O0.
AQ_INLINE float scale_at(const LowbitProblem& p, float mul, int64_t i) {
  if (p.qparams_e8m0) return e8m0_to_float(static_cast<const uint8_t*>(p.scale)[i]) * mul;
  if (p.qparams_f16) return f16_to_float(static_cast<const uint16_t*>(p.scale)[i]) * mul;
  if (!p.qparams_bf16) return static_cast<const float*>(p.scale)[i] * mul;
  return bf16_to_float(static_cast<const uint16_t*>(p.scale)[i]) * mul;
}
AQ_INLINE float qparam_at(const LowbitProblem& p, bool offset, float mul, int64_t i) {
  if (!offset) return scale_at(p, mul, i);
  if (p.offset == nullptr) return p.code_offset == 0 ? 0.f : scale_at(p, static_cast<float>(p.code_offset), i);
  if (p.qparams_e8m0) return e8m0_to_float(static_cast<const uint8_t*>(p.scale)[i]) * mul;
  if (p.qparams_f16) return f16_to_float(static_cast<const uint16_t*>(p.offset)[i]);
  if (!p.qparams_bf16) return static_cast<const float*>(p.offset)[i] * mul;
  return bf16_to_float(static_cast<const uint16_t*>(p.offset)[i]) -
         static_cast<float>(1 << (p.bits - 1)) * bf16_to_float(static_cast<const uint16_t*>(p.scale)[i]);
}

// The path a problem runs (1..5, see the header), given force_path (0 = choose).
int path_for(const LowbitProblem& p, int force_path) {
  const bool gemv_ok = p.group_size % 8 == 0;  // the GEMV and the int16 GEMM step through groups 8 k at a time
  // The caller decides (x dtype, environment); float8 values are not int16 codes, so they never take it.
  const bool int16_codes = p.codes != kCodesE4M3 && p.codes != kCodesE5M2;  // integers, fp4 / fp6 (decode.h)
  const bool use_vnni = kHasVnni && p.allow_int16_x && int16_codes && gemv_ok;
  const bool use_bf16 = kHasBf16Dot && p.x_bf16 != nullptr;
  // Path 4's bf16 tiles on AMX tiles where the CPU has them and k is whole A tiles (32 bf16).
  const bool use_amx = use_bf16 && p.k % 32 == 0 && amx_cpu();
  const int big = use_amx ? 5 : use_bf16 ? 4 : use_vnni ? 3 : 2;  // the GEMM path for this x
  int path = force_path;
  // Rows up to which the fused GEMV runs before the GEMM path: it streams the packed weights (one pass per 1-4
  // rows of x), where a GEMM first widens every weight, a fixed cost that fewer rows do not amortize. With bf16
  // x the GEMV's bf16 tiles (up to 8 rows per pass) stay ahead of the bf16 GEMM up to 8 rows for 8-bit integer
  // codes (16 on weights of 2M weights or more), 16 (24) for 4-bit codes, 4 for the other widths; the int16 GEMM
  // (fp16 x) from 3 rows. The AMX GEMM overtakes the GEMV from 7 rows for 4-bit codes, from 5 for the others.
  // Tuned by measurement (see benchmarks/README.md, kernel design measurements).
  const bool bf16_tiles_ahead = p.codes == kCodesUint && (p.bits == 4 || p.bits == 8) && gemv_reads_bf16_only(p);
  const bool b4 = p.codes == kCodesUint && p.bits == 4;
  const bool large = p.n * p.k >= (int64_t{1} << 21);
  const int64_t many_rows = b4 ? (large ? 24 : 16) : large ? 16 : 8;
  const int64_t gemv_rows = big == 2   ? 8
                            : big == 3 ? 2
                            : big == 5 ? (b4 ? 6 : 4)
                            : bf16_tiles_ahead ? many_rows
                                               : 4;
  if (path == 0) path = !gemv_ok ? big : p.m <= gemv_rows ? 1 : big;
  if (path == 5 && !use_amx) path = 4;
  if (path == 4 && !use_bf16) path = use_vnni ? 3 : 2;
  if (path == 3 && !(kHasVnni && int16_codes && gemv_ok)) path = 2;
  if (path == 1 && !gemv_ok) path = 2;
  return path;
}

// Whether `path` adds p.bias as it stores y (store_tiles_f32): the fp32 GEMMs, and the bf16 one into fp32 y.
bool adds_bias(const LowbitProblem& p, int path) {
  return path == 2 || path == 3 || (path == 4 && p.y_bf16 == nullptr && !p.y_bf16_values);
}

// y += bias for a path that does not add it itself: one pass over y, each value rounded to y's dtype (bf16 y:
// widened, added in fp32, rounded to nearest even, as aten's add of two bf16 tensors).
void add_bias(const LowbitProblem& p) {
  at::parallel_for(0, p.m, grain_for(p.n), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (p.y_bf16 != nullptr) {
        uint16_t* row = p.y_bf16 + m * p.ldy;
        for (int64_t c = 0; c < p.n; ++c) row[c] = float_to_bf16(bf16_to_float(row[c]) + p.bias[c]);
      } else {
        float* row = p.y + m * p.ldy;
        for (int64_t c = 0; c < p.n; ++c) row[c] += p.bias[c];
      }
    }
  });
}

template <int B>
void run(const Ctx& c, int force_path) {
  const int path = path_for(*c.p, force_path);
  if (path == 1) gemv_path<B>(&c, 1);
#if AQ_VNNI
  else if (path == 3) {
    if constexpr (int16_ok(B)) qgemm_path<B>(c);
  }
#endif
#if AQ_BF16DOT
  else if (path == 4) bgemm_path<B>(c);
#endif
#if AQ_AMX
  else if (path == 5) amx_gemm_path<B>(c);
#endif
  else gemm_path<B>(c);
}

// fn(integral_constant<int, B>) for the template width B of p's (bits, codes): the one map from a problem to the
// instantiated kernels (other bit widths are rejected by the callers).
template <class F>
void with_width(const LowbitProblem& p, F&& fn) {
  using std::integral_constant;
  switch (p.bits) {
    case 1: fn(integral_constant<int, 1>{}); break;
    case 2: fn(integral_constant<int, 2>{}); break;
    case 3: fn(integral_constant<int, 3>{}); break;
    case 4:
      if (p.codes == kCodesFp4E2M1) fn(integral_constant<int, kBF4>{});
      else fn(integral_constant<int, 4>{});
      break;
    case 5: fn(integral_constant<int, 5>{}); break;
    case 6:
      if (p.codes == kCodesFp6E2M3) fn(integral_constant<int, kBF6A>{});
      else if (p.codes == kCodesFp6E3M2) fn(integral_constant<int, kBF6B>{});
      else fn(integral_constant<int, 6>{});
      break;
    case 7: fn(integral_constant<int, 7>{}); break;
    case 8:
      if (p.codes == kCodesE4M3) fn(integral_constant<int, kBE4M3>{});
      else if (p.codes == kCodesE5M2) fn(integral_constant<int, kBE5M2>{});
      else fn(integral_constant<int, 8>{});
      break;
    default: break;
  }
}

}  // namespace
}  // namespace detail

void lowbit_linear_f32(const LowbitProblem& p, int force_path) {
  // x_quant is read by path 5's packing alone: on any other path x would go unquantized
  if (p.x_quant != nullptr && detail::path_for(p, force_path) != 5)
    throw std::logic_error("affineq: LowbitProblem::x_quant is set but the path is not 5 (check lowbit_path first)");
  const detail::Ctx c = detail::make_ctx(p);
  detail::with_width(p, [&](auto B) { detail::run<AQ_CV(B)>(c, force_path); });
  if (p.bias != nullptr && p.m > 0 && !detail::adds_bias(p, detail::path_for(p, force_path))) detail::add_bias(p);
}

void lowbit_linear_multi_f32(const LowbitProblem* ps, int64_t count, int force_path) {
  if (count <= 0) return;
  if (count == 1 || detail::path_for(ps[0], force_path) != 1) {  // the GEMMs gain nothing from sharing a call
    for (int64_t i = 0; i < count; ++i) lowbit_linear_f32(ps[i], force_path);
    return;
  }
  std::vector<detail::Ctx> cs;
  for (int64_t i = 0; i < count; ++i) cs.push_back(detail::make_ctx(ps[i]));
  detail::with_width(ps[0], [&](auto B) { detail::gemv_path<AQ_CV(B)>(cs.data(), count); });
  for (int64_t i = 0; i < count; ++i)
    if (ps[i].bias != nullptr && ps[i].m > 0) detail::add_bias(ps[i]);
}

const char* kernel_isa() { return detail::kIsa; }

int lowbit_path(const LowbitProblem& p, int force_path) { return detail::path_for(p, force_path); }

bool lowbit_bf16_io(const LowbitProblem& p, int force_path) {
  const int path = detail::path_for(p, force_path);
  return path == 4 || path == 5 || (path == 1 && detail::gemv_reads_bf16_only(p));
}

void dequantize_f32(const uint8_t* packed, const void* scale, const void* offset, bool qparams_bf16,
                    bool qparams_f16, bool qparams_e8m0, int code_offset, int bits, int codes, int64_t group_size, int64_t n,
                    int64_t k, float* w) {
  const int64_t U = (k + 7) / 8, G = k / group_size, panel_bytes = 16 * U * bits;
  LowbitProblem qp{};
  qp.scale = scale;
  qp.offset = offset;
  qp.qparams_bf16 = qparams_bf16;
  qp.qparams_f16 = qparams_f16;
  qp.qparams_e8m0 = qparams_e8m0;
  qp.code_offset = code_offset;
  qp.bits = bits;
  at::parallel_for(0, (n + 15) / 16, detail::grain_for(16 * k), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t width = std::min<int64_t>(16, n - 16 * p);
      const uint8_t* base = packed + p * panel_bytes;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t row = 16 * p + j;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t u = kk / 8, t = kk % 8;
          const uint8_t* unit = base + u * width * bits;
          int code = 0, shift = 0, slot0 = 0;  // planes: 8, or 4/2/1 for the set bits (low bits first)
          for (int q : {8, 4, 2, 1}) {
            if (bits == 8 ? q != 8 : (q == 8 || (bits & q) == 0)) continue;
            const int per = 8 / q;
            const int byte = unit[(slot0 + t / per) * width + j];
            code |= ((byte >> ((t % per) * q)) & ((1 << q) - 1)) << shift;
            shift += q;
            slot0 += q;
          }
          const int64_t g = kk / group_size;
          const uint8_t b = static_cast<uint8_t>(code);
          const float c = codes == kCodesUint                         ? static_cast<float>(code)
                          : codes == kCodesE4M3 || codes == kCodesE5M2 ? detail::fp8_to_float(b, codes)
                                                                       : detail::fpx_to_float(b, codes);
          // One rounding of scale * c + offset, always (std::fma, not left to the compiler's contraction, which
          // fused only some elements); the PyTorch fallback computes the same in float64. Without an offset
          // array, scale * (c + code_offset): exact, with the product's sign when it is zero.
          const float s = detail::qparam_at(qp, false, 1.f, row * G + g);
          w[row * k + kk] = offset == nullptr ? s * (c + static_cast<float>(code_offset))
                                              : std::fma(s, c, detail::qparam_at(qp, true, 1.f, row * G + g));
        }
      }
    }
  });
}

}  // namespace affineq
