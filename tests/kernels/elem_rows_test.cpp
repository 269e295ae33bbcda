// The row passes of the cpu cross-entropy and softmax (kernels/cpu/elem_common.h): lane_max and
// exp_store_sum on floats, which AVX-512 builds run in zmm registers, bitwise equal to the
// definition written out here lane by lane with the scalar fast_exp: sixteen interleaved partial
// results combined by a fixed tree. Lengths cover whole vectors, tails of every size and rows
// shorter than one vector; values cover the exponent's clamps, infinities, NaN and signed zeros.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/elem_common.h"

namespace moe {
namespace {

using cpu::elem::kLanes;

float lane_max_definition(const float* x, int64_t n) {
  float acc[kLanes];
  for (float& a : acc) a = x[0];
  for (int64_t i = 0; i < n; ++i) acc[i % kLanes] = x[i] > acc[i % kLanes] ? x[i] : acc[i % kLanes];
  float m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

float exp_sum_definition(const float* x, float* d, int64_t n, float mx) {
  float acc[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    d[i] = cpu::elem::fast_exp(x[i] - mx);
    acc[i % kLanes] += d[i];
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

std::vector<float> row(int64_t n, uint64_t seed, float spread) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[static_cast<size_t>(i)] = spread * static_cast<float>(random_uniform(seed, 2, static_cast<uint64_t>(i)) - 0.5);
  return x;
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

void expect_same_passes(const std::vector<float>& x, const char* what) {
  const auto n = static_cast<int64_t>(x.size());
  const float mx = cpu::elem::lane_max(x.data(), n);
  ASSERT_EQ(bits(mx), bits(lane_max_definition(x.data(), n))) << what << ", n " << n;
  std::vector<float> d(x.size()), want(x.size());
  // mx, and a shift that is not the row's max (the routing softmax passes its own)
  for (const float shift : {mx, 0.0f, -3.5f}) {
    const float sum = cpu::elem::exp_store_sum(x.data(), d.data(), n, shift);
    ASSERT_EQ(bits(sum), bits(exp_sum_definition(x.data(), want.data(), n, shift))) << what << ", n " << n;
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits(d[i]), bits(want[i])) << what << ", n " << n << ", at " << i;
  }
  std::vector<float> in_place = x;  // d may be x itself
  const float sum = cpu::elem::exp_store_sum(in_place.data(), in_place.data(), n, mx);
  exp_sum_definition(x.data(), want.data(), n, mx);
  EXPECT_EQ(bits(sum), bits(exp_sum_definition(x.data(), want.data(), n, mx)));
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits(in_place[i]), bits(want[i])) << what << " in place, at " << i;
}

TEST(ElemRows, FloatPassesEqualTheirLaneDefinitionBitwise) {
  for (const int64_t n : {1, 7, 15, 16, 17, 31, 32, 33, 100, 8192, 50304, 50311}) {
    expect_same_passes(row(n, 11 + static_cast<uint64_t>(n), 20.0f), "uniform +-10");
    expect_same_passes(row(n, 13 + static_cast<uint64_t>(n), 400.0f), "uniform +-200 (both clamps)");
  }
}

TEST(ElemRows, FloatPassesKeepSpecialValuesAsDefined) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = row(53, 5, 10.0f);
  x[3] = -0.0f;
  x[4] = 0.0f;
  x[9] = 88.7228391f;   // exactly the upper clamp
  x[10] = -86.5f;       // exactly the lower one
  x[20] = -inf;
  x[35] = inf;
  expect_same_passes(x, "clamps, zeros, infinities");
  x[40] = nan;
  expect_same_passes(x, "a NaN past the first vector");
  x[0] = nan;
  expect_same_passes(x, "a NaN first");
  std::vector<float> zeros = {-0.0f, 0.0f, -0.0f};
  expect_same_passes(zeros, "signed zeros only");
}

}  // namespace
}  // namespace moe
