// The planner: what a training layout costs before it runs, from the same parameter layout,
// activation plan and exchange arithmetic the trainer uses (one source of truth).
//   - memory per pipeline stage by component (MemoryEstimate: plan/memory.h, so one process's
//     plan is `moecore config`'s estimate and the trainer's arena), the ZeRO variant that also
//     shards the fp32 master weights (not in the trainer), and each rank's checkpoint shard;
//   - communication per optimizer step, per rank, per collective: bytes as the Communicator's
//     byte counters define them (parallel/communicator.h), calls, and the link it crosses.
// Exact for model.routing = "uniform"; the balanced-routing expectation otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "plan/memory.h"
#include "config/layout.h"

namespace moe {

// What a step sends over one communicator with one kind of operation, for one purpose.
struct PlannedCollective {
  std::string group;  // world | dp | ep | edp | pp (config/layout.h)
  std::string op;     // comm_op_name: all_reduce, reduce_scatter, all_gather, all_to_all_v, send, recv
  std::string what;   // what it carries ("dense gradients", "expert dispatch, forward", ...)
  double calls = 0;   // operations per step (messages, for send and recv)
  // Of which issued together (an expert move's messages to every peer progress as one grouped
  // exchange): the time model pays latency and message-size efficiency per group.
  double groups = 0;
  double bytes = 0;   // payload this rank sends per step (the byte counters' definition)
  double received = 0;  // payload it receives (counted for recv and all_to_all_v only)
  bool exact = true;  // false: an expectation (routing other than "uniform")
  bool host = false;  // host scalars (never staged through a device)
  std::string link;   // "node": every member of the group in this rank's node; else "network"
};

struct PlannedRank {
  int64_t rank = 0;
  RankCoords coords;
  std::vector<PlannedCollective> comm;
  double checkpoint_bytes = 0;  // tensor payload this rank writes per checkpoint
  double bytes_sent() const;
};

struct PlannedStage {
  int64_t layer_begin = 0, layer_end = 0, moe_layers = 0;  // the layers the stage's chunks span
  int64_t slots = 1;  // micro-batches whose activations the stage holds (1F1B; interleaved: its busiest chunk)
  // Interleaved pipelining (parallel.pp_interleave): the stage's layer chunks and their slots
  // (one chunk otherwise).
  std::vector<LayerRange> chunks;
  std::vector<int64_t> chunk_slots;
  MemoryEstimate memory;
  // The variant that also shards fp32 master weights over the replicas (Olmo-core's distributed
  // optimizer: 6 + 12/D bytes per parameter in bf16); not in the trainer.
  double total_sharded_master = 0;
  // Sized by the expert rows (Rx): the arena less the same plan with no expert rows.
  double expert_row_buffers = 0;
  // Host memory a checkpoint save stages on a rank whose backend memory the host cannot address
  // (cuda: copies of the parameters and the moments it holds); 0 on cpu, where it writes in place.
  double checkpoint_host_bytes = 0;
};

struct PlanOptions {
  int64_t step = 1;            // the optimizer step whose traffic is predicted (uniform routing)
  int64_t ranks_per_node = 0;  // 0: every rank in one node
};

struct Plan {
  Layout layout;
  int64_t micro_batches = 0;   // per rank per step
  int64_t tokens_per_micro = 0;
  int64_t expert_rows = 0;     // Rx: rows a rank's experts may compute per micro-batch
  int64_t capacity = -1;       // kept rows per receiving rank (-1: dropless)
  double drop_fraction = 0;    // of the routes, this step (uniform) or expected (random routing)
  // With EP and a capacity: expected drops if the routing were skewed, (skew, fraction) for
  // Zipf-like expert popularity (exchange_model.h); what the capacity costs a router that is not
  // balanced.
  std::vector<std::pair<double, double>> skewed_drops;
  bool exact_comm = true;
  std::vector<PlannedStage> stages;
  std::vector<PlannedRank> ranks;  // every rank of the world, in rank order
  const PlannedStage& stage_of(const PlannedRank& r) const { return stages[static_cast<size_t>(r.coords.pp)]; }
};

// Ranks in a group of this layout: "world", "dp", "ep", "edp" or "pp" (config/layout.h).
int64_t group_size(const Layout& layout, const std::string& group);

// "dp=4,ep=2,pp=2" (any order, each at most once; missing keys keep the config's) into c.parallel.
// Errors name the bad entry.
void apply_layout_arg(const std::string& arg, ParallelConfig& c);

// The plan of config's [parallel] layout (validated as the trainer does: errors name the key).
Plan make_plan(const Config& config, const PlanOptions& options = {});

// Terminal tables and JSON (every number at full precision, for scripts and the page).
std::string format_plan(const Config& config, const Plan& plan);
std::string plan_to_json(const Config& config, const Plan& plan);

}  // namespace moe
