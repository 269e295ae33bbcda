// Fault injection for the failure tests, driven by MOE_INJECT_FAULT="KIND@RANK:STEP" (unset: none):
//   error     world rank RANK throws before step STEP;
//   nan       fills rank RANK's first parameter with NaN before step STEP (its replicas then
//             disagree, and the non-finite loss must stop every rank);
//   nangrad   makes rank RANK's gradient of its first parameter NaN in step STEP only (a transient
//             fault: with train.on_nonfinite = "skip" that one step is skipped and training goes on);
//   nowait    drops the wait before the host reads step STEP's statistics (the strict backend then
//             hands the host stale bytes);
//   extraread adds one download to step STEP (the transfer count must show it).
// The in-step kinds act through the Trainer's StepHooks (train/step_hooks.h).
#pragma once

#include <cstdint>
#include <string>

#include "train/step_hooks.h"
#include "train/trainer.h"

namespace moe {

class InjectedFaults final : public StepHooks {
 public:
  // The fault MOE_INJECT_FAULT names for world rank `rank` (none when unset).
  explicit InjectedFaults(int rank);
  // Before step `step`: throws (error), poisons the parameters (nan), or arms an in-step fault.
  void before_step(Trainer& trainer, int64_t step);
  void after_gradients(Backend& ops, const ParamLayout& layout, const Tensor& grads, const StepStats& stats) override;
  bool read_record_without_wait() override;

 private:
  std::string spec_, kind_;
  int64_t rank_ = -1, step_ = -1;
  bool armed_ = false, no_wait_ = false;
  double extra_read_ = 0;  // extraread's destination
};

}  // namespace moe
