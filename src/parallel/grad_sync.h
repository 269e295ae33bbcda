// Data-parallel gradient synchronization and the step's global quantities.
//
// Gradients are summed (not averaged: the loss is already normalized by the loss tokens of the
// whole global batch) once per step, after all micro-batches: the dense region of the flat
// gradient buffer over the dp group, the expert region over the edp group (each expert shard's
// replicas). The global gradient norm counts every parameter shard exactly once: a rank adds a
// parameter's sum of squares only if it is the first replica (dp rank 0 for dense parameters, edp
// rank 0 for experts); per-parameter partial sums are summed over the world and then added in the
// whole model's parameter order, so a single process and a pipeline split give the same bits.
//
// ZeRO-1 (parallel.zero1): each region is cut into equal chunks (the layout pads it), one per
// replica: dense chunk dp_rank of dp, expert chunk edp_rank of edp. Gradients are reduce-scattered
// (each rank receives the sum of its chunk only), AdamW updates the owned chunks with moments of
// chunk size, and the updated parameters are all-gathered. The norm then counts the owned chunks,
// which are disjoint across the world. fp32 parameters stay whole on every rank (the model reads
// them: router, norms, bf16 operand copies); only the Adam moments are sharded.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/params.h"
#include "parallel/process_groups.h"
#include "parallel/staged_comm.h"

namespace moe {

struct StepStats;

class GradSync {
 public:
  // groups == nullptr: a single process (every reduction is the identity). Buffers are ops'
  // memory, staged through the host when it is not the host's (parallel/staged_comm.h; the
  // overlapped reduction then is not available).
  GradSync(Backend& ops, const ParamLayout& layout, ProcessGroups* groups, bool zero1 = false, bool overlap = false);
  // Bytes staged through the host for communication so far.
  const TransferStats& staged() const { return comm_.staged(); }
  bool distributed() const { return groups_ != nullptr; }
  bool zero1() const { return zero1_; }
  // The flat ranges whose optimizer state this rank holds (AdamW's `owned`); empty = all.
  std::vector<std::pair<int64_t, int64_t>> owned_ranges() const;

  // Sum the replicas' gradients (dense over dp, experts over edp). In place; with ZeRO-1 only
  // the owned chunks hold the sums afterwards.
  void reduce_gradients(const Tensor& grad_flat);
  // Overlap (parallel.overlap_grad_reduce, plain DDP): begin_step(grads, backwards per layer)
  // arms it; layer_done(l) after each layer backward starts layer l's all-reduce (dense over dp,
  // its experts over edp) once its last micro-batch is through, and polls the outstanding ones
  // (Open MPI progresses non-blocking collectives only inside MPI calls); reduce_gradients then
  // reduces the rest (embedding, final norm, LM head) and waits. exposed_wait_s() is the time
  // that wait took in the last step.
  void begin_step(const Tensor& grad_flat, int64_t backwards_per_layer);
  void layer_done(int64_t layer);
  double exposed_wait_s() const { return exposed_wait_s_; }
  bool overlapping() const { return overlap_; }
  // ZeRO-1: all-gather the updated owned chunks of the parameters (no-op otherwise).
  void gather_params(const Tensor& param_flat);
  // The global gradient norm, in two halves so that the host reads the sums with the step's
  // other statistics (one download): grad_sumsq writes each parameter's sum of squares, counted
  // once per shard and summed over the world, into out (num_global_params) f64 on the device;
  // grad_norm adds a downloaded copy in whole-model order and takes the root. grad_flat must
  // already be reduced. Same value on every rank. One sumsq_segments op over a segment table
  // built once (each parameter's counted slice and its global index).
  void grad_sumsq(const Tensor& grad_flat, const Tensor& out);
  static double grad_norm(const std::vector<double>& sumsq);
  // Sum the step's loss terms, expert counts and router probabilities over dp and pp. Under
  // expert parallelism routing and these statistics stay on the tokens' rank, and dp contains
  // the EP group, so every token counts once and every rank gets the same bias update.
  void reduce_stats(StepStats& stats);
  // Sum of an integer over the dp group (e.g. the global batch's loss tokens).
  int64_t sum_over_dp(int64_t value);
  // A backend tensor summed over the dp group in place (global load balancing: a micro-batch's
  // expert counts of one layer), staged through the host when the communicator needs it.
  void sum_over_dp(const Tensor& t);
  // Number of data-parallel replicas and this rank's index among them.
  int64_t dp_size() const;
  int64_t dp_rank() const;

 private:
  // The owned chunk of a region over comm (ZeRO-1): [begin + rank*len, begin + (rank+1)*len).
  struct Region {
    int64_t begin = 0, length = 0;
    Communicator* comm = nullptr;
    int64_t chunk() const { return comm ? length / comm->size() : length; }
    int64_t chunk_begin() const { return begin + (comm ? comm->rank() * chunk() : 0); }
  };
  void reduce_scatter(const Region& r, const Tensor& flat);
  void all_gather(const Region& r, const Tensor& flat);

  Backend& ops_;
  const ParamLayout& layout_;
  ProcessGroups* groups_;
  bool zero1_;
  Region dense_, experts_;
  StagedComm comm_;
  OwnedTensor sumsq_segments_;  // (S,3) i64 rows (begin, end, global index) for grad_sumsq
  // Overlap: per layer, its dense and expert flat ranges; backwards seen this step; requests.
  struct LayerBucket {
    int64_t dense_begin = -1, dense_end = -1, expert_begin = -1, expert_end = -1;
    int64_t done = 0;
  };
  bool overlap_ = false;
  std::vector<LayerBucket> buckets_;  // by layer index (layers outside the stage stay empty)
  std::vector<Request> in_flight_;
  Tensor grads_;
  int64_t backwards_per_layer_ = 0;
  double exposed_wait_s_ = 0;
};

}  // namespace moe
