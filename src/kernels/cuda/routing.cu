// CUDA MoE routing: router scores, top-k, random assignment (the CPU's Philox draws), the stable
// counting-sort permutation, gather/combine, the auxiliary losses, the expert-parallel plan and the
// optimizer's step control. Contracts: kernels/op_list.inc; reference: kernels/ref/moe_routing.cpp,
// expert_parallel.cpp, step_control.cpp. Integer results are exact, so they equal the CPU's; float
// reductions run in an order fixed by the shape.
#include <cmath>

#include "core/philox.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/ep_checks.h"
#include "kernels/ep_plan_math.h"
#include "kernels/expert_weights.h"
#include "kernels/ops.h"
#include "kernels/step_control.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowChunks = 128;
constexpr int kMaxExperts = 1024;  // moe_plan's per-warp counts live in shared memory

__host__ __device__ constexpr int err_code(OpId op) { return static_cast<int>(op) + 1; }

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

// ||v||_p over a token's K chosen scores, in the order and rounding of kernels/expert_weights.h.
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
template <class Y>
__global__ void moe_combine_bwd_kernel(const float* dout, const Y* ys, const int32_t* pos, const float* w, float* dys,
                                       float* dw, int64_t T, int64_t D, int64_t K) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(tj, T * K) {
    const int64_t t = tj / K, p = pos[tj];
    const float wt = w[tj];
    float dot = 0;
    for (int64_t d = lane; d < D; d += 32) {
      const float g = dout[t * D + d];
      dys[p * D + d] = __fmul_rn(wt, g);
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

// ---------------------------------------------------------------- expert parallelism
// The reference's arithmetic (kernels/ep_plan_math.h), on one thread: the matrix is ep x E (tiny).
__global__ void ep_plan_kernel(const int32_t* c, int64_t ep, int64_t E, int64_t rank, int64_t capacity, int32_t* k,
                               int32_t* lb, int32_t* rb, int32_t* off, int32_t* tot, DeviceError* err) {
  for (int64_t i = 0; i < ep * E; ++i)
    if (c[i] < 0) {
      report_error(err, err_code(OpId::ep_plan), c[i], i);
      return;
    }
  ep_plan_arrays(c, ep, E, rank, capacity, k, lb, rb, off, tot);
}

// ep_slab_copy: block (peer q, local expert e) = blockIdx.x is one contiguous run of rows on each
// side (kernels/ep_plan_math.h), copied as words W by the CTAs of blockIdx.y.
struct SlabArgs {
  const int32_t *c, *k, *lb, *rb;
  int64_t ep, E, rank, S, N, row_bytes;
  bool expert_side, to_slabs;
  char *rows, *slabs;
};
template <class W> __global__ void ep_slab_copy_kernel(SlabArgs a, DeviceError* err) {
  __shared__ EpSlabBlock b;
  const int64_t El = a.E / a.ep, q = blockIdx.x / El, e = blockIdx.x % El;
  if (threadIdx.x == 0) b = ep_slab_block(a.c, a.k, a.lb, a.rb, a.ep, a.E, a.rank, a.expert_side, q, e);
  __syncthreads();
  if (b.rows < 0 || b.dropped < 0 || b.row < 0 || b.slab_row + b.rows > a.S || b.row + b.rows + b.dropped > a.N) {
    if (threadIdx.x == 0 && blockIdx.y == 0) report_error(err, err_code(OpId::ep_slab_copy), static_cast<int>(b.rows), blockIdx.x);
    return;
  }
  W* row = reinterpret_cast<W*>(a.rows + b.row * a.row_bytes);
  W* slab = reinterpret_cast<W*>(a.slabs + (q * a.S + b.slab_row) * a.row_bytes);
  const int64_t words = b.rows * a.row_bytes / static_cast<int64_t>(sizeof(W));
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (a.to_slabs) {
    for (int64_t i = first; i < words; i += step) slab[i] = row[i];
    return;
  }
  for (int64_t i = first; i < words; i += step) row[i] = slab[i];
  const int64_t zeros = b.dropped * a.row_bytes / static_cast<int64_t>(sizeof(W));
  for (int64_t i = first; i < zeros; i += step) row[words + i] = W{};
}

__global__ void step_control_kernel(const double* v, int64_t nv, const double* sq, int64_t nsq, double lm_z_coef,
                                    double lbl_coef, double router_z_coef, double max_norm, const double* lr_table,
                                    int64_t nlr, double* c) {
  double total = 0;
  for (int64_t i = 0; i < nsq; ++i) total += sq[i];
  const double norm = sqrt(total);
  const int64_t M = (nv - 2) / 2;
  double loss = v[0] + lm_z_coef * v[1];
  for (int64_t m = 0; m < M; ++m) loss += lbl_coef * v[2 + m];
  for (int64_t m = 0; m < M; ++m) loss += router_z_coef * v[2 + M + m];
  c[kCtlGradNorm] = norm;
  c[kCtlLoss] = loss;
  if (!isfinite(loss) || !isfinite(norm)) c[kCtlNonfinite] = 1;
  const double coef = max_norm > 0 ? max_norm / (norm + 1e-6) : 1.0;
  const bool clipped = max_norm > 0 && coef < 1.0;
  c[kCtlClipCoef] = clipped ? coef : 1.0;
  c[kCtlClipped] = clipped ? 1.0 : 0.0;
  const auto n = static_cast<int64_t>(c[kCtlUpdates]) + 1;
  c[kCtlLr] = lr_table[n < nlr - 1 ? n : nlr - 1];
  if (c[kCtlNonfinite] == 0) c[kCtlUpdates] = static_cast<double>(n);
}

void check_all(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts) check_device(*t, op);
}
unsigned warp_blocks(int64_t rows) { return cuda::warp_blocks(rows, kThreads); }
unsigned row_blocks(int64_t n) { return static_cast<unsigned>(n < 65535 * 4 ? (n > 0 ? n : 1) : 65535 * 4); }

}  // namespace

