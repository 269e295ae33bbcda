// Fast MoE routing kernels: OpenMP over tokens (every output row is owned by one iteration), and
// reductions over tokens in fixed-size chunks combined in chunk order, so that results do not
// depend on the thread count. Same semantics as kernels/ref/moe_routing.cpp.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "kernels/dtype_dispatch.h"
#include "kernels/expert_weights.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe::cpu {
namespace {

constexpr int64_t kChunk = 256;  // tokens per reduction chunk (fixed: independent of threads)

// n T's of the calling thread's scratch number kSlot, kept across calls: grown in the first step,
// so later steps allocate nothing. Contents are unspecified (callers initialize what they read).
// OpenMP's pool threads persist, and with them their buffers.
template <class T, int kSlot> T* scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

template <class T> void topk_row(const T* sel, int64_t E, int64_t K, int32_t* out) {
  // K is small: repeated selection of the maximum, ties to the lower index, O(K*E).
  uint64_t taken_small = 0;
  char* taken_big = nullptr;
  if (E > 64) {
    taken_big = scratch<char, 0>(E);
    std::fill(taken_big, taken_big + E, char{0});
  }
  for (int64_t j = 0; j < K; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool used = E > 64 ? taken_big[e] != 0 : ((taken_small >> e) & 1u) != 0;
      if (!used && (best < 0 || sel[e] > sel[best])) best = e;
    }
    out[j] = static_cast<int32_t>(best);
    if (E > 64) taken_big[best] = 1;
    else taken_small |= 1ull << best;
  }
}

}  // namespace

void router_scores_fwd(const Tensor& logits, int kind, double eps, const Tensor& scores) {
  check_router_scores(logits, kind, eps, scores, "router_scores_fwd");
  dispatch_real(logits.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* z = logits.as<T>();
    T* s = scores.as<T>();
    const int64_t N = logits.rows(), E = logits.cols();
#pragma omp parallel for schedule(static)
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
      const T inv = T(1) / sum;
      for (int64_t e = 0; e < E; ++e) sr[e] *= inv;
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
#pragma omp parallel for schedule(static)
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
    int32_t* idx = expert_idx.as<int32_t>();
#pragma omp parallel
    {
      T* sel = scratch<T, 1>(E);
      uint32_t* allowed = scratch<uint32_t, 5>((n_group + 31) / 32 + 1);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < N; ++t) {
        const T* row = s + t * E;
        if (b || n_group > 0) {
          for (int64_t e = 0; e < E; ++e) sel[e] = row[e] + (b ? b[e] : T(0));
          row = sel;
        }
        if (n_group > 0) {  // experts outside the chosen groups cannot be chosen
          allowed_groups([&](int64_t e) { return sel[e]; }, E, n_group, topk_group, allowed);
          const int64_t per = E / n_group;
          for (int64_t e = 0; e < E; ++e)
            if (!(allowed[e / per / 32] & (1u << ((e / per) & 31)))) sel[e] = -std::numeric_limits<T>::infinity();
        }
        topk_row(row, E, K, idx + t * K);
      }
    }
  });
}

void router_assign(int kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
                   const Tensor& expert_idx) {
  const RoutingDims dims = check_router_assign(kind, num_experts, expert_idx);
  const int64_t N = dims.T, E = dims.E, K = dims.K;
  int32_t* idx = expert_idx.as<int32_t>();
#pragma omp parallel
  {
    double* draw = scratch<double, 2>(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      const uint64_t g = static_cast<uint64_t>(token_base + t);
      if (kind == 0) {
        for (int64_t j = 0; j < K; ++j)
          idx[t * K + j] = static_cast<int32_t>((g * static_cast<uint64_t>(K) + static_cast<uint64_t>(j)) % static_cast<uint64_t>(E));
        continue;
      }
      for (int64_t e = 0; e < E; ++e)
        draw[e] = random_uniform(seed, stream, g * static_cast<uint64_t>(E) + static_cast<uint64_t>(e));
      topk_row(draw, E, K, idx + t * K);
    }
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
#pragma omp parallel for schedule(static)
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
    const T c = static_cast<T>(rule.factor);
#pragma omp parallel
    {
      T* sel = scratch<T, 4>(K);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < N; ++t) {
        if (rule.norm_p <= 0) {
          for (int64_t j = 0; j < K; ++j) ds[t * E + idx[t * K + j]] += c * dw[t * K + j];
          continue;
        }
        // As the reference: ds_j = c (dw_j - (sum_i dw_i s_i / n) (s_j / n)^(p-1)) / n.
        for (int64_t j = 0; j < K; ++j) sel[j] = s[t * E + idx[t * K + j]];
        const T n = topk_norm(sel, K, rule.norm_p);
        T dot = 0;
        for (int64_t j = 0; j < K; ++j) dot += dw[t * K + j] * sel[j] / n;
        for (int64_t j = 0; j < K; ++j)
          ds[t * E + idx[t * K + j]] += c * (dw[t * K + j] - dot * norm_power(sel[j] / n, rule.norm_p - 1)) / n;
      }
    }
  });
}

