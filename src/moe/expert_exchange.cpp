#include "moe/expert_exchange.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/phase_timer.h"

namespace moe {

int64_t expert_capacity(int64_t tokens, int64_t top_k, double capacity_factor) {
  if (capacity_factor <= 0) return -1;
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(top_k * tokens)));
}

int64_t expert_rows_bound(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t ep, double capacity_factor) {
  const int64_t local_experts = num_experts / ep;
  int64_t rows = ep * tokens * std::min(top_k, local_experts);
  const int64_t capacity = expert_capacity(tokens, top_k, capacity_factor);
  if (capacity >= 0) rows = std::min(rows, capacity);
  return rows;
}

ExpertExchange::ExpertExchange(Communicator& ep, Backend& ops, int64_t num_experts, int64_t capacity)
    : comm_(ep), ops_(ops), num_experts_(num_experts), capacity_(capacity) {
  MOE_CHECK(num_experts % ep.size() == 0, "num_experts=", num_experts, " is not divisible by ep=", ep.size());
  gathered_.resize(static_cast<size_t>(ep.size() * num_experts));
  requests_.reserve(static_cast<size_t>(2 * num_experts));
}

void ExpertExchange::make_plan(const Tensor& local_counts, ExchangePlan& p, const Tensor& recv_offsets) {
  const int64_t ep = comm_.size(), E = num_experts_, El = E / ep, me = comm_.rank();
  check_shape(local_counts, {E}, "expert exchange counts");
  check_shape(recv_offsets, {El + 1}, "expert exchange recv_offsets");
  {
    PhaseScope phase(Phase::kCommunication);
    const auto t0 = std::chrono::steady_clock::now();
    comm_.all_gather(local_counts.as<int32_t>(), gathered_.data(), static_cast<size_t>(E), DType::kI32);
    blocked_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  p.ep = ep;
  p.rank = me;
  p.num_experts = E;
  p.local_experts = El;
  p.counts.assign(gathered_.begin(), gathered_.end());
  p.kept.assign(p.counts.size(), 0);
  p.received_per_rank.assign(static_cast<size_t>(ep), 0);
  p.rows_routed = p.rows_dropped = 0;
  // Capacity per receiving rank r, in its receive order: local expert major, then source rank.
  for (int64_t r = 0; r < ep; ++r) {
    int64_t taken = 0;
    for (int64_t e = r * El; e < (r + 1) * El; ++e)
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t c = p.count(s, e);
        const int64_t keep = capacity_ < 0 ? c : std::clamp<int64_t>(capacity_ - taken, 0, c);
        p.kept[static_cast<size_t>(s * E + e)] = keep;
        taken += keep;
        p.rows_routed += c;
        p.rows_dropped += c - keep;
      }
    p.received_per_rank[static_cast<size_t>(r)] = taken;
  }
  p.local_begin.assign(static_cast<size_t>(E), 0);
  for (int64_t e = 1; e < E; ++e) p.local_begin[static_cast<size_t>(e)] = p.local_begin[static_cast<size_t>(e - 1)] + p.count(me, e - 1);
  p.recv_begin.assign(static_cast<size_t>(El * ep), 0);
  int32_t* off = recv_offsets.as<int32_t>();
  int64_t row = 0;
  off[0] = 0;
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t s = 0; s < ep; ++s) {
      p.recv_begin[static_cast<size_t>(e * ep + s)] = row;
      row += p.kept_rows(s, me * El + e);
    }
    off[e + 1] = static_cast<int32_t>(row);
  }
  p.rows_received = row;
  p.rows_sent_off_rank = 0;
  for (int64_t e = 0; e < E; ++e)
    if (e / El != me) p.rows_sent_off_rank += p.kept_rows(me, e);
}

void ExpertExchange::send_to_experts(const ExchangePlan& plan, const Tensor& local, const Tensor& received) {
  move(plan, local, received, true);
}

void ExpertExchange::return_to_sources(const ExchangePlan& plan, const Tensor& received, const Tensor& local) {
  move(plan, local, received, false);
}

