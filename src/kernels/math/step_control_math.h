// The arithmetic of the step_control op (kernels/op_list.inc) over raw f64 arrays, compiled from
// this one text by the reference backend (kernels/ref/step_control.cpp; cpu runs it too) and the
// CUDA kernel (kernels/cuda/step_control.cuh): the step's decisions must be the same everywhere.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "kernels/step_control.h"

namespace moe {

// The step's total loss: ce + lm_z_coef lm_z + lbl_coef * each lbl + router_z_coef * each
// router_z, one written-out fused multiply-add per term, in that order. Left to the compiler's
// contraction, two copies of this formula differed in the last bit in one build (ASan, on an
// Intel Xeon); the host's total (train/trainer.cpp) calls this one.
MOE_HD inline double step_total_loss(double ce, double lm_z, const double* lbl, int64_t nlbl, const double* router_z,
                                     int64_t nz, double lm_z_coef, double lbl_coef, double router_z_coef) {
  double loss = std::fma(lm_z_coef, lm_z, ce);
  for (int64_t m = 0; m < nlbl; ++m) loss = std::fma(lbl_coef, lbl[m], loss);
  for (int64_t m = 0; m < nz; ++m) loss = std::fma(router_z_coef, router_z[m], loss);
  return loss;
}

// c (kCtlSize) from values (nv) = [ce, lm_z, lbl x M, router_z x M], the per-parameter sums of
// squares sq (nsq) and lr_table (nlr): op_list.inc's step_control, in its order.
MOE_HD inline void step_control_scalars(const double* v, int64_t nv, const double* sq, int64_t nsq, double lm_z_coef,
                                        double lbl_coef, double router_z_coef, double max_norm,
                                        const double* lr_table, int64_t nlr, double* c) {
  double total = 0;
  for (int64_t i = 0; i < nsq; ++i) total += sq[i];
  const double norm = std::sqrt(total);
  const int64_t M = (nv - 2) / 2;
  const double loss = step_total_loss(v[0], v[1], v + 2, M, v + 2 + M, M, lm_z_coef, lbl_coef, router_z_coef);
  c[kCtlGradNorm] = norm;
  c[kCtlLoss] = loss;
  if (!std::isfinite(loss) || !std::isfinite(norm)) c[kCtlNonfinite] = 1;
  const double coef = max_norm > 0 ? max_norm / (norm + 1e-6) : 1.0;  // torch.nn.utils.clip_grad_norm_
  const bool clipped = max_norm > 0 && coef < 1.0;
  c[kCtlClipCoef] = clipped ? coef : 1.0;
  c[kCtlClipped] = clipped ? 1.0 : 0.0;
  const auto n = static_cast<int64_t>(c[kCtlUpdates]) + 1;
  c[kCtlLr] = lr_table[n < nlr - 1 ? n : nlr - 1];
  if (c[kCtlNonfinite] == 0) c[kCtlUpdates] = static_cast<double>(n);
}

}  // namespace moe
