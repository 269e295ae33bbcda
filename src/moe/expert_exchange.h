// Expert parallelism: the token exchange of one MoE layer inside an EP group of `ep` ranks, rank r
// holding global experts [r*El, (r+1)*El).
//
// After moe_plan a rank's T*K rows are expert-major over the GLOBAL experts, so the rows for
// destination rank p are one contiguous run (experts p*El .. p*El+El-1), cut into El blocks.
//  1. make_plan: all-gather the E per-expert counts over the group -> the (ep x E) count matrix.
//     Every rank then knows every block's size and can compute both ends' offsets; capacity
//     drops are decided here, identically on every rank.
//  2. send_to_experts: each (source s, local expert e) block lands directly in the receiver's
//     buffer at its expert-major place (local expert major, then source rank), so the grouped
//     GEMM runs over (El+1) offsets with no second permutation. One isend/irecv per non-empty
//     block to another rank; blocks to self are copied, never sent.
//  3. return_to_sources: the reverse (expert outputs, or input gradients in backward).
// Why per-block point-to-point rather than all_to_all_v: all_to_all_v delivers rows grouped by
// sender, which needs either a placement copy of every received row (a second permutation) or
// (expert, source) segments in the grouped GEMM (ep x more, smaller GEMM groups); per-block
// messages place rows expert-major at no extra copy (tests/parallel/expert_parallel_test.cpp
// measures both).
//
// Capacity (optional): a receiving rank keeps at most `capacity` rows, in the order (local expert,
// then source rank, then the source's token order); the tail is dropped. A dropped row is not
// sent, its expert output is zero (it adds nothing to the combine) and it gets no gradient.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"

namespace moe {

// Which rows move where in one exchange. Same on every rank of the group except `rank`.
struct ExchangePlan {
  int64_t ep = 1, rank = 0, num_experts = 0, local_experts = 0;
  std::vector<int64_t> counts;       // (ep, E): rows source rank s routes to global expert e
  std::vector<int64_t> kept;         // (ep, E): of those, rows the receiving rank keeps
  std::vector<int64_t> local_begin;  // (E): first row of my block for global expert e, in my rows
  std::vector<int64_t> recv_begin;   // (El, ep): first row of block (local expert, source) received
  int64_t rows_received = 0;         // rows this rank's experts compute
  int64_t rows_sent_off_rank = 0;    // my rows that go to (and come back from) other ranks
  int64_t rows_routed = 0, rows_dropped = 0;   // over the whole EP group
  std::vector<int64_t> received_per_rank;      // (ep): rows each EP rank's experts compute
  int64_t count(int64_t source, int64_t expert) const { return counts[static_cast<size_t>(source * num_experts + expert)]; }
  int64_t kept_rows(int64_t source, int64_t expert) const { return kept[static_cast<size_t>(source * num_experts + expert)]; }
};

// The most rows one rank's experts may have to compute: every rank of the group routes all its
// T tokens to this rank (at most min(K, El) distinct experts each), bounded by the capacity.
int64_t expert_rows_bound(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t ep, double capacity_factor);
// Rows a receiving rank keeps with capacity factor cf > 0: ceil(cf * K * T_local); -1 if cf == 0.
int64_t expert_capacity(int64_t tokens, int64_t top_k, double capacity_factor);

class ExpertExchange {
 public:
  // ep: the expert-parallel group (not owned). capacity < 0: dropless.
  ExpertExchange(Communicator& ep, Backend& ops, int64_t num_experts, int64_t capacity);
  int64_t size() const { return comm_.size(); }
  // Seconds spent blocked in the count all-gather and in waiting for the payload, since creation.
  double blocked_seconds() const { return blocked_s_; }

  // local_counts (E) i32: this rank's rows per global expert. Collective over the group.
  // Fills plan and writes recv_offsets (El+1) i32, the grouped GEMM's offsets over received rows.
  void make_plan(const Tensor& local_counts, ExchangePlan& plan, const Tensor& recv_offsets);
  // local (>= T*K, D): my rows, expert-major over global experts -> received (>= rows_received, D)
  // grouped by (local expert, source rank). Dropped rows are not sent.
  void send_to_experts(const ExchangePlan& plan, const Tensor& local, const Tensor& received);
  // The reverse: received rows back into their source's positions in local; my dropped rows
  // in local are zeroed.
  void return_to_sources(const ExchangePlan& plan, const Tensor& received, const Tensor& local);

 private:
  // direction true: local -> received; false: received -> local.
  void move(const ExchangePlan& plan, const Tensor& local, const Tensor& received, bool to_experts);

  Communicator& comm_;
  Backend& ops_;
  int64_t num_experts_, capacity_;
  std::vector<int32_t> gathered_;  // (ep, E) all-gathered counts
  std::vector<Request> requests_;
  double blocked_s_ = 0;
};

}  // namespace moe
