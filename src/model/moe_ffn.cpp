#include "model/moe_ffn.h"

#include <optional>

#include "core/phase_timer.h"
#include "core/rng.h"
#include "model/dense_ffn.h"
#include "model/mx_experts.h"
#include "model/shared_experts.h"

namespace moe {
namespace {
// The expert weights' rule (normalized by p, times the factor: kernels/op_types.h).
ExpertWeightRule weight_rule(const ModelConfig& c) { return {c.expert_weight_norm_p(), c.expert_weight_factor()}; }

// The router's input in the compute dtype: h, or (bf16 mode keeps only the operand copy) h_act
// widened into scratch.dy_TD, which is free in the forward and, in the backward, once the output
// gradient has reached the shared experts and the combine.
Tensor router_input(const SublayerContext& ctx, const FfnActs& a) {
  if (!a.h.empty()) return a.h;
  const Tensor h = ctx.scratch.dy_TD;
  ctx.ops.convert(a.h_act, h);
  return h;
}

// The experts' GEMMs over the received rows a.xr_act (rows of them), in the operand dtype. bf16
// mode: the GEMMs write fp32 scratch, one SwiGLU pass saves bf16 g, u and the product (as in
// swiglu_mlp_forward). Returns the outputs, in the compute dtype with EP (the combine reads it).
Tensor bf16_experts_forward(const SublayerContext& ctx, const LayerParams& p, bool ep, int64_t rows, FfnActs& a) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const LayerWeights& Wc = p.op;
  const bool bf16 = ctx.bf16_operands();
  const int64_t F = a.eg.dim(1);
  const Tensor xr = a.xr_act.slice(0, rows);
  const Tensor eg = bf16 ? rows_view(s.gate_f32_W, rows, F) : a.eg.slice(0, rows);
  const Tensor eu = bf16 ? rows_view(s.up_f32_W, rows, F) : a.eu.slice(0, rows);
  ops.grouped_linear_fwd(xr, Wc.exp_gate, a.recv_offsets, eg);
  ops.grouped_linear_fwd(xr, Wc.exp_up, a.recv_offsets, eu);
  const Tensor ea_act = a.ea_act.slice(0, rows);
  ops.swiglu_fwd(eg, eu, ea_act, bf16 ? a.eg.slice(0, rows) : Tensor(), bf16 ? a.eu.slice(0, rows) : Tensor());
  const Tensor ys = bf16 || ep ? s.ys_f32_XD.slice(0, rows) : a.ys;
  ops.grouped_linear_fwd(ea_act, Wc.exp_down, a.recv_offsets, ys);
  return ys;
}
}  // namespace

