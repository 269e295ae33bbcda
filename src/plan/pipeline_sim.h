// Discrete-event simulation of pipeline schedules: every action starts when its stage is free and
// its input has arrived (a transfer time after the neighbour's action that produced it).
//   - 1F1B, the trainer's schedule (parallel/pipeline_schedule.h);
//   - interleaved 1F1B with v model chunks per stage (Megatron's virtual stages, which Olmo-core
//     3's 1.2T run uses; the trainer's parallel.pp_interleave).
// Both take their order from parallel/pipeline_schedule.h, the order the trainer executes.
#pragma once

#include <cstdint>
#include <vector>

namespace moe {

struct TimelineEntry {
  int64_t stage = 0, micro = 0;
  int64_t chunk = 0;  // model chunk (interleaved schedules), else 0
  bool forward = true;
  double start_s = 0, end_s = 0;
};

// 1F1B over M micro-batches with per-stage forward and backward times (one micro-batch through
// the stage's layers). Entries in execution order per stage.
std::vector<TimelineEntry> simulate_1f1b(const std::vector<double>& forward_s, const std::vector<double>& backward_s,
                                         double transfer_s, int64_t micro_batches);

// Interleaved 1F1B: stage s holds chunks c = 0..v-1, chunk c being virtual stage c P + s, each
// with 1/v of the stage's time. M must be a multiple of P (Megatron's rule). Per stage: warm-up of
// (P - s - 1) 2 + (v - 1) P forwards, then one forward and one backward, then the rest.
std::vector<TimelineEntry> simulate_interleaved(const std::vector<double>& forward_s, const std::vector<double>& backward_s,
                                                double transfer_s, int64_t micro_batches, int64_t chunks);

}  // namespace moe
