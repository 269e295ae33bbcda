// MXFP8 GEMMs (mx_linear, mx_grouped_linear) through every backend against the f64 product of the
// dequantized operands, and the exact-range constants of core/mxfp8.h derived from every code.
//
// Tolerances: every product is exact (that is the contract), so a backend's f32 result differs
// from the f64 reference by its fp32 summation alone: at most K * 2^-24 * sum_l |a_l b_l| for any
// order of K additions (the classical gamma_K bound, first order), checked per element. At the
// boundaries of the exact bf16 range the sum has one nonzero product and the result must equal
// it rounded to fp32, exactly: on the wrong side of a boundary the bf16 path would flush it to
// zero or overflow an operand, so each boundary is crossed in both directions.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "core/bf16.h"
#include "core/mxfp8.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

using mx::Elem;

DType dtype_of_elem(Elem e) { return e == Elem::kE4M3 ? DType::kE4M3 : DType::kE5M2; }

// ---------------------------------------------------------------- the exact ranges, from every code
bool is_bf16(double v) { return static_cast<double>(static_cast<float>(bf16(static_cast<float>(v)))) == v; }
bool is_fp32(double v) { return std::isfinite(static_cast<float>(v)) && static_cast<double>(static_cast<float>(v)) == v; }
bool is_normal_or_zero(double v) { return v == 0 || std::fabs(v) >= std::ldexp(1.0, -126); }

// The contiguous range of s (unbiased) for which pred(s) holds; fails if it is not one interval.
template <class Pred>
std::pair<int, int> range_of(Pred pred, int lo, int hi) {
  int first = 1000, last = -1000;
  for (int s = lo; s <= hi; ++s)
    if (pred(s)) {
      if (first == 1000) first = s;
      EXPECT_TRUE(last == -1000 || last == s - 1) << "not one interval at " << s;
      last = s;
    }
  return {first, last};
}

std::vector<double> finite_values(Elem e) {
  std::vector<double> v;
  for (int c = 0; c < 256; ++c) {
    const float f = mx::decode(static_cast<uint8_t>(c), e);
    if (std::isfinite(f) && f != 0) v.push_back(f);
  }
  return v;
}

TEST(MxExactRange, EveryCodeTimesItsScaleIsABf16InTheStatedRange) {
  for (Elem e : {Elem::kE4M3, Elem::kE5M2}) {
    const std::vector<double> vals = finite_values(e);
    auto all = [&](int s, bool normal) {
      for (double v : vals)
        if (!is_bf16(std::ldexp(v, s)) || (normal && !is_normal_or_zero(std::ldexp(v, s)))) return false;
      return true;
    };
    const auto any_bf16 = range_of([&](int s) { return all(s, false); }, -127, 127);
    const auto normal = range_of([&](int s) { return all(s, true); }, -127, 127);
    if (e == Elem::kE4M3) {
      EXPECT_EQ(any_bf16, std::make_pair(-124, 119));  // bf16 subnormals allowed
    }
    EXPECT_EQ(normal, std::make_pair(mx::bf16_exact_min(e), mx::bf16_exact_max(e)));
  }
}

TEST(MxExactRange, EveryProductOfTwoCodesIsAnFp32InTheStatedRange) {
  const std::pair<Elem, Elem> pairs[] = {{Elem::kE4M3, Elem::kE4M3}, {Elem::kE5M2, Elem::kE4M3},
                                         {Elem::kE5M2, Elem::kE5M2}};
  for (auto [ea, eb] : pairs) {
    const std::vector<double> va = finite_values(ea), vb = finite_values(eb);
    auto all = [&](int s, bool normal) {
      for (double a : va)
        for (double b : vb) {
          const double p = std::ldexp(a * b, s);  // exact in double
          if (!is_fp32(p) || (normal && !is_normal_or_zero(p))) return false;
        }
      return true;
    };
    const auto exact = range_of([&](int s) { return all(s, false); }, -160, 140);
    const auto normal = range_of([&](int s) { return all(s, true); }, -160, 140);
    if (ea == Elem::kE4M3 && eb == Elem::kE4M3) {
      EXPECT_EQ(exact, std::make_pair(-131, 110));
    }
    EXPECT_EQ(normal, std::make_pair(mx::product_exact_min(ea, eb), mx::product_exact_max(ea, eb)));
  }
}

