#include "kernels/checks/routing_checks.h"

#include <cmath>

#include "core/check.h"

namespace moe {
namespace {
RoutingDims matrix(const Tensor& t, const char* what) {
  MOE_CHECK(t.ndim == 2, what, ": expected a (tokens, experts) matrix, got ", t.shape_str());
  return {t.shape[0], t.shape[1], 0};
}

void check_kind(ScoreKind kind, double eps, const char* op) {
  MOE_CHECK(kind == ScoreKind::kSoftmax || kind == ScoreKind::kSigmoid, op, ": score kind ", static_cast<int>(kind),
            " (0 softmax, 1 sigmoid)");
  MOE_CHECK(std::isfinite(eps) && eps >= 0 && (eps == 0 || kind == ScoreKind::kSigmoid), op, ": eps = ", eps,
            " (a non-negative offset of sigmoid scores only)");
}

void check_rule(const ExpertWeightRule& rule, const char* op) {
  MOE_CHECK(std::isfinite(rule.norm_p) && rule.norm_p >= 0, op, ": weight norm p = ", rule.norm_p, " (0 = none, else > 0)");
  MOE_CHECK(std::isfinite(rule.factor), op, ": weight factor = ", rule.factor);
}

// The (T,K) slot tensors of the permutation ops: K = slots / T.
int64_t slots_per_token(int64_t slots, int64_t T, const char* op) {
  MOE_CHECK(T > 0 && slots % T == 0, op, ": ", slots, " slots for ", T, " tokens");
  return slots / T;
}
}  // namespace

RoutingDims check_router_scores(const Tensor& logits, ScoreKind kind, double eps, const Tensor& scores, const char* op) {
  check_kind(kind, eps, op);
  const RoutingDims d = matrix(logits, op);
  check_same_shape(logits, scores, op);
  return d;
}

RoutingDims check_router_scores_bwd(const Tensor& dscores, const Tensor& scores, ScoreKind kind, double eps,
                                    const Tensor& dlogits) {
  const char* op = "router_scores_bwd";
  check_kind(kind, eps, op);
  const RoutingDims d = matrix(scores, op);
  check_same_shape(dscores, scores, op);
  check_same_shape(dlogits, scores, op);
  return d;
}

RoutingDims check_router_topk(const Tensor& scores, const Tensor& bias, int64_t n_group, int64_t topk_group,
                              const Tensor& expert_idx) {
  RoutingDims d = matrix(scores, "router_topk scores");
  d.K = expert_idx.ndim == 2 ? expert_idx.shape[1] : -1;
  check_shape(expert_idx, {d.T, d.K}, "router_topk expert_idx");
  MOE_CHECK(d.K >= 1 && d.K <= d.E, "router_topk: K=", d.K, " outside [1, E=", d.E, "]");
  if (!bias.empty()) check_shape(bias, {d.E}, "router_topk bias");
  if (n_group == 0) {
    MOE_CHECK(topk_group == 0, "router_topk: topk_group = ", topk_group, " without groups");
  } else {
    MOE_CHECK(n_group >= 1 && d.E % n_group == 0, "router_topk: ", n_group, " groups do not divide ", d.E, " experts");
    MOE_CHECK(topk_group >= 1 && topk_group <= n_group, "router_topk: topk_group = ", topk_group, " outside [1, ",
              n_group, "]");
    MOE_CHECK(d.K <= topk_group * (d.E / n_group), "router_topk: K=", d.K, " exceeds the ", topk_group * (d.E / n_group),
              " experts of ", topk_group, " groups");
  }
  return d;
}

RoutingDims check_router_assign(RouterAssignment kind, int num_experts, const Tensor& expert_idx) {
  MOE_CHECK(kind == RouterAssignment::kUniform || kind == RouterAssignment::kRandom, "router_assign: kind ",
            static_cast<int>(kind), " (0 uniform, 1 random)");
  MOE_CHECK(expert_idx.ndim == 2, "router_assign expert_idx: expected (T,K), got ", expert_idx.shape_str());
  const RoutingDims d{expert_idx.shape[0], num_experts, expert_idx.shape[1]};
  MOE_CHECK(d.K >= 1 && d.K <= d.E, "router_assign: K=", d.K, " outside [1, E=", d.E, "]");
  return d;
}

RoutingDims check_router_gather(const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule,
                                const Tensor& weights) {
  check_rule(rule, "router_gather");
  RoutingDims d = matrix(scores, "router_gather scores");
  d.K = expert_idx.ndim == 2 ? expert_idx.shape[1] : -1;
  check_shape(expert_idx, {d.T, d.K}, "router_gather expert_idx");
  check_shape(weights, {d.T, d.K}, "router_gather weights");
  return d;
}

RoutingDims check_router_gather_bwd(const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                                    const ExpertWeightRule& rule, const Tensor& dscores) {
  check_rule(rule, "router_gather_bwd");
  RoutingDims d = matrix(scores, "router_gather_bwd scores");
  d.K = expert_idx.ndim == 2 ? expert_idx.shape[1] : -1;
  check_shape(expert_idx, {d.T, d.K}, "router_gather_bwd expert_idx");
  check_shape(dweights, {d.T, d.K}, "router_gather_bwd dweights");
  check_same_shape(dscores, scores, "router_gather_bwd dscores");
  return d;
}

int64_t check_router_bias_update(const Tensor& step_counts, const Tensor& bias) {
  const int64_t E = step_counts.numel();
  check_shape(bias, {E}, "router_bias_update bias");
  return E;
}

void check_add_counts(const Tensor& counts, const Tensor& total) { check_same_shape(counts, total, "add_counts"); }

void check_expert_counts(const Tensor& expert_idx, const Tensor& counts) {
  MOE_CHECK(expert_idx.ndim == 2, "expert_counts: expert_idx must be (T,K), got ", expert_idx.shape_str());
  MOE_CHECK(counts.ndim == 1 && counts.numel() >= 1, "expert_counts: counts must be (E), got ", counts.shape_str());
  check_dtype(expert_idx, DType::kI32, "expert_counts expert_idx");
  check_dtype(counts, DType::kI32, "expert_counts counts");
}

RoutingDims check_moe_plan(const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets,
                           const Tensor& sorted_slot, const Tensor& slot_pos) {
  const int64_t R = expert_idx.numel(), E = counts.numel();
  MOE_CHECK(E >= 1, "moe_plan: no experts");
  check_shape(offsets, {E + 1}, "moe_plan offsets");
  check_shape(sorted_slot, {R}, "moe_plan sorted_slot");
  check_shape(slot_pos, {R}, "moe_plan slot_pos");
  const int64_t K = expert_idx.ndim == 2 ? expert_idx.shape[1] : 1;
  return {R / K, E, K};
}

void check_expert_ids(const int32_t* ids, int64_t R, int64_t E, const char* op) {
  for (int64_t r = 0; r < R; ++r)
    MOE_CHECK(ids[r] >= 0 && ids[r] < E, op, ": expert id ", ids[r], " out of range [0,", E, ")");
}

PermuteDims check_moe_gather(const Tensor& x, const Tensor& sorted_slot, const Tensor& xs) {
  MOE_CHECK(x.ndim == 2, "moe_gather x: expected (T,D), got ", x.shape_str());
  const int64_t T = x.shape[0], D = x.shape[1], R = sorted_slot.numel();
  const int64_t K = slots_per_token(R, T, "moe_gather");
  check_shape(xs, {R, D}, "moe_gather xs");
  MOE_CHECK(xs.dtype == x.dtype, "moe_gather: dtypes differ");
  return {T, D, K};
}

PermuteDims check_moe_gather_bwd(const Tensor& dxs, const Tensor& slot_pos, const Tensor& dx) {
  MOE_CHECK(dx.ndim == 2, "moe_gather_bwd dx: expected (T,D), got ", dx.shape_str());
  const int64_t T = dx.shape[0], D = dx.shape[1];
  const int64_t K = slots_per_token(slot_pos.numel(), T, "moe_gather_bwd");
  MOE_CHECK(dxs.ndim == 2 && dxs.shape[1] == D && dxs.shape[0] >= T * K, "moe_gather_bwd dxs: ", dxs.shape_str(),
            " holds fewer than ", T * K, " rows of ", D);
  return {T, D, K};
}

PermuteDims check_moe_combine(const Tensor& ys, const Tensor& slot_pos, const Tensor& weights, const Tensor& out) {
  MOE_CHECK(out.ndim == 2 && weights.ndim == 2, "moe_combine: out ", out.shape_str(), " and weights ",
            weights.shape_str(), " must be matrices");
  const int64_t T = out.shape[0], D = out.shape[1], K = weights.shape[1];
  check_shape(weights, {T, K}, "moe_combine weights");
  check_shape(slot_pos, {T * K}, "moe_combine slot_pos");
  MOE_CHECK(ys.ndim == 2 && ys.shape[1] == D && ys.shape[0] >= T * K, "moe_combine ys: ", ys.shape_str(),
            " holds fewer than ", T * K, " rows of ", D);
  return {T, D, K};
}

PermuteDims check_moe_combine_bwd(const Tensor& dout, const Tensor& ys, const Tensor& slot_pos, const Tensor& weights,
                                  const Tensor& dys, const Tensor& dweights) {
  const PermuteDims d = check_moe_combine(ys, slot_pos, weights, dout);
  check_shape(dweights, {d.T, d.K}, "moe_combine_bwd dweights");
  MOE_CHECK(dys.ndim == 2 && dys.shape[1] == d.D && dys.shape[0] >= d.T * d.K, "moe_combine_bwd dys: ",
            dys.shape_str(), " holds fewer than ", d.T * d.K, " rows of ", d.D);
  return d;
}

RoutingDims check_load_balance_loss(const Tensor& scores, const Tensor& counts, ScoreKind kind, int top_k, const Tensor& out,
                                    const Tensor& dscores, const Tensor& mean_prob) {
  check_kind(kind, 0, "load_balance_loss");
  RoutingDims d = matrix(scores, "load_balance_loss scores");
  d.K = top_k;
  MOE_CHECK(d.T > 0, "load_balance_loss: no tokens");
  MOE_CHECK(top_k >= 1 && top_k <= d.E, "load_balance_loss: top_k = ", top_k, " outside [1, E=", d.E, "]");
  check_shape(counts, {d.E}, "load_balance_loss counts");
  check_shape(mean_prob, {d.E}, "load_balance_loss mean_prob");
  MOE_CHECK(out.numel() >= 1, "load_balance_loss: out holds no value");
  if (!dscores.empty()) check_same_shape(dscores, scores, "load_balance_loss dscores");
  return d;
}

RoutingDims check_router_z_loss(const Tensor& logits, const Tensor& out, const Tensor& dlogits) {
  const RoutingDims d = matrix(logits, "router_z_loss logits");
  MOE_CHECK(d.T > 0, "router_z_loss: no tokens");
  MOE_CHECK(out.numel() >= 1, "router_z_loss: out holds no value");
  if (!dlogits.empty()) check_same_shape(dlogits, logits, "router_z_loss dlogits");
  return d;
}

}  // namespace moe
