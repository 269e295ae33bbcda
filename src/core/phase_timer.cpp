#include "core/phase_timer.h"

namespace moe {

bool PhaseTimer::enabled_ = false;
Phase PhaseTimer::current_ = Phase::kOther;
PhaseTimer::Clock::time_point PhaseTimer::since_{};
std::array<double, PhaseTimer::kNum> PhaseTimer::seconds_{};
double PhaseTimer::cpu_since_ = 0;
std::array<double, PhaseTimer::kNum> PhaseTimer::cpu_seconds_{};
const std::atomic<uint64_t>* PhaseTimer::alloc_counter_ = nullptr;
uint64_t PhaseTimer::allocs_since_ = 0;
std::array<uint64_t, PhaseTimer::kNum> PhaseTimer::allocs_{};
uint64_t (*PhaseTimer::thread_alloc_reader_)() = nullptr;
std::atomic<uint64_t> PhaseTimer::foreign_allocs_{0};
const PhaseClock* PhaseTimer::clock_ = nullptr;
std::array<PhaseTimer::Mark, PhaseTimer::kMarks> PhaseTimer::marks_{};
size_t PhaseTimer::num_marks_ = 0;

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
    case Phase::kCommunication: return "communication";
    case Phase::kQuantize: return "quantize";
    case Phase::kCount: break;
  }
  return "?";
}

void PhaseTimer::set_clock(const PhaseClock* clock) {
  clock_ = clock;
  num_marks_ = 0;
}

void PhaseTimer::mark(Phase ending) {
  if (num_marks_ == kMarks) fold_marks();
  marks_[num_marks_++] = Mark{ending, clock_->record(clock_->ctx)};
}

// Charges each marked interval to its phase; keeps the last mark as the start of the next.
void PhaseTimer::fold_marks() {
  if (num_marks_ < 2) return;
  clock_->synchronize(clock_->ctx);
  for (size_t i = 1; i < num_marks_; ++i)
    seconds_[static_cast<size_t>(marks_[i].phase)] += clock_->seconds(clock_->ctx, marks_[i - 1].event, marks_[i].event);
  marks_[0] = marks_[num_marks_ - 1];
  num_marks_ = 1;
}

void PhaseTimer::set_enabled(bool on) {
  enabled_ = on;
  current_ = Phase::kOther;
  since_ = Clock::now();
  cpu_since_ = process_cpu_now();
  if (alloc_counter_) allocs_since_ = alloc_counter_->load(std::memory_order_relaxed);
}

void PhaseTimer::reset() {
  seconds_.fill(0.0);
  cpu_seconds_.fill(0.0);
  allocs_.fill(0);
  current_ = Phase::kOther;
  since_ = Clock::now();
  cpu_since_ = process_cpu_now();
  if (alloc_counter_) allocs_since_ = alloc_counter_->load(std::memory_order_relaxed);
  if (clock_) {
    num_marks_ = 0;
    marks_[num_marks_++] = Mark{Phase::kOther, clock_->record(clock_->ctx)};  // the start
  }
}

void PhaseTimer::flush() {
  if (!enabled_) return;
  PhaseScope::switch_to(current_);
  if (clock_) fold_marks();
}

}  // namespace moe
