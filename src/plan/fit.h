// Fitting what spec sheets do not give: a few named efficiency numbers of a cluster file, chosen
// so that the step-time model reproduces published throughputs (least squares on the relative
// errors, coordinate-wise golden-section search within each number's bounds). The fitted
// numbers are then used, unchanged, to predict other runs.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "plan/hardware.h"
#include "plan/time_model.h"

namespace moe {

struct Observation {
  std::string name;      // "V1 E=8"
  Config config;
  double tokens_per_s_per_device = 0;  // published
};

// A fittable number: "device.attention_efficiency", "network.intra_plateau" (the last point of
// the intra-node efficiency curve), "device.gemm_plateau" (the last point of the GEMM curve).
struct FitParameter {
  std::string key;
  double lo = 0, hi = 1;
};

double& fit_parameter_ref(Cluster& cluster, const std::string& key);
// Tokens/s per device the model predicts for an observation's config on this cluster.
double predict_tokens_per_device(const Config& config, const Cluster& cluster, const TimeOptions& options = {});

struct FitResult {
  Cluster cluster;  // with the fitted numbers
  std::vector<double> values;  // in parameter order
  double rms_relative_error = 0;
};
FitResult fit_cluster(const Cluster& base, const std::vector<FitParameter>& params, const std::vector<Observation>& obs);

}  // namespace moe
