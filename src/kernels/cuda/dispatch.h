// Host-side dispatch of the CUDA ops over storage types (f32, bf16), and the checks every op makes
// before it enqueues anything. f64 is refused: the reference backend owns that precision.
#pragma once

#include "core/tensor.h"
#include "kernels/cuda/context.h"

namespace moe::cuda {

struct bf16s;  // device.cuh

[[noreturn]] void fail_dtype(DType t, const char* op);

// f(float*) for f32 data, f(bf16s*) for bf16; anything else fails naming the op.
template <class F> void dispatch_storage(DType t, const char* op, F&& f) {
  if (t == DType::kF32) {
    f(static_cast<float*>(nullptr));
  } else if (t == DType::kBF16) {
    f(static_cast<bf16s*>(nullptr));
  } else {
    fail_dtype(t, op);
  }
}
// The dtype-agnostic ops (fill, convert, scale, axpy, sum_to: step statistics and control scalars are
// f64): f(double*) too.
template <class F> void dispatch_any(DType t, const char* op, F&& f) {
  if (t == DType::kF64) {
    f(static_cast<double*>(nullptr));
  } else {
    dispatch_storage(t, op, f);
  }
}
// f32 only (the compute dtype of most ops).
inline void require_f32(const Tensor& t, const char* op) {
  if (t.dtype != DType::kF32) fail_dtype(t.dtype, op);
}

template <class P> P* ptr(const Tensor& t) { return static_cast<P*>(t.data); }

}  // namespace moe::cuda
