#include "kernels/elementwise_checks.h"

#include <cmath>

namespace moe {

void check_rope_args(const Tensor& x, double theta, int64_t rotary_dim, const char* op) {
  check_shape(x, {-1, -1, -1, -1}, op);
  MOE_CHECK(x.dim(3) % 2 == 0, op, ": head dim ", x.dim(3), " must be even");
  MOE_CHECK(rotary_dim >= 2 && rotary_dim <= x.dim(3) && rotary_dim % 2 == 0, op, ": rotary_dim ", rotary_dim,
            " must be even and within [2, head dim ", x.dim(3), "]");
  MOE_CHECK(theta > 0, op, ": theta must be positive, got ", theta);
}

void check_clamp_args(const Tensor* dy, const Tensor& x, double limit, const Tensor& out, const char* op) {
  MOE_CHECK(std::isfinite(limit) && limit > 0, op, ": limit must be finite and positive, got ", limit);
  MOE_CHECK(x.dtype == DType::kF32 || x.dtype == DType::kF64, op, ": x must be f32 or f64, got ", dtype_name(x.dtype));
  check_same_shape(x, out, op);
  check_dtype(out, x.dtype, op);
  if (dy) {
    check_same_shape(x, *dy, op);
    check_dtype(*dy, x.dtype, op);
  }
}

}  // namespace moe
