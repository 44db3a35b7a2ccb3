// Context shared by the kernel translation units (gemv.cpp, gemm_f32.cpp, gemm_int16.cpp, gemm_bf16.cpp,
// dispatch.cpp): per-thread scratch buffers, qparam loading (common.cpp), the problem context Ctx and panel
// access, small helpers of the parallel loops, the GEMM tiling shared by paths 2-4, and the declarations of
// the four path templates, each explicitly instantiated for every width in its own .cpp.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "kquant_decode.h"
#include "lowbit_kernels.h"
#include "simd.h"

namespace affineq::detail {

// ---------------------------------------------------------------------------------------------
// Scratch buffers: one set per worker thread, grown on demand and kept (no malloc per call).
// ---------------------------------------------------------------------------------------------
struct Scratch {
  void* ptr = nullptr;
  size_t cap = 0;
  template <class T>
  T* get(size_t n) {
    const size_t bytes = ((n * sizeof(T)) + 63) / 64 * 64 + 64;
    if (bytes > cap) {
      std::free(ptr);
      ptr = std::aligned_alloc(64, bytes);
      if (ptr == nullptr) throw std::bad_alloc();
      cap = bytes;
    }
    return static_cast<T*>(ptr);
  }
  ~Scratch() { std::free(ptr); }
};
// The buffers more than one translation unit uses (defined in common.cpp); a buffer of one path only is
// declared in that path's file.
extern thread_local Scratch tl_scale, tl_offset, tl_wbuf, tl_cbuf;
extern thread_local Scratch tl_xcall;  // per-call x buffer (owned by the calling thread)

// An e8m0 scale byte: 2^(b - 127) (b = 0 is the fp32 subnormal 2^-127), b = 255 is NaN (OCP MX v1.0).
AQ_INLINE float e8m0_to_float(uint8_t b) {
  const uint32_t bits = b == 0 ? 0x00400000u : b == 255 ? 0x7FC00000u : static_cast<uint32_t>(b) << 23;
  return std::bit_cast<float>(bits);
}

// Bytes of one row's scale (and offset) array, G groups: 4, 2 or 1 per group (k-quant sub-scales: 1).
inline int64_t qparam_row_bytes(const LowbitProblem& p, int64_t G) {
  if (p.qparams_kquant) return G;  // the sub-scale (and min) bytes
  return G * (p.qparams_e8m0 ? 1 : p.qparams_bf16 || p.qparams_f16 ? 2 : 4);
}

// dst[g * ldd + r] = qparam_at(r0 + r, g) (dispatch.cpp; k-quant qparams: kquant_decode.h's kq_block) for
// r < rows (zero up to R): the scales (offset=false, times `mul`) or offsets of rows [r0, r0 + rows), transposed
// so 16 consecutive rows form one vector.
void load_qparams(const LowbitProblem& p, bool offset, float mul, int64_t r0, int64_t rows, int64_t R, int64_t G,
                  float* dst, int64_t ldd);

// The k-quant qparams of rows [r0, r0 + rows) as the GEMV forms them per use (kquant_decode.h): sub-scale bytes
// scT[g * ldd + r] (q3_k: b - 32 as int8), min bytes mnT[g * ldd + r] (q4_k / q5_k only), and per super-block
// b the fp32 d and -dmin: dT[(b * kq_supers + s) * ldd + r]; rows in [rows, R) zero. A quarter of the bytes of
// load_qparams' fp32 tiles, and no products formed for groups before their turn.
void load_kq_qparams(const LowbitProblem& p, int64_t r0, int64_t rows, int64_t R, int64_t G, uint8_t* scT,
                     uint8_t* mnT, float* dT, int64_t ldd);

// Whether load_scales16 can transpose p's qparams: 16-bit (bf16 / fp16), G % 16 == 0, and an AVX-512 build, the
// only one with load_scales16 and the tiles that read its output. (Elsewhere the GEMV loads fp32 tiles, whose bf16
// offsets already hold the -2^(bits-1) * scale that a caller seeing true here would add again.)
inline bool scales16_tiles(const LowbitProblem& p, int64_t G) {
#if AQ_AVX512
  return (p.qparams_bf16 || p.qparams_f16) && G % 16 == 0;
#else
  (void)p, (void)G;
  return false;
#endif
}

#if AQ_AVX512
// The 16-bit (bf16 / fp16) scales (offset=false) or offset array entries of rows [r0, r0 + rows) as they are,
// transposed: dst[g * ldd + r], zero for rows in [rows, R) (R % 16 == 0, G % 16 == 0). Half the work of
// load_qparams' fp32 tile; the caller widens per use (and applies a bf16 offset's -2^(bits-1) * scale itself).
void load_scales16(const LowbitProblem& p, bool offset, int64_t r0, int64_t rows, int64_t R, int64_t G,
                   uint16_t* dst, int64_t ldd);
#endif

// Transposed fp32 scales and offsets of rows [r0, r0 + rows) for the GEMM tiles (thread-local, R columns),
// plus an all-zero group G that the padding columns k >= K point at (see group_of_k).
void load_tile_qparams(const LowbitProblem& p, float mul, int64_t r0, int64_t rows, int64_t R, int64_t G, float*& sT,
                       float*& oT);

// Group index of each of the K8 (padded) columns; padding columns get the extra all-zero group G.
std::vector<int32_t> group_of_k(const LowbitProblem& p, int64_t K8, int64_t G);

// Software prefetch distance of the GEMVs (units ahead on each panel stream; gemv.cpp, gemm_int8_codes.cpp's
// gemv4): at few rows they stream the weights from DRAM and the hardware prefetchers alone left part of the
// bandwidth unused. Tuned by measurement (see benchmarks/README.md, kernel design measurements).
inline constexpr int64_t kPrefetchUnits = 24;

// Most panels a GEMV work item holds (gemv.cpp's kItemPanels on each build; gemm_int8_codes.cpp's quads).
inline constexpr int kMaxItemPanels = 4;

// Prefetches what the next work item starts with (gemv.cpp; gemm_int8_codes.cpp's gemv4), a few cache lines
// per group of the current one: its raw qparams (without this load_qparams read them from DRAM through 16..32
// strided streams, a large share of a small-group GEMV's time on AVX2) and the first kPrefetchUnits units of
// each of its full panels (the tile's own prefetch runs that far ahead within a panel, so each new panel would
// otherwise start with as many demand misses). Spread over the groups: issued in one burst, these prefetches
// filled the miss queue and stalled the core (see benchmarks/README.md, kernel design measurements).
struct NextItemPrefetch {
  const char* src[2] = {nullptr, nullptr};  // scale and offset rows of the next item (contiguous)
  const char* pan[kMaxItemPanels] = {};     // its full panels (null: none, or the tail panel)
  int64_t bytes = 0, lines_per_group = 0, panel_lines = 0, panel_lines_per_group = 0;
  NextItemPrefetch(const LowbitProblem& p, int64_t r0, int64_t rows, int64_t G, const uint8_t* const* panels,
                   int64_t npanels, int64_t unit_bytes) {
    const int64_t row_bytes = qparam_row_bytes(p, G);
    src[0] = static_cast<const char*>(p.scale) + r0 * row_bytes;
    src[1] = p.offset != nullptr ? static_cast<const char*>(p.offset) + r0 * row_bytes : src[0];  // none
    bytes = rows * row_bytes;
    lines_per_group = ((bytes + 63) / 64 + G - 1) / G;
    for (int64_t q = 0; q < npanels; ++q) pan[q] = reinterpret_cast<const char*>(panels[q]);
    panel_lines = kPrefetchUnits * unit_bytes / 64;
    panel_lines_per_group = (panel_lines + G - 1) / G;
  }
  AQ_INLINE void group(int64_t g) const { groups(g, g + 1); }
  // group(g) for g in [g0, g1), in one pass
  AQ_INLINE void groups(int64_t g0, int64_t g1) const {
#if defined(__GNUC__)
    for (int64_t l = g0 * lines_per_group, e = std::min(g1 * lines_per_group, (bytes + 63) / 64); l < e; ++l) {
      __builtin_prefetch(src[0] + 64 * l, 0, 2);
      __builtin_prefetch(src[1] + 64 * l, 0, 2);
    }
    for (int64_t l = g0 * panel_lines_per_group, e = std::min(g1 * panel_lines_per_group, panel_lines); l < e; ++l)
      for (const char* q : pan)
        if (q != nullptr) __builtin_prefetch(q + 64 * l, 0, 3);
#endif
  }
};

// Prefetch units [u0, u0 + nu) of `np` panels into L2 (null panels skipped).
inline void prefetch_units(const uint8_t* const* pan, int np, int64_t u0, int64_t nu, int B) {
#if defined(__GNUC__)
  for (int p = 0; p < np; ++p) {
    if (pan[p] == nullptr) continue;
    const uint8_t* b = pan[p] + u0 * 16 * B;
    for (int64_t off = 0; off < nu * 16 * B; off += 64) __builtin_prefetch(b + off, 0, 2);
  }
#endif
}

// y[m, c] = cbuf[(c / tw * rows + m) * tw + c % tw] for m < rows, c < cols: a pass's accumulators, tile-major
// [tile][row][tw], stored row by row, so each row of y is written as one contiguous run (tile by tile, a wide y
// gets one line per row and tile and a new page every row). store(c, m, c0, n) writes n <= tw columns of row m
// from c (n floats) at y column c0.
template <class Store>
inline void store_tiles_by_row(const float* cbuf, int64_t tw, int64_t rows, int64_t cols, Store store) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c0 = 0; c0 < cols; c0 += tw) store(cbuf + (c0 / tw * rows + m) * tw, m, c0, std::min(tw, cols - c0));
}
// The same into a float32 y with row stride ldy, plus bias[c] (LowbitProblem::bias at y's first column) if given.
inline void store_tiles_f32(const float* cbuf, int64_t tw, int64_t rows, int64_t cols, float* y, int64_t ldy,
                            const float* bias) {
  store_tiles_by_row(cbuf, tw, rows, cols, [&](const float* acc, int64_t m, int64_t c0, int64_t n) {
    float* row = y + m * ldy + c0;
    if (bias == nullptr) std::memcpy(row, acc, sizeof(float) * n);
    else for (int64_t c = 0; c < n; ++c) row[c] = acc[c] + bias[c0 + c];
  });
}

