#include "kernels/attention_checks.h"

#include "core/check.h"

namespace moe {

const int32_t* checked_doc_start(const Tensor& doc_start, int64_t B, int64_t S, const char* op) {
  if (doc_start.data == nullptr) return nullptr;
  check_shape(doc_start, {B, S}, op);
  check_dtype(doc_start, DType::kI32, op);
  MOE_CHECK(doc_start.device == Device::kCpu, op, ": doc_start must be a host tensor");
  const int32_t* ds = doc_start.as<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      MOE_CHECK(ds[b * S + s] >= 0 && ds[b * S + s] <= s, op, ": doc_start[", b, ",", s, "] = ", ds[b * S + s],
                " outside [0, ", s, "]");
  return ds;
}

}  // namespace moe
