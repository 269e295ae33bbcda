// Embedding, RoPE, SwiGLU, sum_to/sumsq_to, axpy/scale/fill/convert and AdamW: each backend
// under test against ref, ref f64 gradients against central finite differences, thread-count
// independence.
// Error measure (test_util.h): max|a - b| / max|b|.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

template <class F> void with_threads(int n, F&& f) {
  const int saved = cpu::num_threads();
  cpu::set_num_threads(n);
  f();
  cpu::set_num_threads(saved);
}

#define SEED_TRACE() SCOPED_TRACE("seed " + std::to_string(test::test_seed()))

MOE_BACKEND_SUITE(Embedding);
MOE_BACKEND_SUITE(Rope);
MOE_BACKEND_SUITE(SwiGlu);
MOE_BACKEND_SUITE(SumTo);
MOE_BACKEND_SUITE(Pointwise);
MOE_BACKEND_SUITE(Convert);
MOE_BACKEND_SUITE(AdamW);

// ---------------------------------------------------------------- embedding
// Ids drawn from a small range so that rows repeat.
OwnedTensor repeated_ids(int64_t n, int32_t range, uint64_t salt) {
  OwnedTensor ids(DType::kI32, {n});
  test::fill_ids(ids, test::test_seed(), salt, range);
  return ids;
}

TEST_P(Embedding, MatchesRefBitwise) {
  SEED_TRACE();
  struct Case { int64_t t, v, d; };
  uint64_t salt = 0;
  for (Case c : {Case{1, 1, 1}, Case{7, 5, 3}, Case{300, 37, 129}, Case{64, 1000, 512}}) {
    SCOPED_TRACE("T " + std::to_string(c.t) + " V " + std::to_string(c.v) + " D " +
                 std::to_string(c.d));
    for (DType dt : {DType::kF32, DType::kF64}) {
      // f64 where the backend has it (the cuda one does not: tests/kernels/expected_skips.txt).
      if (!test::fast_device().supports(OpId::embedding_fwd, dt) ||
          !test::fast_device().supports(OpId::embedding_bwd, dt))
        continue;
      OwnedTensor ids = repeated_ids(c.t, static_cast<int32_t>(std::min<int64_t>(c.v, 9)), ++salt);
      OwnedTensor table = random_tensor(dt, {c.v, c.d}, ++salt);
      OwnedTensor y(dt, {c.t, c.d}), yr(dt, {c.t, c.d});
      poison(y);
      test::fast().embedding_fwd(ids, table, y);
      ref::embedding_fwd(ids, table, yr);
      EXPECT_TRUE(test::bitwise_equal(y, yr));  // a copy
      // Backward: both add each row's tokens in token order from the same start: bitwise.
      OwnedTensor dy = random_tensor(dt, {c.t, c.d}, ++salt);
      OwnedTensor dt_fast = random_tensor(dt, {c.v, c.d}, ++salt);
      OwnedTensor dt_ref = clone(dt_fast);
      test::fast().embedding_bwd(ids, dy, dt_fast, -1);
      ref::embedding_bwd(ids, dy, dt_ref, -1);
      EXPECT_TRUE(test::bitwise_equal(dt_fast, dt_ref));
      // With a pad id: its row is untouched (bitwise its start), every other row as before.
      const int32_t pad = static_cast<int32_t>(get(ids, 0));
      OwnedTensor start = random_tensor(dt, {c.v, c.d}, ++salt);
      OwnedTensor pad_fast = clone(start), pad_ref = clone(start), nopad = clone(start);
      test::fast().embedding_bwd(ids, dy, pad_fast, pad);
      ref::embedding_bwd(ids, dy, pad_ref, pad);
      test::fast().embedding_bwd(ids, dy, nopad, -1);
      EXPECT_TRUE(test::bitwise_equal(pad_fast, pad_ref));
      for (int64_t row = 0; row < c.v; ++row)
        EXPECT_EQ(std::memcmp(static_cast<char*>(pad_fast.t.data) + row * c.d * dtype_size(dt),
                              static_cast<char*>((row == pad ? start : nopad).t.data) + row * c.d * dtype_size(dt),
                              static_cast<size_t>(c.d) * dtype_size(dt)), 0)
            << "row " << row << (row == pad ? " (pad)" : "");
    }
  }
  // bf16 tables: the forward is a row copy for any float dtype.
  OwnedTensor ids = repeated_ids(33, 20, 50);
  OwnedTensor table = random_tensor(DType::kBF16, {20, 24}, 51);
  OwnedTensor y(DType::kBF16, {33, 24});
  test::fast().embedding_fwd(ids, table, y);
  for (int64_t t = 0; t < 33; ++t)
    EXPECT_EQ(std::memcmp(static_cast<bf16*>(y.t.data) + t * 24,
                          static_cast<bf16*>(table.t.data) + static_cast<int64_t>(get(ids, t)) * 24,
                          48), 0);
}

