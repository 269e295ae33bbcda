// Olmo-core 3's options together on a test model (docs/MODEL.md): reordered norms, a scaled
// (sqrt(d_model)) and normed embedding, a dense layer at `dense_layer`, per-head QK-norm, sigmoid
// scores with their epsilon, L2-normed weights times K, a scale and sqrt(original_top_k / K),
// sliding windows of 5 keys between a full first and a full last layer, two shared experts behind
// a gate with its logit bias (weights over their 1-norm), the router's logit bias, attention
// biases, q/k/v clamped at 0.2 (init std 0.02: some 10-20% of the projections), RoPE on half of
// each head.
#pragma once

#include <cmath>
#include <string>

#include "config/config.h"

namespace moe::test {

inline void apply_olmo_core3_options(ModelConfig& m, char dense_layer) {
  m.n_dense_layers = 0;
  m.dense_layers.clear();
  m.dense_layers.push_back(dense_layer);  // (not = "2": g++ 12 -O3 reports a false -Wrestrict in the inlined assign)
  m.dense_hidden = 40;
  m.norm_placement = "reordered";
  m.embed_scale = std::sqrt(static_cast<double>(m.d_model));
  m.embedding_norm = true;
  m.qk_norm = "per_head";
  m.score_func = "sigmoid";
  m.sigmoid_eps = 1e-7;
  m.norm_topk_prob = true;
  m.norm_topk_p = 2;
  m.restore_weight_scale = true;
  m.expert_weight_scale = 0.8;
  m.original_top_k = 4;
  m.sliding_window.clear();
  m.sliding_window.append(std::to_string(5));  // (appended: g++ 12's false -Wrestrict on = "5")
  if (m.shared_hidden == 0) m.shared_hidden = 8;
  m.shared_experts = 2;
  m.shared_router = true;
  m.shared_router_bias = true;
  m.shared_router_norm_p = 1;
  m.router_logit_bias = true;
  m.attention_bias = true;
  m.clip_qkv = 0.2;
  m.rope_partial = 0.5;
}

}  // namespace moe::test
