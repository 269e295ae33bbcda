#include "parallel/expert_exchange.h"

#include <algorithm>
#include <cmath>

namespace moe {

int64_t ExchangePlan::words(int64_t ep, int64_t num_experts) { return exchange_plan_words(ep, num_experts); }

ExchangePlan ExchangePlan::over(const Tensor& buffer, int64_t ep, int64_t E) {
  MOE_CHECK(buffer.dtype == DType::kI32 && buffer.numel() >= words(ep, E), "exchange plan buffer ",
            buffer.shape_str(), " ", dtype_name(buffer.dtype), " is smaller than ", words(ep, E), " i32");
  const int64_t El = E / ep;
  ExchangePlan p;
  p.all = buffer.slice(0, words(ep, E));
  int64_t at = 0;
  const auto next = [&](int64_t n) {
    Tensor t = p.all.slice(at, at + n);
    at += n;
    return t;
  };
  p.counts = next(ep * E).view({ep, E});
  p.kept = next(ep * E).view({ep, E});
  p.local_begin = next(E);
  p.recv_begin = next(El * ep).view({El, ep});
  p.recv_offsets = next(El + 1);
  p.totals = next(4 + ep);
  return p;
}

int64_t ExchangePlan::host_total(int which) const {
  MOE_CHECK(!host.empty() && which >= 0 && which < totals.numel(), "exchange plan: total ", which,
            " asked of a plan without a host copy");
  return host[host.size() - static_cast<size_t>(totals.numel()) + static_cast<size_t>(which)];
}

ExpertExchange::ExpertExchange(std::unique_ptr<ExpertTransport> transport, Backend& ops, int64_t num_experts,
                               int64_t capacity, int64_t slots, int64_t moe_layers)
    : transport_(std::move(transport)), ops_(ops), num_experts_(num_experts), capacity_(capacity) {
  const int64_t ep = transport_->size();
  MOE_CHECK(num_experts % ep == 0, "num_experts=", num_experts, " is not divisible by ep=", ep);
  const int64_t words = ExchangePlan::words(ep, num_experts);
  plan_mem_ = Buffer(ops, static_cast<size_t>(slots * moe_layers * words) * sizeof(int32_t));
  const Tensor all = plan_mem_.view(DType::kI32, {slots * moe_layers * words});
  plans_.resize(static_cast<size_t>(slots));
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t m = 0; m < moe_layers; ++m) {
      const int64_t at = (s * moe_layers + m) * words;
      plans_[static_cast<size_t>(s)].push_back(ExchangePlan::over(all.slice(at, at + words), ep, num_experts));
    }
  counts_ = OwnedTensor(ops, DType::kI32, {moe_layers, 4 + ep});
  reset_counts();
}

void ExpertExchange::reset_counts() { ops_.fill(counts_.t, 0.0); }

const ExchangePlan& ExpertExchange::route(int64_t slot, int64_t moe_layer) const {
  MOE_CHECK(slot >= 0 && slot < static_cast<int64_t>(plans_.size()) && moe_layer >= 0 &&
                moe_layer < counts_.t.dim(0),
            "expert exchange: no route for activation slot ", slot, ", MoE layer ", moe_layer);
  return plans_[static_cast<size_t>(slot)][static_cast<size_t>(moe_layer)];
}

void ExpertExchange::plan(int64_t slot, int64_t moe_layer, const Tensor& local_counts) {
  route(slot, moe_layer);  // checks the indices
  ExchangePlan& p = plans_[static_cast<size_t>(slot)][static_cast<size_t>(moe_layer)];
  make_plan(local_counts, p);
  ops_.add_counts(p.totals, counts_.t.slice(moe_layer, moe_layer + 1).view({4 + transport_->size()}));
}

void ExpertExchange::make_plan(const Tensor& local_counts, ExchangePlan& plan) {
  check_shape(local_counts, {num_experts_}, "expert exchange counts");
  MOE_CHECK(plan.all.numel() == ExchangePlan::words(transport_->size(), num_experts_),
            "expert exchange: the plan's views are not bound for ep=", transport_->size());
  transport_->gather_counts(local_counts, plan);
  ops_.ep_plan(plan.counts, transport_->rank(), capacity_, plan.kept, plan.local_begin, plan.recv_begin,
               plan.recv_offsets, plan.totals);
  transport_->plan_ready(plan, capacity_);
}

void reduce_exchange_stats(const int32_t* counters, int64_t layers, int64_t ep, Communicator* edp,
                           std::vector<double>& v, std::vector<double>& drop_fraction,
                           std::vector<std::vector<int64_t>>& rows_received) {
  const size_t L = static_cast<size_t>(layers), n = static_cast<size_t>(ep);
  v.clear();
  for (size_t m = 0; m < L; ++m) {
    const int32_t* c = counters + m * (4 + n);
    v.push_back(static_cast<double>(c[kRowsRouted]));
    v.push_back(static_cast<double>(c[kRowsDropped]));
    for (size_t i = 0; i < n; ++i) v.push_back(static_cast<double>(c[kReceivedPerRank + i]));
  }
  if (edp && edp->size() > 1) edp->all_reduce_sum(v.data(), v.size(), DType::kF64);
  rows_received.resize(L);
  for (size_t m = 0; m < L; ++m) {
    const double* x = v.data() + m * (2 + n);
    drop_fraction.push_back(x[0] > 0 ? x[1] / x[0] : 0.0);
    rows_received[m].resize(n);
    for (size_t i = 0; i < n; ++i) rows_received[m][i] = static_cast<int64_t>(x[2 + i]);
  }
}

}  // namespace moe
