// Gated shared experts (model.shared_router; Olmo-core 3's SharedExperts with its
// shared_experts_router), forward then backward (shared_experts.cpp):
//   z = h W_s^T (+ b_s), fp32 with the master weights; s = softmax|sigmoid(+eps)(z);
//   w = s / ||s||_p (norm_p > 0) or s: no top-k, no auxiliary losses
//   g, u = h_act gate^T, h_act up^T over the Es stacked experts (T, Es*H); a = silu(g) * u
//   a_s[t, e*H + j] = w[t,e] * a[t, e*H + j]; y += a_s down^T
// which is sum_e w[t,e] SharedExpert_e(h)[t] by linearity: one GEMM per projection as with one
// expert. The per-expert scaling is moe_combine over rows (t,e) of H values with one weight each
// (K = 1, identity slot positions), so its backward (moe_combine_bwd) gives both d(a) = w d(a_s)
// and d(w)[t,e] = <d(a_s), a>; the gate reuses the routing-score ops over every expert (the
// identity choice), whose weight rule is exactly the p-norm division.
#pragma once

#include "model/dense_ffn.h"

namespace moe {

// The router's logits (+ its bias when the layer has one): logits = h router^T (+ bias).
void router_logits_fwd(const SublayerContext& ctx, const Tensor& h, const Tensor& router, const Tensor& bias,
                       const Tensor& logits);
// The router_scores ops' kind of a score function (softmax and topk_softmax score by softmax).
ScoreKind score_kind(ScoreFunc f);

// y += the gated shared experts' output (header comment); saves the gate and SwiGLU state in a.
void shared_experts_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& h_act, FfnActs& a,
                            const Tensor& y);
// dh (T,D) = d/dh of sum(dy * y), overwritten; the weight gradients accumulate.
void shared_experts_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& dy, const FfnActs& a,
                             const Tensor& dh);

}  // namespace moe
