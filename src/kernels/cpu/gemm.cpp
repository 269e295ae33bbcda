// CPU GEMM ops (cpu_ops.h): the tensors checked, then each op planned and run in tiles by
// gemm_tiles.h, where the tile policy and its determinism rules are.
#include <string>

#include "kernels/checks/gemm_checks.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/cpu/gemm_tiles.h"
#include "kernels/host/host_args.h"

namespace moe::cpu {
namespace {

void check_operands(const Tensor& a, const Tensor& b, const Tensor& out, const char* op) {
  check_host({&a, &b, &out}, op);
  MOE_CHECK(a.dtype != DType::kF64, op,
            ": the cpu backend does not support f64 GEMMs (the f64 path uses the ref backend)");
  MOE_CHECK(a.dtype == DType::kF32 || a.dtype == DType::kBF16, op,
            ": operands must be f32 or bf16, got ", dtype_name(a.dtype));
  check_gemm_dtypes(a, b, out, op);
}

}  // namespace

std::string gemm_impl_info(GemmOp op, DType dtype, int64_t m, int64_t n, int64_t k) {
  MOE_CHECK(m > 0 && n > 0 && k > 0, "gemm_impl_info: empty shape");
  MOE_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "gemm_impl_info: f32 or bf16 only");
  return tiles::first_tile_impl(op, dtype, m, n, k);
}

void linear_fwd(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate) {
  check_operands(x, w, y, "linear_fwd");
  const GemmDims dims = linear_fwd_dims(x, w, y);
  const int64_t m = dims.m, n = dims.n, k = dims.k;
  if (m == 0 || n == 0) return;
  float* out = static_cast<float*>(y.data);
  if (k == 0) {
    if (!accumulate) tiles::zero_rows(out, m, n);
    return;
  }
  tiles::linear_fwd(x.dtype, m, n, k, x.data, w.data, out, accumulate);
}

void linear_bwd_data(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate) {
  check_operands(dy, w, dx, "linear_bwd_data");
  const GemmDims dims = linear_bwd_data_dims(dy, w, dx);
  const int64_t m = dims.m, n = dims.n, k = dims.k;
  if (m == 0 || k == 0) return;
  float* out = static_cast<float*>(dx.data);
  if (n == 0) {
    if (!accumulate) tiles::zero_rows(out, m, k);
    return;
  }
  tiles::linear_bwd_data(dy.dtype, m, n, k, dy.data, w.data, out, accumulate);
}

void linear_bwd_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate) {
  check_operands(dy, x, dw, "linear_bwd_weight");
  const GemmDims dims = linear_bwd_weight_dims(dy, x, dw);
  const int64_t m = dims.m, n = dims.n, k = dims.k;
  if (n == 0 || k == 0) return;
  if (m == 0) {  // an empty sum
    if (!accumulate) tiles::zero_rows(static_cast<float*>(dw.data), n, k);
    return;
  }
  tiles::linear_bwd_weight(dy.dtype, m, n, k, dy.data, x.data, static_cast<float*>(dw.data), accumulate);
}

void grouped_linear_fwd(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& y) {
  check_operands(x, w, y, "grouped_linear_fwd");
  const GroupedDims dims = grouped_fwd_dims(x, w, y);
  const int64_t experts = dims.experts, n = dims.n, k = dims.k, r = dims.rows;
  const int32_t* off = checked_offsets(offsets, experts, r, "grouped_linear_fwd");
  if (off[experts] == 0 || n == 0) return;
  float* out = static_cast<float*>(y.data);
  if (k == 0) {
    tiles::zero_rows(out, off[experts], n);
    return;
  }
  tiles::grouped_fwd(x.dtype, n, k, x.data, w.data, off, experts, r, out);
}

void grouped_linear_bwd_data(const Tensor& dy, const Tensor& w, const Tensor& offsets,
                             const Tensor& dx) {
  check_operands(dy, w, dx, "grouped_linear_bwd_data");
  const GroupedDims dims = grouped_bwd_data_dims(dy, w, dx);
  const int64_t experts = dims.experts, n = dims.n, k = dims.k, r = dims.rows;
  const int32_t* off = checked_offsets(offsets, experts, r, "grouped_linear_bwd_data");
  if (off[experts] == 0 || k == 0) return;
  float* out = static_cast<float*>(dx.data);
  if (n == 0) {
    tiles::zero_rows(out, off[experts], k);
    return;
  }
  tiles::grouped_bwd_data(dy.dtype, n, k, dy.data, w.data, off, experts, r, out);
}

void grouped_linear_bwd_weight(const Tensor& dy, const Tensor& x, const Tensor& offsets,
                               const Tensor& dw, bool accumulate) {
  check_operands(dy, x, dw, "grouped_linear_bwd_weight");
  const GroupedDims dims = grouped_bwd_weight_dims(dy, x, dw);
  const int64_t experts = dims.experts, n = dims.n, k = dims.k, r = dims.rows;
  const int32_t* off = checked_offsets(offsets, experts, r, "grouped_linear_bwd_weight");
  if (n == 0 || k == 0) return;
  if (off[experts] == 0) {  // no rows: every dw an empty sum
    if (!accumulate) tiles::zero_rows(static_cast<float*>(dw.data), experts * n, k);
    return;
  }
  tiles::grouped_bwd_weight(dy.dtype, n, k, dy.data, x.data, off, experts, static_cast<float*>(dw.data),
                            accumulate);
}

}  // namespace moe::cpu