TEST_P(Embedding, BadIdThrows) {
  OwnedTensor ids(DType::kI32, {3}), table(DType::kF32, {4, 2}), y(DType::kF32, {3, 2});
  set(ids, 0, 1), set(ids, 1, 4), set(ids, 2, 0);
  EXPECT_THROW(test::fast().embedding_fwd(ids, table, y), Error);
  EXPECT_THROW(ref::embedding_fwd(ids, table, y), Error);
  set(ids, 1, -1);
  EXPECT_THROW(test::fast().embedding_bwd(ids, y, table, -1), Error);
  EXPECT_THROW(ref::embedding_bwd(ids, y, table, -1), Error);
}

TEST(EmbeddingRef, GradientMatchesFiniteDifferences) {
  SEED_TRACE();
  const int64_t t = 9, v = 4, d = 3;
  OwnedTensor ids = repeated_ids(t, static_cast<int32_t>(v), 60);
  OwnedTensor table = random_tensor(DType::kF64, {v, d}, 61);
  OwnedTensor rw = random_tensor(DType::kF64, {t, d}, 62);
  OwnedTensor y(DType::kF64, {t, d}), g(DType::kF64, {v, d});
  auto loss = [&] {
    ref::embedding_fwd(ids, table, y);
    return dot(y, rw);
  };
  ref::fill(g, 0);
  ref::embedding_bwd(ids, rw, g, -1);
  EXPECT_LT(rel_error(g, numeric_grad(table, loss)), 1e-9);  // linear: only rounding remains
}

TEST_P(Embedding, BackwardBitwiseIndependentOfThreadCount) {
  SEED_TRACE();
  const int64_t t = 500, v = 50, d = 300;  // many repeats per row; d not a multiple of 16
  OwnedTensor ids = repeated_ids(t, 50, 70);
  OwnedTensor dy = random_tensor(DType::kF32, {t, d}, 71);
  std::vector<OwnedTensor> outs;
  for (int threads : {1, 2, 3, 7}) {
    with_threads(threads, [&] {
      OwnedTensor g = random_tensor(DType::kF32, {v, d}, 72);
      test::fast().embedding_bwd(ids, dy, g, 3);  // a pad id too: skipping tokens keeps the order
      outs.push_back(std::move(g));
    });
  }
  for (size_t i = 1; i < outs.size(); ++i) EXPECT_TRUE(test::bitwise_equal(outs[i], outs[0]));
}

// ---------------------------------------------------------------- RoPE
struct Shape4 {
  int64_t b, s, h, d;
};

TEST_P(Rope, MatchesRef) {
  SEED_TRACE();
  uint64_t salt = 100;
  for (Shape4 s : {Shape4{1, 1, 1, 2}, Shape4{2, 5, 3, 8}, Shape4{1, 300, 2, 64},
                   Shape4{2, 33, 4, 128}}) {
    SCOPED_TRACE("shape " + std::to_string(s.b) + "," + std::to_string(s.s) + "," +
                 std::to_string(s.h) + "," + std::to_string(s.d));
    for (bool inverse : {false, true}) {
      OwnedTensor x = random_tensor(DType::kF32, {s.b, s.s, s.h, s.d}, ++salt);
      OwnedTensor x64 = clone(x, DType::kF64), xr = clone(x);
      inverse ? test::fast().rope_bwd(x, 10000.0, s.d) : test::fast().rope_fwd(x, 10000.0, s.d);
      inverse ? ref::rope_bwd(x64, 10000.0, s.d) : ref::rope_fwd(x64, 10000.0, s.d);
      inverse ? ref::rope_bwd(xr, 10000.0, s.d) : ref::rope_fwd(xr, 10000.0, s.d);
      // cos/sin are the f64 values rounded to f32 (<= 2^-24 relative each), then two products
      // and a sum in f32: a few 2^-24 ~ 1e-7 relative to max|x|. 5e-7.
      EXPECT_LT(rel_error(x, x64), 5e-7);
      // Same table and the same operations as ref f32 (up to FMA contraction).
      EXPECT_LT(rel_error(x, xr), 1e-6);
    }
  }
  // f64 through the backend (the cpu kernels): its table comes from angle-sum formulas for
  // positions >= 64 (~2 ulp of double against libm on the direct angle); the rotation is the same.
  // Not on a backend without f64 (cuda: tests/kernels/expected_skips.txt).
  if (!test::fast_device().supports(OpId::rope_fwd, DType::kF64)) return;
  OwnedTensor a = random_tensor(DType::kF64, {2, 300, 2, 16}, 150), b = clone(a);
  test::fast().rope_fwd(a, 500000.0, 16);
  ref::rope_fwd(b, 500000.0, 16);
  EXPECT_LT(rel_error(a, b), 1e-14);
}

