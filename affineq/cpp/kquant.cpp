// Linear layers on llama.cpp's k-quant weights (affineq::kquant_linear), as the k-quant formats store them: the
// codes bit-packed in the dense panel layout (the layout the int1..8 kernels read), each super-block's header
// bytes in `scales` [n, k / 256 * kq_header_size] (kquant_decode.h). The weight problem is the dense one with
// k-quant qparams (LowbitProblem::qparams_kquant): every path of dispatch.cpp (fused GEMV, tile GEMMs, the
// dequantize + GEMM driver) runs on it unchanged, and only the per-group scale and offset are decoded from the
// headers, once per work item (common.cpp's load_qparams). So a q4_k weight runs at the speed of int4 g32 with
// a quarter fewer qparam bytes, q6_k at int6 g16's, and so on.
// Values: the scale d * sc_j and offset of each sub-block are exact in fp32 and the kernels sum
// scale * dot(x, u) + offset * sum(x) per group, so y = F.linear(x.float(), W) up to the order and rounding of
// the fp32 sums (the dense kernels' bound), cast to x's dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kquant_decode.h"
#include "lowbit_kernels.h"
#include "op_checks.h"

namespace affineq {
namespace {

at::Tensor kquant_linear_cpu(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scales, int64_t kind,
                             int64_t n, int64_t k) {
  const char* op = "affineq::kquant_linear";
  TORCH_CHECK_VALUE(!kernels_disabled(), op, ": the affineq C++ kernels are disabled");
  TORCH_CHECK_VALUE(kind >= 2 && kind <= 6, op, ": kind must be 2..6 (q2_k .. q6_k), got ", kind);
  TORCH_CHECK_VALUE(n >= 0 && k > 0 && k % detail::kSuperBlock == 0, op,
                    ": need n >= 0 and k a positive multiple of 256, got n=", n, ", k=", k);
  const auto xt = x.scalar_type();
  TORCH_CHECK_VALUE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, op, ": x must be a CPU tensor [..., k=",
                    k, "], got ", x.sizes(), " on ", x.device());
  TORCH_CHECK_VALUE(qdata.scalar_type() == at::kByte && qdata.device().is_cpu() &&
                        qdata.numel() == packed_nbytes(n, k, kind),
                    op, ": qdata must be uint8 with ", packed_nbytes(n, k, kind), " bytes (pack_codes of ", kind,
                    "-bit codes), got ", qdata.scalar_type(), " with ", qdata.numel());
  const int64_t header_bytes = n * (k / detail::kSuperBlock) * detail::kq_header_size(kind);
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kByte && scales.device().is_cpu() && scales.numel() == header_bytes,
                    op, ": scales must be uint8 with ", header_bytes, " bytes (n * k / 256 * ",
                    detail::kq_header_size(kind), "), got ", scales.scalar_type(), " with ", scales.numel());
  const at::Tensor pk = qdata.contiguous(), sc = scales.contiguous();
  LowbitProblem p;
  p.packed = pk.const_data_ptr<uint8_t>();
  p.scale = sc.const_data_ptr();
  p.offset = nullptr;
  p.qparams_kquant = static_cast<int>(kind);
  p.bits = static_cast<int>(kind);
  p.codes = kCodesUint;
  p.group_size = detail::kq_group(kind);
  p.n = n;
  p.k = k;
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // an inference op: no derivative
  return run_weight_problem(x.detach(), p, 0);
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) { m.impl("kquant_linear", &affineq::kquant_linear_cpu); }
