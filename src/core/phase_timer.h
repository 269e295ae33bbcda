// Per-phase wall-clock profiler for `moecore bench`. Off by default: a disabled PhaseScope costs
// one branch. Timing is exclusive: entering a nested scope stops the clock of the enclosing
// phase, so the phases never double count. Everything outside any scope is "other" (norms,
// embedding, residual adds, grad zeroing); bench derives it as step time minus the named phases.
// Timers only read the clock: they never change what is computed (bitwise tests unaffected).
// Single-threaded use (the host thread that issues the ops); kernels parallelize inside.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

namespace moe {

enum class Phase : int {
  kOther = 0,
  kAttention,
  kRouter,
  kPermute,
  kExpertGemm,
  kCombine,
  kLmHeadLoss,
  kOptimizer,
  kCommunication,  // blocking time in collectives and send/recv
  kQuantize,       // MXFP8: quantizing and dequantizing operands (train.precision = "mxfp8")
  kCount
};

const char* phase_name(Phase p);

// What times the phase boundaries: the host clock (default), or a backend's events (stream
// time: on an asynchronous backend the host only enqueues, so its clock would time the enqueue).
// record() marks a point after everything enqueued so far; seconds(a, b) is the stream time
// between two marks once synchronize() has returned.
struct PhaseClock {
  void* ctx = nullptr;
  uint64_t (*record)(void* ctx) = nullptr;
  void (*synchronize)(void* ctx) = nullptr;
  double (*seconds)(void* ctx, uint64_t from, uint64_t to) = nullptr;
};

class PhaseTimer {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kNum = static_cast<int>(Phase::kCount);

  static bool enabled() { return enabled_; }
  // Times phases with a backend's events (nullptr: the host clock). CPU seconds and allocations
  // stay host measurements.
  static void set_clock(const PhaseClock* clock);
  static void set_enabled(bool on);
  static void reset();  // zero all accumulated times
  static void flush();  // charge the time since the last switch to the current phase
  // Accumulated exclusive seconds per phase since reset(); kOther only holds time in explicit
  // kOther scopes (bench computes the real "other" from the step time).
  static const std::array<double, kNum>& seconds() { return seconds_; }
  // The same per phase in CPU seconds of the whole process (all threads): on a shared machine
  // this barely moves when other processes take the cores, unlike wall time (with
  // OMP_WAIT_POLICY=passive, so that waiting threads sleep instead of spinning).
  static const std::array<double, kNum>& cpu_seconds() { return cpu_seconds_; }
  static double process_cpu_now() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  // Optional heap allocation counter: allocations are then attributed to phases as well.
  static void set_alloc_counter(const std::atomic<uint64_t>* c) { alloc_counter_ = c; }
  static const std::array<uint64_t, kNum>& allocs() { return allocs_; }
  // Optional reader of the calling thread's own allocation count (same counting operator new).
  // With it, ForeignAllocScope separates the allocations made inside library calls that cannot
  // be made allocation-free from ours; foreign_allocs() is their running total (all threads).
  static void set_thread_alloc_reader(uint64_t (*f)()) { thread_alloc_reader_ = f; }
  static uint64_t foreign_allocs() { return foreign_allocs_.load(std::memory_order_relaxed); }

 private:
  friend class PhaseScope;
  static bool enabled_;
  static Phase current_;
  static Clock::time_point since_;
  static std::array<double, kNum> seconds_;
  static double cpu_since_;
  static std::array<double, kNum> cpu_seconds_;
  static const std::atomic<uint64_t>* alloc_counter_;
  static uint64_t allocs_since_;
  static std::array<uint64_t, kNum> allocs_;
  friend class ForeignAllocScope;
  static uint64_t (*thread_alloc_reader_)();
  static std::atomic<uint64_t> foreign_allocs_;
  // With a PhaseClock: the phase that each marked interval belongs to, and the event ending it,
  // since the last flush (fixed ring: no allocation; folded early when full).
  struct Mark {
    Phase phase;
    uint64_t event;
  };
  static constexpr size_t kMarks = 2048;
  static const PhaseClock* clock_;
  static std::array<Mark, kMarks> marks_;
  static size_t num_marks_;
  static void mark(Phase ending);
  static void fold_marks();
};

// Brackets one call into a library that allocates internally (any thread; the count is the
// calling thread's own, so concurrent scopes never see each other's allocations).
class ForeignAllocScope {
 public:
  ForeignAllocScope() : read_(PhaseTimer::thread_alloc_reader_), start_(read_ ? read_() : 0) {}
  ~ForeignAllocScope() {
    if (read_) PhaseTimer::foreign_allocs_.fetch_add(read_() - start_, std::memory_order_relaxed);
  }
  ForeignAllocScope(const ForeignAllocScope&) = delete;
  ForeignAllocScope& operator=(const ForeignAllocScope&) = delete;

 private:
  uint64_t (*read_)();
  uint64_t start_;
};

class PhaseScope {
 public:
  explicit PhaseScope(Phase p) {
    if (!PhaseTimer::enabled_) return;
    active_ = true;
    prev_ = PhaseTimer::current_;
    switch_to(p);
  }
  ~PhaseScope() {
    if (active_) switch_to(prev_);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  friend class PhaseTimer;
  static void switch_to(Phase p) {
    if (PhaseTimer::clock_) {
      PhaseTimer::mark(PhaseTimer::current_);
    } else {
      const PhaseTimer::Clock::time_point now = PhaseTimer::Clock::now();
      PhaseTimer::seconds_[static_cast<size_t>(PhaseTimer::current_)] +=
          std::chrono::duration<double>(now - PhaseTimer::since_).count();
      PhaseTimer::since_ = now;
    }
    const double cpu = PhaseTimer::process_cpu_now();
    PhaseTimer::cpu_seconds_[static_cast<size_t>(PhaseTimer::current_)] += cpu - PhaseTimer::cpu_since_;
    PhaseTimer::cpu_since_ = cpu;
    if (PhaseTimer::alloc_counter_) {
      const uint64_t a = PhaseTimer::alloc_counter_->load(std::memory_order_relaxed);
      PhaseTimer::allocs_[static_cast<size_t>(PhaseTimer::current_)] += a - PhaseTimer::allocs_since_;
      PhaseTimer::allocs_since_ = a;
    }
    PhaseTimer::current_ = p;
  }
  bool active_ = false;
  Phase prev_ = Phase::kOther;
};

}  // namespace moe
