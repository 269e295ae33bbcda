#include "config/layout.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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

std::pair<int64_t, int64_t> stage_layers_from_counts(const std::string& spec, int64_t pp, int64_t n_layers,
                                                     int64_t stage) {
  if (spec.empty()) return stage_layers(n_layers, pp, stage);
  std::vector<int64_t> counts;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    while (used < item.size() && item[used] == ' ') ++used;
    MOE_CHECK(used == item.size() && !item.empty() && n >= 1, "parallel.stage_layers = \"", spec,
              "\": '", item, "' is not a positive layer count (every stage needs at least one layer)");
    counts.push_back(n);
  }
  MOE_CHECK(static_cast<int64_t>(counts.size()) == pp, "parallel.stage_layers = \"", spec, "\" has ",
            counts.size(), " stages, but parallel.pp = ", pp);
  int64_t sum = 0;
  for (int64_t n : counts) sum += n;
  MOE_CHECK(sum == n_layers, "parallel.stage_layers = \"", spec, "\" sums to ", sum,
            " layers, but model.n_layers = ", n_layers);
  MOE_CHECK(stage >= 0 && stage < pp, "stage ", stage, " of pp=", pp);
  int64_t begin = 0;
  for (int64_t s = 0; s < stage; ++s) begin += counts[static_cast<size_t>(s)];
  return {begin, begin + counts[static_cast<size_t>(stage)]};
}

std::vector<LayerRange> stage_chunks(const std::string& counts, int64_t pp, int64_t chunks, int64_t n_layers,
                                     int64_t stage) {
  MOE_CHECK(chunks >= 1, "parallel.pp_interleave = ", chunks, " must be at least 1");
  MOE_CHECK(pp * chunks <= n_layers, "parallel.pp x parallel.pp_interleave = ", pp, " x ", chunks, " = ", pp * chunks,
            " virtual stages exceed the ", n_layers, " layers (each needs at least one)");
  if (chunks > 1 && !counts.empty()) {
    const auto n = std::count(counts.begin(), counts.end(), ',') + 1;
    MOE_CHECK(n == pp * chunks, "parallel.stage_layers = \"", counts, "\" has ", n,
              " counts, but interleaving needs one per chunk: parallel.pp x parallel.pp_interleave = ", pp, " x ", chunks);
  }
  std::vector<LayerRange> out;
  for (int64_t k = 0; k < chunks; ++k) {
    const auto [begin, end] = stage_layers_from_counts(counts, pp * chunks, n_layers, k * pp + stage);
    out.push_back({begin, end});
  }
  return out;
}

}  // namespace moe

