// Wall time inside each Backend call of the cpu backend, for `moecore bench --ops`: which ops a
// step's time goes to (its phases group several). The cpu backend's calls are synchronous, so the
// time around a call is its op's; an asynchronous backend would time only the enqueue, and the
// bench refuses it there. Off (a null sink) unless a bench sets one: one pointer read per call.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "kernels/ops.h"

namespace moe {

struct OpTimes {
  static constexpr size_t kOps = static_cast<size_t>(OpId::kCount);
  std::array<double, kOps> seconds{};
  std::array<double, kOps> calls{};
};

// The sink the cpu backend adds its calls to, or null (off). The calling thread's: ops are called
// from one thread.
inline OpTimes*& op_times_sink() {
  thread_local OpTimes* sink = nullptr;
  return sink;
}

// Sets the calling thread's sink for a scope; null again when it ends (also by an exception, so
// no call ever adds to an OpTimes that is gone).
class OpTimesScope {
 public:
  explicit OpTimesScope(OpTimes* t) { op_times_sink() = t; }
  ~OpTimesScope() { op_times_sink() = nullptr; }
  OpTimesScope(const OpTimesScope&) = delete;
  OpTimesScope& operator=(const OpTimesScope&) = delete;
};

// Times one call into the sink set when it starts.
class OpClock {
 public:
  explicit OpClock(OpId op) : sink_(op_times_sink()), op_(static_cast<size_t>(op)) {
    if (sink_) start_ = std::chrono::steady_clock::now();
  }
  ~OpClock() {
    if (!sink_) return;
    sink_->seconds[op_] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    sink_->calls[op_] += 1;
  }
  OpClock(const OpClock&) = delete;
  OpClock& operator=(const OpClock&) = delete;

 private:
  OpTimes* sink_;
  size_t op_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace moe
