// The model's state on one rank: its parameter layout and the flat buffers in the backend's
// memory (fp32 master weights, gradients of the same layout, bf16 GEMM operand copies in bf16
// mode) and the loss-free router biases. Nothing here runs a step (model/transformer.h does).
#pragma once

#include <optional>
#include <vector>

#include "config/config.h"
#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/grad_writes.h"
#include "model/params.h"

namespace moe {

// MXFP8 copies of one MoE layer's local expert weights (train.precision = "mxfp8"), quantized from
// the fp32 masters after every update, each in both orientations (one cannot be made from the
// other): "q" quantized along the forward's reduction (K-major for the forward), "t" along the
// data gradient's, stored transposed (K-major for the data gradient). Codes e4m3, scales e8m0.
//   gate, up (El,F,D):  q (El,F,D) + (El,F,D/32)    t (El,D,F) + (El,D,F/32)
//   down (El,D,F):      q (El,D,F) + (El,D,F/32)    t (El,F,D) + (El,F,D/32)
struct MxExpertWeights {
  Tensor gate_q, gate_qs, gate_t, gate_ts;
  Tensor up_q, up_qs, up_t, up_ts;
  Tensor down_q, down_qs, down_t, down_ts;
};

// MXFP8 copies of one layer's attention projections (mxfp8.attention), as MxExpertWeights: "q"
// quantized along the forward's reduction (D for wq/wk/wv, H*hd for wo), "t" along the data
// gradient's, stored transposed.
struct MxWeightCopies {
  Tensor q, qs, t, ts;  // (N,K) + (N,K/32), (K,N) + (K,N/32)
};
struct MxAttentionWeights {
  MxWeightCopies wq, wk, wv, wo;
};

// One layer's weights as the step reads them: master weights (norms, router), their GEMM operand
// copies (= the masters in fp32 mode), the gradients they accumulate into, and the MXFP8 expert
// copies (MoE layers with MXFP8 experts; else null) and the MXFP8 attention copies (else null).
struct LayerParams {
  const LayerWeights& w;
  const LayerWeights& op;
  LayerWeights& grad;
  const MxExpertWeights* mx = nullptr;
  const MxAttentionWeights* mx_attn = nullptr;
};

class ModelState {
 public:
  // dense_chunks / expert_chunks: ZeRO-1 chunking of the flat regions (model/params.h).
  // mx_rule: MXFP8 caches quantized with that scale rule, of the expert weights (mx_experts) and
  // of the attention projections (mx_attention); none without it.
  ModelState(const ModelConfig& config, const ModelShard& shard, int64_t dense_chunks, int64_t expert_chunks,
             DType compute, bool bf16_operands, Backend& ops, std::optional<mx::ScaleRule> mx_rule = {},
             bool mx_experts = true, bool mx_attention = false);

  const ParamLayout& layout() const { return layout_; }
  Weights& params() { return params_; }
  Weights& grads() { return grads_; }
  const Weights& operands() const { return operands_; }
  std::vector<OwnedTensor>& router_bias() { return router_bias_; }
  LayerParams layer(int64_t l) {
    const auto i = static_cast<size_t>(l);
    return {params_.layers[i], operands_.layers[i], grads_.layers[i], mx_.empty() ? nullptr : &mx_[i],
            mx_attn_.empty() ? nullptr : &mx_attn_[i]};
  }

  // OLMo-style init: truncated normal (+-3 std) for matrices, ones for norms; each element a
  // pure function of (seed, parameter name, element index).
  void init_params(uint64_t seed);
  // After the master weights change: refresh the bf16 operand copies (no-op in fp32 mode; skipped
  // with bf16_done, when AdamW wrote them in its pass) and the MXFP8 expert caches.
  void refresh_operand_weights(bool bf16_done = false);
  // The bf16 operand copies, or null when the operands are the parameters (fp32 mode).
  const Weights* bf16_operands() const { return operands_.flat.data != params_.flat.data ? &operands_ : nullptr; }
  // The gradients' first-write tracking (model/grad_writes.h): start_step() where a step used to
  // zero-fill them.
  GradWrites& grad_writes() { return *grad_writes_; }

 private:
  ModelConfig cfg_;
  Backend& ops_;
  ParamLayout layout_;
  DType compute_;
  Buffer param_mem_, grad_mem_, operand_mem_, mx_mem_;
  Weights params_, grads_, operands_;  // operands_ = params_ in fp32 mode
  std::optional<mx::ScaleRule> mx_rule_;
  std::vector<MxExpertWeights> mx_;    // per model layer (filled for local MoE layers); empty: none
  std::vector<MxAttentionWeights> mx_attn_;  // per model layer (filled for local layers); empty: none
  std::vector<OwnedTensor> router_bias_;
  std::optional<GradWrites> grad_writes_;
};

}  // namespace moe
