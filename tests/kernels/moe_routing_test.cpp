// MoE routing kernels: each backend under test against ref, finite-difference gradients of ref
// in f64, the permutation's stability, and thread-count independence.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>

#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

using test::fd_check;
using test::rel_error;

struct Routing {
  int64_t T, E, K;
};

MOE_BACKEND_SUITE(MoeRouting);

// The seed of the random inputs, recorded as a property of the running test.
uint64_t recorded_seed() {
  const uint64_t seed = test::test_seed();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

// FD relative error bound for f64 central differences with h = 1e-6 on smooth functions of
// O(1) inputs: truncation ~h^2 = 1e-12, rounding ~1e-16/1e-6 = 1e-10; 1e-7 leaves margin.
constexpr double kFdTol = 1e-7;

TEST_P(MoeRouting, ScoresForwardMatchesRefAndBackwardMatchesFiniteDifferences) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  // softmax, sigmoid, and sigmoid with Olmo-core 3's stability epsilon (scores + eps).
  // E = 12 (the cpu backend's vectorized rows take only their remainder loops), 37 (two 16-lane
  // blocks and a remainder) and 128 (blocks only).
  for (const int64_t E : {12, 37, 128}) {
    for (auto [kind, eps] : {std::pair{ScoreKind::kSoftmax, 0.0}, std::pair{ScoreKind::kSigmoid, 0.0}, std::pair{ScoreKind::kSigmoid, 1e-7}}) {
      SCOPED_TRACE(testing::Message() << "E " << E << " kind " << static_cast<int>(kind) << " eps " << eps);
      const int64_t T = 37;
      OwnedTensor z(DType::kF64, {T, E}), s(DType::kF64, {T, E}), r(DType::kF64, {T, E});
      test::fill_uniform(z, seed, 1, -3, 3);
      test::fill_uniform(r, seed, 2);
      // backend f32 vs ref f64: softmax of E values in fp32 (the cpu backend's exp within ~2 ulp,
      // sums in 16 lanes), error ~ a few ulp of the largest score (1e-6 relative).
      OwnedTensor z32 = test::clone(z, DType::kF32), s32(DType::kF32, {T, E});
      test::poison(s32);
      test::fast().router_scores_fwd(z32, kind, eps, s32);
      ref::router_scores_fwd(z, kind, eps, s);
      EXPECT_LT(rel_error(s32, s), 1e-6);
      OwnedTensor dz(DType::kF64, {T, E});
      ref::fill(dz, 0.0);
      ref::router_scores_bwd(r, s, kind, eps, dz);
      auto loss = [&] {
        ref::router_scores_fwd(z, kind, eps, s);
        return test::dot(s, r);
      };
      EXPECT_LT(fd_check(z, dz, loss), kFdTol);
      // backend backward (f32) vs ref backward.
      ref::router_scores_fwd(z, kind, eps, s);
      OwnedTensor r32 = test::clone(r, DType::kF32), dz32(DType::kF32, {T, E});
      test::fast().fill(dz32, 0.0);
      test::fast().router_scores_fwd(z32, kind, eps, s32);
      test::fast().router_scores_bwd(r32, s32, kind, eps, dz32);
      EXPECT_LT(rel_error(dz32, dz), 1e-5);
    }
  }
  // The epsilon shifts every sigmoid score by exactly eps (in f64), and only sigmoid takes one.
  const int64_t T = 5, E = 4;
  OwnedTensor z(DType::kF64, {T, E}), a(DType::kF64, {T, E}), b(DType::kF64, {T, E});
  test::fill_uniform(z, seed, 3, -30, 3);
  ref::router_scores_fwd(z, ScoreKind::kSigmoid, 0.0, a);
  ref::router_scores_fwd(z, ScoreKind::kSigmoid, 1e-7, b);
  // Exact up to the rounding of the sum: one ulp of the score (<= 1): 2.2e-16.
  for (int64_t i = 0; i < T * E; ++i) EXPECT_NEAR(b.as<double>()[i] - a.as<double>()[i], 1e-7, 2.3e-16);
  EXPECT_THROW(test::fast().router_scores_fwd(z, ScoreKind::kSoftmax, 1e-7, a), Error);
}

