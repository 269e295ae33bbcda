// Whole-model gradients against central finite differences in double, for every option the
// config offers (norm placement, QK-norm, GQA, tied head, dense layers, shared experts and both
// merges, several gated shared experts, the routers' logit biases, sigmoid/softmax, norm_topk_prob, loss-free bias, routing modes, all loss terms), with
// the assertion that no expert choice flipped between the perturbed evaluations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "common/test_util.h"
#include "train/trainer.h"

namespace moe {
namespace {

Config tiny_config() {
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = 11;
  m.d_model = 8;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.head_dim = 4;
  m.num_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 6;
  m.init_std = 0.3;  // large enough that every parameter matters at O(1e-2) in the loss
  c.loss.lm_z_coef = 0.01;
  c.loss.lbl_coef = 0.1;
  c.loss.router_z_coef = 0.01;
  c.train.seq_len = 7;
  c.train.batch_size = 2;
  c.train.micro_batch_size = 2;
  c.train.steps = 1;
  c.optim.warmup_steps = 0;
  c.train.backend = "ref";
  return c;
}

struct Variant {
  const char* name;
  std::function<void(Config&)> apply;
};

class ModelGradient : public ::testing::TestWithParam<Variant> {};

// Whether two (T,K) expert choices pick the same set of experts for every token. The order
// within a token's K experts follows their scores and may swap under a perturbation without
// changing the function (weights are gathered per expert), so only the sets must agree.
bool same_expert_sets(const Tensor& a, const Tensor& b) {
  const int64_t T = a.dim(0), K = a.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> x(a.as<int32_t>() + t * K, a.as<int32_t>() + (t + 1) * K);
    std::vector<int32_t> y(b.as<int32_t>() + t * K, b.as<int32_t>() + (t + 1) * K);
    std::sort(x.begin(), x.end());
    std::sort(y.begin(), y.end());
    if (x != y) return false;
  }
  return true;
}

// Smallest gap between the K-th and (K+1)-th selection scores (scores + bias) over all tokens and
// MoE layers of the last forward.
double min_selection_gap(Transformer& model, const Config& c) {
  double gap = 1e30;
  const int64_t E = c.model.num_experts, K = c.model.top_k;
  for (int64_t l = 0; l < c.model.n_layers; ++l) {
    if (!c.model.is_moe_layer(l)) continue;
    // topk_softmax chooses on the logits, the others on the scores.
    const Tensor& s = c.model.score_func == "topk_softmax" ? model.router_logits(l) : model.router_scores(l);
    const Tensor* bias = c.model.router_bias_selects() ? &model.router_bias()[static_cast<size_t>(c.model.moe_index(l))].t : nullptr;
    for (int64_t t = 0; t < s.dim(0); ++t) {
      std::vector<double> all;
      for (int64_t e = 0; e < E; ++e) all.push_back(test::get(s, t * E + e) + (bias ? test::get(*bias, e) : 0.0));
      std::vector<double> sel = all;
      if (c.model.n_group > 0) {  // group-limited: the groups' ranking, then the experts of the chosen groups
        const int64_t G = c.model.n_group, per = E / G, keep = c.model.topk_group;
        std::vector<std::pair<double, int64_t>> groups;
        for (int64_t g = 0; g < G; ++g) {
          std::vector<double> v(all.begin() + g * per, all.begin() + (g + 1) * per);
          std::sort(v.begin(), v.end(), std::greater<double>());
          groups.push_back({v[0] + (per > 1 ? v[1] : 0.0), g});
        }
        std::sort(groups.begin(), groups.end(), std::greater<>());
        if (keep < G) gap = std::min(gap, groups[static_cast<size_t>(keep - 1)].first - groups[static_cast<size_t>(keep)].first);
        sel.clear();
        for (int64_t i = 0; i < keep; ++i)
          for (int64_t e = 0; e < per; ++e) sel.push_back(all[static_cast<size_t>(groups[static_cast<size_t>(i)].second * per + e)]);
      }
      std::sort(sel.begin(), sel.end(), std::greater<double>());
      if (static_cast<int64_t>(sel.size()) > K) gap = std::min(gap, sel[static_cast<size_t>(K - 1)] - sel[static_cast<size_t>(K)]);
    }
  }
  return gap;
}

// clip_qkv over all layers of the last forward: which pre-clamp projections lie beyond the bounds,
// the smallest distance of one to a bound (infinite without clipping), and the smallest fraction of
// unclamped entries in any one layer's q, k or v (1 without clipping).
struct ClampState {
  std::vector<bool> clamped;
  double margin = 1e30;
  double min_free_fraction = 1;
};

ClampState clamp_state(Transformer& model, const Config& c) {
  ClampState s;
  if (c.model.clip_qkv <= 0) return s;
  for (int64_t l = 0; l < c.model.n_layers; ++l) {
    const AttnActs& a = model.attention_acts(l);
    for (const Tensor* t : {&a.q_pre, &a.k_pre, &a.v_pre}) {
      int64_t free = 0;
      for (int64_t i = 0; i < t->numel(); ++i) {
        const double x = std::abs(test::get(*t, i));
        s.margin = std::min(s.margin, std::abs(x - c.model.clip_qkv));
        s.clamped.push_back(x > c.model.clip_qkv);
        free += x <= c.model.clip_qkv;
      }
      s.min_free_fraction = std::min(s.min_free_fraction, static_cast<double>(free) / static_cast<double>(t->numel()));
    }
  }
  return s;
}

TEST_P(ModelGradient, MatchesCentralFiniteDifferences) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(seed);
  Config c = tiny_config();
  GetParam().apply(c);
  c.validate();
  std::unique_ptr<Backend> ops = make_backend("ref");
  Trainer trainer(c, *ops, DType::kF64);
  // Parameters from a seed; the search below draws fresh ones when the inputs alone cannot
  // separate the routing or the clamp (a layer-0 projection of one token's embedding near +-clip
  // stays there for every draw of the ids that holds that token, and 14 draws of 11 ids nearly
  // always hold them all: 4% of seeds had no valid ids in 1000 draws).
  auto init_params = [&](uint64_t param_seed) {
    trainer.model().init_params(param_seed);
    for (const ParamInfo& info : trainer.model().layout().entries())  // biases start at 0: give them values
      if (info.is_bias) test::fill_uniform(param_view(info, trainer.model().params().flat), param_seed, 39, -0.5, 0.5);
    if (c.model.router_bias_selects())
      for (auto& b : trainer.model().router_bias()) test::fill_uniform(b, param_seed, 40, -0.05, 0.05);
    // The routers' logit biases start at zero (Olmo-core 3's init): drawn here so that they matter.
    for (const ParamInfo& info : trainer.model().layout().entries())
      if (info.name.ends_with(".bias")) test::fill_uniform(param_view(info, trainer.model().params().flat), param_seed, 43, -0.3, 0.3);
    trainer.model().refresh_operand_weights();
  };
  OwnedTensor ids(DType::kI32, {2, 7}), labels(DType::kI32, {2, 7});
  Transformer& model = trainer.model();
  // Inputs whose K-th and (K+1)-th selection scores are within 1e-2 anywhere are redrawn: the
  // perturbations below (up to 2e-4 in one parameter) must not be able to flip an expert choice.
  // With init std 0.3 a score can move ~10x a parameter's perturbation (2e-3 was seen to flip).
  StepResult base;
  constexpr uint64_t kDrawsPerParams = 20;
  for (uint64_t attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 1000u) << "no well-separated routing or clamp margin found";
    if (attempt % kDrawsPerParams == 0) init_params(seed + 0x9E3779B97F4A7C15ull * (attempt / kDrawsPerParams));
    test::fill_ids(ids, seed, 41 + attempt, 11);
    for (int64_t i = 0; i < 14; ++i) labels.as<int32_t>()[i] = (i % 7 == 6 || i == 3) ? -1 : ids.as<int32_t>()[i + 1];
    base = trainer.compute_gradients(ids, labels);
    // clip_qkv: no projection within 5e-3 of +-clip (a perturbation moves one by <~1e-3 mostly:
    // the check below catches the rest), and a quarter of every layer's q, k and v unclamped, so
    // that no projection's gradient is zero everywhere (the relative check would compare noise).
    const ClampState clamp = clamp_state(model, c);
    if ((c.model.routing != "learned" || min_selection_gap(model, c) > 1e-2) && clamp.margin > 5e-3 &&
        clamp.min_free_fraction >= 0.25)
      break;
  }
  const std::vector<bool> base_clamped = clamp_state(model, c).clamped;
  if (c.model.clip_qkv > 0) {  // the clamp is active: some projections beyond it
    EXPECT_GT(std::count(base_clamped.begin(), base_clamped.end(), true), 0);
  }
  const int64_t moe_layers = c.model.num_moe_layers();
  std::vector<OwnedTensor> choices;
  for (int64_t m = 0; m < moe_layers; ++m) choices.push_back(test::clone(model.expert_choice(c.model.moe_layer(m))));
  OwnedTensor analytic = test::clone(model.grads().flat);
  // Each parameter tensor is checked on its own so a wrong gradient names its parameter.
  for (const ParamInfo& info : model.layout().entries()) {
    Tensor p = param_view(info, model.params().flat);
    Tensor g = param_view(info, analytic.t);
    bool flipped = false, clamp_moved = false;
    auto loss = [&] {
      model.refresh_operand_weights();
      StepResult r = trainer.compute_gradients(ids, labels);
      for (int64_t m = 0; m < moe_layers; ++m)
        flipped = flipped || !same_expert_sets(model.expert_choice(c.model.moe_layer(m)), choices[static_cast<size_t>(m)]);
      clamp_moved = clamp_moved || clamp_state(model, c).clamped != base_clamped;
      return r.total;
    };
    // With init std 0.3 the model is strongly nonlinear: central differences at h = 1e-5 showed a
    // pure O(h^2) truncation error up to ~1.4e-6 (it fell 11x for h / 3.3). The 5-point stencil's
    // truncation is O(h^4) (~1e-12 at h = 1e-4) and its rounding ~1e-16 |loss| / h ~ 1e-11.
    // Errors are relative to the parameter's largest gradient, floored at 1e-4: with clip_qkv and
    // no QK-norm the k bias's true gradient is ~1e-6 (a bias added to every key shifts each query's
    // logits by one constant, which the softmax cancels, except where the clamp holds a key), and the
    // stencil's rounding of ~1e-11 would fail a 1e-6 bound against it. A gradient wrong by more than
    // 1e-10 still fails.
    constexpr double kMinScale = 1e-4;
    double err = test::fd_check(p, g, loss, 1e-4, 24, /*fourth_order=*/true, false, kMinScale);
    // A perturbation of a layer-0 weight moves the layer-1 projections too, and can carry one across
    // +-clip (2 in 1000 seeds with the 5e-3 margin): the stencil then spans the clamp's kink. At
    // h / 10 the moves are ten times smaller than the margin; truncation O(1e-20), rounding ~1e-10.
    if (err >= 1e-6 && clamp_moved) {
      clamp_moved = false;
      err = test::fd_check(p, g, loss, 1e-5, 24, /*fourth_order=*/true, false, kMinScale);
    }
    // Some draws put a per-head QK-norm input or a peri-norm input near zero, where the function
    // curves so sharply that the stencil's O(h^4) truncation alone exceeds the bound (seen: 4e-5
    // in 1 of ~100 seeds). Then the estimate is refined by Richardson extrapolation from h and
    // h/2, which removes that term; a wrong gradient stays wrong at every h.
    if (err >= 1e-6) err = test::fd_check(p, g, loss, 1e-4, 24, /*fourth_order=*/true, /*extrapolate=*/true, kMinScale);
    EXPECT_FALSE(flipped) << info.name << ": an expert choice flipped under perturbation; re-seed";
    EXPECT_FALSE(clamp_moved) << info.name << ": a projection crossed the clip_qkv bound under perturbation; re-seed";
    EXPECT_LT(err, 1e-6) << info.name;
  }
  EXPECT_GT(base.total, 0);
}

