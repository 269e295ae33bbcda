// Dense SwiGLU FFN sublayer (the first n_dense_layers blocks), forward then backward:
//   h = RMSNorm(x); y = down(silu(gate(h)) * up(h)); residual as in attention_block.cpp.
#include "model/transformer.h"

namespace moe {

void Transformer::dense_forward(int64_t l, const Tensor& x_in, FfnActs& a, const Tensor& x_out) {
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  Tensor h_act = norm_input(x_in, W.ffn_norm, a.rstd_in, a.h, a.h_act);
  ops_.linear_fwd(h_act, Wc.mlp_gate, a.g, false);
  ops_.linear_fwd(h_act, Wc.mlp_up, a.u, false);
  Tensor act = dims_.adt == dims_.cdt ? a.a_act : scratch_.ftmp.slice(0, a.g.numel()).view({a.g.dim(0), a.g.dim(1)});
  ops_.swiglu_fwd(a.g, a.u, act);
  Tensor a_act = operand(act, a.a_act);
  Tensor y = cfg_.norm_placement == "peri" ? a.out : x_out;
  ops_.linear_fwd(a_act, Wc.mlp_down, y, false);
  finish_sublayer(y, W.ffn_out_norm, a.rstd_out, x_in, x_out);
}

void Transformer::dense_backward(int64_t l, const Tensor& x_in, FfnActs& a) {
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  LayerWeights& dW = grads_.layers[static_cast<size_t>(l)];
  Scratch& s = scratch_;
  const bool peri = cfg_.norm_placement == "peri";
  Tensor dy = sublayer_output_grad(peri ? a.out : Tensor(), W.ffn_out_norm, a.rstd_out, dW.ffn_out_norm);
  const int64_t T = a.g.dim(0), F = a.g.dim(1);
  Tensor da = s.da.slice(0, T * F).view({T, F});
  Tensor dg = s.dg.slice(0, T * F).view({T, F});
  Tensor du = s.du.slice(0, T * F).view({T, F});
  Tensor g = operand_grad(dy);
  ops_.linear_bwd_data(g, Wc.mlp_down, da, false);
  ops_.linear_bwd_weight(g, a.a_act, dW.mlp_down);
  ops_.swiglu_bwd(da, a.g, a.u, dg, du);
  g = operand_grad(dg);
  ops_.linear_bwd_data(g, Wc.mlp_gate, s.dh, false);
  ops_.linear_bwd_weight(g, a.h_act, dW.mlp_gate);
  g = operand_grad(du);
  ops_.linear_bwd_data(g, Wc.mlp_up, s.dh, true);
  ops_.linear_bwd_weight(g, a.h_act, dW.mlp_up);
  norm_input_backward(s.dh, x_in, W.ffn_norm, a.rstd_in, dW.ffn_norm);
}

}  // namespace moe
