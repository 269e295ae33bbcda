// Sizes of the expert-parallel exchange that follow from the config alone, shared by the
// exchange itself, the activation plan and the planner (src/plan/; no backend, no communicator).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace moe {

// How an EP group's rows travel (parallel.ep_transport).
enum class ExchangeTransportKind : uint8_t {
  kP2p,     // per-block point-to-point messages sized by the plan, read on the host once per plan
  kPadded,  // fixed slabs per peer through one all-to-all: no host read of routing
};

// Rows a receiving rank keeps with capacity factor cf > 0: ceil(cf * K * T_local); -1 if cf == 0.
inline int64_t expert_capacity(int64_t tokens, int64_t top_k, double capacity_factor) {
  if (capacity_factor <= 0) return -1;
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(top_k * tokens)));
}

// The most rows one rank's experts may have to compute: every rank of the group routes all its
// T tokens to this rank (at most min(K, El) distinct experts each), bounded by the capacity.
inline int64_t expert_rows_bound(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t ep, double capacity_factor) {
  int64_t rows = ep * tokens * std::min(top_k, num_experts / ep);
  const int64_t capacity = expert_capacity(tokens, top_k, capacity_factor);
  if (capacity >= 0) rows = std::min(rows, capacity);
  return rows;
}

// The padded transport's slab: the most kept rows one rank can exchange with one peer, T tokens
// times at most min(K, El) of the peer's experts each, bounded by the capacity.
inline int64_t exchange_slab_rows(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t ep, double capacity_factor) {
  int64_t rows = tokens * std::min(top_k, num_experts / ep);
  const int64_t capacity = expert_capacity(tokens, top_k, capacity_factor);
  if (capacity >= 0) rows = std::min(rows, capacity);
  return rows;
}

// i32 words of one exchange plan (ExchangePlan): counts and kept (ep,E), local_begin (E),
// recv_begin (El,ep), recv_offsets (El+1), totals (4+ep).
inline int64_t exchange_plan_words(int64_t ep, int64_t num_experts) {
  const int64_t El = num_experts / ep;
  return 2 * ep * num_experts + num_experts + El * ep + (El + 1) + (4 + ep);
}

}  // namespace moe
