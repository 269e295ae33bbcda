// Every layout a world size allows, planned and timed, best first.
#include <algorithm>
#include <cstdio>

#include "core/check.h"
#include "plan/time_model.h"

namespace moe {

std::vector<SweepRow> sweep_layouts(const Config& config, const Cluster& cluster, int64_t world,
                                    const TimeOptions& options) {
  MOE_CHECK(world >= 1, "sweep: ", world, " ranks");
  const ModelConfig& c = config.model;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double usable = cluster.device.memory_bytes - cluster.device.reserved_bytes - cluster.device.process_bytes;
  std::vector<SweepRow> rows;
  for (int64_t pp = 1; pp <= std::min(world, c.n_layers); ++pp) {
    if (world % pp != 0) continue;
    const int64_t dp = world / pp;
    for (int64_t ep = 1; ep <= dp; ++ep) {
      if (dp % ep != 0 || c.num_experts % ep != 0 || (ep > 1 && c.num_moe_layers() == 0)) continue;
      SweepRow row;
      row.layout = Layout{dp, ep, pp};
      Config x = config;
      x.parallel.dp = dp;
      x.parallel.ep = ep;
      x.parallel.pp = pp;
      x.parallel.stage_layers.clear();  // balanced stages for every pp
      if (pp == 1) x.parallel.pp_interleave = 1;  // one stage has nothing to interleave
      try {
        PlanOptions o;
        o.ranks_per_node = cluster.ranks_per_node;
        const Plan plan = make_plan(x, o);
        size_t worst = 0;
        for (size_t s = 0; s < plan.stages.size(); ++s)
          if (plan.stages[s].memory.total() > plan.stages[worst].memory.total()) worst = s;
        const MemoryEstimate& m = plan.stages[worst].memory;
        row.peak_bytes = m.total();
        row.time = estimate_step_time(x, plan, cluster, options);
        row.fits = m.total() <= usable;
        if (!row.fits) {
          // Name the largest component as what binds.
          const std::pair<const char*, double> parts[] = {
              {"activations", m.activations}, {"master weights", m.params}, {"gradients", m.grads},
              {"AdamW moments", m.optimizer}, {"bf16 copies", m.operand_copies}};
          const auto* big = std::max_element(std::begin(parts), std::end(parts),
                                             [](const auto& l, const auto& r) { return l.second < r.second; });
          char buf[256];
          std::snprintf(buf, sizeof buf, "stage %zu needs %.2f GiB, %.2f GiB over the %.2f GiB a rank may use (largest: %s %.2f GiB)",
                        worst, m.total() / gib, (m.total() - usable) / gib, usable / gib, big->first, big->second / gib);
          row.reason = buf;
        }
      } catch (const Error& e) {
        row.reason = e.what();
      }
      rows.push_back(std::move(row));
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const SweepRow& a, const SweepRow& b) {
    if (a.fits != b.fits) return a.fits;
    return a.time.tokens_per_s > b.time.tokens_per_s;
  });
  return rows;
}

}  // namespace moe