void router_scores_fwd(Context& ctx, const Tensor& logits, int kind, double eps, const Tensor& scores) {
  check_all({&logits, &scores}, "router_scores_fwd");
  const RoutingDims d = check_router_scores(logits, kind, eps, scores, "router_scores_fwd");
  require_f32(logits, "router_scores_fwd");
  require_f32(scores, "router_scores_fwd");
  const int64_t N = d.T, E = d.E;
  if (N == 0) return;
  router_scores_fwd_kernel<<<warp_blocks(N), kThreads, 0, ctx.stream>>>(ptr<const float>(logits), kind,
                                                                        static_cast<float>(eps), ptr<float>(scores), N, E);
  check_launch("router_scores_fwd");
}

void router_scores_bwd(Context& ctx, const Tensor& dscores, const Tensor& scores, int kind, double eps,
                       const Tensor& dlogits) {
  check_all({&dscores, &scores, &dlogits}, "router_scores_bwd");
  const RoutingDims d = check_router_scores_bwd(dscores, scores, kind, eps, dlogits);
  for (const Tensor* t : {&dscores, &scores, &dlogits}) require_f32(*t, "router_scores_bwd");
  const int64_t N = d.T, E = d.E;
  if (N == 0) return;
  router_scores_bwd_kernel<<<warp_blocks(N), kThreads, 0, ctx.stream>>>(ptr<const float>(dscores), ptr<const float>(scores),
                                                                        kind, static_cast<float>(eps), ptr<float>(dlogits), N, E);
  check_launch("router_scores_bwd");
}

void router_topk(Context& ctx, const Tensor& scores, const Tensor& bias, int64_t n_group, int64_t topk_group,
                 const Tensor& expert_idx) {
  check_all({&scores, &bias, &expert_idx}, "router_topk");
  const RoutingDims d = check_router_topk(scores, bias, n_group, topk_group, expert_idx);
  const int64_t N = d.T, E = d.E, K = d.K;
  MOE_CHECK(E <= kMaxExperts, "router_topk: ", E, " experts exceed the CUDA kernel's ", kMaxExperts);
  if (!bias.empty()) require_f32(bias, "router_topk bias");
  require_f32(scores, "router_topk");
  if (N == 0) return;
  router_topk_kernel<<<blocks_for(N, 128), 128, 0, ctx.stream>>>(ptr<const float>(scores), ptr<const float>(bias), n_group,
                                                                 topk_group, ptr<int32_t>(expert_idx), N, E, K);
  check_launch("router_topk");
}

