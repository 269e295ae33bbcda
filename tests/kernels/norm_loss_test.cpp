// RMSNorm and fused cross-entropy: each backend under test against ref, ref f64 gradients
// against central finite differences, bitwise independence of the thread count, in-place
// cross-entropy, bad labels; and a printed throughput of each backend (never fails on speed).
// Error measure (test_util.h): max|a - b| / max|b|. Fast f32 kernels are compared with the ref
// f64 path on the same (f32-representable) inputs, so the bound is the f32 kernel's own error.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

using test::clone;
using test::get;
using test::poison;
using test::rel_error;
using test::set;
using test::dot;
using test::numeric_grad;
using test::random_tensor;

// max|a - b|, +inf if either holds a NaN.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = std::fabs(get(a, i) - get(b, i));
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    m = std::max(m, d);
  }
  return m;
}

template <class F> void with_threads(int n, F&& f) {
  const int saved = cpu::num_threads();
  cpu::set_num_threads(n);
  f();
  cpu::set_num_threads(saved);
}

struct Shape2 {
  int64_t n, c;
};

MOE_BACKEND_SUITE(RmsNorm);
MOE_BACKEND_SUITE(CrossEntropy);
MOE_BACKEND_SUITE(ElemThroughput);

// ---------------------------------------------------------------- RMSNorm
TEST_P(RmsNorm, ForwardMatchesRef) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  uint64_t salt = 0;
  for (Shape2 s : {Shape2{1, 1}, Shape2{3, 7}, Shape2{17, 33}, Shape2{64, 512}, Shape2{5, 1000}}) {
    SCOPED_TRACE("shape " + std::to_string(s.n) + "x" + std::to_string(s.c));
    OwnedTensor x = random_tensor(DType::kF32, {s.n, s.c}, ++salt, -2, 2);
    OwnedTensor w = random_tensor(DType::kF32, {s.c}, ++salt, 0.5, 1.5);
    OwnedTensor x64 = clone(x, DType::kF64), w64 = clone(w, DType::kF64);
    OwnedTensor y(DType::kF32, {s.n, s.c}), r(DType::kF32, {s.n});
    OwnedTensor y64(DType::kF64, {s.n, s.c}), r64(DType::kF64, {s.n});
    poison(y), poison(r);
    test::fast().rmsnorm_fwd(x, w, 1e-5, y, r);
    ref::rmsnorm_fwd(x64, w64, 1e-5, y64, r64);
    // rstd: the fp32 sum of C squares (16 lanes, error ~ sqrt(C/16) 2^-24 relative, a few 1e-7
    // at C = 1000) plus sqrt and divide; y adds two more roundings. Measured <= 2e-7; 1e-6.
    EXPECT_LT(rel_error(r, r64), 1e-6);
    EXPECT_LT(rel_error(y, y64), 1e-6);
    // f64 through the backend (the cpu kernels): same math in double, only the summation order
    // differs. Not on a backend without f64 (cuda: tests/kernels/expected_skips.txt).
    if (!test::fast_device().supports(OpId::rmsnorm_fwd, DType::kF64)) continue;
    OwnedTensor yc(DType::kF64, {s.n, s.c}), rc(DType::kF64, {s.n});
    poison(yc), poison(rc);
    test::fast().rmsnorm_fwd(x64, w64, 1e-5, yc, rc);
    EXPECT_LT(rel_error(yc, y64), 1e-14);
    EXPECT_LT(rel_error(rc, r64), 1e-14);
  }
}

