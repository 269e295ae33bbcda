// step_control and the update ops it gates (kernels/op_list.inc, kernels/step_control.h).
#include "kernels/checks/step_control_checks.h"
#include "kernels/host/gated_update.h"
#include "kernels/host/host_args.h"
#include "kernels/math/step_control_math.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {
void step_control(const Tensor& values, const Tensor& sumsq, double lm_z_coef, double lbl_coef, double router_z_coef,
                  double max_norm, const Tensor& lr_table, const Tensor& control) {
  check_host({&values, &sumsq, &lr_table, &control}, "step_control");
  check_step_control(values, sumsq, lr_table, control);
  step_control_scalars(values.as<double>(), values.numel(), sumsq.as<double>(), sumsq.numel(), lm_z_coef, lbl_coef,
                       router_z_coef, max_norm, lr_table.as<double>(), lr_table.numel(), control.as<double>());
}

void clip_by_control(const Tensor& x, const Tensor& control) { gated::clip(x, control, scale); }

void adamw_by_control(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& control,
                      double beta1, double beta2, double eps, double weight_decay) {
  gated::adamw(param, grad, m, v, control, beta1, beta2, eps, weight_decay, adamw);
}

void router_bias_update_by_control(const Tensor& step_counts, double gamma, const Tensor& bias, const Tensor& control) {
  gated::router_bias(step_counts, gamma, bias, control, router_bias_update);
}

}  // namespace moe::ref
