// The kernel seam. Model code calls ops only through a Backend; a backend implements every op
// of kernels/op_list.inc (same names, same arguments) as free functions in its own namespace.
//   ref  -- plain scalar loops, f32 and f64: the oracle every fast op is tested against, and
//           the f64 path that must match the PyTorch fixtures to 1e-10.
//   cpu  -- oneDNN GEMMs + OpenMP kernels, f32 and bf16 GEMM operands.
//   cuda -- later; same list. A backend may throw moe::Error("... not supported") for an op it
//           lacks; tests treat that as a skip, never a pass.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace moe {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual Device device() const = 0;

#define MOE_OP(name, params, args) virtual void name params = 0;
#include "kernels/op_list.inc"
#undef MOE_OP
};

// "ref" or "cpu"; anything else is an error naming the choices.
std::unique_ptr<Backend> make_backend(const std::string& name);

}  // namespace moe
