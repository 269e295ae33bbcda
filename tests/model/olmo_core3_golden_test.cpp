// The whole model against Olmo-core 3's own MoE transformer (OLMoDDPModel, ai2-olmo-core 3.0.0,
// run in float64 on the CPU by tools/reference/olmo_core3.py): fixtures in
// tests/golden/olmo_core3/, one per option set (their configs and cross-checks are in each
// file's metadata; tools/reference/README.md).
//
// Tolerances (issue #28, fixed before the measurements):
// - float64 (ref backend) against float64: 1e-9 for logits, every loss, every gradient and the
//   parameters and router biases after ten AdamW steps (seen: ~1e-15 at step 0, ~1e-13 after ten
//   steps; both sides compute the same function and differ only in summation order).
// - fp32 (cpu backend) against float64: CE, the load-balancing and router z-losses <= 1e-5
//   relative; every gradient max|d| / max|g| <= 1e-5 (step 0; seen <= 9.1e-7).
// - fp32 parameters after ten AdamW steps, per tensor max|d| / max|p| over the elements whose
//   step-1 gradient is at least 1e-4 of their tensor's max|g| (Adam divides each element's update
//   by its own RMS: an element whose gradient is all rounding moves by up to lr per step whatever
//   its precision). The issue set 1e-6 here. Olmo-core 3's OWN float32 run misses it against its
//   own float64 run on every fixture (worst tensor 8.6e-6, 3.6e-5, 4.9e-6; 12 to 14 tensors above
//   1e-6; the plain PyTorch module in fp32 alike: tests/golden/olmo_core3/fp32_drift.json, from
//   tools/reference/olmo_core3_fp32_drift.py): fp32 rounding at step 0 (~5e-7) grows through ten
//   Adam steps whatever the implementation. The bound is therefore PyTorch's own drift: every
//   tensor of moecore's within 2x the worst tensor of the worse of the two fp32 PyTorch runs of
//   that fixture (two independent fp32 runs land at similar random distances from float64; they
//   differ from each other by as much as from float64; the factor 2 keeps a machine whose GEMMs
//   sum in another order from failing by chance). The 1e-6 of the issue is reported as not
//   reachable in fp32, not met.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <cstdlib>
#include <string>

#include "golden_common.h"

