// core/mx_scale_layout.h against CUTLASS's own description of the layout: cute's tile_to_shape of
// Sm1xxBlockScaledBasicChunk's SfKMajorAtom, as Sm1xxBlockScaledConfig::tile_atom_to_shape_SFA
// builds it, evaluated on the host for every (row, k-block) of several shapes. Built only when the
// CUTLASS headers (scripts/cuda_headers.sh) and CCCL are found (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cute/layout.hpp>
#include <cute/tensor.hpp>

#include "core/mx_scale_layout.h"

namespace moe {
namespace {

using namespace cute;

// Sm1xxBlockScaledBasicChunk<32, UMMA::Major::K>::SfKMajorAtom, spelled as CUTLASS spells it
// (cutlass/detail/sm100_blockscaled_layout.hpp; that header pulls in the device MMA traits, which
// do not build for the host).
using SfKMajorAtom = Layout<Shape<Shape<_32, _4>, Shape<Int<32>, _4>>, Stride<Stride<_16, _4>, Stride<_0, _1>>>;

TEST(MxScaleLayoutCutlass, OffsetsEqualCutlassTileToShape) {
  for (int rows : {128, 256, 384})
    for (int kb : {4, 8, 12}) {
      const auto layout = tile_to_shape(SfKMajorAtom{}, make_shape(rows, kb * 32, 1), Step<_2, _1, _3>{});
      EXPECT_EQ(static_cast<int64_t>(cosize(layout)), mx::swizzled_scale_bytes(rows, kb));
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < kb; ++c)
          for (int within : {0, 17, 31})  // every element of a 32-value block shares its scale
            ASSERT_EQ(static_cast<int64_t>(layout(r, c * 32 + within, 0)), mx::swizzled_scale_offset(r, c, kb))
                << rows << "x" << kb << " row " << r << " block " << c;
    }
}

}  // namespace
}  // namespace moe
