// The whole model against PyTorch: fixtures written in float64 by tools/reference/ from
// transformers' OlmoeForCausalLM, ai2-olmo-core's loss functions and a checked plain PyTorch
// module (see tools/reference/README.md). Error measure per tensor: max|a-b| / max|b|.
//
// Tolerances:
// - f64 reference path: 1e-10. Both sides compute the same function in double; what differs is
//   summation order (GEMMs, softmax, reductions), worth ~1e-15 relative per op and growing
//   mildly through two or three layers and ten AdamW steps. 1e-10 leaves five orders of margin
//   while still catching any real difference in the math (those show up at 1e-6 or worse).
// - f32 fast (cpu) path: logits and losses 1e-5, gradients 1e-4 (issue #2). fp32 rounding is
//   6e-8 per op; logits pass through ~10 rounding stages of O(sqrt(K)) accumulations, and
//   gradients of small-magnitude parameters (router, norms) lose a few more bits.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "common/paths.h"
#include "checkpoint/safetensors.h"
#include "kernels/host_view.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "golden_common.h"
#include "train/trainer.h"

namespace moe {
namespace {

std::vector<std::string> fixtures() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(std::string(::moe::test::source_dir()) + "/tests/golden"))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}


void check_step0(const Golden& g, const std::string& backend, DType dt, double tol_out, double tol_grad) {
  std::unique_ptr<Backend> ops = make_backend(backend);
  Trainer trainer(g.config, *ops, dt);
  load_initial_state(g, trainer, *ops);
  const TrainConfig& tc = g.config.train;
  OwnedTensor ids = g.file.read("ids", DType::kI32), labels = g.file.read("labels", DType::kI32);
  OwnedTensor logits_ref = g.file.read("step0.logits", DType::kF64);
  const int64_t V = g.config.model.vocab_size, mbs = tc.micro_batch_size, S = tc.seq_len;
  double logits_err = 0;
  for (int64_t m = 0; m < tc.batch_size / mbs; ++m) {
    OwnedTensor logits(dt, {mbs * S, V});
    OwnedTensor ids_dev(*ops, DType::kI32, {mbs, S}), logits_dev(*ops, dt, {mbs * S, V});
    ops->upload(ids.t.slice(m * mbs, (m + 1) * mbs).data, ids_dev);
    test::poison(logits);
    ops->upload(logits.t.data, logits_dev);
    trainer.model().forward_logits(ids_dev, logits_dev);
    ops->download(logits_dev, logits.t.data);
    ops->synchronize();
    const double err = test::rel_error(logits, logits_ref.t.slice(m * mbs, (m + 1) * mbs));
    EXPECT_LT(err, tol_out) << "logits, micro-batch " << m;
    logits_err = std::max(logits_err, err);
  }
  StepResult r = trainer.compute_gradients(ids, labels);
  auto near = [&](double a, double b, double tol, const std::string& what) {
    EXPECT_LE(std::fabs(a - b), tol * std::max(1.0, std::fabs(b))) << what << ": " << a << " vs " << b;
  };
  near(r.ce, scalar(g, "step0.ce"), tol_out, "ce");
  near(r.lm_z, scalar(g, "step0.lm_z"), tol_out, "lm_z");
  near(r.total, scalar(g, "step0.total"), tol_out, "total");
  const ModelConfig& c = g.config.model;
  for (int64_t l = c.n_dense_layers; l < c.n_layers; ++l) {
    const size_t m = static_cast<size_t>(l - c.n_dense_layers);
    near(r.lbl[m], scalar(g, "step0.lbl." + std::to_string(l)), tol_out, "lbl layer " + std::to_string(l));
    near(r.router_z[m], scalar(g, "step0.router_z." + std::to_string(l)), tol_out, "router_z layer " + std::to_string(l));
    OwnedTensor counts = g.file.read("step0.counts." + std::to_string(l), DType::kI32);
    for (int64_t e = 0; e < c.num_experts; ++e)
      EXPECT_EQ(r.counts[m][static_cast<size_t>(e)], counts.as<int32_t>()[e]) << "layer " << l << " expert " << e;
  }
  near(r.grad_norm, scalar(g, "step0.grad_norm"), tol_grad, "grad_norm");
  double worst = 0;
  std::string worst_name;
  for (const ParamInfo& info : trainer.model().layout().entries()) {
    const HostView grad(*ops, param_view(info, trainer.model().grads().flat));
    const double err = test::rel_error(grad.tensor(), g.file.read("step0.grad." + info.name, DType::kF64));
    EXPECT_LT(err, tol_grad) << "gradient of " << info.name;
    if (err > worst) { worst = err; worst_name = info.name; }
  }
  std::printf("  %s [%s]: logits error %.2e, loss error %.2e, worst gradient error %.2e (%s)\n", g.name.c_str(),
              backend.c_str(), logits_err, std::fabs(r.total - scalar(g, "step0.total")) / std::fabs(scalar(g, "step0.total")),
              worst, worst_name.c_str());
}

