// Pipeline parallelism: the 1F1B schedule over a step's micro-batches and its execution on one
// stage (a Transformer holding layers [layer_begin, layer_end)).
//
// Each micro-batch's steps on a stage: F = stage_forward; B = on the last stage head_step (final
// norm, LM head and loss, forward and backward), then stage_backward.
// 1F1B (PipeDream-flush / Megatron): stage s of P runs min(P - s - 1, M) warm-up forwards, then
// alternates one forward and one backward, then drains the remaining backwards. Stage s therefore
// holds at most min(P - s, M) micro-batches of activations (the Transformer's slots), instead of
// all M as in GPipe; stage 0 holds the most. Backwards run in micro-batch order on every stage, so
// parameter gradients accumulate (+=) in the same order as in one process: PP alone is bitwise
// equal to a single process.
//
// Communication over the pp group (ranks ordered by stage): activations forward and gradients
// backward as (T,D) compute-dtype buffers with distinct tags. Sends are non-blocking from buffers
// that stay untouched until their request completes (the slot's stage output; a per-slot copy
// of the input gradient); receives block and land directly in the model's buffers. The time
// blocked in receives is the pipeline bubble (plus any imbalance between stages): warm-up waits
// for activations, steady-state waits for gradients, and the cool-down wait of stages 1.. for
// stage 0's last backward (an end-of-step token from stage 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "model/transformer.h"
#include "parallel/staged_comm.h"
#include "parallel/communicator.h"
#include "train/pipeline_schedule.h"

namespace moe {

class Pipeline {
 public:
  // pp: this rank's pipeline group (ranks ordered by stage); nullptr or size 1: one stage.
  Pipeline(Transformer& model, Communicator* pp);
  int64_t stages() const { return stages_; }
  int64_t stage() const { return stage_; }

  // Forward and backward of every micro-batch in 1F1B order; gradients accumulate in the model,
  // loss terms in stats. Returns the seconds blocked in receives (the bubble).
  double run(const std::vector<MicroBatch>& micro, StepStats& stats);
  // Forward only of one micro-batch across the stages (validation): the summed cross-entropy is
  // added to out (1) f64 on the last stage, then out is broadcast to every stage of the group.
  // mb.ids, mb.labels and mb.doc_start are read (scales are not).
  void forward_loss(const MicroBatch& mb, const Tensor& out);
  // Bytes staged through the host for communication so far.
  const TransferStats& staged() const { return comm_.staged(); }
  // The actions of the last run() in execution order ("F0", "F1", "B0", ...).
  const std::vector<std::string>& schedule_log() const { return log_; }

 private:
  void forward(const MicroBatch& mb, int64_t m);
  void backward(const MicroBatch& mb, int64_t m, StepStats& stats);
  // Blocking receive into t from stage `from` (an empty t: the end-of-step token, a host int);
  // the blocked time is added to bubble_s_.
  void receive(const Tensor& t, int64_t from, int tag);
  void wait_sends();

  Transformer& model_;
  Communicator* pp_;
  int64_t stages_ = 1, stage_ = 0;
  StagedComm comm_;
  std::vector<OwnedTensor> grad_out_;  // per slot: d(stage input) while its send is in flight
  // Per slot: the host copies of the in-flight sends when the backend's memory is not the host's.
  std::vector<std::vector<unsigned char>> act_host_, grad_host_;
  std::vector<Request> act_sent_, grad_sent_;  // per slot
  std::vector<Request> flush_sent_;            // stage 0: end-of-step tokens to the other stages
  int32_t flush_token_ = 0;
  std::vector<std::string> log_;
  std::vector<PipelineAction> schedule_;  // 1F1B for schedule_micro_ micro-batches
  int64_t schedule_micro_ = -1;
  double bubble_s_ = 0;
};

}  // namespace moe
