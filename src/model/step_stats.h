// The step's statistics: what the host reads of one optimizer step, made on the device.
#pragma once

#include <vector>

#include "core/buffer.h"
#include "kernels/ops.h"

namespace moe {

// What the host reads of one optimizer step, in one allocation of the backend's memory (values,
// grad_sumsq, mean_prob, counts, exchange), so that it takes one download per step.
struct StepStats {
  Buffer memory;
  Tensor words;   // all of memory as i32 words: what the host downloads
  Tensor values;  // f64: [ce, lm_z, lbl per MoE layer..., router_z per MoE layer...]
  Tensor control;     // (kCtlSize) f64: the step's decisions (kernels/step_control.h), made on the device
  Tensor grad_sumsq;  // (num_global_params) f64: each parameter's gradient sum of squares (GradSync)
  Tensor exchange;    // (MoE layers, 4 + ep) i32 with EP: the exchange counters (copied in), else empty
  Tensor quant;       // (MoE layers, 8) f64 with MXFP8 experts: this rank's quantization statistics
                      // (Transformer::quant_stats, copied in), else empty
  std::vector<Tensor> counts;     // per MoE layer, (E) i32, step total tokens per expert (summed over micro-batches)
  std::vector<Tensor> mean_prob;  // per MoE layer, (E) compute dtype, token-weighted mean over the step
  int64_t num_moe_layers = 0;
  Tensor ce() const { return values.slice(0, 1); }
  Tensor lm_z() const { return values.slice(1, 2); }
  Tensor lbl(int64_t m) const { return values.slice(2 + m, 3 + m); }
  Tensor router_z(int64_t m) const { return values.slice(2 + num_moe_layers + m, 3 + num_moe_layers + m); }
  // Where t's bytes start within memory (for reading a downloaded copy of words).
  size_t offset_of(const Tensor& t) const { return static_cast<size_t>(static_cast<const char*>(t.data) - static_cast<const char*>(memory.data())); }
};

// One StepStats for M MoE layers of E experts, P global parameters, an EP group of ep ranks
// (1: no exchange counters); mean_prob in the compute dtype.
StepStats make_step_stats(Backend& ops, int64_t num_moe_layers, int64_t num_experts, int64_t num_global_params,
                          int64_t ep, DType compute, bool quant_stats = false);
// Zeroes the loss terms, counts and probabilities (the rest is overwritten each step).
void zero_step_stats(Backend& ops, StepStats& stats);

}  // namespace moe
