// The transposed 16-bit copies the AMX weight gradients take as their A (kernels/cpu/transpose16.h)
// against the definition, element by element, at block edges (rows around the 16-row blocks,
// columns around the 32-column blocks and their 16-column halves), with the destination's zero
// padding and its rows past the block untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/cpu/transpose16.h"

namespace moe {
namespace {

TEST(Transpose16, MatchesTheDefinitionAtEveryBlockEdge) {
  constexpr uint16_t kUntouched = 0xBEEF;
  for (int64_t rows : {1, 15, 16, 31, 32, 33, 64, 70}) {
    for (int64_t cols : {1, 16, 17, 31, 32, 33, 96, 100}) {
      SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols);
      const int64_t src_ld = cols + 5, dst_ld = rows + (rows % 32 ? 32 - rows % 32 : 0) + 3;
      std::vector<uint16_t> src(static_cast<size_t>(rows * src_ld));
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(i * 40503u + 7);
      // Two rows past the block's last destination row must stay as they were.
      std::vector<uint16_t> dst(static_cast<size_t>((cols + 2) * dst_ld), kUntouched);
      cpu::transpose_block16(src.data(), src_ld, dst.data(), dst_ld, rows, cols);
      int64_t wrong = 0;
      for (int64_t c = 0; c < cols + 2; ++c)
        for (int64_t r = 0; r < dst_ld; ++r) {
          const uint16_t want = c >= cols ? kUntouched : r < rows ? src[static_cast<size_t>(r * src_ld + c)] : 0;
          wrong += dst[static_cast<size_t>(c * dst_ld + r)] != want;
        }
      EXPECT_EQ(wrong, 0);
    }
  }
}

}  // namespace
}  // namespace moe
