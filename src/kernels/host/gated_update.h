// The update ops that step_control gates (kernels/op_list.inc), written once over a backend's
// own adamw / router_bias_update: each reads the control scalars in the backend's memory
// and runs the ungated op with them, so the result is bitwise the ungated op's.
#pragma once

#include "core/tensor.h"
#include "kernels/checks/step_control_checks.h"
#include "kernels/step_control.h"

namespace moe::gated {

inline const double* control_scalars(const Tensor& control, const char* op) {
  check_control(control, op);
  return control.as<double>();
}

// adamw_op(param, grad, m, v, copy, lr, beta1, beta2, eps, weight_decay, step, grad_scale).
template <class AdamW>
void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& control, double beta1,
           double beta2, double eps, double weight_decay, const Tensor& param_copy, AdamW adamw_op) {
  const double* c = control_scalars(control, "adamw_by_control control");
  check_adamw_copy(param, param_copy);
  if (c[kCtlNonfinite] != 0) return;
  adamw_op(param, grad, m, v, param_copy, c[kCtlLr], beta1, beta2, eps, weight_decay,
           static_cast<int64_t>(c[kCtlUpdates]), c[kCtlClipped] != 0 ? c[kCtlClipCoef] : 1.0);
}

template <class Update>
void router_bias(const Tensor& step_counts, double gamma, const Tensor& bias, const Tensor& control, Update update) {
  const double* c = control_scalars(control, "router_bias_update_by_control control");
  if (c[kCtlNonfinite] == 0) update(step_counts, gamma, bias);
}

}  // namespace moe::gated