void router_assign(Context& ctx, int kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
                   const Tensor& expert_idx) {
  check_device(expert_idx, "router_assign");
  const RoutingDims d = check_router_assign(kind, num_experts, expert_idx);
  const int64_t N = d.T, E = d.E, K = d.K;
  MOE_CHECK(E <= kMaxExperts, "router_assign: ", E, " experts exceed the CUDA kernel's ", kMaxExperts);
  if (N == 0) return;
  router_assign_kernel<<<blocks_for(N, 128), 128, 0, ctx.stream>>>(kind, seed, stream, token_base, E,
                                                                   ptr<int32_t>(expert_idx), N, K);
  check_launch("router_assign");
}

void router_gather(Context& ctx, const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule,
                   const Tensor& weights) {
  check_all({&scores, &expert_idx, &weights}, "router_gather");
  const RoutingDims d = check_router_gather(scores, expert_idx, rule, weights);
  const int64_t N = d.T, E = d.E, K = d.K;
  require_f32(scores, "router_gather");
  require_f32(weights, "router_gather");
  if (N == 0) return;
  router_gather_kernel<<<blocks_for(N, kThreads), kThreads, 0, ctx.stream>>>(
      ptr<const float>(scores), ptr<const int32_t>(expert_idx), rule.norm_p, rule.factor, ptr<float>(weights), N, E, K);
  check_launch("router_gather");
}

void router_gather_bwd(Context& ctx, const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                       const ExpertWeightRule& rule, const Tensor& dscores) {
  check_all({&dweights, &scores, &expert_idx, &dscores}, "router_gather_bwd");
  const RoutingDims d = check_router_gather_bwd(dweights, scores, expert_idx, rule, dscores);
  const int64_t N = d.T, E = d.E, K = d.K;
  for (const Tensor* t : {&dweights, &scores, &dscores}) require_f32(*t, "router_gather_bwd");
  if (N == 0) return;
  router_gather_bwd_kernel<<<blocks_for(N, kThreads), kThreads, 0, ctx.stream>>>(
      ptr<const float>(dweights), ptr<const float>(scores), ptr<const int32_t>(expert_idx), rule.norm_p, rule.factor,
      ptr<float>(dscores), N, E, K);
  check_launch("router_gather_bwd");
}

namespace {
void bias_update(Context& ctx, const Tensor& step_counts, double gamma, const Tensor& bias, const double* control,
                 const char* op) {
  const int64_t E = check_router_bias_update(step_counts, bias);
  require_f32(bias, op);
  if (E == 0) return;
  router_bias_update_kernel<<<1, kThreads, 0, ctx.stream>>>(ptr<const int32_t>(step_counts), gamma, ptr<float>(bias), E, control);
  check_launch(op);
}
}  // namespace

void router_bias_update(Context& ctx, const Tensor& step_counts, double gamma, const Tensor& bias) {
  check_all({&step_counts, &bias}, "router_bias_update");
  bias_update(ctx, step_counts, gamma, bias, nullptr, "router_bias_update");
}

void router_bias_update_by_control(Context& ctx, const Tensor& step_counts, double gamma, const Tensor& bias,
                                   const Tensor& control) {
  check_all({&step_counts, &bias, &control}, "router_bias_update_by_control");
  check_dtype(control, DType::kF64, "router_bias_update_by_control control");
  check_shape(control, {kCtlSize}, "router_bias_update_by_control control");
  bias_update(ctx, step_counts, gamma, bias, ptr<const double>(control), "router_bias_update_by_control");
}

void expert_counts(Context& ctx, const Tensor& expert_idx, const Tensor& counts) {
  check_all({&expert_idx, &counts}, "expert_counts");
  check_expert_counts(expert_idx, counts);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  MOE_CHECK(E <= kMaxExperts, "expert_counts: ", E, " experts (the CUDA kernel takes 1..", kMaxExperts, ")");
  expert_counts_kernel<<<1, kThreads, sizeof(int) * static_cast<size_t>(E), ctx.stream>>>(ptr<const int32_t>(expert_idx), R, E,
                                                                                          ptr<int32_t>(counts), ctx.error);
  check_launch("expert_counts");
}

