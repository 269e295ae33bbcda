// Argument contracts of the attention ops shared by every backend (op_list.inc).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

// Intra-document masking: doc_start is empty (returns nullptr) or (B,S) i32 in host memory with
// 0 <= doc_start[b,s] <= s (returns its data).
const int32_t* checked_doc_start(const Tensor& doc_start, int64_t B, int64_t S, const char* op);

}  // namespace moe
