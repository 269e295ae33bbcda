// step_control and the gated update ops: the scalars are read here (the backend's own memory),
// then the cpu kernels run with them, so the results are bitwise those of the ungated ops.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/host/gated_update.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/step_control.h"

namespace moe::cpu {
void step_control(const Tensor& values, const Tensor& sumsq, double lm_z_coef, double lbl_coef, double router_z_coef,
                  double max_norm, const Tensor& lr_table, const Tensor& control) {
  // A few hundred scalar operations per step: the reference is the fast path.
  ref::step_control(values, sumsq, lm_z_coef, lbl_coef, router_z_coef, max_norm, lr_table, control);
}

void adamw_by_control(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& control,
                      double beta1, double beta2, double eps, double weight_decay, const Tensor& param_copy) {
  gated::adamw(param, grad, m, v, control, beta1, beta2, eps, weight_decay, param_copy, adamw_clipped_with_copy);
}

void router_bias_update_by_control(const Tensor& step_counts, double gamma, const Tensor& bias, const Tensor& control) {
  gated::router_bias(step_counts, gamma, bias, control, router_bias_update);
}

}  // namespace moe::cpu