void add_counts(Context& ctx, const Tensor& counts, const Tensor& total) {
  check_all({&counts, &total}, "add_counts");
  check_add_counts(counts, total);
  const int64_t n = counts.numel();
  if (n == 0) return;
  add_counts_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<const int32_t>(counts), ptr<int32_t>(total), n);
  check_launch("add_counts");
}

void moe_plan(Context& ctx, const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets, const Tensor& sorted_slot,
              const Tensor& slot_pos) {
  check_all({&expert_idx, &counts, &offsets, &sorted_slot, &slot_pos}, "moe_plan");
  check_moe_plan(expert_idx, counts, offsets, sorted_slot, slot_pos);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  MOE_CHECK(E >= 1 && E <= kMaxExperts, "moe_plan: ", E, " experts (the CUDA kernel takes 1..", kMaxExperts, ")");
  const int64_t nb = (R + kThreads - 1) / kThreads > 0 ? (R + kThreads - 1) / kThreads : 1;
  int32_t* block = ctx.scratch_as<int32_t>(static_cast<size_t>(nb * E), "moe_plan");
  const size_t shared = sizeof(int) * kWarps * static_cast<size_t>(E);
  moe_plan_count_kernel<<<static_cast<unsigned>(nb), kThreads, shared, ctx.stream>>>(ptr<const int32_t>(expert_idx), R, E,
                                                                                     block, ctx.error);
  moe_plan_scan_kernel<<<1, 1024, 0, ctx.stream>>>(block, nb, E, ptr<int32_t>(counts), ptr<int32_t>(offsets));
  moe_plan_scatter_kernel<<<static_cast<unsigned>(nb), kThreads, shared, ctx.stream>>>(
      ptr<const int32_t>(expert_idx), R, E, block, ptr<int32_t>(sorted_slot), ptr<int32_t>(slot_pos), ctx.error);
  check_launch("moe_plan");
}

void moe_gather(Context& ctx, const Tensor& x, const Tensor& sorted_slot, const Tensor& xs) {
  check_all({&x, &sorted_slot, &xs}, "moe_gather");
  const PermuteDims d = check_moe_gather(x, sorted_slot, xs);
  const int64_t D = d.D, K = d.K, R = d.T * K;
  if (R == 0) return;
  dispatch_storage(x.dtype, "moe_gather", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    moe_gather_kernel<<<row_blocks(R), 128, 0, ctx.stream>>>(ptr<const S>(x), ptr<const int32_t>(sorted_slot), ptr<S>(xs), R, D, K);
  });
  check_launch("moe_gather");
}

void moe_gather_bwd(Context& ctx, const Tensor& dxs, const Tensor& slot_pos, const Tensor& dx) {
  check_all({&dxs, &slot_pos, &dx}, "moe_gather_bwd");
  const PermuteDims d = check_moe_gather_bwd(dxs, slot_pos, dx);
  const int64_t T = d.T, D = d.D, K = d.K;
  require_f32(dx, "moe_gather_bwd");
  require_f32(dxs, "moe_gather_bwd");
  moe_gather_bwd_kernel<<<row_blocks(T), 128, 0, ctx.stream>>>(ptr<const float>(dxs), ptr<const int32_t>(slot_pos), ptr<float>(dx),
                                                              T, D, K);
  check_launch("moe_gather_bwd");
}

void moe_combine(Context& ctx, const Tensor& ys, const Tensor& slot_pos, const Tensor& weights, const Tensor& out,
                 bool accumulate) {
  check_all({&ys, &slot_pos, &weights, &out}, "moe_combine");
  const PermuteDims d = check_moe_combine(ys, slot_pos, weights, out);
  const int64_t T = d.T, D = d.D, K = d.K;
  for (const Tensor* t : {&ys, &weights, &out}) require_f32(*t, "moe_combine");
  if (T == 0) return;
  moe_combine_kernel<<<row_blocks(T), 128, 0, ctx.stream>>>(ptr<const float>(ys), ptr<const int32_t>(slot_pos),
                                                           ptr<const float>(weights), ptr<float>(out), T, D, K, accumulate);
  check_launch("moe_combine");
}