TEST_P(RmsNorm, BackwardMatchesRef) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  uint64_t salt = 100;
  for (Shape2 s : {Shape2{1, 1}, Shape2{3, 7}, Shape2{37, 33}, Shape2{64, 512}, Shape2{5, 1000}}) {
    SCOPED_TRACE("shape " + std::to_string(s.n) + "x" + std::to_string(s.c));
    OwnedTensor x = random_tensor(DType::kF32, {s.n, s.c}, ++salt, -2, 2);
    OwnedTensor w = random_tensor(DType::kF32, {s.c}, ++salt, 0.5, 1.5);
    OwnedTensor dy = random_tensor(DType::kF32, {s.n, s.c}, ++salt);
    OwnedTensor dw = random_tensor(DType::kF32, {s.c}, ++salt);  // dw accumulates
    OwnedTensor dw0 = clone(dw);
    OwnedTensor x64 = clone(x, DType::kF64), w64 = clone(w, DType::kF64);
    OwnedTensor dy64 = clone(dy, DType::kF64), dw64 = clone(dw, DType::kF64);
    OwnedTensor y64(DType::kF64, {s.n, s.c}), r64(DType::kF64, {s.n});
    ref::rmsnorm_fwd(x64, w64, 1e-5, y64, r64);
    OwnedTensor r = clone(r64, DType::kF32);  // the same rstd for both paths
    OwnedTensor dx(DType::kF32, {s.n, s.c}), dx64(DType::kF64, {s.n, s.c});
    poison(dx);
    test::fast().rmsnorm_bwd(dy, x, w, r, dx, dw, false);
    ref::rmsnorm_bwd(dy64, x64, w64, r64, dx64, dw64, false);
    // dx = rs w dy - (rs^3 dot / C) x. The two terms cancel (completely as C -> 1: a 1-wide
    // RMSNorm is sign(x) w), so the error is measured against the size of the first term:
    // max|dx - dx64| / max|rs w dy|. Errors: rstd rounded to f32 (2^-24, cubed in the second
    // term: 3 2^-24), the fp32 dot over C terms (~sqrt(C/16) 2^-24), a few roundings. 2e-6.
    double max_term = 0;
    for (int64_t i = 0; i < s.n * s.c; ++i)
      max_term = std::max(max_term, std::fabs(get(r64, i / s.c) * get(w64, i % s.c) * get(dy64, i)));
    EXPECT_LT(max_abs_diff(dx, dx64) / max_term, 2e-6);
    // dw = dw0 + sum_r dy x rs: per-chunk fp32 sums of 16 rows, combined in double; rstd
    // rounded to f32. The sum may cancel against dw0 (a 1x1 case does), so the error is
    // measured against max_j (|dw0_j| + sum_r |dy x rs|): a few 2^-24 (measured <= 2e-7). 1e-6.
    double dw_scale = 0;
    for (int64_t j = 0; j < s.c; ++j) {
      double t = std::fabs(get(dw0, j));
      for (int64_t i = 0; i < s.n; ++i)
        t += std::fabs(get(dy64, i * s.c + j) * get(x64, i * s.c + j) * get(r64, i));
      dw_scale = std::max(dw_scale, t);
    }
    EXPECT_LT(max_abs_diff(dw, dw64) / dw_scale, 1e-6);
    // f64 in the backend (the cpu kernels); not on a backend without it (cuda).
    if (!test::fast_device().supports(OpId::rmsnorm_bwd, DType::kF64)) continue;
    OwnedTensor dxc(DType::kF64, {s.n, s.c});
    OwnedTensor dwc = clone(dw, DType::kF64);
    OwnedTensor dwr = clone(dw, DType::kF64);
    poison(dxc);
    test::fast().rmsnorm_bwd(dy64, x64, w64, r64, dxc, dwc, false);
    ref::rmsnorm_bwd(dy64, x64, w64, r64, dx64, dwr, false);
    // dx cancels (a 1x1 case to ~eps / (x^2 + eps) of its terms): measured against the terms,
    // as above, since the two paths may contract a*b - c differently (cpu kernels build with
    // -ffp-contract=off, see CMakeLists.txt).
    EXPECT_LT(max_abs_diff(dxc, dx64) / max_term, 1e-13);
    EXPECT_LT(rel_error(dwc, dwr), 1e-13);
  }
}