TEST_P(MoeRouting, TopkPicksLargestWithBiasAndBreaksTiesToLowerId) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 50, E = 70, K = 4;  // E > 64 exercises the large-E path
  OwnedTensor s(DType::kF32, {T, E}), b(DType::kF32, {E}), a(DType::kI32, {T, K}), c(DType::kI32, {T, K});
  test::fill_uniform(s, seed, 3, 0, 1);
  test::fill_uniform(b, seed, 4, -0.1, 0.1);
  test::poison(a);
  test::poison(c);
  test::fast().router_topk(s, b, 0, 0, a);
  ref::router_topk(s, b, 0, 0, c);
  EXPECT_TRUE(test::bitwise_equal(a, c));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<float, int>> sel;
    for (int e = 0; e < E; ++e) sel.push_back({s.as<float>()[t * E + e] + b.as<float>()[e], e});
    std::stable_sort(sel.begin(), sel.end(), [](auto x, auto y) { return x.first > y.first; });
    for (int64_t j = 0; j < K; ++j) ASSERT_EQ(a.as<int32_t>()[t * K + j], sel[static_cast<size_t>(j)].second);
  }
  ref::fill(s, 0.5);
  test::fast().router_topk(s, Tensor(), 0, 0, a);
  for (int64_t j = 0; j < K; ++j) EXPECT_EQ(a.as<int32_t>()[j], j);
}

// The cpu backend's one-pass top-k against the reference, where they could differ: many equal
// values (4 levels), signed zeros, infinities, K from 1 to past the one-pass limit of 16, E up to
// 128. A row holding a NaN has no defined order (the reference's sort has no strict weak order
// there; a NaN step is skipped whole): there, K distinct experts in range.
TEST_P(MoeRouting, TopkEqualsTheReferenceOnTiesZerosInfinitiesAndNans) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t E : {8, 13, 70, 128})
    for (int64_t K : {1, 2, 4, 8, 16, 20}) {
      if (K > E) continue;
      SCOPED_TRACE(testing::Message() << "E " << E << " K " << K);
      const int64_t T = 64;
      OwnedTensor s(DType::kF32, {T, E}), a(DType::kI32, {T, K}), c(DType::kI32, {T, K});
      test::fill_uniform(s, seed, 17, 0, 4);
      float* v = s.as<float>();
      for (int64_t i = 0; i < T * E; ++i) v[i] = std::floor(v[i]) - 1.5f;  // 4 levels: ties everywhere
      for (int64_t t = 0; t < T; ++t) {
        float* row = v + t * E;
        const int64_t at = (t * 7) % E;
        switch (t % 8) {
          case 1: row[at] = 0.0f; row[(at + 3) % E] = -0.0f; break;
          case 2: row[at] = inf; row[(at + 5) % E] = -inf; break;
          case 3: row[at] = nan; break;                // somewhere in the row
          case 4: row[0] = nan; break;                 // first
          case 5: row[E - 1] = nan; row[at] = inf; break;  // last
          case 6: for (int64_t e = 0; e < E; ++e) row[e] = -inf; break;
          case 7:  // distinct values, no ties (the cpu's 16-expert blocks skip most of the row)
            for (int64_t e = 0; e < E; ++e) row[e] = std::sin(0.37f * static_cast<float>(t * E + e));
            break;
          default: break;
        }
      }
      test::poison(a);
      test::poison(c);
      test::fast().router_topk(s, Tensor(), 0, 0, a);
      ref::router_topk(s, Tensor(), 0, 0, c);
      for (int64_t t = 0; t < T; ++t) {
        const int32_t* x = a.as<int32_t>() + t * K;
        const int32_t* y = c.as<int32_t>() + t * K;
        if (t % 8 < 3 || t % 8 > 5) {
          EXPECT_TRUE(std::equal(x, x + K, y)) << "row " << t;
        } else {
          std::set<int32_t> chosen(x, x + K);
          EXPECT_EQ(static_cast<int64_t>(chosen.size()), K) << "row " << t;
          EXPECT_TRUE(*chosen.begin() >= 0 && *chosen.rbegin() < E) << "row " << t;
        }
      }
    }
}

