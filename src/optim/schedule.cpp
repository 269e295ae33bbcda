#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace moe {

double learning_rate(const OptimConfig& o, int64_t total_steps, int64_t n) {
  const double peak = o.lr, lo = o.min_lr;
  if (o.warmup_steps > 0 && n <= o.warmup_steps)
    return peak * static_cast<double>(n) / static_cast<double>(o.warmup_steps);
  if (o.schedule == "constant") return peak;
  if (o.schedule == "wsd") {
    const int64_t decay_start = total_steps - o.decay_steps;
    if (n <= decay_start) return peak;
    const double p = static_cast<double>(n - decay_start) / static_cast<double>(o.decay_steps);
    return peak - (peak - lo) * std::min(p, 1.0);
  }
  const int64_t span = std::max<int64_t>(total_steps - o.warmup_steps, 1);
  const double p = std::min(1.0, static_cast<double>(n - o.warmup_steps) / static_cast<double>(span));
  if (o.schedule == "linear") return peak - (peak - lo) * p;
  return lo + (peak - lo) * 0.5 * (1.0 + std::cos(M_PI * p));  // cosine
}

}  // namespace moe
