// The device rule of the host backends (ref, cpu; strict runs cpu's kernels on host views):
// every tensor an op is given lives in host memory. Written once for both.
#pragma once

#include <initializer_list>

#include "core/tensor.h"

namespace moe {

// Every tensor given, empty ones aside, in host memory.
inline void check_host(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    MOE_CHECK(t->data == nullptr || t->device == Device::kCpu, op, ": tensor ", t->shape_str(), " is not on the host");
}

// Every tensor given in host memory and of the given dtype.
inline void check_host(std::initializer_list<const Tensor*> ts, DType dtype, const char* op) {
  for (const Tensor* t : ts) {
    MOE_CHECK(t->device == Device::kCpu, op, ": tensor ", t->shape_str(), " is not on the host");
    MOE_CHECK(t->dtype == dtype, op, ": tensor ", t->shape_str(), " has dtype ", dtype_name(t->dtype), ", expected ",
              dtype_name(dtype));
  }
}

}  // namespace moe
