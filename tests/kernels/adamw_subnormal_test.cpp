// The cpu AdamW with subnormal moments and gradients (kernels/cpu/elementwise.cpp, FlushSubnormals):
// they count as zero, so a step on them gives the bits of the same step on zeros and leaves no
// subnormal behind, while the parameters take the reference's bits (which keeps subnormals): the
// updates such moments would make are below half an ulp of p.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>

#include "common/test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

using test::clone;
using test::random_tensor;

bool subnormal(float x) { return x != 0.0f && std::fabs(x) < 1.1754944e-38f; }
int64_t differing_bits(const Tensor& a, const Tensor& b) {
  int64_t d = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    d += std::bit_cast<uint32_t>(a.as<float>()[i]) != std::bit_cast<uint32_t>(b.as<float>()[i]);
  return d;
}

TEST(CpuAdamW, SubnormalMomentsAndGradientsCountAsZero) {
  const int64_t n = 1003;  // 62 blocks of 16 in the parallel loop and a tail of 11
  OwnedTensor p = random_tensor(DType::kF32, {n}, 670, -1.0, 1.0);
  OwnedTensor g(DType::kF32, {n}), m(DType::kF32, {n}), v(DType::kF32, {n});
  OwnedTensor gz(DType::kF32, {n}), mz(DType::kF32, {n}), vz(DType::kF32, {n});  // the same, subnormals zeroed
  for (int64_t i = 0; i < n; ++i) {
    const float tiny = static_cast<float>(i % 97 + 1) * 1e-40f;  // 1e-40 .. 9.7e-39: all subnormal
    // A third of the gradients subnormal, a third zero, a third ordinary; every moment starts subnormal.
    const float gi = i % 3 == 0 ? -tiny : i % 3 == 1 ? 0.0f : 1e-3f * static_cast<float>(i % 7 - 3);
    g.as<float>()[i] = gi, gz.as<float>()[i] = subnormal(gi) ? 0.0f : gi;
    m.as<float>()[i] = i % 2 ? tiny : -tiny, mz.as<float>()[i] = 0.0f;
    v.as<float>()[i] = tiny, vz.as<float>()[i] = 0.0f;
  }
  ASSERT_TRUE(subnormal(m.as<float>()[5]) && subnormal(v.as<float>()[5]) && subnormal(g.as<float>()[0]));
  OwnedTensor pz = clone(p), pr = clone(p), mr = clone(m), vr = clone(v);
  cpu::adamw(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 700);
  cpu::adamw(pz, gz, mz, vz, 1e-3, 0.9, 0.95, 1e-8, 0.1, 700);
  EXPECT_EQ(differing_bits(p, pz), 0);
  EXPECT_EQ(differing_bits(m, mz), 0);
  EXPECT_EQ(differing_bits(v, vz), 0);
  int64_t left = 0;
  for (int64_t i = 0; i < n; ++i) left += subnormal(m.as<float>()[i]) + subnormal(v.as<float>()[i]);
  EXPECT_EQ(left, 0);
  // The reference keeps the subnormals: where the gradient is zero or subnormal the update is
  // p * decay plus a term under half its ulp, the same bits.
  ref::adamw(pr, g, mr, vr, 1e-3, 0.9, 0.95, 1e-8, 0.1, 700);
  int64_t differ = 0, subnormal_left = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 3 == 2) continue;  // ordinary gradients: up to FMA contraction, as the AdamW suite says
    differ += std::bit_cast<uint32_t>(p.as<float>()[i]) != std::bit_cast<uint32_t>(pr.as<float>()[i]);
    subnormal_left += subnormal(mr.as<float>()[i]);
  }
  EXPECT_EQ(differ, 0);
  EXPECT_GT(subnormal_left, 0);  // the reference did keep them: the comparison above means something
}

}  // namespace
}  // namespace moe