// Why the range is narrowed to normal values: this CPU's bf16 dot product (the cpu backend's bf16
// GEMMs) reads a bf16 subnormal as zero and flushes a subnormal product.
TEST(MxExactRange, TheBf16DotProductFlushesSubnormals) {
  if (!__builtin_cpu_supports("avx512bf16")) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  OwnedTensor x(DType::kBF16, {1, 2}), w(DType::kBF16, {1, 2}), y(DType::kF32, {1, 1});
  x.as<bf16>()[0] = bf16(std::ldexp(1.0f, -127));  // a bf16 subnormal
  w.as<bf16>()[0] = bf16(1.0f);
  cpu::linear_fwd(x, w, y, false);
  EXPECT_EQ(y.as<float>()[0], 0.0f) << "subnormal input read as zero";
  x.as<bf16>()[0] = bf16(std::ldexp(1.0f, -63));
  w.as<bf16>()[0] = bf16(std::ldexp(1.0f, -64));  // both normal, the product 2^-127 is not
  cpu::linear_fwd(x, w, y, false);
  EXPECT_EQ(y.as<float>()[0], 0.0f) << "subnormal product flushed";
}

// ---------------------------------------------------------------- operands
struct MxMatrix {
  OwnedTensor codes, scales;
  MxMatrix(Elem e, int64_t rows, int64_t k)
      : codes(dtype_of_elem(e), {rows, k}), scales(DType::kE8M0, {rows, k / mx::kBlock}) {}
};

MxMatrix quantized(const Tensor& x, Elem e) {
  MxMatrix m(e, x.shape[0], x.shape[1]);
  ref::mx_quantize(x, false, mx::ScaleRule::kRceil, m.codes, m.scales, Tensor{}, Tensor{});
  return m;
}

// Random values with magnitudes spread over 2^-6 .. 2^6 by row and column block.
OwnedTensor spread(int64_t rows, int64_t k, uint64_t salt) {
  OwnedTensor x = test::random_tensor(DType::kF32, {rows, k}, salt);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < k; ++l)
      x.as<float>()[r * k + l] *= std::ldexp(1.0f, static_cast<int>((r * 7 + l / 32 * 5) % 13) - 6);
  return x;
}

// |y - exact| <= K 2^-24 sum|products| + K 2^-149 (fp32 subnormal granularity), per element.
void expect_close(const Tensor& y, const Tensor& exact, const Tensor& abs_sum, int64_t k, const char* what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    const double g = y.as<float>()[i], w = exact.as<double>()[i];
    const double tol = static_cast<double>(k) * (std::ldexp(abs_sum.as<double>()[i], -24) + std::ldexp(1.0, -149));
    if (!(std::fabs(g - w) <= tol) && bad++ < 3) ADD_FAILURE() << what << " [" << i << "]: " << g << " vs " << w;
  }
  EXPECT_EQ(bad, 0) << what;
}

// sum_l |deq(a) deq(b)| in f64 for each output: the tolerance's scale.
OwnedTensor abs_products(const MxMatrix& a, const MxMatrix& b) {
  const int64_t m = a.codes.t.shape[0], n = b.codes.t.shape[0], k = a.codes.t.shape[1];
  OwnedTensor da(DType::kF64, {m, k}), db(DType::kF64, {n, k}), out(DType::kF64, {m, n});
  ref::mx_dequantize(a.codes, a.scales, da, Tensor{});
  ref::mx_dequantize(b.codes, b.scales, db, Tensor{});
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += std::fabs(da.as<double>()[i * k + l] * db.as<double>()[j * k + l]);
      out.as<double>()[i * n + j] = s;
    }
  return out;
}

MOE_BACKEND_SUITE(MxGemm);

TEST_P(MxGemm, LinearIsTheExactProductUpToSummationOrder) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_linear, DType::kF32);
  const int64_t m = 70, n = 50, k = 96;
  for (auto [ea, eb] : {std::pair{Elem::kE4M3, Elem::kE4M3}, std::pair{Elem::kE5M2, Elem::kE4M3}})
    for (bool accumulate : {false, true}) {
      const MxMatrix a = quantized(spread(m, k, 1), ea), b = quantized(spread(n, k, 2), eb);
      OwnedTensor y = test::random_tensor(DType::kF32, {m, n}, 3), exact(DType::kF64, {m, n});
      for (int64_t i = 0; i < m * n; ++i) exact.as<double>()[i] = y.as<float>()[i];
      test::fast().mx_linear(a.codes, a.scales, b.codes, b.scales, y, accumulate);
      ref::mx_linear(a.codes, a.scales, b.codes, b.scales, exact, accumulate);
      expect_close(y, exact, abs_products(a, b), k + (accumulate ? 1 : 0), accumulate ? "accumulate" : "overwrite");
    }
}

