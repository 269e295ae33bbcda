// OLMo-style initialization: truncated normal (+-3 std) matrices, unit norm weights, and every
// value a pure function of (seed, parameter name, element index).
#include <gtest/gtest.h>

#include <cmath>

#include "common/test_util.h"
#include "core/fnv1a.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/model_state.h"
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

// FNV-1a of every parameter value of a model initialised from `seed` with `threads` host threads.
uint64_t init_hash(const Config& c, const ModelShard& shard, int threads, uint64_t seed) {
  std::unique_ptr<Backend> ops = make_backend("cpu");
  ModelState state(c.model, shard.resolved(c.model), 1, 1, DType::kF32, false, *ops);
  const int saved = cpu::num_threads();
  cpu::set_num_threads(threads);
  state.init_params(seed);
  cpu::set_num_threads(saved);
  const Tensor& flat = state.params().flat;
  return fnv1a(flat.data, flat.nbytes());
}

// Initialisation runs on several host threads; its values are a pure function of (seed, name,
// index), so every thread count gives the bytes the single-threaded loop gave. The hashes were
// recorded from that loop (before initialisation was parallel), for the default model and for a
// pipeline stage's expert-parallel shard (layers 1-2 of 4, experts 2-3 of 8, E = 8).
TEST(Init, ParametersEqualTheSingleThreadedLoopAtAnyThreadCount) {
  Config def;
  Config ep;
  ep.model.n_layers = 4;
  ep.model.num_experts = 8;
  ep.model.top_k = 2;
  ModelShard shard;
  shard.layer_begin = 1;
  shard.layer_end = 3;
  shard.expert_begin = 2;
  shard.num_local_experts = 2;
  const uint64_t kDefault = 13399645313112919361ull, kShard = 13219034286468030896ull;  // the single-threaded loop's
  for (int threads : {1, 2, 3}) {
    EXPECT_EQ(init_hash(def, ModelShard{}, threads, 1234), kDefault) << threads << " threads, default model";
    EXPECT_EQ(init_hash(ep, shard, threads, 99), kShard) << threads << " threads, expert shard";
  }
}

}  // namespace
}  // namespace moe
