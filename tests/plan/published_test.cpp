// The planner against published runs (../shared/reference/planner.md; configs/published/):
// parameter counts, memory, and throughput after fitting two efficiency numbers on V1 (8
// experts) and V3 only. Every row's tolerance was written here before the row was first run;
// a row outside it is a miss, recorded as such (documented_hit = false) with its reason in
// docs/PLAN.md, and the test fails if a row's outcome changes either way, so the table and the
// model cannot drift apart. MOE_VERBOSE=1 prints the table.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/paths.h"
#include "config/config.h"
#include "plan/fit.h"
#include "plan/hardware.h"
#include "plan/plan.h"
#include "plan/time_model.h"

namespace moe {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Config published(const std::string& file, std::vector<std::string> overrides = {}) {
  return load_config(std::string(::moe::test::source_dir()) + "/configs/published/" + file, overrides);
}

struct Row {
  std::string id, what;
  double predicted = 0, published = 0;
  double tolerance = 0;      // relative, or absolute when absolute = true
  bool absolute = false;
  bool documented_hit = true;
  bool at_most = false;      // a hit is anything up to published * (1 + tolerance): memory we may beat
  bool hit() const {
    if (at_most) return predicted <= published * (1 + tolerance);
    const double err = absolute ? std::abs(predicted - published) : std::abs(predicted / published - 1);
    return err <= tolerance;
  }
};

void check(const std::vector<Row>& rows) {
  for (const Row& r : rows) {
    if (std::getenv("MOE_VERBOSE"))
      std::printf("| %s | %s | %.6g | %.6g | %+.1f%% | %s%.3g%s | %s |\n", r.id.c_str(), r.what.c_str(), r.predicted,
                  r.published, 100 * (r.predicted / r.published - 1), r.absolute ? "+-" : r.at_most ? "<= +" : "",
                  r.absolute ? r.tolerance : 100 * r.tolerance, r.absolute ? "" : "%", r.hit() ? "hit" : "MISS");
    EXPECT_EQ(r.hit(), r.documented_hit) << r.id << " " << r.what << ": predicted " << r.predicted << ", published "
                                         << r.published << " (update docs/PLAN.md if the model changed)";
  }
}

// Parameter counts: tolerance = the published figure's rounding.
TEST(PublishedRuns, ParameterCounts) {
  const auto params = [](const Config& c) { return static_cast<double>(c.model.num_params()); };
  const auto active = [](const Config& c) {  // matmul parameters a token touches + its embedding row's table
    return static_cast<double>(c.model.num_active_matmul_params() + c.model.vocab_size * c.model.d_model);
  };
  const Config e8 = published("olmo3_v1_e32.toml", {"model.num_experts=8"});
  const Config e128 = published("olmo3_v1_e32.toml", {"model.num_experts=128"});
  const Config v4 = published("olmo3_v1_e32.toml"), v7 = published("olmo3_v7_1t.toml");
  const Config qwen = published("qwen3_30b_a3b.toml");
  check({
      {"V1", "total parameters, 8 experts (B)", params(e8) / 1e9, 4.6, 0.05, true},
      {"V1", "total parameters, 128 experts (B)", params(e128) / 1e9, 47, 0.5, true},
      {"V4", "total parameters (B)", params(v4) / 1e9, 13.037, 0.0005, true},
      {"V4", "active parameters (B)", active(v4) / 1e9, 3.172, 0.0005, true},
      {"V7", "total parameters (T)", params(v7) / 1e12, 1.200, 0.0005, true},
      {"V7", "active parameters (B)", active(v7) / 1e9, 58.36, 0.005, true},
      {"V13", "Qwen3-30B-A3B total (B)", params(qwen) / 1e9, 30.5, 0.05, true},
      // Miss: Qwen's "3.3B activated" counts neither the whole embedding table (ours: 3.35B) nor
      // nothing of it (3.04B); its convention is not published.
      {"V13", "Qwen3-30B-A3B active (B)", active(qwen) / 1e9, 3.3, 0.05, true, false},
  });
}

// Memory of V3, V4, V5 (B300: 288 GB). "Persistent": weights, gradients and optimizer state
// with master weights and moments sharded over the replicas as Olmo-core does (the planner's
// variant that is not in the trainer). Peaks as Olmo-core runs attention: its non-deterministic
// backward (train.deterministic_attention = false; the deterministic one adds cuDNN's 8 GiB dP
// workspace at S = 8192). Tolerances: 1% for persistent memory (a formula of the parameter
// layout); peaks and activations at most 5% above the published figure (issue #30's target:
// what each implementation saves for backward may be less).
TEST(PublishedRuns, Memory) {
  const Cluster b300 = load_cluster("b300x4");
  const auto plan_of = [&](Config c) {
    c.train.backend = "cuda";
    c.train.deterministic_attention = false;
    PlanOptions o;
    o.ranks_per_node = 8;
    return make_plan(c, o);
  };
  const auto persistent = [](const PlannedStage& st) {
    const MemoryEstimate& m = st.memory;
    return st.total_sharded_master - m.activations - m.kernel_scratch - m.backend_buffers - m.comm_buffers - m.step_stats;
  };
  const Plan v4 = plan_of(published("olmo3_v1_e32.toml"));
  const Plan v5 = plan_of(published("olmo3_v1_e32.toml", {"train.recompute=true"}));
  const Plan v3_ep = plan_of(published("olmo3_v1_e32.toml", {"parallel.dp=8", "parallel.ep=8", "train.batch_size=128"}));
  const Plan v3_dp = plan_of(published("olmo3_v1_e32.toml", {"parallel.dp=8", "parallel.ep=1", "train.batch_size=128"}));
  (void)b300;
  const PlannedStage &s4 = v4.stages[0], &s5 = v5.stages[0];
  check({
      {"V5", "persistent memory (GiB)", persistent(s4) / kGiB, 62.2, 0.01, false, true},
      {"V4", "peak memory, bf16 (GiB)", s4.total_sharded_master / kGiB, 103.4, 0.05, false, true, true},
      {"V5", "activations (GiB)", s4.memory.activations / kGiB, 40.8, 0.05, false, true, true},
      {"V5", "activations with recompute (GiB)", s5.memory.activations / kGiB, 14.7, 0.05, false, true, true},
      {"V5", "peak with recompute (GiB)", s5.total_sharded_master / kGiB, 76.90, 0.05, false, true, true},
      {"V3", "peak, EP8 (GiB)", v3_ep.stages[0].total_sharded_master / kGiB, 77.85, 0.05, false, true, true},
      {"V3", "peak, no EP (GiB)", v3_dp.stages[0].total_sharded_master / kGiB, 129.3, 0.05, false, true, true},
  });
}

// Throughput: two numbers fitted on V1 (8 experts) and V3 (EP8 and no EP), then V1 at 128
// experts, V4, V5's recompute cost and V13 predicted without refitting. Tolerances: 15% for a
// throughput on the fitted device (B300), 5 points for a relative change, 25% on another device
// (B200, another framework: torchtitan with DeepEP) whose micro-batch is not published.
TEST(PublishedRuns, ThroughputAfterFittingTwoNumbersOnV1AndV3) {
  const Cluster b300 = load_cluster("b300x8");
  const std::vector<FitParameter> fitted = {{"device.attention_efficiency", 0.1, 0.9}, {"network.intra_plateau", 0.05, 1.0}};
  const std::vector<Observation> obs = {
      {"V1 E=8", published("olmo3_v1_e32.toml", {"model.num_experts=8", "parallel.dp=8", "parallel.ep=8", "train.batch_size=512",
                                                 "model.routing=random"}), 54.5e3},
      {"V3 EP8", published("olmo3_v1_e32.toml", {"parallel.dp=8", "parallel.ep=8", "train.batch_size=512", "model.routing=random"}),
       54063},
      {"V3 no EP", published("olmo3_v1_e32.toml", {"parallel.dp=8", "parallel.ep=1", "train.batch_size=512", "model.routing=random"}),
       53512},
  };
  const FitResult fit = fit_cluster(b300, fitted, obs);
  if (std::getenv("MOE_VERBOSE"))
    std::printf("fitted %zu numbers on %zu published rows: attention_efficiency %.4f, intra_plateau %.4f; rms error %.2f%%\n",
                fitted.size(), obs.size(), fit.values[0], fit.values[1], 100 * fit.rms_relative_error);
  EXPECT_EQ(fitted.size(), 2u);
  // The B300 (and B200) presets carry these fitted numbers, citing this test.
  EXPECT_NEAR(b300.device.attention_efficiency, fit.values[0], 0.005);
  EXPECT_NEAR(b300.intra.efficiency.points.back().second, fit.values[1], 0.005);
  const Cluster& c8 = fit.cluster;
  Cluster c4 = fit.cluster;
  c4.ranks_per_node = 4;
  const double e8 = predict_tokens_per_device(obs[0].config, c8);
  const double e128 = predict_tokens_per_device(
      published("olmo3_v1_e32.toml", {"model.num_experts=128", "parallel.dp=8", "parallel.ep=8", "train.batch_size=512",
                                      "model.routing=random"}), c8);
  const double v4 = predict_tokens_per_device(published("olmo3_v1_e32.toml"), c4);
  const double v5 = predict_tokens_per_device(published("olmo3_v1_e32.toml", {"train.recompute=true"}), c4);
  // V6: two-batch overlap, with the report's own measurements as the overlap model (72% of the
  // exchange hidden, grouped GEMMs 25% slower beside it). Tolerance: 3 points on the change
  // (set after a first computation of this row, so it is not a blind prediction).
  const double v6 = predict_tokens_per_device(published("olmo3_v1_e32.toml"), c4, TimeOptions{OverlapModel{0.72, 0.25}});
  // V13 on B200 with the fitted numbers carried over (same tensor cores, same NVLink).
  Cluster b200 = load_cluster("b200x8");
  for (size_t i = 0; i < fitted.size(); ++i) fit_parameter_ref(b200, fitted[i].key) = fit.values[i];
  const double v13 = predict_tokens_per_device(published("qwen3_30b_a3b.toml"), b200);
  check({
      {"V1", "tokens/s/GPU, 8 experts (fitted)", e8, 54.5e3, 0.15, false, true},
      {"V3", "tokens/s/GPU, EP8 (fitted)", predict_tokens_per_device(obs[1].config, c8), 54063, 0.15, false, true},
      {"V3", "tokens/s/GPU, no EP (fitted)", predict_tokens_per_device(obs[2].config, c8), 53512, 0.15, false, true},
      {"V1", "tokens/s/GPU, 128 experts", e128, 52e3, 0.15, false, true},
      {"V1", "8 -> 128 experts: relative change", e128 / e8, 52.0 / 54.5, 0.05, true, true},
      {"V4", "tokens/s/GPU, bf16, 4 GPUs EP4", v4, 54.74e3, 0.15, false, true},
      {"V5", "recompute: relative throughput", v5 / v4, 43.22 / 54.68, 0.05, true, true},
      {"V6", "two-batch overlap: relative throughput", v6 / v4, 55.22 / 54.68, 0.03, true, false},
      {"V13", "Qwen3-30B-A3B tokens/s/GPU, 8 B200 EP8", v13, 14796, 0.25, false, false},
  });
}

}  // namespace
}  // namespace moe
