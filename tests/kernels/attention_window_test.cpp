// Sliding-window attention: the model's first-key tables (model/attention_masks.h) through the
// attention ops. The reference is checked against an independent construction (each query as the
// last row of plain causal attention over its own window), the backend under test against the f64
// reference on windows that start mid-tile, on tile edges and with document starts inside them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "attention_problem.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "model/attention_masks.h"

namespace moe {
namespace {

using test::rel_error;
using namespace attention_test;

OwnedTensor window_table(const Tensor& doc, int64_t B, int64_t S, int64_t window) {
  OwnedTensor t(DType::kI32, {B, S});
  window_first_keys(doc.data ? doc.as<int32_t>() : nullptr, B, S, window, t.as<int32_t>());
  return t;
}

TEST(AttentionWindowRef, EachQueryEqualsCausalAttentionOverItsOwnWindow) {
  // Query i of a windowed row equals the last row of plain causal attention over keys
  // [max(doc start, i - W + 1), i] alone: a construction that does not use the table.
  const Shape s{2, 45, 4, 2, 8, 2.0};
  const int64_t W = 7;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(s, DType::kF64);
  p.fill(s, seed);
  const OwnedTensor doc = doc_starts(s.B, s.S, {{0, 3, 20, 21}, {0, 30}});
  const OwnedTensor table = window_table(doc, s.B, s.S, W);
  ref::attention_fwd(p.q, p.k, p.v, p.o, p.lse, table, false);
  double worst = 0;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t i = 0; i < s.S; ++i) {
      const int64_t a = std::max<int64_t>(doc.as<int32_t>()[b * s.S + i], i - W + 1), n = i - a + 1;
      ASSERT_LE(n, W);
      Shape one{1, n, s.H, s.G, s.hd};
      Problem q(one, DType::kF64);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < s.H * s.hd; ++c)
          test::set(q.q, r * s.H * s.hd + c, test::get(p.q, ((b * s.S + a + r) * s.H * s.hd) + c));
        for (int64_t c = 0; c < s.G * s.hd; ++c) {
          test::set(q.k, r * s.G * s.hd + c, test::get(p.k, ((b * s.S + a + r) * s.G * s.hd) + c));
          test::set(q.v, r * s.G * s.hd + c, test::get(p.v, ((b * s.S + a + r) * s.G * s.hd) + c));
        }
      }
      ref::attention_fwd(q.q, q.k, q.v, q.o, q.lse, Tensor(), false);
      for (int64_t c = 0; c < s.H * s.hd; ++c)
        worst = std::max(worst, std::abs(test::get(p.o, (b * s.S + i) * s.H * s.hd + c) -
                                         test::get(q.o, (n - 1) * s.H * s.hd + c)));
      for (int64_t h = 0; h < s.H; ++h)
        worst = std::max(worst, std::abs(test::get(p.lse, (b * s.H + h) * s.S + i) - test::get(q.lse, h * n + n - 1)));
    }
  EXPECT_LE(worst, 1e-12);
}

TEST(AttentionWindowRef, TableIsTheWindowCutByDocuments) {
  OwnedTensor doc = doc_starts(1, 10, {{0, 6}});
  OwnedTensor plain = window_table(Tensor(), 1, 10, 4), cut = window_table(doc, 1, 10, 4);
  const std::vector<int32_t> want_plain{0, 0, 0, 0, 1, 2, 3, 4, 5, 6}, want_cut{0, 0, 0, 0, 1, 2, 6, 6, 6, 6};
  for (int64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(plain.as<int32_t>()[i], want_plain[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(cut.as<int32_t>()[i], want_cut[static_cast<size_t>(i)]) << i;
  }
}

struct WindowCase {
  Shape shape;
  int64_t window;
  bool docs;
};

std::string window_case_name(const WindowCase& c) {
  std::string out(1, 'S');  // appended piece by piece: g++ 12 -O3 reports a false -Wrestrict on "lit" + string
  out.append(std::to_string(c.shape.S)).append("_hd").append(std::to_string(c.shape.hd));
  out.append("_W").append(std::to_string(c.window));
  if (c.docs) out.append("_docs");
  return out;
}

void PrintTo(const WindowCase& c, std::ostream* os) { *os << window_case_name(c); }

// Windows below a tile (whole key tiles skipped behind every query), on a tile edge (64), across
// several tiles, at least S (plain causal), and with document starts inside the windows.
const WindowCase kWindowCases[] = {{Shape{2, 300, 4, 2, 32, 2.0}, 16, false}, {Shape{2, 300, 4, 2, 32, 2.0}, 64, true},
                                   {Shape{1, 200, 8, 1, 64, 3.0}, 100, false}, {Shape{2, 150, 4, 2, 8}, 1, true},
                                   {Shape{2, 70, 4, 4, 12}, 500, true}};

MOE_BACKEND_SUITE_WITH(AttentionWindows, WindowCase, ::testing::ValuesIn(kWindowCases), window_case_name);

TEST_P(AttentionWindows, MatchesF64Reference) {
  const WindowCase c = param();
  const Shape& s = c.shape;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(name(s) + " window " + std::to_string(c.window) + " seed " + std::to_string(seed));
  Problem ref64(s, DType::kF64);
  ref64.fill(s, seed);
  ref64.poison_outputs();
  Problem fast32 = ref64.converted(s, DType::kF32);
  const OwnedTensor doc = c.docs ? doc_starts(s.B, s.S, {{0, 5, 6, 64, 100, 101, 128, 190}, {0, 37, 130}}) : OwnedTensor();
  const OwnedTensor table = window_table(doc.t, s.B, s.S, c.window);
  run<Ref>(ref64, table);
  run<Fast>(fast32, table);
  const double grow = std::max(1.0, s.amp * s.amp / 9.0);
  EXPECT_LE(rel_error(fast32.o, ref64.o), kTolO * grow);
  EXPECT_LE(rel_error(fast32.lse, ref64.lse), kTolLse * grow);
  EXPECT_LE(rel_error(fast32.dq, ref64.dq), kTolGrad * grow);
  EXPECT_LE(rel_error(fast32.dk, ref64.dk), kTolGrad * grow);
  EXPECT_LE(rel_error(fast32.dv, ref64.dv), kTolGrad * grow);
}

}  // namespace
}  // namespace moe
