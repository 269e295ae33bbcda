// The attention kernels' 2^x (kernels/cpu/attention_simd.h): every lane as the Cephes polynomial
// with vscalefps gives it, written out here in scalar (clamped to [-200, 127], the fraction's
// polynomial in fused multiply-adds, times 2^n rounded once), including the lanes below -152 that
// vexp2 sets to zero without computing them; and within the polynomial's stated error of exp2.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/attention_simd.h"

namespace moe {
namespace {

#if defined(__AVX512F__)
float definition(float x) {
  x = std::isnan(x) ? x : std::min(127.0f, std::max(-200.0f, x));
  const float n = std::nearbyint(x);  // ties to even, as vroundscaleps
  const float f = x - n;
  float p = 1.535336188319500e-4f;
  for (float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                  6.931472028550421e-1f, 1.0f})
    p = std::fma(p, f, c);
  return std::ldexp(p, static_cast<int>(n));  // one rounding, as vscalefps (subnormals kept)
}

std::vector<float> vexp2_of(const std::vector<float>& xs) {
  std::vector<float> out(xs.size());
  for (size_t i = 0; i + 16 <= xs.size(); i += 16) cpu::attn::vstore(out.data() + i, cpu::attn::vexp2(cpu::attn::vload(xs.data() + i)));
  return out;
}

std::vector<float> sweep() {
  std::vector<float> xs;
  for (int i = -260 * 64; i <= 140 * 64; ++i) xs.push_back(static_cast<float>(i) / 64.0f);
  // Every float from -153 to -151 (the zero shortcut's edge) and from -127 to -125 (subnormal results).
  for (float lo : {-153.0f, -127.0f})
    for (float x = lo; x <= lo + 2.0f; x = std::nextafter(x, 0.0f)) xs.push_back(x);
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-inf, inf, -0.0f, 0.0f, std::numeric_limits<float>::denorm_min(), -1e30f, 1e30f, -152.0f,
                  std::nextafter(-152.0f, -inf), std::nextafter(-152.0f, 0.0f), -151.5f, -150.0f, -149.0f})
    xs.push_back(x);
  while (xs.size() % 16) xs.push_back(0.5f);
  return xs;
}

TEST(AttentionExp2, EveryLaneAsThePolynomialGivesIt) {
  const std::vector<float> xs = sweep();
  const std::vector<float> got = vexp2_of(xs);
  int64_t wrong = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const float want = definition(xs[i]);
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want) && ++wrong <= 5)
      ADD_FAILURE() << "2^" << xs[i] << ": " << got[i] << ", the polynomial gives " << want;
    if (xs[i] < -152.0f) {
      EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), 0u) << xs[i];  // +0, as the polynomial rounds it
    }
  }
  EXPECT_EQ(wrong, 0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> nans(16, nan);
  for (float y : vexp2_of(nans)) EXPECT_TRUE(std::isnan(y));
}

// The polynomial's error on normal results, against exp2 in double: attention_simd.h states ~2e-7
// relative, the bound asserted here; the sweep measures 7.7e-8.
TEST(AttentionExp2, WithinThePolynomialsErrorOfExp2) {
  const std::vector<float> xs = sweep();
  const std::vector<float> got = vexp2_of(xs);
  double worst = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!(xs[i] >= -126.0f && xs[i] <= 127.0f)) continue;
    const double want = std::exp2(static_cast<double>(xs[i]));
    worst = std::max(worst, std::abs(got[i] / want - 1.0));
  }
  EXPECT_LT(worst, 2e-7);
}
#else
TEST(AttentionExp2, EveryLaneAsThePolynomialGivesIt) { GTEST_SKIP() << "AVX-512 only"; }
#endif

}  // namespace
}  // namespace moe
