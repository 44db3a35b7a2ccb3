// Plain-C++ interface of the weight-only low-bit linear kernels (no torch types, so the SIMD translation
// units compile fast). Defined in dispatch.cpp (overview of the files there); the op binding is lowbit_ops.cpp.
#pragma once
#include <cstdint>

namespace affineq {

// y[m, n] = sum_k x[m, k] * (scale[n, k / gs] * c(u[n, k]) + offset[n, k / gs]), where c(u) = u for integer
// codes, the float8 value of the byte u for codes == kCodesE4M3 / kCodesE5M2 (bits == 8), and the OCP MX
// element value of the bit pattern u (sign in the top bit) for kCodesFp4E2M1 (bits == 4) and kCodesFp6E2M3 /
// kCodesFp6E3M2 (bits == 6).
constexpr int kCodesUint = 0, kCodesE4M3 = 1, kCodesE5M2 = 2, kCodesFp4E2M1 = 3, kCodesFp6E2M3 = 4, kCodesFp6E3M2 = 5;

// int8_fake_quant's qparams for rows quantized inside a GEMM: each row's own (per_token) or one pair for all of
// x, computed by int8_x_quant.
struct Int8XQuant {
  bool per_token;
  int mode;
  float eps;
  float scale, zp;  // all of x's (not per_token)
};

struct LowbitProblem {
  const float* x;          // [m, k8] fp32, row stride ldx; k8 = k rounded up to 8, padding columns are 0
  int64_t ldx;
  int64_t m;
  const uint8_t* packed;   // codes in the panel layout documented in affineq/cpp/__init__.py
  const void* scale;       // [n, k / group_size] fp32, bf16 (qparams_bf16) or fp16 (qparams_f16), contiguous
  const void* offset;      // [n, k / group_size], same dtype as scale; null: offset = scale * code_offset
  // bf16 qparams use the tinygemm convention: offset holds the zero z, W = scale * (u - 2^(bits-1)) + z
  // (integer codes only), so a float zero point is stored exactly instead of a rounded scale * u offset.
  bool qparams_bf16 = false;
  // fp16 qparams use the fp32 convention W = scale * u + offset (GGUF's Q4_1: d * u + m, stored as in the file).
  bool qparams_f16 = false;
  // e8m0 qparams (OCP MX): scale holds one exponent byte b per group (uint8, value 2^(b - 127); 255 = NaN) and
  // there is no offset array.
  bool qparams_e8m0 = false;
  // Without an offset array the offset is scale * code_offset: quant_min for integer codes stored as
  // u = q - quant_min (symmetric codes: W = scale * q), 0 for float codes. Only with 16-bit or e8m0 scales,
  // whose products with u and with code_offset are exact in fp32, so W = scale * (c(u) + code_offset) exactly.
  int code_offset = 0;
  // k-quant qparams (2..6 for q2_k .. q6_k; kquant_decode.h): scale holds the sub-scale bytes [n, k / group_size]
  // (group_size the sub-block: 32 or 16), offset the min bytes (q4_k / q5_k; null otherwise), kq_super the fp16 d
  // (and dmin) of each super-block [n, k / 256, 1 or 2]; per group W = (d * sc_j) * u - dmin * m_j, or
  // (d * sc_j) * (u - 2^(bits-1)) for the signed kinds (the kernels only: dequantize_f32 takes no k-quant).
  // 0: not k-quant.
  int qparams_kquant = 0;
  const uint16_t* kq_super = nullptr;
  int bits;                // 1..8
  int codes = kCodesUint;  // kCodesE4M3 / kCodesE5M2 need bits == 8, kCodesFp4E2M1 4, kCodesFp6E2M3 / E3M2 6
  int64_t group_size;      // divides k
  int64_t n;
  int64_t k;
  float* y;                // [m, n] fp32, row stride ldy (fully overwritten)
  int64_t ldy;
  bool allow_int16_x = false;  // may the VNNI path round x to 16-bit fixed point (see gemm_int16.cpp)?
  const uint16_t* x_bf16 = nullptr;  // the same x as bf16 [m, k8] (row stride ldx) when the caller's x is bf16:
                                     // enables the bf16 dot-product path (AVX512-BF16)
  uint16_t* y_bf16 = nullptr;  // where lowbit_bf16_io: write y there as bf16 [m, n] (row stride ldy; rounded to
                               // nearest even, NaN as 0x7FC0: torch's float -> bf16) instead of into y
  bool y_bf16_values = false;  // where lowbit_bf16_io and y_bf16 is null: write y (fp32) as those bf16 values
                               // widened back (a float32 caller computing in bf16: no bf16 copy of y)
  // Path 5 only (lowbit_path must give 5): x_bf16's rows are int8_fake_quant-ed with these qparams as the GEMM
  // packs them, so y = lowbit_linear(int8_fake_quant(x)) without a quantized copy of x (lowbit_ops.cpp).
  const Int8XQuant* x_quant = nullptr;
  // Path 5 only: float32 x [m, k] (row stride ldx, k % 32 == 0) that the GEMM rounds to bf16 row by row as it
  // packs it (before x_quant's quantization), read instead of x_bf16 (which then only marks the input as bf16 for
  // the path choice): a float32 caller computing in bf16 without a bf16 copy of x.
  const float* x_round = nullptr;
  // [n] fp32 or null: y = x @ W^T + bias, each value the product as y stores it plus bias[c], rounded to y's
  // dtype (the values of a separate add after the op). Paths 2, 3 and 4 (fp32 y) add it as they store their
  // tiles; the others in one pass over their y after it (dispatch.cpp, add_bias).
  const float* bias = nullptr;
};

Int8XQuant int8_x_quant(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps);
// One row [k] of int8_fake_quant_bf16 with q's qparams: y's values are that op's, bit for bit.
void int8_fake_quant_row_bf16(const uint16_t* x, int64_t k, const Int8XQuant& q, uint16_t* y);

// Runs on torch's intra-op thread pool. force_path: 0 = heuristic, 1 = fused GEMV, 2 = dequant + fp32 GEMM,
// 3 = dequant + int16 VNNI GEMM (AVX512-VNNI builds only; otherwise 2), 4 = dequant to bf16 + bf16 dot GEMM
// (AVX512-BF16 builds and bf16 x only; otherwise 3 or 2).
void lowbit_linear_f32(const LowbitProblem& p, int force_path = 0);
// The same for `count` problems that share x (and m, k, ldx) and the weight configuration (bits, codes,
// group_size, qparam kinds), each writing its own y: where the GEMV serves them, one pool of work items over all
// of their weights (one call and one thread fork instead of `count`); otherwise one after the other.
void lowbit_linear_multi_f32(const LowbitProblem* ps, int64_t count, int force_path = 0);

// w[n, k] = scale[n, k / gs] * c(u[n, k]) + offset[n, k / gs] as fp32 [n, k] (portable code; used by backward).
// qparams as in LowbitProblem (offset is null for e8m0 qparams).
void dequantize_f32(const uint8_t* packed, const void* scale, const void* offset, bool qparams_bf16,
                    bool qparams_f16, bool qparams_e8m0, int code_offset, int bits, int codes, int64_t group_size, int64_t n,
                    int64_t k, float* w);

// y[m, k] = dequantize(quantize(x)) with int8 activation codes, qparams per row (per_token) or over all of x;
// mode 0 symmetric, 1 symmetric without clipping, 2 asymmetric (integer zero point); the result is clamped to
// +-out_max (the output dtype's largest finite value). Bit-identical to affineq/tensor/activation.py's shortcuts.
void int8_fake_quant_f32(const float* x, int64_t m, int64_t k, bool per_token, int mode, float eps, float out_max,
                         float* y);
// The same for bf16 x [m, k] into bf16 y: rows widened to fp32 (exact), each result rounded to bf16 as torch
// rounds (nearest even, NaN as 0x7FC0) after the clamp to bf16's largest finite value.
void int8_fake_quant_bf16(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                          uint16_t* y);

// The same quantization as int8 codes: codes[m, k] = clamp(round(x / scale[r]) + zp[r], -128, 127) with the
// qparams of row r (or of all of x), so dequantize(codes) is exactly int8_fake_quant_f32's result. With csum:
// csum[m, g] = the sum of row m's codes over k in [g * gs, (g + 1) * gs) (gs divides k). amx_tiles (k % 64 == 0):
// the codes are written as AMX A tiles, code (r, kk) at ((r / 16) * (k / 64) + kk / 64) * 1024 + (r % 16) * 64 +
// kk % 64 (rows past m are not written).
void int8_quantize_rows(const float* x, int64_t m, int64_t k, bool per_token, int mode, float eps, int8_t* codes,
                        float* scale, int32_t* zp, int32_t* csum = nullptr, int64_t gs = 0, bool amx_tiles = false);
// The same for bf16 x (its values widened to fp32: the codes of x.to(float32)).
void int8_quantize_rows_bf16(const uint16_t* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                             int8_t* codes, float* scale, int32_t* zp, int32_t* csum = nullptr, int64_t gs = 0,
                             bool amx_tiles = false);
// The same for fp32 x read as its bf16 values: the codes of x.to(bfloat16) (a weight computed in bf16).
void int8_quantize_rows_rounded(const float* x, int64_t m, int64_t k, bool per_token, int mode, float eps,
                                int8_t* codes, float* scale, int32_t* zp, int32_t* csum = nullptr, int64_t gs = 0,
                                bool amx_tiles = false);

// y[m, n] = sx[m] * sum_k (c[m, k] - zp[m]) * W[n, k] for int8 activation codes c and a dense 8-bit integer
// weight (fp32 qparams), with the code products summed exactly in int32 (VNNI u8 x s8 dot products). Built
// for one weight (its qparams are transposed once) and run once per step of a recurrence.
class Int8CodesGemm {
 public:
  // Whether this build has the kernel (AVX512-VNNI + VBMI) and p's weight is one it reads: 8- or 4-bit integer
  // codes, fp32 / bf16 / fp16 qparams (offset array or code_offset), n a multiple of 16, group_size of 8.
  static bool supported(const LowbitProblem& p);
  static bool built();  // whether this build has the kernel at all
  // zero_points: rows may have zp != 0; per_item: each work item reads its panels' qparams when it runs (a call
  // that runs once), instead of all of them transposed here (a recurrence that runs many times).
  Int8CodesGemm(const LowbitProblem& p, bool zero_points, bool per_item = false);
  ~Int8CodesGemm();
  Int8CodesGemm(const Int8CodesGemm&) = delete;
  Int8CodesGemm& operator=(const Int8CodesGemm&) = delete;
  // x [m, k] fp32 (row stride k) is quantized as int8_quantize_rows does; y [m, n] (row stride n) is overwritten.
  void run(const float* x, int64_t m, bool per_token, int mode, float eps, float* y);
  // The same with x and / or y as bf16 (x_bf16 / y_bf16 set, x / y null): x's values widened to fp32, y rounded
  // to bf16 (nearest even) as it is stored; bit-equal to widening x and rounding the fp32 y afterwards. bf16_values
  // (fp32 x and y): x read as x.to(bfloat16) and y written as its bf16 values widened, the fp32 result of the
  // bf16 run on x.to(bfloat16), bit for bit, with no bf16 copy of x or y. bias [n] (fp32 values; null: none) is
  // added to each row as it is stored, bit for bit the separate add of y's dtype (bf16 y: rounded, then the sum).
  void run(const float* x, const uint16_t* x_bf16, int64_t m, bool per_token, int mode, float eps, float* y,
           uint16_t* y_bf16, bool bf16_values = false, const float* bias = nullptr);

  struct State;  // defined in gemm_int8_codes.cpp

 private:
  State* s_;
};

// The path lowbit_linear_f32 takes for p (reads only m, n, k, bits, group_size, codes, allow_int16_x, x_bf16).
int lowbit_path(const LowbitProblem& p, int force_path = 0);
// Whether that path reads x_bf16 alone (x may be null) and honours y_bf16: path 4, and path 1's bf16 tiles (the
// 4-bit bf16-dot GEMV; the other widths but float8 from 3 rows).
bool lowbit_bf16_io(const LowbitProblem& p, int force_path = 0);

// "avx512", "avx2" or "scalar": which SIMD path this build compiled.
const char* kernel_isa();

}  // namespace affineq
