// Path 5: dequant to bf16 + AMX tile GEMM (AMX-BF16, bf16 x, k % 32 == 0, past the GEMV's rows). The weight
// tiles are path 4's (bf16_tiles.h: a [kc x 32] slice of W dequantized in fp32, rounded to bf16 and stored as
// k-pairs), which is exactly an AMX B tile's layout (16 k-pairs x 16 columns at a 128-byte row stride); x,
// packed as whole A tiles (16 rows x 32 bf16, pack_a_tiles), gives the others. tdpbf16ps multiplies them with
// fp32 accumulation: the result is that of dequantize-to-bf16 then a bf16 matmul with fp32 accumulation
// (F.linear on the dequantized bf16 weight), up to the summation order, at the tiles' rate (8x AVX512-BF16's dot
// products per cycle). AMX flushes bf16 subnormal inputs and fp32 subnormal sums to zero (as oneDNN's AMX GEMM
// does).
//
// Compiles to nothing without AMX-BF16 (path_for then never picks path 5).
#include "simd.h"  // defines AQ_AMX

#if AQ_AMX
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_tiles.h"
#include "common.h"
#include "decode.h"

namespace affineq::detail {
namespace {

thread_local Scratch tl_xpack;   // the calling thread's packed x (amx_gemm_path)
thread_local Scratch tl_xquant;  // a worker's int8_fake_quant-ed rows of x (pack_a_tiles with x_quant)
thread_local Scratch tl_xround;  // one float32 row of x rounded to bf16 (x_round with x_quant)

constexpr int64_t kAMR = 32;    // x rows per block (two A tiles)
// Most k per dequantized slice: 640 x 32 bf16 = 40 KiB, which stays in L1 while the blocks stream x past it
// (tileloaddt1: x's tiles are read once per block and would otherwise evict the weight's).
constexpr int64_t kAKC = 640;
constexpr int64_t kAMC = 512;  // rows of x per pass (each pass dequantizes its tiles again)

// cout[32 x 32] = cin (zero when null) + x[32 x 32 ks] @ w (16 ks k-pairs x 32 columns). xa holds the rows' A tiles
// in k order, 2 KiB per 32 k (rows 0..15, then 16..31, 64 bytes a row), so a block reads one contiguous stream;
// cin / cout have a row stride of 32 fp32. Tile registers (amx.h): 0..3 accumulate
// C[i][j] (rows 16 i.., columns 16 j..), 4 / 5 hold the two A tiles of x, 6 / 7 the two 16-column B tiles of W;
// each load comes right before the first product that reads it.
AQ_INLINE void amx_block(const uint16_t* xa, const uint32_t* w, int64_t ks, const float* cin, float* cout) {
  if (cin == nullptr) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, cin, 128);
    _tile_loadd(1, cin + 16, 128);
    _tile_loadd(2, cin + 16 * 32, 128);
    _tile_loadd(3, cin + 16 * 32 + 16, 128);
  }
  for (int64_t k = 0; k < ks; ++k, xa += 32 * 32, w += 16 * 32) {
    _tile_stream_loadd(4, xa, 64);
    _tile_loadd(6, w, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + 16, 128);
    _tile_dpbf16ps(1, 4, 7);
    _tile_stream_loadd(5, xa + 16 * 32, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, cout, 128);
  _tile_stored(1, cout + 16, 128);
  _tile_stored(2, cout + 16 * 32, 128);
  _tile_stored(3, cout + 16 * 32 + 16, 128);
}

// Row blocks [b0, b1) (32 rows each) of x as A tiles: xp[((s * MB + b) * KS + k / 32) * 1024 + r * 32 + k % 32] =
// x[32 b + r, s * kcs + k] for MB = Mp / 32 blocks and KS = kcs / 32 steps per slice, zero past M and K. Each
// 2 KiB pair of tiles is written whole, in order. With pr.x_round the float32 rows are rounded to bf16 (as
// x.to(bf16) rounds) as they are written. With pr.x_quant a block's rows are int8_fake_quant-ed first (into a
// per-thread [32, K] buffer, in L1 / L2; a float32 row rounded into a [K] buffer just before) and those values
// packed.
void pack_a_tiles(const LowbitProblem& pr, int64_t M, int64_t K, int64_t Mp, int64_t kcs, int64_t b0, int64_t b1,
                  uint16_t* xp) {
  const int64_t MB = Mp / 32, KS = kcs / 32, slices = (K + kcs - 1) / kcs;
  uint16_t* quantized = pr.x_quant != nullptr ? tl_xquant.get<uint16_t>(32 * K) : nullptr;
  uint16_t* rounded = pr.x_round != nullptr && quantized != nullptr ? tl_xround.get<uint16_t>(K) : nullptr;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t m = 32 * b, rows = std::min<int64_t>(32, M - m);
    const float* xr = pr.x_round != nullptr ? pr.x_round + m * pr.ldx : nullptr;  // float32 rows to round
    const uint16_t* x = xr != nullptr ? nullptr : pr.x_bf16 + m * pr.ldx;
    int64_t ld = pr.ldx;
    if (quantized != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = x + r * ld;
        if (xr != nullptr) {
          for (int64_t c = 0; c < K; c += 32) store_row_bf16(xr + r * ld + c, 32, rounded + c, nullptr);
          row = rounded;  // K % 32 == 0
        }
        int8_fake_quant_row_bf16(row, K, *pr.x_quant, quantized + r * K);
      }
      x = quantized;
      xr = nullptr;
      ld = K;
    }
    for (int64_t s = 0; s < slices; ++s)
      for (int64_t ks = 0; ks < KS; ++ks) {
        uint16_t* dst = xp + ((s * MB + b) * KS + ks) * 1024;
        const int64_t k = s * kcs + 32 * ks, n = std::clamp<int64_t>(K - k, 0, 32);
        if (xr != nullptr) {  // n is 0 or 32 (K % 32 == 0)
          const float* src = xr + k;
          for (int64_t r = 0; r < 32; ++r, src += ld)
            _mm512_store_si512(dst + 32 * r, r < rows && n == 32
                                                 ? _mm512_inserti64x4(_mm512_castsi256_si512(bf16_bits(
                                                                          _mm512_loadu_ps(src))),
                                                                      bf16_bits(_mm512_loadu_ps(src + 16)), 1)
                                                 : _mm512_setzero_si512());
          continue;
        }
        const __mmask32 mask = n >= 32 ? 0xFFFFFFFFu : (1u << n) - 1;
        const uint16_t* src = x + k;
        for (int64_t r = 0; r < 32; ++r, src += ld)
          _mm512_store_si512(dst + 32 * r, r < rows ? _mm512_maskz_loadu_epi16(mask, src) : _mm512_setzero_si512());
      }
  }
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
  // A narrow layer (at most 64 tiles, 2048 columns) with >= 128 rows per thread is split by rows, as is one whose
  // tiles the threads cannot share evenly (split_gemm): each thread then takes its own rows and every tile, and
  // packs those rows itself, so x is read only by the core that packed it; the price, every thread dequantizing
  // every tile, grows with the width. Otherwise the threads share the tiles and pack x together first (every row
  // goes to every core).
  const int64_t ntiles = (c.npan + 1) / 2, Mp = (M + kAMR - 1) / kAMR * kAMR;
  const GemmSplit sp = split_gemm(ntiles, M, kAMR, M >= 128 * split_threads() && ntiles <= 64);
  const bool own_rows = sp.mparts > 1;
  // x as A tiles (pack_a_tiles): a block's tiles are one contiguous stream, where x's own row stride (8 KiB at
  // k = 4096) maps a tile's 16 rows onto a few L2 sets.
  uint16_t* xp = tl_xpack.get<uint16_t>(slices * Mp * kcs);
  if (!own_rows)
    at::parallel_for(0, Mp / kAMR, grain_for(kAMR * K), [&](int64_t b0, int64_t b1) {
      pack_a_tiles(pr, M, K, Mp, kcs, b0, b1, xp);
    });
  // Rows [mc0, mc0 + mc) (one pass, at most kAMC) of item `it` of sp (its tiles) on this worker's tiles; `last`
  // holds a block's sums after its last slice, on their way to y. A worker runs all its items for one pass before
  // the next, so consecutive items read the same rows of x (the pass's A tiles, 2 MiB at kAMC rows and k = 2048)
  // instead of each item sweeping all of x.
  const auto run_item = [&](int64_t it, int64_t mc0, int64_t mc, float* last) {
    const int64_t t0 = sp.tile0(it), nt = sp.tiles(it);
    const ItemTiles item(c, code_scale(B), t0, nt);
    const int64_t R = item.R, r0 = item.r0, rows = item.rows;
    const float *sT = item.sT, *oT = item.oT;
    const uint8_t* const* pan = item.pan;
    uint32_t* wb = tl_wbuf.get<uint32_t>(kcs / 2 * TW);
    const int64_t mcp = (mc + kAMR - 1) / kAMR * kAMR;
    // Sums carried from one slice to the next (none when K fits one slice).
    float* cbuf = slices > 1 ? tl_cbuf.get<float>(nt * mcp * TW) : nullptr;
    for (int64_t k0 = 0; k0 < K; k0 += kcs) {
      const int64_t kc = std::min(kcs, K - k0);
      const bool final_slice = k0 + kc == K;
      const uint16_t* xs = xp + (k0 / kcs * (Mp / kAMR) + mc0 / kAMR) * (kcs / 32) * 1024;
      for (int64_t t = 0; t < nt && t * TW < rows; ++t) {
        // The next tile's codes (or the next slice's first tile's) are prefetched a unit at a time as this tile's
        // are decoded: all at once, their ~300 lines filled the line-fill buffers and stalled the decode.
        const bool more = t + 1 < nt && (t + 1) * TW < rows;
        dequant_bf16_pairs<B>(pan + 2 * t, sT + t * TW, oT + t * TW, R, kg.data(), k0 / 8, kc / 8, wb,
                              more ? pan + 2 * (t + 1) : final_slice ? nullptr : pan, (more ? k0 : k0 + kc) / 8);
        const int64_t c0 = t * TW, n = std::min(TW, rows - c0);
        for (int64_t m = 0; m < mc; m += kAMR) {
          float* carried = cbuf == nullptr ? nullptr : cbuf + (t * mcp + m) * TW;
          amx_block(xs + m / kAMR * (kcs / 32) * 1024, wb, kc / 32, k0 == 0 ? nullptr : carried,
                    final_slice ? last : carried);
          if (!final_slice) continue;
          for (int64_t i = 0; i < std::min(kAMR, mc - m); ++i) {
            const int64_t yo = (mc0 + m + i) * pr.ldy + r0 + c0;
            if (pr.y_bf16 == nullptr && !pr.y_bf16_values)
              std::memcpy(pr.y + yo, last + i * TW, sizeof(float) * n);
            else
              store_row_bf16(last + i * TW, n, pr.y_bf16 ? pr.y_bf16 + yo : nullptr, pr.y_bf16 ? nullptr : pr.y + yo);
          }
        }
      }
    }
  };
  // Items [i0, i1) (one row part: sp numbers items row-part-major) pass by pass.
  const auto run_items = [&](int64_t i0, int64_t i1, float* last) {
    const int64_t mlo = sp.row0(i0), mhi = sp.row1(i0), mcs = row_chunk(mhi - mlo, kAMR, kAMC);
    for (int64_t mc0 = mlo; mc0 < mhi; mc0 += mcs)
      for (int64_t it = i0; it < i1; ++it) run_item(it, mc0, std::min(mcs, mhi - mc0), last);
  };
  if (own_rows) {
    at::parallel_for(0, sp.mparts, 1, [&](int64_t p0, int64_t p1) {
      const TileScope tiles{TileConfig()};
      alignas(64) float last[kAMR * 32];
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t m0 = sp.row0(p * sp.nblocks), m1 = sp.row1(p * sp.nblocks);
        if (m0 >= m1) continue;
        pack_a_tiles(pr, M, K, Mp, kcs, m0 / kAMR, (m1 + kAMR - 1) / kAMR, xp);
        run_items(p * sp.nblocks, (p + 1) * sp.nblocks, last);
      }
    });
  } else {
    at::parallel_for(0, sp.items(), 1, [&](int64_t i0, int64_t i1) {
      const TileScope tiles{TileConfig()};
      alignas(64) float last[kAMR * 32];
      run_items(i0, i1, last);  // mparts == 1: every item has all M rows
    });
  }
}

// The instantiations dispatch.cpp calls (declared in common.h).
#define AQ_INSTANTIATE(B) template void amx_gemm_path<B>(const Ctx& c);
AQ_FOR_EACH_WIDTH(AQ_INSTANTIATE)
#undef AQ_INSTANTIATE

}  // namespace affineq::detail
#endif  // AQ_AMX
