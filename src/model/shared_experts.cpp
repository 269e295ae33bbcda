#include "model/shared_experts.h"

namespace moe {
namespace {
ExpertWeightRule gate_rule(const ModelConfig& c) { return {c.shared_router_norm_p, 1.0}; }
// (T,Es*H) as (T*Es,H): one row per (token, shared expert).
Tensor per_expert(const Tensor& t, int64_t rows, const ModelConfig& c) {
  return t.view({rows * c.shared_experts, c.shared_hidden});
}
}  // namespace

void router_logits_fwd(const SublayerContext& ctx, const Tensor& h, const Tensor& router, const Tensor& bias,
                       const Tensor& logits) {
  ctx.ops.linear_fwd(h, router, logits, false);
  ctx.add_row_bias(bias, logits);
}

ScoreKind score_kind(ScoreFunc f) { return f == ScoreFunc::kSigmoid ? ScoreKind::kSigmoid : ScoreKind::kSoftmax; }

void shared_experts_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& h_act, FfnActs& a,
                            const Tensor& y) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights &W = p.w, &Wc = p.op;
  const bool bf16 = ctx.bf16_operands();
  const int64_t T = a.g.dim(0), Fs = c.shared_width(), Es = c.shared_experts;

  // The gate: every token weighs every shared expert (the identity choice: the uniform assignment).
  router_logits_fwd(ctx, a.h, W.shared_router, W.shared_router_bias, a.shared_logits);
  ops.router_scores_fwd(a.shared_logits, score_kind(ctx.choice.shared_router_score), c.shared_router_sigmoid_eps,
                        a.shared_scores);
  ops.router_assign(RouterAssignment::kUniform, 0, 0, 0, static_cast<int>(Es), a.shared_idx);
  ops.router_gather(a.shared_scores, a.shared_idx, gate_rule(c), a.shared_w);
  // Identity slot positions 0..T*Es-1: the plan of T*Es rows that all choose the one "expert" 0.
  const Tensor zeros = s.shared_zero_N.slice(0, T * Es).view({T * Es, 1});
  ops.router_assign(RouterAssignment::kUniform, 0, 0, 0, 1, zeros);
  ops.moe_plan(zeros, s.shared_plan_3.slice(0, 1), s.shared_plan_3.slice(1, 3), s.shared_sorted_N.slice(0, T * Es),
               a.shared_pos);

  // The experts: g and u saved (bf16 mode: rounded copies of fp32 scratch), the unscaled product
  // in fp32 scratch, the scaled product saved as the down GEMM's operand.
  const Tensor g = bf16 ? rows_view(s.gate_f32_W, T, Fs) : a.g;
  const Tensor u = bf16 ? rows_view(s.up_f32_W, T, Fs) : a.u;
  ops.linear_fwd(h_act, Wc.shared_gate, g, false);
  ops.linear_fwd(h_act, Wc.shared_up, u, false);
  const Tensor act = rows_view(s.dact_W, T, Fs);  // free in the forward
  ops.swiglu_fwd(g, u, act, bf16 ? a.g : Tensor(), bf16 ? a.u : Tensor());
  const Tensor scaled = bf16 ? rows_view(s.gate_f32_W, T, Fs) : a.a_act;  // g's scratch is read
  ops.moe_combine(per_expert(act, T, c), a.shared_pos, a.shared_w.view({T * Es, 1}), per_expert(scaled, T, c), false);
  if (bf16) ops.convert(scaled, a.a_act);
  ops.linear_fwd(a.a_act, Wc.shared_down, y, true);
}

void shared_experts_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& dy, const FfnActs& a,
                             const Tensor& dh) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights &W = p.w, &Wc = p.op;
  LayerWeights& dW = p.grad;
  const bool bf16 = ctx.bf16_operands();
  const int64_t T = a.g.dim(0), Fs = c.shared_width(), Es = c.shared_experts;
  const Tensor w = a.shared_w.view({T * Es, 1});

  const Tensor dscaled = rows_view(s.dact_W, T, Fs);
  const Tensor g = ctx.operand_grad(dy);
  ops.linear_bwd_data(g, Wc.shared_down, dscaled, false);
  ops.linear_bwd_weight(g, a.a_act, dW.shared_down, ctx.accumulate_grad(dW.shared_down));
  // SwiGLU backward of the unscaled product (linear in its output gradient), then the scaling:
  // du = w du0 and d(w) = <du0, u> = <d(a_s), silu(g) u>; dg = w dg0.
  const Tensor dg0 = rows_view(s.dgate_W, T, Fs), du0 = rows_view(s.dup_W, T, Fs);
  ops.swiglu_bwd(dscaled, a.g, a.u, dg0, du0);
  const Tensor du = dscaled, dg = du0;  // each read before it is overwritten
  const Tensor dw = s.dshared_w_TS.slice(0, T * Es).view({T * Es, 1});
  ops.moe_combine_bwd(per_expert(du0, T, c), per_expert(a.u, T, c), a.shared_pos, w, per_expert(du, T, c), dw);
  ops.moe_combine(per_expert(dg0, T, c), a.shared_pos, w, per_expert(dg, T, c), false);
  // bf16 mode: the GEMM operands rounded over the scratch already read.
  const Tensor dg_op = ctx.grad_operand_store(s.dgate_W, T, Fs, dg);
  if (bf16) ops.convert(dg, dg_op);
  const Tensor du_op = ctx.grad_operand_store(s.dup_W, T, Fs, du);
  if (bf16) ops.convert(du, du_op);
  ops.linear_bwd_data(dg_op, Wc.shared_gate, dh, false);
  ops.linear_bwd_weight(dg_op, a.h_act, dW.shared_gate, ctx.accumulate_grad(dW.shared_gate));
  ops.linear_bwd_data(du_op, Wc.shared_up, dh, true);
  ops.linear_bwd_weight(du_op, a.h_act, dW.shared_up, ctx.accumulate_grad(dW.shared_up));

  // The gate's backward: weights -> scores -> logits -> h, the router and its bias.
  const Tensor dscores = s.dshared_scores_TS.slice(0, T * Es).view({T, Es});
  const Tensor dlogits = s.dshared_logits_TS.slice(0, T * Es).view({T, Es});
  ops.fill(dscores, 0.0);
  ops.router_gather_bwd(dw.view({T, Es}), a.shared_scores, a.shared_idx, gate_rule(c), dscores);
  ops.fill(dlogits, 0.0);
  ops.router_scores_bwd(dscores, a.shared_scores, score_kind(ctx.choice.shared_router_score),
                        c.shared_router_sigmoid_eps, dlogits);
  ops.linear_bwd_data(dlogits, W.shared_router, dh, true);
  ops.linear_bwd_weight(dlogits, a.h, dW.shared_router, ctx.accumulate_grad(dW.shared_router));
  ctx.row_bias_grad(dlogits, dW.shared_router_bias);
}

}  // namespace moe
