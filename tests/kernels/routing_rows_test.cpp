// The cpu routing's vectorized score rows (kernels/cpu/moe_routing.cpp) against their definition
// written out here lane by lane with the scalar fast_exp, bitwise: the router z-loss (each row's
// log-sum-exp, its square summed per 256-token chunk in double, and the gradient added to dlogits)
// and the softmax scores. AVX-512 builds run float rows in zmm registers, with exp's clamps left
// out where a row is ordinary (no NaN, a finite max); the bits must not move either way. Rows
// cover whole vectors, tails, rows shorter than a vector, the exp's clamps, -inf logits, and rows
// that are not ordinary (a NaN, +inf, all -inf).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elem_common.h"
#include "lane_definitions.h"

namespace moe {
namespace {

using cpu::elem::fast_exp;
using test::kLanes;

float lse_definition(const float* z, int64_t n) {
  const float mx = test::lane_max_definition(z, n);
  float acc[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % kLanes] += fast_exp(z[i] - mx);
  return mx + std::log(test::tree_definition(acc));
}

// Rows of E logits: uniform +-10, +-200 (both of the exp's clamps), and special rows.
std::vector<float> logits(int64_t T, int64_t E, uint64_t seed) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> z(static_cast<size_t>(T * E));
  for (int64_t i = 0; i < T * E; ++i) {
    const float spread = (i / E) % 2 ? 400.0f : 20.0f;
    z[static_cast<size_t>(i)] = spread * static_cast<float>(random_uniform(seed, 3, static_cast<uint64_t>(i)) - 0.5);
  }
  auto at = [&](int64_t t, int64_t e) -> float& { return z[static_cast<size_t>(t * E + e % E)]; };
  at(2, 0) = -inf;  // ordinary rows with -inf logits
  at(2, E - 1) = -inf;
  at(3, E / 2) = std::numeric_limits<float>::quiet_NaN();
  at(4, E - 1) = inf;
  for (int64_t e = 0; e < E; ++e) at(5, e) = -inf;
  at(6, 1) = 88.7228391f;  // exactly the upper clamp
  at(6, 0) = -86.5f;       // exactly the lower one
  return z;
}

bool same(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (a != a && b != b); }

TEST(RoutingRows, ZLossEqualsItsLaneDefinitionBitwise) {
  for (const int64_t E : {5, 16, 37, 128, 200}) {
    const int64_t T = 300;  // two reduction chunks of 256 tokens
    std::vector<float> z = logits(T, E, 17 + static_cast<uint64_t>(E)), dz(z.size()), want(z.size());
    for (size_t i = 0; i < dz.size(); ++i) dz[i] = want[i] = 0.25f * static_cast<float>(i % 7);  // added to
    const double value_scale = 0.7, grad_scale = 0.3;
    double out = 0.0;
    cpu::router_z_loss(Tensor(z.data(), DType::kF32, {T, E}), value_scale, grad_scale,
                       Tensor(&out, DType::kF64, {1}), Tensor(dz.data(), DType::kF32, {T, E}));
    double chunks[2] = {0, 0};
    for (int64_t t = 0; t < T; ++t) {
      const float* zr = z.data() + t * E;
      const float lse = lse_definition(zr, E);
      chunks[t / 256] += static_cast<double>(lse) * static_cast<double>(lse);
      const float g = static_cast<float>(grad_scale) * 2.0f * lse / static_cast<float>(T);
      for (int64_t e = 0; e < E; ++e) want[static_cast<size_t>(t * E + e)] += g * fast_exp(zr[e] - lse);
    }
    const double want_out = value_scale * (chunks[0] + chunks[1]) / static_cast<double>(T);
    EXPECT_TRUE(out == want_out || (out != out && want_out != want_out)) << "E " << E << ": " << out << " vs " << want_out;
    for (size_t i = 0; i < dz.size(); ++i)
      ASSERT_TRUE(same(dz[i], want[i])) << "E " << E << ", token " << i / E << ", expert " << i % E << ": " << dz[i]
                                        << " vs " << want[i];
  }
}

TEST(RoutingRows, SoftmaxScoresEqualTheirLaneDefinitionBitwise) {
  for (const int64_t E : {5, 16, 37, 128, 200}) {
    const int64_t T = 9;
    std::vector<float> z = logits(T, E, 29 + static_cast<uint64_t>(E)), s(z.size());
    cpu::router_scores_fwd(Tensor(z.data(), DType::kF32, {T, E}), ScoreKind::kSoftmax, 0.0,
                           Tensor(s.data(), DType::kF32, {T, E}));
    for (int64_t t = 0; t < T; ++t) {
      const float* zr = z.data() + t * E;
      const float mx = test::lane_max_definition(zr, E);
      float acc[kLanes] = {};
      std::vector<float> e_row(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) acc[e % kLanes] += (e_row[static_cast<size_t>(e)] = fast_exp(zr[e] - mx));
      const float inv = 1.0f / test::tree_definition(acc);
      for (int64_t e = 0; e < E; ++e)
        ASSERT_TRUE(same(s[static_cast<size_t>(t * E + e)], e_row[static_cast<size_t>(e)] * inv))
            << "E " << E << ", token " << t << ", expert " << e;
    }
  }
}

}  // namespace
}  // namespace moe
