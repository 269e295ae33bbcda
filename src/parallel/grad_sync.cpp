#include "parallel/grad_sync.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <cmath>
#include <cstring>

#include "core/phase_timer.h"
#include "model/step_stats.h"

namespace moe {

GradSync::GradSync(Backend& ops, const ParamLayout& layout, ProcessGroups* groups, bool zero1, bool overlap)
    : ops_(ops), layout_(layout), groups_(groups), zero1_(zero1 && groups != nullptr), comm_(ops) {
  overlap_ = overlap && groups_ != nullptr && !zero1_;
  MOE_CHECK(!overlap_ || (comm_.direct(*groups_->dp) && groups_->dp->buffer_device() == Device::kCpu),
            "parallel.overlap_grad_reduce needs a backend whose memory the host can address (", ops.name(),
            ": its buffers are staged through the host, or reduced on the device by NCCL)");
  if (overlap_) {
    // Each layer's parameters are contiguous within the dense region and within the expert region.
    for (const ParamInfo& p : layout.entries()) {
      if (p.layer < 0) continue;
      const auto l = static_cast<size_t>(p.layer);
      if (buckets_.size() <= l) buckets_.resize(l + 1);
      LayerBucket& b = buckets_[l];
      int64_t& lo = p.is_expert ? b.expert_begin : b.dense_begin;
      int64_t& hi = p.is_expert ? b.expert_end : b.dense_end;
      lo = lo < 0 ? p.offset : std::min(lo, p.offset);
      hi = std::max(hi, p.offset + p.numel);
    }
    in_flight_.reserve(2 * buckets_.size());
  }
  dense_ = {0, layout.dense_end(), groups_ ? groups_->dp.get() : nullptr};
  experts_ = {layout.dense_end(), layout.total() - layout.dense_end(), groups_ ? groups_->edp.get() : nullptr};
  if (zero1_) {
    for (const Region* r : {&dense_, &experts_})
      MOE_CHECK(r->length % r->comm->size() == 0, "ZeRO-1: a parameter region of ", r->length,
                " elements does not split into ", r->comm->size(), " chunks (layout not padded for it)");
  }
  // Each parameter's slice that this rank counts toward the norm: with ZeRO-1 the owned chunk's
  // part (chunks are disjoint over the world); otherwise all of it on the first replica only.
  std::vector<int64_t> segments;
  const bool count_dense = !groups_ || groups_->coords.dp == 0;
  const bool count_experts = !groups_ || groups_->coords.edp == 0;
  for (const ParamInfo& p : layout.entries()) {
    int64_t lo = p.offset, hi = p.offset + p.numel;
    if (zero1_) {
      const Region& r = p.is_expert ? experts_ : dense_;
      lo = std::max(lo, r.chunk_begin());
      hi = std::min(hi, r.chunk_begin() + r.chunk());
      if (lo >= hi) continue;
    } else if (!(p.is_expert ? count_experts : count_dense)) {
      continue;
    }
    segments.insert(segments.end(), {lo, hi, p.global_index});
  }
  if (!segments.empty()) {
    sumsq_segments_ = OwnedTensor(ops, DType::kI64, {static_cast<int64_t>(segments.size() / 3), 3});
    ops.upload(segments.data(), sumsq_segments_.t);
  }
}

std::vector<std::pair<int64_t, int64_t>> GradSync::owned_ranges() const {
  if (!zero1_) return {};
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Region* r : {&dense_, &experts_})
    if (r->length > 0) out.emplace_back(r->chunk_begin(), r->chunk_begin() + r->chunk());
  return out;
}

void GradSync::reduce_scatter(const Region& r, const Tensor& flat) {
  if (r.length == 0) return;
  comm_.reduce_scatter_sum(*r.comm, flat.slice(r.begin, r.begin + r.length),
                           flat.slice(r.chunk_begin(), r.chunk_begin() + r.chunk()));
}

void GradSync::all_gather(const Region& r, const Tensor& flat) {
  if (r.length == 0) return;
  comm_.all_gather(*r.comm, flat.slice(r.chunk_begin(), r.chunk_begin() + r.chunk()),
                   flat.slice(r.begin, r.begin + r.length));
}

void GradSync::gather_params(const Tensor& param_flat) {
  if (!zero1_) return;
  PhaseScope phase(Phase::kCommunication);
  all_gather(dense_, param_flat);
  all_gather(experts_, param_flat);
}

int64_t GradSync::dp_size() const { return groups_ ? groups_->layout.dp : 1; }
int64_t GradSync::dp_rank() const { return groups_ ? groups_->coords.dp : 0; }

