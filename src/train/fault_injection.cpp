#include "train/fault_injection.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "core/check.h"

namespace moe {

InjectedFaults::InjectedFaults(int rank) {
  const char* env = std::getenv("MOE_INJECT_FAULT");
  if (env == nullptr) return;
  spec_ = env;
  char kind[16] = {};
  long long r = -1, s = -1;
  MOE_CHECK(std::sscanf(env, "%15[a-z]@%lld:%lld", kind, &r, &s) == 3, "MOE_INJECT_FAULT='", env,
            "': expected error@RANK:STEP, nan@RANK:STEP or nangrad@RANK:STEP");
  kind_ = kind;
  if (r == rank) {
    rank_ = r;
    step_ = s;
  }
}

void InjectedFaults::before_step(Trainer& trainer, int64_t step) {
  if (spec_.empty() || step != step_) return;
  if (kind_ == "error") MOE_FAIL("injected fault (MOE_INJECT_FAULT=", spec_, ")");
  if (kind_ == "nangrad" || kind_ == "nowait" || kind_ == "extraread") {
    armed_ = true;  // acts in the step enqueued next
    return;
  }
  MOE_CHECK(kind_ == "nan", "MOE_INJECT_FAULT: unknown kind '", kind_, "'");
  const ParamInfo& p = trainer.model().layout().entries().front();
  trainer.model().ops().fill(param_view(p, trainer.model().params().flat), std::nan(""));
}

void InjectedFaults::after_gradients(Backend& ops, const ParamLayout& layout, const Tensor& grads,
                                     const StepStats& stats) {
  if (!armed_) return;
  armed_ = false;
  if (kind_ == "nangrad") ops.fill(param_view(layout.entries().front(), grads), std::nan(""));
  if (kind_ == "extraread") ops.download(stats.values.slice(0, 1), &extra_read_);  // lands by the next wait
  no_wait_ = kind_ == "nowait";
}

bool InjectedFaults::read_record_without_wait() { return std::exchange(no_wait_, false); }

}  // namespace moe
