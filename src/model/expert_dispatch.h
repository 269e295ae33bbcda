// How a MoE layer's routed rows reach the experts that compute them. Without expert parallelism
// the rows stay where they are and there is no dispatch; with it, the expert exchange
// (parallel/expert_exchange.h) moves them to the ranks holding their experts and back, installed
// on a built model by parallelize (parallel/parallelize.h). The model crosses no ranks itself:
// this interface is all it knows of the exchange.
//
// A route is one (activation slot, MoE layer) pair: 1F1B keeps several micro-batches in flight,
// each with its own plan, made by the forward and reused by recompute and the backward.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

class ExpertDispatch {
 public:
  virtual ~ExpertDispatch() = default;
  // Ranks in the expert-parallel group.
  virtual int64_t size() const = 0;
  // Plans the route from this rank's rows per global expert, local_counts (E) i32 on the device,
  // and counts it in the exchange counters. Collective over the group.
  virtual void plan(int64_t slot, int64_t moe_layer, const Tensor& local_counts) = 0;
  // (El + 1) i32 on the device: the grouped GEMMs' offsets over the rows this rank's experts receive.
  virtual Tensor received_offsets(int64_t slot, int64_t moe_layer) const = 0;
  // local (>= T*K, D): my rows, expert-major over the global experts -> received, grouped by
  // (local expert, source rank); dropped rows are not sent. workspace: the transport's scratch in
  // the activation plan (Scratch::ep_slabs; empty when it needs none).
  virtual void send_to_experts(int64_t slot, int64_t moe_layer, const Tensor& local, const Tensor& received,
                               const Tensor& workspace) = 0;
  // The reverse: received rows back into their places in local; my dropped rows are zeroed.
  virtual void return_to_sources(int64_t slot, int64_t moe_layer, const Tensor& received, const Tensor& local,
                                 const Tensor& workspace) = 0;
};

}  // namespace moe
