// Path 1's GEMV for one row of fp32 x (or of bf16 x, widened exactly by lowbit_ops.cpp's run_weight_problems)
// against 2- to 6-bit integer codes (k-quants' too; which of them on which CPU: use_x_digits), on integer digits
// of x (gemv_digits.cpp; gemv.cpp's gemv_path runs it). Per block of kb k, x = fx * q with
// fx = 2^(e - 30) a power of two (|x| < 2^e over the block) and q = round(x / fx) an integer of at most 30 bits,
// written as four signed bytes, q = d0 + 2^8 d1 + 2^16 d2 + 2^24 d3. VNNI u8 x s8 dot products (vpdpbusd: 4 MACs
// per int32 lane) sum the codes' products with each digit exactly in int32, and per block
//     sum_k (u_k - 2^(B-1)) x_k = fx * (2^16 (2^8 D3 + D2 - c_hi) + (2^8 D1 + D0 - c_lo)),   D_i = sum_k u_k d_i,k,
// where c_hi = 2^(B-1) (2^8 S3 + S2) and c_lo = 2^(B-1) (2^8 S1 + S0) take the bias off with the digits' sums S_i
// (integers, exact). Numerics: fx * q is x exactly for every element within 2^7 of the block's largest (and for
// subnormals: fx >= 2^-149); smaller ones are rounded to a multiple of fx, an error of at most 2^-31 of the
// block's bound 2^e. The block's sum is formed in fp32 from the two exact int32 halves (two roundings), then
// scaled and added per group as the FMA GEMV adds its groups. Four dot products per 16 rows x 4 k replace the FMA
// GEMV's decode (vpermb, shift, vcvtdq2ps) and FMA per k; the codes of a unit are gathered as the biased decoder
// gathers them (combine_planes_vbmi), then into VNNI lanes.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "lowbit_kernels.h"
#include "simd.h"

#if AQ_VNNI && defined(__AVX512VBMI__)
#define AQ_X_DIGITS 1  // the build has the tiles (use_x_digits also asks the CPU)
#endif

namespace affineq::detail {

// The code widths the digits serve: 2-bit codes (their fields picked by vpmultishiftqb), and those
// combine_planes_vbmi joins into bytes (decode.h) but 7 bits, whose unit decode left them slower than the biased
// FMA GEMV (benchmarks/README.md, kernel design measurements).
constexpr bool digits_width(int B) { return B >= 2 && B <= 6; }

// x's digits for the tiles: d [4][K8] (digit i of x[k] at d[i K8 + k'], with each unit of 8 k in the order the
// tiles read its codes: k 0 2 4 6 1 3 5 7); per block b (of nb): fx, c_hi and c_lo.
struct XDigits {
  int64_t K8 = 0, kb = 0, nb = 0;
  std::vector<int8_t> d;
  std::vector<float> fx;
  std::vector<int32_t> c_hi, c_lo;
  std::vector<int32_t> c_sub_hi, c_sub_lo;  // c_hi / c_lo of each 16 k (x_digits' sub_biases; else empty)
};

// Whether p (one row of fp32 x, or of bf16 x on weights of 2^19 weights or more; integer codes of a
// digits_width: fp32 / 16-bit qparams or a k-quant's) takes the digits on this build and CPU.
bool use_x_digits(const LowbitProblem& p);
// k per digit block for p's groups (group_size % 8 == 0): the group, or a divisor of it of at most 512 k, so that
// the int32 halves cannot overflow: |2^8 D_odd + D_even| <= 2^8 * 63 * 128 * 512 * 1.01 < 2^30, |c_hi|, |c_lo| <
// 2^29; q2_k's and q3_k's super-block of 256 k (their sub-scales applied in the int32 sums: gemv_digits.cpp's
// tile_q2k / tile_q3k).
int64_t digit_block(const LowbitProblem& p);
// One row x [K8] as digits in blocks of kb k, for B-bit codes (c_hi / c_lo; with sub_biases and kb % 16 == 0 also
// per 16 k, c_sub_hi / c_sub_lo); false (xd then meaningless) when x
// holds inf or NaN, or a block reaches 2^100 (its scaled halves could overflow fp32 before the scale brings them
// back).
bool x_digits(const float* x, int64_t K8, int64_t kb, int B, XDigits& xd, bool sub_biases = false);

// y[0 .. nvalid) = x @ W^T for `cnt` 16-row panels (pan: their B-bit units, 16 B bytes per 8 k) with their
// qparams qp (TileQp or KqQp<B>, gemv_groups.h) and gemv_path's group sums xs [2][G] (xs_a = (2^(B-1) + f) *
// sum(x): the codes' bias and the offset folded on the scale, see add_group).
template <int B, class QP>
void gemv_digits(const uint8_t* const* pan, int64_t cnt, const QP& qp, const XDigits& xd, const float* xs, int64_t G,
                 int64_t gs, float* y, int64_t nvalid, const NextItemPrefetch* pf);

}  // namespace affineq::detail
