// Parameter layout: every parameter of the model as a named slice of ONE flat buffer (llm.c
// style), so gradients, optimizer moments, bf16 weight copies, all-reduce, ZeRO-1 sharding and
// checkpoint I/O are each one allocation and one loop. Names and shapes are docs/MODEL.md's.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"

namespace moe {

// The part of the model one rank holds: a contiguous range of layers (a pipeline stage; the
// first stage holds the embedding, the last the final norm and LM head), or with interleaved
// pipelining several ranges (chunks), and a contiguous range of experts in every MoE layer (its
// expert-parallel shard). The default is the whole model.
struct ModelShard {
  int64_t layer_begin = 0, layer_end = -1;         // -1: n_layers
  // Interleaved pipelining: the layer chunks held, increasing and apart (set instead of the range
  // above, which resolved() then spans). resolved() always fills it: one chunk without interleaving.
  std::vector<LayerRange> chunks;
  int64_t expert_begin = 0, num_local_experts = -1;  // -1: num_experts
  // The same shard with -1 resolved against config (and checked).
  ModelShard resolved(const ModelConfig& config) const;
  bool holds_layer(int64_t l) const;
  bool first_stage() const { return (chunks.empty() ? layer_begin : chunks.front().begin) == 0; }
  bool last_stage(const ModelConfig& config) const {
    return (chunks.empty() ? layer_end : chunks.back().end) == config.n_layers;
  }
  int64_t held_layers() const;  // layers in every chunk (resolved shards)
};

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;  // local shape (experts: num_local_experts x ...)
  int64_t offset = 0;  // elements from the start of the flat buffer
  int64_t numel = 0;
  bool is_norm = false;       // RMSNorm weight: init 1
  bool is_embedding = false;  // excluded from weight decay with no_decay_embeddings_norms
  bool is_expert = false;     // routed-expert weight: sharded over EP, replicated over EDP
  bool is_bias = false;       // attention and router logit biases: init 0 (weight decay as the weights, as Olmo-core 3)
  std::vector<int64_t> global_shape;  // the whole parameter's shape
  int64_t global_begin = 0;  // element of the whole (row-major) parameter where this slice starts
  int64_t global_index = 0;  // position of the parameter in the whole model's layout
  int64_t layer = -1;        // the block holding it; -1 outside the blocks (embedding, final norm, LM head)
};

// Parameters in two regions of the flat buffer: dense (replicated over data parallelism) first,
// then routed experts (replicated over expert-data parallelism), so gradient reduction is one
// collective per region. Within a region, model order.
class ParamLayout {
 public:
  // dense_chunks / expert_chunks: the region lengths are padded to multiples of 16 x chunks, so
  // ZeRO-1 can cut each region into equal, 64-byte aligned chunks.
  explicit ParamLayout(const ModelConfig& config, const ModelShard& shard = {}, int64_t dense_chunks = 1,
                       int64_t expert_chunks = 1);
  const std::vector<ParamInfo>& entries() const { return entries_; }
  int64_t total() const { return total_; }
  // [0, dense_end()): dense parameters; [dense_end(), total()): routed experts.
  int64_t dense_end() const { return dense_end_; }
  const ModelShard& shard() const { return shard_; }
  int64_t num_global_params() const { return num_global_; }  // parameters of the whole model
  const ParamInfo& find(const std::string& name) const;  // throws naming the parameter
  bool contains(const std::string& name) const;

 private:
  void add_layer(const ModelConfig& config, int64_t layer, bool experts);
  void add(std::string name, std::vector<int64_t> shape, bool is_norm = false, bool is_embedding = false,
           bool is_expert = false, bool is_bias = false);
  std::vector<ParamInfo> entries_;
  ModelShard shard_;
  int64_t total_ = 0, dense_end_ = 0, num_global_ = 0, global_experts_ = 0;
};

// Views of one layer's parameters (or gradients, or bf16 copies) inside a flat buffer.
// Tensors of absent parameters are empty (data == nullptr).
struct LayerWeights {
  Tensor attn_norm, attn_out_norm, wq, wk, wv, wo, q_norm, k_norm;
  Tensor bq, bk, bv, bo;                              // model.attention_bias
  Tensor ffn_norm, ffn_out_norm;
  Tensor mlp_gate, mlp_up, mlp_down;                  // dense layers
  Tensor router, exp_gate, exp_up, exp_down;          // MoE layers
  Tensor router_bias;                                 // model.router_logit_bias (E)
  Tensor shared_gate, shared_up, shared_down;         // optional shared experts, stacked
  Tensor shared_router, shared_router_bias;           // model.shared_router (Es,D), (Es)
};

struct Weights {
  Tensor embed, final_norm, lm_head;  // lm_head aliases embed when tied
  Tensor embed_norm;                  // model.embedding_norm only
  std::vector<LayerWeights> layers;
  Tensor flat;                        // the whole buffer as one 1-D tensor
};

// Views of every parameter over one flat buffer (1-D, layout.total() elements; its dtype and
// device carry over to the views).
Weights bind_weights(const ParamLayout& layout, const ModelConfig& config, const Tensor& flat);
// A parameter's view by ParamInfo over a flat buffer of the layout.
Tensor param_view(const ParamInfo& info, const Tensor& flat);

}  // namespace moe
