// CUDA expert parallelism: the ops of kernels/ref/expert_parallel.cpp (ep_plan, ep_slab_copy;
// contracts: kernels/op_list.inc, kernels/checks/ep_checks.h). Compiled inside moe_routing.cu (one
// nvcc unit for the routing-side families), its only includer.
#pragma once

#include <cstdint>

#include "kernels/checks/ep_checks.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/math/ep_plan_math.h"

namespace moe::cuda {
namespace {

constexpr int kSlabThreads = 256;

// The reference's arithmetic (kernels/math/ep_plan_math.h), on one thread: the matrix is ep x E (tiny).
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
// side (kernels/math/ep_plan_math.h), copied as words W by the CTAs of blockIdx.y.
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

}  // namespace

void ep_plan(Context& ctx, const Tensor& counts, int64_t rank, int64_t capacity, const Tensor& kept, const Tensor& local_begin,
             const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  check_device({&counts, &kept, &local_begin, &recv_begin, &recv_offsets, &totals}, "ep_plan");
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
  check_device({&counts, &kept, &local_begin, &recv_begin, &rows, &slabs}, "ep_slab_copy");
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
  if (wide) ep_slab_copy_kernel<uint4><<<grid, kSlabThreads, 0, ctx.stream>>>(a, ctx.error);
  else ep_slab_copy_kernel<uint16_t><<<grid, kSlabThreads, 0, ctx.stream>>>(a, ctx.error);
  check_launch("ep_slab_copy");
}

}  // namespace moe::cuda