TEST(Golden, FixturesArePresent) { EXPECT_GE(fixtures().size(), 3u); }

TEST(Golden, DoubleReferencePathMatchesPyTorchAtStepZero) {
  for (const auto& path : fixtures()) {
    SCOPED_TRACE(path);
    Golden g(path);
    check_step0(g, "ref", DType::kF64, 1e-10, 1e-10);
  }
}

TEST(Golden, DoubleReferencePathMatchesTenAdamWSteps) {
  for (const auto& path : fixtures()) {
    SCOPED_TRACE(path);
    Golden g(path);
    std::unique_ptr<Backend> ops = make_backend("ref");
    Trainer trainer(g.config, *ops, DType::kF64);
    load_initial_state(g, trainer, *ops);
    OwnedTensor ids = g.file.read("ids", DType::kI32), labels = g.file.read("labels", DType::kI32);
    OwnedTensor total = g.file.read("train.total", DType::kF64), ce = g.file.read("train.ce", DType::kF64);
    OwnedTensor gn = g.file.read("train.grad_norm", DType::kF64), lr = g.file.read("train.lr", DType::kF64);
    bool clipped_any = false;
    for (int64_t n = 0; n < g.config.train.steps; ++n) {
      StepResult r = trainer.step(ids, labels);
      clipped_any = clipped_any || r.clipped;
      const double* t = total.as<double>();
      EXPECT_NEAR(r.total, t[n], 1e-10 * std::fabs(t[n])) << "step " << n + 1;
      EXPECT_NEAR(r.ce, ce.as<double>()[n], 1e-10 * std::fabs(ce.as<double>()[n])) << "step " << n + 1;
      EXPECT_NEAR(r.grad_norm, gn.as<double>()[n], 1e-10 * gn.as<double>()[n]) << "step " << n + 1;
      EXPECT_NEAR(r.lr, lr.as<double>()[n], 1e-15) << "step " << n + 1;
    }
    EXPECT_TRUE(clipped_any) << "the fixture must exercise clipping";
    for (const ParamInfo& info : trainer.model().layout().entries())
      EXPECT_LT(test::rel_error(param_view(info, trainer.model().params().flat),
                                g.file.read("final.param." + info.name, DType::kF64)), 1e-10)
          << "final " << info.name;
    const ModelConfig& c = g.config.model;
    for (int64_t l = c.n_dense_layers; l < c.n_layers && c.router_bias_gamma > 0; ++l)
      EXPECT_LT(test::rel_error(trainer.model().router_bias()[static_cast<size_t>(l - c.n_dense_layers)],
                                g.file.read("final.router_bias." + std::to_string(l), DType::kF64)), 1e-10)
          << "router bias of layer " << l;
  }
}

// The f32 fast paths, cpu and (in a CUDA build) cuda, with the same tolerances: cuda's kernels
// differ from cpu's only in summation order (and its fp32 GEMMs use full fp32, not TF32), which
// the stated bounds already cover. Without a GPU the cuda case reports Skipped.
class GoldenFast : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Fast, GoldenFast, ::testing::ValuesIn(test::backends_under_test()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST_P(GoldenFast, Float32MatchesPyTorchAtStepZero) {
  if (GetParam() == "strict") GTEST_SKIP() << "strict runs the cpu kernels: covered by the cpu case";
  std::string why;
  if (!test::backend_available(GetParam(), &why)) GTEST_SKIP() << GetParam() << " unavailable: " << why;
  for (const auto& path : fixtures()) {
    SCOPED_TRACE(path);
    Golden g(path);
    check_step0(g, GetParam(), DType::kF32, 1e-5, 1e-4);
  }
}

}  // namespace
}  // namespace moe
