// Reference GEMM family: plain loops, written to be obviously right, not fast.
// Operands are f64 (output f64), f32 (output f32) or bf16 (converted to float, output f32).
// Every dot product accumulates in the output precision, in increasing index order, and is
// added to the old output value only at the end (as the fast kernels' "sum" post-op does).
#include <cstdint>
#include <vector>

#include "kernels/checks/gemm_checks.h"
#include "kernels/host/host_args.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {
namespace {

void check_operands(const Tensor& a, const Tensor& b, const Tensor& out, const char* op) {
  check_host({&a, &b, &out}, op);
  MOE_CHECK(a.dtype == DType::kF64 || a.dtype == DType::kF32 || a.dtype == DType::kBF16, op,
            ": operands must be f64, f32 or bf16, got ", dtype_name(a.dtype));
  check_gemm_dtypes(a, b, out, op);
}

// y(m,n) (+)= x(m,k) * w(n,k)^T
template <class T, class A>
void fwd(const T* x, const T* w, A* y, int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      A acc = 0;
      for (int64_t l = 0; l < k; ++l)
        acc += static_cast<A>(to_float(x[i * k + l])) * static_cast<A>(to_float(w[j * k + l]));
      y[i * n + j] = accumulate ? y[i * n + j] + acc : acc;
    }
}

// dx(m,k) (+)= dy(m,n) * w(n,k)
template <class T, class A>
void bwd_data(const T* dy, const T* w, A* dx, int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t l = 0; l < k; ++l) {
      A acc = 0;
      for (int64_t j = 0; j < n; ++j)
        acc += static_cast<A>(to_float(dy[i * n + j])) * static_cast<A>(to_float(w[j * k + l]));
      dx[i * k + l] = accumulate ? dx[i * k + l] + acc : acc;
    }
}

// dw(n,k) (+)= dy(m,n)^T * x(m,k)
template <class T, class A>
void bwd_weight(const T* dy, const T* x, A* dw, int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t l = 0; l < k; ++l) {
      A acc = 0;
      for (int64_t i = 0; i < m; ++i)
        acc += static_cast<A>(to_float(dy[i * n + j])) * static_cast<A>(to_float(x[i * k + l]));
      dw[j * k + l] = accumulate ? dw[j * k + l] + acc : acc;
    }
}

// Calls f(T*, A*) tag values for the operand dtype: (double, double), (float, float) or
// (bf16, float).
template <class F>
void dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF64:
      f(static_cast<const double*>(nullptr), static_cast<double*>(nullptr));
      break;
    case DType::kF32:
      f(static_cast<const float*>(nullptr), static_cast<float*>(nullptr));
      break;
    case DType::kBF16:
      f(static_cast<const bf16*>(nullptr), static_cast<float*>(nullptr));
      break;
    default:
      MOE_FAIL("GEMM operands must be f64, f32 or bf16, got ", dtype_name(dtype));
  }
}

template <class P>
P* ptr(const Tensor& t, P*) {
  return static_cast<P*>(t.data);
}

}  // namespace

void linear_fwd(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate) {
  check_operands(x, w, y, "linear_fwd");
  const GemmDims dims = linear_fwd_dims(x, w, y);
  const int64_t m = dims.m, n = dims.n, k = dims.k;
  dispatch(x.dtype,
           [&](auto t, auto a) { fwd(ptr(x, t), ptr(w, t), ptr(y, a), m, n, k, accumulate); });
}

void linear_bwd_data(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate) {
  check_operands(dy, w, dx, "linear_bwd_data");
  const GemmDims dims = linear_bwd_data_dims(dy, w, dx);
  const int64_t m = dims.m, n = dims.n, k = dims.k;
  dispatch(dy.dtype, [&](auto t, auto a) {
    bwd_data(ptr(dy, t), ptr(w, t), ptr(dx, a), m, n, k, accumulate);
  });
}

void linear_bwd_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate) {
  check_operands(dy, x, dw, "linear_bwd_weight");
  const GemmDims dims = linear_bwd_weight_dims(dy, x, dw);
  const int64_t m = dims.m, n = dims.n, k = dims.k;
  dispatch(dy.dtype,
           [&](auto t, auto a) { bwd_weight(ptr(dy, t), ptr(x, t), ptr(dw, a), m, n, k, accumulate); });
}

void grouped_linear_fwd(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& y) {
  check_operands(x, w, y, "grouped_linear_fwd");
  const GroupedDims dims = grouped_fwd_dims(x, w, y);
  const int64_t e_count = dims.experts, n = dims.n, k = dims.k, r = dims.rows;
  auto off = checked_offsets(offsets, e_count, r, "grouped_linear_fwd");
  dispatch(x.dtype, [&](auto t, auto a) {
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t r0 = off[static_cast<size_t>(e)], rows = off[static_cast<size_t>(e) + 1] - r0;
      fwd(ptr(x, t) + r0 * k, ptr(w, t) + e * n * k, ptr(y, a) + r0 * n, rows, n, k, false);
    }
  });
}

void grouped_linear_bwd_data(const Tensor& dy, const Tensor& w, const Tensor& offsets,
                             const Tensor& dx) {
  check_operands(dy, w, dx, "grouped_linear_bwd_data");
  const GroupedDims dims = grouped_bwd_data_dims(dy, w, dx);
  const int64_t e_count = dims.experts, n = dims.n, k = dims.k, r = dims.rows;
  auto off = checked_offsets(offsets, e_count, r, "grouped_linear_bwd_data");
  dispatch(dy.dtype, [&](auto t, auto a) {
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t r0 = off[static_cast<size_t>(e)], rows = off[static_cast<size_t>(e) + 1] - r0;
      bwd_data(ptr(dy, t) + r0 * n, ptr(w, t) + e * n * k, ptr(dx, a) + r0 * k, rows, n, k, false);
    }
  });
}

void grouped_linear_bwd_weight(const Tensor& dy, const Tensor& x, const Tensor& offsets,
                               const Tensor& dw, bool accumulate) {
  check_operands(dy, x, dw, "grouped_linear_bwd_weight");
  const GroupedDims dims = grouped_bwd_weight_dims(dy, x, dw);
  const int64_t e_count = dims.experts, n = dims.n, k = dims.k, r = dims.rows;
  auto off = checked_offsets(offsets, e_count, r, "grouped_linear_bwd_weight");
  dispatch(dy.dtype, [&](auto t, auto a) {
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t r0 = off[static_cast<size_t>(e)], rows = off[static_cast<size_t>(e) + 1] - r0;
      if (rows == 0 && accumulate) continue;  // a zero-row expert adds nothing (else: zeros)
      bwd_weight(ptr(dy, t) + r0 * n, ptr(x, t) + r0 * k, ptr(dw, a) + e * n * k, rows, n, k, accumulate);
    }
  });
}

}  // namespace moe::ref
