// The parallel layout: world = PP x DP; EP divides DP; expert-data-parallel (EDP) = DP / EP.
//
// Rank ordering (global rank r in [0, pp*dp)):
//   pp_rank  = r / dp            pipeline stage; each stage is a contiguous block of dp ranks
//   dp_rank  = r % dp            data-parallel index inside the stage
//   ep_rank  = dp_rank % ep      expert-parallel index: EP groups are contiguous runs of ep ranks
//   edp_rank = dp_rank / ep      index among the replicas of the same expert shard
// Groups (each built with Communicator::split, ranks ordered by the index named on the right):
//   dp  : same pp_rank                         (size dp,  by dp_rank)   dense-weight replicas
//   ep  : same pp_rank and edp_rank            (size ep,  by ep_rank)   tokens travel inside it
//   edp : same pp_rank and ep_rank             (size dp/ep, by edp_rank) expert-weight replicas
//   pp  : same dp_rank                         (size pp,  by pp_rank)   activations send/recv
// Example pp=2, dp=4, ep=2: ranks 0..3 form stage 0; EP groups {0,1} {2,3} {4,5} {6,7};
// EDP groups {0,2} {1,3} {4,6} {5,7}; PP groups {0,4} {1,5} {2,6} {3,7}.
#pragma once

// Pure arithmetic over the layout sizes: no communicator, no config (config/config.h builds a
// Layout from [parallel]; parallel/process_groups.h splits the communicators).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe {

struct LayerRange {
  int64_t begin = 0, end = 0;  // layers [begin, end)
};

struct Layout {
  int64_t dp = 1, ep = 1, pp = 1;
  int64_t world() const { return dp * pp; }
  int64_t edp() const { return dp / ep; }
};

// Throws moe::Error naming the problem: "ep=3 does not divide dp=4",
// "num_experts=10 is not divisible by ep=4", "pp=5 exceeds the 4 layers",
// "world size 6 != pp=2 x dp=4 = 8". world_size < 0 skips the world check.
void validate_layout(const Layout& layout, int64_t world_size, int64_t num_experts, int64_t n_layers);

struct RankCoords {
  int64_t pp = 0, dp = 0, ep = 0, edp = 0;
};
RankCoords rank_coords(const Layout& layout, int64_t rank);
// Inverse of rank_coords (ep/edp are derived from dp).
int64_t global_rank(const Layout& layout, int64_t pp_rank, int64_t dp_rank);

// Layers [begin, end) of pipeline stage `stage`: contiguous, balanced (the first n_layers % pp
// stages get one layer more).
std::pair<int64_t, int64_t> stage_layers(int64_t n_layers, int64_t pp, int64_t stage);
// Layers of stage `stage` under parallel.stage_layers = counts (comma-separated layer counts per
// stage, contiguous in order; "" = stage_layers() above). Throws naming the key: not pp counts, a
// count that is not a positive integer, or counts not summing to n_layers.
std::pair<int64_t, int64_t> stage_layers_from_counts(const std::string& counts, int64_t pp, int64_t n_layers,
                                                     int64_t stage);

// The layer chunks of stage `stage` under interleaved pipelining (parallel.pp_interleave =
// chunks): the layers split into pp x chunks virtual stages (by counts as above, pp x chunks of
// them, or balanced), the stage holding virtual stages stage, stage + pp, ... in order. chunks = 1:
// the one range of stage_layers_from_counts.
std::vector<LayerRange> stage_chunks(const std::string& counts, int64_t pp, int64_t chunks, int64_t n_layers,
                                     int64_t stage);

}  // namespace moe
