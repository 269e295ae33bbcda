#include "plan/plan_command.h"

#include "core/check.h"

namespace moe {

PlanReport run_plan(Config c, const PlanRequest& a) {
  if (!a.layout.empty()) apply_layout_arg(a.layout, c.parallel);
  if (a.interleave > 0) c.parallel.pp_interleave = a.interleave;
  c.validate();  // the layout and interleaving as planned
  check_interleave(c);
  PlanOptions o;
  o.step = a.step;
  o.ranks_per_node = a.ranks_per_node;
  PlanReport r;
  MOE_CHECK(!a.sweep || !a.cluster.empty(), "plan: --sweep needs --cluster");
  if (!a.cluster.empty()) {
    r.cluster = load_cluster(a.cluster);
    c.train.backend = r.cluster->device.backend;  // the backend's own buffers count on its devices
    if (o.ranks_per_node == 0) o.ranks_per_node = r.cluster->ranks_per_node;
    const int64_t world = c.parallel.dp * c.parallel.pp;
    MOE_CHECK(a.sweep || world == r.cluster->ranks(), "--cluster ", a.cluster, " has ", r.cluster->ranks(),
              " ranks but the layout dp=", c.parallel.dp, " x pp=", c.parallel.pp, " has ", world,
              " (give --layout, --sweep, or a cluster of that size: NAMEx", world, ")");
  }
  if (a.sweep) {
    r.sweep = sweep_layouts(c, *r.cluster, r.cluster->ranks(), a.time);
    // The plan shown in full is the best layout that fits (else the first).
    const Layout& best = r.sweep.front().layout;
    c.parallel.dp = best.dp;
    c.parallel.ep = best.ep;
    c.parallel.pp = best.pp;
    c.parallel.stage_layers.clear();
  }
  r.plan = make_plan(c, o);
  if (r.cluster) r.time = estimate_step_time(c, r.plan, *r.cluster, a.time);
  r.config = c;
  return r;
}

std::string PlanReport::json() const {
  return plan_report_json(config, plan, cluster ? &*cluster : nullptr, time ? &*time : nullptr,
                          sweep.empty() ? nullptr : &sweep);
}

std::string PlanReport::text() const {
  std::string out = format_plan(config, plan);
  if (time) out += format_step_time(config, plan, *cluster, *time);
  if (!sweep.empty()) out += format_sweep(*cluster, sweep);
  return out;
}

}  // namespace moe
