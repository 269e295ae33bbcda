// Where code outside the Trainer may act inside one of its steps, between the device work the
// step enqueues. The failure tests' injected faults (train/fault_injection.h) act here; a test
// may bring its own. Installed with Trainer::set_step_hooks.
#pragma once

#include "kernels/ops.h"
#include "model/params.h"
#include "model/step_stats.h"

namespace moe {

class StepHooks {
 public:
  virtual ~StepHooks() = default;
  // Gradients reduced over the ranks, before the grad norm and the step's decisions; grads is
  // the flat gradient buffer in layout's order. May enqueue device work.
  virtual void after_gradients(Backend& /*ops*/, const ParamLayout& /*layout*/, const Tensor& /*grads*/,
                               const StepStats& /*stats*/) {}
  // Asked once the step's record is enqueued: read it without waiting for it (a device-discipline
  // bug the strict backend must expose).
  virtual bool read_record_without_wait() { return false; }
};

}  // namespace moe
