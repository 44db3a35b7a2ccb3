// The compute-bound linear of the dense format (dequant_gemm.cpp; the k-quant formats reach it through the dense
// paths): y = x @ W^T with W decoded block by block into a per-thread buffer that stays in L2, each block
// multiplied with all of x by torch's own GEMM (at::mm_out: oneDNN / MKL, which pick AMX, AVX-512 or AVX2 at run
// time). The packed weight is read once per call in its compact form; the arithmetic runs at the float GEMM's
// speed. What differs between formats is only the block decoder, a functor
//     decode(u0, u1, void* dst, int64_t ld)
// that writes rows [u0 * unit_rows, min(n, u1 * unit_rows)) of W (r0 = u0 * unit_rows, rows = their count) in
// the GEMM's dtype (x2's: fp32 or bf16):
//     weight_transposed = false: row r at dst + (r - r0) * ld elements, ld = k
//     weight_transposed = true:  W^T, element (r, kk) at dst + kk * ld + (r - r0), ld = rows
// The result is dequantize-then-F.linear in x2's dtype, up to the GEMM's summation order.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace affineq::detail {
namespace {

struct BlockedGemmShape {
  int64_t unit_rows;          // rows the decoder writes per unit (a 16-row panel, or a whole block of rows)
  int64_t block_units;        // units decoded and multiplied at a time (one block, about 1 MiB of weight)
  bool weight_transposed;     // blocks as W^T [k, rows] (see above) rather than W [rows, k]
  bool transposed_output;     // each GEMM writes a contiguous row slice of y^T [n, M] (W_blk @ x^T) instead of a
                              // strided column slice of y [M, n] (x @ W_blk^T); y^T is transposed once at the end
};

// x's sizes with the last one replaced by n: the shape of a linear's output.
inline std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return sizes;
}

// y [M, n] (a transposed view when shape.transposed_output) = x2 @ W^T for x2 [M, k] contiguous, in x2's dtype.
// Call inside at::AutoDispatchBelowADInplaceOrView (the GEMMs dispatch again; this has no derivative).
template <class Decode>
at::Tensor blocked_linear(const at::Tensor& x2, int64_t n, int64_t k, const BlockedGemmShape& shape,
                          Decode&& decode) {
  const int64_t M = x2.size(0), ur = shape.unit_rows, bu = std::max<int64_t>(1, shape.block_units);
  const bool wt = shape.weight_transposed, tr = shape.transposed_output;
  at::Tensor y = tr ? at::empty({n, M}, x2.options()) : at::empty({M, n}, x2.options());
  const at::Tensor x2t = x2.t();
  if (M > 0 && n > 0) {
    // One parallel region: each thread takes a contiguous range of units, decodes a block of them into its own
    // buffer and multiplies it with all of x by a GEMM that runs on that thread (oneDNN and MKL run
    // single-threaded inside a parallel region). One fork/join per call, however many blocks.
    const at::ThreadLocalState tls;  // the caller's inference mode, dispatch keys, ... for the workers' GEMMs
    at::parallel_for(0, (n + ur - 1) / ur, 1, [&](int64_t q0, int64_t q1) {
      const at::ThreadLocalStateGuard tls_guard(tls);
      const int64_t cap = std::min(n, std::min(q1 - q0, bu) * ur);  // rows of the largest block
      at::Tensor buf = wt ? at::empty({k, cap}, x2.options()) : at::empty({cap, k}, x2.options());
      for (int64_t b0 = q0; b0 < q1; b0 += bu) {
        const int64_t b1 = std::min(q1, b0 + bu), r0 = ur * b0, rows = std::min(ur * b1, n) - r0;
        // W^T blocks are [k, rows] with a row stride of rows (contiguous), W blocks [rows, k]
        const at::Tensor wblk =
            wt ? buf.view(-1).narrow(0, 0, k * rows).view({k, rows}).t() : buf.narrow(0, 0, rows);
        decode(b0, b1, buf.mutable_data_ptr(), wt ? rows : k);
        if (tr) {
          at::Tensor out = y.narrow(0, r0, rows);
          at::mm_out(out, wblk, x2t);
        } else {
          at::Tensor out = y.narrow(1, r0, rows);
          at::mm_out(out, x2, wblk.t());
        }
      }
    });
  }
  return tr ? y.t() : y;
}

}  // namespace
}  // namespace affineq::detail