// bf16 mode saves the QK-norm's input in bf16: the backward from it is bitwise the backward from
// its values widened to f32 (dx in f32 or rounded to bf16, dw accumulated), on the backend and on
// the reference.
TEST_P(RmsNorm, BackwardFromABf16InputIsTheWidenedInputsBitwise) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  uint64_t salt = 300;
  for (Shape2 s : {Shape2{1, 1}, Shape2{37, 33}, Shape2{64, 512}}) {
    SCOPED_TRACE("shape " + std::to_string(s.n) + "x" + std::to_string(s.c));
    const OwnedTensor x16 = clone(random_tensor(DType::kF32, {s.n, s.c}, ++salt, -2, 2), DType::kBF16);
    const OwnedTensor xw = clone(x16, DType::kF32);
    const OwnedTensor w = random_tensor(DType::kF32, {s.c}, ++salt, 0.5, 1.5);
    const OwnedTensor dy = random_tensor(DType::kF32, {s.n, s.c}, ++salt);
    const OwnedTensor r = random_tensor(DType::kF32, {s.n}, ++salt, 0.5, 2);
    const OwnedTensor dw0 = random_tensor(DType::kF32, {s.c}, ++salt);
    for (const DType out : {DType::kF32, DType::kBF16}) {
      OwnedTensor dx_a(out, {s.n, s.c}), dx_b(out, {s.n, s.c}), dw_a = clone(dw0), dw_b = clone(dw0);
      poison(dx_a);
      poison(dx_b);
      test::fast().rmsnorm_bwd(dy, xw, w, r, dx_a, dw_a, false);
      test::fast().rmsnorm_bwd(dy, x16, w, r, dx_b, dw_b, false);
      EXPECT_TRUE(test::bitwise_equal(dx_a, dx_b));
      EXPECT_TRUE(test::bitwise_equal(dw_a, dw_b));
      OwnedTensor dx_r(out, {s.n, s.c}), dw_r = clone(dw0), dx_rw(out, {s.n, s.c}), dw_rw = clone(dw0);
      ref::rmsnorm_bwd(dy, xw, w, r, dx_rw, dw_rw, false);
      ref::rmsnorm_bwd(dy, x16, w, r, dx_r, dw_r, false);
      EXPECT_TRUE(test::bitwise_equal(dx_r, dx_rw));
      EXPECT_TRUE(test::bitwise_equal(dw_r, dw_rw));
    }
  }
}

TEST(RmsNormRef, GradientsMatchFiniteDifferences) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  const int64_t n = 3, c = 7;
  OwnedTensor x = random_tensor(DType::kF64, {n, c}, 201, -2, 2);
  OwnedTensor w = random_tensor(DType::kF64, {c}, 202, 0.5, 1.5);
  OwnedTensor rw = random_tensor(DType::kF64, {n, c}, 203);  // loss = sum(y * rw)
  OwnedTensor y(DType::kF64, {n, c}), r(DType::kF64, {n});
  auto loss = [&] {
    ref::rmsnorm_fwd(x, w, 1e-3, y, r);
    return dot(y, rw);
  };
  loss();
  OwnedTensor dx(DType::kF64, {n, c}), dw(DType::kF64, {c});
  ref::fill(dw, 0);
  ref::rmsnorm_bwd(rw, x, w, r, dx, dw, false);
  const double ex = rel_error(dx, numeric_grad(x, loss));
  const double ew = rel_error(dw, numeric_grad(w, loss));
  EXPECT_LT(ex, 1e-7);
  EXPECT_LT(ew, 1e-7);
}

TEST_P(RmsNorm, BitwiseIndependentOfThreadCount) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  const int64_t n = 203, c = 257;  // 13 row chunks, odd width, above the parallel threshold
  OwnedTensor x = random_tensor(DType::kF32, {n, c}, 301, -2, 2);
  OwnedTensor w = random_tensor(DType::kF32, {c}, 302, 0.5, 1.5);
  OwnedTensor dy = random_tensor(DType::kF32, {n, c}, 303);
  std::vector<OwnedTensor> ys, rs, dxs, dws;
  for (int threads : {1, 2, 3}) {
    with_threads(threads, [&] {
      OwnedTensor y(DType::kF32, {n, c}), r(DType::kF32, {n}), dx(DType::kF32, {n, c});
      OwnedTensor dw = random_tensor(DType::kF32, {c}, 304);
      test::fast().rmsnorm_fwd(x, w, 1e-5, y, r);
      test::fast().rmsnorm_bwd(dy, x, w, r, dx, dw, false);
      ys.push_back(std::move(y)), rs.push_back(std::move(r));
      dxs.push_back(std::move(dx)), dws.push_back(std::move(dw));
    });
  }
  for (size_t i = 1; i < ys.size(); ++i) {
    EXPECT_TRUE(test::bitwise_equal(ys[i], ys[0]));
    EXPECT_TRUE(test::bitwise_equal(rs[i], rs[0]));
    EXPECT_TRUE(test::bitwise_equal(dxs[i], dxs[0]));
    EXPECT_TRUE(test::bitwise_equal(dws[i], dws[0]));
  }
}

// ---------------------------------------------------------------- cross-entropy
// Labels in [0, V) with every 4th row unlabeled (-1).
OwnedTensor make_labels(int64_t n, int64_t vocab, uint64_t salt) {
  OwnedTensor lab(DType::kI32, {n});
  test::fill_ids(lab, test::test_seed(), salt, static_cast<int32_t>(vocab));
  for (int64_t r = 0; r < n; r += 4) set(lab, r, -1);
  return lab;
}

