// Core pieces: tensor views, bf16 rounding, the counter-based RNG, host buffers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "common/test_util.h"
#include "core/buffer.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace moe {
namespace {

TEST(Philox, MatchesRandom123KnownAnswers) {
  // Known-answer vectors from Random123's kat_vectors for philox4x32_10.
  auto zero = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(zero[0], 0x6627e8d5u);
  EXPECT_EQ(zero[1], 0xe169c58du);
  EXPECT_EQ(zero[2], 0xbc57ac4cu);
  EXPECT_EQ(zero[3], 0x9b00dbd8u);
  auto ones = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                         {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(ones[0], 0x408f276du);
  EXPECT_EQ(ones[1], 0x41c83b0eu);
  EXPECT_EQ(ones[2], 0xa20bc7c6u);
  EXPECT_EQ(ones[3], 0x6d5451fdu);
}

TEST(Rng, TruncatedNormalMomentsAndBounds) {
  double sum = 0, sumsq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double z = random_trunc_normal(7, 1, static_cast<uint64_t>(i), 2.0);
    ASSERT_LE(std::fabs(z), 2.0);
    sum += z;
    sumsq += z * z;
  }
  // Variance of a standard normal truncated at +-2 is 0.7737; mean 0.
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sumsq / n, 0.7737, 0.01);
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 1.0f / 256)), 1.0f);  // tie -> even (down)
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::nanf("")))));
}

// Buffers of 2 MiB or more start on a huge-page boundary (so the kernel can back them with huge
// pages where it gives them on request); smaller ones on a cache line. Every byte reads zero.
TEST(HostBuffer, LargeBuffersAreHugePageAlignedAndZeroed) {
  for (const size_t bytes : {size_t{100}, size_t{4096}, (size_t{2} << 20) - 1, size_t{2} << 20, (size_t{5} << 20) + 7}) {
    const Buffer b(bytes);
    const auto at = reinterpret_cast<uintptr_t>(b.data());
    EXPECT_EQ(at % (bytes >= (size_t{2} << 20) ? (size_t{2} << 20) : 64), 0u) << bytes << " bytes";
    const auto* p = static_cast<const unsigned char*>(b.data());
    for (size_t i = 0; i < bytes; i += 4093) ASSERT_EQ(p[i], 0) << bytes << " bytes, at " << i;
    EXPECT_EQ(p[bytes - 1], 0);
  }
}

TEST(Tensor, ViewsAndSlicesCheckShapes) {
  OwnedTensor t(DType::kF32, {4, 6});
  EXPECT_EQ(t.t.view({2, 12}).dim(1), 12);
  EXPECT_THROW(t.t.view({5, 5}), Error);
  Tensor s = t.t.slice(1, 3);
  EXPECT_EQ(s.dim(0), 2);
  EXPECT_EQ(static_cast<float*>(s.data), t.as<float>() + 6);
  EXPECT_THROW(t.t.slice(3, 5), Error);
  EXPECT_THROW(t.t.as<double>(), Error);
}

}  // namespace
}  // namespace moe
