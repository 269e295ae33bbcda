// Argument contracts of the MXFP8 ops (op_list.inc: mx_quantize, mx_dequantize, mx_linear,
// mx_grouped_linear), checked once for every backend. Shapes and dtypes only.
#pragma once

#include <cstdint>
#include <vector>

#include "core/mxfp8.h"
#include "core/tensor.h"

namespace moe {

// The element format of a codes tensor (e4m3 or e5m2; anything else is an error naming `what`).
mx::Elem mx_elem(const Tensor& codes, const char* what);

// mx_quantize: x (N,C) or (G,N,C); the matrices and the length of each block-reduced line.
struct MxQuantizeShape {
  int64_t groups = 1, n = 0, c = 0;  // x is groups x (n, c)
};
MxQuantizeShape check_mx_quantize_args(const Tensor& x, bool columnwise, mx::ScaleRule rule, const Tensor& codes,
                                       const Tensor& scales, const Tensor& stats, const Tensor& row_end);
// mx_quantize_swizzled: x (N,C), codes (N,C), scales (S) e8m0, offsets empty or (G+1) i32; on a
// host-addressable offsets, also its order and S against the padded size (mx_swizzled_layout).
struct MxSwizzledShape {
  int64_t n = 0, c = 0, groups = 1;
  mx::Elem elem = mx::Elem::kE4M3;
  mx::ScaleRule rule = mx::ScaleRule::kRceil;
  // Host offsets only: group g's rows [begin[g], begin[g+1]), its scales after padded_before[g] rows.
  std::vector<int64_t> begin, padded_before;
  int64_t bytes = 0;  // the span the scales take
};
MxSwizzledShape check_mx_quantize_swizzled_args(const Tensor& x, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales,
                                                const Tensor& offsets);
// mx_dequantize: codes (N,C), scales (N,C/32), y (N,C).
void check_mx_dequantize_args(const Tensor& codes, const Tensor& scales, const Tensor& y, const Tensor& row_end);
// The rows an op covers: all n, or row_end's last element (host-addressable row_end only; checked
// to lie in [0, n]).
int64_t mx_row_limit(const Tensor& row_end, int64_t n, const char* what);

struct MxGemmShape {
  int64_t groups = 1, m = 0, n = 0, k = 0;  // grouped: m = rows R, groups = E
};
// mx_linear: a (M,K), b (N,K), scales (.,K/32), y (M,N) f32 (f64 where allow_f64).
MxGemmShape check_mx_linear_args(const Tensor& a, const Tensor& a_scales, const Tensor& b,
                                 const Tensor& b_scales, const Tensor& y, bool allow_f64);
// mx_grouped_linear: a (R,K), b (E,N,K), offsets (E+1) i32, y (R,N).
MxGemmShape check_mx_grouped_linear_args(const Tensor& a, const Tensor& a_scales, const Tensor& b,
                                         const Tensor& b_scales, const Tensor& offsets, const Tensor& y,
                                         bool allow_f64);

}  // namespace moe
