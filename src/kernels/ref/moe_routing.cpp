// Reference MoE routing kernels: router scores, top-k, permutation plan, gather/combine and the
// auxiliary losses, as plain loops in the tensors' precision (f32 or f64).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/checks/routing_checks.h"
#include "kernels/host/dtype_dispatch.h"
#include "kernels/host/routing_ops.h"
#include "kernels/math/routing_rows.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/ref/rounded_output.h"

namespace moe::ref {
namespace rows = routing_rows;
namespace {

// Indices of the K largest values of sel[0..E), descending, ties to the lower index.
void topk_row(const double* sel, int64_t E, int64_t K, int32_t* out) {
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sel[a] > sel[b]; });
  for (int64_t j = 0; j < K; ++j) out[j] = order[static_cast<size_t>(j)];
}

}  // namespace

void router_scores_fwd(const Tensor& logits, ScoreKind kind, double eps, const Tensor& scores) {
  routing_ops::scores_fwd(logits, kind, eps, scores, routing_ops::SerialRows{}, routing_ops::RefScoreRows{});
}

void router_scores_bwd(const Tensor& dscores, const Tensor& scores, ScoreKind kind, double eps, const Tensor& dlogits) {
  routing_ops::scores_bwd(dscores, scores, kind, eps, dlogits, routing_ops::SerialRows{}, routing_ops::RefScoreRows{});
}

void router_topk(const Tensor& scores, const Tensor& bias, int64_t n_group, int64_t topk_group, const Tensor& expert_idx) {
  const RoutingDims dims = check_router_topk(scores, bias, n_group, topk_group, expert_idx);
  const int64_t N = dims.T, E = dims.E, K = dims.K;
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.as<T>();
    const T* b = bias.empty() ? nullptr : bias.as<T>();
    std::vector<double> sel(static_cast<size_t>(E));
    std::vector<uint32_t> allowed(static_cast<size_t>((n_group + 31) / 32));
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t e = 0; e < E; ++e)
        sel[static_cast<size_t>(e)] = static_cast<double>(s[t * E + e] + (b ? b[e] : T(0)));
      if (n_group > 0) {  // experts outside the chosen groups cannot be chosen
        const T* row = s + t * E;
        allowed_groups([&](int64_t e) { return row[e] + (b ? b[e] : T(0)); }, E, n_group, topk_group, allowed.data());
        rows::mask_outside_groups(allowed.data(), E, n_group, sel.data());
      }
      topk_row(sel.data(), E, K, expert_idx.as<int32_t>() + t * K);
    }
  });
}

void router_assign(RouterAssignment kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
                   const Tensor& expert_idx) {
  routing_ops::assign(kind, seed, stream, token_base, num_experts, expert_idx, routing_ops::SerialRows{}, topk_row);
}

void router_gather(const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule, const Tensor& weights) {
  routing_ops::gather(scores, expert_idx, rule, weights, routing_ops::SerialRows{});
}

void router_gather_bwd(const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                       const ExpertWeightRule& rule, const Tensor& dscores) {
  routing_ops::gather_bwd(dweights, scores, expert_idx, rule, dscores, routing_ops::SerialRows{});
}

void router_bias_update(const Tensor& step_counts, double gamma, const Tensor& bias) {
  const int64_t E = check_router_bias_update(step_counts, bias);
  const int32_t* c = step_counts.as<int32_t>();
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += c[e];
  mean /= static_cast<double>(E);
  dispatch_real(bias.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    T* b = bias.as<T>();
    for (int64_t e = 0; e < E; ++e) {
      double d = mean - c[e];
      b[e] += static_cast<T>(gamma * static_cast<double>((d > 0) - (d < 0)));
    }
  });
}

void add_counts(const Tensor& counts, const Tensor& total) {
  check_add_counts(counts, total);
  for (int64_t e = 0; e < counts.numel(); ++e) total.as<int32_t>()[e] += counts.as<int32_t>()[e];
}

void expert_counts(const Tensor& expert_idx, const Tensor& counts) {
  check_expert_counts(expert_idx, counts);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  const int32_t* idx = expert_idx.as<int32_t>();
  int32_t* c = counts.as<int32_t>();
  check_expert_ids(idx, R, E, "expert_counts");
  for (int64_t e = 0; e < E; ++e) c[e] = 0;
  for (int64_t r = 0; r < R; ++r) ++c[idx[r]];
}

void moe_plan(const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets,
              const Tensor& sorted_slot, const Tensor& slot_pos) {
  check_moe_plan(expert_idx, counts, offsets, sorted_slot, slot_pos);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  const int32_t* idx = expert_idx.as<int32_t>();
  int32_t* c = counts.as<int32_t>();
  int32_t* off = offsets.as<int32_t>();
  check_expert_ids(idx, R, E, "moe_plan");
  for (int64_t e = 0; e < E; ++e) c[e] = 0;
  for (int64_t r = 0; r < R; ++r) ++c[idx[r]];
  off[0] = 0;
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + c[e];
  std::vector<int32_t> fill(off, off + E);
  for (int64_t r = 0; r < R; ++r) {
    int32_t p = fill[static_cast<size_t>(idx[r])]++;
    sorted_slot.as<int32_t>()[p] = static_cast<int32_t>(r);
    slot_pos.as<int32_t>()[r] = p;
  }
}

