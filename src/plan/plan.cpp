#include "plan/plan.h"

#include <algorithm>
#include <map>

#include "core/check.h"
#include "model/activations.h"
#include "model/params.h"
#include "model/exchange_bounds.h"
#include "plan/exchange_model.h"
#include "parallel/pipeline_schedule.h"

namespace moe {

int64_t group_size(const Layout& L, const std::string& group) {
  if (group == "world") return L.world();
  if (group == "dp") return L.dp;
  if (group == "ep") return L.ep;
  if (group == "edp") return L.edp();
  return L.pp;
}

double PlannedRank::bytes_sent() const {
  double n = 0;
  for (const PlannedCollective& c : comm) n += c.bytes;
  return n;
}

void apply_layout_arg(const std::string& arg, ParallelConfig& c) {
  std::map<std::string, int64_t*> keys = {{"dp", &c.dp}, {"ep", &c.ep}, {"pp", &c.pp}};
  std::map<std::string, bool> seen;
  size_t at = 0;
  while (at <= arg.size()) {
    const size_t comma = std::min(arg.find(',', at), arg.size());
    const std::string item = arg.substr(at, comma - at);
    const size_t eq = item.find('=');
    MOE_CHECK(eq != std::string::npos, "--layout: '", item, "' is not key=value (keys: dp, ep, pp; e.g. dp=4,ep=2,pp=2)");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    MOE_CHECK(keys.count(key), "--layout: unknown key '", key, "' (keys: dp, ep, pp)");
    MOE_CHECK(!seen[key], "--layout: ", key, " given twice");
    seen[key] = true;
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOE_CHECK(used == value.size() && !value.empty() && v >= 1, "--layout: ", key, "=", value,
              " is not a positive integer");
    *keys[key] = v;
    at = comma + 1;
  }
}

namespace {

// The first and last rank of one of this rank's groups and the stride between its members
// (config/layout.h's ordering: dp and ep groups are contiguous, edp strides by ep within the
// stage, pp by dp, the world is everyone).
struct GroupSpan {
  int64_t first = 0, last = 0;
};
GroupSpan group_span(const Layout& L, const RankCoords& me, const std::string& group) {
  const int64_t stage0 = me.pp * L.dp;
  if (group == "world") return {0, L.world() - 1};
  if (group == "dp") return {stage0, stage0 + L.dp - 1};
  if (group == "ep") return {stage0 + me.edp * L.ep, stage0 + me.edp * L.ep + L.ep - 1};
  if (group == "edp") return {stage0 + me.ep, stage0 + me.ep + (L.edp() - 1) * L.ep};
  return {me.dp, me.dp + (L.pp - 1) * L.dp};  // pp
}


struct RankTraffic {
  const Config& config;
  const Layout& L;
  RankCoords me;
  int64_t rank, ranks_per_node;
  std::vector<PlannedCollective> out;

