// The CUDA backend's launch arithmetic, checked on the host (no GPU needed): the capped grids of
// the warp-per-row kernels reach every row through their grid-stride loops, and the alignment
// cuBLASLt is told is the one the pointers have.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/cuda/alignment.h"
#include "kernels/cuda/grid.h"

namespace moe::cuda {
namespace {

// MOE_WARP_LOOP (device.cuh) on the host: warp w of the grid takes rows w, w + stride, ...; the
// rows a launch of warp_blocks(rows) blocks of `threads` threads reaches, counted.
int64_t rows_reached(int64_t rows, int threads) {
  const unsigned blocks = warp_blocks(rows, threads);
  const int64_t stride = warp_stride(blocks, threads);
  int64_t reached = 0;
  for (int64_t w = 0; w < stride; ++w)
    if (w < rows) reached += (rows - 1 - w) / stride + 1;
  return reached;
}

TEST(CudaGrid, WarpPerRowLaunchesReachEveryRowPastTheGridCap) {
  // The cap: 65535 x 16 blocks of 256 threads = 8 warps each, 8,388,480 rows in one pass; a
  // kernel without the loop skipped every row past that.
  const int64_t one_pass = kMaxGridBlocks * 256 / 32;
  EXPECT_EQ(one_pass, 8388480);
  for (const int64_t rows : {int64_t{1}, int64_t{7}, int64_t{4096}, one_pass - 1, one_pass, one_pass + 1, int64_t{3} * one_pass + 5,
                             int64_t{1} << 31}) {
    SCOPED_TRACE(rows);
    EXPECT_LE(warp_blocks(rows, 256), kMaxGridBlocks);
    EXPECT_GE(warp_blocks(rows, 256), 1u);
    EXPECT_EQ(rows_reached(rows, 256), rows);
    EXPECT_EQ(rows_reached(rows, 128), rows);
  }
  EXPECT_EQ(warp_stride(warp_blocks(one_pass + 1, 256), 256), one_pass);  // capped: the loop takes the rest
  EXPECT_EQ(warp_blocks(0, 256), 1u);  // an empty launch is still a valid grid
}

TEST(CudaGrid, PointerAlignmentIsTheLargestPowerOfTwoUpTo256) {
  EXPECT_EQ(pointer_alignment(uintptr_t{0x7f0000001000}), 256u);
  EXPECT_EQ(pointer_alignment(uintptr_t{0x7f0000001040}), 64u);  // an arena tensor (64-byte aligned)
  EXPECT_EQ(pointer_alignment(uintptr_t{0x7f0000001010}), 16u);
  EXPECT_EQ(pointer_alignment(uintptr_t{0x7f0000001002}), 2u);
  EXPECT_EQ(pointer_alignment(uintptr_t{0x7f0000001001}), 1u);
  EXPECT_EQ(pointer_alignment(uintptr_t{0x7f0000001080}), 128u);
  EXPECT_EQ(pointer_alignment(uintptr_t{0}), 256u);  // a null operand (beta = 0's C) assumes nothing
  alignas(64) static float buf[64];
  EXPECT_GE(pointer_alignment(buf), 64u);
  EXPECT_EQ(pointer_alignment(buf + 4), 16u);  // 16 bytes past a 64-byte boundary
}

}  // namespace
}  // namespace moe::cuda
