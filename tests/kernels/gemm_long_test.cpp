// Our bf16 long-reduction data gradient (kernels/cpu/gemm_long.h) on its own: within the fp32
// accumulation bound of the f64 product of the same bf16 values, and an element's bits the same
// whatever band of rows holds it. Through the ops it is also checked against the reference by
// gemm_test.cpp's long-reduction cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/cpu/gemm_long.h"

namespace moe {
namespace {

std::vector<bf16> values(int64_t n, uint64_t seed) {
  std::vector<bf16> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = bf16(static_cast<float>(random_uniform(seed, 1, static_cast<uint64_t>(i)) - 0.5));
  return v;
}

std::vector<uint32_t> paired(const std::vector<bf16>& w, int64_t n, int64_t k) {
  std::vector<uint32_t> wp(static_cast<size_t>(cpu::longred::pair_words(n, k)), 0xdeadbeefu);
  cpu::longred::pair_rows(w.data(), n, k, 0, (n + 1) / 2, wp.data());
  return wp;
}

TEST(LongReductionKernel, IsWithinTheFp32AccumulationBound) {
  if (!cpu::longred::available(DType::kBF16)) GTEST_SKIP() << "built without AVX512-BF16: oneDNN runs it";
  struct Case {
    int64_t m, n, k;
  };
  // Odd n (the last pair half zero), n over several 256-pair chunks, k with a partial column block and
  // under one block, m with a partial group of rows.
  for (const Case& c : {Case{37, 101, 70}, Case{13, 1201, 130}, Case{7, 4097, 5}, Case{64, 6000, 256}}) {
    SCOPED_TRACE(testing::Message() << "m " << c.m << " n " << c.n << " k " << c.k);
    const auto dy = values(c.m * c.n, 1), w = values(c.n * c.k, 2);
    const auto wp = paired(w, c.n, c.k);
    std::vector<float> dx(static_cast<size_t>(c.m * c.k), -7.0f);  // written, never read
    cpu::longred::band(dy.data(), c.n, wp.data(), c.n, c.k, c.m, dx.data(), c.k);
    double worst = 0;
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.k; ++j) {
        double sum = 0, mag = 0;
        for (int64_t r = 0; r < c.n; ++r) {
          const double p = static_cast<double>(static_cast<float>(dy[static_cast<size_t>(i * c.n + r)])) *
                           static_cast<float>(w[static_cast<size_t>(r * c.k + j)]);
          sum += p;
          mag += std::fabs(p);
        }
        // Products of bf16 values are exact in fp32: only the chain's n / 2 + 1 roundings count.
        const double bound = static_cast<double>(c.n / 2 + 2) * std::ldexp(1.0, -24) * mag;
        worst = std::max(worst, std::fabs(dx[static_cast<size_t>(i * c.k + j)] - sum) / bound);
      }
    EXPECT_LE(worst, 1.0);
  }
}

TEST(LongReductionKernel, AnElementsBitsDoNotDependOnItsBand) {
  if (!cpu::longred::available(DType::kBF16)) GTEST_SKIP() << "built without AVX512-BF16: oneDNN runs it";
  const int64_t m = 29, n = 1031, k = 100;
  const auto dy = values(m * n, 3), w = values(n * k, 4);
  const auto wp = paired(w, n, k);
  std::vector<float> whole(static_cast<size_t>(m * k)), parts(static_cast<size_t>(m * k));
  cpu::longred::band(dy.data(), n, wp.data(), n, k, m, whole.data(), k);
  for (const auto& [r0, rows] : {std::pair<int64_t, int64_t>{0, 5}, {5, 13}, {18, 11}})
    cpu::longred::band(dy.data() + r0 * n, n, wp.data(), n, k, rows, parts.data() + r0 * k, k);
  EXPECT_EQ(parts, whole);
}

}  // namespace
}  // namespace moe
