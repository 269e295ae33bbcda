// Where a Blackwell MXFP8 GEMM wants each E8M0 scale (cuBLASLt's VEC32_UE8M0 mode, "1D block
// scaling factors layout"; CUTLASS's Sm1xxBlockScaledConfig, SfKMajorAtom): the (rows, K/32)
// scales of a K-major operand in tiles of 128 rows x 4 k-blocks, each tile 512 contiguous bytes,
// the k-tiles of a 128-row block consecutive (tiles row-block-major), and within a tile row r,
// k-block c at (r % 32) * 16 + (r / 32) * 4 + c. Rows and k-blocks are padded up to whole tiles.
// A grouped (expert) operand pads each expert's rows to 128 separately, so expert e's tiles start
// after the padded rows of the experts before it.
// The mx_quantize_swizzled op writes its scales at these offsets (the codes stay where
// mx_quantize puts them: a grouped GEMM takes each expert's rows by pointer, so only the scales
// need the padding); training on the cpu keeps them row-major (rows, K/32), which its GEMMs read. tests/kernels/mx_scale_layout_test.cpp checks them against CUTLASS's own
// layout (cute's tile_to_shape of SfKMajorAtom) where its headers are present.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moe::mx {

constexpr int64_t kTileRows = 128, kTileBlocks = 4, kTileBytes = kTileRows * kTileBlocks;

MOE_HD constexpr int64_t round_up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Bytes of the swizzled scales of a rows x (kblocks * 32) operand.
MOE_HD constexpr int64_t swizzled_scale_bytes(int64_t rows, int64_t kblocks) {
  return round_up_to(rows, kTileRows) * round_up_to(kblocks, kTileBlocks);
}

// Byte offset of row r, k-block c's scale in an operand of kblocks k-blocks.
MOE_HD constexpr int64_t swizzled_scale_offset(int64_t r, int64_t c, int64_t kblocks) {
  const int64_t tile = (r / kTileRows) * (round_up_to(kblocks, kTileBlocks) / kTileBlocks) + c / kTileBlocks;
  return tile * kTileBytes + (r % 32) * 16 + (r % kTileRows) / 32 * 4 + c % kTileBlocks;
}

// Grouped operands: the first padded row of expert e, given the experts' row counts' prefix
// (offsets[e] rows before e, as the grouped GEMMs' offsets): the padded rows of experts < e.
// rows_before_padded = sum over e' < e of round_up_to(rows(e'), 128); the scale of expert e's row
// i, k-block c is at swizzled_scale_offset(rows_before_padded + i, c, kblocks).
MOE_HD constexpr int64_t padded_group_rows(int64_t rows) { return round_up_to(rows, kTileRows); }

}  // namespace moe::mx
