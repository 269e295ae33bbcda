// The step-time model: per-op roofline with the device's efficiency curves (dense GEMMs by FLOPs
// per call, grouped expert GEMMs also by rows per expert, attention, memory-bound kernels),
// collectives as latency + wire bytes / (link bandwidth x efficiency(message bytes)) on the link
// each group crosses, and a discrete-event simulation of the trainer's 1F1B schedule
// (parallel/pipeline_schedule.h) for the bubble. Nothing overlaps by default: expert exchanges block
// their layer, gradient reductions follow the pipeline (what the trainer does without
// parallel.overlap_grad_reduce).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "plan/hardware.h"
#include "plan/pipeline_sim.h"
#include "plan/plan.h"

namespace moe {

// Overlap of the expert exchange with compute (two-batch overlap; not in the trainer): the
// fraction of exchange time hidden, and the slowdown of the grouped expert GEMMs that run while
// it does (Olmo-core 3: 72% hidden, grouped GEMMs 23-27% slower). None by default.
struct OverlapModel {
  double exchange_hidden = 0;
  double grouped_slowdown = 0;
};

struct TimeOptions {
  OverlapModel overlap;
  bool power_capped = false;  // GEMMs at the device's power-capped rate
};

struct StageTime {
  // One micro-batch on this stage: compute and the expert exchanges inside its layers.
  double forward_compute_s = 0, forward_exchange_s = 0;
  double backward_compute_s = 0, backward_exchange_s = 0;  // recompute's forward included
  double transfer_s = 0;   // one (T, D) activation or gradient to the next / previous stage
  double grouped_s = 0;    // of the compute (forward + backward, one micro-batch): grouped expert GEMMs
  double busy_s = 0;       // forwards and backwards of the step
  double bubble_s = 0;     // the simulated pipeline's idle time on this stage
  double sync_s = 0;       // after the pipeline: statistics, gradients, norm sums, ZeRO-1 gather
  double optimizer_s = 0;  // clipping, AdamW, the bf16 refresh (memory-bound)
  double forward_s() const { return forward_compute_s + forward_exchange_s; }
  double backward_s() const { return backward_compute_s + backward_exchange_s; }
};

struct StepTime {
  std::vector<StageTime> stages;
  std::vector<TimelineEntry> timeline;  // every stage's forwards and backwards, simulated
  double pipeline_s = 0;                // first forward to last backward
  double step_s = 0;
  double step_spread = 0;  // relative error bar from the calibration's spread (0: unknown)
  double tokens_per_s = 0, tokens_per_s_per_device = 0;
  double model_flops_per_token = 0;  // 6 x active + causal attention (ModelConfig)
  double achieved_flops_per_device = 0;
  double mfu = 0;        // against the device's peak for train.precision
  double mfu_bf16 = 0;   // against the bf16 peak (Olmo-core 3's convention, whatever the precision)
  double bubble_fraction = 0;  // stage 0's idle share of the pipeline
  double checkpoint_save_s = 0;  // the slowest rank's shard at the device's storage rate
  std::vector<std::pair<std::string, double>> waterfall;  // where the step's time goes (critical stage)
};

StepTime estimate_step_time(const Config& config, const Plan& plan, const Cluster& cluster,
                            const TimeOptions& options = {});

// Layouts of `world` ranks the trainer accepts for this config (pp divides world and is at most
// n_layers, ep divides dp and num_experts, the batch splits), each planned and timed, best first;
// those that do not fit or are refused say why.
struct SweepRow {
  Layout layout;
  bool fits = false;
  std::string reason;  // why not (the binding constraint), or empty
  double peak_bytes = 0;
  StepTime time;
};
std::vector<SweepRow> sweep_layouts(const Config& config, const Cluster& cluster, int64_t world,
                                    const TimeOptions& options = {});

// plan_to_json's object with the cluster, the step time and the sweep (each optional) added.
std::string plan_report_json(const Config& config, const Plan& plan, const Cluster* cluster, const StepTime* time,
                             const std::vector<SweepRow>* sweep);
std::string format_step_time(const Config& config, const Plan& plan, const Cluster& cluster, const StepTime& t);
std::string format_sweep(const Cluster& cluster, const std::vector<SweepRow>& rows);

}  // namespace moe