// Group-limited routing: against a direct transcription of Olmo-core 3's get_top_k (group score =
// sum of the group's two best selection values, the topk_group best groups, then top-k over
// their experts), cpu equal to ref, and the groups' edge cases.
TEST_P(MoeRouting, GroupLimitedTopkChoosesWithinTheBestGroups) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  struct Case {
    int64_t E, K, groups, keep;
  };
  for (const Case& k : {Case{16, 4, 4, 2}, Case{70, 6, 7, 3}, Case{8, 2, 8, 2}, Case{12, 3, 3, 3}}) {
    SCOPED_TRACE(testing::Message() << "E " << k.E << " K " << k.K << " groups " << k.groups << " keep " << k.keep);
    const int64_t T = 40, per = k.E / k.groups;
    OwnedTensor s(DType::kF32, {T, k.E}), b(DType::kF32, {k.E}), a(DType::kI32, {T, k.K}), c(DType::kI32, {T, k.K});
    test::fill_uniform(s, seed, 13, 0, 1);
    test::fill_uniform(b, seed, 14, -0.1, 0.1);
    test::poison(a);
    test::poison(c);
    test::fast().router_topk(s, b, k.groups, k.keep, a);
    ref::router_topk(s, b, k.groups, k.keep, c);
    EXPECT_TRUE(test::bitwise_equal(a, c));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> sel(static_cast<size_t>(k.E));
      for (int64_t e = 0; e < k.E; ++e) sel[static_cast<size_t>(e)] = s.as<float>()[t * k.E + e] + b.as<float>()[e];
      std::vector<std::pair<float, int64_t>> gs;
      for (int64_t g = 0; g < k.groups; ++g) {
        std::vector<float> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<float>());
        gs.push_back({per > 1 ? v[0] + v[1] : v[0], g});
      }
      std::stable_sort(gs.begin(), gs.end(), [](auto x, auto y) { return x.first > y.first; });
      std::vector<std::pair<float, int32_t>> cand;
      for (int64_t i = 0; i < k.keep; ++i)
        for (int64_t e = gs[static_cast<size_t>(i)].second * per; e < (gs[static_cast<size_t>(i)].second + 1) * per; ++e)
          cand.push_back({sel[static_cast<size_t>(e)], static_cast<int32_t>(e)});
      std::stable_sort(cand.begin(), cand.end(), [](auto x, auto y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      });
      for (int64_t j = 0; j < k.K; ++j) ASSERT_EQ(a.as<int32_t>()[t * k.K + j], cand[static_cast<size_t>(j)].second) << t;
    }
  }
  OwnedTensor s(DType::kF32, {2, 8}), a(DType::kI32, {2, 5});
  EXPECT_THROW(test::fast().router_topk(s, Tensor(), 3, 1, a.t.view({2, 5})), Error);  // 3 groups of 8
  EXPECT_THROW(test::fast().router_topk(s, Tensor(), 4, 2, a), Error);                  // 5 > 2 groups x 2
  EXPECT_THROW(test::fast().router_topk(s, Tensor(), 0, 2, a), Error);                  // topk_group alone
}

TEST_P(MoeRouting, UniformAndRandomAssignmentArePureFunctionsOfTheGlobalToken) {
  const uint64_t seed = recorded_seed();
  const int64_t T = 40, K = 3, E = 8;
  OwnedTensor a(DType::kI32, {T, K}), b(DType::kI32, {T - 5, K}), c(DType::kI32, {T, K});
  test::fast().router_assign(RouterAssignment::kUniform, seed, 7, 100, E, a);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) EXPECT_EQ(a.as<int32_t>()[t * K + j], ((100 + t) * K + j) % E);
  test::fast().router_assign(RouterAssignment::kRandom, seed, 7, 100, E, a);
  ref::router_assign(RouterAssignment::kRandom, seed, 7, 100, E, c);
  EXPECT_TRUE(test::bitwise_equal(a, c));
  test::fast().router_assign(RouterAssignment::kRandom, seed, 7, 105, E, b);  // the same tokens seen from another split
  for (int64_t i = 0; i < (T - 5) * K; ++i) EXPECT_EQ(b.as<int32_t>()[i], a.as<int32_t>()[5 * K + i]);
  for (int64_t t = 0; t < T; ++t) {
    std::set<int32_t> chosen(a.as<int32_t>() + t * K, a.as<int32_t>() + (t + 1) * K);
    EXPECT_EQ(static_cast<int64_t>(chosen.size()), K);
  }
}

