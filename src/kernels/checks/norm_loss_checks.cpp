#include "kernels/checks/norm_loss_checks.h"

#include "core/check.h"

namespace moe {
namespace {
// c: the compute dtype (x's, or f32 for a bf16 x).
void check_norm_shapes(const Tensor& x, DType c, const Tensor& w, const Tensor& rstd, const char* op) {
  MOE_CHECK(x.ndim >= 1, op, ": x must have at least one dimension");
  check_shape(w, {x.cols()}, op);
  check_shape(rstd, {x.rows()}, op);
  check_dtype(w, c, op);
  check_dtype(rstd, c, op);
}
}  // namespace

void check_rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd) {
  check_norm_shapes(x, x.dtype, w, rstd, "rmsnorm_fwd w/rstd");
  check_same_shape(x, y, "rmsnorm_fwd x/y");
  check_output_dtype(y, x.dtype, "rmsnorm_fwd y");
}

void check_rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                       const Tensor& dw, bool accumulate) {
  const DType c = x.dtype == DType::kBF16 ? DType::kF32 : x.dtype;  // a bf16 x: saved QK-norm input
  check_norm_shapes(x, c, w, rstd, "rmsnorm_bwd w/rstd");
  check_same_shape(x, dy, "rmsnorm_bwd x/dy");
  check_same_shape(x, dx, "rmsnorm_bwd x/dx");
  check_same_shape(w, dw, "rmsnorm_bwd w/dw");
  check_dtype(dy, c, "rmsnorm_bwd dy");
  check_dtype(dw, c, "rmsnorm_bwd dw");
  if (accumulate) check_dtype(dx, c, "rmsnorm_bwd dx (accumulated)");
  else check_output_dtype(dx, c, "rmsnorm_bwd dx");
}

CrossEntropyDims check_cross_entropy(const Tensor& logits, const Tensor& labels, const Tensor& dlogits,
                                     const Tensor& row_ce, const Tensor& row_z) {
  check_shape(logits, {-1, -1}, "cross_entropy logits");
  const CrossEntropyDims d{logits.dim(0), logits.dim(1)};
  check_same_shape(logits, dlogits, "cross_entropy logits/dlogits");
  check_output_dtype(dlogits, logits.dtype, "cross_entropy dlogits");
  check_dtype(labels, DType::kI32, "cross_entropy labels");
  check_shape(labels, {d.rows}, "cross_entropy labels");
  check_shape(row_ce, {d.rows}, "cross_entropy row_ce");
  check_shape(row_z, {d.rows}, "cross_entropy row_z");
  check_dtype(row_ce, logits.dtype, "cross_entropy row_ce");
  check_dtype(row_z, logits.dtype, "cross_entropy row_z");
  return d;
}

const int32_t* checked_labels(const Tensor& labels, int64_t vocab) {
  const int32_t* l = labels.as<int32_t>();
  for (int64_t r = 0; r < labels.numel(); ++r)
    MOE_CHECK(l[r] < vocab, "cross_entropy: label ", l[r], " at row ", r, " is out of range for vocab size ", vocab);
  return l;
}

}  // namespace moe
