// Linear layers on llama.cpp's k-quant weights (affineq::kquant_linear), as the k-quant formats store them: the
// codes bit-packed in the dense panel layout (the layout the int1..8 kernels read), one sub-scale byte (and for
// q4_k / q5_k one min byte) per sub-block, the fp16 d (and dmin) per super-block (kquant_decode.h). The weight
// problem is the dense one with k-quant qparams (LowbitProblem::qparams_kquant): every path of dispatch.cpp
// (fused GEMV, tile GEMMs, the dequantize + GEMM driver) runs on it unchanged; only the per-group scale and offset
// come from the sub-scales, once per work item (common.cpp's load_qparams). So q4_k runs at int4 g32's speed on
// fewer qparam bytes, q6_k at int6 g16's, and so on.
// Values: the scale d * sc_j and the offset of each sub-block are exact in fp32 and the kernels sum
// scale * dot(x, u) + offset * sum(x) per group, so y = F.linear(x.float(), W) up to the order and rounding of
// the fp32 sums (the dense kernels' bound), cast to x's dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kquant_decode.h"
#include "lowbit_kernels.h"
#include "op_checks.h"

namespace affineq {
namespace {

void check_bytes(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.device().is_cpu() && t.numel() == numel, op, ": ", name,
                    " must be a ", dtype, " CPU tensor with ", numel, " elements, got ", t.scalar_type(), " with ",
                    t.numel(), " on ", t.device());
}

at::Tensor kquant_impl(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const at::Tensor& d, int64_t kind, int64_t n, int64_t k,
                       const std::optional<at::Tensor>& bias) {
  const char* op = bias ? "affineq::kquant_linear_biased" : "affineq::kquant_linear";
  TORCH_CHECK_VALUE(!kernels_disabled(), op, ": the affineq C++ kernels are disabled");
  TORCH_CHECK_VALUE(kind >= 2 && kind <= 6, op, ": kind must be 2..6 (q2_k .. q6_k), got ", kind);
  TORCH_CHECK_VALUE(n >= 0 && k > 0 && k % detail::kSuperBlock == 0, op,
                    ": need n >= 0 and k a positive multiple of 256, got n=", n, ", k=", k);
  const auto xt = x.scalar_type();
  TORCH_CHECK_VALUE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, op, ": x must be a CPU tensor [..., k=",
                    k, "], got ", x.sizes(), " on ", x.device());
  const int64_t gs = detail::kq_group(kind), G = k / gs, nb = k / detail::kSuperBlock;
  check_bytes(op, "qdata", qdata, at::kByte, packed_nbytes(n, k, kind));
  check_bytes(op, "scales", scales, at::kByte, n * G);
  const bool has_mins = kind == 4 || kind == 5;
  TORCH_CHECK_VALUE(has_mins == (mins.has_value() && mins->defined()), op, ": mins must be given for q4_k / q5_k "
                    "(kind 4, 5) and None otherwise, got kind=", kind);
  if (has_mins) check_bytes(op, "mins", *mins, at::kByte, n * G);
  check_bytes(op, "d", d, at::kHalf, n * nb * detail::kq_supers(kind));
  const at::Tensor pk = qdata.contiguous(), sc = scales.contiguous(), dd = d.contiguous();
  const at::Tensor mn = has_mins ? mins->contiguous() : at::Tensor();
  LowbitProblem p;
  p.packed = pk.const_data_ptr<uint8_t>();
  p.scale = sc.const_data_ptr();
  p.offset = has_mins ? mn.const_data_ptr() : nullptr;
  p.qparams_kquant = static_cast<int>(kind);
  p.kq_super = reinterpret_cast<const uint16_t*>(dd.const_data_ptr());
  p.bits = static_cast<int>(kind);
  p.codes = kCodesUint;
  p.group_size = gs;
  p.n = n;
  p.k = k;
  check_bias(op, x, bias, n);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // an inference op: no derivative
  return run_weight_problem(x.detach(), p, 0, false, bias);
}

at::Tensor kquant_linear_cpu(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const at::Tensor& d, int64_t kind, int64_t n,
                             int64_t k) {
  return kquant_impl(x, qdata, scales, mins, d, kind, n, k, std::nullopt);
}

// kquant_linear + bias (bias [n] in x's dtype) bit for bit, the bias added as the kernels store y.
at::Tensor kquant_linear_biased_cpu(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, const at::Tensor& d, int64_t kind,
                                    int64_t n, int64_t k, const at::Tensor& bias) {
  return kquant_impl(x, qdata, scales, mins, d, kind, n, k, bias);
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) {
  m.impl("kquant_linear", &affineq::kquant_linear_cpu);
  m.impl("kquant_linear_biased", &affineq::kquant_linear_biased_cpu);
}
