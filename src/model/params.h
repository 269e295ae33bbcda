// Parameter layout: every parameter of the model as a named slice of ONE flat buffer (llm.c
// style), so gradients, optimizer moments, bf16 weight copies, all-reduce, ZeRO-1 sharding and
// checkpoint I/O are each one allocation and one loop. Names and shapes are docs/MODEL.md's.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"

namespace moe {

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // elements from the start of the flat buffer
  int64_t numel = 0;
  bool is_norm = false;       // RMSNorm weight: init 1
  bool is_embedding = false;  // excluded from weight decay with no_decay_embeddings_norms
};

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& config);
  const std::vector<ParamInfo>& entries() const { return entries_; }
  int64_t total() const { return total_; }
  const ParamInfo& find(const std::string& name) const;  // throws naming the parameter
  bool contains(const std::string& name) const;

 private:
  void add(std::string name, std::vector<int64_t> shape, bool is_norm = false, bool is_embedding = false);
  std::vector<ParamInfo> entries_;
  int64_t total_ = 0;
};

// Views of one layer's parameters (or gradients, or bf16 copies) inside a flat buffer.
// Tensors of absent parameters are empty (data == nullptr).
struct LayerWeights {
  Tensor attn_norm, attn_out_norm, wq, wk, wv, wo, q_norm, k_norm;
  Tensor ffn_norm, ffn_out_norm;
  Tensor mlp_gate, mlp_up, mlp_down;                  // dense layers
  Tensor router, exp_gate, exp_up, exp_down;          // MoE layers
  Tensor shared_gate, shared_up, shared_down;         // optional shared expert
};

struct Weights {
  Tensor embed, final_norm, lm_head;  // lm_head aliases embed when tied
  std::vector<LayerWeights> layers;
  Tensor flat;                        // the whole buffer as one 1-D tensor
};

Weights bind_weights(const ParamLayout& layout, const ModelConfig& config, void* base, DType dtype);
// A parameter's view by ParamInfo.
Tensor param_view(const ParamInfo& info, void* base, DType dtype);

}  // namespace moe
