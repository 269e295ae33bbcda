// Partial RoPE (rope_fwd / rope_bwd with rotary_dim < hd) and the clamp ops of clip_qkv: each
// backend under test against ref, ref f64 gradients against central finite differences, the
// exact conventions (which dims rotate at which frequency; torch.clamp's gradient at the bounds).
// Error measure (test_util.h): max|a - b| / max|b|.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

using test::clone;
using test::dot;
using test::get;
using test::numeric_grad;
using test::random_tensor;
using test::rel_error;
using test::set;

#define SEED_TRACE() SCOPED_TRACE("seed " + std::to_string(test::test_seed()))
#define EXPECT_ERROR(stmt, text)                                                                        \
  do {                                                                                                  \
    const std::string msg_ = test::error_of([&] { stmt; });                                             \
    EXPECT_NE(msg_.find(text), std::string::npos) << "expected '" << (text) << "' in: " << msg_;        \
  } while (0)

MOE_BACKEND_SUITE(PartialRope);
MOE_BACKEND_SUITE(Clamp);

// ---------------------------------------------------------------- partial RoPE
struct RopeCase {
  int64_t b, s, h, d, rd;
};

TEST_P(PartialRope, MatchesRefAndPassesTheRestThrough) {
  SEED_TRACE();
  uint64_t salt = 300;
  for (RopeCase c : {RopeCase{1, 3, 1, 4, 2}, RopeCase{2, 5, 3, 8, 4}, RopeCase{1, 90, 2, 64, 16},
                     RopeCase{2, 33, 4, 128, 96}, RopeCase{1, 7, 2, 10, 6}}) {
    SCOPED_TRACE("d " + std::to_string(c.d) + " rotary " + std::to_string(c.rd));
    for (bool inverse : {false, true}) {
      OwnedTensor x = random_tensor(DType::kF32, {c.b, c.s, c.h, c.d}, ++salt);
      OwnedTensor x0 = clone(x), x64 = clone(x, DType::kF64);
      inverse ? test::fast().rope_bwd(x, 10000.0, c.rd) : test::fast().rope_fwd(x, 10000.0, c.rd);
      inverse ? ref::rope_bwd(x64, 10000.0, c.rd) : ref::rope_fwd(x64, 10000.0, c.rd);
      // As the full-rotation test (elementwise_test.cpp): f32 cos/sin, two products and a sum.
      EXPECT_LT(rel_error(x, x64), 5e-7);
      // Dims [rd, d) of every head are untouched, bit for bit.
      int64_t moved = 0;
      for (int64_t row = 0; row < c.b * c.s * c.h; ++row)
        for (int64_t j = c.rd; j < c.d; ++j) moved += get(x, row * c.d + j) != get(x0, row * c.d + j);
      EXPECT_EQ(moved, 0);
    }
  }
}

TEST(PartialRopeRef, PairsAndFrequenciesAreThoseOfTheRotatedPart) {
  // hd 8, rotary_dim 4: dims (0, 2) and (1, 3) rotate by s * theta^(-2i/4), i = 0, 1 (Olmo-core
  // 3's RotaryEmbedding: inv_freq over rotary_dim, rotate_half within it); dims 4..7 pass.
  const double theta = 100.0;
  OwnedTensor x(DType::kF64, {1, 2, 1, 8});
  for (int64_t i = 0; i < 16; ++i) set(x, i, static_cast<double>(i + 1));
  ref::rope_fwd(x, theta, 4);
  for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(get(x, j), static_cast<double>(j + 1));  // position 0
  const double a1 = std::pow(theta, -0.5);  // position 1, i = 1: theta^(-2/4)
  const double v[8] = {9, 10, 11, 12, 13, 14, 15, 16};
  EXPECT_NEAR(get(x, 8), v[0] * std::cos(1.0) - v[2] * std::sin(1.0), 1e-14);
  EXPECT_NEAR(get(x, 10), v[2] * std::cos(1.0) + v[0] * std::sin(1.0), 1e-14);
  EXPECT_NEAR(get(x, 9), v[1] * std::cos(a1) - v[3] * std::sin(a1), 1e-14);
  EXPECT_NEAR(get(x, 11), v[3] * std::cos(a1) + v[1] * std::sin(a1), 1e-14);
  for (int64_t j = 4; j < 8; ++j) EXPECT_EQ(get(x, 8 + j), v[j]);
  // rotary_dim = hd is the full rotation; an odd or out-of-range count is refused.
  OwnedTensor y = random_tensor(DType::kF64, {1, 3, 2, 8}, 310), z = clone(y);
  ref::rope_fwd(y, theta, 8);
  ref::rope_fwd(z, theta, 8);
  EXPECT_TRUE(test::bitwise_equal(y, z));
  EXPECT_ERROR(ref::rope_fwd(y, theta, 3), "rotary_dim 3");
  EXPECT_ERROR(ref::rope_fwd(y, theta, 10), "rotary_dim 10");
  EXPECT_ERROR(ref::rope_fwd(y, theta, 0), "rotary_dim 0");
}

