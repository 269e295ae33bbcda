// OLMo-style initialization: truncated normal (+-3 std) matrices, unit norm weights, and every
// value a pure function of (seed, parameter name, element index).
#include <gtest/gtest.h>

#include <cmath>

#include "common/test_util.h"
#include "train/trainer.h"

namespace moe {
namespace {

TEST(Init, TruncatedNormalWithConfiguredStdAndUnitNorms) {
  Config c;
  c.model.d_model = 128;
  c.model.expert_hidden = 128;
  c.model.init_std = 0.02;
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Transformer model(c.model, c.loss, ModelOptions{}, *ops);
  model.init_params(7);
  for (const ParamInfo& info : model.layout().entries()) {
    Tensor t = param_view(info, model.params().flat);
    if (info.is_norm) {
      for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.as<float>()[i], 1.0f) << info.name;
      continue;
    }
    double sum = 0, sumsq = 0, maxabs = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = t.as<float>()[i];
      sum += v;
      sumsq += v * v;
      maxabs = std::max(maxabs, std::fabs(v));
    }
    const double n = static_cast<double>(t.numel()), mean = sum / n, sd = std::sqrt(sumsq / n - mean * mean);
    // A normal truncated at +-3 sigma has std 0.98658 sigma; the sample std of n values has a
    // standard error of about sigma / sqrt(2n): allow 5 of them. The 3-sigma bound is exact.
    EXPECT_NEAR(sd, 0.02 * 0.98658, 5 * 0.02 / std::sqrt(2 * n)) << info.name;
    EXPECT_NEAR(mean, 0.0, 0.02 * 5 / std::sqrt(n)) << info.name;
    EXPECT_LE(maxabs, 3 * 0.02 * (1 + 1e-6)) << info.name;
  }
}

TEST(Init, ValuesDependOnNameAndIndexNotOnLayout) {
  // Adding a dense layer in front shifts every offset in the flat buffer; a layer's values, keyed
  // by name, must not change (this is what makes init independent of a parallel layout later).
  Config a, b;
  a.model.n_layers = 2;
  b.model.n_layers = 2;
  b.model.tie_embeddings = true;  // removes lm_head, shifting nothing before it but changing the total
  b.model.qk_norm = "none";       // removes q_norm/k_norm: shifts all later offsets
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Transformer ma(a.model, a.loss, ModelOptions{}, *ops), mb(b.model, b.loss, ModelOptions{}, *ops);
  ma.init_params(3);
  mb.init_params(3);
  for (const char* name : {"embed", "layers.1.wq", "layers.1.experts.down", "layers.1.router"}) {
    Tensor ta = param_view(ma.layout().find(name), ma.params().flat);
    Tensor tb = param_view(mb.layout().find(name), mb.params().flat);
    EXPECT_TRUE(test::bitwise_equal(ta, tb)) << name;
  }
  Transformer mc(a.model, a.loss, ModelOptions{}, *ops);
  mc.init_params(4);
  EXPECT_FALSE(test::bitwise_equal(param_view(ma.layout().find("embed"), ma.params().flat),
                                   param_view(mc.layout().find("embed"), mc.params().flat)));
}

}  // namespace
}  // namespace moe
