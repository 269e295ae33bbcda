// `moecore plan`'s whole command, shared by the command line and the guide page (web/): the
// same request gives the same JSON in both.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "plan/hardware.h"
#include "plan/plan.h"
#include "plan/time_model.h"

namespace moe {

struct PlanRequest {
  std::string layout;          // "dp=..,ep=..,pp=.." over [parallel], or ""
  std::string cluster;         // preset or file, or "" (no step time)
  int64_t ranks_per_node = 0;  // 0: the cluster's (or one node)
  int64_t step = 1;
  bool sweep = false;          // every layout of the cluster's ranks; the plan shown is the best
  int64_t interleave = 0;      // > 0: parallel.pp_interleave
  TimeOptions time;            // overlap and the power cap (not in the trainer); none by default
};

struct PlanReport {
  Config config;  // as planned (layout applied; the cluster's backend)
  Plan plan;
  std::optional<Cluster> cluster;
  std::optional<StepTime> time;
  std::vector<SweepRow> sweep;
  std::string json() const;
  std::string text() const;
};

PlanReport run_plan(Config config, const PlanRequest& request);

}  // namespace moe
