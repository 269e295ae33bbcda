// The routed experts of one MoE layer in MXFP8 (train.precision = "mxfp8", [mxfp8] experts), as
// Olmo-core 3 runs them: the grouped GEMMs' forward and data gradient on MXFP8 operands
// (core/mxfp8.h; kernels: mx_grouped_linear), the weight gradients in bf16 on the saved operands
// dequantized. What is quantized, and where:
//   forward   the gathered rows (R,D), on the tokens' rank: with EP and [mxfp8] dispatch the
//             codes and scales are what crosses the wire (33/32 bytes per value); without
//             dispatch the bf16 rows cross and the experts' rank quantizes them. They stay saved
//             quantized (FfnActs::xr_q) for the gate and up weight gradients.
//             The SwiGLU output (Rx,F), quantized from fp32, saved so for the down weight gradient.
//   backward  the output gradient at the experts (Rx,D) and the SwiGLU gradients (Rx,F), each in
//             [mxfp8] grad_format, against the weights' transposed caches (MxExpertWeights).
// Combine, the returned outputs and every gradient on the wire stay bf16 (Olmo-core: only the
// forward dispatch is FP8). Quantization statistics go to `stats` (4 forward, 4 backward f64:
// the mx_quantize op's), or nowhere when empty.
#pragma once

#include "model/model_state.h"
#include "model/sublayer.h"
#include "model/moe_ffn.h"

namespace moe {

// From the gathered rows xs (R,D) (operand dtype) to the expert outputs over the rows this
// rank's experts computed: the returned view (rows, D) of s.ys_f32_XD, or of a.ys without EP
// or bf16. With EP, a.recv_offsets must already be the plan's.
Tensor mx_experts_forward(const SublayerContext& ctx, const MxExpertWeights& w, const MoeExchangeStep& ex,
                          const Tensor& xs, const Tensor& stats, FfnActs& a);

// From the output gradient g (rows, D) at the experts (operand dtype) to the input gradients
// dxs (gate) and dxs_up (up), adding the three weight gradients. Without EP dxs_up is dxs: the
// gate's input gradient is gathered back into scratch.dnormed_TD before the up one overwrites it.
void mx_experts_backward(const SublayerContext& ctx, const MxExpertWeights& w, LayerWeights& dW,
                         const Tensor& g, const Tensor& stats, FfnActs& a, const Tensor& dxs, const Tensor& dxs_up);

}  // namespace moe