// Grain for at::parallel_for: enough items that one chunk carries >= ~2^17 multiply-adds, so small layers
// run inline instead of paying an OpenMP fork/join that would cost more than their work (see
// benchmarks/README.md, kernel design measurements).
inline int64_t grain_for(int64_t macs_per_item) {
  constexpr int64_t kMinMacs = int64_t{1} << 17;
  return std::max<int64_t>(1, kMinMacs / std::max<int64_t>(1, macs_per_item));
}

// fn(i, next) for every item i in [0, n), on at most ceil(n / grain) intra-op threads that claim items one at a
// time from a shared counter: a thread whose memory streams run faster takes more items, so at the end neither
// waits long for the other (a static split of a DRAM-bound GEMV left one thread idle ~5% of a decode step).
// `next` is the item the same thread runs after i, or -1 (so fn can prefetch for it). Which thread runs an item
// never changes its result.
template <class F>
void parallel_dynamic(int64_t n, int64_t grain, const F& fn) {
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (workers <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i, i + 1 < n ? i + 1 : int64_t{-1});
    return;
  }
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = counter.fetch_add(1); i < n;) {
      const int64_t j = counter.fetch_add(1);  // claimed before i runs: fn may prefetch for it
      fn(i, j < n ? j : int64_t{-1});
      i = j;
    }
  });
}