namespace moe {
namespace {

constexpr double kF64Tol = 1e-9;
constexpr double kF32LossTol = 1e-5, kF32GradTol = 1e-5, kSmallGrad = 1e-4;

std::vector<std::string> oc3_fixtures() { return fixtures("olmo_core3"); }

// The worst per-tensor drift after ten steps of the two fp32 PyTorch runs of a fixture.
double pytorch_fp32_drift(const std::string& fixture) {
  std::ifstream in(std::string(::moe::test::source_dir()) + "/tests/golden/olmo_core3/fp32_drift.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  return std::max(j.at(fixture).at("oc32").at("step10_worst").get<double>(),
                  j.at(fixture).at("plain32").at("step10_worst").get<double>());
}

TEST(OlmoCore3Golden, FixturesArePresentAndComeFromOlmoCore3) {
  ASSERT_GE(oc3_fixtures().size(), 3u);
  for (const auto& path : oc3_fixtures()) {
    Golden g(path);
    EXPECT_NE(g.file.meta("notes").find("olmo_core"), std::string::npos) << path;
  }
}

TEST(OlmoCore3Golden, DoubleReferencePathMatchesAtStepZero) {
  for (const auto& path : oc3_fixtures()) {
    SCOPED_TRACE(path);
    check_step0(Golden(path), "ref", DType::kF64, kF64Tol, kF64Tol);
  }
}

TEST(OlmoCore3Golden, Float32MatchesAtStepZero) {
  for (const auto& path : oc3_fixtures()) {
    SCOPED_TRACE(path);
    check_step0(Golden(path), "cpu", DType::kF32, kF32LossTol, kF32GradTol);
  }
}

// Ten AdamW steps on the fixture's batch (clipping, the LR schedule, loss-free bias included).
void check_ten_steps(const Golden& g, const std::string& backend, DType dt) {
  const bool f64 = dt == DType::kF64;
  std::unique_ptr<Backend> ops = make_backend(backend);
  Trainer trainer(g.config, *ops, dt);
  load_initial_state(g, trainer, *ops);
  OwnedTensor ids = g.file.read("ids", DType::kI32), labels = g.file.read("labels", DType::kI32);
  OwnedTensor total = g.file.read("train.total", DType::kF64), ce = g.file.read("train.ce", DType::kF64);
  const double loss_tol = f64 ? kF64Tol : kF32LossTol;
  // The step-1 gradients, which decide what the fp32 comparison excludes.
  OwnedTensor grad1;
  for (int64_t n = 0; n < g.config.train.steps; ++n) {
    if (n == 0 && !f64) {
      trainer.compute_gradients(ids, labels);
      const HostView gv(*ops, trainer.model().grads().flat);
      grad1 = test::clone(gv.tensor(), DType::kF64);
    }
    const StepResult r = trainer.step(ids, labels);
    EXPECT_NEAR(r.total, total.as<double>()[n], loss_tol * std::fabs(total.as<double>()[n])) << "step " << n + 1;
    EXPECT_NEAR(r.ce, ce.as<double>()[n], loss_tol * std::fabs(ce.as<double>()[n])) << "step " << n + 1;
  }
  const double param_tol = f64 ? kF64Tol : 2 * pytorch_fp32_drift(g.name);
  int64_t excluded = 0, compared = 0;
  double worst = 0;
  std::string worst_name;
  for (const ParamInfo& info : trainer.model().layout().entries()) {
    const HostView pv(*ops, param_view(info, trainer.model().params().flat));
    OwnedTensor mine = test::clone(pv.tensor(), DType::kF64);
    OwnedTensor ref = g.file.read("final.param." + info.name, DType::kF64);
    if (f64) {
      EXPECT_LT(test::rel_error(mine, ref), kF64Tol) << "final " << info.name;
      continue;
    }
    const double* p = mine.as<double>();
    const double* q = ref.as<double>();
    const double* gr = grad1.as<double>() + info.offset;
    double max_p = 0, max_g = 0, max_d = 0;
    for (int64_t i = 0; i < info.numel; ++i) {
      max_p = std::max(max_p, std::fabs(q[i]));
      max_g = std::max(max_g, std::fabs(gr[i]));
    }
    for (int64_t i = 0; i < info.numel; ++i) {
      if (std::fabs(gr[i]) < kSmallGrad * max_g) {
        ++excluded;
        continue;
      }
      ++compared;
      if (std::getenv("MOE_GOLDEN_DEBUG") && std::fabs(p[i] - q[i]) > param_tol * std::max(max_p, 1e-300))
        std::printf("    %s[%lld]: |d| %.2e of max|p|, step-1 |g| %.2e of max|g|\n", info.name.c_str(),
                    static_cast<long long>(i), std::fabs(p[i] - q[i]) / max_p, std::fabs(gr[i]) / max_g);
      max_d = std::max(max_d, std::fabs(p[i] - q[i]));
    }
    const double err = max_d / std::max(max_p, 1e-300);
    EXPECT_LE(err, param_tol) << "final " << info.name;
    if (err > worst) {
      worst = err;
      worst_name = info.name;
    }
  }
  const ModelConfig& c = g.config.model;
  for (int64_t l = 0; l < c.n_layers && c.router_bias_selects(); ++l) {
    if (!c.is_moe_layer(l)) continue;
    const HostView bv(*ops, trainer.model().router_bias()[static_cast<size_t>(c.moe_index(l))].t);
    // The bias moves by +-gamma per step from integer counts: equal counts give equal bits.
    EXPECT_LT(test::rel_error(bv.tensor(), g.file.read("final.router_bias." + std::to_string(l), DType::kF64)),
              f64 ? kF64Tol : 1e-6)
        << "router bias of layer " << l;
  }
  if (!f64)
    std::printf("  %s [%s]: after 10 steps worst parameter error %.2e of max|p| (%s; PyTorch's own fp32 runs: "
                "%.2e); %lld of %lld elements excluded (step-1 |g| < 1e-4 max|g|)\n",
                g.name.c_str(), backend.c_str(), worst, worst_name.c_str(), pytorch_fp32_drift(g.name),
                static_cast<long long>(excluded), static_cast<long long>(excluded + compared));
}

TEST(OlmoCore3Golden, DoubleReferencePathMatchesTenAdamWSteps) {
  for (const auto& path : oc3_fixtures()) {
    SCOPED_TRACE(path);
    check_ten_steps(Golden(path), "ref", DType::kF64);
  }
}

TEST(OlmoCore3Golden, Float32MatchesTenAdamWSteps) {
  for (const auto& path : oc3_fixtures()) {
    SCOPED_TRACE(path);
    check_ten_steps(Golden(path), "cpu", DType::kF32);
  }
}

}  // namespace
}  // namespace moe
