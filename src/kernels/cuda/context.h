// What every CUDA op needs besides its tensors: the backend's stream, the cuBLASLt state, a
// scratch region for multi-pass reductions, and the device error word. Owned by the backend
// (cuda_backend.cpp); allocated once when the backend is made, so no op allocates.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"
#include "kernels/cuda/cuda_backend.h"

namespace moe::cuda {

class GemmLt;     // kernels/cuda/gemm_lt.cpp
class CudnnSdpa;  // kernels/cuda/sdpa_cudnn.cpp (builds with cuDNN only)

// Errors found on the device (an id outside the vocabulary, an expert id outside [0, E)): the
// first kernel to find one stores its code and value in host-mapped memory (no copy, no sync);
// the backend reports it, naming the op, at the next wait or synchronize, as a GPU reports a
// fault. Codes are OpId + 1.
struct DeviceError {
  int32_t code = 0;
  int32_t value = 0;
  int64_t index = 0;
};

struct Context {
  cudaStream_t stream = nullptr;
  int device = 0;
  int sm_count = 0;
  int cc_major = 0;          // compute capability: 9 Hopper, 10 Blackwell (picks the grouped GEMM kernels)
  bool tensor_core_grouped = true;  // false: the SIMT grouped kernel everywhere (MOE_CUDA_GROUPED=simt)
  GemmLt* gemm = nullptr;
  CudnnSdpa* sdpa = nullptr;  // null: no cuDNN in this build, or MOE_CUDA_ATTENTION=ours
  DeviceError* error = nullptr;  // device-visible pointer to host-mapped memory
  // Scratch for the second pass of reductions (partial sums in a fixed order). Ops run in
  // stream order, so one region serves all of them; each op checks its need against the size.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  CudaPaths paths;  // which implementation ran (cuda_paths)
  template <class T> T* scratch_as(size_t count, const char* op) const;
};

[[noreturn]] void fail_cuda(cudaError_t err, const char* call, const char* file, int line);
inline void check_cuda(cudaError_t err, const char* call, const char* file, int line) {
  if (err != cudaSuccess) fail_cuda(err, call, file, line);
}
#define MOE_CUDA_CHECK(call) ::moe::cuda::check_cuda((call), #call, __FILE__, __LINE__)
// After a launch: a launch error (bad configuration) names the op.
void check_launch(const char* op);
// The op's tensors must be this backend's device tensors (or empty "none" arguments).
void check_device(const Tensor& t, const char* op);
inline void check_device(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts) check_device(*t, op);
}
size_t scratch_limit_error(size_t need, size_t have, const char* op);

template <class T> T* Context::scratch_as(size_t count, const char* op) const {
  if (count * sizeof(T) > scratch_bytes) scratch_limit_error(count * sizeof(T), scratch_bytes, op);
  return static_cast<T*>(scratch);
}

}  // namespace moe::cuda
