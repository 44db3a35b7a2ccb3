// affineq::grouped_lowbit_linear: the rows of x routed to each expert of a 3-D dense-format weight [E, n, k],
// multiplied by that expert's packed weight in one call (layout, math and the PyTorch reference:
// affineq/cpp/grouped_ops.py; the schema and fake impl are defined there).
//
// 1. Counting sort of the rows by expert (stable: an expert's rows keep their order), then x gathered into one
//    fp32 buffer (and a bf16 copy for bf16 x) in that order, each expert's rows contiguous, zero-padded to k8
//    columns exactly as lowbit_linear prepares x.
// 2. Work items (expert, block of output columns): each runs lowbit_linear_f32 (dispatch.cpp), the kernel the
//    2-D op runs, on the expert's rows and a 16-row-aligned slice of its panels, qparams and outputs. A column's
//    value depends only on its own panel, the rows and the path, which the kernel picks from the rows alone, so
//    every row equals affineq::lowbit_linear on that expert's rows bit for bit. Only experts with rows are read.
//    The items run on torch's intra-op pool (the kernel's own parallel loops then run inline), sized so that
//    even one token's top-k experts keep every thread busy, and split in proportion to each expert's rows.
// 3. The rows scattered back to their original order and cast to x's dtype (as lowbit_linear casts).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "lowbit_kernels.h"
#include "op_checks.h"

