#include "model/dense_ffn.h"

namespace moe {

void swiglu_mlp_forward(const SublayerContext& ctx, const MlpWeights& w, const Tensor& h_act, FfnActs& a,
                        const Tensor& y, bool accumulate) {
  // fp32: everything goes straight into the saved tensors; bf16: the GEMMs write fp32 scratch,
  // and one SwiGLU pass saves g and u (for its backward) and the product (the down GEMM's
  // operand) rounded to bf16.
  Backend& ops = ctx.ops;
  const bool bf16 = ctx.bf16_operands();
  const int64_t T = a.g.dim(0), F = a.g.dim(1);
  Tensor g = bf16 ? rows_view(ctx.scratch.gate_f32_W, T, F) : a.g;
  Tensor u = bf16 ? rows_view(ctx.scratch.up_f32_W, T, F) : a.u;
  ops.linear_fwd(h_act, w.gate, g, false);
  ops.linear_fwd(h_act, w.up, u, false);
  ops.swiglu_fwd(g, u, a.a_act, bf16 ? a.g : Tensor(), bf16 ? a.u : Tensor());
  ops.linear_fwd(a.a_act, w.down, y, accumulate);
}

void swiglu_mlp_backward(const SublayerContext& ctx, const MlpWeights& w, const MlpWeights& dw, const Tensor& dy,
                         const FfnActs& a, const Tensor& dh) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const int64_t T = a.g.dim(0), F = a.g.dim(1);
  Tensor da = rows_view(s.dact_W, T, F), dg = rows_view(s.dgate_W, T, F), du = rows_view(s.dup_W, T, F);
  Tensor g = ctx.operand_grad(dy);
  ops.linear_bwd_data(g, w.down, da, false);
  ops.linear_bwd_weight(g, a.a_act, dw.down, ctx.accumulate_grad(dw.down));
  // dg and du go straight into GEMM operands (bf16 over their own fp32 scratch in bf16 mode).
  dg = ctx.grad_operand_store(s.dgate_W, T, F, dg);
  du = ctx.grad_operand_store(s.dup_W, T, F, du);
  ops.swiglu_bwd(da, a.g, a.u, dg, du);
  ops.linear_bwd_data(dg, w.gate, dh, false);
  ops.linear_bwd_weight(dg, a.h_act, dw.gate, ctx.accumulate_grad(dw.gate));
  ops.linear_bwd_data(du, w.up, dh, true);
  ops.linear_bwd_weight(du, a.h_act, dw.up, ctx.accumulate_grad(dw.up));
}

void dense_ffn_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, FfnActs& a,
                       const Tensor& x_out) {
  const LayerWeights &W = p.w, &Wc = p.op;
  Tensor h_act = a.h_act = ctx.norm_input(x_in, W.ffn_norm, a.rstd_in, a.h, a.h_act);
  Tensor y = ctx.choice.output_norm() ? a.out : x_out;
  swiglu_mlp_forward(ctx, {Wc.mlp_gate, Wc.mlp_up, Wc.mlp_down}, h_act, a, y, false);
  ctx.finish_sublayer(y, W.ffn_out_norm, a.rstd_out, x_in, x_out);
}

void dense_ffn_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, const FfnActs& a) {
  const LayerWeights &W = p.w, &Wc = p.op;
  LayerWeights& dW = p.grad;
  Tensor dy = ctx.sublayer_output_grad(ctx.choice.output_norm() ? a.out : Tensor(), W.ffn_out_norm, a.rstd_out,
                                       dW.ffn_out_norm);
  swiglu_mlp_backward(ctx, {Wc.mlp_gate, Wc.mlp_up, Wc.mlp_down}, {dW.mlp_gate, dW.mlp_up, dW.mlp_down}, dy, a,
                      ctx.scratch.dnormed_TD);
  ctx.norm_input_backward(ctx.scratch.dnormed_TD, x_in, W.ffn_norm, a.rstd_in, dW.ffn_norm);
}

}  // namespace moe
