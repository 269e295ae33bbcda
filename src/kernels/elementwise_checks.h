// Argument contracts of the RoPE and clamp ops shared by every backend (op_list.inc). Shapes,
// dtypes agreeing and scalar ranges only: device rules and the dtypes a backend takes are its own.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

// rope_fwd / rope_bwd: x (B,S,N,hd), hd even, rotary_dim even in [2, hd], theta > 0.
void check_rope_args(const Tensor& x, double theta, int64_t rotary_dim, const char* op);
// clamp_fwd (dy = nullptr) / clamp_bwd: x, out (and dy) of one shape and one float dtype, limit
// finite and > 0.
void check_clamp_args(const Tensor* dy, const Tensor& x, double limit, const Tensor& out, const char* op);

}  // namespace moe
