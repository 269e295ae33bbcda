// The kernels of the CUDA MoE routing ops (moe_routing.cu, the one file that includes this): router
// scores, top-k, random assignment (the CPU's Philox draws), expert weights, the stable
// counting-sort permutation, gather/combine and the auxiliary losses. Integer results are exact,
// so they equal the CPU's; float reductions run in an order fixed by the shape.
#pragma once

#include <cmath>

#include "core/philox.h"
#include "kernels/cuda/device.cuh"
#include "kernels/math/expert_weights.h"
#include "kernels/step_control.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowChunks = 128;
constexpr int kMaxExperts = 1024;  // moe_plan's per-warp counts live in shared memory

// ---------------------------------------------------------------- scores
// A warp's row zr of E logits: its max and sum of exp(z - max), each lane's part in index order,
// then the warp's fixed tree (softmax and the router z-loss's log-sum-exp share it).
__device__ __forceinline__ void row_max_and_exp_sum(const float* zr, int64_t E, int lane, float& mx, float& sum) {
  mx = -INFINITY;
  for (int64_t e = lane; e < E; e += 32) mx = fmaxf(mx, zr[e]);
  mx = warp_max(mx);
  sum = 0;
  for (int64_t e = lane; e < E; e += 32) sum = __fadd_rn(sum, expf(__fsub_rn(zr[e], mx)));
  sum = warp_sum(sum);
}

__global__ void router_scores_fwd_kernel(const float* z, int kind, float eps, float* s, int64_t n, int64_t E) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(t, n) {
    const float* zr = z + t * E;
    float* sr = s + t * E;
    if (kind == 1) {
      for (int64_t e = lane; e < E; e += 32) sr[e] = __fadd_rn(__fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-zr[e]))), eps);
      continue;
    }
    float mx, sum;
    row_max_and_exp_sum(zr, E, lane, mx, sum);
    for (int64_t e = lane; e < E; e += 32) sr[e] = __fdiv_rn(expf(__fsub_rn(zr[e], mx)), sum);
  }
}

__global__ void router_scores_bwd_kernel(const float* ds, const float* s, int kind, float eps, float* dz, int64_t n,
                                         int64_t E) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(t, n) {
    const float* dr = ds + t * E;
    const float* sr = s + t * E;
    float* zr = dz + t * E;
    if (kind == 1) {
      for (int64_t e = lane; e < E; e += 32) {
        const float sig = __fsub_rn(sr[e], eps);
        zr[e] = __fadd_rn(zr[e], __fmul_rn(__fmul_rn(dr[e], sig), __fsub_rn(1.0f, sig)));
      }
      continue;
    }
    float dot = 0;
    for (int64_t e = lane; e < E; e += 32) dot = __fadd_rn(dot, __fmul_rn(dr[e], sr[e]));
    dot = warp_sum(dot);
    for (int64_t e = lane; e < E; e += 32) zr[e] = __fadd_rn(zr[e], __fmul_rn(sr[e], __fsub_rn(dr[e], dot)));
  }
}

// ---------------------------------------------------------------- top-k and assignment
// The K largest of value(e), descending, ties to the lower expert: K passes of a first-maximum scan.
template <class Value> __device__ void topk_scan(Value value, int64_t E, int64_t K, int32_t* out) {
  uint32_t taken[kMaxExperts / 32] = {};
  for (int64_t j = 0; j < K; ++j) {
    int64_t best = -1;
    double best_v = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (taken[e >> 5] & (1u << (e & 31))) continue;
      const double v = value(e);
      if (best < 0 || v > best_v) {
        best = e;
        best_v = v;
      }
    }
    taken[best >> 5] |= 1u << (best & 31);
    out[j] = static_cast<int32_t>(best);
  }
}

