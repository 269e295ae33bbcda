// Layout validation messages, rank coordinates, and the process groups built on the world.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "config/config.h"
#include "parallel/process_groups.h"
#include "world.h"

namespace moe::test {
namespace {

std::string error_of(const Layout& l, int64_t world, int64_t experts, int64_t layers) {
  try {
    validate_layout(l, world, experts, layers);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Layout, ValidationNamesTheProblem) {
  EXPECT_NE(error_of({4, 3, 1}, 4, 12, 4).find("ep=3 does not divide dp=4"), std::string::npos);
  EXPECT_NE(error_of({4, 4, 1}, 4, 10, 4).find("num_experts=10 is not divisible by ep=4"), std::string::npos);
  EXPECT_NE(error_of({1, 1, 5}, 5, 8, 4).find("pp=5 exceeds the 4 layers"), std::string::npos);
  EXPECT_NE(error_of({4, 2, 2}, 6, 8, 4).find("world size 6 != pp=2 x dp=4 = 8"), std::string::npos);
  EXPECT_EQ(error_of({4, 2, 2}, 8, 8, 4), "");
  EXPECT_EQ(error_of({4, 2, 2}, -1, 8, 4), "");
}

TEST(Layout, ConfigSectionValidates) {
  const Config c = parse_config("", {"parallel.dp=4", "parallel.ep=2", "parallel.pp=2", "train.micro_batch_size=4"});
  EXPECT_EQ(c.parallel.dp, 4);
  EXPECT_EQ(c.parallel.ep, 2);
  EXPECT_EQ(c.parallel.pp, 2);
  EXPECT_EQ(parse_config("", {}).parallel.dp, 1);
  try {
    parse_config("", {"parallel.dp=4", "parallel.ep=3", "train.micro_batch_size=4"});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ep=3 does not divide dp=4"), std::string::npos) << e.what();
  }
}

TEST(Layout, RankCoordinates) {
  const Layout l{4, 2, 2};
  const RankCoords c5 = rank_coords(l, 5);
  EXPECT_EQ(c5.pp, 1);
  EXPECT_EQ(c5.dp, 1);
  EXPECT_EQ(c5.ep, 1);
  EXPECT_EQ(c5.edp, 0);
  for (int64_t r = 0; r < l.world(); ++r) {
    const RankCoords c = rank_coords(l, r);
    EXPECT_EQ(global_rank(l, c.pp, c.dp), r);
    EXPECT_EQ(c.edp * l.ep + c.ep, c.dp);
  }
}

// For every layout that fits the world: each group holds exactly the ranks the header says,
// in the documented order.
TEST(Layout, ProcessGroupsMatchCoordinates) {
  Communicator& w = world();
  const int64_t n = w.size();
  int tried = 0;
  for (int64_t pp = 1; pp <= n; ++pp) {
    if (n % pp) continue;
    const int64_t dp = n / pp;
    for (int64_t ep = 1; ep <= dp; ++ep) {
      if (dp % ep) continue;
      const Layout l{dp, ep, pp};
      validate_layout(l, n, 8, 4);
      ProcessGroups g = make_process_groups(w, l);
      const RankCoords me = rank_coords(l, w.rank());
      auto members = [&](Communicator& c) {
        std::vector<int32_t> out(static_cast<size_t>(c.size()));
        int32_t r = w.rank();
        c.all_gather(&r, out.data(), 1, DType::kI32);
        return out;
      };
      auto expect = [&](auto same, auto order) {
        std::vector<int32_t> e;
        for (int64_t r = 0; r < n; ++r)
          if (same(rank_coords(l, r))) e.push_back(static_cast<int32_t>(r));
        std::sort(e.begin(), e.end(),
                  [&](int32_t a, int32_t b) { return order(rank_coords(l, a)) < order(rank_coords(l, b)); });
        return e;
      };
      SCOPED_TRACE("pp=" + std::to_string(pp) + " dp=" + std::to_string(dp) + " ep=" + std::to_string(ep));
      EXPECT_EQ(members(*g.dp), expect([&](RankCoords c) { return c.pp == me.pp; }, [](RankCoords c) { return c.dp; }));
      EXPECT_EQ(members(*g.ep), expect([&](RankCoords c) { return c.pp == me.pp && c.edp == me.edp; },
                                       [](RankCoords c) { return c.ep; }));
      EXPECT_EQ(members(*g.edp), expect([&](RankCoords c) { return c.pp == me.pp && c.ep == me.ep; },
                                        [](RankCoords c) { return c.edp; }));
      EXPECT_EQ(members(*g.pp), expect([&](RankCoords c) { return c.dp == me.dp; }, [](RankCoords c) { return c.pp; }));
      EXPECT_EQ(g.dp->rank(), me.dp);
      EXPECT_EQ(g.ep->rank(), me.ep);
      EXPECT_EQ(g.edp->rank(), me.edp);
      EXPECT_EQ(g.pp->rank(), me.pp);
      ++tried;
    }
  }
  EXPECT_GE(tried, 1);
}

}  // namespace
}  // namespace moe::test
