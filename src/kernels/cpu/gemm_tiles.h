// How the CPU GEMM ops are cut into tiles and run (gemm_tiles.cpp): the tile policy, a function
// of the shapes; the work items; the per-thread staging; the one OpenMP region that runs them on
// single-threaded oneDNN primitives (gemm_dnnl.h). The ops' entry points, which check their
// tensors, are in gemm.cpp. Every function here plans and runs one whole op, serialized with the
// others (they share the item list, the staging buffers and the primitive cache).
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "kernels/cpu/gemm_dnnl.h"

namespace moe::cpu::tiles {

void zero_rows(float* c, int64_t rows, int64_t cols);

// y(m,n) (+)= x(m,k) * w(n,k)^T
void linear_fwd(DType t, int64_t m, int64_t n, int64_t k, const void* x, const void* w, float* y, bool accumulate);
// dx(m,k) (+)= dy(m,n) * w(n,k)
void linear_bwd_data(DType t, int64_t m, int64_t n, int64_t k, const void* dy, const void* w, float* dx,
                     bool accumulate);
// dw(n,k) (+)= dy(m,n)^T * x(m,k)
void linear_bwd_weight(DType t, int64_t m, int64_t n, int64_t k, const void* dy, const void* x, float* dw,
                       bool accumulate);

// Grouped over `experts` weights of (n,k) each: rows [off[e], off[e+1]) of the row operands belong
// to expert e; `rows` is the row operands' allocated row count (>= off[experts]).
void grouped_fwd(DType t, int64_t n, int64_t k, const void* x, const void* w, const int32_t* off, int64_t experts,
                 int64_t rows, float* y);
void grouped_bwd_data(DType t, int64_t n, int64_t k, const void* dy, const void* w, const int32_t* off,
                      int64_t experts, int64_t rows, float* dx);
void grouped_bwd_weight(DType t, int64_t n, int64_t k, const void* dy, const void* x, const int32_t* off,
                        int64_t experts, float* dw, bool accumulate);

// oneDNN's implementation string for the first (largest) tile of the plan the op would run.
std::string first_tile_impl(GemmOp op, DType dtype, int64_t m, int64_t n, int64_t k);

}  // namespace moe::cpu::tiles
