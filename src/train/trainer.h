// One optimizer step: micro-batches with gradient accumulation (in 1F1B order across pipeline
// stages, parallel/pipeline.h), loss normalization over the whole step, global grad-norm clipping,
// the LR schedule, AdamW, and loss-free bias updates.
#pragma once

#include <memory>
#include <optional>
#include <array>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "kernels/ops.h"
#include "model/attention_masks.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/grad_sync.h"
#include "parallel/parallelize.h"
#include "parallel/process_groups.h"
#include "parallel/pipeline.h"
#include "train/step_hooks.h"

namespace moe {

struct StepResult {
  int64_t step = 0;         // optimizer step just taken (1-based)
  double total = 0;         // CE + weighted z-loss and auxiliary losses
  double ce = 0, lm_z = 0;
  std::vector<double> lbl, router_z;           // per MoE layer (unweighted)
  std::vector<std::vector<int32_t>> counts;    // per MoE layer, tokens per expert this step
  std::vector<std::vector<double>> mean_prob;  // per MoE layer, mean router probability per expert
                                               // (token-weighted over the step's micro-batches)
  // Expert parallelism (parallel.ep > 1), per MoE layer over the step and all EP groups of the
  // stage: the fraction of routed rows dropped by the capacity (0 when dropless), and the rows
  // EP rank r's experts computed (summed over r's replicas).
  std::vector<double> ep_drop_fraction;
  std::vector<std::vector<int64_t>> ep_rows_received;
  // MXFP8 experts, per MoE layer on this rank: the step's quantizations, forward (inputs, SwiGLU
  // output) then backward (output and SwiGLU gradients): largest |x|, saturated values, values
  // that underflowed to zero, values (mx_quantize's statistics).
  std::vector<std::array<double, 8>> mx_quant;
  double grad_norm = 0;     // before clipping
  double lr = 0;
  bool clipped = false;
  int64_t loss_tokens = 0, tokens = 0;
  bool finite = true;            // loss and grad norm finite
  std::string nonfinite_tensor;  // first parameter (layout order) with a NaN/Inf gradient, if any
  bool skipped = false;          // non-finite with train.on_nonfinite = "skip": no update applied
  // The backend's stream seconds of this step on this rank: from the end of the step before when
  // that one was still in flight as this one was enqueued (train.overlap_host: back to back, so the
  // host's own work between steps counts), else from this step's start (evaluations, checkpoints
  // and the host's work before the step do not). A step enqueued again after a skipped one counts
  // both attempts.
  double step_s = 0;
  double pp_bubble_s = 0;        // seconds this rank blocked receiving pipeline activations/gradients
  TransferStats transfers;       // host <-> device copies of this step on this rank, staging excluded (step() only)
  TransferStats staged;          // copies that staged communication buffers through the host (step() only)
};

class Trainer {
 public:
  // compute: f32 (cpu or ref backend) or f64 (ref backend, tests).
  // groups: this rank's process groups (not owned) for a distributed run; nullptr = one process.
  Trainer(const Config& config, Backend& ops, DType compute, ProcessGroups* groups = nullptr);
  Transformer& model() { return *model_; }
  const ExpertExchange* expert_exchange() const { return parallel_.exchange.get(); }  // nullptr without EP
  AdamW& optimizer() { return *optim_; }
  const Config& config() const { return config_; }
  // ids, labels: (local_batch(), seq_len) i32, this rank's contiguous share of the global batch
  // (data-parallel rank d holds global rows [d*local_batch, (d+1)*local_batch)); labels < 0
  // carry no loss. The step's results (losses, grad norm, counts) are global.
  // A step runs one way: submit() enqueues it, collect() reads it; step() is the two at once.
  // doc_start: (batch_size, seq_len) i32 document starts for intra-document masking, or empty.
  // Both return the trainer's own record (refilled each step, so a step allocates nothing for
  // it); copy it to keep it past the next step.
  const StepResult& step(const Tensor& ids, const Tensor& labels, const Tensor& doc_start = Tensor());
  // Lagged steps (train.overlap_host): submit() enqueues the step of this batch -- gradients,
  // decisions, update, the download of its record -- and only then reads the record of the step
  // before it, which it returns (nullptr when none was in flight). So the host prepares and
  // enqueues step n+1 while the device runs step n. The non-finite flag stays set on the device
  // until the host has read it, so a step enqueued behind a non-finite one changes nothing; with
  // train.on_nonfinite = "skip" submit() then enqueues it again. Either way the run is step()'s,
  // bit for bit. collect() reads the step in flight (nullptr if none); the batch tensors must stay
  // unchanged until the next submit() or collect() returns. Evaluation, checkpoints and the other
  // calls below need no step in flight.
  const StepResult* submit(const Tensor& ids, const Tensor& labels, const Tensor& doc_start = Tensor());
  const StepResult* collect();
  bool in_flight() const { return in_flight_; }
  // A step's device work only -- gradients, decisions, update -- with the update counter kept on
  // the device and no read of the step's record: what a CUDA graph captures (stream capture of
  // this call) and replays as the following steps. Host-side counters do not advance.
  void enqueue_step_on_device(const Tensor& ids, const Tensor& labels);
  // A step's first half only (tests look at its gradients): forward + backward over all
  // micro-batches, losses, gradients (unclipped) and grad norm, no update. A non-finite loss or
  // grad norm sets r.finite = false and r.nonfinite_tensor (no throw).
  StepResult& compute_gradients(const Tensor& ids, const Tensor& labels, const Tensor& doc_start = Tensor());
  // Name of the first parameter (ParamLayout order) whose gradient holds a NaN or Inf; "" if none.
  // A diagnosis that scans (and stages) the whole gradient; a step names its first offending
  // tensor from the per-parameter sums of squares it downloads anyway (StepResult).
  std::string first_nonfinite_grad();
  int64_t skipped_steps() const { return skipped_steps_; }
  // Code that acts inside each step (train/step_hooks.h: fault injection); not owned, nullptr = none.
  void set_step_hooks(StepHooks* hooks) { hooks_ = hooks; }
  int64_t steps_taken() const { return optim_->steps_taken(); }
  // Sequences of the global batch this rank feeds to step(): batch_size / dp.
  int64_t local_batch() const;
  ProcessGroups* groups() { return groups_; }
  // What checkpoints save and restore (checkpoint/checkpoint.h).
  TrainingState state() { return TrainingState{config_, *model_, *optim_, groups_}; }
  // Forward only across the pipeline stages (validation): summed cross-entropy of one
  // micro-batch (micro_batch_size, seq_len) added to out (1) f64 (the backend's memory), the
  // same on every stage. ids, labels and doc_start (document starts, or empty) are host tensors.
  void forward_loss(const Tensor& ids, const Tensor& labels, const Tensor& out, const Tensor& doc_start = Tensor());
  // This stage's forward/backward actions of the last step in execution order ("F0", "B0", ...).
  const std::vector<std::string>& pipeline_schedule() const { return pipeline_->schedule_log(); }
  const Pipeline& pipeline() const { return *pipeline_; }