__global__ void router_topk_kernel(const float* s, const float* bias, int64_t n_group, int64_t topk_group, int32_t* idx,
                                   int64_t n, int64_t E, int64_t K) {
  MOE_GRID_LOOP(t, n) {
    const float* sr = s + t * E;
    auto sel = [&](int64_t e) { return bias ? __fadd_rn(sr[e], bias[e]) : sr[e]; };
    if (n_group == 0) {
      topk_scan([&](int64_t e) { return static_cast<double>(sel(e)); }, E, K, idx + t * K);
      continue;
    }
    uint32_t allowed[kMaxExperts / 32];
    allowed_groups(sel, E, n_group, topk_group, allowed);
    const int64_t per = E / n_group;
    topk_scan(
        [&](int64_t e) {
          const int64_t g = e / per;
          return (allowed[g >> 5] & (1u << (g & 31))) ? static_cast<double>(sel(e)) : -INFINITY;
        },
        E, K, idx + t * K);
  }
}

__global__ void router_assign_kernel(int kind, uint64_t seed, uint64_t stream, int64_t token_base, int64_t E, int32_t* idx,
                                     int64_t n, int64_t K) {
  MOE_GRID_LOOP(t, n) {
    const uint64_t g = static_cast<uint64_t>(token_base + t);
    if (kind == 0) {
      for (int64_t j = 0; j < K; ++j)
        idx[t * K + j] = static_cast<int32_t>((g * static_cast<uint64_t>(K) + static_cast<uint64_t>(j)) % static_cast<uint64_t>(E));
      continue;
    }
    topk_scan([&](int64_t e) { return philox::random_uniform(seed, stream, g * static_cast<uint64_t>(E) + static_cast<uint64_t>(e)); },
              E, K, idx + t * K);
  }
}

// ||v||_p over a token's K chosen scores, in the order and rounding of kernels/math/expert_weights.h.
__device__ float topk_norm_rn(const float* v, int64_t stride, int64_t K, double p) {
  float acc = 0;
  if (p == 1) {
    for (int64_t j = 0; j < K; ++j) acc = __fadd_rn(acc, v[j * stride]);
    return acc;
  }
  if (p == 2) {
    for (int64_t j = 0; j < K; ++j) acc = __fadd_rn(acc, __fmul_rn(v[j * stride], v[j * stride]));
    return static_cast<float>(sqrt(static_cast<double>(acc)));
  }
  for (int64_t j = 0; j < K; ++j) acc = __fadd_rn(acc, norm_power(v[j * stride], p));
  return static_cast<float>(pow(static_cast<double>(acc), 1.0 / p));
}

__global__ void router_gather_kernel(const float* s, const int32_t* idx, double norm_p, double factor, float* w, int64_t n,
                                     int64_t E, int64_t K) {
  MOE_GRID_LOOP(t, n) {
    float* wr = w + t * K;
    for (int64_t j = 0; j < K; ++j) wr[j] = s[t * E + idx[t * K + j]];
    float c = static_cast<float>(factor);
    if (norm_p > 0) c = __fdiv_rn(c, topk_norm_rn(wr, 1, K, norm_p));
    for (int64_t j = 0; j < K; ++j) wr[j] = __fmul_rn(wr[j], c);
  }
}