// A backend may keep its cos/sin table between calls (the cpu one keeps the last): each call
// still rotates by its own theta, length and rotary dims, in any order, and a repeated call
// gives the same bits.
TEST_P(Rope, EachCallUsesItsOwnThetaLengthAndRotaryDims) {
  SEED_TRACE();
  struct Call {
    double theta;
    int64_t s, rd;
  };
  const Call calls[] = {{10000.0, 40, 32}, {500000.0, 40, 32}, {10000.0, 72, 32}, {10000.0, 40, 16}, {10000.0, 40, 32}};
  OwnedTensor first;
  for (const Call& c : calls) {
    SCOPED_TRACE("theta " + std::to_string(c.theta) + ", S " + std::to_string(c.s) + ", rd " + std::to_string(c.rd));
    OwnedTensor x = random_tensor(DType::kF32, {2, c.s, 3, 32}, 190), x64 = clone(x, DType::kF64);
    test::fast().rope_fwd(x, c.theta, c.rd);
    ref::rope_fwd(x64, c.theta, c.rd);
    EXPECT_LT(rel_error(x, x64), 5e-7);  // as MatchesRef
    if (&c == &calls[0]) {
      first = clone(x);
    } else if (&c == &calls[4]) {
      EXPECT_TRUE(test::bitwise_equal(x, first));
    }
  }
}

TEST_P(Rope, BackwardInvertsForward) {
  SEED_TRACE();
  OwnedTensor x = random_tensor(DType::kF64, {2, 40, 3, 32}, 160), x0 = clone(x);
  ref::rope_fwd(x, 10000.0, 32);
  ref::rope_bwd(x, 10000.0, 32);
  EXPECT_LT(rel_error(x, x0), 1e-15);  // cos^2 + sin^2 = 1 to rounding
  OwnedTensor y = random_tensor(DType::kF32, {2, 40, 3, 32}, 161), y0 = clone(y);
  test::fast().rope_fwd(y, 10000.0, 32);
  test::fast().rope_bwd(y, 10000.0, 32);
  EXPECT_LT(rel_error(y, y0), 1e-6);  // cos/sin rounded to f32, four f32 roundings
}

TEST(RopeRef, GradientMatchesFiniteDifferences) {
  SEED_TRACE();
  OwnedTensor x = random_tensor(DType::kF64, {2, 4, 2, 6}, 170);
  OwnedTensor rw = random_tensor(DType::kF64, {2, 4, 2, 6}, 171);
  auto loss = [&] {
    OwnedTensor y = clone(x);
    ref::rope_fwd(y, 100.0, 6);
    return dot(y, rw);
  };
  OwnedTensor g = clone(rw);
  ref::rope_bwd(g, 100.0, 6);  // the gradient of sum(rope(x) * rw) is the inverse rotation of rw
  EXPECT_LT(rel_error(g, numeric_grad(x, loss)), 1e-9);
  // Position 0 is the identity; position 1, frequency 0 rotates by exactly 1 radian.
  OwnedTensor p(DType::kF64, {1, 2, 1, 2});
  set(p, 0, 1), set(p, 1, 0), set(p, 2, 1), set(p, 3, 0);
  ref::rope_fwd(p, 100.0, 2);
  EXPECT_EQ(get(p, 0), 1.0);
  EXPECT_EQ(get(p, 1), 0.0);
  EXPECT_NEAR(get(p, 2), std::cos(1.0), 1e-15);
  EXPECT_NEAR(get(p, 3), std::sin(1.0), 1e-15);
}

