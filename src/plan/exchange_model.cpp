#include "plan/exchange_model.h"

#include <cmath>

#include "kernels/ep_plan_math.h"
#include "moe/exchange_bounds.h"

namespace moe {

int64_t micro_batch_token_base(const Config& c, int64_t step, int64_t dp_rank, int64_t micro) {
  const TrainConfig& t = c.train;
  const int64_t per_rank = t.batch_size / (t.micro_batch_size * c.parallel.dp);
  return (step - 1) * t.batch_size * t.seq_len + (dp_rank * per_rank + micro) * t.micro_batch_size * t.seq_len;
}

std::vector<int32_t> uniform_expert_counts(int64_t base, int64_t tokens, int64_t top_k, int64_t num_experts) {
  // Routes (g, j) of the micro-batch are the consecutive integers [base K, (base + T) K); route
  // x goes to expert x mod E. Each expert gets n / E of the n = T K routes, and the n mod E
  // experts that follow (base K) mod E one more.
  const int64_t n = tokens * top_k, E = num_experts, first = (base * top_k) % E;
  std::vector<int32_t> counts(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    counts[static_cast<size_t>(e)] = static_cast<int32_t>(n / E + (((e - first) % E + E) % E < n % E ? 1 : 0));
  return counts;
}

double expected_drop_fraction_random(const Config& c) {
  const int64_t ep = c.parallel.ep, E = c.model.num_experts, K = c.model.top_k;
  const int64_t T = c.train.micro_batch_size * c.train.seq_len;
  const int64_t capacity = expert_capacity(T, K, c.parallel.ep_capacity_factor);
  if (ep <= 1 || capacity < 0) return 0;
  // Rows one rank receives: over the group's ep T tokens, each a hypergeometric draw of its K
  // experts among E, El of them this rank's.
  const double El = static_cast<double>(E / ep), Ed = static_cast<double>(E), Kd = static_cast<double>(K);
  const double p = El / Ed, n = static_cast<double>(ep * T);
  const double mean = n * Kd * p;
  const double var = n * Kd * p * (1 - p) * (Ed > 1 ? (Ed - Kd) / (Ed - 1) : 0);
  if (var <= 0) return mean > static_cast<double>(capacity) ? (mean - static_cast<double>(capacity)) / mean : 0;
  const double sd = std::sqrt(var), z = (static_cast<double>(capacity) - mean) / sd;
  const double pdf = std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI), upper = 0.5 * std::erfc(z / std::sqrt(2.0));
  const double excess = sd * pdf - (static_cast<double>(capacity) - mean) * upper;  // E[(X - cap)+]
  return excess / mean;
}

std::vector<ExchangeRows> exchange_rows(const Config& c, int64_t step, int64_t group_dp_begin, int64_t micro) {
  const int64_t ep = c.parallel.ep, E = c.model.num_experts, K = c.model.top_k, El = E / ep;
  const int64_t T = c.train.micro_batch_size * c.train.seq_len;
  std::vector<ExchangeRows> out(static_cast<size_t>(ep));
  if (c.model.routing != "uniform") {
    const double drop = expected_drop_fraction_random(c), routes = static_cast<double>(T * K);
    const double off = routes * static_cast<double>(ep - 1) / static_cast<double>(ep) * (1 - drop);
    for (ExchangeRows& r : out) {
      r.dispatched = r.returned = off;
      r.received = routes * (1 - drop);
      r.routed = routes * static_cast<double>(ep);
      r.dropped = r.routed * drop;
      r.send_blocks = r.return_blocks = (ep - 1) * El;
    }
    return out;
  }
  // The (ep, E) count matrix the exchange gathers, then the trainer's own plan arithmetic.
  std::vector<int32_t> counts(static_cast<size_t>(ep * E)), kept(counts.size()), lb(static_cast<size_t>(E)),
      rb(static_cast<size_t>(El * ep)), off(static_cast<size_t>(El + 1)), tot(static_cast<size_t>(4 + ep));
  for (int64_t s = 0; s < ep; ++s) {
    const std::vector<int32_t> row =
        uniform_expert_counts(micro_batch_token_base(c, step, group_dp_begin + s, micro), T, K, E);
    std::copy(row.begin(), row.end(), counts.begin() + s * E);
  }
  const int64_t capacity = expert_capacity(T, K, c.parallel.ep_capacity_factor);
  ep_plan_arrays(counts.data(), ep, E, 0, capacity, kept.data(), lb.data(), rb.data(), off.data(), tot.data());
  for (int64_t me = 0; me < ep; ++me) {
    ExchangeRows& r = out[static_cast<size_t>(me)];
    for (int64_t g = 0; g < E; ++g) {
      if (g / El == me) continue;
      const int32_t mine = kept[static_cast<size_t>(me * E + g)];  // my tokens, peer's expert g
      r.dispatched += mine;
      r.send_blocks += mine > 0;
      // Peer s = g / El's tokens for my local expert at g's position among the peer's.
      const int32_t theirs = kept[static_cast<size_t>((g / El) * E + me * El + g % El)];
      r.returned += theirs;
      r.return_blocks += theirs > 0;
    }
    // totals (ep_plan): received, off-rank, routed, dropped, then kept rows per receiving rank.
    r.received = tot[static_cast<size_t>(4 + me)];
    r.routed = tot[2];
    r.dropped = tot[3];
  }
  return out;
}

}  // namespace moe
