// What the golden-fixture tests share (tests/model/golden_test.cpp, mxfp8_golden_test.cpp): a
// fixture file with its config, and loading its initial state into a trainer's model.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoint/safetensors.h"
#include "common/backends.h"
#include "common/paths.h"
#include "common/test_util.h"
#include "kernels/host_view.h"
#include "train/trainer.h"

namespace moe {

struct Golden {
  std::string name;
  SafetensorsFile file;
  Config config;
  explicit Golden(const std::string& path)
      : name(std::filesystem::path(path).stem().string()), file(path), config(config_from_json(file.meta("config"))) {
    EXPECT_EQ(file.meta("format"), "moecore-golden-v1");
  }
};

// Writes a host tensor into a backend tensor (staged when the host cannot address it).
inline void write_into(Backend& ops, const Tensor& src, const Tensor& dst) {
  HostView v(ops, dst, HostView::kWrite);
  test::copy_tensor(src, v.tensor());
  v.commit();
}

// Loads the fixture's initial parameters and router biases into the trainer's model.
inline void load_initial_state(const Golden& g, Trainer& trainer, Backend& ops) {
  Transformer& model = trainer.model();
  const DType dt = model.compute_dtype();
  for (const ParamInfo& info : model.layout().entries()) {
    OwnedTensor src = g.file.read("param." + info.name, dt);
    Tensor dst = param_view(info, model.params().flat);
    check_same_shape(src.t, dst, info.name.c_str());
    write_into(ops, src, dst);
  }
  const ModelConfig& c = g.config.model;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    const std::string name = "router_bias." + std::to_string(l);
    if (g.file.contains(name)) write_into(ops, g.file.read(name, dt), model.router_bias()[static_cast<size_t>(c.moe_index(l))]);
  }
  model.refresh_operand_weights();
}

inline double scalar(const Golden& g, const std::string& name) { return g.file.read(name, DType::kF64).as<double>()[0]; }

// The fixture files of tests/golden/<subdir> (not recursive), sorted.
inline std::vector<std::string> fixtures(const std::string& subdir = "") {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(std::string(::moe::test::source_dir()) + "/tests/golden/" + subdir))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}


// Step 0 against the fixture: logits per micro-batch, every loss term and expert count, the grad
// norm and every gradient (max|a-b| / max|b| per tensor). Prints the errors.
inline void check_step0(const Golden& g, const std::string& backend, DType dt, double tol_out, double tol_grad) {
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
  for (int64_t l = 0; l < c.n_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    const size_t m = static_cast<size_t>(c.moe_index(l));
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
    if (std::getenv("MOE_GOLDEN_DEBUG")) std::printf("    %s %.2e\n", info.name.c_str(), err);
    if (err > worst) { worst = err; worst_name = info.name; }
  }
  std::printf("  %s [%s]: logits error %.2e, loss error %.2e, worst gradient error %.2e (%s)\n", g.name.c_str(),
              backend.c_str(), logits_err, std::fabs(r.total - scalar(g, "step0.total")) / std::fabs(scalar(g, "step0.total")),
              worst, worst_name.c_str());
}


}  // namespace moe