// A step's first write of every gradient overwrites it (model/grad_writes.h): gradients left
// full of NaN by anything before the step must give the same gradients, bit for bit, as a first
// step, for every option, with one micro-batch and with two (the second adds).
TEST_P(ModelGradient, AStepNeverReadsTheLastStepsGradients) {
  for (const int64_t micro : {2, 1}) {
    SCOPED_TRACE(testing::Message() << "micro_batch_size " << micro);
    Config c = tiny_config();
    GetParam().apply(c);
    c.train.micro_batch_size = micro;
    c.validate();
    std::unique_ptr<Backend> ops = make_backend("ref");
    Trainer trainer(c, *ops, DType::kF64);
    trainer.model().init_params(test::test_seed());
    trainer.model().refresh_operand_weights();
    OwnedTensor ids(DType::kI32, {2, 7}), labels(DType::kI32, {2, 7});
    test::fill_ids(ids, test::test_seed(), 41, 11);
    for (int64_t i = 0; i < 14; ++i) labels.as<int32_t>()[i] = i % 7 == 6 ? -1 : ids.as<int32_t>()[i + 1];
    trainer.compute_gradients(ids, labels);
    const OwnedTensor first = test::clone(trainer.model().grads().flat);
    const Tensor& g = trainer.model().grads().flat;
    for (const ParamInfo& info : trainer.model().layout().entries()) {  // (the padding between regions stays 0)
      const Tensor e = param_view(info, g);
      std::fill(e.as<double>(), e.as<double>() + e.numel(), std::nan(""));
    }
    trainer.compute_gradients(ids, labels);
    int64_t differ = 0;
    for (int64_t i = 0; i < g.numel(); ++i)
      differ += std::memcmp(g.as<double>() + i, first.as<double>() + i, sizeof(double)) != 0;
    EXPECT_EQ(differ, 0) << "gradient elements that depend on the values before the step";
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, ModelGradient,
    ::testing::Values(
        Variant{"olmoe_pre_full_qk", [](Config&) {}},
        Variant{"peri_per_head_sigmoid_shared_sum_dense",
                [](Config& c) {
                  c.model.norm_placement = "peri";
                  c.model.qk_norm = "per_head";
                  c.model.score_func = "sigmoid";
                  c.model.shared_hidden = 5;
                  c.model.n_layers = 3;
                  c.model.n_dense_layers = 1;
                  c.model.dense_hidden = 9;
                  c.model.rope_theta = 500000;
                }},
        Variant{"tied_norm_topk_shared_v1_lossfree",
                [](Config& c) {
                  c.model.tie_embeddings = true;
                  c.model.norm_topk_prob = true;
                  c.model.shared_hidden = 4;
                  c.model.shared_merge = "v1";
                  c.model.router_bias_gamma = 0.01;
                  c.model.qk_norm = "none";
                }},
        // Olmo-core 3's block: reordered norms, scaled and normed embedding, a dense layer in the
        // middle, restore_weight_scale after the sum.
        Variant{"reordered_embed_norm_dense_middle_restore",
                [](Config& c) {
                  c.model.norm_placement = "reordered";
                  c.model.embed_scale = std::sqrt(8.0);
                  c.model.embedding_norm = true;
                  c.model.n_layers = 3;
                  c.model.dense_layers = "1";
                  c.model.dense_hidden = 7;
                  c.model.norm_topk_prob = true;
                  c.model.restore_weight_scale = true;
                  c.model.qk_norm = "per_head";
                  c.model.shared_hidden = 3;
                }},
        Variant{"sigmoid_eps_l2_weights_scaled_lossfree",
                [](Config& c) {
                  c.model.score_func = "sigmoid";
                  c.model.sigmoid_eps = 1e-7;
                  c.model.norm_topk_prob = true;
                  c.model.norm_topk_p = 2;
                  c.model.expert_weight_scale = 2.5;
                  c.model.original_top_k = 3;
                  c.model.router_bias_gamma = 0.01;
                  c.model.n_layers = 3;
                  c.model.dense_layers = "0,2";
                  c.model.dense_hidden = 5;
                }},
        Variant{"topk_softmax_lossfree_scaled_embedding_tied",
                [](Config& c) {
                  c.model.score_func = "topk_softmax";
                  c.model.router_bias_gamma = 0.01;
                  c.model.embed_scale = 2.0;
                  c.model.tie_embeddings = true;
                  c.model.norm_placement = "peri";
                }},
        // Group-limited routing over a fixed (loaded) score-correction bias.
        Variant{"group_limited_score_correction_bias",
                [](Config& c) {
                  c.model.num_experts = 8;
                  c.model.n_group = 4;
                  c.model.topk_group = 2;
                  c.model.score_correction_bias = true;
                  c.model.score_func = "sigmoid";
                }},
        // A sliding window of 3 of the 7 positions on layer 0, the last layer full.
        Variant{"sliding_window_first_layer",
                [](Config& c) {
                  c.model.sliding_window.push_back('3');  // (not = "3": g++ 12's false -Wrestrict)
                  c.model.sliding_window_full_first = false;
                }},
        // RoPE on the windowed layer only (Olmo-core 3's no_global_rope); and no RoPE at all.
        Variant{"rope_on_windowed_layers_only",
                [](Config& c) {
                  c.model.sliding_window.push_back('3');
                  c.model.sliding_window_full_first = false;
                  c.model.rope = "windowed";
                }},
        Variant{"no_rope", [](Config& c) { c.model.rope = "none"; }},
        // Olmo-core 3's attention options: clip_qkv (about a quarter of the projections clamped),
        // biases on the four projections, RoPE on half of each head's dims; with QK-norm over all
        // heads (pre), per head (reordered) and none (peri).
        Variant{"clip_qkv_attention_bias_partial_rope_full_qk",
                [](Config& c) {
                  c.model.clip_qkv = 1.0;
                  c.model.attention_bias = true;
                  c.model.rope_partial = 0.5;
                }},
        Variant{"clip_qkv_attention_bias_partial_rope_per_head_reordered",
                [](Config& c) {
                  c.model.clip_qkv = 1.0;
                  c.model.attention_bias = true;
                  c.model.rope_partial = 0.5;
                  c.model.qk_norm = "per_head";
                  c.model.norm_placement = "reordered";
                }},
        Variant{"clip_qkv_attention_bias_no_qk_norm_peri",
                [](Config& c) {
                  c.model.clip_qkv = 1.0;
                  c.model.attention_bias = true;
                  c.model.qk_norm = "none";
                  c.model.norm_placement = "peri";
                }},
        // The load-balancing loss per sequence (the micro-batch holds two), sigmoid scores.
        Variant{"instance_load_balancing_sigmoid",
                [](Config& c) {
                  c.loss.lbl_granularity = "instance";
                  c.model.score_func = "sigmoid";
                }},
        // Three gated shared experts (softmax gate with its logit bias, weights over their
        // 2-norm) and the routed router's logit bias, reordered norms.
        Variant{"three_gated_shared_experts_logit_biases",
                [](Config& c) {
                  c.model.norm_placement = "reordered";
                  c.model.shared_hidden = 3;
                  c.model.shared_experts = 3;
                  c.model.shared_router = true;
                  c.model.shared_router_bias = true;
                  c.model.shared_router_norm_p = 2;
                  c.model.router_logit_bias = true;
                }},
        // Two shared experts behind a sigmoid gate (+ eps, weights over their 1-norm, no bias),
        // sigmoid routing with the routed logit bias, peri norms.
        Variant{"sigmoid_gated_shared_experts",
                [](Config& c) {
                  c.model.norm_placement = "peri";
                  c.model.shared_hidden = 4;
                  c.model.shared_router = true;
                  c.model.shared_router_score = "sigmoid";
                  c.model.shared_router_sigmoid_eps = 1e-7;
                  c.model.shared_experts = 2;
                  c.model.shared_router_norm_p = 1;
                  c.model.score_func = "sigmoid";
                  c.model.router_logit_bias = true;
                }},
        Variant{"uniform_routing", [](Config& c) { c.model.routing = "uniform"; }},
        Variant{"random_routing_mha", [](Config& c) {
                  c.model.routing = "random";
                  c.model.n_kv_heads = 2;
                }}),
    [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace moe
