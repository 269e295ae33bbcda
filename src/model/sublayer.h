// What every sublayer (attention, dense FFN, MoE FFN) of a block is given, and the pieces they
// share: the normed input, the output norm + residual add, and GEMM operand conversions.
// Sublayers are free functions of (context, weights, saved activations, input, output), forward
// and backward side by side in their own files:
//   model/attention_block.cpp, model/dense_ffn.cpp (and the shared expert), model/moe_ffn.cpp.
// Backward convention: on entry scratch.dresid_TD holds d(x_out); on exit d(x_in) (the residual
// passes straight through, the input norm's gradient is added).
#pragma once

#include "config/config.h"
#include "kernels/ops.h"
#include "model/activations.h"
#include "model/grad_writes.h"

namespace moe {

struct SublayerContext {
  Backend& ops;
  const ModelConfig& cfg;
  const ModelChoices& choice;
  const Dims& dims;
  Scratch& scratch;
  Tensor doc_start;  // (B,S) i32 the first key each query sees (document starts, the layer's window), or empty
  bool rope = true;  // the layer applies RoPE to q and k (model.rope)
  GradWrites* grad_writes = nullptr;  // the step's gradient writes (set for a training step's backward)

  // A weight-gradient GEMM's accumulate flag for grad (model/grad_writes.h), and the zeroing
  // before an op that only adds into grad.
  bool accumulate_grad(const Tensor& grad) const;
  void prepare_grad(const Tensor& grad) const;
  GradWrites& writes() const;  // grad_writes, checked

  bool bf16_operands() const { return dims.adt != dims.cdt; }
  // A bias on every row, as exact rank-1 GEMMs with a column of ones (scratch.ones_T1, compute
  // dtype): y (rows, n) += 1 b^T, and its gradient db += dy^T 1 (the column sums). Nothing when
  // b (db) is empty: the attention and router biases, each optional.
  void add_row_bias(const Tensor& b, const Tensor& y) const;
  void row_bias_grad(const Tensor& dy, const Tensor& db) const;
  // A GEMM operand view of x: x itself, or x converted into store (bf16 mode).
  Tensor operand(const Tensor& x, const Tensor& store) const;
  // The operand-dtype scratch for an upstream gradient of dy's shape.
  Tensor operand_grad(const Tensor& dy) const;
  // Where a kernel writes a (rows, cols) gradient that only feeds GEMMs: the fp32 tensor itself,
  // or (bf16 mode) an operand-dtype view over the start of `store`, which the kernel fills with
  // rounded values (op_list.inc: "may be bf16 (rounded)") instead of a later convert pass.
  Tensor grad_operand_store(const Tensor& store, int64_t rows, int64_t cols, const Tensor& fp32) const;

  // The normed input of a sublayer: into h (compute dtype) and its operand copy h_act, or, with
  // no h, straight into the operand (rounded to bf16 as it is stored in bf16 mode). Reordered
  // norms have no input norm: x_in itself, or its operand copy in h_act (bf16 mode).
  Tensor norm_input(const Tensor& x_in, const Tensor& w, const Tensor& rstd, const Tensor& h, const Tensor& h_act) const;
  // x_out = x_in + y (pre), or x_in + RMSNorm_out(y) (peri, reordered).
  void finish_sublayer(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out, const Tensor& x_in,
                       const Tensor& x_out) const;
  // Backward of finish_sublayer: d(y) given d(x_out) in scratch.dresid_TD.
  Tensor sublayer_output_grad(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out,
                              const Tensor& dout_norm_w) const;
  // Adds the input norm's gradient of dh (reordered: dh itself) into scratch.dresid_TD (the
  // residual path is already there).
  void norm_input_backward(const Tensor& dh, const Tensor& x_in, const Tensor& w, const Tensor& rstd,
                           const Tensor& dw) const;
};

// SublayerContext::grad_operand_store for any step that has the dims (the LM head too).
Tensor grad_operand_store(const Dims& dims, const Tensor& store, int64_t rows, int64_t cols, const Tensor& fp32);

// A (rows, cols) view over the start of a flat scratch tensor.
inline Tensor rows_view(const Tensor& flat, int64_t rows, int64_t cols) {
  return flat.slice(0, rows * cols).view({rows, cols});
}

}  // namespace moe
