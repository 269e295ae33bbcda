// What the golden-fixture tests share (tests/model/golden_test.cpp, mxfp8_golden_test.cpp): a
// fixture file with its config, and loading its initial state into a trainer's model.
#pragma once

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "checkpoint/safetensors.h"
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
  for (int64_t l = c.n_dense_layers; l < c.n_layers; ++l) {
    const std::string name = "router_bias." + std::to_string(l);
    if (g.file.contains(name)) write_into(ops, g.file.read(name, dt), model.router_bias()[static_cast<size_t>(l - c.n_dense_layers)]);
  }
  model.refresh_operand_weights();
}

inline double scalar(const Golden& g, const std::string& name) { return g.file.read(name, DType::kF64).as<double>()[0]; }

}  // namespace moe
