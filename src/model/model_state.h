// The model's state on one rank: its parameter layout and the flat buffers in the backend's
// memory (fp32 master weights, gradients of the same layout, bf16 GEMM operand copies in bf16
// mode) and the loss-free router biases. Nothing here runs a step (model/transformer.h does).
#pragma once

#include <vector>

#include "config/config.h"
#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/params.h"

namespace moe {

// One layer's weights as the step reads them: master weights (norms, router), their GEMM operand
// copies (= the masters in fp32 mode) and the gradients they accumulate into.
struct LayerParams {
  const LayerWeights& w;
  const LayerWeights& op;
  LayerWeights& grad;
};

class ModelState {
 public:
  // dense_chunks / expert_chunks: ZeRO-1 chunking of the flat regions (model/params.h).
  ModelState(const ModelConfig& config, const ModelShard& shard, int64_t dense_chunks, int64_t expert_chunks,
             DType compute, bool bf16_operands, Backend& ops);

  const ParamLayout& layout() const { return layout_; }
  Weights& params() { return params_; }
  Weights& grads() { return grads_; }
  const Weights& operands() const { return operands_; }
  std::vector<OwnedTensor>& router_bias() { return router_bias_; }
  LayerParams layer(int64_t l) {
    const auto i = static_cast<size_t>(l);
    return {params_.layers[i], operands_.layers[i], grads_.layers[i]};
  }

  // OLMo-style init: truncated normal (+-3 std) for matrices, ones for norms; each element a
  // pure function of (seed, parameter name, element index).
  void init_params(uint64_t seed);
  // After the master weights change: refresh the bf16 operand copies (no-op in fp32 mode).
  void refresh_operand_weights();
  void zero_grads();

 private:
  ModelConfig cfg_;
  Backend& ops_;
  ParamLayout layout_;
  DType compute_;
  Buffer param_mem_, grad_mem_, operand_mem_;
  Weights params_, grads_, operands_;  // operands_ = params_ in fp32 mode
  std::vector<OwnedTensor> router_bias_;
};

}  // namespace moe
