// Argument contracts of step_control and the update ops it gates (op_list.inc: step_control,
// adamw_by_control, router_bias_update_by_control), checked once for every
// backend. The gated ops' other arguments are their ungated ops' (elementwise and routing checks).
#pragma once

#include "core/tensor.h"

namespace moe {

// control (kCtlSize) f64: one step's control scalars (kernels/step_control.h).
void check_control(const Tensor& control, const char* op);
// values (2 + 2M) f64 = [ce, lm_z, lbl x M, router_z x M], sumsq (P) f64, lr_table (S >= 2) f64
// (an entry for step 1 on), control as above.
void check_step_control(const Tensor& values, const Tensor& sumsq, const Tensor& lr_table, const Tensor& control);
// adamw_by_control's param_copy: empty, or bf16 with param's element count.
void check_adamw_copy(const Tensor& param, const Tensor& param_copy);

}  // namespace moe
