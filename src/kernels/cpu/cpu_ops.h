// Fast CPU kernels: oneDNN GEMMs and OpenMP loops. Same list and semantics as kernels/ref.
#pragma once

#include "core/tensor.h"
#include "kernels/op_types.h"

namespace moe::cpu {
#define MOE_OP(name, params, args) void name params;
#include "kernels/op_list.inc"
#undef MOE_OP

// adamw with the gradient read times grad_scale and, when copy is given (bf16, param's size),
// bf16(param) written after the update (adamw_by_control's one pass).
void adamw_clipped_with_copy(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                             const Tensor& copy, double lr, double beta1, double beta2, double eps,
                             double weight_decay, int64_t step, double grad_scale);

// Threads used by the CPU kernels (OpenMP), and how many the machine offers.
void set_num_threads(int n);
int num_threads();
// OpenMP keeps the thread count per calling thread: a backend that runs these kernels on its own
// thread (strict) calls this there before each op, so set_num_threads on the host applies.
void adopt_thread_setting();
}  // namespace moe::cpu