// ---------------------------------------------------------------- SwiGLU
TEST_P(SwiGlu, MatchesRef) {
  SEED_TRACE();
  uint64_t salt = 200;
  for (auto dims : {std::vector<int64_t>{1, 1}, {3, 7}, {65, 129}, {64, 1024}}) {
    const int64_t n = dims[0], f = dims[1];
    SCOPED_TRACE("shape " + std::to_string(n) + "x" + std::to_string(f));
    OwnedTensor g = random_tensor(DType::kF32, {n, f}, ++salt, -12, 12);
    OwnedTensor u = random_tensor(DType::kF32, {n, f}, ++salt, -2, 2);
    OwnedTensor dh = random_tensor(DType::kF32, {n, f}, ++salt);
    OwnedTensor g64 = clone(g, DType::kF64), u64 = clone(u, DType::kF64);
    OwnedTensor dh64 = clone(dh, DType::kF64);
    OwnedTensor h(DType::kF32, {n, f}), dg(DType::kF32, {n, f}), du(DType::kF32, {n, f});
    OwnedTensor h64(DType::kF64, {n, f}), dg64(DType::kF64, {n, f}), du64(DType::kF64, {n, f});
    poison(h), poison(dg), poison(du);
    test::fast().swiglu_fwd(g, u, h, Tensor(), Tensor());
    test::fast().swiglu_bwd(dh, g, u, dg, du);
    ref::swiglu_fwd(g64, u64, h64, Tensor(), Tensor());
    ref::swiglu_bwd(dh64, g64, u64, dg64, du64);
    // fast_exp (~2 ulp) then a divide and 1-3 products in f32: a few 2^-24 relative per
    // element (measured <= 2.2e-7 over 40 seeds). 1e-6.
    EXPECT_LT(rel_error(h, h64), 1e-6);
    EXPECT_LT(rel_error(du, du64), 1e-6);
    // dg = dh u (sig + g sig (1 - sig)) is a sum whose two terms cancel near silu's minimum
    // (g ~ -1.28: a 1x1 case drew g = -1.2805, dg = -3.7e-5 from terms of 0.019), so its error is
    // measured against the terms' magnitude |dh u| sig (1 + |g| (1 - sig)), not against dg.
    const auto dg_error = [&](const Tensor& got) {
      double diff = 0, scale = 0;
      for (int64_t i = 0; i < n * f; ++i) {
        const double gi = get(g64, i), sig = 1 / (1 + std::exp(-gi));
        diff = std::max(diff, std::fabs(get(got, i) - get(dg64, i)));
        scale = std::max(scale, std::fabs(get(dh64, i) * get(u64, i)) * sig * (1 + std::fabs(gi) * (1 - sig)));
      }
      return scale > 0 ? diff / scale : diff;
    };
    EXPECT_LT(dg_error(dg), 1e-6);
    // Not on a backend without f64 (cuda: tests/kernels/expected_skips.txt).
    if (!test::fast_device().supports(OpId::swiglu_fwd, DType::kF64) ||
        !test::fast_device().supports(OpId::swiglu_bwd, DType::kF64))
      continue;
    OwnedTensor hc(DType::kF64, {n, f}), dgc(DType::kF64, {n, f}), duc(DType::kF64, {n, f});
    test::fast().swiglu_fwd(g64, u64, hc, Tensor(), Tensor());
    test::fast().swiglu_bwd(dh64, g64, u64, dgc, duc);
    // f64 in the backend (the cpu kernels): libm exp as the ref; dg's 1 - sig is formed
    // differently (e sig).
    EXPECT_LT(rel_error(hc, h64), 1e-15);
    EXPECT_LT(dg_error(dgc), 1e-14);
    EXPECT_LT(rel_error(duc, du64), 1e-15);
  }
}

TEST_P(SwiGlu, BackwardReadsBf16SavedActivations) {
  SEED_TRACE();
  const int64_t n = 33, f = 70;
  OwnedTensor g = random_tensor(DType::kBF16, {n, f}, 260, -8, 8);
  OwnedTensor u = random_tensor(DType::kBF16, {n, f}, 261, -2, 2);
  OwnedTensor dh = random_tensor(DType::kF32, {n, f}, 262);
  // The reference runs in f64 on the same bf16-rounded values, so only the f32 arithmetic of the
  // fast path differs: the 1e-6 bound of MatchesRef applies.
  OwnedTensor g64 = clone(g, DType::kF64), u64 = clone(u, DType::kF64), dh64 = clone(dh, DType::kF64);
  OwnedTensor dg(DType::kF32, {n, f}), du(DType::kF32, {n, f}), dgr(DType::kF32, {n, f}), dur(DType::kF32, {n, f});
  OwnedTensor dg64(DType::kF64, {n, f}), du64(DType::kF64, {n, f});
  poison(dg), poison(du), poison(dgr), poison(dur);
  test::fast().swiglu_bwd(dh, g, u, dg, du);
  ref::swiglu_bwd(dh, g, u, dgr, dur);
  ref::swiglu_bwd(dh64, g64, u64, dg64, du64);
  EXPECT_LT(rel_error(dg, dg64), 1e-6);
  EXPECT_LT(rel_error(du, du64), 1e-6);
  EXPECT_LT(rel_error(dgr, dg64), 1e-6);
  EXPECT_LT(rel_error(dur, du64), 1e-6);
  OwnedTensor bad(DType::kF64, {n, f});
  EXPECT_THROW(test::fast().swiglu_bwd(bad, g, u, dg, du), Error);
}

