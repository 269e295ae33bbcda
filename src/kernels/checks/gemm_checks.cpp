#include "kernels/checks/gemm_checks.h"

#include "core/check.h"

namespace moe {

GemmDims linear_fwd_dims(const Tensor& x, const Tensor& w, const Tensor& y) {
  MOE_CHECK(w.ndim == 2, "linear_fwd: w must be (N,K), got ", w.shape_str());
  const GemmDims d{x.rows(), w.dim(0), w.dim(1)};
  MOE_CHECK(x.cols() == d.k, "linear_fwd: x ", x.shape_str(), " does not match w ", w.shape_str());
  MOE_CHECK(y.rows() == d.m && y.cols() == d.n, "linear_fwd: y ", y.shape_str(), " must be (", d.m, ",", d.n, ")");
  return d;
}

GemmDims linear_bwd_data_dims(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  MOE_CHECK(w.ndim == 2, "linear_bwd_data: w must be (N,K), got ", w.shape_str());
  const GemmDims d{dy.rows(), w.dim(0), w.dim(1)};
  MOE_CHECK(dy.cols() == d.n, "linear_bwd_data: dy ", dy.shape_str(), " does not match w ", w.shape_str());
  MOE_CHECK(dx.rows() == d.m && dx.cols() == d.k, "linear_bwd_data: dx ", dx.shape_str(), " must be (", d.m, ",",
            d.k, ")");
  return d;
}

GemmDims linear_bwd_weight_dims(const Tensor& dy, const Tensor& x, const Tensor& dw) {
  MOE_CHECK(dw.ndim == 2, "linear_bwd_weight: dw must be (N,K), got ", dw.shape_str());
  const GemmDims d{dy.rows(), dw.dim(0), dw.dim(1)};
  MOE_CHECK(dy.cols() == d.n && x.rows() == d.m && x.cols() == d.k, "linear_bwd_weight: dy ", dy.shape_str(),
            ", x ", x.shape_str(), " and dw ", dw.shape_str(), " do not match");
  return d;
}

namespace {
// a(R,A) against w(E,N,K) and out(R,O), where (A,O) is (K,N) forward and (N,K) for bwd_data.
GroupedDims grouped_dims(const Tensor& a, const Tensor& w, const Tensor& out, bool forward, const char* op) {
  MOE_CHECK(w.ndim == 3, op, ": w must be (E,N,K), got ", w.shape_str());
  const GroupedDims d{w.dim(0), w.dim(1), w.dim(2), a.rows()};
  const int64_t in_cols = forward ? d.k : d.n, out_cols = forward ? d.n : d.k;
  MOE_CHECK(a.cols() == in_cols && out.rows() == d.rows && out.cols() == out_cols, op, ": ",
            forward ? "x " : "dy ", a.shape_str(), ", w ", w.shape_str(), " and ", forward ? "y " : "dx ",
            out.shape_str(), " do not match");
  return d;
}
}  // namespace

GroupedDims grouped_fwd_dims(const Tensor& x, const Tensor& w, const Tensor& y) {
  return grouped_dims(x, w, y, true, "grouped_linear_fwd");
}

GroupedDims grouped_bwd_data_dims(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  return grouped_dims(dy, w, dx, false, "grouped_linear_bwd_data");
}

GroupedDims grouped_bwd_weight_dims(const Tensor& dy, const Tensor& x, const Tensor& dw) {
  MOE_CHECK(dw.ndim == 3, "grouped_linear_bwd_weight: dw must be (E,N,K), got ", dw.shape_str());
  const GroupedDims d{dw.dim(0), dw.dim(1), dw.dim(2), dy.rows()};
  MOE_CHECK(dy.cols() == d.n && x.rows() == d.rows && x.cols() == d.k, "grouped_linear_bwd_weight: dy ",
            dy.shape_str(), ", x ", x.shape_str(), " and dw ", dw.shape_str(), " do not match");
  return d;
}

void check_gemm_dtypes(const Tensor& a, const Tensor& b, const Tensor& out, const char* op) {
  MOE_CHECK(b.dtype == a.dtype, op, ": operands must share a dtype, got ", dtype_name(a.dtype), " and ",
            dtype_name(b.dtype));
  check_dtype(out, a.dtype == DType::kF64 ? DType::kF64 : DType::kF32, op);
}

const int32_t* checked_offsets(const Tensor& offsets, int64_t experts, int64_t rows, const char* op) {
  check_dtype(offsets, DType::kI32, op);
  check_shape(offsets, {experts + 1}, op);
  MOE_CHECK(offsets.device == Device::kCpu, op, ": offsets must be a host tensor");
  const int32_t* o = offsets.as<int32_t>();
  MOE_CHECK(o[0] == 0, op, ": offsets[0] must be 0, got ", o[0]);
  for (int64_t e = 1; e <= experts; ++e)
    MOE_CHECK(o[e] >= o[e - 1], op, ": offsets must be non-decreasing, offsets[", e, "] = ", o[e], " < offsets[",
              e - 1, "] = ", o[e - 1]);
  MOE_CHECK(o[experts] <= rows, op, ": offsets[E] = ", o[experts], " exceeds the ", rows, " rows of the operands");
  return o;
}

}  // namespace moe