  // One collective on `group` (nothing when the group is this rank alone).
  void add(const std::string& group, const char* op, const std::string& what, double calls, double bytes,
           bool exact = true, bool host = false, double received = 0, double groups = -1) {
    if (group_size(L, group) <= 1 || calls == 0) return;
    // Members are increasing in rank, so the group stays in one node iff its first and last do.
    std::string link = "node";
    const GroupSpan g = group_span(L, me, group);
    if (ranks_per_node > 0 && g.first / ranks_per_node != g.last / ranks_per_node) link = "network";
    out.push_back({group, op, what, calls, groups < 0 ? calls : groups, bytes, received, exact, host, link});
  }
};

// The step's sizes the traffic and memory follow, from the config.
struct StepShape {
  int64_t T = 0, K = 0, E = 0, D = 0;  // tokens per micro-batch, top-k, experts, model width
  int64_t M = 0, nm = 0;               // micro-batches per rank per step, MoE layers
  bool bf16 = false, padded = false;
  bool mx_dispatch = false;  // MXFP8 dispatch: the forward's rows go as e4m3 codes, then their e8m0 scales
  double cdt = 4, adt = 4;   // compute and GEMM-operand bytes per element
};

StepShape step_shape(const Config& config) {
  const ModelConfig& c = config.model;
  const TrainConfig& t = config.train;
  const ParallelConfig& pc = config.parallel;
  StepShape s;
  s.T = t.micro_batch_size * t.seq_len;
  s.K = c.top_k;
  s.E = c.num_experts;
  s.D = c.d_model;
  s.M = t.batch_size / (t.micro_batch_size * pc.dp);
  s.nm = c.num_moe_layers();
  s.bf16 = t.precision != "fp32";
  s.padded = pc.ep_transport == "padded";
  s.mx_dispatch = mx_mode(config).dispatch;
  s.adt = s.bf16 ? 2 : 4;
  return s;
}

// The trainer's checks, except that this build need not have the backend planned for (a CPU-only
// build plans GPU clusters).
void check_plannable(const Config& config, const PlanOptions& options) {
  Config checked = config;
  checked.train.backend = "cpu";
  if (checked.parallel.communicator == "nccl") checked.parallel.communicator = "mpi";
  checked.validate();
  MOE_CHECK(options.step >= 1, "plan: step ", options.step, " must be >= 1");
  MOE_CHECK(options.ranks_per_node >= 0, "plan: ranks per node ", options.ranks_per_node, " must be >= 0");
}

// Stage s: its layer chunks, activation slots and memory (the sharded-master total is the
// caller's: it needs the stage's parameter layout).
PlannedStage plan_stage(const Config& config, const Layout& L, const StepShape& sh, int64_t s) {
  const ModelConfig& c = config.model;
  const TrainConfig& t = config.train;
  const ParallelConfig& pc = config.parallel;
  PlannedStage st;
  st.chunks = configured_stage_chunks(pc, c.n_layers, s);
  st.layer_begin = st.chunks.front().begin;
  st.layer_end = st.chunks.back().end;
  for (const LayerRange& r : st.chunks)
    for (int64_t l = r.begin; l < r.end; ++l) st.moe_layers += c.is_moe_layer(l);
  st.chunk_slots = stage_chunk_slots(L.pp, s, sh.M, pc.pp_interleave);
  st.slots = *std::max_element(st.chunk_slots.begin(), st.chunk_slots.end());
  st.memory = estimate_stage_memory(config, s);
  // Sized by the expert rows: the arena less the same plan measured with none.
  Dims d = model_dims(c, t.micro_batch_size, t.seq_len, DType::kF32, sh.bf16, L.ep, pc.ep_capacity_factor, sh.padded,
                      mx_mode(config));
  d.Rx = 0;
  st.expert_row_buffers =
      st.memory.activations -
      static_cast<double>(ActivationPlan(c, d, StagePlan(st.chunks, st.chunk_slots, t.recompute), nullptr).bytes());
  if (t.backend == "cuda") st.checkpoint_host_bytes = st.memory.params + st.memory.optimizer;
  return st;
}

// Master weights and moments sharded over the replicas (dense over dp, experts over edp): the
// stage's total with 12 bytes per owned parameter in place of its parameters and moments.
double sharded_master_total(const MemoryEstimate& memory, const ParamLayout& whole, const Layout& L) {
  const double dense = static_cast<double>(whole.dense_end()), experts = static_cast<double>(whole.total() - whole.dense_end());
  const double owned = dense / static_cast<double>(L.dp) + experts / static_cast<double>(L.edp());
  return memory.total() - memory.params - memory.optimizer + 12 * owned;
}

// Pipeline::run: (T,D) compute-dtype activations forward, gradients back, stage 0's end-of-step
// token to every later stage.
void add_pipeline_traffic(RankTraffic& tr, const StepShape& sh) {
  const Layout& L = tr.L;
  const bool first = tr.me.pp == 0, last = tr.me.pp == L.pp - 1;
  const double act = static_cast<double>(sh.M * sh.T * sh.D) * sh.cdt, Md = static_cast<double>(sh.M);
  if (!last) tr.add("pp", "send", "activations", Md, act);
  if (!first) tr.add("pp", "recv", "activations", Md, 0, true, false, act);
  if (!first) tr.add("pp", "send", "activation gradients", Md, act);
  if (!last) tr.add("pp", "recv", "activation gradients", Md, 0, true, false, act);
  if (first) tr.add("pp", "send", "end-of-step token", static_cast<double>(L.pp - 1), 4.0 * static_cast<double>(L.pp - 1), true, true);
  if (!first) tr.add("pp", "recv", "end-of-step token", 1, 0, true, true, 4);
}

// The padded transport: every peer's slab of capacity rows goes out and comes back whole.
void add_padded_exchange(RankTraffic& tr, const StepShape& sh, double layers, double pairs_fwd) {
  const Layout& L = tr.L;
  const double slab = static_cast<double>((L.ep - 1) * exchange_slab_rows(sh.T, sh.K, sh.E, L.ep, tr.config.parallel.ep_capacity_factor) * sh.D);
  const double n = layers * static_cast<double>(sh.M);
  const double fwd = n * pairs_fwd;
  const double adt = sh.adt, cdt = sh.cdt;
  if (sh.mx_dispatch) {
    tr.add("ep", "all_to_all_v", "expert dispatch, fwd codes", fwd, fwd * slab, true, false, fwd * slab);
    tr.add("ep", "all_to_all_v", "expert dispatch, fwd scales", fwd, fwd * slab / 32, true, false,
           fwd * slab / 32);
  } else {
    tr.add("ep", "all_to_all_v", "expert dispatch, forward", fwd, fwd * slab * adt, true, false, fwd * slab * adt);
  }
  tr.add("ep", "all_to_all_v", "expert combine, forward", fwd, fwd * slab * cdt, true, false, fwd * slab * cdt);
  tr.add("ep", "all_to_all_v", "expert dispatch, backward", n, n * slab * adt, true, false, n * slab * adt);
  tr.add("ep", "all_to_all_v", "expert combine, backward", n, n * slab * cdt, true, false, n * slab * cdt);
}

// The point-to-point transport: this rank's blocks of rows, per micro-batch (rows: its EP group's
// exchange rows of each micro-batch).
void add_p2p_exchange(RankTraffic& tr, const StepShape& sh, double layers, double pairs_fwd,
                      const std::vector<std::vector<ExchangeRows>>& rows, bool exact) {
  double rows_out = 0, rows_back = 0, blocks_out = 0, blocks_back = 0;
  for (int64_t m = 0; m < sh.M; ++m) {
    const ExchangeRows& x = rows[static_cast<size_t>(m)][static_cast<size_t>(tr.me.ep)];
    rows_out += x.dispatched;
    rows_back += x.returned;
    blocks_out += static_cast<double>(x.send_blocks);
    blocks_back += static_cast<double>(x.return_blocks);
  }
  // Each move sends my side's blocks and receives the peers' (rows out toward the experts,
  // rows back to the tokens): forward (again under recompute), then the gradients.
  const double d = static_cast<double>(sh.D);
  const auto move = [&](const std::string& what, double times, double elem, bool to_experts) {
    const double sent = to_experts ? rows_out : rows_back, got = to_experts ? rows_back : rows_out;
    const double moves = layers * times * static_cast<double>(sh.M);
    tr.add("ep", "send", what, layers * times * (to_experts ? blocks_out : blocks_back), layers * times * sent * d * elem, exact,
           false, 0, moves);
    tr.add("ep", "recv", what, layers * times * (to_experts ? blocks_back : blocks_out), 0, exact, false,
           layers * times * got * d * elem, moves);
  };
  if (sh.mx_dispatch) {
    move("expert dispatch, fwd codes", pairs_fwd, 1, true);
    move("expert dispatch, fwd scales", pairs_fwd, 1.0 / 32, true);
  } else {
    move("expert dispatch, forward", pairs_fwd, sh.adt, true);
  }
  move("expert combine, forward", pairs_fwd, sh.cdt, false);
  // Backward: output gradients (operand dtype) to the experts, input gradients back.
  move("expert dispatch, backward", 1, sh.adt, true);
  move("expert combine, backward", 1, sh.cdt, false);
}

// GradSync::reduce_gradients: the dense region over dp, the experts over edp (the layout's padded
// regions; ZeRO-1: reduce-scatter, then all-gather of the updated chunks).
void add_gradient_traffic(RankTraffic& tr, const ParamLayout& held) {
  const ParallelConfig& pc = tr.config.parallel;
  const Layout& L = tr.L;
  const double dense = static_cast<double>(held.dense_end()), experts = static_cast<double>(held.total() - held.dense_end());
  if (pc.zero1) {
    const double dp = static_cast<double>(L.dp), edp = static_cast<double>(L.edp());
    if (dense > 0) tr.add("dp", "reduce_scatter", "dense gradients", 1, (dp - 1) * dense / dp * 4);
    if (experts > 0) tr.add("edp", "reduce_scatter", "expert gradients", 1, (edp - 1) * experts / edp * 4);
    if (dense > 0) tr.add("dp", "all_gather", "dense parameters", 1, (dp - 1) * dense / dp * 4);
    if (experts > 0) tr.add("edp", "all_gather", "expert parameters", 1, (edp - 1) * experts / edp * 4);
  } else if (pc.overlap_grad_reduce) {
    // Per layer as its backward ends (dense and expert ranges), then the parameters outside
    // the layers one by one: the regions' padding is not sent.
    double dense_calls = 0, dense_elems = 0, expert_calls = 0, expert_elems = 0;
    std::map<int64_t, bool> dense_layer, expert_layer;
    for (const ParamInfo& q : held.entries()) {
      if (q.is_expert) {
        expert_elems += static_cast<double>(q.numel);
        expert_layer[q.layer] = true;
      } else {
        dense_elems += static_cast<double>(q.numel);
        if (q.layer < 0) dense_calls += 1;
        else dense_layer[q.layer] = true;
      }
    }
    dense_calls += static_cast<double>(dense_layer.size());
    expert_calls += static_cast<double>(expert_layer.size());
    tr.add("dp", "all_reduce", "dense gradients", dense_calls, dense_elems * 4);
    tr.add("edp", "all_reduce", "expert gradients", expert_calls, expert_elems * 4);
  } else {
    if (dense > 0) tr.add("dp", "all_reduce", "dense gradients", 1, dense * 4);
    if (experts > 0) tr.add("edp", "all_reduce", "expert gradients", 1, experts * 4);
  }
}

// The backward's load-balancing counts (global granularity) and the step's statistics.
void add_statistics_traffic(RankTraffic& tr, const StepShape& sh, int64_t moe_layers) {
  // loss.lbl_granularity = "global": each MoE layer's counts of each micro-batch summed over dp
  // (E i32, in the backward; Olmo-core 3's global_load_balancing).
  if (tr.config.loss.lbl_granularity == "global" && moe_layers > 0) {
    const double n = static_cast<double>(moe_layers) * static_cast<double>(sh.M);
    tr.add("dp", "all_reduce", "load-balancing counts", n, n * static_cast<double>(sh.E) * 4);
  }
  // GradSync::reduce_stats over dp, then pp: loss terms (f64), per MoE layer counts (i32) and
  // mean probabilities (compute dtype) of the whole model.
  for (const char* g : {"dp", "pp"}) {
    tr.add(g, "all_reduce", "step statistics", static_cast<double>(1 + 2 * sh.nm),
           8.0 * static_cast<double>(2 + 2 * sh.nm) + static_cast<double>(sh.nm * sh.E) * (4 + sh.cdt));
  }
}

// Checkpoint shard (checkpoint/checkpoint.cpp): parameters from their first replica, Adam moments
// from their owners (ZeRO-1: the owned chunk's parameter elements), router biases of the stage's
// MoE layers from dp rank 0; fp32 throughout.
double checkpoint_shard_bytes(const Config& config, const Layout& L, const RankCoords& me, const ParamLayout& held,
                              const ParamLayout& unpadded, int64_t moe_layers) {
  double params = 0, moments = 0;
  for (const ParamInfo& q : unpadded.entries()) {
    const bool first_replica = q.is_expert ? me.edp == 0 : me.dp == 0;
    if (first_replica) params += static_cast<double>(q.numel);
  }
  if (config.parallel.zero1) {
    for (const ParamInfo& q : held.entries()) {
      const int64_t parts = q.is_expert ? L.edp() : L.dp, index = q.is_expert ? me.edp : me.dp;
      const int64_t begin = q.is_expert ? held.dense_end() : 0, length = q.is_expert ? held.total() - held.dense_end() : held.dense_end();
      const int64_t lo = begin + index * (length / parts), hi = lo + length / parts;
      moments += static_cast<double>(std::max<int64_t>(0, std::min(hi, q.offset + q.numel) - std::max(lo, q.offset)));
    }
  } else {
    moments = params;
  }
  return 4 * (params + 2 * moments) + (me.dp == 0 ? 4.0 * static_cast<double>(moe_layers * config.model.num_experts) : 0);
}

// Rank r's collectives over the step, in the order it issues them, and its checkpoint shard.
// rows: its EP group's exchange rows per micro-batch (empty without EP).
PlannedRank plan_rank(const Config& config, const Plan& p, const StepShape& sh, const PlanOptions& options, int64_t r,
                      const ParamLayout& held, const ParamLayout& unpadded,
                      const std::vector<std::vector<ExchangeRows>>& rows) {
  const Layout& L = p.layout;
  const RankCoords me = rank_coords(L, r);
  const PlannedStage& st = p.stages[static_cast<size_t>(me.pp)];
  RankTraffic tr{config, L, me, r, options.ranks_per_node, {}};
  // Trainer::enqueue_gradients: the global batch's loss tokens (host f64).
  tr.add("dp", "all_reduce", "loss tokens", 1, 8, true, true);
  add_pipeline_traffic(tr, sh);
  // Expert parallelism, per MoE layer and micro-batch: the count matrix once per plan, then rows
  // out and back in forward and backward, the forward pair again under recompute.
  if (L.ep > 1 && st.moe_layers > 0) {
    const double layers = static_cast<double>(st.moe_layers), pairs_fwd = config.train.recompute ? 2 : 1;
    tr.add("ep", "all_gather", "routing counts", layers * static_cast<double>(sh.M),
           layers * static_cast<double>(sh.M * (L.ep - 1) * sh.E) * 4);
    if (sh.padded) add_padded_exchange(tr, sh, layers, pairs_fwd);
    else add_p2p_exchange(tr, sh, layers, pairs_fwd, rows, p.exact_comm);
  }
  add_statistics_traffic(tr, sh, st.moe_layers);
  add_gradient_traffic(tr, held);
  // GradSync::grad_sumsq: every parameter's sum of squares (f64) over the world.
  tr.add("world", "all_reduce", "gradient norm sums", 1, 8.0 * static_cast<double>(held.num_global_params()));
  // Trainer::expert_parallel_stats: the exchange counters of every MoE layer (host f64).
  if (L.ep > 1) tr.add("edp", "all_reduce", "exchange counters", 1, 8.0 * static_cast<double>(sh.nm * (2 + L.ep)), true, true);
  PlannedRank pr;
  pr.rank = r;
  pr.coords = me;
  pr.comm = std::move(tr.out);
  pr.checkpoint_bytes = checkpoint_shard_bytes(config, L, me, held, unpadded, st.moe_layers);
  return pr;
}

}  // namespace

Plan make_plan(const Config& config, const PlanOptions& options) {
  check_plannable(config, options);
  const ModelConfig& c = config.model;
  const ParallelConfig& pc = config.parallel;
  Plan p;
  p.layout = layout_from_config(pc);
  const Layout& L = p.layout;
  validate_layout(L, -1, c.num_experts, c.n_layers);
  const StepShape sh = step_shape(config);
  const int64_t T = sh.T, K = sh.K, E = sh.E, M = sh.M;
  p.micro_batches = M;
  p.tokens_per_micro = T;
  p.expert_rows = L.ep > 1 ? expert_rows_bound(T, K, E, L.ep, pc.ep_capacity_factor) : T * K;
  p.capacity = L.ep > 1 ? expert_capacity(T, K, pc.ep_capacity_factor) : -1;
  p.exact_comm = c.routing == "uniform" || L.ep == 1;

  // Per stage: its memory, and the parameter layouts of its ranks (the same sizes and offsets for
  // every EP rank: only which experts differs), as the trainer pads them (ZeRO-1 chunks) and
  // unpadded (what a checkpoint writes).
  std::vector<ParamLayout> held_of, unpadded_of;
  for (int64_t s = 0; s < L.pp; ++s) {
    PlannedStage st = plan_stage(config, L, sh, s);
    ModelShard shard;
    shard.chunks = st.chunks;
    shard.num_local_experts = E / L.ep;
    held_of.emplace_back(c, shard, pc.zero1 ? L.dp : 1, pc.zero1 ? L.edp() : 1);
    unpadded_of.emplace_back(c, shard);
    st.total_sharded_master = sharded_master_total(st.memory, unpadded_of.back(), L);
    p.stages.push_back(st);
  }

  // Every EP group's exchange rows, per micro-batch: they depend on the group's data-parallel
  // ranks only (not on the stage), so each is computed once.
  std::vector<std::vector<std::vector<ExchangeRows>>> rows_of(static_cast<size_t>(L.ep > 1 ? L.edp() : 0));
  for (int64_t g = 0; g < static_cast<int64_t>(rows_of.size()); ++g)
    for (int64_t m = 0; m < M; ++m) rows_of[static_cast<size_t>(g)].push_back(exchange_rows(config, options.step, g * L.ep, m));
  static const std::vector<std::vector<ExchangeRows>> kNoExchange;
  // Drops of this step's exchanges (uniform) or expected (other routing), over every EP group.
  double routed = 0, dropped = 0;
  for (int64_t r = 0; r < L.world(); ++r) {
    const RankCoords me = rank_coords(L, r);
    const size_t stage = static_cast<size_t>(me.pp);
    const auto& rows = L.ep > 1 ? rows_of[static_cast<size_t>(me.edp)] : kNoExchange;
    p.ranks.push_back(plan_rank(config, p, sh, options, r, held_of[stage], unpadded_of[stage], rows));
    const int64_t moe_layers = p.stages[stage].moe_layers;
    if (L.ep > 1 && me.ep == 0 && moe_layers > 0)
      for (int64_t m = 0; m < M; ++m) {
        const ExchangeRows& x = rows[static_cast<size_t>(m)][0];
        routed += x.routed * static_cast<double>(moe_layers);
        dropped += x.dropped * static_cast<double>(moe_layers);
      }
  }
  p.drop_fraction = routed > 0 ? dropped / routed : 0;
  if (L.ep > 1 && p.capacity >= 0)
    for (double skew : {0.0, 0.5, 1.0}) p.skewed_drops.emplace_back(skew, expected_drop_fraction_skewed(config, skew));
  return p;
}

}  // namespace moe
