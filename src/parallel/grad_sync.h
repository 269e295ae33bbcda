// Data-parallel gradient synchronization and the step's global quantities.
//
// Gradients are summed (not averaged: the loss is already normalized by the loss tokens of the
// whole global batch) once per step, after all micro-batches: the dense region of the flat
// gradient buffer over the dp group, the expert region over the edp group (each expert shard's
// replicas). The global gradient norm counts every parameter shard exactly once: a rank adds a
// parameter's sum of squares only if it is the first replica (dp rank 0 for dense parameters, edp
// rank 0 for experts); per-parameter partial sums are summed over the world and then added in the
// whole model's parameter order, so a single process and a pipeline split give the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/params.h"
#include "parallel/layout.h"

namespace moe {

struct StepStats;

class GradSync {
 public:
  // groups == nullptr: a single process (every reduction is the identity).
  GradSync(const ParamLayout& layout, ProcessGroups* groups);
  bool distributed() const { return groups_ != nullptr; }

  // Sum the replicas' gradients (dense over dp, experts over edp). In place.
  void reduce_gradients(const Tensor& grad_flat);
  // sqrt of the sum of squares of the whole model's gradient, counted once per shard.
  // grad_flat must already be reduced. Same value on every rank.
  double global_grad_norm(Backend& ops, const Tensor& grad_flat);
  // Sum the step's loss terms, expert counts and router probabilities over dp and pp. Under
  // expert parallelism routing and these statistics stay on the tokens' rank, and dp contains
  // the EP group, so every token counts once and every rank gets the same bias update.
  void reduce_stats(StepStats& stats);
  // Sum of an integer over the dp group (e.g. the global batch's loss tokens).
  int64_t sum_over_dp(int64_t value);
  // Number of data-parallel replicas and this rank's index among them.
  int64_t dp_size() const;
  int64_t dp_rank() const;

 private:
  const ParamLayout& layout_;
  ProcessGroups* groups_;
  OwnedTensor partial_;  // (num_global_params) f64 per-parameter sums of squares
};

}  // namespace moe
