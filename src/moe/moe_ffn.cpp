// MoE FFN sublayer, forward then backward. Dropless token-choice routing:
//   h = RMSNorm(x); z = h router^T (compute dtype, master weights); s = softmax|sigmoid(z)
//   choose K experts per token (learned: top-k of s + bias; or uniform/random); w = s[chosen]
//   plan: stable counting sort of the T*K (token, slot) pairs by expert -> offsets, positions
//   xs = h rows in expert-major order; ys = grouped SwiGLU experts over xs (row tiles per expert)
//   y = sum_j w_tj * ys[pos(t,j)]  (+ shared expert: sum, or v1 u/(K+1) + r*K/(K+1))
// Expert parallelism (moe/expert_exchange.h): after the gather, rows move to the ranks holding
// their experts and the outputs come back before the combine; backward moves the gradients the
// same two ways. Routing, the plan, the combine and the router losses stay on the tokens' rank.
// Backward mirrors it and injects the load-balancing and router z-loss gradients into the
// router, weighted by this micro-batch's share of the step's tokens.
#include <optional>

#include "core/phase_timer.h"
#include "core/rng.h"
#include "model/transformer.h"

namespace moe {
namespace {
Tensor rows_view(const Tensor& flat, int64_t rows, int64_t cols) {
  return flat.slice(0, rows * cols).view({rows, cols});
}
}  // namespace

void Transformer::moe_forward(int64_t slot, int64_t l, const Tensor& x_in, FfnActs& a, const Tensor& x_out,
                              int64_t token_base) {
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  const int64_t m = l - moe_index_base_;
  const bool bf16 = dims_.adt != dims_.cdt;
  Tensor h_act = norm_input(x_in, W.ffn_norm, a.rstd_in, a.h, a.h_act);

  // Router in the compute dtype with the fp32 master weights.
  std::optional<PhaseScope> phase(std::in_place, Phase::kRouter);
  ops_.linear_fwd(a.h, W.router, a.logits, false);
  const int kind = cfg_.score_func == "sigmoid" ? 1 : 0;
  ops_.router_scores_fwd(a.logits, kind, a.scores);
  if (cfg_.routing == "learned") {
    ops_.router_topk(a.scores, cfg_.router_bias_gamma > 0 ? router_bias_[static_cast<size_t>(m)].t : Tensor(), a.expert_idx);
  } else {
    const uint64_t stream = static_cast<uint64_t>(RngStream::kRandomRouting) | (static_cast<uint64_t>(l) << 32);
    ops_.router_assign(cfg_.routing == "uniform" ? 0 : 1, seed_, stream, token_base,
                       static_cast<int>(cfg_.num_experts), a.expert_idx);
  }
  ops_.router_gather(a.scores, a.expert_idx, cfg_.norm_topk_prob, a.weights);
  phase.reset();
  phase.emplace(Phase::kPermute);
  ops_.moe_plan(a.expert_idx, a.counts, a.offsets, a.sorted_slot, a.slot_pos);

  // Routed experts over the permuted rows.
  ops_.moe_gather(h_act, a.sorted_slot, a.xs_act);
  // Expert parallelism: rows travel to the ranks of their experts, arriving grouped by local
  // expert (then source rank); the plan's recv_offsets are the grouped GEMM's offsets over them.
  // Recompute re-runs the forward with the same routing: it reuses the stored plan.
  // The expert ops run over the static bound Rx: the grouped GEMMs read and write only the rows
  // below the plan's device offsets, and the row-wise ops (SwiGLU, the gradient sum) also pass
  // over the unused tail, whose values nothing reads. No host integer sizes any op.
  int64_t rows = dims_.R;
  if (exchange_) {
    ExchangePlan& plan = plans_[static_cast<size_t>(slot)][static_cast<size_t>(m)];
    if (!recomputing_) {
      exchange_->make_plan(a.counts, plan);
      ops_.add_counts(plan.totals, exchange_counts_.t.slice(m, m + 1).view({4 + dims_.ep}));
    }
    a.recv_offsets = plan.recv_offsets;
    exchange_->send_to_experts(plan, a.xs_act, a.xr_act);
    rows = dims_.Rx;
  }
  phase.reset();
  phase.emplace(Phase::kExpertGemm);
  // bf16 mode: the GEMMs write fp32 scratch, one SwiGLU pass saves bf16 g, u and the product
  // (as in swiglu_mlp_forward).
  const int64_t F = a.eg.dim(1);
  const Tensor xr = a.xr_act.slice(0, rows);
  Tensor eg = bf16 ? rows_view(scratch_.fg, rows, F) : a.eg.slice(0, rows);
  Tensor eu = bf16 ? rows_view(scratch_.fu, rows, F) : a.eu.slice(0, rows);
  ops_.grouped_linear_fwd(xr, Wc.exp_gate, a.recv_offsets, eg);
  ops_.grouped_linear_fwd(xr, Wc.exp_up, a.recv_offsets, eu);
  const Tensor ea_act = a.ea_act.slice(0, rows);
  ops_.swiglu_fwd(eg, eu, ea_act, bf16 ? a.eg.slice(0, rows) : Tensor(), bf16 ? a.eu.slice(0, rows) : Tensor());
  // With EP the outputs go back in the compute dtype: the combine reads that dtype.
  Tensor ys = bf16 || exchange_ ? scratch_.fys.slice(0, rows) : a.ys;
  ops_.grouped_linear_fwd(ea_act, Wc.exp_down, a.recv_offsets, ys);
  if (exchange_) {  // back to the tokens' rank, into their local expert-major rows
    Tensor returned = bf16 ? scratch_.dys : a.ys;  // dys is free during the forward
    exchange_->return_to_sources(plans_[static_cast<size_t>(slot)][static_cast<size_t>(m)], ys, returned);
    ys = returned;
  }

  Tensor y = cfg_.norm_placement == "peri" ? a.out : x_out;
  phase.reset();
  phase.emplace(Phase::kCombine);
  ops_.moe_combine(ys, a.slot_pos, a.weights, y, false);
  if (bf16) ops_.convert(ys, a.ys);
  phase.reset();
  if (cfg_.shared_hidden > 0) {
    PhaseScope shared_phase(Phase::kExpertGemm);
    if (cfg_.shared_merge == "sum") {
      swiglu_mlp_forward(h_act, Wc.shared_gate, Wc.shared_up, Wc.shared_down, a, y, true);
    } else {  // v1: shared/(K+1) + routed*K/(K+1)
      const double k = static_cast<double>(cfg_.top_k);
      ops_.scale(y, k / (k + 1));
      swiglu_mlp_forward(h_act, Wc.shared_gate, Wc.shared_up, Wc.shared_down, a, scratch_.fwd_dtmp, false);
      ops_.axpy(1.0 / (k + 1), scratch_.fwd_dtmp, y);
    }
  }
  finish_sublayer(y, W.ffn_out_norm, a.rstd_out, x_in, x_out);
}

void Transformer::moe_backward(int64_t slot, int64_t l, const Tensor& x_in, FfnActs& a, const MicroBatchScales& sc,
                               StepStats& stats) {
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  LayerWeights& dW = grads_.layers[static_cast<size_t>(l)];
  Scratch& s = scratch_;
  const int64_t m = l - moe_index_base_;
  const bool peri = cfg_.norm_placement == "peri";
  Tensor dy = sublayer_output_grad(peri ? a.out : Tensor(), W.ffn_out_norm, a.rstd_out, dW.ffn_out_norm);
  const double k = static_cast<double>(cfg_.top_k);
  const bool v1 = cfg_.shared_hidden > 0 && cfg_.shared_merge == "v1";

  // Shared expert: its d(h) initializes s.dh.
  std::optional<PhaseScope> phase(std::in_place, Phase::kExpertGemm);
  if (cfg_.shared_hidden > 0) {
    Tensor dshared = dy;
    if (v1) {
      ops_.fill(s.dtmp3, 0.0);
      ops_.axpy(1.0 / (k + 1), dy, s.dtmp3);
      dshared = s.dtmp3;
    }
    swiglu_mlp_backward(dshared, Wc.shared_gate, Wc.shared_up, Wc.shared_down, a, dW.shared_gate,
                        dW.shared_up, dW.shared_down, s.dh);
  } else {
    ops_.fill(s.dh, 0.0);
  }

  // Routed experts.
  Tensor droute = dy;
  if (v1) {
    ops_.fill(s.dtmp2, 0.0);
    ops_.axpy(k / (k + 1), dy, s.dtmp2);
    droute = s.dtmp2;
  }
  phase.reset();
  phase.emplace(Phase::kCombine);
  ops_.moe_combine_bwd(droute, a.ys, a.slot_pos, a.weights, s.dys, s.dweights);
  phase.reset();
  phase.emplace(Phase::kExpertGemm);
  // Mirror of the forward exchange: output gradients (operand dtype) go to the experts' ranks,
  // input gradients (compute dtype, gate + up summed first: one message) come back.
  Tensor g = operand_grad(s.dys);
  int64_t rows = dims_.R;
  if (exchange_) {
    const ExchangePlan& plan = plans_[static_cast<size_t>(slot)][static_cast<size_t>(m)];
    a.recv_offsets = plan.recv_offsets;
    exchange_->send_to_experts(plan, g, s.dyr);
    rows = dims_.Rx;
    g = s.dyr.slice(0, rows);
  }
  const int64_t F = a.eg.dim(1);
  Tensor da = rows_view(s.da, rows, F);
  // dg and du go straight into GEMM operands (bf16 over their own fp32 scratch in bf16 mode).
  const Tensor dg = grad_operand_store(s.dg, rows, F, rows_view(s.dg, rows, F));
  const Tensor du = grad_operand_store(s.du, rows, F, rows_view(s.du, rows, F));
  const Tensor xr = a.xr_act.slice(0, rows), dxs = s.dxs.slice(0, rows);
  ops_.grouped_linear_bwd_data(g, Wc.exp_down, a.recv_offsets, da);
  ops_.grouped_linear_bwd_weight(g, a.ea_act.slice(0, rows), a.recv_offsets, dW.exp_down);
  ops_.swiglu_bwd(da, a.eg.slice(0, rows), a.eu.slice(0, rows), dg, du);
  ops_.grouped_linear_bwd_data(dg, Wc.exp_gate, a.recv_offsets, dxs);
  ops_.grouped_linear_bwd_weight(dg, xr, a.recv_offsets, dW.exp_gate);
  if (!exchange_) {
    PhaseScope permute(Phase::kPermute);
    ops_.moe_gather_bwd(dxs, a.slot_pos, s.dh);
  }
  const Tensor dxs_up = exchange_ ? s.dxs2.slice(0, rows) : dxs;
  ops_.grouped_linear_bwd_data(du, Wc.exp_up, a.recv_offsets, dxs_up);
  ops_.grouped_linear_bwd_weight(du, xr, a.recv_offsets, dW.exp_up);
  Tensor dxs_local = dxs;
  if (exchange_) {
    ops_.axpy(1.0, dxs_up, dxs);
    exchange_->return_to_sources(plans_[static_cast<size_t>(slot)][static_cast<size_t>(m)], dxs, s.dys);  // dys was sent: free
    dxs_local = s.dys;
  }
  phase.reset();
  phase.emplace(Phase::kPermute);
  ops_.moe_gather_bwd(dxs_local, a.slot_pos, s.dh);

  // Router: combine weights, then the auxiliary losses (their values go to the step's stats).
  const int kind = cfg_.score_func == "sigmoid" ? 1 : 0;
  phase.reset();
  phase.emplace(Phase::kRouter);
  ops_.fill(s.dscores, 0.0);
  ops_.router_gather_bwd(s.dweights, a.scores, a.expert_idx, cfg_.norm_topk_prob, s.dscores);
  ops_.load_balance_loss(a.scores, a.counts, kind, static_cast<int>(cfg_.top_k), sc.aux_weight,
                         loss_.lbl_coef * sc.aux_weight, stats.lbl(m), s.dscores, s.mean_prob);
  ops_.axpy(sc.aux_weight, s.mean_prob, stats.mean_prob[static_cast<size_t>(m)]);
  ops_.add_counts(a.counts, stats.counts[static_cast<size_t>(m)]);
  ops_.fill(s.dlogits, 0.0);
  ops_.router_scores_bwd(s.dscores, a.scores, kind, s.dlogits);
  ops_.router_z_loss(a.logits, sc.aux_weight, loss_.router_z_coef * sc.aux_weight, stats.router_z(m), s.dlogits);
  ops_.linear_bwd_data(s.dlogits, W.router, s.dh, true);
  ops_.linear_bwd_weight(s.dlogits, a.h, dW.router);
  phase.reset();
  norm_input_backward(s.dh, x_in, W.ffn_norm, a.rstd_in, dW.ffn_norm);
}

}  // namespace moe
