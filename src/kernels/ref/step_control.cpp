// step_control and the update ops it gates (kernels/op_list.inc, kernels/step_control.h).
#include "core/buffer.h"
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

// By its definition: scale a copy of the gradient, adamw, convert.
void adamw_by_control(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& control,
                      double beta1, double beta2, double eps, double weight_decay, const Tensor& param_copy) {
  check_host({&param, &grad, &m, &v, &control, &param_copy}, "adamw_by_control");
  gated::adamw(param, grad, m, v, control, beta1, beta2, eps, weight_decay, param_copy,
               [](const Tensor& p, const Tensor& g, const Tensor& pm, const Tensor& pv, const Tensor& copy, double lr,
                  double b1, double b2, double e, double wd, int64_t step, double grad_scale) {
                 const int64_t n = g.numel();
                 OwnedTensor scaled(g.dtype, {n});
                 convert(g.view({n}), scaled);
                 scale(scaled, grad_scale);
                 adamw(p.view({n}), scaled, pm.view({n}), pv.view({n}), lr, b1, b2, e, wd, step);
                 if (!copy.empty()) convert(p.view({n}), copy.view({n}));
               });
}

void router_bias_update_by_control(const Tensor& step_counts, double gamma, const Tensor& bias, const Tensor& control) {
  gated::router_bias(step_counts, gamma, bias, control, router_bias_update);
}

}  // namespace moe::ref