void moe_ffn_forward(const SublayerContext& ctx, const LayerParams& p, const MoeRouting& routing,
                     const MoeExchangeStep& ex, const Tensor& x_in, FfnActs& a, const Tensor& x_out) {
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights &W = p.w, &Wc = p.op;
  Scratch& s = ctx.scratch;
  const bool bf16 = ctx.bf16_operands();
  Tensor h_act = a.h_act = ctx.norm_input(x_in, W.ffn_norm, a.rstd_in, a.h, a.h_act);
  if (!ctx.choice.input_norm()) a.h = x_in;  // reordered norms: the router reads the residual stream

  // Router in the compute dtype with the fp32 master weights.
  std::optional<PhaseScope> phase(std::in_place, Phase::kRouter);
  router_logits_fwd(ctx, router_input(ctx, a), W.router, W.router_bias, a.logits);
  ops.router_scores_fwd(a.logits, score_kind(ctx.choice.score_func), c.sigmoid_eps, a.scores);
  if (ctx.choice.routing == Routing::kLearned) {
    // topk_softmax chooses on the logits (+ bias), the others on the scores (+ bias).
    const bool on_logits = ctx.choice.score_func == ScoreFunc::kTopkSoftmax;
    ops.router_topk(on_logits ? a.logits : a.scores, routing.router_bias, c.n_group, c.topk_group, a.expert_idx);
  } else {
    const uint64_t stream = static_cast<uint64_t>(RngStream::kRandomRouting) | (static_cast<uint64_t>(routing.layer) << 32);
    ops.router_assign(ctx.choice.routing == Routing::kUniform ? RouterAssignment::kUniform : RouterAssignment::kRandom,
                      routing.seed, stream, routing.token_base, static_cast<int>(c.num_experts), a.expert_idx);
  }
  ops.router_gather(a.scores, a.expert_idx, weight_rule(c), a.weights);
  phase.reset();
  phase.emplace(Phase::kPermute);
  ops.moe_plan(a.expert_idx, a.counts, a.offsets, a.sorted_slot, a.slot_pos);

  // Routed experts over the permuted rows (MXFP8: gathered into scratch, saved quantized).
  const bool mx = ctx.dims.mx.experts;
  const Tensor xs = mx || ex.exchange ? s.xs_RD : a.xs_act;
  ops.moe_gather(h_act, a.sorted_slot, xs);
  // Expert parallelism: rows travel to the ranks of their experts, arriving grouped by local
  // expert (then source rank); the plan's recv_offsets are the grouped GEMM's offsets over them.
  // Recompute re-runs the forward with the same routing: it reuses the stored plan.
  // The expert ops run over the static bound Rx: the grouped GEMMs read and write only the rows
  // below the plan's device offsets, and the row-wise ops (SwiGLU, the gradient sum) also pass
  // over the unused tail, whose values nothing reads. No host integer sizes any op.
  int64_t rows = ctx.dims.R;
  if (ex.exchange) {
    if (ex.new_plan) ex.exchange->plan(ex.slot, ex.moe_layer, a.counts);
    a.recv_offsets = ex.exchange->received_offsets(ex.slot, ex.moe_layer);
    if (!mx) ex.exchange->send_to_experts(ex.slot, ex.moe_layer, xs, a.xr_act, s.ep_slabs);
    rows = ctx.dims.Rx;
  }
  phase.reset();
  phase.emplace(Phase::kExpertGemm);
  Tensor ys = mx ? mx_experts_forward(ctx, *p.mx, ex, xs, routing.quant_stats, a) : Tensor();
  if (!mx) ys = bf16_experts_forward(ctx, p, ex.exchange != nullptr, rows, a);
  if (ex.exchange) {  // back to the tokens' rank, into their local expert-major rows
    Tensor returned = bf16 ? s.returned_RD : a.ys;
    ex.exchange->return_to_sources(ex.slot, ex.moe_layer, ys, returned, s.ep_slabs);
    ys = returned;
  }

  Tensor y = ctx.choice.output_norm() ? a.out : x_out;
  phase.reset();
  phase.emplace(Phase::kCombine);
  ops.moe_combine(ys, a.slot_pos, a.weights, y, false);
  if (bf16) ops.convert(ys, a.ys);
  phase.reset();
  if (c.shared_hidden > 0) {
    PhaseScope shared_phase(Phase::kExpertGemm);
    const MlpWeights shared{Wc.shared_gate, Wc.shared_up, Wc.shared_down};
    if (c.shared_router) {
      shared_experts_forward(ctx, p, h_act, a, y);
    } else if (ctx.choice.shared_merge == SharedMerge::kSum) {
      swiglu_mlp_forward(ctx, shared, h_act, a, y, true);
    } else {  // v1: shared/(K+1) + routed*K/(K+1)
      const double k = static_cast<double>(c.top_k);
      ops.scale(y, k / (k + 1));
      swiglu_mlp_forward(ctx, shared, h_act, a, s.shared_out_TD, false);
      ops.axpy(1.0 / (k + 1), s.shared_out_TD, y);
    }
  }
  ctx.finish_sublayer(y, W.ffn_out_norm, a.rstd_out, x_in, x_out);
}

namespace {
// The load-balancing loss at the configured granularity (MoeLossOutputs); its value into out.lbl,
// its score gradient into scratch.dscores_TE, the mean probabilities into out.mean_prob.
void load_balance(const SublayerContext& ctx, const MoeLossOutputs& out, const FfnActs& a, ScoreKind kind) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const int K = static_cast<int>(ctx.cfg.top_k);
  const double value = out.aux_weight, grad = out.lbl_coef * out.aux_weight;
  if (out.granularity == LblGranularity::kInstance) {
    // The mean over sequences of each sequence's loss: its own counts and probabilities.
    const int64_t B = out.sequences, S = a.scores.dim(0) / B;
    MOE_CHECK(B >= 1 && S * B == a.scores.dim(0), "instance load balancing: ", a.scores.dim(0), " tokens in ", B,
              " sequences");
    for (int64_t b = 0; b < B; ++b) {
      ops.expert_counts(a.expert_idx.slice(b * S, (b + 1) * S), s.lbl_counts_E);
      ops.load_balance_loss(a.scores.slice(b * S, (b + 1) * S), s.lbl_counts_E, kind, K, value / static_cast<double>(B),
                            grad / static_cast<double>(B), out.lbl, s.dscores_TE.slice(b * S, (b + 1) * S), s.mean_prob_E);
      ops.axpy(out.stat_weight / static_cast<double>(B), s.mean_prob_E, out.mean_prob);
    }
    return;
  }
  if (out.granularity == LblGranularity::kGlobal && out.count_sum && out.count_sum->ranks > 1) {
    // Olmo-core 3's global_load_balancing: the group's summed counts over its size.
    const double r = static_cast<double>(out.count_sum->ranks);
    ops.expert_counts(a.expert_idx, s.lbl_counts_E);
    out.count_sum->sum(s.lbl_counts_E);
    ops.load_balance_loss(a.scores, s.lbl_counts_E, kind, K, value / r, grad / r, out.lbl, s.dscores_TE, s.mean_prob_E);
  } else {
    ops.load_balance_loss(a.scores, a.counts, kind, K, value, grad, out.lbl, s.dscores_TE, s.mean_prob_E);
  }
  ops.axpy(out.stat_weight, s.mean_prob_E, out.mean_prob);
}

