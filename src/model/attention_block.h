// Attention sublayer, forward then backward (attention_block.cpp):
//   h = RMSNorm(x); q,k,v = clamp(h W^T [+ b]) (clip_qkv); [QK-norm]; RoPE(q,k) on the first
//   rotary_dim dims of each head; o = causal GQA attention; y = o wo^T [+ bo]
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
