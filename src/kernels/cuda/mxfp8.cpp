// MXFP8 on cuda: not yet. The format, the ops' contracts and the K-major operand layout are the
// ones a Blackwell block-scaled GEMM (CUTLASS, cuBLASLt's VEC32_UE8M0 mode) consumes; the kernels
// belong to a later issue. cuda_supports() says false for these ops, so the op tests report skips
// (tests/kernels/expected_skips.txt) and a run asking for train.precision = "mxfp8" on cuda fails
// at its first MXFP8 op with this message.
#include "core/check.h"
#include "kernels/cuda/cuda_ops.h"

namespace moe::cuda {
namespace {
[[noreturn]] void unsupported(const char* op) {
  MOE_FAIL(op, " not supported on cuda (MXFP8 runs on the ref and cpu backends for now)");
}
}  // namespace

void mx_quantize(Context&, const Tensor&, bool, mx::ScaleRule, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("mx_quantize");
}
void mx_quantize_swizzled(Context&, const Tensor&, mx::ScaleRule, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("mx_quantize_swizzled");
}
void mx_dequantize(Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("mx_dequantize");
}
void mx_linear(Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) {
  unsupported("mx_linear");
}
void mx_grouped_linear(Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&) {
  unsupported("mx_grouped_linear");
}

}  // namespace moe::cuda