// The shared experts' backward: their d(h) initializes s.dnormed_TD (zeros without them). v1's
// shared output was scaled by 1/(K+1) in the forward.
void shared_branch_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& dy, bool v1, FfnActs& a) {
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights& Wc = p.op;
  LayerWeights& dW = p.grad;
  Scratch& s = ctx.scratch;
  const double k = static_cast<double>(c.top_k);
  if (c.shared_router) {
    shared_experts_backward(ctx, p, dy, a, s.dnormed_TD);
  } else if (c.shared_hidden > 0) {
    Tensor dshared = dy;
    if (v1) {
      ops.fill(s.dshared_TD, 0.0);
      ops.axpy(1.0 / (k + 1), dy, s.dshared_TD);
      dshared = s.dshared_TD;
    }
    swiglu_mlp_backward(ctx, {Wc.shared_gate, Wc.shared_up, Wc.shared_down},
                        {dW.shared_gate, dW.shared_up, dW.shared_down}, dshared, a, s.dnormed_TD);
  } else {
    ops.fill(s.dnormed_TD, 0.0);
  }
}

// The experts' GEMM gradients over rows received rows (bf16 / fp32 operands): g is the output
// gradient, dxs and dxs_up receive the input gradient's gate and up parts. Without EP the gate
// part is gathered back before the up gradient overwrites it.
void bf16_experts_backward(const SublayerContext& ctx, const LayerParams& p, bool ep, int64_t rows, const Tensor& g,
                           FfnActs& a, const Tensor& dxs, const Tensor& dxs_up) {
  Backend& ops = ctx.ops;
  const LayerWeights& Wc = p.op;
  LayerWeights& dW = p.grad;
  Scratch& s = ctx.scratch;
  const int64_t F = a.eg.dim(1);
  const Tensor da = rows_view(s.dact_W, rows, F);
  // dg and du go straight into GEMM operands (bf16 over their own fp32 scratch in bf16 mode).
  const Tensor dg = ctx.grad_operand_store(s.dgate_W, rows, F, rows_view(s.dgate_W, rows, F));
  const Tensor du = ctx.grad_operand_store(s.dup_W, rows, F, rows_view(s.dup_W, rows, F));
  const Tensor xr = a.xr_act.slice(0, rows);
  ops.grouped_linear_bwd_data(g, Wc.exp_down, a.recv_offsets, da);
  ops.grouped_linear_bwd_weight(g, a.ea_act.slice(0, rows), a.recv_offsets, dW.exp_down,
                                ctx.accumulate_grad(dW.exp_down));
  ops.swiglu_bwd(da, a.eg.slice(0, rows), a.eu.slice(0, rows), dg, du);
  ops.grouped_linear_bwd_data(dg, Wc.exp_gate, a.recv_offsets, dxs);
  ops.grouped_linear_bwd_weight(dg, xr, a.recv_offsets, dW.exp_gate, ctx.accumulate_grad(dW.exp_gate));
  if (!ep) {  // gathered back before the up gradient overwrites it
    PhaseScope permute(Phase::kPermute);
    ops.moe_gather_bwd(dxs, a.slot_pos, s.dnormed_TD);
  }
  ops.grouped_linear_bwd_data(du, Wc.exp_up, a.recv_offsets, dxs_up);
  ops.grouped_linear_bwd_weight(du, xr, a.recv_offsets, dW.exp_up, ctx.accumulate_grad(dW.exp_up));
}