TEST_P(MxGemm, GroupedIsTheExactProductPerExpert) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_grouped_linear, DType::kF32);
  const int64_t rows = 100, experts = 4, n = 40, k = 64;
  const int32_t offs[] = {0, 30, 30, 77, 91};  // an empty expert; rows past offsets[E] untouched
  OwnedTensor offsets(DType::kI32, {experts + 1});
  std::memcpy(offsets.t.data, offs, sizeof offs);
  const MxMatrix a = quantized(spread(rows, k, 4), Elem::kE4M3);
  OwnedTensor w = spread(experts * n, k, 5);
  const MxMatrix b = quantized(w, Elem::kE4M3);
  Tensor b3 = b.codes.t, s3 = b.scales.t;
  b3.ndim = s3.ndim = 3;
  b3.shape[0] = s3.shape[0] = experts;
  b3.shape[1] = s3.shape[1] = n;
  b3.shape[2] = k;
  s3.shape[2] = k / mx::kBlock;
  OwnedTensor y(DType::kF32, {rows, n}), exact(DType::kF64, {rows, n});
  for (int64_t i = 0; i < rows * n; ++i) y.as<float>()[i] = 12345.0f;
  test::fast().mx_grouped_linear(a.codes, a.scales, b3, s3, offsets, y);
  ref::mx_grouped_linear(a.codes, a.scales, b3, s3, offsets, exact);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = offs[e], r1 = offs[e + 1];
    if (r0 == r1) continue;
    OwnedTensor ye(DType::kF32, {r1 - r0, n}), xe(DType::kF64, {r1 - r0, n});
    std::memcpy(ye.t.data, y.as<float>() + r0 * n, static_cast<size_t>((r1 - r0) * n) * 4);
    std::memcpy(xe.t.data, exact.as<double>() + r0 * n, static_cast<size_t>((r1 - r0) * n) * 8);
    MxMatrix ae(Elem::kE4M3, r1 - r0, k), be(Elem::kE4M3, n, k);
    std::memcpy(ae.codes.t.data, a.codes.bytes() + r0 * k, static_cast<size_t>((r1 - r0) * k));
    std::memcpy(ae.scales.t.data, a.scales.bytes() + r0 * k / 32, static_cast<size_t>((r1 - r0) * k / 32));
    std::memcpy(be.codes.t.data, b.codes.bytes() + e * n * k, static_cast<size_t>(n * k));
    std::memcpy(be.scales.t.data, b.scales.bytes() + e * n * k / 32, static_cast<size_t>(n * k / 32));
    expect_close(ye, xe, abs_products(ae, be), k, "expert");
  }
  for (int64_t i = offs[experts] * n; i < rows * n; ++i) ASSERT_EQ(y.as<float>()[i], 12345.0f) << i;
}

// One nonzero product in K-block 1 (block 0 is zeros at a normal scale): the result must be that
// product rounded to fp32, on both sides of each boundary of the exact bf16 range.
struct Boundary {
  const char* what;
  Elem ea, eb;
  int sa, sb;          // unbiased scales of block 1
  float va, vb;        // the two elements (codes' values)
};

std::vector<Boundary> boundaries() {
  std::vector<Boundary> out;
  for (auto [ea, eb] : {std::pair{Elem::kE4M3, Elem::kE4M3}, std::pair{Elem::kE5M2, Elem::kE4M3}}) {
    const float sub_a = std::ldexp(1.0f, mx::min_subnormal_exp(ea)), sub_b = std::ldexp(1.0f, mx::min_subnormal_exp(eb));
    const float max_a = mx::elem_max(ea), max_b = mx::elem_max(eb);
    for (int d : {-1, 0}) {  // d = -1: just outside the range, 0: its edge
      out.push_back({"a's smallest", ea, eb, mx::bf16_exact_min(ea) + d, 0, sub_a, 1.0f});
      out.push_back({"b's smallest", ea, eb, 0, mx::bf16_exact_min(eb) + d, 1.0f, sub_b});
      out.push_back({"a's largest", ea, eb, mx::bf16_exact_max(ea) - d, 0, max_a, 0.5f});
      out.push_back({"b's largest", ea, eb, -1, mx::bf16_exact_max(eb) - d, 0.5f, max_b});
      const int pmin = mx::product_exact_min(ea, eb) + d;
      out.push_back({"smallest product", ea, eb, pmin / 2, pmin - pmin / 2, sub_a, sub_b});
      const int pmax = mx::product_exact_max(ea, eb) - d;
      out.push_back({"largest product", ea, eb, pmax / 2, pmax - pmax / 2, max_a, max_b});
    }
  }
  return out;
}

