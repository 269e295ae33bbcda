// The CUDA backend (kernels/cuda): make_backend("cuda") when moecore is built with -DMOE_CUDA=ON.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "kernels/ops.h"

namespace moe {

// GPUs this process can use; 0 (with the reason in *why) on a machine without a GPU or driver.
int cuda_device_count(std::string* why = nullptr);
// This process's GPU: its local rank under a launcher (mpirun, srun, torchrun), modulo the GPUs.
int cuda_local_device();
// Backend::supports of the cuda backend, known without a GPU: everything but f64, which only the
// dtype-agnostic ops (fill, convert, scale, axpy, sum_to, sumsq_to, sumsq_segments) take.
bool cuda_supports(OpId op, DType dtype);
// The most bytes cuda backends of this process held in cudaMalloc'd memory at once (0 if none).
size_t cuda_peak_allocated_bytes();
// The datasheet's dense peak of this process's GPU, TFLOP/s: bf16 tensor cores (bf16 = true) or
// fp32 without tensor cores. H100/H200 SXM 989 / 67, B200 and B300 2250 / 80; 0 for other GPUs.
double cuda_peak_tflops(bool bf16);
// The cudaStream_t every op of a cuda backend is enqueued on (fails for another backend).
void* cuda_stream(Backend& cuda);
// Which implementation each call of the ops with more than one took, counted since the backend
// was made: tests assert that the tensor-core path ran, the benchmarks label their rows by it.
struct CudaPaths {
  uint64_t grouped_cutlass = 0;  // grouped GEMM calls (fwd, dgrad, wgrad) on CUTLASS's tensor cores
  uint64_t grouped_simt = 0;     // ... on our SIMT kernel (fp32 operands, unaligned shapes, other GPUs)
  uint64_t attention_cudnn = 0;  // attention_fwd / attention_bwd calls on cuDNN's SDPA
  uint64_t attention_ours = 0;   // ... on our kernel (fp32 products, document masks, no cuDNN)
  CudaPaths operator-(const CudaPaths& o) const {
    return {grouped_cutlass - o.grouped_cutlass, grouped_simt - o.grouped_simt, attention_cudnn - o.attention_cudnn,
            attention_ours - o.attention_ours};
  }
};
CudaPaths cuda_paths(Backend& cuda);
// "grouped GEMM: 12 CUTLASS, 0 SIMT; attention: 4 cuDNN, 0 ours" (the calls in `p`).
std::string cuda_paths_text(const CudaPaths& p);
// `moecore bench --kernels`: dense, grouped and attention kernel rates on this GPU, one row each.
void cuda_kernel_bench(std::ostream& os);
// A backend on cuda_local_device(); fails naming the reason when there is no usable GPU.
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace moe
