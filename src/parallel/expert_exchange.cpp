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

ExpertExchange::ExpertExchange(ExpertTransport& transport, Backend& ops, int64_t num_experts, int64_t capacity)
    : transport_(transport), ops_(ops), num_experts_(num_experts), capacity_(capacity) {
  MOE_CHECK(num_experts % transport.size() == 0, "num_experts=", num_experts, " is not divisible by ep=",
            transport.size());
}

void ExpertExchange::make_plan(const Tensor& local_counts, ExchangePlan& plan) {
  check_shape(local_counts, {num_experts_}, "expert exchange counts");
  MOE_CHECK(plan.all.numel() == ExchangePlan::words(transport_.size(), num_experts_),
            "expert exchange: the plan's views are not bound for ep=", transport_.size());
  transport_.gather_counts(local_counts, plan);
  ops_.ep_plan(plan.counts, transport_.rank(), capacity_, plan.kept, plan.local_begin, plan.recv_begin,
               plan.recv_offsets, plan.totals);
  transport_.plan_ready(plan, capacity_);
}

}  // namespace moe