// Mirror of the forward exchange: output gradients (operand dtype) go to the experts' ranks,
// input gradients (compute dtype, gate + up summed first: one message) come back. Returns the
// input gradients of this rank's permuted rows.
Tensor routed_experts_backward(const SublayerContext& ctx, const LayerParams& p, const MoeExchangeStep& ex,
                               const MoeLossOutputs& out, FfnActs& a) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  Tensor g = ctx.operand_grad(s.dys_RD);
  int64_t rows = ctx.dims.R;
  if (ex.exchange) {
    a.recv_offsets = ex.exchange->received_offsets(ex.slot, ex.moe_layer);
    ex.exchange->send_to_experts(ex.slot, ex.moe_layer, g, s.dyr_XD, s.ep_slabs);
    rows = ctx.dims.Rx;
    g = s.dyr_XD.slice(0, rows);
  }
  const Tensor dxs = s.dxs_XD.slice(0, rows);
  const Tensor dxs_up = ex.exchange ? s.dxs_up_XD.slice(0, rows) : dxs;
  if (ctx.dims.mx.experts) {
    mx_experts_backward(ctx, *p.mx, p.grad, g, out.quant_stats, a, dxs, dxs_up);
  } else {
    bf16_experts_backward(ctx, p, ex.exchange != nullptr, rows, g, a, dxs, dxs_up);
  }
  Tensor dxs_local = dxs;
  if (ex.exchange) {
    ops.axpy(1.0, dxs_up, dxs);
    ex.exchange->return_to_sources(ex.slot, ex.moe_layer, dxs, s.returned_RD, s.ep_slabs);
    dxs_local = s.returned_RD;
  }
  return dxs_local;
}

// Router: combine weights, then the auxiliary losses (their values go to the step's stats), into
// the router's gradients and s.dnormed_TD.
void router_backward(const SublayerContext& ctx, const LayerParams& p, const MoeLossOutputs& out, FfnActs& a) {
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights& W = p.w;
  LayerWeights& dW = p.grad;
  Scratch& s = ctx.scratch;
  const ScoreKind kind = score_kind(ctx.choice.score_func);
  ops.fill(s.dscores_TE, 0.0);
  ops.router_gather_bwd(s.dweights_TK, a.scores, a.expert_idx, weight_rule(c), s.dscores_TE);
  load_balance(ctx, out, a, kind);
  ops.add_counts(a.counts, out.counts);
  ops.fill(s.dlogits_TE, 0.0);
  ops.router_scores_bwd(s.dscores_TE, a.scores, kind, c.sigmoid_eps, s.dlogits_TE);
  ops.router_z_loss(a.logits, out.aux_weight, out.router_z_coef * out.aux_weight, out.router_z, s.dlogits_TE);
  ctx.row_bias_grad(s.dlogits_TE, dW.router_bias);
  ops.linear_bwd_data(s.dlogits_TE, W.router, s.dnormed_TD, true);
  ops.linear_bwd_weight(s.dlogits_TE, router_input(ctx, a), dW.router, ctx.accumulate_grad(dW.router));
}
}  // namespace

void moe_ffn_backward(const SublayerContext& ctx, const LayerParams& p, const MoeExchangeStep& ex,
                      const MoeLossOutputs& out, const Tensor& x_in, FfnActs& a) {
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights& W = p.w;
  LayerWeights& dW = p.grad;
  Scratch& s = ctx.scratch;
  Tensor dy = ctx.sublayer_output_grad(ctx.choice.output_norm() ? a.out : Tensor(), W.ffn_out_norm, a.rstd_out,
                                       dW.ffn_out_norm);
  const double k = static_cast<double>(c.top_k);
  const bool v1 = c.shared_hidden > 0 && ctx.choice.shared_merge == SharedMerge::kV1;

  // Shared expert: its d(h) initializes s.dnormed_TD.
  std::optional<PhaseScope> phase(std::in_place, Phase::kExpertGemm);
  shared_branch_backward(ctx, p, dy, v1, a);

  // Routed experts.
  Tensor droute = dy;
  if (v1) {
    ops.fill(s.droute_TD, 0.0);
    ops.axpy(k / (k + 1), dy, s.droute_TD);
    droute = s.droute_TD;
  }
  phase.reset();
  phase.emplace(Phase::kCombine);
  ops.moe_combine_bwd(droute, a.ys, a.slot_pos, a.weights, s.dys_RD, s.dweights_TK);
  phase.reset();
  phase.emplace(Phase::kExpertGemm);
  const Tensor dxs_local = routed_experts_backward(ctx, p, ex, out, a);
  phase.reset();
  phase.emplace(Phase::kPermute);
  ops.moe_gather_bwd(dxs_local, a.slot_pos, s.dnormed_TD);

  phase.reset();
  phase.emplace(Phase::kRouter);
  router_backward(ctx, p, out, a);
  phase.reset();
  ctx.norm_input_backward(s.dnormed_TD, x_in, W.ffn_norm, a.rstd_in, dW.ffn_norm);
}

}  // namespace moe
