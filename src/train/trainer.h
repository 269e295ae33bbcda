// One optimizer step: micro-batches with gradient accumulation, loss normalization over the
// whole step, global grad-norm clipping, the LR schedule, AdamW, and loss-free bias updates.
#pragma once

#include <memory>
#include <vector>

#include "config/config.h"
#include "kernels/ops.h"
#include "model/transformer.h"
#include "optim/adamw.h"

namespace moe {

struct StepResult {
  int64_t step = 0;         // optimizer step just taken (1-based)
  double total = 0;         // CE + weighted z-loss and auxiliary losses
  double ce = 0, lm_z = 0;
  std::vector<double> lbl, router_z;           // per MoE layer (unweighted)
  std::vector<std::vector<int32_t>> counts;    // per MoE layer, tokens per expert this step
  double grad_norm = 0;     // before clipping
  double lr = 0;
  bool clipped = false;
  int64_t loss_tokens = 0, tokens = 0;
};

class Trainer {
 public:
  // compute: f32 (cpu or ref backend) or f64 (ref backend, tests).
  Trainer(const Config& config, Backend& ops, DType compute);
  Transformer& model() { return *model_; }
  AdamW& optimizer() { return *optim_; }
  const Config& config() const { return config_; }
  // ids, labels: (batch_size, seq_len) i32 for the whole step; labels < 0 carry no loss.
  // step() = compute_gradients() + apply_update(); tests look at the gradients in between.
  // doc_start: (batch_size, seq_len) i32 document starts for intra-document masking, or empty.
  StepResult step(const Tensor& ids, const Tensor& labels, const Tensor& doc_start = Tensor());
  // Forward + backward over all micro-batches: losses, gradients (unclipped) and grad norm.
  StepResult compute_gradients(const Tensor& ids, const Tensor& labels, const Tensor& doc_start = Tensor());
  // Clipping, LR, AdamW, loss-free bias update, bf16 weight refresh.
  void apply_update(StepResult& r);
  int64_t steps_taken() const { return optim_->steps_taken(); }

 private:
  Config config_;
  Backend& ops_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optim_;
  StepStats stats_;
  OwnedTensor norm_acc_;  // (1) f64
};

// Total of the loss terms with the configured coefficients.
double total_loss(const LossConfig& loss, const StepResult& r);

}  // namespace moe
