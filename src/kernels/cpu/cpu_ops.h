// Fast CPU kernels: oneDNN GEMMs and OpenMP loops. Same list and semantics as kernels/ref.
#pragma once

#include "core/tensor.h"
#include "kernels/op_types.h"

namespace moe::cpu {
#define MOE_OP(name, params, args) void name params;
#include "kernels/op_list.inc"
#undef MOE_OP

// Threads used by the CPU kernels (OpenMP), and how many the machine offers.
void set_num_threads(int n);
int num_threads();
// OpenMP keeps the thread count per calling thread: a backend that runs these kernels on its own
// thread (strict) calls this there before each op, so set_num_threads on the host applies.
void adopt_thread_setting();
}  // namespace moe::cpu
