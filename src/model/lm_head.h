// The model's head on the last pipeline stage (lm_head.cpp): final RMSNorm of the stage output,
// LM head and cross-entropy (+ z-loss), forward and backward per row chunk so the full logits of
// a micro-batch never exist. In training it is its own step of the pipeline schedule, between
// the stage's forward and its backward (Transformer::head_step).
#pragma once

#include "kernels/ops.h"
#include "model/activations.h"
#include "model/grad_writes.h"

namespace moe {

struct HeadContext {
  Backend& ops;
  const ModelConfig& cfg;
  const Dims& dims;
  Scratch& scratch;
  const FinalNormActs& final_norm;  // (T) rstd and (T,D) operand-dtype output of the final norm
  int64_t chunk = 1;                // rows per LM-head chunk (lm_head_chunk_rows)
};

struct HeadWeights {
  const Tensor& final_norm;  // (D) master weight
  const Tensor& lm_head;     // (V,D) GEMM operand copy
};

// Forward + backward: x (T,D) the stage output, labels (T) i32 (< 0: no loss). Adds
// ce_scale * sum(CE) to ce and ce_scale * sum(z^2) to lm_z ((1) f64 each); writes d(x) into
// scratch.dresid_TD; the weight gradients go to d_final_norm and d_lm_head (overwritten or added
// to, as grad_writes says).
void lm_head_loss_step(const HeadContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& labels,
                       double ce_scale, double lm_z_coef, const Tensor& ce, const Tensor& lm_z,
                       const Tensor& d_final_norm, const Tensor& d_lm_head, GradWrites& grad_writes);
// Forward only: the summed cross-entropy over labeled positions added to out (1) f64.
void lm_head_eval_loss(const HeadContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& labels,
                       const Tensor& out);
// Forward only: the full logits (T,V) in the compute dtype.
void lm_head_logits(const HeadContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& logits);

}  // namespace moe
