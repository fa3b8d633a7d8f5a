// What the kernels that run on AMX's tile unit share (kernels/cpu_linear.cpp,
// kernels/cpu_chunk_attention.cpp): whether Linux grants this process the
// tile state, and the one tile shape they use. Built only where the compiler
// targets AMX-BF16 (-march=native on such a CPU): AGENTKV_AMX then.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AGENTKV_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace agentkv {

constexpr int64_t kTileRows = 16;   // rows per tile
constexpr int64_t kTileBytes = 64;  // bytes per tile row: 32 bf16, 16 pairs or 16 fp32

// Linux hands out the tile state only on request, once per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows of 64 bytes, on the calling thread (tile state is per thread).
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = kTileBytes;
    c.rows[t] = kTileRows;
  }
  _tile_loadconfig(&c);
}

}  // namespace agentkv
#endif