TEST(SwiGluRef, GradientsMatchFiniteDifferences) {
  SEED_TRACE();
  OwnedTensor g = random_tensor(DType::kF64, {3, 5}, 250, -4, 4);
  OwnedTensor u = random_tensor(DType::kF64, {3, 5}, 251, -2, 2);
  OwnedTensor rw = random_tensor(DType::kF64, {3, 5}, 252);
  OwnedTensor h(DType::kF64, {3, 5}), dg(DType::kF64, {3, 5}), du(DType::kF64, {3, 5});
  auto loss = [&] {
    ref::swiglu_fwd(g, u, h, Tensor(), Tensor());
    return dot(h, rw);
  };
  ref::swiglu_bwd(rw, g, u, dg, du);
  EXPECT_LT(rel_error(dg, numeric_grad(g, loss)), 1e-8);
  EXPECT_LT(rel_error(du, numeric_grad(u, loss)), 1e-8);
}

// ---------------------------------------------------------------- sum_to, sumsq_to
TEST_P(SumTo, MatchesRefAllDtypes) {
  SEED_TRACE();
  uint64_t salt = 300;
  for (int64_t n : {0, 1, 4095, 4096, 4097, 100003}) {
    for (DType dt : {DType::kF32, DType::kF64, DType::kBF16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n));
      OwnedTensor x = random_tensor(dt, {n}, ++salt, -1, 3);
      OwnedTensor a(DType::kF64, {1}), b(DType::kF64, {1}), c(DType::kF64, {1}), d(DType::kF64, {1});
      set(a, 0, 1.5), set(b, 0, 1.5), set(c, 0, -2), set(d, 0, -2);  // outputs accumulate
      test::fast().sum_to(x, 0.25, a);
      ref::sum_to(x, 0.25, b);
      test::fast().sumsq_to(x, c);
      ref::sumsq_to(x, d);
      // Both sum each 4096-element chunk in double (the cpu kernel in 16 lanes, ref
      // sequentially) and add chunks in order: ~1e-16 * sqrt(chunk) relative to the sum of |x|.
      long double s = 0, ss = 0;
      for (int64_t i = 0; i < n; ++i) s += get(x, i), ss += get(x, i) * get(x, i);
      const double tol = 1e-13 * (1 + static_cast<double>(ss));
      EXPECT_NEAR(get(a, 0), get(b, 0), tol);
      EXPECT_NEAR(get(b, 0), 1.5 + 0.25 * static_cast<double>(s), tol);
      EXPECT_NEAR(get(c, 0), get(d, 0), tol);
      EXPECT_NEAR(get(d, 0), -2 + static_cast<double>(ss), tol);
    }
  }
}