void moe_combine_bwd(Context& ctx, const Tensor& dout, const Tensor& ys, const Tensor& slot_pos, const Tensor& weights,
                     const Tensor& dys, const Tensor& dweights) {
  check_all({&dout, &ys, &slot_pos, &weights, &dys, &dweights}, "moe_combine_bwd");
  const PermuteDims d = check_moe_combine_bwd(dout, ys, slot_pos, weights, dys, dweights);
  const int64_t T = d.T, D = d.D, K = d.K;
  for (const Tensor* t : {&dout, &weights, &dys, &dweights}) require_f32(*t, "moe_combine_bwd");
  if (T * K == 0) return;
  dispatch_storage(ys.dtype, "moe_combine_bwd ys", [&](auto* tag) {
    using Y = std::remove_pointer_t<decltype(tag)>;
    moe_combine_bwd_kernel<<<warp_blocks(T * K), kThreads, 0, ctx.stream>>>(
        ptr<const float>(dout), ptr<const Y>(ys), ptr<const int32_t>(slot_pos), ptr<const float>(weights), ptr<float>(dys),
        ptr<float>(dweights), T, D, K);
  });
  check_launch("moe_combine_bwd");
}

void load_balance_loss(Context& ctx, const Tensor& scores, const Tensor& counts, int kind, int top_k, double value_scale,
                       double grad_scale, const Tensor& out, const Tensor& dscores, const Tensor& mean_prob) {
  check_all({&scores, &counts, &out, &dscores, &mean_prob}, "load_balance_loss");
  const RoutingDims d = check_load_balance_loss(scores, counts, kind, top_k, out, dscores, mean_prob);
  const int64_t T = d.T, E = d.E;
  require_f32(scores, "load_balance_loss");
  require_f32(mean_prob, "load_balance_loss");
  check_dtype(out, DType::kF64, "load_balance_loss out");
  if (!dscores.empty()) require_f32(dscores, "load_balance_loss dscores");
  const int chunks = static_cast<int>(T < kRowChunks ? T : kRowChunks);
  float* norm = ctx.scratch_as<float>(static_cast<size_t>(T + E + chunks * E), "load_balance_loss");
  float* f = norm + T;
  float* partial = f + E;
  row_norm_kernel<<<warp_blocks(T), kThreads, 0, ctx.stream>>>(ptr<const float>(scores), kind, norm, T, E);
  column_parts_kernel<<<dim3(blocks_for(E, kThreads), chunks), kThreads, 0, ctx.stream>>>(ptr<const float>(scores), norm, T, E,
                                                                                         chunks, partial);
  lbl_finish_kernel<<<1, 1, 0, ctx.stream>>>(partial, chunks, ptr<const int32_t>(counts), T, E, top_k, value_scale,
                                             ptr<double>(out), ptr<float>(mean_prob), f);
  if (!dscores.empty()) {
    const float gscale = static_cast<float>(grad_scale) * static_cast<float>(E) / static_cast<float>(T);
    lbl_grad_kernel<<<warp_blocks(T), kThreads, 0, ctx.stream>>>(ptr<const float>(scores), f, norm, kind, gscale,
                                                                 ptr<float>(dscores), T, E);
  }
  check_launch("load_balance_loss");
}

void router_z_loss(Context& ctx, const Tensor& logits, double value_scale, double grad_scale, const Tensor& out,
                   const Tensor& dlogits) {
  check_all({&logits, &out, &dlogits}, "router_z_loss");
  const RoutingDims d = check_router_z_loss(logits, out, dlogits);
  const int64_t T = d.T, E = d.E;
  require_f32(logits, "router_z_loss");
  check_dtype(out, DType::kF64, "router_z_loss out");
  if (!dlogits.empty()) require_f32(dlogits, "router_z_loss dlogits");
  float* lse = ctx.scratch_as<float>(static_cast<size_t>(T), "router_z_loss");
  z_rows_kernel<<<warp_blocks(T), kThreads, 0, ctx.stream>>>(ptr<const float>(logits), static_cast<float>(grad_scale), lse,
                                                             ptr<float>(dlogits), T, E);
  z_finish_kernel<<<1, kThreads, 0, ctx.stream>>>(lse, T, value_scale, ptr<double>(out));
  check_launch("router_z_loss");
}