struct Ctx {
  const LowbitProblem* p;
  int B;
  int64_t K8, U, G, N, M;
  int64_t nfull, tail_w, npan;  // full 16-row panels, rows in the narrower last panel, panels in total
  int64_t panel_bytes;          // bytes of one full panel = 16 * U * B
};

// The problem context of p (widths, panel counts; common.cpp).
Ctx make_ctx(const LowbitProblem& p);

// Pointer to panel `pi` in the 16-wide layout; the narrower tail panel is re-spread into 16-byte slots (in a
// thread-local buffer).
const uint8_t* panel_ptr(const Ctx& c, int64_t pi);

// ---------------------------------------------------------------------------------------------
// Tiling shared by the dequant + GEMM paths (2, 3 and 4).
// ---------------------------------------------------------------------------------------------
inline constexpr int64_t kKC = 256;  // k-slice per dequantized tile: 256 x 32 fp32 = 32 KiB
inline constexpr int64_t kNCB = 8;   // micro-tiles dequantized together per k-slice (x block reused across them)
// Rows of x per pass. Accumulators live in a dense [kMC x 32] buffer per micro-tile rather than in y, whose
// row stride (often 16 KiB) would make all rows alias to the same cache sets.
inline constexpr int64_t kMC = 240;
// Rows per pass for m rows: at most kMC, split evenly (a multiple of `mult`) so no pass is a small remainder.
inline int64_t row_chunk(int64_t m, int64_t mult, int64_t most = kMC) {
  const int64_t passes = (m + most - 1) / most;
  return std::min(most, ((m + passes - 1) / passes + mult - 1) / mult * mult);
}

