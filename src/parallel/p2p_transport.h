// The point-to-point expert transport: one isend/irecv per non-empty (rank, local expert) block
// through a Communicator (MPI), placed straight at its expert-major position on the receiver;
// blocks to self are device copies.
// Why per-block point-to-point rather than all_to_all_v: all_to_all_v delivers rows grouped by
// sender, which needs either a placement copy of every received row (a second permutation) or
// (expert, source) segments in the grouped GEMM (ep x more, smaller GEMM groups); per-block
// messages place rows expert-major at no extra copy (tests/parallel/expert_parallel_test.cpp
// measures both).
// Posting a message needs its size on the host, so this transport is the one place that reads
// routing counts on the host: per plan, one download of the local counts (E i32, counted by the
// backend), the all-gather on the host, an upload of the matrix, and a host mirror of the plan
// computed by the reference backend's ep_plan (bitwise the device plan: same integers). Recompute reuses
// the plan, so it reads nothing.
// On a backend whose memory the host cannot address the payload is staged: one download of the
// source rows and one upload of the destination rows per move (counted as staging), unless the
// communicator takes device buffers (NCCL on cuda): then the counts are gathered on the device and
// read once per plan, and the blocks go as grouped ncclSend/ncclRecv between device buffers.
#pragma once

#include <memory>
#include <vector>

#include "parallel/expert_exchange.h"
#include "parallel/communicator.h"
#include "parallel/staged_comm.h"

namespace moe {

class P2pExpertTransport final : public ExpertTransport {
 public:
  // ep: the expert-parallel group (not owned).
  P2pExpertTransport(Communicator& ep, Backend& ops, int64_t num_experts);
  int64_t size() const override { return comm_.size(); }
  int64_t rank() const override { return comm_.rank(); }
  void gather_counts(const Tensor& local_counts, ExchangePlan& plan) override;
  void plan_ready(ExchangePlan& plan, int64_t capacity) override;
  void move(const ExchangePlan& plan, const Tensor& local, const Tensor& received, bool to_experts,
            const Tensor& workspace) override;
  double blocked_seconds() const override { return blocked_s_; }
  const TransferStats& staged() const override { return staging_.staged(); }

 private:
  Communicator& comm_;
  Backend& ops_;
  std::unique_ptr<Backend> host_ops_;  // the reference backend: the plan's host mirror
  StagedComm staging_;
  int64_t num_experts_;
  std::vector<int32_t> local_counts_;  // (E) staged
  std::vector<unsigned char> local_host_, received_host_;  // payload copies when staged
  std::vector<Request> requests_;
  double blocked_s_ = 0;
};

}  // namespace moe
