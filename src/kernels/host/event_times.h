// When each recorded event was reached, for Backend::elapsed_seconds: a fixed ring (no
// allocation in the step), so only the most recent kSlots events can be compared.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>

#include "core/check.h"
#include "kernels/ops.h"

namespace moe {

class EventTimes {
 public:
  static constexpr uint64_t kSlots = kEventHistory;
  void stamp(uint64_t seq) {
    slots_[seq % kSlots] = Slot{seq, std::chrono::steady_clock::now()};
  }
  double seconds_between(uint64_t from, uint64_t to) const {
    const Slot& a = slots_[from % kSlots];
    const Slot& b = slots_[to % kSlots];
    MOE_CHECK(a.seq == from && b.seq == to, "elapsed_seconds: event ", a.seq == from ? to : from,
              " is not among the last ", kSlots, " recorded");
    return std::chrono::duration<double>(b.at - a.at).count();
  }

 private:
  struct Slot {
    uint64_t seq = ~uint64_t{0};
    std::chrono::steady_clock::time_point at{};
  };
  std::array<Slot, kSlots> slots_{};
};

}  // namespace moe
