// Argument contracts of the attention ops shared by every backend (op_list.inc).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"

namespace moe {

struct AttentionShape {
  int64_t B = 0, S = 0, H = 0, G = 0, hd = 0;
};
// q (B,S,H,hd), k and v (B,S,G,hd) of q's dtype, G dividing H. Which dtypes and head dims a
// backend takes are its own.
AttentionShape check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const char* op);

// Intra-document masking: doc_start is empty (returns nullptr) or (B,S) i32 in host memory with
// 0 <= doc_start[b,s] <= s (returns its data).
const int32_t* checked_doc_start(const Tensor& doc_start, int64_t B, int64_t S, const char* op);

// o (B,S,H,hd) and lse (B,H,S) of the forward or (backward) the backward's inputs. Shapes only:
// dtype and device rules are each backend's.
void check_attention_outputs(int64_t B, int64_t S, int64_t H, int64_t hd, const Tensor& o, const Tensor& lse,
                             bool backward);
// The backward's dout and dq (B,S,H,hd), dk and dv (B,S,G,hd).
void check_attention_gradients(int64_t B, int64_t S, int64_t H, int64_t G, int64_t hd, const Tensor& dout,
                               const Tensor& dq, const Tensor& dk, const Tensor& dv);
// The dtype rule of op_list.inc: q, k, v in the compute dtype C (f32, f64) or bf16 (bf16 mode's
// saved operands: then C = f32 and bf16_products); lse, dout, dq, dk, dv in C; o in C or, with
// C = f32, bf16. `grads` null in the forward. Returns C.
DType check_attention_dtypes(const Tensor& q, const Tensor& o, const Tensor& lse, bool bf16_products,
                             std::initializer_list<const Tensor*> grads, const char* op);

}  // namespace moe