 private:
  Config config_;
  Backend& ops_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optim_;
  ProcessGroups* groups_;
  std::unique_ptr<GradSync> sync_;
  ParallelModel parallel_;  // what parallelize installed on model_ (the expert exchange)
  std::vector<MicroBatch> micro_;  // the step's micro-batch views
  // A step's record on its way to the host: the download of the step statistics
  // (StepStats::words, once per step), the event after it, and what the host makes of them.
  struct StepSlot {
    StepResult r;
    std::vector<int32_t> host;
    Event from{}, done{};    // where the step's time starts (StepResult::step_s) and ends
    double host_from = 0;    // the host clock at the step's enqueue (steady, s): step_s past kEventHistory
    bool drop_wait = false;  // StepHooks::read_record_without_wait
  };
  StepSlot slots_[2];  // the step in flight and the one before it (submit)
  int cur_ = 0;        // the slot the next step's record goes to
  bool in_flight_ = false;
  std::vector<double> ep_stats_;   // expert-parallel counters on their way to the edp sum
  std::unique_ptr<Pipeline> pipeline_;  // one stage without pipeline parallelism
  StepStats stats_;
  // The batch in the backend's memory (used only when the host cannot address it): the step's
  // (local_batch, seq_len) ids, labels, document starts, and validation's micro-batch.
  OwnedTensor batch_ids_, batch_labels_, eval_ids_, eval_labels_;
  // The attention's first-key tables (document starts, sliding windows) of the step's and the
  // evaluation's batch; windows_: the model's distinct windows.
  AttentionMasks batch_masks_, eval_masks_;
  std::vector<int64_t> windows_;
  Tensor on_device(const Tensor& host, OwnedTensor& slot);
  // The pieces of a step: forward/backward/reductions and the device decisions (step_control);
  // the update those decisions gate; the one download and what the host makes of it.
  // counter_from_host: the step's update counter starts from the host's count (every eager step);
  // false leaves it to the device, where step_control advances it (a captured step, replayed).
  void enqueue_gradients(const Tensor& ids, const Tensor& labels, const Tensor& doc_start, StepResult& r,
                         bool counter_from_host = true);
  void enqueue_update();
  // The whole step of a batch into slot s: gradients, update, the record's download (its
  // transfers counted in s.r).
  void enqueue_step(const Tensor& ids, const Tensor& labels, const Tensor& doc_start, StepSlot& s);
  void start_clock(StepSlot& s);  // where the step's time starts (StepResult::step_s)
  void enqueue_record(StepSlot& s);
  void read_step(StepSlot& s);
  // After the read: count the update (finite), or handle the non-finite step; true if applied.
  bool resolve(StepResult& r);
  // A non-finite step: "stop" throws naming the step and tensor; "skip" records it.
  void handle_nonfinite(StepResult& r);
  OwnedTensor lr_table_;  // (steps + 2) f64: the LR of each optimizer step, on the device
  bool skip_nonfinite_ = false;  // train.on_nonfinite = "skip" (parsed once)
  std::vector<std::string> global_param_names_;  // by global index (StepStats::grad_sumsq)
  TransferStats staged() const;  // communication staging so far (grad sync, pipeline, expert exchange)
  int64_t skipped_steps_ = 0;
  StepHooks* hooks_ = nullptr;
  void expert_parallel_stats(const char* host, StepResult& r);  // host: the downloaded statistics
};

// Total of the loss terms with the configured coefficients.
double total_loss(const LossConfig& loss, const StepResult& r);

}  // namespace moe
