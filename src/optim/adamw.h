// AdamW over the model's flat parameter buffer: first and second moments are one flat buffer
// each with the parameters' layout, so checkpointing and (later) ZeRO-1 sharding are slices.
#pragma once

#include "config/config.h"
#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/params.h"

namespace moe {

class AdamW {
 public:
  AdamW(const ParamLayout& layout, const OptimConfig& config, DType dtype);
  // One update of every parameter with learning rate lr; increments the step counter first.
  void step(Backend& ops, const Weights& params, const Weights& grads, double lr);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t n) { step_ = n; }
  const Tensor& exp_avg() const { return m_.t; }
  const Tensor& exp_avg_sq() const { return v_.t; }

 private:
  const ParamLayout& layout_;
  OptimConfig config_;
  DType dtype_;
  OwnedTensor m_, v_;
  int64_t step_ = 0;
};

}  // namespace moe