TEST_P(CrossEntropy, MatchesRef) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  uint64_t salt = 400;
  for (Shape2 s : {Shape2{1, 1}, Shape2{3, 5}, Shape2{9, 1000}, Shape2{6, 50304}}) {
    SCOPED_TRACE("shape " + std::to_string(s.n) + "x" + std::to_string(s.c));
    OwnedTensor x = random_tensor(DType::kF32, {s.n, s.c}, ++salt, -8, 8);
    OwnedTensor lab = make_labels(s.n, s.c, ++salt);
    set(lab, s.n - 1, static_cast<double>(s.c - 1));  // the last label is labeled, at V-1
    OwnedTensor x64 = clone(x, DType::kF64);
    OwnedTensor d(DType::kF32, {s.n, s.c}), ce(DType::kF32, {s.n}), z(DType::kF32, {s.n});
    OwnedTensor d64(DType::kF64, {s.n, s.c}), ce64(DType::kF64, {s.n}), z64(DType::kF64, {s.n});
    poison(d), poison(ce), poison(z);
    const double scale = 0.37, zc = 1e-2;
    test::fast().cross_entropy(x, lab, scale, zc, d, ce, z);
    ref::cross_entropy(x64, lab, scale, zc, d64, ce64, z64);
    // lse: fp32 max, a 16-lane fp32 sum of V exponentials (fast_exp ~2 ulp, the sum ~sqrt(V/16)
    // 2^-24 relative) and a log. A sum near 1 (a confident row) is known to 2^-24 absolute, so
    // ce near 0 carries ~1e-7 absolute: errors relative to max(max|ref|, 1). Measured <= 3e-7
    // (ce) and 6e-7 (z = lse^2, up to ~100) over 60 seeds; 1e-6 and 2e-6.
    double ce_ref = 1, z_ref = 1;
    for (int64_t r = 0; r < s.n; ++r) {
      ce_ref = std::max(ce_ref, std::fabs(get(ce64, r)));
      z_ref = std::max(z_ref, std::fabs(get(z64, r)));
    }
    EXPECT_LT(max_abs_diff(ce, ce64) / ce_ref, 1e-6);
    EXPECT_LT(max_abs_diff(z, z64) / z_ref, 2e-6);
    // dlogits: exp(x - max) (a few ulp) times one coefficient carrying the sum's error. An f32
    // probability near 1 is only known to 2^-24 absolute, so the natural scale of the error is
    // loss_scale (|dlogit| <= scale (1 + 2 z |lse|)), not max|dlogits|, which is tiny when every
    // labeled row is confident (small V). Error relative to max(max|d64|, scale): measured
    // <= 1.7e-7 over 40 seeds; 1e-6.
    double max_ref = scale;
    for (int64_t i = 0; i < s.n * s.c; ++i) max_ref = std::max(max_ref, std::fabs(get(d64, i)));
    EXPECT_LT(max_abs_diff(d, d64) / max_ref, 1e-6);
    for (int64_t r = 0; r < s.n; ++r) {
      if (get(lab, r) >= 0) continue;
      EXPECT_EQ(get(ce, r), 0.0);
      EXPECT_EQ(get(z, r), 0.0);
      for (int64_t j = 0; j < s.c; ++j) ASSERT_EQ(get(d, r * s.c + j), 0.0) << "row " << r;
    }
    // f64 through the backend (the cpu kernels) against ref f64: libm exp in both, only the summation order differs.
    // Not on a backend without f64 (cuda: tests/kernels/expected_skips.txt).
    if (!test::fast_device().supports(OpId::cross_entropy, DType::kF64)) continue;
    OwnedTensor dc(DType::kF64, {s.n, s.c}), cec(DType::kF64, {s.n}), zcc(DType::kF64, {s.n});
    poison(dc);
    test::fast().cross_entropy(x64, lab, scale, zc, dc, cec, zcc);
    EXPECT_LT(rel_error(dc, d64), 1e-13);
    // ce = lse - x[label] is a difference of two numbers up to ~|lse| (here <= ~10): near 0 (every
    // row confident, as a 3 x 5 draw can be) it carries ~|lse| 2^-52 absolute, so relative to
    // max(max|ref|, 1) as the fp32 checks above. Measured over 13 seeds (MOE_CE_PRINT_ERRORS=1):
    // <= 1.1e-15 so; relative to max|ce| alone the 3 x 5 draw of seed 1412082244525624606 (every
    // row confident) gave 2.05e-13 for an absolute error of 3.6e-16.
    EXPECT_LT(max_abs_diff(cec, ce64) / ce_ref, 1e-13);
    EXPECT_LT(max_abs_diff(zcc, z64) / z_ref, 1e-13);
    if (std::getenv("MOE_CE_PRINT_ERRORS"))
      printf("%lldx%lld f64: d %.2e ce %.2e (of max|ce| %.2e) z %.2e\n", static_cast<long long>(s.n),
             static_cast<long long>(s.c), rel_error(dc, d64), max_abs_diff(cec, ce64) / ce_ref, rel_error(cec, ce64),
             max_abs_diff(zcc, z64) / z_ref);
  }
}

