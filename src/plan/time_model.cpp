#include "plan/time_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "plan/exchange_model.h"
#include "plan/pipeline_sim.h"

namespace moe {

namespace {

struct Roofline {
  const DeviceSpec& dev;
  double peak;       // GEMM operand precision's peak
  double attn_eff;   // attention's fraction of it
  double cap = 1;    // the power cap's factor on GEMM rates (1: uncapped)
  double gemm(double m, double n, double k, double peak_flops) const {
    const double flops = 2 * m * n * k;
    return flops / (peak_flops * dev.gemm_efficiency.at(flops) * cap);
  }
  double gemm(double m, double n, double k) const { return gemm(m, n, k, peak); }
  // One grouped GEMM over `experts` groups of rows_per_expert rows each: the dense rate of a GEMM
  // of its whole size, scaled by the grouped efficiency at its rows per expert.
  double grouped(double rows_per_expert, double experts, double n, double k) const {
    if (rows_per_expert <= 0) return 0;
    const double flops = 2 * experts * rows_per_expert * n * k;
    return flops / (peak * dev.gemm_efficiency.at(flops) * cap * dev.grouped_efficiency.at(rows_per_expert));
  }
  double memory(double bytes) const { return bytes / (dev.memory_bytes_per_s * dev.memory_efficiency); }
};

// One collective call's time on a link: latency + wire bytes at the size-dependent rate.
double call_time(const LinkSpec& link, double wire_bytes) {
  if (wire_bytes <= 0) return link.latency_s;
  return link.latency_s + wire_bytes / (link.bytes_per_s * link.efficiency.at(wire_bytes));
}

// A planned collective's time per step: groups of equal size; all-reduce moves 2 (n-1)/n of its
// payload per rank (ring), the other operations' counters already are what leaves the rank. A
// receive is the other end of a send and costs nothing more.
double collective_time(const PlannedCollective& c, const Cluster& cl, const Layout& L) {
  if (c.groups <= 0 || c.op == "recv") return 0;
  const LinkSpec& link = c.link == "network" ? cl.inter : cl.intra;
  const double n = static_cast<double>(group_size(L, c.group));
  const double per_group = c.bytes / c.groups;
  const double wire = c.op == "all_reduce" ? per_group * 2 * (n - 1) / n : per_group;
  return c.groups * call_time(link, wire);
}

bool is_exchange(const PlannedCollective& c) { return c.group == "ep"; }
bool is_pipeline(const PlannedCollective& c) { return c.group == "pp" && c.what != "step statistics"; }

// One layer's compute on one micro-batch, from the roofline and the model's shape.
struct LayerCost {
  const ModelConfig& c;
  const Roofline& roof;
  double fp32_flops;  // the router runs in fp32
  int64_t seq_len;
  double T, S, D, hd, H, G, E, F, El, a;  // a: operand bytes
  // Rows one rank's experts compute per micro-batch: all routes of its tokens without EP; with EP
  // T K on average (the group's tokens spread over the ranks), less the drops.
  double rows;

