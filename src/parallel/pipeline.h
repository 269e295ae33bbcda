// Pipeline parallelism: the 1F1B schedule over a step's micro-batches and its execution on one
// stage (a Transformer holding a range of layers, or with interleaving several chunks of them).
//
// Each micro-batch's steps on a stage: F = stage_forward; B = on the last stage head_step (final
// norm, LM head and loss, forward and backward), then stage_backward. Interleaved 1F1B
// (parallel.pp_interleave = v, parallel/pipeline_schedule.h) runs the same steps per chunk: chunk c of
// stage s is virtual stage c P + s, which receives from the previous virtual stage (stage s - 1,
// or stage P - 1's chunk c - 1) and sends to the next.
// 1F1B (PipeDream-flush / Megatron): stage s of P runs min(P - s - 1, M) warm-up forwards, then
// alternates one forward and one backward, then drains the remaining backwards. Stage s therefore
// holds at most min(P - s, M) micro-batches of activations (the Transformer's slots), instead of
// all M as in GPipe; stage 0 holds the most. Backwards run in micro-batch order on every stage, so
// parameter gradients accumulate (+=) in the same order as in one process: PP alone is bitwise
// equal to a single process. Interleaving keeps that: each layer lies in one chunk, whose
// backwards also run in micro-batch order.
//
// Communication over the pp group (ranks ordered by stage): activations forward and gradients
// backward as (T,D) compute-dtype buffers with tags per kind and receiving chunk. Sends are non-blocking from buffers
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
#include "parallel/pipeline_schedule.h"

namespace moe {

class Pipeline {
 public:
  // pp: this rank's pipeline group (ranks ordered by stage); nullptr or size 1: one stage.
  Pipeline(Transformer& model, Communicator* pp);
  int64_t stages() const { return stages_; }
  int64_t stage() const { return stage_; }

  // Forward and backward of every micro-batch in (interleaved) 1F1B order; gradients accumulate
  // in the model, loss terms in stats. Returns the seconds blocked in receives (the bubble).
  double run(const std::vector<MicroBatch>& micro, StepStats& stats);
  // Forward only of one micro-batch across the stages (validation): the summed cross-entropy is
  // added to out (1) f64 on the last stage, then out is broadcast to every stage of the group.
  // mb.ids, mb.labels and mb.doc_start are read (scales are not).
  void forward_loss(const MicroBatch& mb, const Tensor& out);
  // Bytes staged through the host for communication so far.
  const TransferStats& staged() const { return comm_.staged(); }
  // Seconds the last run() spent computing forwards and backwards (host clock: the time to
  // enqueue them on an asynchronous backend), for comparing the bubble with a simulation.
  double forward_compute_s() const { return forward_s_; }
  double backward_compute_s() const { return backward_s_; }
  // The actions of the last run() in execution order ("F0", "F1", "B0", ...; interleaved: "F0.1" =
  // micro-batch 0 on local chunk 1).
  const std::vector<std::string>& schedule_log() const { return log_; }

 private:
  void forward(const MicroBatch& mb, int64_t chunk, int64_t m);
  void backward(const MicroBatch& mb, int64_t chunk, int64_t m, StepStats& stats);
  // The neighbouring virtual stages of a chunk: the rank and chunk before and after it.
  bool model_start(int64_t chunk) const { return chunk == 0 && stage_ == 0; }
  bool model_end(int64_t chunk) const { return chunk == chunks_ - 1 && stage_ == stages_ - 1; }
  int prev_rank() const { return static_cast<int>((stage_ + stages_ - 1) % stages_); }
  int next_rank() const { return static_cast<int>((stage_ + 1) % stages_); }
  int64_t prev_chunk(int64_t chunk) const { return stage_ == 0 ? chunk - 1 : chunk; }
  int64_t next_chunk(int64_t chunk) const { return stage_ == stages_ - 1 ? chunk + 1 : chunk; }
  // Blocking receive into t from stage `from` (an empty t: the end-of-step token, a host int);
  // the blocked time is added to bubble_s_.
  void receive(const Tensor& t, int64_t from, int tag);
  void wait_sends();

  Transformer& model_;
  Communicator* pp_;
  int64_t stages_ = 1, stage_ = 0, chunks_ = 1;
  StagedComm comm_;
  // Per chunk and slot: d(chunk input) while its send is in flight; the host copies of the
  // in-flight sends when the backend's memory is not the host's; the sends.
  std::vector<std::vector<OwnedTensor>> grad_out_;
  std::vector<std::vector<std::vector<unsigned char>>> act_host_, grad_host_;
  std::vector<std::vector<Request>> act_sent_, grad_sent_;
  std::vector<Request> flush_sent_;            // stage 0: end-of-step tokens to the other stages
  int32_t flush_token_ = 0;
  std::vector<std::string> log_;
  std::vector<PipelineAction> schedule_;  // (interleaved) 1F1B for schedule_micro_ micro-batches
  int64_t schedule_micro_ = -1;
  double bubble_s_ = 0, forward_s_ = 0, backward_s_ = 0;
};

}  // namespace moe
