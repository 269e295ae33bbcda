// cuBLASLt state of one backend: the handle, the workspace (allocated once with the backend) and
// one cached plan (descriptors + algorithm) per GEMM shape. Column-major problem, as cuBLAS has it:
// C(m,n) = op(A) op(B) (+ C with accumulate), fp32 C, A and B both f32 or both bf16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "kernels/cuda/context.h"

struct cublasLtContext;

namespace moe::cuda {

class GemmLt {
 public:
  GemmLt(void* workspace, size_t workspace_bytes);
  ~GemmLt();
  GemmLt(const GemmLt&) = delete;
  GemmLt& operator=(const GemmLt&) = delete;

  void run(cudaStream_t stream, const char* op, bool bf16, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
           const void* A, int64_t lda, const void* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);
  size_t cached_plans() const { return plans_.size(); }
  // For benchmarks: the fastest of up to `candidates` heuristic algorithms for this problem
  // (each timed over `reps` runs after one warm-up, without our no-split-K restriction), seconds
  // per run. Synchronizes the stream.
  double best_algorithm_seconds(cudaStream_t stream, bool bf16, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                                const void* A, int64_t lda, const void* B, int64_t ldb, float* C, int64_t ldc,
                                int candidates, int reps);

 private:
  // The pointers' alignments (kernels/cuda/alignment.h) are part of the problem: an algorithm
  // chosen for 256-byte aligned operands may read 64-byte aligned ones wrongly.
  struct Key {
    bool bf16, transa, transb;
    int64_t m, n, k, lda, ldb, ldc;
    uint32_t align_a, align_b, align_c;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Plan;
  const Plan& plan(const Key& key, const char* op);

  cublasLtContext* handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  std::unordered_map<Key, std::unique_ptr<Plan>, KeyHash> plans_;
};

}  // namespace moe::cuda
