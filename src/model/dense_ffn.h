// SwiGLU MLP, forward then backward (dense_ffn.cpp): y = down(silu(gate(h)) * up(h)). Used by
// the dense FFN sublayer (the first n_dense_layers blocks: h = RMSNorm(x), residual as in
// attention) and by the shared expert of MoE layers (model/moe_ffn.cpp).
#pragma once

#include "model/model_state.h"
#include "model/sublayer.h"

namespace moe {

// The three weights of one SwiGLU MLP (the dense FFN's, or the shared expert's).
struct MlpWeights {
  const Tensor &gate, &up, &down;
};

// y (+)= down(silu(h_act gate^T) * (h_act up^T)); g, u and their product saved in a.
void swiglu_mlp_forward(const SublayerContext& ctx, const MlpWeights& w, const Tensor& h_act, FfnActs& a,
                        const Tensor& y, bool accumulate);
// dh (T,D) = d/dh of sum(dy * y), overwritten; the three weight gradients accumulate.
void swiglu_mlp_backward(const SublayerContext& ctx, const MlpWeights& w, const MlpWeights& dw, const Tensor& dy,
                         const FfnActs& a, const Tensor& dh);

void dense_ffn_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, FfnActs& a,
                       const Tensor& x_out);
// scratch.dresid_TD: d(x_out) in, d(x_in) out.
void dense_ffn_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, const FfnActs& a);

}  // namespace moe
