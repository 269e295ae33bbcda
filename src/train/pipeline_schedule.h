// The 1F1B schedule as data: the order of one stage's forwards and backwards (no model, no
// communicator), shared by the pipeline that runs it (train/pipeline.h) and the planner that
// simulates it (plan/).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

struct PipelineAction {
  bool forward = true;
  int64_t micro = 0;
  std::string name() const;  // "F3", "B0"
};

// The canonical 1F1B order of stage `stage` of `stages` over `micro_batches` micro-batches.
std::vector<PipelineAction> one_f_one_b(int64_t stages, int64_t stage, int64_t micro_batches);
// Micro-batches whose activations the stage holds at once under 1F1B: min(stages - stage, M).
int64_t pipeline_slots(int64_t stages, int64_t stage, int64_t micro_batches);

}  // namespace moe
