// Reference kernels: plain loops in the tensor's own precision (f32 or f64), written to be
// obviously right, not fast. Every fast kernel is tested against these.
#pragma once

#include "core/tensor.h"
#include "kernels/op_types.h"

namespace moe::ref {
#define MOE_OP(name, params, args) void name params;
#include "kernels/op_list.inc"
#undef MOE_OP
}  // namespace moe::ref
