#include "parallel/grad_sync.h"

#include <cmath>

#include "core/phase_timer.h"
#include "model/transformer.h"

namespace moe {

GradSync::GradSync(const ParamLayout& layout, ProcessGroups* groups)
    : layout_(layout), groups_(groups), partial_(DType::kF64, {layout.num_global_params()}) {}

int64_t GradSync::dp_size() const { return groups_ ? groups_->layout.dp : 1; }
int64_t GradSync::dp_rank() const { return groups_ ? groups_->coords.dp : 0; }

void GradSync::reduce_gradients(const Tensor& grad_flat) {
  if (!groups_) return;
  PhaseScope phase(Phase::kCommunication);
  char* base = static_cast<char*>(grad_flat.data);
  const size_t esize = dtype_size(grad_flat.dtype);
  const auto dense = static_cast<size_t>(layout_.dense_end());
  const auto experts = static_cast<size_t>(layout_.total() - layout_.dense_end());
  if (groups_->dp->size() > 1 && dense > 0) groups_->dp->all_reduce_sum(base, dense, grad_flat.dtype);
  if (groups_->edp->size() > 1 && experts > 0)
    groups_->edp->all_reduce_sum(base + dense * esize, experts, grad_flat.dtype);
}

double GradSync::global_grad_norm(Backend& ops, const Tensor& grad_flat) {
  ops.fill(partial_.t, 0.0);
  const bool count_dense = !groups_ || groups_->coords.dp == 0;
  const bool count_experts = !groups_ || groups_->coords.edp == 0;
  for (const ParamInfo& p : layout_.entries()) {
    if (!(p.is_expert ? count_experts : count_dense)) continue;
    ops.sumsq_to(grad_flat.slice(p.offset, p.offset + p.numel),
                 partial_.t.slice(p.global_index, p.global_index + 1));
  }
  if (groups_ && groups_->world->size() > 1) {
    PhaseScope phase(Phase::kCommunication);
    groups_->world->all_reduce_sum(partial_.t.data, static_cast<size_t>(partial_.t.numel()), DType::kF64);
  }
  // The partial sums live in host memory on the cpu and ref backends.
  double total = 0;
  const double* v = partial_.as<double>();
  for (int64_t i = 0; i < partial_.t.numel(); ++i) total += v[i];
  return std::sqrt(total);
}

void GradSync::reduce_stats(StepStats& stats) {
  if (!groups_) return;
  PhaseScope phase(Phase::kCommunication);
  for (Communicator* c : {groups_->dp.get(), groups_->pp.get()}) {
    if (c->size() == 1) continue;
    c->all_reduce_sum(stats.values.t.data, static_cast<size_t>(stats.values.t.numel()), DType::kF64);
    for (auto& t : stats.counts) c->all_reduce_sum(t.t.data, static_cast<size_t>(t.t.numel()), DType::kI32);
    for (auto& t : stats.mean_prob) c->all_reduce_sum(t.t.data, static_cast<size_t>(t.t.numel()), t.t.dtype);
  }
}

int64_t GradSync::sum_over_dp(int64_t value) {
  if (!groups_ || groups_->dp->size() == 1) return value;
  double v = static_cast<double>(value);  // exact below 2^53
  groups_->dp->all_reduce_sum(&v, 1, DType::kF64);
  return static_cast<int64_t>(v);
}

}  // namespace moe