TEST_P(SumTo, BitwiseIndependentOfThreadCount) {
  SEED_TRACE();
  OwnedTensor x = random_tensor(DType::kF32, {123457}, 350, -1, 3);
  std::vector<double> sums, sumsqs;
  for (int threads : {1, 2, 3, 7}) {
    with_threads(threads, [&] {
      OwnedTensor a(DType::kF64, {1}), b(DType::kF64, {1});
      set(a, 0, 0), set(b, 0, 0);
      test::fast().sum_to(x, 1.0, a);
      test::fast().sumsq_to(x, b);
      sums.push_back(get(a, 0)), sumsqs.push_back(get(b, 0));
    });
  }
  for (size_t i = 1; i < sums.size(); ++i) {
    EXPECT_EQ(std::memcmp(&sums[i], &sums[0], sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(&sumsqs[i], &sumsqs[0], sizeof(double)), 0);
  }
}

// sumsq_segments is bitwise one sumsq_to per segment (the grad norm's old loop), on every
// backend and at several thread counts: empty segments, segments crossing the 4096 chunk, a
// repeated output index (adds in row order) and untouched outputs.
TEST_P(SumTo, SegmentsEqualOneSumsqToPerSegmentBitwise) {
  SEED_TRACE();
  const std::vector<int64_t> rows = {0, 5000, 3,  5000, 5000, 0,  9000, 21000, 7,
                                     17, 18, 1,   21000, 30001, 3, 100, 4196, 5};
  const int64_t S = static_cast<int64_t>(rows.size() / 3);
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    OwnedTensor x = random_tensor(dt, {30001}, 360, -1, 3);
    OwnedTensor segments(DType::kI64, {S, 3});
    std::copy(rows.begin(), rows.end(), segments.as<int64_t>());
    OwnedTensor expect(DType::kF64, {8}), oracle(DType::kF64, {8});
    for (int64_t i = 0; i < 8; ++i) set(expect, i, 0.5 * static_cast<double>(i)), set(oracle, i, 0.5 * static_cast<double>(i));
    for (int64_t s = 0; s < S; ++s) {
      const int64_t b = rows[static_cast<size_t>(3 * s)], e = rows[static_cast<size_t>(3 * s + 1)], o = rows[static_cast<size_t>(3 * s + 2)];
      // (An empty slice adds +0: the host-facing harness cannot upload a zero-length view.)
      if (e > b) test::fast().sumsq_to(x.t.slice(b, e), expect.t.slice(o, o + 1));
      ref::sumsq_to(x.t.slice(b, e), oracle.t.slice(o, o + 1));
    }
    for (int threads : {1, 3}) {
      with_threads(threads, [&] {
        OwnedTensor out(DType::kF64, {8}), ref_out(DType::kF64, {8});
        for (int64_t i = 0; i < 8; ++i) set(out, i, 0.5 * static_cast<double>(i)), set(ref_out, i, 0.5 * static_cast<double>(i));
        test::fast().sumsq_segments(x, segments, out);
        ref::sumsq_segments(x, segments, ref_out);
        EXPECT_TRUE(test::bitwise_equal(out.t, expect.t)) << threads << " threads";
        EXPECT_TRUE(test::bitwise_equal(ref_out.t, oracle.t));
        for (int64_t i = 0; i < 8; ++i) EXPECT_NEAR(get(out, i), get(ref_out, i), 1e-13 * (1 + get(ref_out, i)));
      });
    }
  }
}

TEST_P(SumTo, SegmentsOutsideTheirTensorsAreRefused) {
  OwnedTensor x(DType::kF32, {10}), out(DType::kF64, {2}), seg(DType::kI64, {1, 3});
  const std::vector<std::vector<int64_t>> bad = {{0, 11, 0}, {5, 4, 0}, {-1, 2, 0}, {0, 2, 2}};
  for (const auto& row : bad) {
    std::copy(row.begin(), row.end(), seg.as<int64_t>());
    for (Backend* b : {&test::fast(), static_cast<Backend*>(nullptr)}) {
      const std::string what = [&] {
        try {
          if (b) b->sumsq_segments(x, seg, out);
          else ref::sumsq_segments(x, seg, out);
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }();
      // cuda checks the segments on the device: segment 0 is the index of its error.
      EXPECT_TRUE(test::says(what, b ? b->name() : "ref", {"sumsq_segments: segment 0"},
                             {"sumsq_segments: invalid value 0 at index 0"}));
    }
  }
}

// ---------------------------------------------------------------- axpy, scale, fill, convert
TEST_P(Pointwise, AxpyScaleFillMatchRefBitwise) {
  SEED_TRACE();
  uint64_t salt = 400;
  for (int64_t n : {1, 17, 40000}) {
    for (DType dt : {DType::kF32, DType::kF64, DType::kBF16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n));
      OwnedTensor x = random_tensor(dt, {n}, ++salt);
      OwnedTensor y = random_tensor(dt, {n}, ++salt), yr = clone(y), y0 = clone(y);
      // One multiply and one add in the compute type: equal to the ref up to FMA contraction,
      // i.e. one rounding of the product and one of the sum, each at most an ulp of the terms'
      // magnitude |y| + |a x| (relative to the result itself it is unbounded when y and a x
      // nearly cancel: seen at n = 1 in f64, 1.6 ulp of the result).
      test::fast().axpy(-0.3, x, y);
      ref::axpy(-0.3, x, yr);
      const double ulp = dt == DType::kF64 ? 0x1p-52 : dt == DType::kF32 ? 0x1p-23 : 0x1p-7;
      double worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double terms = std::fabs(get(y0, i)) + 0.3 * std::fabs(get(x, i));
        worst = std::max(worst, std::fabs(get(y, i) - get(yr, i)) / terms);
      }
      EXPECT_LE(worst, ulp);
      test::copy_tensor(yr, y);
      // A single multiply or store: bitwise.
      test::fast().scale(y, 1.7);
      ref::scale(yr, 1.7);
      EXPECT_TRUE(test::bitwise_equal(y, yr));
      test::fast().fill(y, 0.1);
      ref::fill(yr, 0.1);
      EXPECT_TRUE(test::bitwise_equal(y, yr));
    }
  }
  OwnedTensor counts(DType::kI32, {5000});
  test::fast().fill(counts, 7);
  EXPECT_EQ(get(counts, 4999), 7);
  EXPECT_THROW(test::fast().fill(counts, 0.5), Error);
}

