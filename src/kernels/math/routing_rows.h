// One token's routing arithmetic (kernels/op_list.inc, MoE routing), the one text the ref and cpu
// kernels run per row: the reference loops over tokens in order, the cpu one in parallel, and
// both get the same bits because a row's operations and their order are written once here. The
// exceptions are the rows with an exp over all E experts (softmax / sigmoid scores, their softmax
// backward, the z-loss): the cpu backend runs vectorized versions of those (cpu/moe_routing.cpp,
// fast_exp and lane sums), which agree with these to a few ulp.
// Internal linkage: each backend compiles these with its own floating-point flags (cpu/
// moe_routing.cpp builds without contraction, CMakeLists.txt), as when each file had its copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/rng.h"
#include "kernels/math/expert_weights.h"
#include "kernels/op_types.h"

namespace moe::routing_rows {
namespace {

// sr = sigmoid(zr) + eps over the row's E logits.
template <class T> void sigmoid_scores(const T* zr, int64_t E, double eps, T* sr) {
  for (int64_t e = 0; e < E; ++e) sr[e] = T(1) / (T(1) + std::exp(-zr[e])) + static_cast<T>(eps);
}

// sr = exp(zr - max(zr)); returns their sum (the softmax before its normalization).
template <class T> T softmax_numerators(const T* zr, int64_t E, T* sr) {
  T mx = zr[0];
  for (int64_t e = 1; e < E; ++e) mx = std::max(mx, zr[e]);
  T sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (sr[e] = std::exp(zr[e] - mx));
  return sum;
}

// zr += the backward of the row's scores sr (sigmoid: from sr - eps) given their gradient dr.
template <class T> void scores_bwd(const T* dr, const T* sr, ScoreKind kind, double eps, int64_t E, T* zr) {
  if (kind == ScoreKind::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) {
      const T sig = sr[e] - static_cast<T>(eps);
      zr[e] += dr[e] * sig * (T(1) - sig);
    }
    return;
  }
  T dot = 0;
  for (int64_t e = 0; e < E; ++e) dot += dr[e] * sr[e];
  for (int64_t e = 0; e < E; ++e) zr[e] += sr[e] * (dr[e] - dot);
}

// Group-limited routing: sel[e] = -inf for every expert outside the groups `allowed` keeps.
template <class T> void mask_outside_groups(const uint32_t* allowed, int64_t E, int64_t n_group, T* sel) {
  const int64_t per = E / n_group;
  for (int64_t e = 0; e < E; ++e)
    if (!(allowed[e / per / 32] & (1u << ((e / per) & 31)))) sel[e] = -std::numeric_limits<T>::infinity();
}

// router_assign, uniform: token g takes experts (g*K + j) mod E.
inline void uniform_experts(uint64_t g, int64_t K, int64_t E, int32_t* out) {
  for (int64_t j = 0; j < K; ++j)
    out[j] = static_cast<int32_t>((g * static_cast<uint64_t>(K) + static_cast<uint64_t>(j)) % static_cast<uint64_t>(E));
}

// router_assign, random: token g's E draws, whose K largest are its experts.
inline void expert_draws(uint64_t seed, uint64_t stream, uint64_t g, int64_t E, double* draw) {
  for (int64_t e = 0; e < E; ++e)
    draw[e] = random_uniform(seed, stream, g * static_cast<uint64_t>(E) + static_cast<uint64_t>(e));
}

// router_gather: wr (K) = rule.factor * the chosen scores sr[ir[j]] / their p-norm.
template <class T> void expert_weights(const T* sr, const int32_t* ir, int64_t K, const ExpertWeightRule& rule, T* wr) {
  for (int64_t j = 0; j < K; ++j) wr[j] = sr[ir[j]];
  T c = static_cast<T>(rule.factor);
  if (rule.norm_p > 0) c /= topk_norm(wr, K, rule.norm_p);
  for (int64_t j = 0; j < K; ++j) wr[j] *= c;
}

// router_gather_bwd: dsr (E) += the backward of expert_weights given dwr (K); sel: K scratch values.
// w_j = c s_j / n, n = (sum_i s_i^p)^(1/p): ds_j = c (dw_j - (sum_i dw_i s_i / n) (s_j / n)^(p-1)) / n.
template <class T>
void expert_weights_bwd(const T* dwr, const T* sr, const int32_t* ir, int64_t K, const ExpertWeightRule& rule, T* sel,
                        T* dsr) {
  const T c = static_cast<T>(rule.factor);
  if (rule.norm_p <= 0) {
    for (int64_t j = 0; j < K; ++j) dsr[ir[j]] += c * dwr[j];
    return;
  }
  for (int64_t j = 0; j < K; ++j) sel[j] = sr[ir[j]];
  const T n = topk_norm(sel, K, rule.norm_p);
  T dot = 0;
  for (int64_t j = 0; j < K; ++j) dot += dwr[j] * sel[j] / n;
  for (int64_t j = 0; j < K; ++j) dsr[ir[j]] += c * (dwr[j] - dot * norm_power(sel[j] / n, rule.norm_p - 1)) / n;
}

// load_balance_loss: f (E) = each expert's share of the T*K choices.
template <class T> void expert_fractions(const int32_t* counts, int64_t E, int top_k, int64_t tokens, T* f) {
  for (int64_t e = 0; e < E; ++e) f[e] = static_cast<T>(counts[e]) / static_cast<T>(top_k * tokens);
}

// load_balance_loss: acc (E) += the row's scores, normalized to sum 1 when they are sigmoids.
template <class T> void add_score_shares(const T* sr, ScoreKind kind, int64_t E, T* acc) {
  // Softmax scores already sum to 1: no divide per score by it (x / 1 is x, the same bits).
  if (kind != ScoreKind::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) acc[e] += sr[e];
    return;
  }
  T norm = 0;
  for (int64_t e = 0; e < E; ++e) norm += sr[e];
  for (int64_t e = 0; e < E; ++e) acc[e] += sr[e] / norm;
}

// load_balance_loss: dsr (E) += its gradient, gscale = grad_scale * E / T. d loss / d p_te =
// E f_e / T; for sigmoid p = s / sum(s): ds_j = (g_j - sum_i g_i p_i) / sum(s).
template <class T> void load_balance_grad(const T* sr, const T* f, ScoreKind kind, T gscale, int64_t E, T* dsr) {
  if (kind == ScoreKind::kSoftmax) {
    for (int64_t e = 0; e < E; ++e) dsr[e] += gscale * f[e];
    return;
  }
  T norm = 0, dot = 0;
  for (int64_t e = 0; e < E; ++e) norm += sr[e];
  for (int64_t e = 0; e < E; ++e) dot += f[e] * sr[e] / norm;
  for (int64_t e = 0; e < E; ++e) dsr[e] += gscale * (f[e] - dot) / norm;
}

// router_z_loss: the row's log-sum-exp.
template <class T> T log_sum_exp(const T* zr, int64_t E) {
  T mx = zr[0];
  for (int64_t e = 1; e < E; ++e) mx = std::max(mx, zr[e]);
  T sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(zr[e] - mx);
  return mx + std::log(sum);
}

// router_z_loss: dzr (E) += grad_scale * d (lse^2 / tokens) / d zr.
template <class T> void z_loss_grad(const T* zr, T lse, double grad_scale, int64_t tokens, int64_t E, T* dzr) {
  const T g = static_cast<T>(grad_scale) * T(2) * lse / static_cast<T>(tokens);
  for (int64_t e = 0; e < E; ++e) dzr[e] += g * std::exp(zr[e] - lse);
}

}  // namespace
}  // namespace moe::routing_rows
