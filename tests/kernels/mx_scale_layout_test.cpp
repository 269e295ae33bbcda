// The Blackwell block-scale layout of core/mx_scale_layout.h: every offset a bijection onto the
// padded tiles, the stated in-tile formula, grouped padding per expert; and, built only where
// CUTLASS's headers are present (tests/kernels_cutlass/), equal to CUTLASS's own layout.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "core/mx_scale_layout.h"

namespace moe {
namespace {

TEST(MxScaleLayout, EveryScaleHasItsOwnByteInsideThePaddedTiles) {
  for (int64_t rows : {1, 31, 32, 128, 129, 300})
    for (int64_t kb : {1, 3, 4, 8, 9}) {
      const int64_t bytes = mx::swizzled_scale_bytes(rows, kb);
      std::set<int64_t> seen;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < kb; ++c) {
          const int64_t o = mx::swizzled_scale_offset(r, c, kb);
          ASSERT_GE(o, 0);
          ASSERT_LT(o, bytes) << rows << "x" << kb;
          ASSERT_TRUE(seen.insert(o).second) << "row " << r << " block " << c << " collides";
        }
      EXPECT_EQ(bytes % mx::kTileBytes, 0);
    }
}

TEST(MxScaleLayout, InTileOffsetsAndTileOrderAreTheDocumentedOnes) {
  const int64_t kb = 8;  // two k-tiles per 128-row block
  EXPECT_EQ(mx::swizzled_scale_offset(0, 0, kb), 0);
  EXPECT_EQ(mx::swizzled_scale_offset(1, 0, kb), 16);
  EXPECT_EQ(mx::swizzled_scale_offset(32, 0, kb), 4);
  EXPECT_EQ(mx::swizzled_scale_offset(0, 1, kb), 1);
  EXPECT_EQ(mx::swizzled_scale_offset(0, 4, kb), 512);      // the next k-tile of the same rows
  EXPECT_EQ(mx::swizzled_scale_offset(128, 0, kb), 1024);   // then the next 128 rows
  EXPECT_EQ(mx::swizzled_scale_offset(127, 3, kb), 31 * 16 + 3 * 4 + 3);
}

// Experts of 5, 0 and 130 rows: padded to 128, 0 and 256; expert 2's first row starts at 128.
TEST(MxScaleLayout, GroupedOperandsPadEachExpert) {
  const int64_t rows[] = {5, 0, 130}, kb = 4;
  int64_t base = 0;
  std::set<int64_t> seen;
  for (int64_t e = 0; e < 3; ++e) {
    for (int64_t i = 0; i < rows[e]; ++i)
      for (int64_t c = 0; c < kb; ++c) EXPECT_TRUE(seen.insert(mx::swizzled_scale_offset(base + i, c, kb)).second);
    base += mx::padded_group_rows(rows[e]);
  }
  EXPECT_EQ(base, 384);
  EXPECT_EQ(mx::swizzled_scale_offset(128, 0, kb), mx::kTileBytes);  // expert 2 starts a tile
}

}  // namespace
}  // namespace moe
