// Device-side helpers shared by the kernel files: bf16 storage with the CPU's exact rounding,
// loads and stores by storage type, and reductions whose order depends only on the shape (so a
// run is bitwise repeatable; no floating-point atomics anywhere).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/context.h"
#include "kernels/cuda/grid.h"
#include "kernels/ops.h"

namespace moe::cuda {

// bf16 storage: the upper half of an IEEE float, rounded to nearest even (core/bf16.h, bit for bit:
// a NaN stays a quiet NaN).
struct bf16s {
  uint16_t bits;
};

__device__ __forceinline__ uint16_t bf16_round(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float bf16_value(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

__device__ __forceinline__ double load(const double* p) { return *p; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const bf16s* p) { return bf16_value(p->bits); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16s* p, float v) { p->bits = bf16_round(v); }
// Products and sums rounded separately (no contraction into an FMA), as the reference computes.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
// Rounds v as storing it in S would (identity for float).
__device__ __forceinline__ float rounded_as(float v, const float*) { return v; }
__device__ __forceinline__ float rounded_as(float v, const bf16s*) { return bf16_value(bf16_round(v)); }

// The DeviceError code of an op.
__host__ __device__ constexpr int err_code(OpId op) { return static_cast<int>(op) + 1; }

// Records a device error (see DeviceError) unless one is already recorded. No atomics: the word
// is host-mapped memory, where device atomics are not guaranteed; two threads failing at once
// may mix their value and index, which only blurs an error message.
__device__ __forceinline__ void report_error(DeviceError* err, int code, int value, int64_t index) {
  volatile DeviceError* e = err;
  if (e->code != 0) return;
  e->value = value;
  e->index = index;
  __threadfence_system();
  e->code = code;
}

// Sum over the block in a fixed tree order (warp shuffles, then the warps' results in order).
// Every thread gets the total. blockDim.x must be a multiple of 32, at most 1024.
template <class T> __device__ T block_sum(T v) {
  __shared__ T warp_part[32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // warp_part may still be read by a previous call
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < warps; ++w) total += warp_part[w];  // same order in every thread
  return total;
}

template <class T> __device__ T block_max(T v) {
  __shared__ T warp_part[32];
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  T m = warp_part[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, warp_part[w]);
  return m;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Grid-stride loop over [0, n) (grids are capped: kernels/cuda/grid.h).
#define MOE_GRID_LOOP(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// One warp per row, rows strided by the grid's warps (warp_stride): every lane of a warp takes
// the same rows, so warp-wide shuffles inside stay converged. blockDim.x is a multiple of 32.
#define MOE_WARP_LOOP(row, n)                                                                            \
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; row < (n); \
       row += static_cast<int64_t>(blockDim.x) * gridDim.x / 32)

}  // namespace moe::cuda
