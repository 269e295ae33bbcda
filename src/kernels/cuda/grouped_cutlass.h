// The tensor-core grouped GEMM entry points (kernels/cuda/grouped_cutlass.cuh), one per
// (operation, architecture) translation unit. Each returns false when it cannot run the call (an
// alignment it needs, scratch too small); the caller then uses the SIMT kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::cuda {
struct DeviceError;  // kernels/cuda/context.h
}  // namespace moe::cuda

namespace moe::cuda::grouped {

enum class Kind { kFwd, kDgrad, kWgrad };

struct Args {
  const void* a = nullptr;  // fwd: x (R,k); dgrad, wgrad: dy (R,n); bf16
  const void* b = nullptr;  // fwd, dgrad: w (E,n,k); wgrad: x (R,k); bf16
  float* out = nullptr;     // fwd: y (R,n); dgrad: dx (R,k); wgrad: dw (E,n,k), accumulated
  const int32_t* offsets = nullptr;
  int64_t experts = 0, rows = 0, n = 0, k = 0;  // rows: R, the operands' row count (offsets clamped to it)
  DeviceError* error = nullptr;  // the backend's device error word: bad offsets are reported there
  int error_code = 0;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  int device = 0, sm_count = 0;
  cudaStream_t stream = nullptr;
};

bool fwd_sm90(const Args& a);
bool dgrad_sm90(const Args& a);
bool wgrad_sm90(const Args& a);
bool fwd_sm100(const Args& a);
bool dgrad_sm100(const Args& a);
bool wgrad_sm100(const Args& a);

}  // namespace moe::cuda::grouped