void moe_gather(const Tensor& x, const Tensor& sorted_slot, const Tensor& xs) {
  const PermuteDims dims = check_moe_gather(x, sorted_slot, xs);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  const int64_t R = T * K;
  const size_t row = static_cast<size_t>(D) * dtype_size(x.dtype);
  for (int64_t p = 0; p < R; ++p) {
    int64_t t = sorted_slot.as<int32_t>()[p] / K;
    std::copy_n(static_cast<const char*>(x.data) + t * row, row, static_cast<char*>(xs.data) + p * row);
  }
}

void moe_gather_bwd(const Tensor& dxs, const Tensor& slot_pos, const Tensor& dx) {
  const PermuteDims dims = check_moe_gather_bwd(dxs, slot_pos, dx);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  dispatch_real(dx.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* g = dxs.as<F>();
    F* out = dx.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j)
        for (int64_t d = 0; d < D; ++d) out[t * D + d] += g[pos[t * K + j] * D + d];
  });
}

void moe_combine(const Tensor& ys, const Tensor& slot_pos, const Tensor& weights, const Tensor& out,
                 bool accumulate) {
  const PermuteDims dims = check_moe_combine(ys, slot_pos, weights, out);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  dispatch_real(out.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* y = ys.as<F>();
    const F* w = weights.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
    F* o = out.as<F>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        F acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += w[t * K + j] * y[pos[t * K + j] * D + d];
        o[t * D + d] = accumulate ? o[t * D + d] + acc : acc;
      }
  });
}

void moe_combine_bwd(const Tensor& dout, const Tensor& ys, const Tensor& slot_pos,
                     const Tensor& weights, const Tensor& dys, const Tensor& dweights) {
  const PermuteDims dims = check_moe_combine_bwd(dout, ys, slot_pos, weights, dys, dweights);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  // ys may be stored in bf16 (bf16 mode's saved expert outputs); gradients stay in F, except dys,
  // which may be bf16 (rounded): it only feeds the experts' GEMMs.
  auto run = [&](auto zero, auto ys_zero) {
    using F = decltype(zero);
    using Y = decltype(ys_zero);
    const RoundedOutput ody(dys, dtype_of<F>(), "moe_combine_bwd dys");
    const F* g = dout.as<F>();
    const Y* y = ys.as<Y>();
    const F* w = weights.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
    F* dy = ody.work().as<F>();
    F* dw = dweights.as<F>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t p = pos[t * K + j];
        F dot = 0;
        for (int64_t d = 0; d < D; ++d) {
          dy[p * D + d] = w[t * K + j] * g[t * D + d];
          dot += g[t * D + d] * static_cast<F>(to_float(y[p * D + d]));
        }
        dw[t * K + j] = dot;
      }
    ody.finish();
  };
  if (ys.dtype == DType::kBF16) {
    check_dtype(dout, DType::kF32, "moe_combine_bwd dout");
    run(float{}, bf16{});
  } else {
    dispatch_real(dout.dtype, __func__, [&](auto zero) { run(zero, zero); });
  }
}

void load_balance_loss(const Tensor& scores, const Tensor& counts, ScoreKind kind, int top_k,
                       double value_scale, double grad_scale, const Tensor& out,
                       const Tensor& dscores, const Tensor& mean_prob) {
  const RoutingDims dims = check_load_balance_loss(scores, counts, kind, top_k, out, dscores, mean_prob);
  const int64_t T = dims.T, E = dims.E;
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* s = scores.as<F>();
    const int32_t* c = counts.as<int32_t>();
    F* ds = dscores.empty() ? nullptr : dscores.as<F>();
    F* P = mean_prob.as<F>();
    std::vector<F> f(static_cast<size_t>(E));
    rows::expert_fractions(c, E, top_k, T, f.data());
    std::fill(P, P + E, F(0));
    for (int64_t t = 0; t < T; ++t) rows::add_score_shares(s + t * E, kind, E, P);
    F loss = 0;
    for (int64_t e = 0; e < E; ++e) {
      P[e] /= static_cast<F>(T);
      loss += f[static_cast<size_t>(e)] * P[e];
    }
    out.as<double>()[0] += value_scale * static_cast<double>(static_cast<F>(E) * loss);
    if (!ds) return;
    const F gscale = static_cast<F>(grad_scale) * static_cast<F>(E) / static_cast<F>(T);
    for (int64_t t = 0; t < T; ++t) rows::load_balance_grad(s + t * E, f.data(), kind, gscale, E, ds + t * E);
  });
}

void router_z_loss(const Tensor& logits, double value_scale, double grad_scale, const Tensor& out,
                   const Tensor& dlogits) {
  const RoutingDims dims = check_router_z_loss(logits, out, dlogits);
  const int64_t T = dims.T, E = dims.E;
  dispatch_real(logits.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* z = logits.as<F>();
    F* dz = dlogits.empty() ? nullptr : dlogits.as<F>();
    F total = 0;
    for (int64_t t = 0; t < T; ++t) {
      const F lse = rows::log_sum_exp(z + t * E, E);
      total += lse * lse;
      if (dz) rows::z_loss_grad(z + t * E, lse, grad_scale, T, E, dz + t * E);
    }
    out.as<double>()[0] += value_scale * static_cast<double>(total / static_cast<F>(T));
  });
}

}  // namespace moe::ref
