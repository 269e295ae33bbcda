// cuDNN's fused attention for the bf16-products path (kernels/cuda/sdpa_cudnn.cpp), in builds
// that found cuDNN's headers (MOE_WITH_CUDNN); the library itself is loaded at run time.
// forward / backward return false for a shape cuDNN refuses; the caller then runs our kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "core/buffer.h"
#include "kernels/cuda/context.h"

struct cudnnContext;

namespace moe::cuda {

class CudnnSdpa {
 public:
  // Loads cuDNN (libcudnn.so.9) at run time; null, with the reason, when it cannot.
  static std::unique_ptr<CudnnSdpa> load(Allocator& device, cudaStream_t stream, std::string* why);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  // train.deterministic_attention (default true): the backward's algorithm; graphs are kept per choice.
  void set_deterministic(bool on) { deterministic_ = on; }
  bool forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse);
  bool backward(Context& ctx, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv);

 private:
  CudnnSdpa(Allocator& device, cudnnContext* handle);  // takes the handle (load made it)
  struct Graph;
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t>;  // backward, deterministic, B, S, H, G, hd
  Graph& graph(bool backward, int64_t B, int64_t S, int64_t H, int64_t G, int64_t hd);
  // bf16 copies of the operands, then cuDNN's workspace: one device region, grown when a larger
  // shape first runs (the first step), so later steps allocate nothing.
  void* buffer(size_t bytes);

  Allocator& device_;
  cudnnContext* handle_ = nullptr;
  std::map<Key, std::unique_ptr<Graph>> graphs_;
  void* buffer_ = nullptr;
  size_t buffer_bytes_ = 0;
  bool deterministic_ = true;
};

}  // namespace moe::cuda
