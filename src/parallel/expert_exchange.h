// Expert parallelism: the token exchange of one MoE layer inside an EP group of `ep` ranks, rank r
// holding global experts [r*El, (r+1)*El).
//
// After moe_plan a rank's T*K rows are expert-major over the GLOBAL experts, so the rows for
// destination rank p are one contiguous run (experts p*El .. p*El+El-1), cut into El blocks.
//  1. make_plan: the transport gathers the E per-expert counts of every rank -> the (ep x E)
//     count matrix, and the ep_plan op turns it into the plan on the device (kept rows, both
//     ends' offsets, the grouped GEMMs' offsets over received rows, totals); capacity drops are
//     decided there, identically on every rank. Recompute reuses the stored plan.
//  2. send_to_experts: each (source s, local expert e) block lands directly in the receiver's
//     buffer at its expert-major place (local expert major, then source rank), so the grouped
//     GEMM runs over (El+1) offsets with no second permutation.
//  3. return_to_sources: the reverse (expert outputs, or input gradients in backward).
// How rows travel is the transport's business (ExpertTransport below): the point-to-point one
// (parallel/p2p_transport.*) posts one message per block through a Communicator and therefore reads
// the plan on the host, once per plan; a device transport (NCCL) would not.
//
// Capacity (optional): a receiving rank keeps at most `capacity` rows, in the order (local expert,
// then source rank, then the source's token order); the tail is dropped. A dropped row is not
// sent, its expert output is zero (it adds nothing to the combine) and it gets no gradient.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "core/phase_timer.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "model/exchange_bounds.h"
#include "model/expert_dispatch.h"

namespace moe {

// One exchange plan: i32 views into one buffer of plan_words(ep, E) elements on the backend's
// device, so a transport that needs it on the host reads it in one download. Layout in order:
// counts (ep,E), kept (ep,E), local_begin (E), recv_begin (El,ep), recv_offsets (El+1),
// totals (4+ep) -- the outputs of ep_plan (kernels/op_list.inc), counts being its input.
struct ExchangePlan {
  static int64_t words(int64_t ep, int64_t num_experts);
  // Views over `buffer` (>= words(ep, E) i32 elements).
  static ExchangePlan over(const Tensor& buffer, int64_t ep, int64_t num_experts);

  Tensor all, counts, kept, local_begin, recv_begin, recv_offsets, totals;
  // The same words on the host, for transports that read the plan there (empty otherwise).
  std::vector<int32_t> host;
  // A total (ExchangeTotal) from the host copy; fails when the transport keeps none.
  int64_t host_total(int which) const;
};

// Indices into ExchangePlan::totals.
enum ExchangeTotal : int { kRowsReceived = 0, kRowsSentOffRank = 1, kRowsRouted = 2, kRowsDropped = 3, kReceivedPerRank = 4 };


// For transports: adds the seconds of its scope to `total` (the host blocked in communication)
// and books them to the communication phase.
class BlockedTimer {
 public:
  explicit BlockedTimer(double& total) : total_(total), phase_(Phase::kCommunication) {}
  ~BlockedTimer() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }

 private:
  double& total_;
  PhaseScope phase_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// How an EP group moves rows. Collective: every rank of the group calls in the same order.
class ExpertTransport {
 public:
  virtual ~ExpertTransport() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;
  // plan.counts (ep,E) <- every rank's local_counts (E) (device tensors).
  virtual void gather_counts(const Tensor& local_counts, ExchangePlan& plan) = 0;
  // Called once ep_plan has written the plan's device tensors.
  virtual void plan_ready(ExchangePlan& plan, int64_t capacity) = 0;
  // to_experts: local (>= T*K, D) rows -> received (>= rows received, D); else the reverse, and
  // my dropped rows in local are zeroed. workspace: the transport's scratch in the activation
  // plan (Scratch::ep_slabs; empty when the transport needs none), any dtype.
  virtual void move(const ExchangePlan& plan, const Tensor& local, const Tensor& received, bool to_experts,
                    const Tensor& workspace) = 0;
  // Seconds the host spent blocked in this transport, since creation.
  virtual double blocked_seconds() const = 0;
  // Payload bytes staged through the host so far (zero for a device transport).
  virtual const TransferStats& staged() const = 0;
};

// The expert exchange of a model's MoE layers: the model's ExpertDispatch over a transport, with
// one plan per (activation slot, MoE layer) and the exchange counters. Built by parallelize
// (parallel/parallelize.h).
class ExpertExchange final : public ExpertDispatch {
 public:
  // capacity < 0: dropless. slots: the most activation slots of any layer chunk; moe_layers: the
  // model's MoE layers (a MoE layer lies in one chunk, so slots of different chunks do not share
  // a plan).
  ExpertExchange(std::unique_ptr<ExpertTransport> transport, Backend& ops, int64_t num_experts, int64_t capacity,
                 int64_t slots, int64_t moe_layers);
  int64_t size() const override { return transport_->size(); }
  double blocked_seconds() const { return transport_->blocked_seconds(); }
  const TransferStats& staged() const { return transport_->staged(); }

  void plan(int64_t slot, int64_t moe_layer, const Tensor& local_counts) override;
  Tensor received_offsets(int64_t slot, int64_t moe_layer) const override { return route(slot, moe_layer).recv_offsets; }
  void send_to_experts(int64_t slot, int64_t moe_layer, const Tensor& local, const Tensor& received,
                       const Tensor& workspace) override {
    transport_->move(route(slot, moe_layer), local, received, true, workspace);
  }
  void return_to_sources(int64_t slot, int64_t moe_layer, const Tensor& received, const Tensor& local,
                         const Tensor& workspace) override {
    transport_->move(route(slot, moe_layer), local, received, false, workspace);
  }

  // Writes every device tensor of plan (whose views must be bound: ExchangePlan::over) from
  // local_counts (E) i32, this rank's rows per global expert. Collective over the group.
  void make_plan(const Tensor& local_counts, ExchangePlan& plan);
  // (MoE layers, 4 + ep) i32 on the device: each layer's plan totals (ExchangeTotal) summed over
  // the plans made since the last reset (recompute re-runs make none).
  const Tensor& counts() const { return counts_.t; }
  void reset_counts();
  // The plan of one route (its host words, for transports that keep them).
  const ExchangePlan& route(int64_t slot, int64_t moe_layer) const;

 private:
  std::unique_ptr<ExpertTransport> transport_;
  Backend& ops_;
  int64_t num_experts_, capacity_;
  Buffer plan_mem_;                               // every plan's i32 words, on the device
  std::vector<std::vector<ExchangePlan>> plans_;  // [activation slot][MoE layer]
  OwnedTensor counts_;
};

// The step's exchange statistics over a pipeline stage: each EP group counted its own exchanges
// (counters: (layers, 4 + ep) i32 on the host, ExchangeTotal per layer), and the EP groups of a
// stage are the edp indices, so a sum over the edp group (nullptr or size 1: none) gives the whole
// stage's rows, the same on every rank. Appends each layer's drop fraction; sizes and fills the
// rows each EP rank received. scratch: reused between calls.
void reduce_exchange_stats(const int32_t* counters, int64_t layers, int64_t ep, Communicator* edp,
                           std::vector<double>& scratch, std::vector<double>& drop_fraction,
                           std::vector<std::vector<int64_t>>& rows_received);

}  // namespace moe
