// Path 5: dequant to bf16 + AMX tile GEMM (AMX-BF16, bf16 x, k % 32 == 0, past the GEMV's rows). The weight
// tiles are path 4's (bf16_tiles.h: a [kc x 32] slice of W dequantized in fp32, rounded to bf16 and stored as
// k-pairs), which is exactly an AMX B tile's layout (16 k-pairs x 16 columns at a 128-byte row stride); x, packed
// by k-slice, gives the A tiles (16 rows x 32 bf16). tdpbf16ps multiplies them with fp32 accumulation: the
// result is that of dequantize-to-bf16 then a bf16 matmul with fp32 accumulation (F.linear on the dequantized
// bf16 weight), up to the summation order, at the tiles' rate (8x AVX512-BF16's dot products per cycle). AMX
// flushes bf16 subnormal inputs and fp32 subnormal sums to zero (as oneDNN's AMX GEMM does).
//
// Compiles to nothing without AMX-BF16 (path_for then never picks path 5).
#include "simd.h"  // defines AQ_AMX

#if AQ_AMX
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_tiles.h"
#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

thread_local Scratch tl_xpack;  // the calling thread's packed x (amx_gemm_path)

constexpr int64_t kAMR = 32;   // x rows per block (two A tiles)
constexpr int64_t kAKC = 512;  // k per dequantized slice: 512 x 32 bf16 = 32 KiB, in L1 for all row blocks
constexpr int64_t kAMC = 512;  // rows of x per pass (each pass dequantizes its tiles again)

// c[32 x 32] (+)= x[32 x kc] @ w (kc / 2 k-pairs x 32 columns): x rows at a row stride of ldx_bytes, c (row
// stride 32 fp32) is the block's accumulator memory. Tile registers (amx.h): 0..3 accumulate C[i][j] (rows 16 i..,
// columns 16 j..), 4 / 5 hold the two 16-row A tiles of x, 6 / 7 the two 16-column B tiles of W.
AQ_INLINE void amx_block(const uint16_t* x, int64_t ldx_bytes, const uint32_t* w, int64_t kc, float* c,
                         bool init) {
  if (init) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, 128);
    _tile_loadd(1, c + 16, 128);
    _tile_loadd(2, c + 16 * 32, 128);
    _tile_loadd(3, c + 16 * 32 + 16, 128);
  }
  const char* x1 = reinterpret_cast<const char*>(x) + 16 * ldx_bytes;
  for (int64_t k = 0; k < kc; k += 32, w += 16 * 32) {
    _tile_loadd(4, x + k, ldx_bytes);
    _tile_loadd(5, x1 + 2 * k, ldx_bytes);
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 16, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

}  // namespace

bool amx_usable() {
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile instruction faults.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

template <int B>
void amx_gemm_path(const Ctx& c) {
  const LowbitProblem& pr = *c.p;
  const int64_t G = c.G, M = c.M, K = c.K8;  // K % 32 == 0 (path_for)
  const std::vector<int32_t> kg = group_of_k(pr, K, G);
  constexpr int64_t TW = 32;
  const int64_t slices = (K + kAKC - 1) / kAKC, kcs = ((K + slices - 1) / slices + 31) / 32 * 32;
  // x packed by k-slice, xp[(s * Mp + m) * kcs + kk] = x[m, s * kcs + kk], rows zero-padded to a multiple of 32
  // (tiles always load 16 rows): a pass's rows of one slice are contiguous, where x's own row stride (8 KiB at
  // k = 4096) maps the rows onto a few L2 sets and they evict each other.
  const int64_t Mp = (M + kAMR - 1) / kAMR * kAMR;
  uint16_t* xp = tl_xpack.get<uint16_t>(slices * Mp * kcs);
  at::parallel_for(0, Mp, grain_for(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t s = 0, k0 = 0; s < slices; ++s, k0 += kcs) {
        const int64_t kc = std::min(kcs, K - k0);
        uint16_t* dst = xp + (s * Mp + m) * kcs;
        if (m < M) std::memcpy(dst, pr.x_bf16 + m * pr.ldx + k0, sizeof(uint16_t) * kc);
        else std::memset(dst, 0, sizeof(uint16_t) * kc);
      }
  });
  const GemmSplit sp = split_gemm((c.npan + 1) / 2, M, kAMR);
  at::parallel_for(0, sp.items(), 1, [&](int64_t i0, int64_t i1) {
    const TileScope tiles{TileConfig()};
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t0 = sp.tile0(it), nt = sp.tiles(it), mlo = sp.row0(it), mhi = sp.row1(it);
      const ItemTiles item(c, code_scale(B), t0, nt);
      const int64_t R = item.R, r0 = item.r0, rows = item.rows;
      const float *sT = item.sT, *oT = item.oT;
      const uint8_t* const* pan = item.pan;
      uint32_t* wb = tl_wbuf.get<uint32_t>(kcs / 2 * TW);
      const int64_t mcs = row_chunk(mhi - mlo, kAMR, kAMC);
      for (int64_t mc0 = mlo; mc0 < mhi; mc0 += mcs) {
        const int64_t mc = std::min(mcs, mhi - mc0), mcp = (mc + kAMR - 1) / kAMR * kAMR;
        float* cbuf = tl_cbuf.get<float>(nt * mcp * TW);
        for (int64_t k0 = 0; k0 < K; k0 += kcs) {
          const int64_t kc = std::min(kcs, K - k0);
          const uint16_t* xs = xp + (k0 / kcs * Mp + mc0) * kcs;  // this slice's rows of the pass
          for (int64_t t = 0; t < nt && t * TW < rows; ++t) {
            dequant_bf16_pairs<B>(pan + 2 * t, sT + t * TW, oT + t * TW, R, kg.data(), k0 / 8, kc / 8, wb);
            if (t + 1 < nt && (t + 1) * TW < rows)  // the next tile's codes, or the next slice's first tile's
              prefetch_units(pan + 2 * (t + 1), 2, k0 / 8, kc / 8, c.B);
            else if (k0 + kc < K)
              prefetch_units(pan, 2, (k0 + kc) / 8, std::min(kcs, K - k0 - kc) / 8, c.B);
            float* ct = cbuf + t * mcp * TW;
            for (int64_t m = 0; m < mc; m += kAMR) amx_block(xs + m * kcs, 2 * kcs, wb, kc, ct + m * TW, k0 == 0);
          }
        }
        const int64_t y0 = mc0 * pr.ldy + r0;
        for (int64_t m = 0; m < mc; ++m)
          for (int64_t c0 = 0; c0 < rows; c0 += TW) {
            const float* cm = cbuf + (c0 / TW * mcp + m) * TW;
            const int64_t n = std::min(TW, rows - c0), yo = y0 + m * pr.ldy + c0;
            if (pr.y_bf16 == nullptr && !pr.y_bf16_values) std::memcpy(pr.y + yo, cm, sizeof(float) * n);
            else store_row_bf16(cm, n, pr.y_bf16 ? pr.y_bf16 + yo : nullptr, pr.y_bf16 ? nullptr : pr.y + yo);
          }
      }
    }
  });
}

// The instantiations dispatch.cpp calls (declared in common.h).
#define AQ_INSTANTIATE(B) template void amx_gemm_path<B>(const Ctx& c);
AQ_FOR_EACH_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE

}  // namespace affineq::detail
#endif  // AQ_AMX