TEST_P(MxGemm, BoundariesOfTheExactRangeGiveTheExactProduct) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_linear, DType::kF32);
  const int64_t m = 2, n = 3, k = 64;
  for (const Boundary& c : boundaries()) {
    MxMatrix a(c.ea, m, k), b(c.eb, n, k);
    auto fill = [](MxMatrix& x, int64_t rows, Elem e, int s, float v) {
      for (int64_t r = 0; r < rows; ++r) {
        x.scales.bytes()[r * 2] = 127;  // block 0: zeros at scale 2^0
        x.scales.bytes()[r * 2 + 1] = static_cast<uint8_t>(s + 127);
        x.codes.bytes()[r * 64 + 32 + 5] = mx::encode(v, e);
      }
    };
    fill(a, m, c.ea, c.sa, c.va);
    fill(b, n, c.eb, c.sb, c.vb);
    const double exact = std::ldexp(static_cast<double>(c.va) * c.vb, c.sa + c.sb);
    OwnedTensor y(DType::kF32, {m, n}), y64(DType::kF64, {m, n});
    test::fast().mx_linear(a.codes, a.scales, b.codes, b.scales, y, false);
    ref::mx_linear(a.codes, a.scales, b.codes, b.scales, y64, false);
    for (int64_t i = 0; i < m * n; ++i) {
      EXPECT_EQ(y64.as<double>()[i], exact) << c.what;
      EXPECT_EQ(y.as<float>()[i], static_cast<float>(exact))
          << c.what << " at s_a " << c.sa << ", s_b " << c.sb << " (" << (c.ea == Elem::kE4M3 ? "e4m3" : "e5m2") << ")";
    }
  }
}

TEST_P(MxGemm, ANaNScaleMakesItsOutputsNaN) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_linear, DType::kF32);
  const MxMatrix a = quantized(spread(4, 64, 8), Elem::kE4M3), b = quantized(spread(5, 64, 9), Elem::kE4M3);
  a.scales.bytes()[2 * 2 + 1] = mx::kScaleNaN;  // row 2, block 1
  OwnedTensor y(DType::kF32, {4, 5});
  test::fast().mx_linear(a.codes, a.scales, b.codes, b.scales, y, false);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(std::isnan(y.as<float>()[i * 5 + j]), i == 2) << i << "," << j;
}

TEST(MxGemmThreads, ResultsDoNotDependOnTheThreadCount) {
  const int saved = omp_get_max_threads();
  const MxMatrix a = quantized(spread(300, 128, 10), Elem::kE4M3), b = quantized(spread(96, 128, 11), Elem::kE4M3);
  a.scales.bytes()[7] = 127 - 120;  // one block outside the exact range: the fp32 path too
  OwnedTensor x = spread(300, 128, 12);
  std::vector<std::vector<unsigned char>> runs;
  for (int threads : {1, 2}) {
    cpu::set_num_threads(threads);
    OwnedTensor y(DType::kF32, {300, 96});
    cpu::mx_linear(a.codes, a.scales, b.codes, b.scales, y, false);
    OwnedTensor rc(DType::kE4M3, {300, 128}), rs(DType::kE8M0, {300, 4}), st(DType::kF64, {4});
    cpu::mx_quantize(x, false, mx::ScaleRule::kRceil, rc, rs, st, Tensor{});
    std::vector<unsigned char> bytes(static_cast<const unsigned char*>(y.t.data),
                                     static_cast<const unsigned char*>(y.t.data) + y.t.nbytes());
    bytes.insert(bytes.end(), rc.bytes(), rc.bytes() + rc.t.nbytes());
    bytes.insert(bytes.end(), reinterpret_cast<unsigned char*>(st.t.data),
                 reinterpret_cast<unsigned char*>(st.t.data) + 32);
    runs.push_back(bytes);
  }
  cpu::set_num_threads(saved);
  EXPECT_TRUE(runs[0] == runs[1]);
}

}  // namespace
}  // namespace moe
