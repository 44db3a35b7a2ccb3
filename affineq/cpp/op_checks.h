// Argument rules and switches shared by the torch op bindings (defined in lowbit_ops.cpp; grouped.cpp uses them
// too, so the 2-D and the grouped ops accept exactly the same weights).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "lowbit_kernels.h"

namespace affineq {

// Whether the kill switch (affineq.cpp._set_disabled / AFFINEQ_DISABLE_CPP_KERNELS) is on.
bool kernels_disabled();

// Bytes of pack_codes output for an [n, k] weight of `bits`-bit codes.
int64_t packed_nbytes(int64_t n, int64_t k, int64_t bits);

// Whether the VNNI GEMM may round x of this dtype to 16-bit fixed point (AFFINEQ_KERNELS_INT16_X).
bool allow_int16_x(at::ScalarType xt);

// TORCH_CHECKs codes against bits and the qparams of one [n, k] weight (scale / offset [n, G]); returns whether the
// scales are e8m0 exponent bytes. `op` names the op in the messages.
bool check_qparams(const char* op, const at::Tensor& scale, const std::optional<at::Tensor>& offset_opt,
                   int64_t bits, int64_t codes, int64_t code_offset, int64_t n, int64_t G);

// The weight fields of p: packed codes, scale / offset (offset null: scale * code_offset) of dtype qdtype (float32,
// bfloat16, float16 or uint8 e8m0), and the shape; x / y stay as they are.
void set_weight(LowbitProblem& p, const void* packed, const void* scale, const void* offset, at::ScalarType qdtype,
                int64_t code_offset, int64_t bits, int64_t codes, int64_t group_size, int64_t n, int64_t k);

// A weight's tensors made contiguous (packed, scale, offset: undefined when absent) and p, set_weight over them:
// p is valid while this lives.
struct WeightTensors {
  at::Tensor packed, scale, offset;
  LowbitProblem p;
  WeightTensors(const at::Tensor& packed_, const at::Tensor& scale_, const std::optional<at::Tensor>& offset_,
                int64_t code_offset, int64_t bits, int64_t codes, int64_t group_size, int64_t n, int64_t k);
};

// bias [n] of x's dtype on the CPU, or None (a clear error naming `op` otherwise).
void check_bias(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n);

// The weight-only kernels (lowbit_linear_f32) on x [..., k] (float32 / bfloat16 / float16, CPU) for the weight
// problem p (its x / y fields unset): x is padded to whole 8-column units; returns [..., n] in x's dtype. `path`
// is lowbit_linear_f32's force_path. bf16_compute with float32 x: the values of x.to(bf16) run, then .to(float32),
// where the bf16 paths read the rounded x and write the widened y themselves. bias [n] (x's dtype, checked by the
// caller): the result + bias, bit for bit a separate add after the op (added as the kernels store y where they
// can, LowbitProblem::bias; otherwise in the pass that converts y to x's dtype).
at::Tensor run_weight_problem(const at::Tensor& x, LowbitProblem p, int64_t path, bool bf16_compute = false,
                              const std::optional<at::Tensor>& bias = std::nullopt);

}  // namespace affineq