TEST_P(MoeRouting, GatherWeightsBackwardMatchesFiniteDifferences) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  // Not divided; the sum (norm_topk_prob); an L2 norm scaled as restore_weight_scale x
  // sqrt(original_top_k / K) would; a fractional p with expert_weight_scale.
  const ExpertWeightRule rules[] = {{0, 1}, {1, 1}, {2, 3 * std::sqrt(8.0 / 3)}, {3.5, 2.5}, {0, 0.75}};
  for (const ExpertWeightRule& rule : rules) {
    SCOPED_TRACE(testing::Message() << "p " << rule.norm_p << " factor " << rule.factor);
    const int64_t T = 20, E = 8, K = 3;
    OwnedTensor s(DType::kF64, {T, E}), idx(DType::kI32, {T, K}), w(DType::kF64, {T, K}), r(DType::kF64, {T, K});
    test::fill_uniform(s, seed, 5, 0.05, 1);
    test::fill_uniform(r, seed, 6);
    ref::router_topk(s, Tensor(), 0, 0, idx);
    OwnedTensor ds(DType::kF64, {T, E});
    ref::fill(ds, 0.0);
    ref::router_gather_bwd(r, s, idx, rule, ds);
    auto loss = [&] {
      ref::router_gather(s, idx, rule, w);
      return test::dot(w, r);
    };
    EXPECT_LT(fd_check(s, ds, loss), kFdTol);
    // The weights against their definition: factor * s_j / (sum_i s_i^p)^(1/p).
    ref::router_gather(s, idx, rule, w);
    for (int64_t t = 0; t < T; ++t) {
      double n = 0;
      for (int64_t j = 0; j < K; ++j) n += std::pow(s.as<double>()[t * E + idx.as<int32_t>()[t * K + j]], rule.norm_p);
      n = rule.norm_p > 0 ? std::pow(n, 1 / rule.norm_p) : 1;
      for (int64_t j = 0; j < K; ++j)
        EXPECT_NEAR(w.as<double>()[t * K + j], rule.factor * s.as<double>()[t * E + idx.as<int32_t>()[t * K + j]] / n,
                    1e-14 * std::fabs(rule.factor));
    }
    OwnedTensor s32 = test::clone(s, DType::kF32), w32(DType::kF32, {T, K}), wr(DType::kF64, {T, K});
    test::poison(w32);
    test::fast().router_gather(s32, idx, rule, w32);
    ref::router_gather(s, idx, rule, wr);
    EXPECT_LT(rel_error(w32, wr), 1e-6);
    // backend backward (f32) vs ref backward.
    OwnedTensor r32 = test::clone(r, DType::kF32), ds32(DType::kF32, {T, E});
    test::fast().fill(ds32, 0.0);
    test::fast().router_gather_bwd(r32, s32, idx, rule, ds32);
    EXPECT_LT(rel_error(ds32, ds), 1e-5);
  }
  OwnedTensor s(DType::kF32, {2, 4}), idx(DType::kI32, {2, 2}), w(DType::kF32, {2, 3}), w2(DType::kF32, {2, 2});
  test::fill_uniform(s, seed, 7, 0.05, 1);
  ref::router_topk(s, Tensor(), 0, 0, idx);
  EXPECT_THROW(test::fast().router_gather(s, idx, ExpertWeightRule{1, 1}, w), Error);  // weights not (T,K)
  EXPECT_THROW(test::fast().router_gather(s, idx, ExpertWeightRule{-1, 1}, w2), Error);  // p < 0
  EXPECT_NO_THROW(test::fast().router_gather(s, idx, ExpertWeightRule{1, 1}, w2));
}

TEST_P(MoeRouting, PlanIsAStableCountingSortAndEqualsRef) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 5000, K = 2, E = 16;  // > one 4096-slot chunk in the cpu kernel
  OwnedTensor idx(DType::kI32, {T, K});
  test::fill_ids(idx, seed, 7, static_cast<int32_t>(E - 1));  // expert E-1 receives zero rows
  OwnedTensor counts(DType::kI32, {E}), off(DType::kI32, {E + 1}), sorted(DType::kI32, {T * K}), pos(DType::kI32, {T * K});
  OwnedTensor counts2(DType::kI32, {E}), off2(DType::kI32, {E + 1}), sorted2(DType::kI32, {T * K}), pos2(DType::kI32, {T * K});
  for (auto* t : {&counts, &off, &sorted, &pos}) test::poison(*t);
  test::fast().moe_plan(idx, counts, off, sorted, pos);
  ref::moe_plan(idx, counts2, off2, sorted2, pos2);
  EXPECT_TRUE(test::bitwise_equal(sorted, sorted2));
  EXPECT_TRUE(test::bitwise_equal(pos, pos2));
  EXPECT_TRUE(test::bitwise_equal(off, off2));
  EXPECT_EQ(counts.as<int32_t>()[E - 1], 0);
  std::vector<int32_t> expect(static_cast<size_t>(T * K));
  std::iota(expect.begin(), expect.end(), 0);
  std::stable_sort(expect.begin(), expect.end(), [&](int32_t a, int32_t b) { return idx.as<int32_t>()[a] < idx.as<int32_t>()[b]; });
  for (int64_t p = 0; p < T * K; ++p) {
    ASSERT_EQ(sorted.as<int32_t>()[p], expect[static_cast<size_t>(p)]);
    ASSERT_EQ(pos.as<int32_t>()[sorted.as<int32_t>()[p]], p);
  }
  int32_t bad_ids[2] = {0, 99};
  Tensor bad(bad_ids, DType::kI32, {1, 2});
  EXPECT_THROW(test::fast().moe_plan(bad, counts, off, sorted.t.slice(0, 2), pos.t.slice(0, 2)), Error);
}

