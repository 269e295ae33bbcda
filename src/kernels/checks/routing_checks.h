// Argument contracts of the MoE routing ops (op_list.inc), shared by every backend: shapes, the
// score kinds, the expert-weight rule. Dtype and device rules are each backend's; expert ids are
// data, checked where they are: by the host backends with check_expert_ids, by cuda's kernels.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/op_types.h"

namespace moe {

// Token count, experts and slots per token of a routing op.
struct RoutingDims {
  int64_t T = 0, E = 0, K = 0;
};
// Token count, row width and slots per token of a permutation op (gather, combine).
struct PermuteDims {
  int64_t T = 0, D = 0, K = 0;
};

// eps >= 0 and only with sigmoid scores. logits, scores (T,E).
RoutingDims check_router_scores(const Tensor& logits, ScoreKind kind, double eps, const Tensor& scores, const char* op);
// dscores, scores, dlogits (T,E).
RoutingDims check_router_scores_bwd(const Tensor& dscores, const Tensor& scores, ScoreKind kind, double eps,
                                    const Tensor& dlogits);
// scores (T,E), bias (E) or empty, expert_idx (T,K) with K <= E; groups: none (0, 0) or n_group
// dividing E, 1 <= topk_group <= n_group and K within the topk_group groups' experts.
RoutingDims check_router_topk(const Tensor& scores, const Tensor& bias, int64_t n_group, int64_t topk_group,
                              const Tensor& expert_idx);
// expert_idx (T,K), K <= num_experts.
RoutingDims check_router_assign(RouterAssignment kind, int num_experts, const Tensor& expert_idx);
// scores (T,E), expert_idx and weights (T,K); the rule's p >= 0 and factor finite.
RoutingDims check_router_gather(const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule,
                                const Tensor& weights);
RoutingDims check_router_gather_bwd(const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                                    const ExpertWeightRule& rule, const Tensor& dscores);
// step_counts and bias (E); returns E.
int64_t check_router_bias_update(const Tensor& step_counts, const Tensor& bias);
void check_add_counts(const Tensor& counts, const Tensor& total);
void check_expert_counts(const Tensor& expert_idx, const Tensor& counts);
// expert_idx (T,K) or (R), counts (E), offsets (E+1), sorted_slot and slot_pos (R = T*K).
RoutingDims check_moe_plan(const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets,
                           const Tensor& sorted_slot, const Tensor& slot_pos);
// Host expert ids (R of them): each in [0, E).
void check_expert_ids(const int32_t* ids, int64_t R, int64_t E, const char* op);
// x (T,D), sorted_slot (R) with R a multiple of T, xs (R,D) of x's dtype. Returns {T, D, K}.
PermuteDims check_moe_gather(const Tensor& x, const Tensor& sorted_slot, const Tensor& xs);
// dx (T,D), slot_pos (T*K), dxs (>= T*K rows, D). Returns {T, D, K}.
PermuteDims check_moe_gather_bwd(const Tensor& dxs, const Tensor& slot_pos, const Tensor& dx);
// out (T,D), weights (T,K), slot_pos (T*K), ys (>= T*K rows, D). Returns {T, D, K}.
PermuteDims check_moe_combine(const Tensor& ys, const Tensor& slot_pos, const Tensor& weights, const Tensor& out);
// dout (T,D), weights and dweights (T,K), slot_pos (T*K), ys and dys (>= T*K rows, D).
PermuteDims check_moe_combine_bwd(const Tensor& dout, const Tensor& ys, const Tensor& slot_pos, const Tensor& weights,
                                  const Tensor& dys, const Tensor& dweights);
// scores (T,E) with T > 0, counts and mean_prob (E), out one value, dscores (T,E) or empty.
RoutingDims check_load_balance_loss(const Tensor& scores, const Tensor& counts, ScoreKind kind, int top_k, const Tensor& out,
                                    const Tensor& dscores, const Tensor& mean_prob);
// logits (T,E) with T > 0, out one value, dlogits (T,E) or empty.
RoutingDims check_router_z_loss(const Tensor& logits, const Tensor& out, const Tensor& dlogits);

}  // namespace moe