  // Attention's QK^T and PV of one layer on one micro-batch: causal, cut by a sliding window.
  double attention_s(int64_t layer) const {
    return 4 * T * H * hd * (c.attention_pairs(layer, seq_len) / S) / (roof.peak * roof.attn_eff);
  }
  // Forward time of one layer on one micro-batch (and, into *grouped, its grouped expert GEMMs').
  double forward(int64_t layer, double* grouped) const {
    const bool moe = c.is_moe_layer(layer);
    double s = roof.gemm(T, H * hd, D) + 2 * roof.gemm(T, G * hd, D) + roof.gemm(T, D, H * hd);
    s += attention_s(layer);
    double bytes = 4 * T * D * 10 + 8 * T * (H + 2 * G) * hd;   // norms, residual adds; QK-norm, RoPE
    if (moe) {
      s += roof.gemm(T, E, D, fp32_flops);  // the router runs in fp32
      const double g = 3 * roof.grouped(rows / El, El, F, D);
      s += g;
      if (grouped) *grouped += g;
      if (c.shared_hidden > 0) s += 3 * roof.gemm(T, static_cast<double>(c.shared_width()), D);
      if (c.shared_router) s += roof.gemm(T, static_cast<double>(c.shared_experts), D, fp32_flops);
      bytes += 12 * T * E + rows * D * (2 * a + 4) + 3 * rows * F * a;  // scores, gather, SwiGLU, combine
    } else {
      const double Fd = static_cast<double>(c.dense_width());
      s += 3 * roof.gemm(T, Fd, D);
      bytes += 3 * T * Fd * a;
    }
    return s + roof.memory(bytes);
  }
  // Data and weight gradients: twice the forward GEMMs; attention's backward 2.5x its forward.
  double backward(int64_t layer, double* grouped) const {
    const double fwd_attn = attention_s(layer);
    double g = 0;
    const double f = forward(layer, &g);
    if (grouped) *grouped += 2 * g;
    return 2 * (f - fwd_attn) + 2.5 * fwd_attn;
  }
};

LayerCost layer_cost(const Config& config, const Plan& plan, const Roofline& roof, bool bf16) {
  const ModelConfig& c = config.model;
  const double T = static_cast<double>(plan.tokens_per_micro);
  const double E = static_cast<double>(c.num_experts), K = static_cast<double>(c.top_k);
  return {c,
          roof,
          roof.dev.fp32_flops,
          config.train.seq_len,
          T,
          static_cast<double>(config.train.seq_len),
          static_cast<double>(c.d_model),
          static_cast<double>(c.hd()),
          static_cast<double>(c.n_heads),
          static_cast<double>(c.n_kv_heads),
          E,
          static_cast<double>(c.expert_hidden),
          E / static_cast<double>(plan.layout.ep),
          bf16 ? 2.0 : 4.0,
          T * K * (1 - plan.drop_fraction)};
}

// The slowest rank of stage s: its exchanges per micro-batch (forward, backward), its sync after
// the pipeline, and its largest pipeline send per micro-batch (ranks of a stage differ in traffic).
struct StageTraffic {
  double fwd_ex = 0, bwd_ex = 0, sync = 0, xfer = 0;
};
StageTraffic stage_traffic(const Plan& plan, const Cluster& cl, size_t s, bool recompute) {
  const Layout& L = plan.layout;
  const double M = static_cast<double>(plan.micro_batches);
  StageTraffic out;
  for (const PlannedRank& r : plan.ranks) {
    if (r.coords.pp != static_cast<int64_t>(s)) continue;
    double f = 0, b = 0, y = 0, p = 0;
    for (const PlannedCollective& col : r.comm) {
      const double time = collective_time(col, cl, L);
      if (is_exchange(col)) {
        // Under recompute the plan's forward moves happen twice, the second time inside the
        // backward; the count gather happens once.
        const bool move_fwd = col.what.find("forward") != std::string::npos;
        const double share = move_fwd && recompute ? 0.5 : 1;
        if (col.what == "routing counts" || move_fwd) f += share * time / M;
        if (!move_fwd && col.what != "routing counts") b += time / M;
        if (move_fwd && recompute) b += share * time / M;
      } else if (is_pipeline(col)) {
        if (col.op == "send" && col.what != "end-of-step token") p = std::max(p, time / M);
      } else {
        y += time;
      }
    }
    out.fwd_ex = std::max(out.fwd_ex, f);
    out.bwd_ex = std::max(out.bwd_ex, b);
    out.sync = std::max(out.sync, y);
    out.xfer = std::max(out.xfer, p);
  }
  return out;
}

// Stage s's time per micro-batch (compute, exchanges, transfers) and after the pipeline (sync,
// optimizer).
StageTime stage_time(const Config& config, const Plan& plan, const Cluster& cl, const TimeOptions& options,
                     const LayerCost& cost, size_t s) {
  const OverlapModel& overlap = options.overlap;
  const ModelConfig& c = config.model;
  const TrainConfig& t = config.train;
  const Roofline& roof = cost.roof;
  const bool bf16 = t.precision != "fp32";
  const double T = cost.T, D = cost.D, V = static_cast<double>(c.vocab_size);
  const PlannedStage& st = plan.stages[s];
  StageTime x;
  for (const LayerRange& r : st.chunks)
    for (int64_t l = r.begin; l < r.end; ++l) {
      x.forward_compute_s += cost.forward(l, &x.grouped_s);
      x.backward_compute_s += cost.backward(l, &x.grouped_s) + (t.recompute ? cost.forward(l, &x.grouped_s) : 0);
    }
  if (st.layer_begin == 0) x.backward_compute_s += roof.memory(3 * T * D * 4);  // embedding
  if (st.layer_end == c.n_layers) x.backward_compute_s += 3 * roof.gemm(T, V, D) + roof.memory(4 * T * V * 4);
  StageTraffic tr = stage_traffic(plan, cl, s, t.recompute);
  // Overlap (not in the trainer): part of each exchange hidden behind compute, the grouped GEMMs
  // that run beside it slowed down (split between forward and backward as their shares).
  if (overlap.exchange_hidden > 0 && tr.fwd_ex + tr.bwd_ex > 0) {
    const double slower = overlap.grouped_slowdown * x.grouped_s;
    const double f_share = x.forward_compute_s / (x.forward_compute_s + x.backward_compute_s);
    x.forward_compute_s += slower * f_share;
    x.backward_compute_s += slower * (1 - f_share);
    tr.fwd_ex *= 1 - overlap.exchange_hidden;
    tr.bwd_ex *= 1 - overlap.exchange_hidden;
  }
  x.forward_exchange_s = tr.fwd_ex;
  x.backward_exchange_s = tr.bwd_ex;
  x.sync_s = tr.sync;
  x.transfer_s = tr.xfer;
  // Optimizer (memory-bound, per held parameter): clip r/w, AdamW's parameter r/w and gradient
  // read, moments r/w for the owned share, the bf16 refresh, zeroing and the norm's read.
  const double n = st.memory.params / 4, owned = st.memory.optimizer / 8;
  x.optimizer_s = roof.memory(n * (8 + 8 + 4 + 4 + 4 + (bf16 ? 6 : 0)) + owned * 16);
  return x;
}

// After the simulated pipeline: each stage's busy time and bubble, the step (the pipeline, then
// the slowest stage's sync and optimizer), its rates and where its time goes.
void finish_step_time(const Config& config, const Plan& plan, const DeviceSpec& dev, double peak, StepTime& out) {
  const ModelConfig& c = config.model;
  const TrainConfig& t = config.train;
  const double M = static_cast<double>(plan.micro_batches);
  for (const TimelineEntry& e : out.timeline) out.pipeline_s = std::max(out.pipeline_s, e.end_s);
  double tail = 0;
  size_t critical = 0;
  for (size_t s = 0; s < out.stages.size(); ++s) {
    StageTime& x = out.stages[s];
    x.busy_s = M * (x.forward_s() + x.backward_s());
    // The span less the stage's own work; a difference within the two sums' rounding (~M ulps)
    // is no wait (pp = 1 showed "bubble 0.0000000000000178%").
    const double gap = out.pipeline_s - x.busy_s;
    x.bubble_s = gap > 1e-12 * out.pipeline_s ? gap : 0.0;
    if (x.sync_s + x.optimizer_s > tail) {
      tail = x.sync_s + x.optimizer_s;
      critical = s;
    }
  }
  out.step_s = out.pipeline_s + tail;
  // Error bar: every measured rate may be as far off as the calibration's rounds were from each
  // other, so the step as well (to first order).
  out.step_spread = dev.timing_spread;
  const double tokens = static_cast<double>(t.batch_size * t.seq_len);
  out.tokens_per_s = tokens / out.step_s;
  out.tokens_per_s_per_device = out.tokens_per_s / static_cast<double>(plan.layout.world());
  out.model_flops_per_token = c.train_flops_per_token(t.seq_len);
  out.achieved_flops_per_device = out.model_flops_per_token * out.tokens_per_s_per_device;
  out.mfu = out.achieved_flops_per_device / peak;
  out.mfu_bf16 = out.achieved_flops_per_device / dev.bf16_flops;
  out.bubble_fraction = out.pipeline_s > 0 ? out.stages[0].bubble_s / out.pipeline_s : 0;
  for (const PlannedRank& r : plan.ranks)
    out.checkpoint_save_s = std::max(out.checkpoint_save_s, r.checkpoint_bytes / dev.storage_bytes_per_s);
  const StageTime& x = out.stages[critical];
  out.waterfall = {{"compute", M * (x.forward_compute_s + x.backward_compute_s)},
                   {"expert exchange", M * (x.forward_exchange_s + x.backward_exchange_s)},
                   {"pipeline bubble", x.bubble_s},
                   {"gradient and statistics sync", x.sync_s},
                   {"optimizer", x.optimizer_s}};
}

}  // namespace

StepTime estimate_step_time(const Config& config, const Plan& plan, const Cluster& cl, const TimeOptions& options) {
  const OverlapModel& overlap = options.overlap;
  MOE_CHECK(overlap.exchange_hidden >= 0 && overlap.exchange_hidden <= 1 && overlap.grouped_slowdown >= 0,
            "overlap: the hidden fraction must be in [0, 1] and the slowdown >= 0");
  const DeviceSpec& dev = cl.device;
  // mxfp8 is timed as bf16 for now (the MXFP8 GEMM rates are not in the cluster files yet).
  const bool bf16 = config.train.precision != "fp32";
  const Roofline roof{dev, bf16 ? dev.bf16_flops : dev.fp32_flops, bf16 ? dev.attention_efficiency : dev.attention_efficiency_fp32,
                      options.power_capped ? dev.power_capped_gemm : 1.0};
  const LayerCost cost = layer_cost(config, plan, roof, bf16);
  StepTime out;
  std::vector<double> fwd, bwd;
  double transfer = 0;
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const StageTime x = stage_time(config, plan, cl, options, cost, s);
    transfer = std::max(transfer, x.transfer_s);
    out.stages.push_back(x);
    fwd.push_back(x.forward_s());
    bwd.push_back(x.backward_s());
  }
  out.timeline = simulate_interleaved(fwd, bwd, transfer, plan.micro_batches, config.parallel.pp_interleave);
  finish_step_time(config, plan, dev, roof.peak, out);
  return out;
}

}  // namespace moe