// The instance load-balancing loss's per-sequence counts: moe_plan's counts, overwritten.
TEST_P(MoeRouting, ExpertCountsEqualThePlansCountsAndRefuseBadIds) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 700, K = 3, E = 24;
  OwnedTensor idx(DType::kI32, {T, K});
  test::fill_ids(idx, seed, 8, static_cast<int32_t>(E - 1));  // expert E-1 receives none
  OwnedTensor counts(DType::kI32, {E}), plan(DType::kI32, {E}), off(DType::kI32, {E + 1}), sorted(DType::kI32, {T * K}),
      pos(DType::kI32, {T * K});
  test::poison(counts);
  test::fast().expert_counts(idx, counts);
  ref::moe_plan(idx, plan, off, sorted, pos);
  EXPECT_TRUE(test::bitwise_equal(counts, plan));
  EXPECT_EQ(counts.as<int32_t>()[E - 1], 0);
  test::fast().expert_counts(idx.t.slice(0, 1), counts);  // overwritten, not added to
  int32_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts.as<int32_t>()[e];
  EXPECT_EQ(total, K);
  int32_t bad_ids[2] = {0, 99};
  const Tensor bad(bad_ids, DType::kI32, {1, 2});
  EXPECT_THROW(test::fast().expert_counts(bad, counts), Error);
  EXPECT_THROW(ref::expert_counts(bad, counts), Error);
}

// T tokens routed over E experts at top-K by the reference's ops from uniform scores (salt): the
// combine weights (dtype t) and the plan's sorted slots and slot positions.
struct Routed {
  OwnedTensor w, sorted, pos;
};
Routed routed(int64_t T, int64_t E, int64_t K, DType t, uint64_t seed, uint64_t salt) {
  OwnedTensor s(t, {T, E}), idx(DType::kI32, {T, K});
  Routed r{OwnedTensor(t, {T, K}), OwnedTensor(DType::kI32, {T * K}), OwnedTensor(DType::kI32, {T * K})};
  test::fill_uniform(s, seed, salt, 0, 1);
  ref::router_topk(s, Tensor(), 0, 0, idx);
  ref::router_gather(s, idx, ExpertWeightRule{}, r.w);
  OwnedTensor counts(DType::kI32, {E}), off(DType::kI32, {E + 1});
  ref::moe_plan(idx, counts, off, r.sorted, r.pos);
  return r;
}

