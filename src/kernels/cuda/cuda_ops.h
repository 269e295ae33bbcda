// The CUDA kernels: every op of kernels/op_list.inc, same names and arguments, each taking the
// backend's Context first (its stream, library handles, scratch and error word). Tensors are
// device tensors of this backend; every op only enqueues work on ctx.stream and never waits.
// f64 is the reference's precision and is not supported here (Backend::supports says so).
#pragma once

#include "core/tensor.h"
#include "kernels/op_types.h"

namespace moe::cuda {

struct Context;  // kernels/cuda/context.h

#define MOE_CUDA_PARAMS(...) (Context & ctx, __VA_ARGS__)
#define MOE_OP(name, params, args) void name MOE_CUDA_PARAMS params;
#include "kernels/op_list.inc"
#undef MOE_OP
#undef MOE_CUDA_PARAMS

}  // namespace moe::cuda