void router_bias_update(const Tensor& step_counts, double gamma, const Tensor& bias) {
  ref::router_bias_update(step_counts, gamma, bias);  // E values, once per step: nothing to speed up
}

void add_counts(const Tensor& counts, const Tensor& total) { ref::add_counts(counts, total); }
// B small (T*K) integer loop, not hot: the reference's.
void expert_counts(const Tensor& expert_idx, const Tensor& counts) { ref::expert_counts(expert_idx, counts); }

void moe_plan(const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets,
              const Tensor& sorted_slot, const Tensor& slot_pos) {
  check_moe_plan(expert_idx, counts, offsets, sorted_slot, slot_pos);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  const int32_t* idx = expert_idx.as<int32_t>();
  // Parallel stable counting sort: per-chunk histograms, an exclusive scan in (expert, chunk)
  // order, then each chunk scatters its slots in order. The result is the unique stable order.
  const int64_t chunk = 4096, num_chunks = (R + chunk - 1) / chunk;
  const int64_t hist_len = std::max<int64_t>(num_chunks, 1) * E;
  int32_t* hist = scratch<int32_t, 3>(hist_len);
  std::fill(hist, hist + hist_len, 0);
  bool bad = false;
#pragma omp parallel for schedule(static) reduction(|| : bad)
  for (int64_t c = 0; c < num_chunks; ++c) {
    int32_t* h = hist + c * E;
    for (int64_t r = c * chunk; r < std::min(R, (c + 1) * chunk); ++r) {
      if (idx[r] < 0 || idx[r] >= E) { bad = true; continue; }
      ++h[idx[r]];
    }
  }
  MOE_CHECK(!bad, "moe_plan: expert id out of range [0,", E, ")");
  int32_t* cnt = counts.as<int32_t>();
  int32_t* off = offsets.as<int32_t>();
  int32_t running = 0;
  for (int64_t e = 0; e < E; ++e) {
    off[e] = running;
    for (int64_t c = 0; c < num_chunks; ++c) {
      int32_t n = hist[c * E + e];
      hist[c * E + e] = running;
      running += n;
    }
    cnt[e] = running - off[e];
  }
  off[E] = running;
  int32_t* sorted = sorted_slot.as<int32_t>();
  int32_t* pos = slot_pos.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < num_chunks; ++c) {
    int32_t* next = hist + c * E;
    for (int64_t r = c * chunk; r < std::min(R, (c + 1) * chunk); ++r) {
      int32_t p = next[idx[r]]++;
      sorted[p] = static_cast<int32_t>(r);
      pos[r] = p;
    }
  }
}

