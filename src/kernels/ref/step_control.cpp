// step_control and the update ops it gates (kernels/op_list.inc, kernels/step_control.h).
#include <algorithm>
#include <cmath>

#include "kernels/gated_update.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/step_control.h"

namespace moe::ref {
void step_control(const Tensor& values, const Tensor& sumsq, double lm_z_coef, double lbl_coef, double router_z_coef,
                  double max_norm, const Tensor& lr_table, const Tensor& control) {
  gated::control_scalars(control, "step_control control");
  for (const Tensor* t : {&values, &sumsq, &lr_table}) check_dtype(*t, DType::kF64, "step_control");
  MOE_CHECK(values.numel() >= 2 && values.numel() % 2 == 0, "step_control: values ", values.shape_str(),
            " must be [ce, lm_z, lbl x M, router_z x M]");
  MOE_CHECK(lr_table.numel() >= 2, "step_control: the LR table needs entries for step 1 on");
  const double* v = values.as<double>();
  const double* sq = sumsq.as<double>();
  double* c = control.as<double>();
  double total = 0;
  for (int64_t i = 0; i < sumsq.numel(); ++i) total += sq[i];
  const double norm = std::sqrt(total);
  const int64_t M = (values.numel() - 2) / 2;
  double loss = v[0] + lm_z_coef * v[1];
  for (int64_t m = 0; m < M; ++m) loss += lbl_coef * v[2 + m];
  for (int64_t m = 0; m < M; ++m) loss += router_z_coef * v[2 + M + m];
  c[kCtlGradNorm] = norm;
  c[kCtlLoss] = loss;
  if (!std::isfinite(loss) || !std::isfinite(norm)) c[kCtlNonfinite] = 1;
  const double coef = max_norm > 0 ? max_norm / (norm + 1e-6) : 1.0;  // torch.nn.utils.clip_grad_norm_
  const bool clipped = max_norm > 0 && coef < 1.0;
  c[kCtlClipCoef] = clipped ? coef : 1.0;
  c[kCtlClipped] = clipped ? 1.0 : 0.0;
  const auto n = static_cast<int64_t>(c[kCtlUpdates]) + 1;
  c[kCtlLr] = lr_table.as<double>()[std::min(n, lr_table.numel() - 1)];
  if (c[kCtlNonfinite] == 0) c[kCtlUpdates] = static_cast<double>(n);
}

void clip_by_control(const Tensor& x, const Tensor& control) {
  gated::clip(x, control, [](const Tensor& t, double a) { scale(t, a); });
}

void adamw_by_control(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& control,
                      double beta1, double beta2, double eps, double weight_decay) {
  gated::adamw(param, grad, m, v, control, beta1, beta2, eps, weight_decay,
               [](auto&&... a) { adamw(a...); });
}

void router_bias_update_by_control(const Tensor& step_counts, double gamma, const Tensor& bias, const Tensor& control) {
  gated::router_bias(step_counts, gamma, bias, control, [](auto&&... a) { router_bias_update(a...); });
}

}  // namespace moe::ref