__global__ void router_gather_bwd_kernel(const float* dw, const float* s, const int32_t* idx, double norm_p, double factor,
                                         float* ds, int64_t n, int64_t E, int64_t K) {
  const float c = static_cast<float>(factor);
  MOE_GRID_LOOP(t, n) {
    const int32_t* ir = idx + t * K;
    if (norm_p <= 0) {
      for (int64_t j = 0; j < K; ++j) ds[t * E + ir[j]] = __fadd_rn(ds[t * E + ir[j]], __fmul_rn(c, dw[t * K + j]));
      continue;
    }
    // The chosen scores, read through idx (K is unbounded: no local copy).
    float acc = 0;
    for (int64_t j = 0; j < K; ++j) {
      const float v = s[t * E + ir[j]];
      acc = norm_p == 1 ? __fadd_rn(acc, v) : norm_p == 2 ? __fadd_rn(acc, __fmul_rn(v, v)) : __fadd_rn(acc, norm_power(v, norm_p));
    }
    const float nrm = norm_p == 1 ? acc
                      : norm_p == 2 ? static_cast<float>(sqrt(static_cast<double>(acc)))
                                    : static_cast<float>(pow(static_cast<double>(acc), 1.0 / norm_p));
    float dot = 0;
    for (int64_t j = 0; j < K; ++j) dot = __fadd_rn(dot, __fdiv_rn(__fmul_rn(dw[t * K + j], s[t * E + ir[j]]), nrm));
    for (int64_t j = 0; j < K; ++j) {
      float* d = ds + t * E + ir[j];
      const float pw = norm_power(__fdiv_rn(s[t * E + ir[j]], nrm), norm_p - 1);
      *d = __fadd_rn(*d, __fdiv_rn(__fmul_rn(c, __fsub_rn(dw[t * K + j], __fmul_rn(dot, pw))), nrm));
    }
  }
}

__global__ void router_bias_update_kernel(const int32_t* c, double gamma, float* b, int64_t E, const double* control) {
  if (control && control[kCtlNonfinite] != 0) return;
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += c[e];
  mean /= static_cast<double>(E);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const double d = mean - c[e];
    b[e] = __fadd_rn(b[e], static_cast<float>(gamma * static_cast<double>((d > 0) - (d < 0))));
  }
}

// One block: counts zeroed, then each choice counted (shared-memory integer adds: order-free).
__global__ void expert_counts_kernel(const int32_t* idx, int64_t R, int64_t E, int32_t* counts, DeviceError* err) {
  extern __shared__ int c[];
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) c[e] = 0;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {
    const int32_t e = idx[r];
    if (e < 0 || e >= E) {
      report_error(err, err_code(OpId::expert_counts), e, r);
      continue;
    }
    atomicAdd(&c[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) counts[e] = c[e];
}

__global__ void add_counts_kernel(const int32_t* c, int32_t* total, int64_t n) {
  MOE_GRID_LOOP(i, n) total[i] += c[i];
}

// ---------------------------------------------------------------- permutation plan
// Blocks of kThreads rows. A row's place: its block's start for its expert (expert-major prefix
// over blocks), plus the rows of the same expert in earlier warps of the block, plus those in
// earlier lanes of its warp: a stable counting sort.
struct WarpRank {
  int expert;  // -1: no row (past the end, or an invalid id)
  int rank;    // among the rows of the same expert in earlier lanes of this warp
};

__device__ WarpRank warp_rank(const int32_t* idx, int64_t R, int64_t E, int* counts /* [kWarps][E] shared */,
                              DeviceError* err) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int e = -1;
  if (r < R) {
    e = idx[r];
    if (e < 0 || e >= E) {
      report_error(err, err_code(OpId::moe_plan), e, r);
      e = -1;
    }
  }
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && rank == 0) counts[warp * E + e] = __popc(peers);
  return WarpRank{e, rank};
}

__global__ void moe_plan_count_kernel(const int32_t* idx, int64_t R, int64_t E, int32_t* block_counts, DeviceError* err) {
  extern __shared__ int counts[];
  for (int64_t i = threadIdx.x; i < kWarps * E; i += kThreads) counts[i] = 0;
  __syncthreads();
  warp_rank(idx, R, E, counts, err);
  __syncthreads();
  const int64_t nb = gridDim.x;
  for (int64_t e = threadIdx.x; e < E; e += kThreads) {
    int total = 0;
    for (int w = 0; w < kWarps; ++w) total += counts[w * E + e];
    block_counts[e * nb + blockIdx.x] = total;
  }
}

