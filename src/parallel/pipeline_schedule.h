// The pipeline schedules as data: the order of one stage's forwards and backwards (no model, no
// communicator), shared by the pipeline that runs it (parallel/pipeline.h) and the planner that
// simulates it (plan/).
//   1F1B (PipeDream-flush / Megatron): stage s of P runs min(P - s - 1, M) warm-up forwards, then
//   alternates one forward and one backward, then drains.
//   Interleaved 1F1B (Megatron's virtual stages; Olmo-core 3's production schedule): the layers
//   form P * v chunks, rank s holding chunks s, s + P, ..., s + (v - 1) P (its local chunks
//   0 .. v-1). Forwards take the micro-batches in groups of P, local chunk by chunk; backwards the
//   same groups with the chunks in reverse; (P - s - 1) * 2 + (v - 1) * P warm-up forwards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

struct PipelineAction {
  bool forward = true;
  int64_t micro = 0;
  int64_t chunk = 0;  // local model chunk (interleaved schedules), else 0
  // "F3", "B0"; with_chunk (interleaved): "F3.1" = micro-batch 3 on local chunk 1.
  std::string name(bool with_chunk = false) const;
};

// The canonical 1F1B order of stage `stage` of `stages` over `micro_batches` micro-batches.
std::vector<PipelineAction> one_f_one_b(int64_t stages, int64_t stage, int64_t micro_batches);
// Interleaved 1F1B with `chunks` local chunks per stage (chunks = 1: one_f_one_b). Needs
// micro_batches to be a multiple of stages when chunks > 1 (as Megatron's schedule does).
std::vector<PipelineAction> interleaved_1f1b(int64_t stages, int64_t stage, int64_t micro_batches, int64_t chunks);
// Micro-batches whose activations the stage holds at once under 1F1B: min(stages - stage, M).
int64_t pipeline_slots(int64_t stages, int64_t stage, int64_t micro_batches);
// Per local chunk: the most micro-batches forwarded and not yet backwarded at once in `order`
// (each chunk's forwards and backwards run in micro-batch order, so micro-batch m can use slot
// m % slots of its chunk).
std::vector<int64_t> chunk_slots(const std::vector<PipelineAction>& order, int64_t chunks);
// The activation slots per local chunk of stage `stage` under its schedule (chunks = 1:
// {pipeline_slots}).
std::vector<int64_t> stage_chunk_slots(int64_t stages, int64_t stage, int64_t micro_batches, int64_t chunks);

}  // namespace moe
