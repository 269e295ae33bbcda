// step_control and the gated update ops: the scalars are read here (the backend's own memory),
// then the cpu kernels run with them, so the results are bitwise those of the ungated ops.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/step_control.h"

namespace moe::cpu {
namespace {
const double* checked_control(const Tensor& control, const char* op) {
  check_dtype(control, DType::kF64, op);
  check_shape(control, {kCtlSize}, op);
  return control.as<double>();
}
}  // namespace

void step_control(const Tensor& values, const Tensor& sumsq, double lm_z_coef, double lbl_coef, double router_z_coef,
                  double max_norm, const Tensor& lr_table, const Tensor& control) {
  // A few hundred scalar operations per step: the reference is the fast path.
  ref::step_control(values, sumsq, lm_z_coef, lbl_coef, router_z_coef, max_norm, lr_table, control);
}

void clip_by_control(const Tensor& x, const Tensor& control) {
  const double* c = checked_control(control, "clip_by_control control");
  if (c[kCtlClipped] != 0 && c[kCtlNonfinite] == 0) scale(x, c[kCtlClipCoef]);
}

void adamw_by_control(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& control,
                      double beta1, double beta2, double eps, double weight_decay) {
  const double* c = checked_control(control, "adamw_by_control control");
  if (c[kCtlNonfinite] != 0) return;
  adamw(param, grad, m, v, c[kCtlLr], beta1, beta2, eps, weight_decay, static_cast<int64_t>(c[kCtlUpdates]));
}

void router_bias_update_by_control(const Tensor& step_counts, double gamma, const Tensor& bias, const Tensor& control) {
  const double* c = checked_control(control, "router_bias_update_by_control control");
  if (c[kCtlNonfinite] == 0) router_bias_update(step_counts, gamma, bias);
}

}  // namespace moe::cpu
