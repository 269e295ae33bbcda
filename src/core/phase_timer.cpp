#include "core/phase_timer.h"

namespace moe {

bool PhaseTimer::enabled_ = false;
Phase PhaseTimer::current_ = Phase::kOther;
PhaseTimer::Clock::time_point PhaseTimer::since_{};
std::array<double, PhaseTimer::kNum> PhaseTimer::seconds_{};

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kOther: return "other";
    case Phase::kAttention: return "attention";
    case Phase::kRouter: return "router";
    case Phase::kPermute: return "permute";
    case Phase::kExpertGemm: return "expert_gemm";
    case Phase::kCombine: return "combine";
    case Phase::kLmHeadLoss: return "lm_head_loss";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kCount: break;
  }
  return "?";
}

void PhaseTimer::set_enabled(bool on) {
  enabled_ = on;
  current_ = Phase::kOther;
  since_ = Clock::now();
}

void PhaseTimer::reset() {
  seconds_.fill(0.0);
  current_ = Phase::kOther;
  since_ = Clock::now();
}

void PhaseTimer::flush() {
  if (enabled_) PhaseScope::switch_to(current_);
}

}  // namespace moe
