#include "parallel/layout.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"

namespace moe {

void validate_layout(const Layout& l, int64_t world_size, int64_t num_experts, int64_t n_layers) {
  MOE_CHECK(l.dp >= 1 && l.ep >= 1 && l.pp >= 1, "parallel sizes must be at least 1 (dp=", l.dp, ", ep=", l.ep,
            ", pp=", l.pp, ")");
  MOE_CHECK(l.dp % l.ep == 0, "ep=", l.ep, " does not divide dp=", l.dp);
  MOE_CHECK(num_experts % l.ep == 0, "num_experts=", num_experts, " is not divisible by ep=", l.ep);
  MOE_CHECK(l.pp <= n_layers, "pp=", l.pp, " exceeds the ", n_layers, " layers");
  if (world_size >= 0)
    MOE_CHECK(world_size == l.world(), "world size ", world_size, " != pp=", l.pp, " x dp=", l.dp, " = ",
              l.world(), " (launch with mpirun -np ", l.world(), ")");
}

Layout layout_from_config(const ParallelConfig& c) { return Layout{c.dp, c.ep, c.pp}; }

RankCoords rank_coords(const Layout& l, int64_t rank) {
  MOE_CHECK(rank >= 0 && rank < l.world(), "rank ", rank, " is outside the world of ", l.world());
  RankCoords c;
  c.pp = rank / l.dp;
  c.dp = rank % l.dp;
  c.ep = c.dp % l.ep;
  c.edp = c.dp / l.ep;
  return c;
}

int64_t global_rank(const Layout& l, int64_t pp_rank, int64_t dp_rank) { return pp_rank * l.dp + dp_rank; }

std::pair<int64_t, int64_t> stage_layers(int64_t n_layers, int64_t pp, int64_t stage) {
  MOE_CHECK(pp >= 1 && pp <= n_layers && stage >= 0 && stage < pp, "stage ", stage, " of pp=", pp, " over ",
            n_layers, " layers");
  const int64_t base = n_layers / pp, extra = n_layers % pp;
  const int64_t begin = stage * base + std::min(stage, extra);
  return {begin, begin + base + (stage < extra ? 1 : 0)};
}

std::pair<int64_t, int64_t> configured_stage_layers(const ParallelConfig& c, int64_t n_layers, int64_t stage) {
  if (c.stage_layers.empty()) return stage_layers(n_layers, c.pp, stage);
  std::vector<int64_t> counts;
  std::stringstream in(c.stage_layers);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    while (used < item.size() && item[used] == ' ') ++used;
    MOE_CHECK(used == item.size() && !item.empty() && n >= 1, "parallel.stage_layers = \"", c.stage_layers,
              "\": '", item, "' is not a positive layer count (every stage needs at least one layer)");
    counts.push_back(n);
  }
  MOE_CHECK(static_cast<int64_t>(counts.size()) == c.pp, "parallel.stage_layers = \"", c.stage_layers, "\" has ",
            counts.size(), " stages, but parallel.pp = ", c.pp);
  int64_t sum = 0;
  for (int64_t n : counts) sum += n;
  MOE_CHECK(sum == n_layers, "parallel.stage_layers = \"", c.stage_layers, "\" sums to ", sum,
            " layers, but model.n_layers = ", n_layers);
  MOE_CHECK(stage >= 0 && stage < c.pp, "stage ", stage, " of pp=", c.pp);
  int64_t begin = 0;
  for (int64_t s = 0; s < stage; ++s) begin += counts[static_cast<size_t>(s)];
  return {begin, begin + counts[static_cast<size_t>(stage)]};
}

ProcessGroups make_process_groups(Communicator& world, const Layout& l) {
  MOE_CHECK(world.size() == l.world(), "world size ", world.size(), " != pp=", l.pp, " x dp=", l.dp, " = ",
            l.world());
  ProcessGroups g;
  g.layout = l;
  g.world = &world;
  g.coords = rank_coords(l, world.rank());
  const RankCoords& c = g.coords;
  auto i = [](int64_t v) { return static_cast<int>(v); };
  g.dp = world.split(i(c.pp), i(c.dp));
  g.ep = world.split(i(c.pp * l.edp() + c.edp), i(c.ep));
  g.edp = world.split(i(c.pp * l.ep + c.ep), i(c.edp));
  g.pp = world.split(i(c.dp), i(c.pp));
  return g;
}

}  // namespace moe
