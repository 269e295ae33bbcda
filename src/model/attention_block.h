// Attention sublayer, forward then backward (attention_block.cpp):
//   h = RMSNorm(x); q,k,v = h W^T; [QK-norm]; RoPE(q,k); o = causal GQA attention; y = o wo^T
//   pre: x_out = x + y          peri: x_out = x + RMSNorm_out(y)
#pragma once

#include "model/model_state.h"
#include "model/sublayer.h"

namespace moe {

void attention_forward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, AttnActs& a,
                       const Tensor& x_out);
// scratch.dresid_TD: d(x_out) in, d(x_in) out; weight gradients accumulate into p.grad.
void attention_backward(const SublayerContext& ctx, const LayerParams& p, const Tensor& x_in, const AttnActs& a);

}  // namespace moe
