// Launch-grid arithmetic of the CUDA kernels, plain C++ so the host tests check it without a GPU.
// Grids are capped (a 1-D grid above ~1 M blocks buys nothing); every kernel launched with a
// capped grid loops over its items with the grid's stride (MOE_GRID_LOOP, MOE_WARP_LOOP in
// device.cuh), so no item is ever left out, whatever the count.
#pragma once

#include <cstdint>

namespace moe::cuda {

constexpr int64_t kMaxGridBlocks = 65535LL * 16;

// Blocks of `threads` threads for n items, at least 1 and at most cap.
constexpr unsigned blocks_for(int64_t n, int threads, int64_t cap = kMaxGridBlocks) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b < cap ? b : cap);
}

// One warp (32 threads) per row: the blocks for `rows` rows, and the grid's stride in rows (its
// number of warps), which MOE_WARP_LOOP steps by.
constexpr unsigned warp_blocks(int64_t rows, int threads) { return blocks_for(rows * 32, threads); }
constexpr int64_t warp_stride(unsigned blocks, int threads) { return static_cast<int64_t>(blocks) * threads / 32; }

}  // namespace moe::cuda
