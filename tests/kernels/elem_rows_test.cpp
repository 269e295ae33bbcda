// The row passes of the cpu cross-entropy and softmax (kernels/cpu/elem_common.h): lane_max and
// exp_store_sum on floats, which AVX-512 builds run in zmm registers, bitwise equal to the
// definition written out here lane by lane with the scalar fast_exp: sixteen interleaved partial
// results combined by a fixed tree. Lengths cover whole vectors, tails of every size and rows
// shorter than one vector; values cover the exponent's clamps, infinities, NaN and signed zeros.
// The cross-entropy's versions (lane_max_ordinary, exp_store_sum_ahead with its shortened exp on
// rows without NaN and with a finite max) give the same bits.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/elem_common.h"
#include "lane_definitions.h"

namespace moe {
namespace {

using cpu::elem::kLanes;
using test::lane_max_definition;

float exp_sum_definition(const float* x, float* d, int64_t n, float mx) {
  float acc[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    d[i] = cpu::elem::fast_exp(x[i] - mx);
    acc[i % kLanes] += d[i];
  }
  return test::tree_definition(acc);
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
  // The cross-entropy's passes: the max and whether the row is ordinary (no NaN, a finite max),
  // then the exponentials, by the shortened exp where it is; the same bits either way.
  bool ordinary = true;
  ASSERT_EQ(bits(cpu::elem::lane_max_ordinary(x.data(), n, &ordinary)), bits(mx)) << what;
  bool has_nan = false;
  for (const float v : x) has_nan |= std::isnan(v);
  EXPECT_EQ(ordinary, !has_nan && std::isfinite(mx)) << what << ", n " << n;
  const float want_sum = exp_sum_definition(x.data(), want.data(), n, mx);
  std::vector<float> next(x.size());  // the row asked for ahead
  for (const bool in_place_ahead : {false, true}) {
    std::vector<float> src = x, dst(x.size());
    float* out = in_place_ahead ? src.data() : dst.data();
    const float got = cpu::elem::exp_store_sum_ahead(src.data(), out, n, mx, next.data(), ordinary);
    ASSERT_EQ(bits(got), bits(want_sum)) << what << ", n " << n << (ordinary ? ", ordinary" : "");
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits(out[i]), bits(want[i])) << what << " ahead, at " << i;
  }
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
  // Ordinary rows with -inf logits and values far below the max (the exp's lower clamp), a row
  // whose max is -inf (not ordinary: -inf - -inf is NaN), and one with +inf.
  std::vector<float> y = row(70, 7, 400.0f);
  y[2] = -inf;
  y[65] = -inf;
  expect_same_passes(y, "-inf logits in an ordinary row");
  expect_same_passes(std::vector<float>(19, -inf), "all -inf");
  y[30] = inf;
  expect_same_passes(y, "+inf max");
}

}  // namespace
}  // namespace moe