TEST_P(MoeRouting, GatherCombineAndTheirBackwardsMatchFiniteDifferences) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 17, D = 6, E = 5, K = 2, R = T * K;
  const Routed rt = routed(T, E, K, DType::kF64, seed, 8);
  const OwnedTensor &w = rt.w, &sorted = rt.sorted, &pos = rt.pos;
  OwnedTensor x(DType::kF64, {T, D}), xs(DType::kF64, {R, D}), ys(DType::kF64, {R, D}), out(DType::kF64, {T, D}), r(DType::kF64, {T, D});
  test::fill_uniform(x, seed, 9);
  test::fill_uniform(ys, seed, 10);
  test::fill_uniform(r, seed, 11);
  // gather: d loss/dx with loss = sum(xs * rr)
  OwnedTensor rr(DType::kF64, {R, D}), dx(DType::kF64, {T, D});
  test::fill_uniform(rr, seed, 12);
  ref::fill(dx, 0.0);
  ref::moe_gather_bwd(rr, pos, dx);
  EXPECT_LT(fd_check(x, dx, [&] { ref::moe_gather(x, sorted, xs); return test::dot(xs, rr); }), kFdTol);
  // combine: d loss / d ys and d loss / d weights with loss = sum(out * r)
  OwnedTensor dys(DType::kF64, {R, D}), dw(DType::kF64, {T, K});
  ref::moe_combine_bwd(r, ys, pos, w, dys, dw);
  auto loss = [&] { ref::moe_combine(ys, pos, w, out, false); return test::dot(out, r); };
  EXPECT_LT(fd_check(ys, dys, loss), kFdTol);
  EXPECT_LT(fd_check(w, dw, loss), kFdTol);
  // backend vs ref, f32, outputs poisoned first. Same summation order: exact up to fp32 rounding.
  OwnedTensor x32 = test::clone(x, DType::kF32), xs32(DType::kF32, {R, D}), ys32 = test::clone(ys, DType::kF32);
  OwnedTensor w32 = test::clone(w, DType::kF32), out32(DType::kF32, {T, D}), r32 = test::clone(r, DType::kF32);
  OwnedTensor dys32(DType::kF32, {R, D}), dw32(DType::kF32, {T, K}), dx32(DType::kF32, {T, D});
  for (auto* t : {&xs32, &out32, &dys32, &dw32}) test::poison(*t);
  test::fast().moe_gather(x32, sorted, xs32);
  ref::moe_gather(x, sorted, xs);
  EXPECT_LT(rel_error(xs32, xs), 1e-7);
  test::fast().moe_combine(ys32, pos, w32, out32, false);
  ref::moe_combine(ys, pos, w, out, false);
  EXPECT_LT(rel_error(out32, out), 1e-6);
  test::fast().moe_combine_bwd(r32, ys32, pos, w32, dys32, dw32);
  EXPECT_LT(rel_error(dys32, dys), 1e-6);
  EXPECT_LT(rel_error(dw32, dw), 1e-6);
  test::fast().fill(dx32, 0.0);
  test::fast().moe_gather_bwd(test::clone(rr, DType::kF32), pos, dx32);
  EXPECT_LT(rel_error(dx32, dx), 1e-6);
  // bf16-saved expert outputs (bf16 mode): compare with the f64 reference on the same rounded ys.
  OwnedTensor ys16 = test::clone(ys, DType::kBF16), ys16_64 = test::clone(ys16, DType::kF64);
  for (auto* t : {&dys32, &dw32}) test::poison(*t);
  test::fast().moe_combine_bwd(r32, ys16, pos, w32, dys32, dw32);
  ref::moe_combine_bwd(r, ys16_64, pos, w, dys, dw);
  EXPECT_LT(rel_error(dys32, dys), 1e-6);
  EXPECT_LT(rel_error(dw32, dw), 1e-6);
  OwnedTensor dw32r(DType::kF32, {T, K}), dys32r(DType::kF32, {R, D});
  ref::moe_combine_bwd(r32, ys16, pos, w32, dys32r, dw32r);
  EXPECT_LT(rel_error(dw32r, dw), 1e-6);
  // dys rounded to bf16 as it is stored (bf16 mode: the experts' GEMM operand) is bitwise the f32
  // dys converted, on the backend and on the reference, with ys in f32 or bf16; dweights unchanged.
  for (const Tensor* y : {&ys32.t, &ys16.t}) {
    OwnedTensor dys16(DType::kBF16, {R, D}), dys16_ref(DType::kBF16, {R, D}), dys16_conv(DType::kBF16, {R, D});
    OwnedTensor dw16(DType::kF32, {T, K});
    for (auto* t : {&dys32, &dw32, &dys16, &dw16}) test::poison(*t);
    test::fast().moe_combine_bwd(r32, *y, pos, w32, dys32, dw32);
    test::fast().moe_combine_bwd(r32, *y, pos, w32, dys16, dw16);
    ref::convert(dys32, dys16_conv);
    EXPECT_TRUE(test::bitwise_equal(dys16, dys16_conv));
    EXPECT_TRUE(test::bitwise_equal(dw16, dw32));
    ref::moe_combine_bwd(r32, *y, pos, w32, dys16_ref, dw32r);
    EXPECT_TRUE(test::bitwise_equal(dys16_ref, dys16_conv));
  }
}

