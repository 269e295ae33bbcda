// The control scalars of one optimizer step (the step_control op of kernels/op_list.inc): f64
// entries of one device tensor, written where the statistics live and read by the update ops,
// so the host need not see them before the update.
#pragma once

namespace moe {

enum StepControl : int {
  kCtlGradNorm = 0,  // global gradient norm
  kCtlLoss,          // total loss (the configured coefficients)
  kCtlClipCoef,      // factor the gradients are scaled by (1 when not clipped)
  kCtlClipped,       // 1 when clipped
  kCtlNonfinite,     // 1 when loss or norm is NaN/Inf: the update ops then change nothing
  kCtlLr,            // learning rate of this step
  kCtlUpdates,       // optimizer updates applied so far (AdamW's step after this one)
  kCtlSize = 8,
};

}  // namespace moe