TEST_P(Convert, AllPairsMatchRefAndBf16Rounding) {
  SEED_TRACE();
  const int64_t n = 70001;
  OwnedTensor base = random_tensor(DType::kF64, {n}, 500, -3e3, 3e3);
  // Specials and rounding ties at the front.
  const double inf = std::numeric_limits<double>::infinity();
  const double specials[] = {0.0, -0.0, inf, -inf, std::nan(""), 1.0 + 1.0 / 256,
                             1.0 + 3.0 / 256, 3.4e38, 1e-40, -1e-45, 65504.0, 1.0 + 1e-12};
  for (size_t i = 0; i < std::size(specials); ++i) set(base, static_cast<int64_t>(i), specials[i]);
  for (DType from : {DType::kF64, DType::kF32, DType::kBF16}) {
    OwnedTensor src(from, {n});
    for (int64_t i = 0; i < n; ++i) {
      // Values as the source dtype holds them (f64 -> f32 -> bf16 by the library rules).
      if (from == DType::kF64) static_cast<double*>(src.t.data)[i] = get(base, i);
      if (from == DType::kF32) static_cast<float*>(src.t.data)[i] = static_cast<float>(get(base, i));
      if (from == DType::kBF16)
        static_cast<bf16*>(src.t.data)[i] = bf16(static_cast<float>(get(base, i)));
    }
    for (DType to : {DType::kF64, DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
      OwnedTensor a(to, {n}), b(to, {n});
      poison(a);
      test::fast().convert(src, a);
      ref::convert(src, b);
      EXPECT_TRUE(test::bitwise_equal(a, b));
      // Against core/bf16.h element by element (f64 rounds through f32).
      if (to == DType::kBF16) {
        int bad = 0;
        for (int64_t i = 0; i < n; ++i) {
          const uint16_t want = bf16::round(static_cast<float>(get(src, i)));
          bad += static_cast<bf16*>(a.t.data)[i].bits != want;
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

// ---------------------------------------------------------------- AdamW
TEST_P(AdamW, MatchesRefOverSteps) {
  SEED_TRACE();
  const int64_t n = 40001;
  OwnedTensor p = random_tensor(DType::kF32, {n}, 600);
  OwnedTensor m(DType::kF32, {n}), v(DType::kF32, {n});
  test::fast().fill(m, 0), test::fast().fill(v, 0);
  OwnedTensor p64 = clone(p, DType::kF64), m64 = clone(m, DType::kF64), v64 = clone(v, DType::kF64);
  OwnedTensor pr = clone(p), mr = clone(m), vr = clone(v);
  for (int64_t step = 1; step <= 5; ++step) {
    OwnedTensor g = random_tensor(DType::kF32, {n}, 600 + static_cast<uint64_t>(step), -1e-2, 1e-2);
    OwnedTensor g64 = clone(g, DType::kF64);
    test::fast().adamw(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, step);
    ref::adamw(pr, g, mr, vr, 1e-3, 0.9, 0.95, 1e-8, 0.1, step);
    ref::adamw(p64, g64, m64, v64, 1e-3, 0.9, 0.95, 1e-8, 0.1, step);
  }
  // Same scalars and operation order as ref f32: equal up to FMA contraction, which the build
  // allows and which the compiler applies differently to the two loops: <= 1 ulp of p per
  // step (5 steps: measured <= 3.6e-7 relative to max|p| ~ 1). 1e-6.
  EXPECT_LT(rel_error(p, pr), 1e-6);
  EXPECT_LT(rel_error(m, mr), 1e-6);
  EXPECT_LT(rel_error(v, vr), 1e-6);
  // Against f64: p ~ 1 takes one f32 rounding (6e-8) per step, the update ~lr is computed to
  // a few ulp; m and v a few ulp per step. Measured <= 3e-7 (p), 1.4e-7 (m, v). 1e-6.
  EXPECT_LT(rel_error(p, p64), 1e-6);
  EXPECT_LT(rel_error(m, m64), 1e-6);
  EXPECT_LT(rel_error(v, v64), 1e-6);
}

TEST_P(AdamW, F64AndLargeLerpWeightMatchRef) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::adamw, DType::kF64);
  SEED_TRACE();
  const int64_t n = 1003;  // not a multiple of the 16-element blocks
  for (double beta1 : {0.9, 0.3}) {  // 1 - beta1 >= 0.5 takes torch's other lerp form
    SCOPED_TRACE("beta1 " + std::to_string(beta1));
    OwnedTensor p = random_tensor(DType::kF64, {n}, 650), m = random_tensor(DType::kF64, {n}, 651);
    OwnedTensor v = random_tensor(DType::kF64, {n}, 652, 0, 1e-4);
    OwnedTensor g = random_tensor(DType::kF64, {n}, 653, -1e-2, 1e-2);
    OwnedTensor pr = clone(p), mr = clone(m), vr = clone(v);
    test::fast().adamw(p, g, m, v, 1e-3, beta1, 0.99, 1e-8, 0.1, 7);
    ref::adamw(pr, g, mr, vr, 1e-3, beta1, 0.99, 1e-8, 0.1, 7);
    // Same operations in double, up to FMA contraction: ~1 ulp.
    EXPECT_LT(rel_error(p, pr), 1e-15);
    EXPECT_LT(rel_error(m, mr), 1e-15);
    EXPECT_LT(rel_error(v, vr), 1e-15);
  }
}

TEST(AdamWRef, MatchesTextbookFormula) {
  // The formula of op_list.inc written out in double for one element over three steps.
  double p = 0.5, m = 0, v = 0;
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  OwnedTensor tp(DType::kF64, {1}), tg(DType::kF64, {1}), tm(DType::kF64, {1}), tv(DType::kF64, {1});
  set(tp, 0, p), set(tm, 0, 0), set(tv, 0, 0);
  const double grads[] = {0.3, -0.7, 0.05};
  for (int64_t step = 1; step <= 3; ++step) {
    const double g = grads[step - 1];
    p *= 1 - lr * wd;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    p -= (lr / (1 - std::pow(b1, step))) * m /
         (std::sqrt(v) / std::sqrt(1 - std::pow(b2, step)) + eps);
    set(tg, 0, g);
    ref::adamw(tp, tg, tm, tv, lr, b1, b2, eps, wd, step);
    EXPECT_NEAR(get(tp, 0), p, 1e-15);
    EXPECT_NEAR(get(tm, 0), m, 1e-16);
    EXPECT_NEAR(get(tv, 0), v, 1e-17);
  }
  // Step 1 from zero moments moves a parameter by lr * g / (|g| + eps) ~ lr * sign(g).
  set(tp, 0, 0.5), set(tg, 0, -0.3), set(tm, 0, 0), set(tv, 0, 0);
  ref::adamw(tp, tg, tm, tv, lr, b1, b2, eps, 0.0, 1);
  EXPECT_NEAR(get(tp, 0), 0.5 + lr, 1e-9);
  EXPECT_THROW(ref::adamw(tp, tg, tm, tv, lr, b1, b2, eps, wd, 0), Error);
}

TEST_P(AdamW, RejectsStepZero) {
  // f32, which every backend takes: refused for the step, not for the dtype.
  OwnedTensor tp(DType::kF32, {1}), tg(DType::kF32, {1}), tm(DType::kF32, {1}), tv(DType::kF32, {1});
  set(tp, 0, 0.5), set(tg, 0, -0.3), set(tm, 0, 0), set(tv, 0, 0);
  const std::string what =
      test::error_of([&] { test::fast().adamw(tp, tg, tm, tv, 1e-2, 0.9, 0.999, 1e-8, 0.01, 0); });
  EXPECT_NE(what.find("adamw: step counts from 1, got 0"), std::string::npos) << what;
}

}  // namespace
}  // namespace moe