TEST_P(CrossEntropy, InPlaceMatchesOutOfPlace) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  const int64_t n = 13, v = 3001;
  OwnedTensor x = random_tensor(DType::kF32, {n, v}, 501, -5, 5);
  OwnedTensor lab = make_labels(n, v, 502);
  OwnedTensor d(DType::kF32, {n, v}), ce(DType::kF32, {n}), z(DType::kF32, {n});
  OwnedTensor ce2(DType::kF32, {n}), z2(DType::kF32, {n});
  test::fast().cross_entropy(x, lab, 1.0, 1e-4, d, ce, z);
  OwnedTensor inplace = clone(x);
  test::fast().cross_entropy(inplace, lab, 1.0, 1e-4, inplace, ce2, z2);
  EXPECT_TRUE(test::bitwise_equal(inplace, d));
  EXPECT_TRUE(test::bitwise_equal(ce2, ce));
  EXPECT_TRUE(test::bitwise_equal(z2, z));
  // The reference too, in f64.
  OwnedTensor x64 = clone(x, DType::kF64), d64(DType::kF64, {n, v});
  OwnedTensor c64(DType::kF64, {n}), z64(DType::kF64, {n});
  ref::cross_entropy(x64, lab, 1.0, 1e-4, d64, c64, z64);
  ref::cross_entropy(x64, lab, 1.0, 1e-4, x64, c64, z64);
  EXPECT_TRUE(test::bitwise_equal(x64, d64));
}

TEST(CrossEntropyRef, GradientMatchesFiniteDifferences) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  const int64_t n = 5, v = 11;
  OwnedTensor x = random_tensor(DType::kF64, {n, v}, 601, -3, 3);
  OwnedTensor lab = make_labels(n, v, 602);  // rows 0 and 4 unlabeled
  const double scale = 0.7, zc = 0.3;        // a large z coefficient so its term shows
  OwnedTensor d(DType::kF64, {n, v}), ce(DType::kF64, {n}), z(DType::kF64, {n});
  auto loss = [&] {
    ref::cross_entropy(x, lab, scale, zc, d, ce, z);
    double l = 0;
    for (int64_t r = 0; r < n; ++r) l += scale * (get(ce, r) + zc * get(z, r));
    return l;
  };
  OwnedTensor num = numeric_grad(x, loss);
  loss();
  EXPECT_LT(rel_error(d, num), 1e-7);
  // ce against a direct evaluation of -log softmax.
  for (int64_t r = 0; r < n; ++r) {
    const int64_t l = static_cast<int64_t>(get(lab, r));
    if (l < 0) continue;
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(get(x, r * v + j));
    EXPECT_NEAR(get(ce, r), std::log(s) - get(x, r * v + l), 1e-12);
    EXPECT_NEAR(get(z, r), std::log(s) * std::log(s), 1e-11);
  }
}

TEST_P(CrossEntropy, OutOfRangeLabelThrows) {
  const int64_t n = 4, v = 10;
  for (bool use_fast : {false, true}) {
    OwnedTensor x(DType::kF32, {n, v}), d(DType::kF32, {n, v});
    OwnedTensor ce(DType::kF32, {n}), z(DType::kF32, {n}), lab(DType::kI32, {n});
    test::fast().fill(x, 0.5);
    for (int64_t r = 0; r < n; ++r) set(lab, r, static_cast<double>(r));
    set(lab, 2, 10.0);
    try {
      if (use_fast) test::fast().cross_entropy(x, lab, 1, 0, d, ce, z);
      else ref::cross_entropy(x, lab, 1, 0, d, ce, z);
      ADD_FAILURE() << "no error for label 10 with V = 10";
    } catch (const Error& e) {
      // cuda checks the labels on the device: the row is the index of its error.
      EXPECT_TRUE(test::says(e.what(), use_fast ? test::fast_device().name() : "ref", {"row 2", "label 10"},
                             {"cross_entropy: invalid value 10 at index 2"}));
    }
  }
}