namespace affineq {
namespace {

constexpr const char* kOp = "affineq::grouped_lowbit_linear";

struct WorkItem {
  int64_t expert, row0, rows, col0, cols;
};

// Column blocks per expert: about 8 items per thread over all experts, each expert's share in proportion to its
// rows (a prefill expert with many rows gets more blocks), blocks a multiple of 16 rows (whole panels; of 64, the
// AVX-512 GEMV's item of 4 panels, once blocks are that wide).
std::vector<WorkItem> plan_items(const std::vector<int64_t>& counts, const std::vector<int64_t>& starts, int64_t T,
                                 int64_t n) {
  const int64_t target = 8 * std::max<int64_t>(1, at::get_num_threads());
  const int64_t max_blocks = std::max<int64_t>(1, (n + 15) / 16);
  std::vector<WorkItem> items;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    const int64_t cnt = counts[e];
    if (cnt == 0) continue;
    const int64_t want = std::clamp<int64_t>((target * cnt + T - 1) / T, 1, max_blocks);
    int64_t cb = ((n + want - 1) / want + 15) / 16 * 16;
    if (cb > 64) cb = (cb + 63) / 64 * 64;
    for (int64_t c0 = 0; c0 < n; c0 += cb) items.push_back({e, starts[e], cnt, c0, std::min(cb, n - c0)});
  }
  return items;
}

at::Tensor grouped_lowbit_linear_cpu(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& packed,
                                     const at::Tensor& scale, const std::optional<at::Tensor>& offset, int64_t bits,
                                     int64_t group_size, int64_t n, int64_t k, int64_t codes, int64_t code_offset) {
  TORCH_CHECK(!kernels_disabled(), kOp,
              ": the affineq C++ kernels are disabled (AFFINEQ_DISABLE_CPP_KERNELS=1 or affineq.cpp._set_disabled("
              "True)); use affineq.cpp.grouped_ops.grouped_lowbit_linear_reference instead");
  TORCH_CHECK(bits >= 1 && bits <= 8, kOp, ": bits must be in [1, 8], got ", bits);
  TORCH_CHECK(n >= 0 && k > 0, kOp, ": need n >= 0 and k > 0, got n=", n, ", k=", k);
  TORCH_CHECK(group_size > 0 && k % group_size == 0, kOp, ": group_size must divide k, got group_size=", group_size,
              ", k=", k);
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, kOp,
              ": x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK(x.device().is_cpu(), kOp, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, kOp, ": x must have shape [T, k=", k, "], got ", x.sizes());
  const int64_t T = x.size(0);
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.device().is_cpu() && expert_ids.dim() == 1 &&
                  expert_ids.size(0) == T,
              kOp, ": expert_ids must be an int64 CPU tensor of shape [T] = [", T, "] (one expert per row of x), got ",
              expert_ids.scalar_type(), " ", expert_ids.sizes(), " on ", expert_ids.device());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.device().is_cpu() && packed.dim() == 3, kOp,
              ": packed must be a uint8 CPU tensor [E, n, packed bytes per row] (pack_codes of each expert), got ",
              packed.scalar_type(), " ", packed.sizes(), " on ", packed.device());
  const int64_t E = packed.size(0);
  TORCH_CHECK(E > 0, kOp, ": packed holds no experts (E = 0)");
  TORCH_CHECK(packed[0].numel() == packed_nbytes(n, k, bits), kOp, ": packed[e] must hold ",
              packed_nbytes(n, k, bits), " bytes for n=", n, ", k=", k, ", bits=", bits, ", got ", packed[0].numel());
  const bool has_offset = offset.has_value() && offset->defined();
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == E, kOp, ": scale must be 3-D [E=", E,
              ", n, k // group_size], got ", scale.sizes());
  TORCH_CHECK(!has_offset || (offset->dim() == 3 && offset->size(0) == E), kOp, ": offset must be 3-D [E=", E,
              ", n, k // group_size] or None, got ", has_offset ? offset->sizes() : scale.sizes());
  const int64_t G = k / group_size;
  const std::optional<at::Tensor> off0 = has_offset ? std::optional<at::Tensor>((*offset)[0]) : std::nullopt;
  check_qparams(kOp, scale[0], off0, bits, codes, code_offset, n, G);

  // 1. Counting sort by expert (checks the range on the way).
  const at::Tensor ids = expert_ids.contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    // ValueError in Python (bad input, not a kernel failure), as grouped_linear's own checks raise
    TORCH_CHECK_VALUE(id[t] >= 0 && id[t] < E, kOp, ": expert_ids must be in [0, ", E, ") (E = packed.size(0) "
                      "experts), got ", id[t], " at row ", t);
    ++counts[id[t]];
  }
  std::vector<int64_t> starts(static_cast<size_t>(E), 0);
  for (int64_t e = 1; e < E; ++e) starts[e] = starts[e - 1] + counts[e - 1];
  at::Tensor order = at::empty({T}, ids.options());  // order[i]: the row of x at sorted position i
  {
    int64_t* o = order.mutable_data_ptr<int64_t>();
    std::vector<int64_t> next = starts;
    for (int64_t t = 0; t < T; ++t) o[next[id[t]]++] = t;
  }

  at::Tensor out = at::empty({T, n}, x.options().dtype(at::kFloat));
  if (T == 0 || n == 0) return out.to(xt);
  // x in sorted order as lowbit_linear prepares it: fp32 (and bf16 as given), zero-padded to k8 columns.
  const int64_t K8 = (k + 7) / 8 * 8;
  const at::Tensor xs = x.index_select(0, order);
  const auto padded = [&](at::ScalarType dt) {
    if (K8 == k) return xs.to(dt).contiguous();
    at::Tensor p = at::zeros({T, K8}, xs.options().dtype(dt));
    p.narrow(1, 0, k).copy_(xs);
    return p;
  };
  const at::Tensor xf = padded(at::kFloat);
  const at::Tensor xb = xt == at::kBFloat16 ? padded(at::kBFloat16) : at::Tensor();

  // 2. (expert, column block) items through the 2-D kernel.
  const at::Tensor pk = packed.contiguous(), sc = scale.contiguous();
  const at::Tensor of = has_offset ? offset->contiguous() : at::Tensor();
  const int64_t row_bytes = packed_nbytes(1, k, bits);  // panel p of expert e starts at row 16p of packed[e]
  const int64_t qp_bytes = sc.element_size();
  const uint8_t* pk_base = pk.const_data_ptr<uint8_t>();
  const uint8_t* sc_base = static_cast<const uint8_t*>(sc.const_data_ptr());
  const uint8_t* of_base = has_offset ? static_cast<const uint8_t*>(of.const_data_ptr()) : nullptr;
  const float* xf_base = xf.const_data_ptr<float>();
  const uint16_t* xb_base = xb.defined() ? reinterpret_cast<const uint16_t*>(xb.const_data_ptr()) : nullptr;
  at::Tensor ys = at::empty({T, n}, xf.options());
  float* ys_base = ys.mutable_data_ptr<float>();
  const bool int16_x = allow_int16_x(xt);
  const std::vector<WorkItem> items = plan_items(counts, starts, T, n);
  // Run inline when the whole call is smaller than one OpenMP fork/join is worth (~2^17 multiply-adds per item).
  const int64_t macs = T * n * K8;
  const int64_t nitems = static_cast<int64_t>(items.size());
  const int64_t grain = macs >= (int64_t{1} << 17) * 2 ? 1 : nitems;
  at::parallel_for(0, nitems, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const WorkItem& it = items[i];
      const int64_t qp_off = (it.expert * n + it.col0) * G * qp_bytes;
      LowbitProblem p;
      p.x = xf_base + it.row0 * K8;
      p.ldx = K8;
      p.m = it.rows;
      set_weight(p, pk_base + (it.expert * n + it.col0) * row_bytes, sc_base + qp_off,
                 has_offset ? of_base + qp_off : nullptr, sc.scalar_type(), code_offset, bits, codes, group_size,
                 it.cols, k);
      p.y = ys_base + it.row0 * n + it.col0;
      p.ldy = n;
      p.allow_int16_x = int16_x;
      if (xb_base != nullptr) p.x_bf16 = xb_base + it.row0 * K8;
      lowbit_linear_f32(p);
    }
  });

  // 3. Back to the original row order, then x's dtype.
  const int64_t* o = order.const_data_ptr<int64_t>();
  float* out_base = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < T; ++i) std::memcpy(out_base + o[i] * n, ys_base + i * n, sizeof(float) * n);
  return out.to(xt);
}

}  // namespace
}  // namespace affineq

TORCH_LIBRARY_IMPL(affineq, CPU, m) { m.impl("grouped_lowbit_linear", &affineq::grouped_lowbit_linear_cpu); }
