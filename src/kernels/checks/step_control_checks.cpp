#include "kernels/checks/step_control_checks.h"

#include "core/check.h"
#include "kernels/step_control.h"

namespace moe {

void check_control(const Tensor& control, const char* op) {
  check_dtype(control, DType::kF64, op);
  check_shape(control, {kCtlSize}, op);
}

void check_adamw_copy(const Tensor& param, const Tensor& param_copy) {
  if (param_copy.empty()) return;
  check_dtype(param_copy, DType::kBF16, "adamw_by_control param_copy");
  MOE_CHECK(param_copy.numel() == param.numel(), "adamw_by_control: param_copy ", param_copy.shape_str(),
            " must have param's ", param.numel(), " elements");
}

void check_step_control(const Tensor& values, const Tensor& sumsq, const Tensor& lr_table, const Tensor& control) {
  check_control(control, "step_control control");
  for (const Tensor* t : {&values, &sumsq, &lr_table}) check_dtype(*t, DType::kF64, "step_control");
  MOE_CHECK(values.numel() >= 2 && values.numel() % 2 == 0, "step_control: values ", values.shape_str(),
            " must be [ce, lm_z, lbl x M, router_z x M]");
  MOE_CHECK(lr_table.numel() >= 2, "step_control: the LR table needs entries for step 1 on");
}

}  // namespace moe
