#include "plan/pipeline_sim.h"

#include <algorithm>

#include "core/check.h"
#include "parallel/pipeline_schedule.h"

namespace moe {

namespace {

struct Action {
  bool forward;
  int64_t chunk, micro;
};

// The event loop shared by both schedules: `order[s]` per stage; an action's input is the
// previous virtual stage's forward (forward) or the next one's backward (backward; the last
// virtual stage's backward follows its own forward).
std::vector<TimelineEntry> run(const std::vector<std::vector<Action>>& order, const std::vector<double>& forward_s,
                               const std::vector<double>& backward_s, double transfer_s, int64_t M, int64_t v) {
  const auto P = static_cast<int64_t>(order.size());
  const int64_t V = P * v;  // virtual stages
  // End times by (virtual stage, micro-batch); -1 until done.
  std::vector<double> f_end(static_cast<size_t>(V * M), -1), b_end(static_cast<size_t>(V * M), -1);
  const auto at = [&](int64_t vs, int64_t m) { return static_cast<size_t>(vs * M + m); };
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  std::vector<double> free_at(static_cast<size_t>(P), 0);
  std::vector<TimelineEntry> out;
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < P; ++s) {
      const auto su = static_cast<size_t>(s);
      while (next[su] < order[su].size()) {
        const Action& a = order[su][next[su]];
        const int64_t vs = a.chunk * P + s;
        double ready = 0;
        if (a.forward && vs > 0) {
          const double e = f_end[at(vs - 1, a.micro)];
          if (e < 0) break;
          ready = e + transfer_s;
        } else if (!a.forward) {
          const double e = vs < V - 1 ? b_end[at(vs + 1, a.micro)] : f_end[at(vs, a.micro)];
          if (e < 0) break;
          ready = e + (vs < V - 1 ? transfer_s : 0);
        }
        const double start = std::max(ready, free_at[su]);
        const double end = start + (a.forward ? forward_s[su] : backward_s[su]) / static_cast<double>(v);
        (a.forward ? f_end : b_end)[at(vs, a.micro)] = end;
        free_at[su] = end;
        out.push_back({s, a.micro, a.chunk, a.forward, start, end});
        ++next[su];
        progress = true;
      }
    }
  }
  for (int64_t s = 0; s < P; ++s)
    MOE_CHECK(next[static_cast<size_t>(s)] == order[static_cast<size_t>(s)].size(), "pipeline simulation: stage ", s,
              " stalled");
  return out;
}

}  // namespace

std::vector<TimelineEntry> simulate_1f1b(const std::vector<double>& forward_s, const std::vector<double>& backward_s,
                                         double transfer_s, int64_t M) {
  return simulate_interleaved(forward_s, backward_s, transfer_s, M, 1);
}

std::vector<TimelineEntry> simulate_interleaved(const std::vector<double>& forward_s, const std::vector<double>& backward_s,
                                                double transfer_s, int64_t M, int64_t v) {
  const auto P = static_cast<int64_t>(forward_s.size());
  MOE_CHECK(P >= 1 && backward_s.size() == forward_s.size() && M >= 1 && v >= 1, "pipeline simulation: ", P,
            " stages, ", M, " micro-batches, ", v, " chunks");
  // The trainer's own order (parallel/pipeline_schedule.h), so the simulation is of what runs.
  std::vector<std::vector<Action>> order(static_cast<size_t>(P));
  for (int64_t s = 0; s < P; ++s)
    for (const PipelineAction& a : interleaved_1f1b(P, s, M, v))
      order[static_cast<size_t>(s)].push_back({a.forward, a.chunk, a.micro});
  return run(order, forward_s, backward_s, transfer_s, M, v);
}

}  // namespace moe