void ep_plan(Context& ctx, const Tensor& counts, int64_t rank, int64_t capacity, const Tensor& kept, const Tensor& local_begin,
             const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  check_all({&counts, &kept, &local_begin, &recv_begin, &recv_offsets, &totals}, "ep_plan");
  const EpGroup g = check_ep_plan_args(counts, rank, kept, local_begin, recv_begin, recv_offsets, totals);
  const int64_t ep = g.ep, E = g.E;
  ep_plan_kernel<<<1, 1, 0, ctx.stream>>>(ptr<const int32_t>(counts), ep, E, rank, capacity, ptr<int32_t>(kept),
                                          ptr<int32_t>(local_begin), ptr<int32_t>(recv_begin), ptr<int32_t>(recv_offsets),
                                          ptr<int32_t>(totals), ctx.error);
  check_launch("ep_plan");
}

void ep_slab_copy(Context& ctx, const Tensor& counts, const Tensor& kept, const Tensor& local_begin,
                  const Tensor& recv_begin, int64_t rank, bool expert_side, bool to_slabs, const Tensor& rows,
                  const Tensor& slabs) {
  check_all({&counts, &kept, &local_begin, &recv_begin, &rows, &slabs}, "ep_slab_copy");
  const EpGroup g = check_ep_slab_copy_args(counts, kept, local_begin, recv_begin, rank, rows, slabs);
  const int64_t ep = g.ep, E = g.E, El = E / ep;
  SlabArgs a{ptr<const int32_t>(counts), ptr<const int32_t>(kept), ptr<const int32_t>(local_begin),
             ptr<const int32_t>(recv_begin), ep, E, rank, slabs.dim(1), rows.rows(),
             rows.cols() * static_cast<int64_t>(dtype_size(rows.dtype)), expert_side, to_slabs,
             static_cast<char*>(rows.data), static_cast<char*>(slabs.data)};
  if (ep * El == 0 || a.row_bytes == 0) return;
  // Each block is one contiguous run: 16-byte words when every run starts on a 16-byte boundary.
  const bool wide = a.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.rows) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.slabs) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(ep * El), 8);
  if (wide) ep_slab_copy_kernel<uint4><<<grid, kThreads, 0, ctx.stream>>>(a, ctx.error);
  else ep_slab_copy_kernel<uint16_t><<<grid, kThreads, 0, ctx.stream>>>(a, ctx.error);
  check_launch("ep_slab_copy");
}

void step_control(Context& ctx, const Tensor& values, const Tensor& sumsq, double lm_z_coef, double lbl_coef,
                  double router_z_coef, double max_norm, const Tensor& lr_table, const Tensor& control) {
  check_all({&values, &sumsq, &lr_table, &control}, "step_control");
  check_dtype(control, DType::kF64, "step_control control");
  check_shape(control, {kCtlSize}, "step_control control");
  for (const Tensor* t : {&values, &sumsq, &lr_table}) check_dtype(*t, DType::kF64, "step_control");
  MOE_CHECK(values.numel() >= 2 && values.numel() % 2 == 0, "step_control: values ", values.shape_str(),
            " must be [ce, lm_z, lbl x M, router_z x M]");
  MOE_CHECK(lr_table.numel() >= 2, "step_control: the LR table needs entries for step 1 on");
  step_control_kernel<<<1, 1, 0, ctx.stream>>>(ptr<const double>(values), values.numel(), ptr<const double>(sumsq),
                                               sumsq.numel(), lm_z_coef, lbl_coef, router_z_coef, max_norm,
                                               ptr<const double>(lr_table), lr_table.numel(), ptr<double>(control));
  check_launch("step_control");
}

}  // namespace moe::cuda
