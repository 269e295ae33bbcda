// An op output that may be stored rounded to bf16 (op_list.inc: "may be bf16 (rounded)"). The
// reference computes into an fp32 copy and converts it at the end: that is the definition the
// fast kernels, which round as they store, must match bit for bit.
#pragma once

#include "core/buffer.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {

class RoundedOutput {
 public:
  RoundedOutput(const Tensor& out, DType compute, const char* what) : out_(out), work_(out) {
    check_output_dtype(out, compute, what);
    if (out.dtype != compute && !out.empty()) {
      buffer_ = Buffer(static_cast<size_t>(out.numel()) * dtype_size(compute));
      work_.data = buffer_.data();
      work_.dtype = compute;
    }
  }
  // Where the op writes its result, in the compute dtype.
  const Tensor& work() const { return work_; }
  // Stores the result into the output (rounding it when the output is bf16).
  void finish() const {
    if (work_.data != out_.data) convert(work_, out_);
  }

 private:
  Tensor out_, work_;
  Buffer buffer_;
};

}  // namespace moe::ref
