// Argument contracts of the norm and loss ops (op_list.inc: rmsnorm_fwd, rmsnorm_bwd,
// cross_entropy), checked once for every backend: shapes, the dtypes the op ties to its compute
// dtype (the input's) and the outputs that may be bf16 (rounded). Which compute dtypes a backend
// takes and where its tensors live are its own.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

// x (N,C) (any rank, viewed as rows x last dim), w (C) and rstd (N) of x's dtype, y like x (may
// be bf16).
void check_rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd);
// dy like x, dw like w, all of x's dtype; dx like x, bf16 allowed unless accumulated.
void check_rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                       const Tensor& dw, bool accumulate);

struct CrossEntropyDims {
  int64_t rows = 0, vocab = 0;
};
// logits (N,V), labels (N) i32, row_ce and row_z (N) of the logits' dtype, dlogits like logits
// (may be bf16).
CrossEntropyDims check_cross_entropy(const Tensor& logits, const Tensor& labels, const Tensor& dlogits,
                                     const Tensor& row_ce, const Tensor& row_z);
// Host labels, each below the vocabulary (a negative label means no loss at its row): their data.
const int32_t* checked_labels(const Tensor& labels, int64_t vocab);

}  // namespace moe
