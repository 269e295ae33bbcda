// Attention sublayer, forward then backward:
//   h = RMSNorm(x); q,k,v = h W^T; [QK-norm]; RoPE(q,k); o = causal GQA attention; y = o wo^T
//   pre: x_out = x + y          peri: x_out = x + RMSNorm_out(y)
#include "core/phase_timer.h"
#include "model/transformer.h"

namespace moe {

void Transformer::attention_forward(int64_t l, const Tensor& x_in, AttnActs& a, const Tensor& x_out) {
  PhaseScope phase(Phase::kAttention);
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  const int64_t T = dims_.T, H = cfg_.n_heads, G = cfg_.n_kv_heads, hd = cfg_.hd();
  Tensor h_act = norm_input(x_in, W.attn_norm, a.rstd_in, Tensor(), a.h_act);
  Tensor q2 = a.q.view({T, H * hd}), k2 = a.k.view({T, G * hd});
  if (cfg_.qk_norm == "none") {
    ops_.linear_fwd(h_act, Wc.wq, q2, false);
    ops_.linear_fwd(h_act, Wc.wk, k2, false);
  } else {
    ops_.linear_fwd(h_act, Wc.wq, a.q_lin, false);
    ops_.linear_fwd(h_act, Wc.wk, a.k_lin, false);
    if (cfg_.qk_norm == "full") {
      ops_.rmsnorm_fwd(a.q_lin, W.q_norm, cfg_.norm_eps, q2, a.rstd_q);
      ops_.rmsnorm_fwd(a.k_lin, W.k_norm, cfg_.norm_eps, k2, a.rstd_k);
    } else {  // per head: rows of hd values, one weight of size hd shared by all heads
      ops_.rmsnorm_fwd(a.q_lin.view({T * H, hd}), W.q_norm, cfg_.norm_eps, q2.view({T * H, hd}), a.rstd_q);
      ops_.rmsnorm_fwd(a.k_lin.view({T * G, hd}), W.k_norm, cfg_.norm_eps, k2.view({T * G, hd}), a.rstd_k);
    }
  }
  ops_.linear_fwd(h_act, Wc.wv, a.v.view({T, G * hd}), false);
  ops_.rope_fwd(a.q, cfg_.rope_theta);
  ops_.rope_fwd(a.k, cfg_.rope_theta);
  ops_.attention_fwd(a.q, a.k, a.v, a.o, a.lse, doc_start_, bf16_attention());
  Tensor o_act = operand(a.o.view({T, H * hd}), a.o_act);
  const bool peri = cfg_.norm_placement == "peri";
  Tensor y = peri ? a.out : x_out;
  ops_.linear_fwd(o_act, Wc.wo, y, false);
  finish_sublayer(y, W.attn_out_norm, a.rstd_out, x_in, x_out);
}

// On entry scratch_.dx holds d(x_out); on exit d(x_in) (the residual passes straight through).
void Transformer::attention_backward(int64_t l, const Tensor& x_in, AttnActs& a) {
  PhaseScope phase(Phase::kAttention);
  const LayerWeights& W = params_.layers[static_cast<size_t>(l)];
  const LayerWeights& Wc = operands_.layers[static_cast<size_t>(l)];
  LayerWeights& dW = grads_.layers[static_cast<size_t>(l)];
  Scratch& s = scratch_;
  const int64_t T = dims_.T, H = cfg_.n_heads, G = cfg_.n_kv_heads, hd = cfg_.hd();
  const bool peri = cfg_.norm_placement == "peri";
  Tensor dy = sublayer_output_grad(peri ? a.out : Tensor(), W.attn_out_norm, a.rstd_out, dW.attn_out_norm);

  Tensor dy_act = operand_grad(dy);
  Tensor o_act = dims_.adt == dims_.cdt ? a.o.view({T, H * hd}) : a.o_act;
  ops_.linear_bwd_data(dy_act, Wc.wo, s.dO.view({T, H * hd}), false);
  ops_.linear_bwd_weight(dy_act, o_act, dW.wo);
  ops_.attention_bwd(s.dO, a.q, a.k, a.v, a.o, a.lse, s.dq, s.dk, s.dv, doc_start_, bf16_attention());
  ops_.rope_bwd(s.dq, cfg_.rope_theta);
  ops_.rope_bwd(s.dk, cfg_.rope_theta);

  Tensor dq = s.dq.view({T, H * hd}), dk = s.dk.view({T, G * hd});
  if (cfg_.qk_norm != "none") {
    // The norms' input gradients only feed the q/k projections' GEMMs: written as their operands
    // (bf16 over the fp32 scratch, rounded, in bf16 mode).
    const Tensor dq_op = grad_operand_store(s.dq_lin, T, H * hd, s.dq_lin);
    const Tensor dk_op = grad_operand_store(s.dk_lin, T, G * hd, s.dk_lin);
    if (cfg_.qk_norm == "full") {
      ops_.rmsnorm_bwd(dq, a.q_lin, W.q_norm, a.rstd_q, dq_op, dW.q_norm, false);
      ops_.rmsnorm_bwd(dk, a.k_lin, W.k_norm, a.rstd_k, dk_op, dW.k_norm, false);
    } else {  // per head
      ops_.rmsnorm_bwd(dq.view({T * H, hd}), a.q_lin.view({T * H, hd}), W.q_norm, a.rstd_q,
                       dq_op.view({T * H, hd}), dW.q_norm, false);
      ops_.rmsnorm_bwd(dk.view({T * G, hd}), a.k_lin.view({T * G, hd}), W.k_norm, a.rstd_k,
                       dk_op.view({T * G, hd}), dW.k_norm, false);
    }
    dq = dq_op;
    dk = dk_op;
  }
  // dh = dq wq + dk wk + dv wv, each operand converted once and used for data and weight grads.
  Tensor g = operand_grad(dq);
  ops_.linear_bwd_data(g, Wc.wq, s.dh, false);
  ops_.linear_bwd_weight(g, a.h_act, dW.wq);
  g = operand_grad(dk);
  ops_.linear_bwd_data(g, Wc.wk, s.dh, true);
  ops_.linear_bwd_weight(g, a.h_act, dW.wk);
  g = operand_grad(s.dv.view({T, G * hd}));
  ops_.linear_bwd_data(g, Wc.wv, s.dh, true);
  ops_.linear_bwd_weight(g, a.h_act, dW.wv);
  norm_input_backward(s.dh, x_in, W.attn_norm, a.rstd_in, dW.attn_norm);
}

}  // namespace moe
