// Reference MoE routing kernels: router scores, top-k, permutation plan, gather/combine and the
// auxiliary losses, as plain loops in the tensors' precision (f32 or f64).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "kernels/dtype_dispatch.h"
#include "kernels/expert_weights.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {
namespace {


// Indices of the K largest values of sel[0..E), descending, ties to the lower index.
void topk_row(const double* sel, int64_t E, int64_t K, int32_t* out) {
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sel[a] > sel[b]; });
  for (int64_t j = 0; j < K; ++j) out[j] = order[static_cast<size_t>(j)];
}

}  // namespace

void router_scores_fwd(const Tensor& logits, int kind, double eps, const Tensor& scores) {
  check_router_scores(logits, kind, eps, scores, "router_scores_fwd");
  dispatch_real(logits.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* z = logits.as<T>();
    T* s = scores.as<T>();
    const int64_t N = logits.rows(), E = logits.cols();
    for (int64_t t = 0; t < N; ++t) {
      const T* zr = z + t * E;
      T* sr = s + t * E;
      if (kind == 1) {
        for (int64_t e = 0; e < E; ++e) sr[e] = T(1) / (T(1) + std::exp(-zr[e])) + static_cast<T>(eps);
        continue;
      }
      T mx = zr[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, zr[e]);
      T sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (sr[e] = std::exp(zr[e] - mx));
      for (int64_t e = 0; e < E; ++e) sr[e] /= sum;
    }
  });
}

void router_scores_bwd(const Tensor& dscores, const Tensor& scores, int kind, double eps, const Tensor& dlogits) {
  check_router_scores_bwd(dscores, scores, kind, eps, dlogits);
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* ds = dscores.as<T>();
    const T* s = scores.as<T>();
    T* dz = dlogits.as<T>();
    const int64_t N = scores.rows(), E = scores.cols();
    for (int64_t t = 0; t < N; ++t) {
      const T* dr = ds + t * E;
      const T* sr = s + t * E;
      T* zr = dz + t * E;
      if (kind == 1) {
        for (int64_t e = 0; e < E; ++e) {
          const T sig = sr[e] - static_cast<T>(eps);
          zr[e] += dr[e] * sig * (T(1) - sig);
        }
        continue;
      }
      T dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += dr[e] * sr[e];
      for (int64_t e = 0; e < E; ++e) zr[e] += sr[e] * (dr[e] - dot);
    }
  });
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
        const int64_t per = E / n_group;
        for (int64_t e = 0; e < E; ++e)
          if (!(allowed[static_cast<size_t>(e / per / 32)] & (1u << ((e / per) & 31))))
            sel[static_cast<size_t>(e)] = -std::numeric_limits<double>::infinity();
      }
      topk_row(sel.data(), E, K, expert_idx.as<int32_t>() + t * K);
    }
  });
}

void router_assign(int kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
                   const Tensor& expert_idx) {
  const RoutingDims dims = check_router_assign(kind, num_experts, expert_idx);
  const int64_t N = dims.T, E = dims.E, K = dims.K;
  int32_t* idx = expert_idx.as<int32_t>();
  std::vector<double> draw(static_cast<size_t>(E));
  for (int64_t t = 0; t < N; ++t) {
    const uint64_t g = static_cast<uint64_t>(token_base + t);
    if (kind == 0) {
      for (int64_t j = 0; j < K; ++j)
        idx[t * K + j] = static_cast<int32_t>((g * static_cast<uint64_t>(K) + static_cast<uint64_t>(j)) % static_cast<uint64_t>(E));
      continue;
    }
    for (int64_t e = 0; e < E; ++e)
      draw[static_cast<size_t>(e)] = random_uniform(seed, stream, g * static_cast<uint64_t>(E) + static_cast<uint64_t>(e));
    topk_row(draw.data(), E, K, idx + t * K);
  }
}

void router_gather(const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule, const Tensor& weights) {
  const RoutingDims dims = check_router_gather(scores, expert_idx, rule, weights);
  const int64_t N = dims.T, E = dims.E, K = dims.K;
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.as<T>();
    const int32_t* idx = expert_idx.as<int32_t>();
    T* w = weights.as<T>();
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t j = 0; j < K; ++j) w[t * K + j] = s[t * E + idx[t * K + j]];
      T c = static_cast<T>(rule.factor);
      if (rule.norm_p > 0) c /= topk_norm(w + t * K, K, rule.norm_p);
      for (int64_t j = 0; j < K; ++j) w[t * K + j] *= c;
    }
  });
}

