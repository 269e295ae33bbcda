// The padded expert transport (parallel.ep_transport = "padded"): every move is one fixed-size
// all-to-all of per-peer slabs, so no message size, and therefore no routing count, is ever read
// on the host. A step with it can run with no device-to-host synchronization (and be captured in
// a CUDA graph) under expert parallelism.
//
//   to the experts: ep_slab_copy packs my kept rows for peer q into slab q (local expert major),
//                   the all-to-all swaps slab q of every rank with rank q, and ep_slab_copy places
//                   the slab from source q at its expert-major rows (recv_begin): no second
//                   permutation, the same rows in the same places as the p2p transport;
//   back:           the reverse, and my dropped rows are zeroed while unpacking.
// The plan is the same ep_plan on the device (rank-wide capacity, keep order, offsets), from
// counts all-gathered between device buffers (staged through the host only when the
// communicator cannot take the backend's memory).
//
// What it costs: a slab holds exchange_slab_rows = min(T * min(K, El), capacity) rows, the most
// one peer can be sent, so each move sends (ep - 1) slabs whatever the routing, against the
// p2p transport's actual off-rank rows (about (ep - 1) / ep * T * K with balanced routing):
// ep / cf times the bytes with cf >= 1 and min(K, El) = K (the byte counters report it as
// all_to_all_v), and the two slab sets are scratch of the activation plan (counted in the
// estimate). Why not direct stores into capacity-shaped symmetric windows (NCCL 2.28 device
// API, Olmo-core 3's NVSHMEM PUT): they move only the kept rows, but they need peer-to-peer
// GPUs to run at all, and this transport is what we can test here end to end over MPI.
#pragma once

#include "parallel/expert_exchange.h"
#include "parallel/communicator.h"
#include "parallel/staged_comm.h"

namespace moe {

class PaddedExpertTransport final : public ExpertTransport {
 public:
  // ep: the expert-parallel group (not owned); slab_rows: exchange_slab_rows of the run.
  PaddedExpertTransport(Communicator& ep, Backend& ops, int64_t num_experts, int64_t slab_rows);
  int64_t size() const override { return comm_.size(); }
  int64_t rank() const override { return comm_.rank(); }
  void gather_counts(const Tensor& local_counts, ExchangePlan& plan) override;
  void plan_ready(ExchangePlan&, int64_t) override {}  // nothing on the host
  void move(const ExchangePlan& plan, const Tensor& local, const Tensor& received, bool to_experts,
            const Tensor& workspace) override;
  double blocked_seconds() const override { return blocked_s_; }
  const TransferStats& staged() const override { return staging_.staged(); }

 private:
  Communicator& comm_;
  Backend& ops_;
  StagedComm staging_;
  int64_t slab_rows_;
  double blocked_s_ = 0;
};

}  // namespace moe