void GradSync::begin_step(const Tensor& grad_flat, int64_t backwards_per_layer) {
  if (!overlap_) return;
  grads_ = grad_flat;
  backwards_per_layer_ = backwards_per_layer;
  for (LayerBucket& b : buckets_) b.done = 0;
}

void GradSync::layer_done(int64_t layer) {
  if (!overlap_ || layer >= static_cast<int64_t>(buckets_.size())) return;
  PhaseScope phase(Phase::kCommunication);
  LayerBucket& b = buckets_[static_cast<size_t>(layer)];
  if (++b.done == backwards_per_layer_) {
    char* base = static_cast<char*>(grads_.data);
    const size_t es = dtype_size(grads_.dtype);
    if (groups_->dp->size() > 1 && b.dense_begin >= 0)
      in_flight_.push_back(groups_->dp->iall_reduce_sum(base + static_cast<size_t>(b.dense_begin) * es,
                                                        static_cast<size_t>(b.dense_end - b.dense_begin), grads_.dtype));
    if (groups_->edp->size() > 1 && b.expert_begin >= 0)
      in_flight_.push_back(groups_->edp->iall_reduce_sum(base + static_cast<size_t>(b.expert_begin) * es,
                                                         static_cast<size_t>(b.expert_end - b.expert_begin), grads_.dtype));
  }
  for (Request& r : in_flight_) r.test();  // progress
}

void GradSync::reduce_gradients(const Tensor& grad_flat) {
  if (!groups_) return;
  PhaseScope phase(Phase::kCommunication);
  if (overlap_) {
    // The dense parameters outside the layers (embedding, final norm, LM head), then the wait.
    const auto t0 = std::chrono::steady_clock::now();
    char* base = static_cast<char*>(grad_flat.data);
    const size_t es = dtype_size(grad_flat.dtype);
    if (groups_->dp->size() > 1)
      for (const ParamInfo& p : layout_.entries())
        if (!p.is_expert && p.layer < 0)
          groups_->dp->all_reduce_sum(base + static_cast<size_t>(p.offset) * es, static_cast<size_t>(p.numel), grad_flat.dtype);
    for (Request& r : in_flight_) r.wait();
    in_flight_.clear();
    exposed_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return;
  }
  if (zero1_) {
    reduce_scatter(dense_, grad_flat);
    reduce_scatter(experts_, grad_flat);
    return;
  }
  const int64_t dense = layout_.dense_end(), total = layout_.total();
  if (groups_->dp->size() > 1 && dense > 0) comm_.all_reduce_sum(*groups_->dp, grad_flat.slice(0, dense));
  if (groups_->edp->size() > 1 && total > dense) comm_.all_reduce_sum(*groups_->edp, grad_flat.slice(dense, total));
}

void GradSync::grad_sumsq(const Tensor& grad_flat, const Tensor& out) {
  check_shape(out, {layout_.num_global_params()}, "grad_sumsq out");
  ops_.fill(out, 0.0);
  if (!sumsq_segments_.t.empty()) ops_.sumsq_segments(grad_flat, sumsq_segments_.t, out);
  if (groups_ && groups_->world->size() > 1) {
    PhaseScope phase(Phase::kCommunication);
    comm_.all_reduce_sum(*groups_->world, out);
  }
}

double GradSync::grad_norm(const std::vector<double>& sumsq) {
  double total = 0;
  for (double v : sumsq) total += v;
  return std::sqrt(total);
}

void GradSync::reduce_stats(StepStats& stats) {
  if (!groups_) return;
  PhaseScope phase(Phase::kCommunication);
  for (Communicator* c : {groups_->dp.get(), groups_->pp.get()}) {
    if (c->size() == 1) continue;
    comm_.all_reduce_sum(*c, stats.values);
    for (const Tensor& t : stats.counts) comm_.all_reduce_sum(*c, t);
    for (const Tensor& t : stats.mean_prob) comm_.all_reduce_sum(*c, t);
  }
}

void GradSync::sum_over_dp(const Tensor& t) {
  if (!groups_ || groups_->dp->size() == 1) return;
  comm_.all_reduce_sum(*groups_->dp, t);
}

int64_t GradSync::sum_over_dp(int64_t value) {
  if (!groups_ || groups_->dp->size() == 1) return value;
  double v = static_cast<double>(value);  // exact below 2^53
  groups_->dp->all_reduce_sum(&v, 1, DType::kF64);
  return static_cast<int64_t>(v);
}

}  // namespace moe
