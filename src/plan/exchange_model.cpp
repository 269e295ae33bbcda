#include "plan/exchange_model.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "kernels/math/ep_plan_math.h"
#include "model/exchange_bounds.h"

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

double expected_drop_fraction_random(const Config& c) { return expected_drop_fraction_skewed(c, 0); }

double expected_drop_fraction_skewed(const Config& c, double skew) {
  const int64_t ep = c.parallel.ep, E = c.model.num_experts, K = c.model.top_k, El = E / ep;
  const int64_t T = c.train.micro_batch_size * c.train.seq_len;
  const int64_t capacity = expert_capacity(T, K, c.parallel.ep_capacity_factor);
  MOE_CHECK(skew >= 0 && std::isfinite(skew), "skewed routing: exponent ", skew, " must be >= 0");
  if (ep <= 1 || capacity < 0) return 0;
  // Inclusion probabilities pi_e = 1 - exp(-lambda w_e), sum K (bisection on lambda); uniform
  // weights give K / E exactly.
  std::vector<double> w(static_cast<size_t>(E)), pi(w.size());
  for (int64_t e = 0; e < E; ++e) w[static_cast<size_t>(e)] = std::pow(static_cast<double>(e + 1), -skew);
  const auto inclusion = [&](double lambda) {
    double sum = 0;
    for (size_t e = 0; e < w.size(); ++e) sum += pi[e] = 1 - std::exp(-lambda * w[e]);
    return sum;
  };
  if (skew == 0) {
    std::fill(pi.begin(), pi.end(), static_cast<double>(K) / static_cast<double>(E));
  } else {
    double lo = 0, hi = 1;
    while (inclusion(hi) < static_cast<double>(K)) hi *= 2;
    for (int it = 0; it < 200; ++it) {
      const double mid = (lo + hi) / 2;
      (inclusion(mid) < static_cast<double>(K) ? lo : hi) = mid;
    }
    inclusion((lo + hi) / 2);
  }
  // Per rank: over the group's ep T tokens, mean and variance of the rows it receives. The
  // variance scale (E - El) / (E - 1) turns the sum of independent inclusions into the
  // hypergeometric variance at skew 0.
  const double n = static_cast<double>(ep * T), Ed = static_cast<double>(E), cap = static_cast<double>(capacity);
  const double scale = E > 1 ? (Ed - static_cast<double>(El)) / (Ed - 1) : 0;
  double dropped = 0;
  for (int64_t r = 0; r < ep; ++r) {
    double m = 0, v = 0;
    for (int64_t e = r * El; e < (r + 1) * El; ++e) {
      m += pi[static_cast<size_t>(e)];
      v += pi[static_cast<size_t>(e)] * (1 - pi[static_cast<size_t>(e)]);
    }
    const double mean = n * m, var = n * v * scale;
    if (var <= 0) {
      dropped += std::max(0.0, mean - cap);
      continue;
    }
    const double sd = std::sqrt(var), z = (cap - mean) / sd;
    const double pdf = std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI), upper = 0.5 * std::erfc(z / std::sqrt(2.0));
    dropped += sd * pdf - (cap - mean) * upper;  // E[(X - cap)+]
  }
  return dropped / (n * static_cast<double>(K));
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