void ExpertExchange::move(const ExchangePlan& p, const Tensor& local, const Tensor& received, bool to_experts) {
  const int64_t ep = p.ep, El = p.local_experts, me = p.rank, D = local.cols();
  MOE_CHECK(local.dtype == received.dtype && received.cols() == D, "expert exchange: local ", local.shape_str(), " ",
            dtype_name(local.dtype), " and received ", received.shape_str(), " ", dtype_name(received.dtype),
            " do not match");
  MOE_CHECK(received.rows() >= p.rows_received, "expert exchange: received buffer has ", received.rows(),
            " rows, the plan needs ", p.rows_received);
  const size_t elem = dtype_size(local.dtype);
  auto rows_ptr = [&](const Tensor& t, int64_t row) { return static_cast<char*>(t.data) + static_cast<size_t>(row * D) * elem; };
  const auto n = [&](int64_t rows) { return static_cast<size_t>(rows * D); };
  requests_.clear();
  // Receives first, then sends, in the same (peer, local expert) order on both ends. The tag
  // names the local expert and the direction (e toward the experts, El + e back), so a
  // mismatched pair cannot match silently (and tests can tell the directions apart).
  const auto tag = [&](int64_t e) { return static_cast<int>(to_experts ? e : El + e); };
  for (int64_t peer = 0; peer < ep; ++peer) {
    if (peer == me) continue;
    for (int64_t e = 0; e < El; ++e) {
      if (to_experts) {  // block (local expert e, source peer) of my received rows
        const int64_t rows = p.kept_rows(peer, me * El + e);
        if (rows > 0)
          requests_.push_back(comm_.irecv(rows_ptr(received, p.recv_begin[static_cast<size_t>(e * ep + peer)]), n(rows),
                                          local.dtype, static_cast<int>(peer), tag(e)));
      } else {  // my rows that peer's local expert e computed
        const int64_t g = peer * El + e, rows = p.kept_rows(me, g);
        if (rows > 0)
          requests_.push_back(comm_.irecv(rows_ptr(local, p.local_begin[static_cast<size_t>(g)]), n(rows), local.dtype,
                                          static_cast<int>(peer), tag(e)));
      }
    }
  }
  for (int64_t peer = 0; peer < ep; ++peer) {
    if (peer == me) continue;
    for (int64_t e = 0; e < El; ++e) {
      if (to_experts) {
        const int64_t g = peer * El + e, rows = p.kept_rows(me, g);
        if (rows > 0)
          requests_.push_back(comm_.isend(rows_ptr(local, p.local_begin[static_cast<size_t>(g)]), n(rows), local.dtype,
                                          static_cast<int>(peer), tag(e)));
      } else {
        const int64_t rows = p.kept_rows(peer, me * El + e);
        if (rows > 0)
          requests_.push_back(comm_.isend(rows_ptr(received, p.recv_begin[static_cast<size_t>(e * ep + peer)]), n(rows),
                                          local.dtype, static_cast<int>(peer), tag(e)));
      }
    }
  }
  // Rows to self: a copy while the messages are in flight.
  for (int64_t e = 0; e < El; ++e) {
    const int64_t g = me * El + e, rows = p.kept_rows(me, g);
    if (rows == 0) continue;
    const int64_t l0 = p.local_begin[static_cast<size_t>(g)], r0 = p.recv_begin[static_cast<size_t>(e * ep + me)];
    if (to_experts) ops_.convert(local.slice(l0, l0 + rows), received.slice(r0, r0 + rows));
    else ops_.convert(received.slice(r0, r0 + rows), local.slice(l0, l0 + rows));
  }
  // Dropped rows of my tokens: zero output / zero gradient.
  if (!to_experts)
    for (int64_t g = 0; g < p.num_experts; ++g) {
      const int64_t keep = p.kept_rows(me, g), all = p.count(me, g), l0 = p.local_begin[static_cast<size_t>(g)];
      if (all > keep) ops_.fill(local.slice(l0 + keep, l0 + all), 0.0);
    }
  PhaseScope phase(Phase::kCommunication);
  const auto t0 = std::chrono::steady_clock::now();
  wait_all(requests_);
  blocked_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace moe
