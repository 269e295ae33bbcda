#include "model/lm_head.h"

#include <algorithm>
#include <optional>

#include "core/phase_timer.h"
#include "model/sublayer.h"

namespace moe {
namespace {
void final_norm_forward(const HeadContext& ctx, const HeadWeights& w, const Tensor& x) {
  ctx.ops.rmsnorm_fwd(x, w.final_norm, ctx.cfg.norm_eps, ctx.final_norm.out_act, ctx.final_norm.rstd);
}
}  // namespace

void lm_head_loss_step(const HeadContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& labels,
                       double ce_scale, double lm_z_coef, const Tensor& ce, const Tensor& lm_z,
                       const Tensor& d_final_norm, const Tensor& d_lm_head, GradWrites& grad_writes) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const int64_t T = ctx.dims.T, V = ctx.cfg.vocab_size;
  // The final norm runs here, not in the stage's forward: one set of its buffers serves every slot.
  final_norm_forward(ctx, w, x);
  const Tensor& xf_act = ctx.final_norm.out_act;
  std::optional<PhaseScope> phase(std::in_place, Phase::kLmHeadLoss);
  for (int64_t r0 = 0; r0 < T; r0 += ctx.chunk) {
    const int64_t r1 = std::min(T, r0 + ctx.chunk), n = r1 - r0;
    Tensor logits = s.logits_CV.slice(0, n);
    Tensor x_rows = xf_act.slice(r0, r1);
    ops.linear_fwd(x_rows, w.lm_head, logits, false);
    Tensor row_ce = s.row_ce_C.slice(0, n), row_z = s.row_z_C.slice(0, n);
    // The logits' gradient is written in place, or rounded straight into the bf16 operand.
    const Tensor g = grad_operand_store(ctx.dims, s.dy_operand_N, n, V, logits);
    ops.cross_entropy(logits, labels.slice(r0, r1), ce_scale, lm_z_coef, g, row_ce, row_z);
    ops.sum_to(row_ce, ce_scale, ce);
    ops.sum_to(row_z, ce_scale, lm_z);
    ops.linear_bwd_data(g, w.lm_head, s.dy_TD.slice(r0, r1), false);
    ops.linear_bwd_weight(g, x_rows, d_lm_head, grad_writes.accumulate(d_lm_head));
  }
  phase.reset();
  grad_writes.prepare(d_final_norm);
  ops.rmsnorm_bwd(s.dy_TD, x, w.final_norm, ctx.final_norm.rstd, s.dresid_TD, d_final_norm, false);
}

void lm_head_eval_loss(const HeadContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& labels,
                       const Tensor& out) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const int64_t T = ctx.dims.T;
  final_norm_forward(ctx, w, x);
  for (int64_t r0 = 0; r0 < T; r0 += ctx.chunk) {
    const int64_t r1 = std::min(T, r0 + ctx.chunk), n = r1 - r0;
    Tensor logits = s.logits_CV.slice(0, n);
    ops.linear_fwd(ctx.final_norm.out_act.slice(r0, r1), w.lm_head, logits, false);
    ops.cross_entropy(logits, labels.slice(r0, r1), 1.0, 0.0, logits, s.row_ce_C.slice(0, n), s.row_z_C.slice(0, n));
    ops.sum_to(s.row_ce_C.slice(0, n), 1.0, out);
  }
}

void lm_head_logits(const HeadContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& logits) {
  final_norm_forward(ctx, w, x);
  ctx.ops.linear_fwd(ctx.final_norm.out_act, w.lm_head, logits, false);
}

}  // namespace moe