TEST(PartialRopeRef, GradientMatchesFiniteDifferences) {
  SEED_TRACE();
  OwnedTensor x = random_tensor(DType::kF64, {2, 4, 2, 10}, 320);
  OwnedTensor rw = random_tensor(DType::kF64, {2, 4, 2, 10}, 321);
  auto loss = [&] {
    OwnedTensor y = clone(x);
    ref::rope_fwd(y, 100.0, 6);
    return dot(y, rw);
  };
  OwnedTensor g = clone(rw);
  ref::rope_bwd(g, 100.0, 6);
  EXPECT_LT(rel_error(g, numeric_grad(x, loss)), 1e-9);
}

// ---------------------------------------------------------------- clamp (clip_qkv)
TEST_P(Clamp, MatchesRefBitwise) {
  SEED_TRACE();
  OwnedTensor x = random_tensor(DType::kF32, {70, 33}, 330, -3.0, 3.0);
  // Values exactly at the bounds, in both ops.
  set(x, 0, 1.5), set(x, 1, -1.5), set(x, 2, 1.5000001), set(x, 3, -1.4999999);
  set(x, 4, std::nan(""));  // stays NaN, as torch.clamp's (its gradient: 0)
  OwnedTensor y = random_tensor(DType::kF32, {70, 33}, 331), yr = clone(y);
  test::fast().clamp_fwd(x, 1.5, y);
  ref::clamp_fwd(x, 1.5, yr);
  EXPECT_TRUE(std::isnan(get(y, 4)));
  set(y, 4, 0.0), set(yr, 4, 0.0);
  EXPECT_TRUE(test::bitwise_equal(y, yr));
  OwnedTensor dy = random_tensor(DType::kF32, {70, 33}, 332), dx = clone(dy), dxr = clone(dy);
  test::fast().clamp_bwd(dy, x, 1.5, dx);
  ref::clamp_bwd(dy, x, 1.5, dxr);
  EXPECT_TRUE(test::bitwise_equal(dx, dxr));
  // In place (dx aliasing dy; y aliasing x) as the attention block calls them.
  OwnedTensor g = clone(dy), xi = clone(x);
  test::fast().clamp_bwd(g, x, 1.5, g);
  test::fast().clamp_fwd(xi, 1.5, xi);
  EXPECT_EQ(get(dxr, 4), 0.0);
  EXPECT_TRUE(test::bitwise_equal(g, dxr));
  set(xi, 4, 0.0);
  EXPECT_TRUE(test::bitwise_equal(xi, yr));
}

TEST(ClampRef, ValuesAndTorchsGradientAtTheBounds) {
  // torch.clamp(x, -c, c): the gradient passes where -c <= x <= c, the bounds included
  // (FunctionsManual clamp_backward: (self >= min) & (self <= max)).
  const double c = 0.75;
  const double xs[7] = {-2.0, -0.75, -0.7499999, 0.0, 0.75, 0.7500001, 3.0};
  const double ys[7] = {-0.75, -0.75, -0.7499999, 0.0, 0.75, 0.75, 0.75};
  const double gs[7] = {0, 1, 1, 1, 1, 0, 0};
  for (DType dt : {DType::kF64, DType::kF32}) {
    OwnedTensor x(dt, {7}), y(dt, {7}), dy(dt, {7}), dx(dt, {7});
    for (int64_t i = 0; i < 7; ++i) set(x, i, xs[i]), set(dy, i, 1.0);
    ref::clamp_fwd(x, c, y);
    ref::clamp_bwd(dy, x, c, dx);
    for (int64_t i = 0; i < 7; ++i) {
      const double expect = dt == DType::kF32 ? static_cast<float>(ys[i]) : ys[i];
      EXPECT_EQ(get(y, i), expect) << i;
      EXPECT_EQ(get(dx, i), gs[i]) << i;
    }
  }
  OwnedTensor x(DType::kF32, {2}), y(DType::kF64, {2});
  EXPECT_ERROR(ref::clamp_fwd(x, 0.0, x), "limit");
  EXPECT_ERROR(ref::clamp_fwd(x, 1.0, y), "clamp_fwd");
}

TEST(ClampRef, GradientMatchesFiniteDifferences) {
  SEED_TRACE();
  // Values at least 1e-3 from the bounds: the clamp is linear or flat within the FD step.
  OwnedTensor x = random_tensor(DType::kF64, {9, 11}, 340, -2.0, 2.0);
  for (int64_t i = 0; i < x.t.numel(); ++i)
    if (std::abs(std::abs(get(x, i)) - 0.9) < 1e-3) set(x, i, 0.0);
  OwnedTensor rw = random_tensor(DType::kF64, {9, 11}, 341);
  auto loss = [&] {
    OwnedTensor y(DType::kF64, {9, 11});
    ref::clamp_fwd(x, 0.9, y);
    return dot(y, rw);
  };
  OwnedTensor g(DType::kF64, {9, 11});
  ref::clamp_bwd(rw, x, 0.9, g);
  EXPECT_LT(rel_error(g, numeric_grad(x, loss)), 1e-9);
}

}  // namespace
}  // namespace moe