void router_gather_bwd(const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                       const ExpertWeightRule& rule, const Tensor& dscores) {
  const RoutingDims dims = check_router_gather_bwd(dweights, scores, expert_idx, rule, dscores);
  const int64_t N = dims.T, E = dims.E, K = dims.K;
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.as<T>();
    const T* dw = dweights.as<T>();
    const int32_t* idx = expert_idx.as<int32_t>();
    T* ds = dscores.as<T>();
    std::vector<T> sel(static_cast<size_t>(K));
    const T c = static_cast<T>(rule.factor);
    for (int64_t t = 0; t < N; ++t) {
      if (rule.norm_p <= 0) {
        for (int64_t j = 0; j < K; ++j) ds[t * E + idx[t * K + j]] += c * dw[t * K + j];
        continue;
      }
      // w_j = c s_j / N, N = (sum_i s_i^p)^(1/p): ds_j = c (dw_j - (sum_i dw_i s_i / N) (s_j / N)^(p-1)) / N.
      for (int64_t j = 0; j < K; ++j) sel[static_cast<size_t>(j)] = s[t * E + idx[t * K + j]];
      const T n = topk_norm(sel.data(), K, rule.norm_p);
      T dot = 0;
      for (int64_t j = 0; j < K; ++j) dot += dw[t * K + j] * sel[static_cast<size_t>(j)] / n;
      for (int64_t j = 0; j < K; ++j)
        ds[t * E + idx[t * K + j]] +=
            c * (dw[t * K + j] - dot * norm_power(sel[static_cast<size_t>(j)] / n, rule.norm_p - 1)) / n;
    }
  });
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
  for (int64_t e = 0; e < E; ++e) c[e] = 0;
  for (int64_t r = 0; r < R; ++r) {
    MOE_CHECK(idx[r] >= 0 && idx[r] < E, "expert_counts: expert id ", idx[r], " out of range [0,", E, ")");
    ++c[idx[r]];
  }
}

void moe_plan(const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets,
              const Tensor& sorted_slot, const Tensor& slot_pos) {
  check_moe_plan(expert_idx, counts, offsets, sorted_slot, slot_pos);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  const int32_t* idx = expert_idx.as<int32_t>();
  int32_t* c = counts.as<int32_t>();
  int32_t* off = offsets.as<int32_t>();
  for (int64_t e = 0; e < E; ++e) c[e] = 0;
  for (int64_t r = 0; r < R; ++r) {
    MOE_CHECK(idx[r] >= 0 && idx[r] < E, "moe_plan: expert id ", idx[r], " out of range [0,", E, ")");
    ++c[idx[r]];
  }
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
  // ys may be stored in bf16 (bf16 mode's saved expert outputs); gradients stay in F.
  auto run = [&](auto zero, auto ys_zero) {
    using F = decltype(zero);
    using Y = decltype(ys_zero);
    const F* g = dout.as<F>();
    const Y* y = ys.as<Y>();
    const F* w = weights.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
    F* dy = dys.as<F>();
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
  };
  if (ys.dtype == DType::kBF16) {
    check_dtype(dout, DType::kF32, "moe_combine_bwd dout");
    run(float{}, bf16{});
  } else {
    dispatch_real(dout.dtype, __func__, [&](auto zero) { run(zero, zero); });
  }
}

void load_balance_loss(const Tensor& scores, const Tensor& counts, int kind, int top_k,
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
    std::vector<F> f(static_cast<size_t>(E)), p(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      f[static_cast<size_t>(e)] = static_cast<F>(c[e]) / static_cast<F>(top_k * T);
      P[e] = 0;
    }
    for (int64_t t = 0; t < T; ++t) {
      F norm = 1;
      if (kind == 1) {
        norm = 0;
        for (int64_t e = 0; e < E; ++e) norm += s[t * E + e];
      }
      for (int64_t e = 0; e < E; ++e) P[e] += s[t * E + e] / norm;
    }
    F loss = 0;
    for (int64_t e = 0; e < E; ++e) {
      P[e] /= static_cast<F>(T);
      loss += f[static_cast<size_t>(e)] * P[e];
    }
    out.as<double>()[0] += value_scale * static_cast<double>(static_cast<F>(E) * loss);
    if (!ds) return;
    // d loss / d p_te = E f_e / T; for sigmoid p = s / sum(s): ds_j = (g_j - sum_i g_i p_i) / sum(s).
    const F gscale = static_cast<F>(grad_scale) * static_cast<F>(E) / static_cast<F>(T);
    for (int64_t t = 0; t < T; ++t) {
      if (kind == 0) {
        for (int64_t e = 0; e < E; ++e) ds[t * E + e] += gscale * f[static_cast<size_t>(e)];
        continue;
      }
      F norm = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) norm += s[t * E + e];
      for (int64_t e = 0; e < E; ++e) dot += f[static_cast<size_t>(e)] * s[t * E + e] / norm;
      for (int64_t e = 0; e < E; ++e) ds[t * E + e] += gscale * (f[static_cast<size_t>(e)] - dot) / norm;
    }
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
      F mx = z[t * E];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, z[t * E + e]);
      F sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(z[t * E + e] - mx);
      F lse = mx + std::log(sum);
      total += lse * lse;
      if (!dz) continue;
      const F g = static_cast<F>(grad_scale) * F(2) * lse / static_cast<F>(T);
      for (int64_t e = 0; e < E; ++e) dz[t * E + e] += g * std::exp(z[t * E + e] - lse);
    }
    out.as<double>()[0] += value_scale * static_cast<double>(total / static_cast<F>(T));
  });
}

}  // namespace moe::ref
