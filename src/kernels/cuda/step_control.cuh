// CUDA step control: the step_control op of kernels/ref/step_control.cpp (contracts:
// kernels/op_list.inc, kernels/checks/step_control_checks.h). The update ops it gates run their
// ungated kernels with the control scalars read on the device (adamw_by_control: elementwise.cu; router_bias_update_by_control: moe_routing.cu). Compiled inside moe_routing.cu
// (one nvcc unit for the routing-side families), its only includer.
#pragma once

#include "kernels/checks/step_control_checks.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/math/step_control_math.h"

namespace moe::cuda {
namespace {

// One thread: the reference's arithmetic (kernels/math/step_control_math.h) over a few hundred values.
__global__ void step_control_kernel(const double* v, int64_t nv, const double* sq, int64_t nsq, double lm_z_coef,
                                    double lbl_coef, double router_z_coef, double max_norm, const double* lr_table,
                                    int64_t nlr, double* c) {
  step_control_scalars(v, nv, sq, nsq, lm_z_coef, lbl_coef, router_z_coef, max_norm, lr_table, nlr, c);
}

}  // namespace

void step_control(Context& ctx, const Tensor& values, const Tensor& sumsq, double lm_z_coef, double lbl_coef,
                  double router_z_coef, double max_norm, const Tensor& lr_table, const Tensor& control) {
  check_device({&values, &sumsq, &lr_table, &control}, "step_control");
  check_step_control(values, sumsq, lr_table, control);
  step_control_kernel<<<1, 1, 0, ctx.stream>>>(ptr<const double>(values), values.numel(), ptr<const double>(sumsq),
                                               sumsq.numel(), lm_z_coef, lbl_coef, router_z_coef, max_norm,
                                               ptr<const double>(lr_table), lr_table.numel(), ptr<double>(control));
  check_launch("step_control");
}

}  // namespace moe::cuda
