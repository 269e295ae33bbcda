// Shape contracts of the GEMM family (op_list.inc), checked once for every backend: each returns
// the problem sizes after checking the operands agree, naming the op and the shapes otherwise.
// dtype and device rules differ per backend and stay there.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

struct GemmDims {
  int64_t m = 0, n = 0, k = 0;
};
struct GroupedDims {
  int64_t experts = 0, n = 0, k = 0, rows = 0;
};

GemmDims linear_fwd_dims(const Tensor& x, const Tensor& w, const Tensor& y);            // x(M,K) w(N,K) y(M,N)
GemmDims linear_bwd_data_dims(const Tensor& dy, const Tensor& w, const Tensor& dx);     // dy(M,N) w(N,K) dx(M,K)
GemmDims linear_bwd_weight_dims(const Tensor& dy, const Tensor& x, const Tensor& dw);   // dy(M,N) x(M,K) dw(N,K)
GroupedDims grouped_fwd_dims(const Tensor& x, const Tensor& w, const Tensor& y);         // w(E,N,K)
GroupedDims grouped_bwd_data_dims(const Tensor& dy, const Tensor& w, const Tensor& dx);
GroupedDims grouped_bwd_weight_dims(const Tensor& dy, const Tensor& x, const Tensor& dw);
// The operands a and b share a dtype; out is f64 for f64 operands, else f32. Which operand dtypes
// a backend takes are its own.
void check_gemm_dtypes(const Tensor& a, const Tensor& b, const Tensor& out, const char* op);
// Offsets (E+1) i32 in host memory: offsets[0] = 0, non-decreasing, offsets[E] <= rows.
const int32_t* checked_offsets(const Tensor& offsets, int64_t experts, int64_t rows, const char* op);

}  // namespace moe
