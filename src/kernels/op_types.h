// The values the ops of kernels/op_list.inc take besides tensors and numbers: each op's modes as
// enums, and the expert-weight rule. Defined once here for every backend and every caller.
#pragma once

#include "core/mxfp8.h"  // mx::ScaleRule, the MXFP8 quantizers' scale rule

namespace moe {

// How router logits become scores (router_scores_fwd/bwd, load_balance_loss): softmax over the
// experts, or each logit's sigmoid (plus eps).
enum class ScoreKind : int { kSoftmax = 0, kSigmoid = 1 };

// What router_assign puts in place of the learned choice (throughput tests): uniform, token g
// takes experts (g*K + j) mod E; random, K distinct experts drawn by a counter-based RNG.
enum class RouterAssignment : int { kUniform = 0, kRandom = 1 };

// How a token's K chosen scores become its combine weights (model.norm_topk_prob / norm_topk_p,
// restore_weight_scale, expert_weight_scale, original_top_k: Olmo-core 3's MoERouterV2):
// w_j = factor * s_j / ||s||_p over the chosen scores; norm_p = 0: not divided.
struct ExpertWeightRule {
  double norm_p = 0;
  double factor = 1;
};

}  // namespace moe
