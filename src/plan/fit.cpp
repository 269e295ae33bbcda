#include "plan/fit.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "plan/plan.h"
#include "plan/time_model.h"

namespace moe {

double& fit_parameter_ref(Cluster& c, const std::string& key) {
  if (key == "device.attention_efficiency") return c.device.attention_efficiency;
  if (key == "device.memory_efficiency") return c.device.memory_efficiency;
  if (key == "device.gemm_plateau") return c.device.gemm_efficiency.points.back().second;
  if (key == "network.intra_plateau") return c.intra.efficiency.points.back().second;
  if (key == "network.inter_plateau") return c.inter.efficiency.points.back().second;
  MOE_FAIL("fit: unknown parameter '", key, "' (device.attention_efficiency, device.memory_efficiency, "
           "device.gemm_plateau, network.intra_plateau, network.inter_plateau)");
}

double predict_tokens_per_device(const Config& config, const Cluster& cluster, const TimeOptions& options) {
  Config c = config;
  c.train.backend = cluster.device.backend;
  PlanOptions o;
  o.ranks_per_node = cluster.ranks_per_node;
  const Plan plan = make_plan(c, o);
  return estimate_step_time(c, plan, cluster, options).tokens_per_s_per_device;
}

FitResult fit_cluster(const Cluster& base, const std::vector<FitParameter>& params, const std::vector<Observation>& obs) {
  MOE_CHECK(!params.empty() && obs.size() >= params.size(), "fit: ", params.size(), " parameters need at least as many observations (",
            obs.size(), ")");
  FitResult r;
  r.cluster = base;
  const auto loss = [&](const Cluster& c) {
    double sum = 0;
    for (const Observation& o : obs) {
      const double e = predict_tokens_per_device(o.config, c) / o.tokens_per_s_per_device - 1;
      sum += e * e;
    }
    return sum;
  };
  // Coordinate-wise golden-section search from the middle of every range (so the result does not
  // depend on the values the base file had), until a sweep moves no number by more than 1e-7.
  const double g = (std::sqrt(5.0) - 1) / 2;
  for (const FitParameter& p : params) fit_parameter_ref(r.cluster, p.key) = (p.lo + p.hi) / 2;
  for (int sweep = 0; sweep < 50; ++sweep) {
    double moved = 0;
    for (const FitParameter& p : params) {
      double a = p.lo, b = p.hi;
      Cluster c = r.cluster;
      double& v = fit_parameter_ref(c, p.key);
      for (int it = 0; it < 40; ++it) {
        const double x1 = b - g * (b - a), x2 = a + g * (b - a);
        v = x1;
        const double f1 = loss(c);
        v = x2;
        const double f2 = loss(c);
        if (f1 < f2) b = x2;
        else a = x1;
      }
      moved = std::max(moved, std::abs(v - fit_parameter_ref(r.cluster, p.key)));
      v = (a + b) / 2;
      moved = std::max(moved, std::abs(v - fit_parameter_ref(r.cluster, p.key)));
      r.cluster = c;
    }
    if (moved < 1e-7) break;
  }
  for (const FitParameter& p : params) r.values.push_back(fit_parameter_ref(r.cluster, p.key));
  r.rms_relative_error = std::sqrt(loss(r.cluster) / static_cast<double>(obs.size()));
  return r;
}

}  // namespace moe