TEST_P(MoeRouting, LoadBalanceLossIsOneAtBalanceAndItsGradientMatchesFiniteDifferences) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 32, E = 8, K = 2;
  // Perfect balance: uniform scores and equal counts give exactly 1.
  OwnedTensor s(DType::kF64, {T, E}), counts(DType::kI32, {E}), out(DType::kF64, {1}), P(DType::kF64, {E});
  ref::fill(s, 1.0 / E);
  for (int64_t e = 0; e < E; ++e) counts.as<int32_t>()[e] = static_cast<int32_t>(T * K / E);
  ref::fill(out, 0.0);
  ref::load_balance_loss(s, counts, ScoreKind::kSoftmax, K, 1.0, 1.0, out, Tensor(), P);
  EXPECT_NEAR(out.as<double>()[0], 1.0, 1e-15);
  for (ScoreKind kind : {ScoreKind::kSoftmax, ScoreKind::kSigmoid}) {
    test::fill_uniform(s, seed, 13 + static_cast<int>(kind), 0.01, 1);
    if (kind == ScoreKind::kSoftmax)  // rows of a softmax sum to one
      for (int64_t t = 0; t < T; ++t) {
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += s.as<double>()[t * E + e];
        for (int64_t e = 0; e < E; ++e) s.as<double>()[t * E + e] /= sum;
      }
    test::fill_ids(counts, seed, 15, 2 * T * K / E);
    OwnedTensor ds(DType::kF64, {T, E});
    ref::fill(ds, 0.0);
    ref::load_balance_loss(s, counts, kind, K, 1.0, 0.7, out, ds, P);
    auto loss = [&] {
      ref::fill(out, 0.0);
      ref::load_balance_loss(s, counts, kind, K, 0.7, 0.0, out, Tensor(), P);
      return out.as<double>()[0];
    };
    // The gradient here is small (grad scale x E/T x f over a row sum: ~1e-3), so kFdTol's rounding
    // floor (1e-16 |loss| / h, relative to max |gradient|) needs h = 1e-5: ~1e-8 relative, with a
    // truncation of h^2 x the third derivative < 1e-12. At h = 1e-6 one seed in ~800 gave 1.1e-7.
    EXPECT_LT(fd_check(s, ds, loss, 1e-5), kFdTol) << "kind " << static_cast<int>(kind);
    OwnedTensor s32 = test::clone(s, DType::kF32), ds32(DType::kF32, {T, E}), P32(DType::kF32, {E}), out32(DType::kF64, {1});
    test::fast().fill(ds32, 0.0);
    test::fast().fill(out32, 0.0);
    test::fast().load_balance_loss(s32, counts, kind, K, 0.7, 0.7, out32, ds32, P32);
    ref::fill(ds, 0.0);
    ref::fill(out, 0.0);
    ref::load_balance_loss(s, counts, kind, K, 0.7, 0.7, out, ds, P);
    EXPECT_LT(rel_error(out32, out), 1e-6);
    EXPECT_LT(rel_error(ds32, ds), 1e-6);
    EXPECT_LT(rel_error(P32, P), 1e-6);
  }
}

TEST_P(MoeRouting, RouterZLossGradientMatchesFiniteDifferences) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  // FD on few tokens: each gradient element is O(1/T) of a loss of O(lse^2), so with many tokens
  // the FD rounding error (1e-16 * |loss| / h) would approach the gradient itself.
  {
    const int64_t T = 24, E = 8;
    OwnedTensor z(DType::kF64, {T, E}), dz(DType::kF64, {T, E}), out(DType::kF64, {1});
    test::fill_uniform(z, seed, 16, -4, 4);
    ref::fill(dz, 0.0);
    ref::fill(out, 0.0);
    ref::router_z_loss(z, 1.0, 0.3, out, dz);
    auto loss = [&] {
      OwnedTensor o(DType::kF64, {1});
      ref::fill(o, 0.0);
      ref::router_z_loss(z, 0.3, 0.0, o, Tensor());
      return o.as<double>()[0];
    };
    EXPECT_LT(fd_check(z, dz, loss), kFdTol);
  }
  // backend vs ref over more than one 256-token reduction chunk, at E = 8 and 128 (the cpu
  // backend's remainder loop and its 16-lane blocks).
  for (const int64_t E : {8, 128}) {
    SCOPED_TRACE(testing::Message() << "E " << E);
    const int64_t T = 300;
    OwnedTensor z(DType::kF64, {T, E}), dz(DType::kF64, {T, E}), out(DType::kF64, {1});
    test::fill_uniform(z, seed, 16, -4, 4);
    ref::fill(dz, 0.0);
    ref::fill(out, 0.0);
    ref::router_z_loss(z, 1.0, 0.3, out, dz);
    OwnedTensor z32 = test::clone(z, DType::kF32), dz32(DType::kF32, {T, E}), out32(DType::kF64, {1});
    test::fast().fill(dz32, 0.0);
    test::fast().fill(out32, 0.0);
    test::fast().router_z_loss(z32, 1.0, 0.3, out32, dz32);
    EXPECT_LT(rel_error(out32, out), 1e-6);
    EXPECT_LT(rel_error(dz32, dz), 1e-5);
  }
}

