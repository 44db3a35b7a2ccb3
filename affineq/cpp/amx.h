// AMX tiles (gemm_amx.cpp: bf16; gemm_int8_codes.cpp: int8): the OS permission and the tile configuration.
// Linux grants a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process:
// amx_usable). Each worker loads a configuration when its work starts and releases the tiles when done, so
// oneDNN's AMX kernels on the same threads configure their own.
#pragma once

#include "simd.h"  // defines AQ_AMX

#include <cstdint>

namespace affineq::detail {

#if AQ_AMX
// Whether the OS granted this process the AMX tile state (requested on the first call; gemm_amx.cpp).
bool amx_usable();
#endif

// Whether this build and CPU run AMX tiles. Also what tells an AMX Xeon's cores apart, whose 512-bit vdpbf16ps
// issues at half the rate of an fp32 FMA (use_x_digits gives them the digits GEMV at every width).
inline bool amx_cpu() {
#if AQ_AMX
  return amx_usable();
#else
  return false;
#endif
}

#if AQ_AMX

// Every tile 16 rows x 64 bytes: 0..3 accumulate (16 fp32 / int32 per row), 4 / 5 are A tiles (16 rows of x: 32
// bf16 or 64 int8) and 6 / 7 B tiles (16 k-pairs or k-quads of 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Loads `cfg` for this thread's tiles and releases them when it goes out of scope.
class TileScope {
 public:
  explicit TileScope(const TileConfig& cfg) {
    // cfg escapes and memory is clobbered first: GCC modelled ldtilecfg as reading only part of the 64 bytes and
    // left reserved bytes of a config built field by field unwritten (garbage there: #GP)
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

#endif  // AQ_AMX
}  // namespace affineq::detail