TEST_P(CrossEntropy, BitwiseIndependentOfThreadCount) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  const int64_t n = 11, v = 5003;
  OwnedTensor x = random_tensor(DType::kF32, {n, v}, 701, -6, 6);
  OwnedTensor lab = make_labels(n, v, 702);
  std::vector<OwnedTensor> ds, ces, zs;
  for (int threads : {1, 2, 3}) {
    with_threads(threads, [&] {
      OwnedTensor d(DType::kF32, {n, v}), ce(DType::kF32, {n}), z(DType::kF32, {n});
      test::fast().cross_entropy(x, lab, 0.5, 1e-4, d, ce, z);
      ds.push_back(std::move(d)), ces.push_back(std::move(ce)), zs.push_back(std::move(z));
    });
  }
  for (size_t i = 1; i < ds.size(); ++i) {
    EXPECT_TRUE(test::bitwise_equal(ds[i], ds[0]));
    EXPECT_TRUE(test::bitwise_equal(ces[i], ces[0]));
    EXPECT_TRUE(test::bitwise_equal(zs[i], zs[0]));
  }
}

// ---------------------------------------------------------------- throughput (printed only)
// Prints GB/s (bytes that must cross memory once: reads + writes) for the shapes of a small
// model; never fails on speed. The tensors live on the backend under test, uploaded once, and
// the clock stops after a synchronize: what is timed is the ops on the backend's stream, not the
// staging copies test::fast() makes around every call.
TEST_P(ElemThroughput, PrintRmsNormAndCrossEntropy) {
  using clock = std::chrono::steady_clock;
  Backend& b = test::fast_device();
  auto fill_fast = [&](const Tensor& t, float amp) {
    std::vector<float> p(static_cast<size_t>(t.numel()));
    uint32_t s = 12345;
    for (float& e : p) {
      s = s * 1664525u + 1013904223u;
      e = amp * (static_cast<float>(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
    }
    b.upload(p.data(), t);
  };
  auto time_it = [&](int iters, const std::function<void()>& f) {
    f();  // warm-up (page faults, scratch)
    b.synchronize();
    auto t0 = clock::now();
    for (int i = 0; i < iters; ++i) f();
    b.synchronize();
    return std::chrono::duration<double>(clock::now() - t0).count() / iters;
  };
  {
    const int64_t n = 4096, c = 512;
    OwnedTensor x(b, DType::kF32, {n, c}), w(b, DType::kF32, {c}), y(b, DType::kF32, {n, c});
    OwnedTensor r(b, DType::kF32, {n}), dy(b, DType::kF32, {n, c}), dx(b, DType::kF32, {n, c});
    OwnedTensor dw(b, DType::kF32, {c});
    fill_fast(x, 4), fill_fast(w, 1), fill_fast(dy, 1), b.fill(dw, 0);
    const double bytes = 4.0 * n * c;
    const double tf = time_it(20, [&] { b.rmsnorm_fwd(x, w, 1e-5, y, r); });
    const double tb = time_it(20, [&] { b.rmsnorm_bwd(dy, x, w, r, dx, dw, false); });
    std::printf("[ throughput ] %s rmsnorm %ldx%ld, %d threads: fwd %.3f ms = %.1f GB/s, "
                "bwd %.3f ms = %.1f GB/s\n", b.name(), static_cast<long>(n), static_cast<long>(c),
                cpu::num_threads(), tf * 1e3, 2 * bytes / tf / 1e9, tb * 1e3,
                3 * bytes / tb / 1e9);
  }
  {
    const int64_t n = 1024, v = 50304;
    OwnedTensor x(b, DType::kF32, {n, v}), lab(b, DType::kI32, {n});
    OwnedTensor ce(b, DType::kF32, {n}), z(b, DType::kF32, {n});
    fill_fast(x, 10);
    std::vector<int32_t> labels(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) labels[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7919) % v);
    b.upload(labels.data(), lab);
    // In place (the training layout): a rerun treats the previous dlogits as logits.
    const double t = time_it(3, [&] { b.cross_entropy(x, lab, 1.0, 1e-4, x, ce, z); });
    std::printf("[ throughput ] %s cross_entropy %ldx%ld in place, %d threads: %.2f ms = %.1f "
                "GB/s\n", b.name(), static_cast<long>(n), static_cast<long>(v), cpu::num_threads(),
                t * 1e3, 2 * 4.0 * n * v / t / 1e9);
  }
}

}  // namespace
}  // namespace moe
