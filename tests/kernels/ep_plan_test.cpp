// ep_plan through every backend against a row-by-row simulation of the exchange (each routed
// row placed or dropped one at a time), and its argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "core/rng.h"

namespace moe {
namespace {

MOE_BACKEND_SUITE(EpPlan);

struct Expected {
  std::vector<int32_t> kept, local_begin, recv_begin, recv_offsets, totals;
};

// Every row of the group walks to its receiving rank in receive order (local expert, source,
// token order); a rank keeps rows while it has room.
Expected simulate(const std::vector<int32_t>& counts, int64_t ep, int64_t E, int64_t me, int64_t capacity) {
  const int64_t El = E / ep;
  Expected x;
  x.kept.assign(static_cast<size_t>(ep * E), 0);
  x.totals.assign(static_cast<size_t>(4 + ep), 0);
  for (int64_t r = 0; r < ep; ++r) {
    int64_t room = capacity < 0 ? INT64_MAX : capacity;
    for (int64_t e = r * El; e < (r + 1) * El; ++e)
      for (int64_t s = 0; s < ep; ++s)
        for (int32_t row = 0; row < counts[static_cast<size_t>(s * E + e)]; ++row) {
          ++x.totals[2];
          if (room > 0) {
            --room;
            ++x.kept[static_cast<size_t>(s * E + e)];
            ++x.totals[static_cast<size_t>(4 + r)];
          } else {
            ++x.totals[3];
          }
        }
  }
  // My rows are expert-major over the global experts; my receive buffer (local expert, source).
  int32_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    x.local_begin.push_back(row);
    row += counts[static_cast<size_t>(me * E + e)];
  }
  row = 0;
  x.recv_offsets.push_back(0);
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t s = 0; s < ep; ++s) {
      x.recv_begin.push_back(row);
      row += x.kept[static_cast<size_t>(s * E + me * El + e)];
    }
    x.recv_offsets.push_back(row);
  }
  x.totals[0] = row;
  for (int64_t e = 0; e < E; ++e)
    if (e / El != me) x.totals[1] += x.kept[static_cast<size_t>(me * E + e)];
  return x;
}

std::vector<int32_t> values(const OwnedTensor& t) {
  const int32_t* p = t.as<int32_t>();
  return std::vector<int32_t>(p, p + t.t.numel());
}

TEST_P(EpPlan, MatchesARowByRowSimulation) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  uint64_t draw = 0;
  for (int64_t ep : {1, 2, 3, 4})
    for (int64_t per_rank : {1, 2, 5})
      for (int64_t capacity : {-1, 0, 1, 7, 40, 100000}) {
        const int64_t E = ep * per_rank;
        std::vector<int32_t> counts(static_cast<size_t>(ep * E));
        for (int32_t& c : counts) {  // zeros often, some large blocks
          const uint32_t u = random_words(seed, static_cast<uint64_t>(RngStream::kTest), draw++)[0];
          c = u % 3 == 0 ? 0 : static_cast<int32_t>(u % 29);
        }
        for (int64_t me = 0; me < ep; ++me) {
          SCOPED_TRACE("ep " + std::to_string(ep) + " E " + std::to_string(E) + " rank " + std::to_string(me) +
                       " capacity " + std::to_string(capacity));
          const int64_t El = E / ep;
          OwnedTensor c(DType::kI32, {ep, E}), kept(DType::kI32, {ep, E}), lb(DType::kI32, {E}),
              rb(DType::kI32, {El, ep}), off(DType::kI32, {El + 1}), tot(DType::kI32, {4 + ep});
          std::copy(counts.begin(), counts.end(), c.as<int32_t>());
          for (const OwnedTensor* t : {&kept, &lb, &rb, &off, &tot}) test::poison(*t);
          test::fast().ep_plan(c, me, capacity, kept, lb, rb, off, tot);
          const Expected x = simulate(counts, ep, E, me, capacity);
          EXPECT_EQ(values(kept), x.kept);
          EXPECT_EQ(values(lb), x.local_begin);
          EXPECT_EQ(values(rb), x.recv_begin);
          EXPECT_EQ(values(off), x.recv_offsets);
          EXPECT_EQ(values(tot), x.totals);
        }
      }
}

TEST_P(EpPlan, RefusesBadArgumentsNamingThem) {
  OwnedTensor c(DType::kI32, {2, 4}), kept(DType::kI32, {2, 4}), lb(DType::kI32, {4}), rb(DType::kI32, {2, 2}),
      off(DType::kI32, {3}), tot(DType::kI32, {6});
  test::fast().fill(c, 1.0);
  const auto err = [&](int64_t rank, const Tensor& counts, const Tensor& totals) {
    return test::error_of([&] { test::fast().ep_plan(counts, rank, -1, kept, lb, rb, off, totals); });
  };
  EXPECT_NE(err(2, c, tot).find("ep_plan: rank 2 outside the group of 2"), std::string::npos);
  EXPECT_NE(err(0, c, OwnedTensor(DType::kI32, {5})).find("ep_plan totals"), std::string::npos);
  OwnedTensor odd(DType::kI32, {3, 4});
  EXPECT_NE(err(0, odd, tot).find("4 experts do not divide over 3 ranks"), std::string::npos);
  c.as<int32_t>()[5] = -3;
  // cuda checks the counts on the device: source * E + expert is the index of its error.
  EXPECT_TRUE(test::says(err(0, c, tot), {"negative count -3 (source 1, expert 1)"},
                         {"ep_plan: invalid value -3 at index 5"}));
}

}  // namespace
}  // namespace moe