TEST_P(MoeRouting, BiasUpdateFollowsTheSignOfTheLoadGap) {
  int32_t c[4] = {10, 2, 6, 6};  // mean 6
  Tensor counts(c, DType::kI32, {4});
  OwnedTensor bias(DType::kF32, {4});
  test::fast().fill(bias, 0.0);
  test::fast().router_bias_update(counts, 0.5, bias);
  EXPECT_EQ(bias.as<float>()[0], -0.5f);
  EXPECT_EQ(bias.as<float>()[1], 0.5f);
  EXPECT_EQ(bias.as<float>()[2], 0.0f);
}

TEST_P(MoeRouting, ReductionsAreBitwiseEqualWithOneAndTwoThreads) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 3000, E = 16, K = 4;
  OwnedTensor z(DType::kF32, {T, E}), s(DType::kF32, {T, E}), idx(DType::kI32, {T, K});
  test::fill_uniform(z, seed, 17, -2, 2);
  test::fast().router_scores_fwd(z, ScoreKind::kSoftmax, 0.0, s);
  test::fast().router_topk(s, Tensor(), 0, 0, idx);
  OwnedTensor counts(DType::kI32, {E}), off(DType::kI32, {E + 1}), sorted(DType::kI32, {T * K}), pos(DType::kI32, {T * K});
  test::fast().moe_plan(idx, counts, off, sorted, pos);
  auto run = [&](int threads) {
    cpu::set_num_threads(threads);  // reaches a backend's own worker thread too (strict)
    std::vector<OwnedTensor> r;
    r.emplace_back(DType::kF64, std::initializer_list<int64_t>{2});
    r.emplace_back(DType::kF32, std::initializer_list<int64_t>{T, E});
    r.emplace_back(DType::kF32, std::initializer_list<int64_t>{E});
    test::fast().fill(r[0], 0.0);
    test::fast().fill(r[1], 0.0);
    test::fast().load_balance_loss(s, counts, ScoreKind::kSoftmax, K, 1.0, 1.0, r[0].t.slice(0, 1), r[1], r[2]);
    test::fast().router_z_loss(z, 1.0, 1.0, r[0].t.slice(1, 2), r[1]);
    return r;
  };
  const int saved = omp_get_max_threads();
  auto a = run(1), b = run(2);
  cpu::set_num_threads(saved);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bitwise_equal(a[i], b[i])) << i;
}

// The cpu combine's element (t, d): 0, then + w_j ys_j for j in order, each product and sum
// rounded to f32 (its file compiles without contraction), then onto out when accumulating; 16
// elements at a time plus a scalar tail (D = 40). Emulated here in double: a product of two
// floats is exact there, and a double-rounded f32 sum equals the f32 sum (53 >= 2 * 24 + 2).
TEST(MoeCombineCpu, SumsEachElementInOrderWithF32Roundings) {
  const uint64_t seed = recorded_seed();
  SCOPED_TRACE(seed);
  const int64_t T = 37, D = 40, E = 5, K = 3, R = T * K;
  const Routed rt = routed(T, E, K, DType::kF32, seed, 21);
  const OwnedTensor &w = rt.w, &pos = rt.pos;
  OwnedTensor ys(DType::kF32, {R, D}), base(DType::kF32, {T, D});
  test::fill_uniform(ys, seed, 22, -3, 3);
  test::fill_uniform(base, seed, 23, -1, 1);
  const float* pw = w.t.as<float>();
  const float* py = ys.t.as<float>();
  const int32_t* pp = pos.t.as<int32_t>();
  auto f32 = [](double x) { return static_cast<float>(x); };
  for (bool accumulate : {false, true}) {
    OwnedTensor got = test::clone(base, DType::kF32), want = test::clone(base, DType::kF32);
    cpu::moe_combine(ys, pos, w, got, accumulate);
    float* pe = want.t.as<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int64_t j = 0; j < K; ++j)
          acc = f32(double{acc} + double{f32(double{pw[t * K + j]} * double{py[pp[t * K + j] * D + d]})});
        pe[t * D + d] = accumulate ? f32(double{pe[t * D + d]} + double{acc}) : acc;
      }
    EXPECT_TRUE(test::bitwise_equal(got, want)) << "accumulate " << accumulate;
  }
}

}  // namespace
}  // namespace moe
