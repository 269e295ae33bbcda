// SwiGLU MLP, forward then backward: y = down(silu(gate(h)) * up(h)). Used by the dense FFN
// sublayer (the first n_dense_layers blocks: h = RMSNorm(x), residual as in attention_block.cpp)
// and by the shared expert of MoE layers (moe/moe_ffn.cpp).
#include "model/transformer.h"

namespace moe {
namespace {
Tensor rows_view(const Tensor& flat, int64_t rows, int64_t cols) {
  return flat.slice(0, rows * cols).view({rows, cols});
}
}  // namespace

void Transformer::swiglu_mlp_forward(const Tensor& h_act, const Tensor& gate, const Tensor& up,
                                     const Tensor& down, FfnActs& a, const Tensor& y, bool accumulate) {
  // fp32: everything goes straight into the saved tensors; bf16: the GEMMs write fp32 scratch,
  // and one SwiGLU pass saves g and u (for its backward) and the product (the down GEMM's
  // operand) rounded to bf16.
  const bool bf16 = dims_.adt != dims_.cdt;
  const int64_t T = a.g.dim(0), F = a.g.dim(1);
  Tensor g = bf16 ? rows_view(scratch_.fg, T, F) : a.g, u = bf16 ? rows_view(scratch_.fu, T, F) : a.u;
  ops_.linear_fwd(h_act, gate, g, false);
  ops_.linear_fwd(h_act, up, u, false);
  ops_.swiglu_fwd(g, u, a.a_act, bf16 ? a.g : Tensor(), bf16 ? a.u : Tensor());
  ops_.linear_fwd(a.a_act, down, y, accumulate);
}

// dh (T,D) = d/dh of sum(dy * y), overwritten; parameter gradients accumulate.
void Transformer::swiglu_mlp_backward(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                      const Tensor& down, FfnActs& a, const Tensor& dgate,
                                      const Tensor& dup, const Tensor& ddown, const Tensor& dh) {
  Scratch& s = scratch_;
  const int64_t T = a.g.dim(0), F = a.g.dim(1);
  Tensor da = rows_view(s.da, T, F), dg = rows_view(s.dg, T, F), du = rows_view(s.du, T, F);
  Tensor g = operand_grad(dy);
  ops_.linear_bwd_data(g, down, da, false);
  ops_.linear_bwd_weight(g, a.a_act, ddown);
  // dg and du go straight into GEMM operands (bf16 over their own fp32 scratch in bf16 mode).
  dg = grad_operand_store(s.dg, T, F, dg);
  du = grad_operand_store(s.du, T, F, du);
  ops_.swiglu_bwd(da, a.g, a.u, dg, du);
  ops_.linear_bwd_data(dg, gate, dh, false);
  ops_.linear_bwd_weight(dg, a.h_act, dgate);
  ops_.linear_bwd_data(du, up, dh, true);
  ops_.linear_bwd_weight(du, a.h_act, dup);
}

void Transformer::dense_forward(int64_t l, const Tensor& x_in, FfnActs& a, const Tensor& x_out) {
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  Tensor h_act = norm_input(x_in, W.ffn_norm, a.rstd_in, a.h, a.h_act);
  Tensor y = cfg_.norm_placement == "peri" ? a.out : x_out;
  swiglu_mlp_forward(h_act, Wc.mlp_gate, Wc.mlp_up, Wc.mlp_down, a, y, false);
  finish_sublayer(y, W.ffn_out_norm, a.rstd_out, x_in, x_out);
}

void Transformer::dense_backward(int64_t l, const Tensor& x_in, FfnActs& a) {
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  LayerWeights& dW = grads_.layers[static_cast<size_t>(l)];
  const bool peri = cfg_.norm_placement == "peri";
  Tensor dy = sublayer_output_grad(peri ? a.out : Tensor(), W.ffn_out_norm, a.rstd_out, dW.ffn_out_norm);
  swiglu_mlp_backward(dy, Wc.mlp_gate, Wc.mlp_up, Wc.mlp_down, a, dW.mlp_gate, dW.mlp_up, dW.mlp_down, scratch_.dh);
  norm_input_backward(scratch_.dh, x_in, W.ffn_norm, a.rstd_in, dW.ffn_norm);
}

}  // namespace moe