// How a tiled GEMM path (2, 3, 4) shares its work among the threads: the N tiles in `nblocks` blocks of at most
// kNCB tiles (sizes differing by at most one), times `mparts` parts of the M rows (multiples of `mult`). Items
// are numbered row-part-major, so at::parallel_for's contiguous runs give each thread about ntiles / threads
// tiles, or all tiles of its own rows. Rows are split when the tiles cannot be shared evenly (9 tiles on 2
// threads: 5 against 4), or when the caller asks (`by_rows`), since each row part decodes its tiles again.
struct GemmSplit {
  int64_t ntiles, nblocks, mparts, rows_per_part, M;
  int64_t items() const { return nblocks * mparts; }
  int64_t block(int64_t item) const { return item % nblocks; }
  int64_t tile0(int64_t item) const { return block(item) * ntiles / nblocks; }
  int64_t tiles(int64_t item) const { return (block(item) + 1) * ntiles / nblocks - tile0(item); }
  int64_t row0(int64_t item) const { return std::min(M, (item / nblocks) * rows_per_part); }
  int64_t row1(int64_t item) const { return std::min(M, (item / nblocks + 1) * rows_per_part); }
};

// The threads a split shares its items among: 1 nested in another parallel loop (grouped.cpp), whose items then
// run on the calling thread alone.
inline int64_t split_threads() { return at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads()); }

inline GemmSplit split_gemm(int64_t ntiles, int64_t M, int64_t mult, bool by_rows = false) {
  const int64_t T = split_threads();
  GemmSplit s{ntiles, 1, 1, M, M};
  // Tiles per thread of the busiest thread against the mean: even shares, or split the rows as well.
  const bool uneven = ntiles % T != 0 && 10 * ((ntiles + T - 1) / T) * T > 11 * ntiles;
  if (T > 1 && (uneven || by_rows) && M >= 2 * mult * T) {
    s.mparts = T;
    s.rows_per_part = ((M + T - 1) / T + mult - 1) / mult * mult;
    s.nblocks = (ntiles + kNCB - 1) / kNCB;
  } else {
    s.nblocks = std::min(ntiles, T * ((ntiles + T * kNCB - 1) / (T * kNCB)));
  }
  s.nblocks = std::max<int64_t>(1, s.nblocks);
  return s;
}

// ---------------------------------------------------------------------------------------------
// The paths (dispatch.cpp picks one per call). Each is defined in its own file, which explicitly instantiates
// it for every width of AQ_FOR_EACH_WIDTH (decode.h; path 3 for the integer widths only), so that the files
// compile in parallel.
// ---------------------------------------------------------------------------------------------
// 1: fused GEMV (gemv.cpp) over `count` problems that share x and the weight configuration, in one pool of items
template <int B> void gemv_path(const Ctx* cs, int64_t count);
// Whether path 1 runs bf16 tiles for p (the 4-bit bf16-dot GEMV, or the bf16-pair one from 3 rows of bf16 x):
// it reads x_bf16 alone and writes y_bf16 when that is set.
bool gemv_reads_bf16_only(const LowbitProblem& p);
template <int B> void gemm_path(const Ctx& c);   // 2: dequant + fp32 GEMM (gemm_f32.cpp)
#if AQ_VNNI
template <int B> void qgemm_path(const Ctx& c);  // 3: dequant + int16 VNNI GEMM (gemm_int16.cpp)
#endif
#if AQ_BF16DOT
template <int B> void bgemm_path(const Ctx& c);  // 4: dequant to bf16 + bf16 dot GEMM (gemm_bf16.cpp)
#endif
#if AQ_AMX
template <int B> void amx_gemm_path(const Ctx& c);  // 5: dequant to bf16 + AMX tile GEMM (gemm_amx.cpp)
#endif

}  // namespace affineq::detail
