// AMX tiles on the CPU, the two things every user needs: the kernel's permission to use them
// (once per process) and the tile shapes loaded on the calling thread. Used by the peak's AMX loop
// (fma_peak.cpp), the bf16 GEMMs' switch (gemm_dnnl.cpp) and the attention's AMX products
// (attention_amx.h). Every user here takes all eight tiles at 16 rows x 64 bytes.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace moe::cpu::amx {

// Whether the kernel lets this process use tile data (Linux 5.16+), asked once per process.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads eight tiles of 16 rows x 64 bytes on the calling thread (tile state is per thread; oneDNN's
// AMX kernels load their own shapes between our uses). Not _tile_loadconfig: GCC 12's declares only
// the first 8 bytes read, so the stores that fill the configuration were removed as dead.
inline void load_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

}  // namespace moe::cpu::amx
