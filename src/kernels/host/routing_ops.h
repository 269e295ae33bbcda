// The per-token routing ops of the host backends, written once over a backend's loop of rows:
// ref runs the rows in order (SerialRows), cpu splits them over OpenMP threads (cpu's
// ParallelRows). The checks are the contract's (kernels/checks/routing_checks.h) and a row's
// arithmetic is kernels/math/routing_rows.h, so the two give the same bits whatever the thread
// count (the cpu backend's score rows are its own, vectorized: see routing_rows.h). Internal
// linkage, as routing_rows.h: each backend compiles them with its own flags.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "kernels/checks/routing_checks.h"
#include "kernels/host/dtype_dispatch.h"
#include "kernels/math/routing_rows.h"

namespace moe::routing_ops {
namespace {

// Rows in order; f(t), or f(t, scratch) with `count` values of scratch reused by every row.
struct SerialRows {
  template <class F> void operator()(int64_t n, F&& f) const {
    for (int64_t t = 0; t < n; ++t) f(t);
  }
  template <class S, class F> void with_scratch(int64_t n, int64_t count, F&& f) const {
    std::vector<S> scratch(static_cast<size_t>(count));
    for (int64_t t = 0; t < n; ++t) f(t, scratch.data());
  }
};

// A token's scores and their backward, as the reference computes them (routing_rows.h, in
// order); the cpu backend passes its own vectorized rows (cpu/moe_routing.cpp).
struct RefScoreRows {
  template <class T> static void fwd(const T* zr, int64_t E, ScoreKind kind, double eps, T* sr) {
    if (kind == ScoreKind::kSigmoid) return routing_rows::sigmoid_scores(zr, E, eps, sr);
    const T sum = routing_rows::softmax_numerators(zr, E, sr);
    for (int64_t e = 0; e < E; ++e) sr[e] /= sum;
  }
  template <class T> static void bwd(const T* dr, const T* sr, ScoreKind kind, double eps, int64_t E, T* dzr) {
    routing_rows::scores_bwd(dr, sr, kind, eps, E, dzr);
  }
};

// router_scores_fwd, row by row through ScoreRows::fwd.
template <class Rows, class ScoreRows>
void scores_fwd(const Tensor& logits, ScoreKind kind, double eps, const Tensor& scores, Rows rows, ScoreRows) {
  const RoutingDims d = check_router_scores(logits, kind, eps, scores, "router_scores_fwd");
  dispatch_real(logits.dtype, "router_scores_fwd", [&](auto zero) {
    using T = decltype(zero);
    const T* z = logits.as<T>();
    T* s = scores.as<T>();
    rows(d.T, [&](int64_t t) { ScoreRows::fwd(z + t * d.E, d.E, kind, eps, s + t * d.E); });
  });
}

// router_scores_bwd, row by row through ScoreRows::bwd.
template <class Rows, class ScoreRows>
void scores_bwd(const Tensor& dscores, const Tensor& scores, ScoreKind kind, double eps, const Tensor& dlogits, Rows rows,
                ScoreRows) {
  const RoutingDims d = check_router_scores_bwd(dscores, scores, kind, eps, dlogits);
  dispatch_real(scores.dtype, "router_scores_bwd", [&](auto zero) {
    using T = decltype(zero);
    const T* ds = dscores.as<T>();
    const T* s = scores.as<T>();
    T* dz = dlogits.as<T>();
    rows(d.T, [&](int64_t t) { ScoreRows::bwd(ds + t * d.E, s + t * d.E, kind, eps, d.E, dz + t * d.E); });
  });
}

// router_assign; topk(draws, E, K, out) picks a token's experts from its random draws.
template <class Rows, class TopK>
void assign(RouterAssignment kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
            const Tensor& expert_idx, Rows rows, TopK topk) {
  const RoutingDims d = check_router_assign(kind, num_experts, expert_idx);
  int32_t* idx = expert_idx.as<int32_t>();
  rows.template with_scratch<double>(d.T, d.E, [&](int64_t t, double* draw) {
    const uint64_t g = static_cast<uint64_t>(token_base + t);
    if (kind == RouterAssignment::kUniform) return routing_rows::uniform_experts(g, d.K, d.E, idx + t * d.K);
    routing_rows::expert_draws(seed, stream, g, d.E, draw);
    topk(draw, d.E, d.K, idx + t * d.K);
  });
}

template <class Rows>
void gather(const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule, const Tensor& weights,
            Rows rows) {
  const RoutingDims d = check_router_gather(scores, expert_idx, rule, weights);
  dispatch_real(scores.dtype, "router_gather", [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.as<T>();
    const int32_t* idx = expert_idx.as<int32_t>();
    T* w = weights.as<T>();
    rows(d.T, [&](int64_t t) { routing_rows::expert_weights(s + t * d.E, idx + t * d.K, d.K, rule, w + t * d.K); });
  });
}

template <class Rows>
void gather_bwd(const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule,
                const Tensor& dscores, Rows rows) {
  const RoutingDims d = check_router_gather_bwd(dweights, scores, expert_idx, rule, dscores);
  dispatch_real(scores.dtype, "router_gather_bwd", [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.as<T>();
    const T* dw = dweights.as<T>();
    const int32_t* idx = expert_idx.as<int32_t>();
    T* ds = dscores.as<T>();
    rows.template with_scratch<T>(d.T, d.K, [&](int64_t t, T* sel) {
      routing_rows::expert_weights_bwd(dw + t * d.K, s + t * d.E, idx + t * d.K, d.K, rule, sel, ds + t * d.E);
    });
  });
}

}  // namespace
}  // namespace moe::routing_ops
