#include "model/attention_block.h"

#include "core/phase_timer.h"

namespace moe {

void attention_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, AttnActs& a,
                       const Tensor& x_out) {
  PhaseScope phase(Phase::kAttention);
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights &W = p.w, &Wc = p.op;
  const int64_t T = ctx.dims.T, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  Tensor h_act = ctx.norm_input(x_in, W.attn_norm, a.rstd_in, Tensor(), a.h_act);
  Tensor q2 = a.q.view({T, H * hd}), k2 = a.k.view({T, G * hd});
  if (ctx.choice.qk_norm == QkNorm::kNone) {
    ops.linear_fwd(h_act, Wc.wq, q2, false);
    ops.linear_fwd(h_act, Wc.wk, k2, false);
  } else {
    ops.linear_fwd(h_act, Wc.wq, a.q_lin, false);
    ops.linear_fwd(h_act, Wc.wk, a.k_lin, false);
    if (ctx.choice.qk_norm == QkNorm::kFull) {
      ops.rmsnorm_fwd(a.q_lin, W.q_norm, c.norm_eps, q2, a.rstd_q);
      ops.rmsnorm_fwd(a.k_lin, W.k_norm, c.norm_eps, k2, a.rstd_k);
    } else {  // per head: rows of hd values, one weight of size hd shared by all heads
      ops.rmsnorm_fwd(a.q_lin.view({T * H, hd}), W.q_norm, c.norm_eps, q2.view({T * H, hd}), a.rstd_q);
      ops.rmsnorm_fwd(a.k_lin.view({T * G, hd}), W.k_norm, c.norm_eps, k2.view({T * G, hd}), a.rstd_k);
    }
  }
  ops.linear_fwd(h_act, Wc.wv, a.v.view({T, G * hd}), false);
  ops.rope_fwd(a.q, c.rope_theta);
  ops.rope_fwd(a.k, c.rope_theta);
  // bf16 mode runs attention's matrix products on bf16 operands too (fp32 softmax and sums).
  ops.attention_fwd(a.q, a.k, a.v, a.o, a.lse, ctx.doc_start, ctx.bf16_operands());
  Tensor o_act = ctx.operand(a.o.view({T, H * hd}), a.o_act);
  Tensor y = ctx.choice.peri() ? a.out : x_out;
  ops.linear_fwd(o_act, Wc.wo, y, false);
  ctx.finish_sublayer(y, W.attn_out_norm, a.rstd_out, x_in, x_out);
}

void attention_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, const AttnActs& a) {
  PhaseScope phase(Phase::kAttention);
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights &W = p.w, &Wc = p.op;
  LayerWeights& dW = p.grad;
  Scratch& s = ctx.scratch;
  const int64_t T = ctx.dims.T, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  Tensor dy = ctx.sublayer_output_grad(ctx.choice.peri() ? a.out : Tensor(), W.attn_out_norm, a.rstd_out,
                                       dW.attn_out_norm);

  Tensor dy_act = ctx.operand_grad(dy);
  Tensor o_act = ctx.bf16_operands() ? a.o_act : a.o.view({T, H * hd});
  ops.linear_bwd_data(dy_act, Wc.wo, s.do_BSHd.view({T, H * hd}), false);
  ops.linear_bwd_weight(dy_act, o_act, dW.wo);
  ops.attention_bwd(s.do_BSHd, a.q, a.k, a.v, a.o, a.lse, s.dq_BSHd, s.dk_BSGd, s.dv_BSGd, ctx.doc_start,
                    ctx.bf16_operands());
  ops.rope_bwd(s.dq_BSHd, c.rope_theta);
  ops.rope_bwd(s.dk_BSGd, c.rope_theta);

  Tensor dq = s.dq_BSHd.view({T, H * hd}), dk = s.dk_BSGd.view({T, G * hd});
  if (ctx.choice.qk_norm != QkNorm::kNone) {
    // The norms' input gradients only feed the q/k projections' GEMMs: written as their operands
    // (bf16 over the fp32 scratch, rounded, in bf16 mode).
    const Tensor dq_op = ctx.grad_operand_store(s.dq_lin_THd, T, H * hd, s.dq_lin_THd);
    const Tensor dk_op = ctx.grad_operand_store(s.dk_lin_TGd, T, G * hd, s.dk_lin_TGd);
    if (ctx.choice.qk_norm == QkNorm::kFull) {
      ops.rmsnorm_bwd(dq, a.q_lin, W.q_norm, a.rstd_q, dq_op, dW.q_norm, false);
      ops.rmsnorm_bwd(dk, a.k_lin, W.k_norm, a.rstd_k, dk_op, dW.k_norm, false);
    } else {  // per head
      ops.rmsnorm_bwd(dq.view({T * H, hd}), a.q_lin.view({T * H, hd}), W.q_norm, a.rstd_q,
                      dq_op.view({T * H, hd}), dW.q_norm, false);
      ops.rmsnorm_bwd(dk.view({T * G, hd}), a.k_lin.view({T * G, hd}), W.k_norm, a.rstd_k,
                      dk_op.view({T * G, hd}), dW.k_norm, false);
    }
    dq = dq_op;
    dk = dk_op;
  }
  // dh = dq wq + dk wk + dv wv, each operand converted once and used for data and weight grads.
  Tensor g = ctx.operand_grad(dq);
  ops.linear_bwd_data(g, Wc.wq, s.dnormed_TD, false);
  ops.linear_bwd_weight(g, a.h_act, dW.wq);
  g = ctx.operand_grad(dk);
  ops.linear_bwd_data(g, Wc.wk, s.dnormed_TD, true);
  ops.linear_bwd_weight(g, a.h_act, dW.wk);
  g = ctx.operand_grad(s.dv_BSGd.view({T, G * hd}));
  ops.linear_bwd_data(g, Wc.wv, s.dnormed_TD, true);
  ops.linear_bwd_weight(g, a.h_act, dW.wv);
  ctx.norm_input_backward(s.dnormed_TD, x_in, W.attn_norm, a.rstd_in, dW.attn_norm);
}

}  // namespace moe
