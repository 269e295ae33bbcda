// Our weight-gradient micro-kernels (kernels/cpu/gemm_wgrad.h) on their own: every element is
// one chain over the rows in order, added to dw in one rounding, whatever the band, the width or
// the panel it falls in. Through the ops they are also checked against the reference by every
// GEMM test (gemm_test.cpp: f64 parity, thread counts, bands of any size).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/cpu/gemm_wgrad.h"

namespace moe {
namespace {

struct Case {
  int64_t rows, band, k, lda, ldb;
};
// Remainders of every kind (band % 6, k % 64, odd rows for bf16's pairs), a strided a (lda >
// band: a column block of dy), and the shapes of the bench configs' experts and LM heads.
const Case kCases[] = {{37, 19, 70, 23, 75},   {1, 1, 1, 1, 1},     {64, 128, 256, 128, 256},
                       {64, 256, 128, 300, 128}, {256, 512, 512, 512, 512}, {513, 13, 129, 50, 129}};

std::vector<float> values(int64_t n, uint64_t seed, bool round) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(random_uniform(seed, 1, static_cast<uint64_t>(i)) - 0.5);
    v[static_cast<size_t>(i)] = round ? static_cast<float>(bf16(x)) : x;
  }
  return v;
}

std::vector<uint16_t> bits_of(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = bf16(v[i]).bits;
  return b;
}

// Runs chunk() on a (rows x band at lda), b (rows x k at ldb) into a copy of c0.
std::vector<float> run(DType t, const Case& s, const std::vector<float>& a, const std::vector<float>& b,
                       const std::vector<float>& c0, bool overwrite, int64_t a_col = 0, int64_t band = -1) {
  if (band < 0) band = s.band;
  std::vector<float> c(c0.begin() + a_col * s.k, c0.begin() + (a_col + band) * s.k);
  std::vector<char> scratch(cpu::wgrad::scratch_bytes(t, s.rows, band, s.k));
  if (t == DType::kF32) {
    cpu::wgrad::chunk(t, a.data() + a_col, s.lda, b.data(), s.ldb, s.rows, band, s.k, c.data(), overwrite,
                      scratch.data());
  } else {
    const std::vector<uint16_t> ab = bits_of(a), bb = bits_of(b);
    cpu::wgrad::chunk(t, ab.data() + a_col, s.lda, bb.data(), s.ldb, s.rows, band, s.k, c.data(), overwrite,
                      scratch.data());
  }
  return c;
}

TEST(WeightGradKernel, Fp32IsTheFmaChainOfEachElementAddedOnce) {
  if (!cpu::wgrad::available(DType::kF32)) GTEST_SKIP() << "built without AVX-512: oneDNN runs weight gradients";
  for (const Case& s : kCases) {
    SCOPED_TRACE(testing::Message() << s.rows << " rows, band " << s.band << ", k " << s.k);
    const auto a = values(s.rows * s.lda, 1, false), b = values(s.rows * s.ldb, 2, false),
               c0 = values(s.band * s.k, 3, false);
    const std::vector<float> added = run(DType::kF32, s, a, b, c0, false);
    const std::vector<float> written = run(DType::kF32, s, a, b, c0, true);
    int64_t wrong = 0;
    for (int64_t i = 0; i < s.band; ++i)
      for (int64_t j = 0; j < s.k; ++j) {
        float chain = 0.0f;
        for (int64_t r = 0; r < s.rows; ++r) chain = std::fma(a[r * s.lda + i], b[r * s.ldb + j], chain);
        const size_t e = static_cast<size_t>(i * s.k + j);
        wrong += added[e] != c0[e] + chain;
        wrong += written[e] != chain;
      }
    EXPECT_EQ(wrong, 0);
  }
}

TEST(WeightGradKernel, Bf16IsWithinTheFp32AccumulationBound) {
  if (!cpu::wgrad::available(DType::kBF16))
    GTEST_SKIP() << "built without AVX512-BF16: oneDNN runs bf16 weight gradients";
  for (const Case& s : kCases) {
    SCOPED_TRACE(testing::Message() << s.rows << " rows, band " << s.band << ", k " << s.k);
    // bf16-exact operands: every product is exact in fp32, so the only error is the fp32 sum's
    // (vdpbf16ps: two products and the accumulator per step), at most (rows + 1) roundings.
    const auto a = values(s.rows * s.lda, 1, true), b = values(s.rows * s.ldb, 2, true),
               c0 = values(s.band * s.k, 3, false);
    const std::vector<float> c = run(DType::kBF16, s, a, b, c0, false);
    double worst = 0;
    for (int64_t i = 0; i < s.band; ++i)
      for (int64_t j = 0; j < s.k; ++j) {
        double sum = c0[static_cast<size_t>(i * s.k + j)], mag = std::fabs(sum);
        for (int64_t r = 0; r < s.rows; ++r) {
          const double p = static_cast<double>(a[r * s.lda + i]) * b[r * s.ldb + j];
          sum += p;
          mag += std::fabs(p);
        }
        const double bound = static_cast<double>(s.rows + 1) * std::ldexp(1.0, -24) * mag;
        worst = std::max(worst, std::fabs(c[static_cast<size_t>(i * s.k + j)] - sum) / bound);
      }
    EXPECT_LE(worst, 1.0);
  }
}

TEST(WeightGradKernel, AnElementsBitsDoNotDependOnItsBand) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    if (!cpu::wgrad::available(t)) continue;
    SCOPED_TRACE(dtype_name(t));
    const Case s{75, 31, 90, 40, 90};
    const auto a = values(s.rows * s.lda, 4, t == DType::kBF16), b = values(s.rows * s.ldb, 5, t == DType::kBF16),
               c0 = values(s.band * s.k, 6, false);
    const std::vector<float> whole = run(t, s, a, b, c0, false);
    // The same rows of dw as bands of 7, 11 and 13 rows (other panels, other remainders).
    std::vector<float> parts;
    for (const auto& [col, band] : {std::pair<int64_t, int64_t>{0, 7}, {7, 11}, {18, 13}}) {
      const std::vector<float> p = run(t, s, a, b, c0, false, col, band);
      parts.insert(parts.end(), p.begin(), p.end());
    }
    EXPECT_EQ(parts, whole);
  }
}

}  // namespace
}  // namespace moe
