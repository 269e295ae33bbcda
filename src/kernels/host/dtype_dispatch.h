// Dtype dispatch shared by every backend: calls f(T{}) with the C++ type of a tensor's dtype.
#pragma once

#include "core/tensor.h"

namespace moe {

// T = float or double.
template <class F> void dispatch_real(DType t, const char* op, F&& f) {
  if (t == DType::kF32) {
    f(float{});
  } else if (t == DType::kF64) {
    f(double{});
  } else {
    MOE_FAIL(op, ": dtype ", dtype_name(t), " not supported (f32 or f64)");
  }
}

// Same, with bf16 as a third storage type.
template <class F> void dispatch_any_float(DType t, const char* op, F&& f) {
  if (t == DType::kBF16) {
    f(bf16{});
  } else {
    dispatch_real(t, op, f);
  }
}

}  // namespace moe