// One block: exclusive prefix over block_counts (expert-major) in place, counts and offsets.
__global__ void moe_plan_scan_kernel(int32_t* block, int64_t nb, int64_t E, int32_t* counts, int32_t* offsets) {
  __shared__ int32_t part[1024];
  const int64_t total = nb * E, per = (total + blockDim.x - 1) / blockDim.x;
  const int64_t b0 = threadIdx.x * per, b1 = b0 + per < total ? b0 + per : total;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int64_t b = 0; b < nb; ++b) c += block[e * nb + b];
    counts[e] = c;
  }
  int32_t mine = 0;
  for (int64_t i = b0; i < b1; ++i) mine += block[i];
  part[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) {
      const int32_t v = part[i];
      part[i] = run;
      run += v;
    }
    offsets[E] = run;
  }
  __syncthreads();
  int32_t run = part[threadIdx.x];
  for (int64_t i = b0; i < b1; ++i) {
    const int32_t v = block[i];
    block[i] = run;
    run += v;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) offsets[e] = block[e * nb];
}

__global__ void moe_plan_scatter_kernel(const int32_t* idx, int64_t R, int64_t E, const int32_t* block_start,
                                        int32_t* sorted_slot, int32_t* slot_pos, DeviceError* err) {
  extern __shared__ int counts[];
  for (int64_t i = threadIdx.x; i < kWarps * E; i += kThreads) counts[i] = 0;
  __syncthreads();
  const WarpRank wr = warp_rank(idx, R, E, counts, err);
  __syncthreads();
  if (wr.expert < 0) return;
  const int warp = threadIdx.x >> 5;
  int pos = block_start[wr.expert * static_cast<int64_t>(gridDim.x) + blockIdx.x] + wr.rank;
  for (int w = 0; w < warp; ++w) pos += counts[w * E + wr.expert];
  const int64_t r = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  sorted_slot[pos] = static_cast<int32_t>(r);
  slot_pos[r] = pos;
}

// ---------------------------------------------------------------- gather / combine
template <class S> __global__ void moe_gather_kernel(const S* x, const int32_t* sorted_slot, S* xs, int64_t R, int64_t D, int64_t K) {
  for (int64_t p = blockIdx.x; p < R; p += gridDim.x) {
    const int64_t t = sorted_slot[p] / K;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) xs[p * D + d] = x[t * D + d];
  }
}

__global__ void moe_gather_bwd_kernel(const float* dxs, const int32_t* pos, float* dx, int64_t T, int64_t D, int64_t K) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = dx[t * D + d];
      for (int64_t j = 0; j < K; ++j) acc = __fadd_rn(acc, dxs[pos[t * K + j] * D + d]);
      dx[t * D + d] = acc;
    }
}

__global__ void moe_combine_kernel(const float* ys, const int32_t* pos, const float* w, float* out, int64_t T, int64_t D,
                                   int64_t K, bool accumulate) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0;
      for (int64_t j = 0; j < K; ++j) acc = __fadd_rn(acc, __fmul_rn(w[t * K + j], ys[pos[t * K + j] * D + d]));
      out[t * D + d] = accumulate ? __fadd_rn(out[t * D + d], acc) : acc;
    }
}

// One warp per (token, slot).
template <class Y, class O>
__global__ void moe_combine_bwd_kernel(const float* dout, const Y* ys, const int32_t* pos, const float* w, O* dys,
                                       float* dw, int64_t T, int64_t D, int64_t K) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(tj, T * K) {
    const int64_t t = tj / K, p = pos[tj];
    const float wt = w[tj];
    float dot = 0;
    for (int64_t d = lane; d < D; d += 32) {
      const float g = dout[t * D + d];
      store(dys + p * D + d, __fmul_rn(wt, g));
      dot = __fmaf_rn(g, load(ys + p * D + d), dot);
    }
    dot = warp_sum(dot);
    if (lane == 0) dw[tj] = dot;
  }
}

