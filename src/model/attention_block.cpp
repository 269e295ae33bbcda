#include "model/attention_block.h"

#include "core/mxfp8.h"
#include "core/phase_timer.h"

namespace moe {

namespace {
// MXFP8 projections (mxfp8.attention): the quantization work is booked to its own phase.
void quantize(Backend& ops, const Tensor& x, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales) {
  PhaseScope phase(Phase::kQuantize);
  ops.mx_quantize(x, false, rule, codes, scales, Tensor(), Tensor());
}
// dx (+)= g W for an MXFP8 projection: the upstream gradient g (T,N) quantized along N (into the
// scratch, in the gradient element) against the weight's transposed copy.
void mx_data_grad(const SublayerContext& ctx, const Tensor& g, const MxWeightCopies& w, const Tensor& dx,
                  bool accumulate) {
  const int64_t T = g.dim(0), N = g.dim(1);
  const Tensor gq = rows_view(ctx.scratch.mx_attn_g_q, T, N), gqs = rows_view(ctx.scratch.mx_attn_g_qs, T, N / mx::kBlock);
  quantize(ctx.ops, g, ctx.dims.mx.rule, gq, gqs);
  ctx.ops.mx_linear(gq, gqs, w.t, w.ts, dx, accumulate);
}
// The weight gradients' operand from its saved quantized copy, into the scratch.
Tensor dequantized(const SublayerContext& ctx, const Tensor& codes, const Tensor& scales) {
  PhaseScope phase(Phase::kQuantize);
  const Tensor x = rows_view(ctx.scratch.mx_attn_x_N, codes.dim(0), codes.dim(1));
  ctx.ops.mx_dequantize(codes, scales, x, Tensor());
  return x;
}
}  // namespace

void attention_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, AttnActs& a,
                       const Tensor& x_out) {
  PhaseScope phase(Phase::kAttention);
  Backend& ops = ctx.ops;
  const ModelConfig& c = ctx.cfg;
  const LayerWeights &W = p.w, &Wc = p.op;
  const int64_t T = ctx.dims.T, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  // MXFP8: the normed input is quantized once (saved so) for the three projections.
  const MxAttentionWeights* mx = ctx.dims.mx.attention ? p.mx_attn : nullptr;
  MOE_CHECK(!ctx.dims.mx.attention || mx, "MXFP8 attention without the layer's MXFP8 weight caches");
  Tensor h_act = ctx.norm_input(x_in, W.attn_norm, a.rstd_in, Tensor(),
                                mx ? rows_view(ctx.scratch.mx_attn_x_N, T, c.d_model) : a.h_act);
  if (mx) quantize(ops, h_act, ctx.dims.mx.rule, a.h_q, a.h_qs);
  else a.h_act = h_act;  // reordered norms in fp32: the input itself
  auto project = [&](const Tensor& w, const MxWeightCopies* w8, const Tensor& y) {
    if (w8) ops.mx_linear(a.h_q, a.h_qs, w8->q, w8->qs, y, false);
    else ops.linear_fwd(h_act, w, y, false);
  };
  // out = clamp(h w^T + b): the projection, its bias, then clip_qkv (into out from a.*_pre).
  auto qkv = [&](const Tensor& w, const MxWeightCopies* w8, const Tensor& b, const Tensor& pre, const Tensor& out) {
    const Tensor y = c.clip_qkv > 0 ? pre : out;
    project(w, w8, y);
    ctx.add_row_bias(b, y);  // model.attention_bias (b empty without)
    if (c.clip_qkv > 0) ops.clamp_fwd(pre, c.clip_qkv, out);
  };
  // bf16 mode saves q, k, v and o in bf16 (the attention products take them so): the projections,
  // QK-norm and RoPE work in fp32 in the backward's dq/dk/dv scratch (free in the forward), then
  // one rounding each.
  const bool stored = ctx.bf16_operands();
  const Tensor& s_q = stored ? ctx.scratch.dq_BSHd : a.q;
  const Tensor& s_k = stored ? ctx.scratch.dk_BSGd : a.k;
  const Tensor& s_v = stored ? ctx.scratch.dv_BSGd : a.v;
  Tensor q2 = s_q.view({T, H * hd}), k2 = s_k.view({T, G * hd});
  if (ctx.choice.qk_norm == QkNorm::kNone) {
    qkv(Wc.wq, mx ? &mx->wq : nullptr, W.bq, a.q_pre, q2);
    qkv(Wc.wk, mx ? &mx->wk : nullptr, W.bk, a.k_pre, k2);
  } else {
    // The norms' inputs are saved for their backward (in bf16 in bf16 mode, computed in fp32 in
    // the QK-norm gradients' scratch, free in the forward).
    const Tensor q_lin = stored ? ctx.scratch.dq_lin_THd : a.q_lin, k_lin = stored ? ctx.scratch.dk_lin_TGd : a.k_lin;
    qkv(Wc.wq, mx ? &mx->wq : nullptr, W.bq, a.q_pre, q_lin);
    qkv(Wc.wk, mx ? &mx->wk : nullptr, W.bk, a.k_pre, k_lin);
    if (ctx.choice.qk_norm == QkNorm::kFull) {
      ops.rmsnorm_fwd(q_lin, W.q_norm, c.norm_eps, q2, a.rstd_q);
      ops.rmsnorm_fwd(k_lin, W.k_norm, c.norm_eps, k2, a.rstd_k);
    } else {  // per head: rows of hd values, one weight of size hd shared by all heads
      ops.rmsnorm_fwd(q_lin.view({T * H, hd}), W.q_norm, c.norm_eps, q2.view({T * H, hd}), a.rstd_q);
      ops.rmsnorm_fwd(k_lin.view({T * G, hd}), W.k_norm, c.norm_eps, k2.view({T * G, hd}), a.rstd_k);
    }
    if (stored) {
      ops.convert(q_lin, a.q_lin);
      ops.convert(k_lin, a.k_lin);
    }
  }
  qkv(Wc.wv, mx ? &mx->wv : nullptr, W.bv, a.v_pre, s_v.view({T, G * hd}));
  if (ctx.rope) {
    ops.rope_fwd(s_q, c.rope_theta, c.rotary_dim());
    ops.rope_fwd(s_k, c.rope_theta, c.rotary_dim());
  }
  if (stored) {
    ops.convert(s_q, a.q);
    ops.convert(s_k, a.k);
    ops.convert(s_v, a.v);
  }
  // bf16 mode runs attention's matrix products on bf16 operands too (fp32 softmax and sums) and
  // writes o in bf16: wo's operand.
  ops.attention_fwd(a.q, a.k, a.v, a.o, a.lse, ctx.doc_start, ctx.bf16_operands());
  Tensor y = ctx.choice.output_norm() ? a.out : x_out;
  const Tensor o2 = a.o.view({T, H * hd});
  if (mx) {  // o quantized, saved so for wo's weight gradient
    quantize(ops, o2, ctx.dims.mx.rule, a.o_q, a.o_qs);
    ops.mx_linear(a.o_q, a.o_qs, mx->wo.q, mx->wo.qs, y, false);
  } else {
    ops.linear_fwd(o2, Wc.wo, y, false);
  }
  ctx.add_row_bias(W.bo, y);
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
  Tensor dy = ctx.sublayer_output_grad(ctx.choice.output_norm() ? a.out : Tensor(), W.attn_out_norm, a.rstd_out,
                                       dW.attn_out_norm);

  // MXFP8: each data gradient quantizes the operand-dtype upstream gradient its weight gradient
  // reads; the weight gradients run in bf16 on the saved operands dequantized.
  const MxAttentionWeights* mx = ctx.dims.mx.attention ? p.mx_attn : nullptr;
  auto data_grad = [&](const Tensor& g, const Tensor& w, const MxWeightCopies* w8, const Tensor& dx, bool acc) {
    if (w8) mx_data_grad(ctx, g, *w8, dx, acc);
    else ops.linear_bwd_data(g, w, dx, acc);
  };
  Tensor dy_act = ctx.operand_grad(dy);
  data_grad(dy_act, Wc.wo, mx ? &mx->wo : nullptr, s.do_BSHd.view({T, H * hd}), false);
  const Tensor o_act = mx ? dequantized(ctx, a.o_q, a.o_qs) : a.o.view({T, H * hd});
  ops.linear_bwd_weight(dy_act, o_act, dW.wo, ctx.accumulate_grad(dW.wo));
  ctx.row_bias_grad(dy, dW.bo);
  ops.attention_bwd(s.do_BSHd, a.q, a.k, a.v, a.o, a.lse, s.dq_BSHd, s.dk_BSGd, s.dv_BSGd, ctx.doc_start,
                    ctx.bf16_operands());
  if (ctx.rope) {
    ops.rope_bwd(s.dq_BSHd, c.rope_theta, c.rotary_dim());
    ops.rope_bwd(s.dk_BSGd, c.rope_theta, c.rotary_dim());
  }

  // clip_qkv and the biases read the projections' gradients in the compute dtype: the QK-norm
  // backward then writes them so (and operand_grad converts them for the GEMMs in bf16 mode).
  const bool fp32_grads = c.clip_qkv > 0 || c.attention_bias;
  Tensor dq = s.dq_BSHd.view({T, H * hd}), dk = s.dk_BSGd.view({T, G * hd}), dv = s.dv_BSGd.view({T, G * hd});
  if (ctx.choice.qk_norm != QkNorm::kNone) {
    // The norms' input gradients only feed the q/k projections' GEMMs: written as their operands
    // (bf16 over the fp32 scratch, rounded, in bf16 mode).
    const Tensor dq_op = fp32_grads ? s.dq_lin_THd : ctx.grad_operand_store(s.dq_lin_THd, T, H * hd, s.dq_lin_THd);
    const Tensor dk_op = fp32_grads ? s.dk_lin_TGd : ctx.grad_operand_store(s.dk_lin_TGd, T, G * hd, s.dk_lin_TGd);
    if (ctx.choice.qk_norm == QkNorm::kFull) {
      ctx.prepare_grad(dW.q_norm);
      ops.rmsnorm_bwd(dq, a.q_lin, W.q_norm, a.rstd_q, dq_op, dW.q_norm, false);
      ctx.prepare_grad(dW.k_norm);
      ops.rmsnorm_bwd(dk, a.k_lin, W.k_norm, a.rstd_k, dk_op, dW.k_norm, false);
    } else {  // per head
      ctx.prepare_grad(dW.q_norm);
      ops.rmsnorm_bwd(dq.view({T * H, hd}), a.q_lin.view({T * H, hd}), W.q_norm, a.rstd_q,
                      dq_op.view({T * H, hd}), dW.q_norm, false);
      ctx.prepare_grad(dW.k_norm);
      ops.rmsnorm_bwd(dk.view({T * G, hd}), a.k_lin.view({T * G, hd}), W.k_norm, a.rstd_k,
                      dk_op.view({T * G, hd}), dW.k_norm, false);
    }
    dq = dq_op;
    dk = dk_op;
  }
  if (c.clip_qkv > 0) {  // in place: the gradient passes where the projection was within the clamp
    ops.clamp_bwd(dq, a.q_pre, c.clip_qkv, dq);
    ops.clamp_bwd(dk, a.k_pre, c.clip_qkv, dk);
    ops.clamp_bwd(dv, a.v_pre, c.clip_qkv, dv);
  }
  ctx.row_bias_grad(dq, dW.bq);
  ctx.row_bias_grad(dk, dW.bk);
  ctx.row_bias_grad(dv, dW.bv);
  // dh = dq wq + dk wk + dv wv, each operand converted once and used for data and weight grads.
  const Tensor h_act = mx ? dequantized(ctx, a.h_q, a.h_qs) : a.h_act;
  Tensor g = ctx.operand_grad(dq);
  data_grad(g, Wc.wq, mx ? &mx->wq : nullptr, s.dnormed_TD, false);
  ops.linear_bwd_weight(g, h_act, dW.wq, ctx.accumulate_grad(dW.wq));
  g = ctx.operand_grad(dk);
  data_grad(g, Wc.wk, mx ? &mx->wk : nullptr, s.dnormed_TD, true);
  ops.linear_bwd_weight(g, h_act, dW.wk, ctx.accumulate_grad(dW.wk));
  g = ctx.operand_grad(dv);
  data_grad(g, Wc.wv, mx ? &mx->wv : nullptr, s.dnormed_TD, true);
  ops.linear_bwd_weight(g, h_act, dW.wv, ctx.accumulate_grad(dW.wv));
  ctx.norm_input_backward(s.dnormed_TD, x_in, W.attn_norm, a.rstd_in, dW.attn_norm);
}

}  // namespace moe