void moe_gather(const Tensor& x, const Tensor& sorted_slot, const Tensor& xs) {
  const PermuteDims dims = check_moe_gather(x, sorted_slot, xs);
  const int64_t D = dims.D, K = dims.K, R = dims.T * K;
  const size_t row = static_cast<size_t>(D) * dtype_size(x.dtype);
  const int32_t* sorted = sorted_slot.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < R; ++p) {
    const int64_t t = sorted[p] / K;
    std::memcpy(static_cast<char*>(xs.data) + p * row, static_cast<const char*>(x.data) + t * row, row);
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
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const F* src = g + pos[t * K + j] * D;
        F* dst = out + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
      }
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
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      F* dst = o + t * D;
      if (!accumulate)
        for (int64_t d = 0; d < D; ++d) dst[d] = 0;
      // Same order as the reference (j inner per element), so fast == ref bitwise in f32.
      for (int64_t d = 0; d < D; ++d) {
        F acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += w[t * K + j] * y[pos[t * K + j] * D + d];
        dst[d] += acc;
      }
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
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t p = pos[t * K + j];
        const F wt = w[t * K + j];
        F dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) {
          dy[p * D + d] = wt * g[t * D + d];
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
    F* f = scratch<F, 4>(E);
    for (int64_t e = 0; e < E; ++e) f[e] = static_cast<F>(c[e]) / static_cast<F>(top_k * T);
    const int64_t num_chunks = (T + kChunk - 1) / kChunk;
    F* partial = scratch<F, 5>(num_chunks * E);
    std::fill(partial, partial + num_chunks * E, F(0));
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < num_chunks; ++ch) {
      F* acc = partial + ch * E;
      for (int64_t t = ch * kChunk; t < std::min(T, (ch + 1) * kChunk); ++t) {
        F norm = 1;
        if (kind == 1) {
          norm = 0;
          for (int64_t e = 0; e < E; ++e) norm += s[t * E + e];
        }
        for (int64_t e = 0; e < E; ++e) acc[e] += s[t * E + e] / norm;
      }
    }
    F loss = 0;
    for (int64_t e = 0; e < E; ++e) {
      F sum = 0;
      for (int64_t ch = 0; ch < num_chunks; ++ch) sum += partial[ch * E + e];
      P[e] = sum / static_cast<F>(T);
      loss += f[e] * P[e];
    }
    out.as<double>()[0] += value_scale * static_cast<double>(static_cast<F>(E) * loss);
    if (!ds) return;
    const F gscale = static_cast<F>(grad_scale) * static_cast<F>(E) / static_cast<F>(T);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (kind == 0) {
        for (int64_t e = 0; e < E; ++e) ds[t * E + e] += gscale * f[e];
        continue;
      }
      F norm = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) norm += s[t * E + e];
      for (int64_t e = 0; e < E; ++e) dot += f[e] * s[t * E + e] / norm;
      for (int64_t e = 0; e < E; ++e) ds[t * E + e] += gscale * (f[e] - dot) / norm;
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
    const int64_t num_chunks = (T + kChunk - 1) / kChunk;
    double* partial = scratch<double, 6>(num_chunks);
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < num_chunks; ++ch) {
      double acc = 0;
      for (int64_t t = ch * kChunk; t < std::min(T, (ch + 1) * kChunk); ++t) {
        F mx = z[t * E];
        for (int64_t e = 1; e < E; ++e) mx = std::max(mx, z[t * E + e]);
        F sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += std::exp(z[t * E + e] - mx);
        const F lse = mx + std::log(sum);
        acc += static_cast<double>(lse) * static_cast<double>(lse);
        if (!dz) continue;
        const F g = static_cast<F>(grad_scale) * F(2) * lse / static_cast<F>(T);
        for (int64_t e = 0; e < E; ++e) dz[t * E + e] += g * std::exp(z[t * E + e] - lse);
      }
      partial[ch] = acc;
    }
    double total = 0;
    for (int64_t ch = 0; ch < num_chunks; ++ch) total += partial[ch];
    out.as<double>()[0] += value_scale * total / static_cast<double>(T);
  });
}

// A few thousand integer operations per MoE layer: the reference loop is the fast path.
void ep_plan(const Tensor& counts, int64_t rank, int64_t capacity, const Tensor& kept, const Tensor& local_begin,
             const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  ref::ep_plan(counts, rank, capacity, kept, local_begin, recv_begin, recv_offsets, totals);
}

// Whole-row memcpy per block: the reference is already the memory-bound copy.
void ep_slab_copy(const Tensor& counts, const Tensor& kept, const Tensor& local_begin, const Tensor& recv_begin,
                  int64_t rank, bool expert_side, bool to_slabs, const Tensor& rows, const Tensor& slabs) {
  ref::ep_slab_copy(counts, kept, local_begin, recv_begin, rank, expert_side, to_slabs, rows, slabs);
}

}  // namespace moe::cpu