// ---------------------------------------------------------------- auxiliary losses
// Per-row normalizer of the score vector: 1 for softmax, the row sum for sigmoid.
__global__ void row_norm_kernel(const float* s, int kind, float* norm, int64_t T, int64_t E) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(t, T) {
    float sum = 0;
    if (kind == 1) {
      for (int64_t e = lane; e < E; e += 32) sum = __fadd_rn(sum, s[t * E + e]);
      sum = warp_sum(sum);
    }
    if (lane == 0) norm[t] = kind == 1 ? sum : 1.0f;
  }
}

// partial[p, e] = sum over rows of chunk p of s[t,e] / norm[t].
__global__ void column_parts_kernel(const float* s, const float* norm, int64_t T, int64_t E, int chunks, float* partial) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int p = blockIdx.y;
  if (e >= E) return;
  const int64_t per = (T + chunks - 1) / chunks, t0 = p * per, t1 = t0 + per < T ? t0 + per : T;
  float acc = 0;
  for (int64_t t = t0; t < t1; ++t) acc = __fadd_rn(acc, __fdiv_rn(s[t * E + e], norm[t]));
  partial[p * E + e] = acc;
}

__global__ void lbl_finish_kernel(const float* partial, int chunks, const int32_t* counts, int64_t T, int64_t E, int top_k,
                                  double value_scale, double* out, float* mean_prob, float* f) {
  float loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    float P = 0;
    for (int p = 0; p < chunks; ++p) P = __fadd_rn(P, partial[p * E + e]);
    P = __fdiv_rn(P, static_cast<float>(T));
    mean_prob[e] = P;
    f[e] = __fdiv_rn(static_cast<float>(counts[e]), static_cast<float>(top_k * T));
    loss = __fadd_rn(loss, __fmul_rn(f[e], P));
  }
  out[0] += value_scale * static_cast<double>(__fmul_rn(static_cast<float>(E), loss));
}

__global__ void lbl_grad_kernel(const float* s, const float* f, const float* norm, int kind, float gscale, float* ds,
                                int64_t T, int64_t E) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(t, T) {
    if (kind == 0) {
      for (int64_t e = lane; e < E; e += 32) ds[t * E + e] = __fadd_rn(ds[t * E + e], __fmul_rn(gscale, f[e]));
      continue;
    }
    const float nrm = norm[t];
    float dot = 0;
    for (int64_t e = lane; e < E; e += 32) dot = __fadd_rn(dot, __fdiv_rn(__fmul_rn(f[e], s[t * E + e]), nrm));
    dot = warp_sum(dot);
    for (int64_t e = lane; e < E; e += 32)
      ds[t * E + e] = __fadd_rn(ds[t * E + e], __fdiv_rn(__fmul_rn(gscale, __fsub_rn(f[e], dot)), nrm));
  }
}

__global__ void z_rows_kernel(const float* z, float grad_scale, float* lse_out, float* dz, int64_t T, int64_t E) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(t, T) {
    const float* zr = z + t * E;
    float mx, sum;
    row_max_and_exp_sum(zr, E, lane, mx, sum);
    const float lse = __fadd_rn(mx, logf(sum));
    if (lane == 0) lse_out[t] = lse;
    if (!dz) continue;
    const float g = __fdiv_rn(__fmul_rn(__fmul_rn(grad_scale, 2.0f), lse), static_cast<float>(T));
    for (int64_t e = lane; e < E; e += 32) dz[t * E + e] = __fadd_rn(dz[t * E + e], __fmul_rn(g, expf(__fsub_rn(zr[e], lse))));
  }
}

__global__ void z_finish_kernel(const float* lse, int64_t T, double value_scale, double* out) {
  float acc = 0;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(lse[t], lse[t]));
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] += value_scale * static_cast<double>(__fdiv_rn(acc, static_cast<float>(T)));
}


unsigned warp_blocks(int64_t rows) { return cuda::warp_blocks(rows, kThreads); }
unsigned row_blocks(int64_t n) { return static_cast<unsigned>(n < 65535 * 4 ? (n > 0 ? n : 1) : 65535 * 4); }

}  // namespace
}  // namespace moe::cuda
