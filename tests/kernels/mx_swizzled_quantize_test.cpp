// mx_quantize_swizzled through the Backend: the quantizer writing its scales straight into the
// Blackwell GEMMs' 128 x 4 tile layout (core/mx_scale_layout.h), each expert's rows padded to 128
// separately, the codes unmoved. Checked against the row-major mx_quantize of the ref backend:
// the same codes, every scale at its tile offset, zeros everywhere else in the padded span.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "core/mx_scale_layout.h"
#include "core/mxfp8.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

MOE_BACKEND_SUITE(MxSwizzled);

struct Case {
  std::vector<int32_t> offsets;  // empty: one group of all rows
  int64_t rows, cols;
};

void check_case(const Case& k, DType xdt, DType elem, mx::ScaleRule rule) {
  SCOPED_TRACE(testing::Message() << k.rows << "x" << k.cols << ", " << k.offsets.size() << " offsets, "
                                  << dtype_name(xdt) << " -> " << dtype_name(elem) << ", rule " << static_cast<int>(rule));
  const int64_t kb = k.cols / mx::kBlock;
  OwnedTensor x = test::random_tensor(xdt, {k.rows, k.cols}, 31 + static_cast<uint64_t>(k.rows), -4.0, 4.0);
  OwnedTensor want_codes(elem, {k.rows, k.cols}), want_scales(DType::kE8M0, {k.rows, kb});
  ref::mx_quantize(x, false, rule, want_codes, want_scales, Tensor(), Tensor());
  // The layout's span: each group's rows padded to 128, the k-blocks to 4.
  std::vector<int64_t> begin{0}, padded_before;
  int64_t padded = 0;
  const size_t groups = k.offsets.empty() ? 1 : k.offsets.size() - 1;
  for (size_t g = 0; g < groups; ++g) {
    const int64_t b = k.offsets.empty() ? 0 : k.offsets[g], e = k.offsets.empty() ? k.rows : k.offsets[g + 1];
    padded_before.push_back(padded);
    padded += mx::padded_group_rows(e - b);
    begin.push_back(e);
  }
  const int64_t bytes = mx::swizzled_scale_bytes(padded, kb);
  OwnedTensor codes(elem, {k.rows, k.cols}), scales(DType::kE8M0, {bytes + 7});  // a tail it must not touch
  std::memset(codes.t.data, 0xee, static_cast<size_t>(codes.t.nbytes()));
  std::memset(scales.t.data, 0xee, static_cast<size_t>(scales.t.nbytes()));
  OwnedTensor off(DType::kI32, {static_cast<int64_t>(k.offsets.size())});
  for (size_t i = 0; i < k.offsets.size(); ++i) off.as<int32_t>()[i] = k.offsets[i];
  test::fast().mx_quantize_swizzled(x, rule, codes, scales, k.offsets.empty() ? Tensor() : off.t);

  const auto* gc = static_cast<const uint8_t*>(codes.t.data);
  const auto* wc = static_cast<const uint8_t*>(want_codes.t.data);
  const int64_t quantized_rows = begin.back();
  int64_t bad_codes = 0;
  for (int64_t i = 0; i < quantized_rows * k.cols; ++i) bad_codes += gc[i] != wc[i];
  for (int64_t i = quantized_rows * k.cols; i < k.rows * k.cols; ++i) bad_codes += gc[i] != 0xee;
  EXPECT_EQ(bad_codes, 0) << "codes";
  std::vector<int> placed(static_cast<size_t>(bytes), 0);
  const auto* gs = static_cast<const uint8_t*>(scales.t.data);
  const auto* ws = static_cast<const uint8_t*>(want_scales.t.data);
  int64_t bad_scales = 0;
  for (size_t g = 0; g < groups; ++g)
    for (int64_t r = begin[g]; r < begin[g + 1]; ++r)
      for (int64_t j = 0; j < kb; ++j) {
        const int64_t o = mx::swizzled_scale_offset(padded_before[g] + r - begin[g], j, kb);
        ++placed[static_cast<size_t>(o)];
        bad_scales += gs[o] != ws[r * kb + j];
      }
  EXPECT_EQ(bad_scales, 0) << "scales at their tile offsets";
  int64_t bad_padding = 0, twice = 0;
  for (int64_t o = 0; o < bytes; ++o) {
    twice += placed[static_cast<size_t>(o)] > 1;
    bad_padding += placed[static_cast<size_t>(o)] == 0 && gs[o] != 0;
  }
  EXPECT_EQ(twice, 0);
  EXPECT_EQ(bad_padding, 0) << "padding bytes are 0";
  for (int64_t o = bytes; o < bytes + 7; ++o) EXPECT_EQ(gs[o], 0xee) << "past the span, byte " << o;
}

TEST_P(MxSwizzled, ScalesLandOnTheirTileOffsetsAndCodesStayRowMajor) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_quantize_swizzled, DType::kF32);
  // One dense operand; experts of 5, 0, 135 and 60 rows (an empty one, one past a tile), k-blocks
  // 3 (padded to 4) and 8 (two k-tiles); rows left after the last offset.
  const std::vector<Case> cases = {{{}, 300, 96}, {{0, 5, 5, 140, 200}, 200, 96}, {{0, 5, 5, 140, 200}, 210, 256},
                                   {{0, 129}, 129, 32}};
  for (const Case& k : cases) {
    check_case(k, DType::kF32, DType::kE4M3, mx::ScaleRule::kRceil);
    check_case(k, DType::kBF16, DType::kE5M2, mx::ScaleRule::kFloor);
  }
  // f64 input where the backend has it (expected_skips.txt lists the backends without).
  if (test::fast_device().supports(OpId::mx_quantize_swizzled, DType::kF64))
    check_case(cases[1], DType::kF64, DType::kE4M3, mx::ScaleRule::kRceil);
}

TEST_P(MxSwizzled, RefusesScalesTooSmallForThePaddedLayout) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_quantize_swizzled, DType::kF32);
  OwnedTensor x = test::random_tensor(DType::kF32, {140, 64}, 5);
  OwnedTensor codes(DType::kE4M3, {140, 64}), off(DType::kI32, {3});
  off.as<int32_t>()[0] = 0;
  off.as<int32_t>()[1] = 5;
  off.as<int32_t>()[2] = 140;
  // Two groups: 128 + 256 padded rows, 4 k-blocks: 1,536 bytes; the unpadded 140 x 2 is far short.
  OwnedTensor small(DType::kE8M0, {1535});
  const std::string e = test::error_of([&] { test::fast().mx_quantize_swizzled(x, mx::ScaleRule::kRceil, codes, small, off); });
  EXPECT_NE(e.find("the swizzled layout of 2 group(s) needs 1536"), std::string::npos) << e;
}

}  // namespace
}  // namespace moe
