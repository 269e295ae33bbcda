// The MoE transformer: parameters, saved activations, and the forward + backward of one
// micro-batch. The step's data flow, top to bottom (transformer.cpp):
//   embedding -> [block: attention sublayer (attention_block.cpp) -> FFN sublayer (dense_ffn.cpp
//   or moe/moe_ffn.cpp)] x L -> final norm -> LM head + cross-entropy in row chunks
//   -> backward of the same, in reverse, gradients accumulating into one flat buffer.
// Auxiliary MoE losses are computed in each MoE layer's backward, where their gradients are
// injected; their values land in StepStats. A pipeline stage holds layers [layer_begin,
// layer_end) of its ModelShard and runs the same code per slot (stage_forward/stage_backward);
// the first stage adds the embedding, the last the final norm, LM head and loss.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "config/config.h"
#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/activations.h"
#include "model/params.h"
#include "moe/expert_exchange.h"
#include "parallel/communicator.h"

namespace moe {

// What the host reads of one optimizer step, in one allocation of the backend's memory (values,
// grad_sumsq, mean_prob, counts, exchange), so that it takes one download per step.
struct StepStats {
  Buffer memory;
  Tensor words;   // all of memory as i32 words: what the host downloads
  Tensor values;  // f64: [ce, lm_z, lbl per MoE layer..., router_z per MoE layer...]
  Tensor control;     // (kCtlSize) f64: the step's decisions (kernels/step_control.h), made on the device
  Tensor grad_sumsq;  // (num_global_params) f64: each parameter's gradient sum of squares (GradSync)
  Tensor exchange;    // (MoE layers, 4 + ep) i32 with EP: the exchange counters (copied in), else empty
  std::vector<Tensor> counts;     // per MoE layer, (E) i32, step total tokens per expert (summed over micro-batches)
  std::vector<Tensor> mean_prob;  // per MoE layer, (E) compute dtype, token-weighted mean over the step
  int64_t num_moe_layers = 0;
  Tensor ce() const { return values.slice(0, 1); }
  Tensor lm_z() const { return values.slice(1, 2); }
  Tensor lbl(int64_t m) const { return values.slice(2 + m, 3 + m); }
  Tensor router_z(int64_t m) const { return values.slice(2 + num_moe_layers + m, 3 + num_moe_layers + m); }
  // Where t's bytes start within memory (for reading a downloaded copy of words).
  size_t offset_of(const Tensor& t) const { return static_cast<size_t>(static_cast<const char*>(t.data) - static_cast<const char*>(memory.data())); }
};

// How one micro-batch's losses enter the step's total (docs/MODEL.md, "Losses of one step").
struct MicroBatchScales {
  double ce_scale = 1.0;    // 1 / (loss tokens in the whole step)
  double aux_weight = 1.0;  // tokens in this micro-batch / tokens in the whole step
  int64_t token_base = 0;   // global index of this micro-batch's first token (random routing)
};

struct ModelOptions {
  DType compute = DType::kF32;  // f32, or f64 with the ref backend
  bool bf16_operands = false;   // GEMM operands and their saved activations in bf16
  bool recompute = false;       // keep only the residual stream; recompute blocks in backward
  int64_t batch = 1;            // sequences per micro-batch
  int64_t seq_len = 2;
  uint64_t seed = 0;            // random routing draws
  ModelShard shard;             // the layers and experts this rank holds (default: all)
  int64_t dense_chunks = 1;     // ZeRO-1: the flat regions split into this many equal chunks
  int64_t expert_chunks = 1;
  // Expert parallelism: the EP group (not owned; nullptr or size 1 = no EP). Its rank r must
  // hold experts [r*E/ep, (r+1)*E/ep) (shard.expert_begin, shard.num_local_experts).
  Communicator* ep = nullptr;
  double ep_capacity_factor = 0;  // 0 = dropless (see parallel.ep_capacity_factor)
  // Micro-batches whose saved activations a pipeline stage holds at once (1F1B: min(pp - stage,
  // micro-batches)); each slot is a residual stream + per-layer activations, scratch is shared.
  int64_t pipeline_slots = 1;
};

class Transformer {
 public:
  Transformer(const ModelConfig& config, const LossConfig& loss, const ModelOptions& options,
              Backend& ops);

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  Backend& ops() { return ops_; }
  DType compute_dtype() const { return dims_.cdt; }

  // Master parameters, gradients (same layout), and loss-free router biases per MoE layer.
  Weights& params() { return params_; }
  Weights& grads() { return grads_; }
  std::vector<OwnedTensor>& router_bias() { return router_bias_; }

  // OLMo-style init: truncated normal (+-3 std) for matrices, ones for norms; each element a
  // pure function of (seed, parameter name, element index).
  void init_params(uint64_t seed);
  // After the master weights change: refresh the bf16 operand copies (no-op in fp32 mode).
  void refresh_operand_weights();
  void zero_grads();
  StepStats make_stats() const;
  void zero_stats(StepStats& stats) const;

  // One micro-batch: ids and labels (B,S) i32 (label < 0: no loss). Accumulates parameter
  // gradients of the step's total loss and adds this micro-batch's loss terms to stats.
  // = stage_forward(0, ...) + stage_backward(0, ...) on the whole model.
  void forward_backward(const Tensor& ids, const Tensor& labels, const MicroBatchScales& scales,
                        StepStats& stats);

  // Pipeline stage API (the shard's layers [layer_begin, layer_end); train/pipeline.h runs the
  // schedule). A slot holds one in-flight micro-batch's saved activations.
  int64_t pipeline_slots() const { return static_cast<int64_t>(resid_.size()); }
  bool first_stage() const { return layout_.shard().first_stage(); }
  bool last_stage() const { return layout_.shard().last_stage(cfg_); }
  // (T,D) compute dtype: a non-first stage receives the previous stage's output here.
  const Tensor& stage_input(int64_t slot) const { return resid_[static_cast<size_t>(slot)].front(); }
  // (T,D): the residual stream after the stage's last layer (a non-last stage sends it).
  const Tensor& stage_output(int64_t slot) const { return resid_[static_cast<size_t>(slot)].back(); }
  // (T,D) gradient of the residual stream: a non-last stage receives d(stage output) here before
  // stage_backward; after stage_backward a non-first stage finds d(stage input) here (valid
  // until the next backward).
  const Tensor& stage_grad() const { return scratch_.dx; }
  // Forward of the stage's layers (the first stage embeds ids; others read stage_input(slot)).
  void stage_forward(int64_t slot, const Tensor& ids, int64_t token_base);
  // Backward of the stage's layers, gradients accumulating. The last stage first runs final norm,
  // LM head and loss (forward and backward, labels); the first stage ends with the embedding.
  void stage_backward(int64_t slot, const Tensor& ids, const Tensor& labels, const MicroBatchScales& scales,
                      StepStats& stats);
  // Last stage, after stage_forward: summed cross-entropy over labeled positions added to out (1) f64.
  void stage_loss(int64_t slot, const Tensor& labels, const Tensor& out);
  // Intra-document masking for the following forward/backward calls: (B,S) i32 document starts
  // of the micro-batch (a view the caller keeps alive), or an empty tensor for plain causal
  // attention (the default). See attention_fwd in kernels/op_list.inc.
  void set_document_starts(const Tensor& doc_start) { doc_start_ = doc_start; }
  // Called after each layer's backward with its index (data-parallel gradient reduction starts
  // a finished layer's bucket there); empty = none.
  void set_layer_grads_hook(std::function<void(int64_t)> hook) { layer_grads_hook_ = std::move(hook); }
  // Forward only: full logits (B*S, V) in the compute dtype (tests, evaluation).
  void forward_logits(const Tensor& ids, const Tensor& logits);
  // Forward only: summed cross-entropy over labeled positions added to out (1) f64 (validation).
  // Whole model only; Trainer::forward_loss runs it across pipeline stages.
  void forward_loss(const Tensor& ids, const Tensor& labels, const Tensor& out);

  // The expert choice (T,K) of MoE layer l in the last forward (tests check no choice flips).
  const Tensor& expert_choice(int64_t l) { return acts(0, l).ffn.expert_idx; }
  // The expert outputs (T*K,D) of MoE layer l in the last forward, in the plan's expert-major
  // order (with EP: as returned to this rank; rows the capacity dropped are zero).
  const Tensor& expert_outputs(int64_t l) { return acts(0, l).ffn.ys; }
  // The router scores (T,E) of MoE layer l in the last forward.
  const Tensor& router_scores(int64_t l) { return acts(0, l).ffn.scores; }
  // Expert parallelism: the exchange counters, (MoE layers, 4 + ep) i32 on the device: each
  // layer's plan totals (moe/expert_exchange.h, ExchangeTotal) summed over the forwards since
  // the last reset (recompute re-runs are not counted); and their reset.
  const Tensor& exchange_counts() const { return exchange_counts_.t; }
  void reset_exchange_counts();
  int64_t ep_size() const { return dims_.ep; }
  const ExpertExchange* exchange() const { return exchange_.get(); }  // nullptr without EP
  // Bytes of saved activations per token (all layers), for the report.
  double activation_bytes_per_token() const;
  // Bytes of the one activation arena (saved activations + shared scratch, 64-byte padded);
  // estimate_memory() (model/memory.h) gives the same in closed form.
  size_t activation_arena_bytes() const { return arena_.capacity(); }

 private:
  void final_norm(int64_t slot);
  void layer_forward(int64_t slot, int64_t l, int64_t token_base);
  void layer_backward(int64_t slot, int64_t l, const MicroBatchScales& s, StepStats& stats);
  // Saved activations of layer l in a slot (with recompute: the one shared set).
  LayerActs& acts(int64_t slot, int64_t l) {
    return recompute_ ? acts_[0][0] : acts_[static_cast<size_t>(slot)][static_cast<size_t>(l - layer_begin_)];
  }
  // A dense layer's FFN activations (with recompute in a stage of both kinds: their own buffers).
  FfnActs& dense_ffn_acts(int64_t slot, int64_t l) {
    return recompute_dense_.x_mid.data ? recompute_dense_.ffn : acts(slot, l).ffn;
  }
  // A GEMM operand view of x: x itself, or x converted into store (bf16 mode).
  Tensor operand(const Tensor& x, const Tensor& store);
  // The operand-dtype scratch for an upstream gradient of x's shape.
  Tensor operand_grad(const Tensor& dy);
  // bf16 mode runs attention's matrix products on bf16 operands too (fp32 softmax and sums).
  bool bf16_attention() const { return dims_.adt == DType::kBF16; }
  // Where a kernel writes a (rows, cols) gradient that only feeds GEMMs: the fp32 tensor itself,
  // or (bf16 mode) an operand-dtype view over the start of `store`, which the kernel fills with
  // rounded values (op_list.inc: "may be bf16 (rounded)") instead of a later convert pass.
  Tensor grad_operand_store(const Tensor& store, int64_t rows, int64_t cols, const Tensor& fp32) const;

  // SwiGLU MLP (dense FFN and shared expert): y (+)= down(silu(h gate^T) * (h up^T)), and its
  // backward into dh (overwritten) and the three weight gradients (accumulated).
  void swiglu_mlp_forward(const Tensor& h_act, const Tensor& gate, const Tensor& up, const Tensor& down,
                          FfnActs& a, const Tensor& y, bool accumulate);
  void swiglu_mlp_backward(const Tensor& dy, const Tensor& gate, const Tensor& up, const Tensor& down,
                           FfnActs& a, const Tensor& dgate, const Tensor& dup, const Tensor& ddown,
                           const Tensor& dh);
  // Sublayers (attention_block.cpp, dense_ffn.cpp, moe/moe_ffn.cpp).
  void attention_forward(int64_t l, const Tensor& x_in, AttnActs& a, const Tensor& x_out);
  void attention_backward(int64_t l, const Tensor& x_in, AttnActs& a);
  void dense_forward(int64_t l, const Tensor& x_in, FfnActs& a, const Tensor& x_out);
  void dense_backward(int64_t l, const Tensor& x_in, FfnActs& a);
  void moe_forward(int64_t slot, int64_t l, const Tensor& x_in, FfnActs& a, const Tensor& x_out, int64_t token_base);
  void moe_backward(int64_t slot, int64_t l, const Tensor& x_in, FfnActs& a, const MicroBatchScales& s, StepStats& stats);
  // Shared pieces: the normed input of a sublayer, and the output norm + residual add.
  Tensor norm_input(const Tensor& x_in, const Tensor& w, const Tensor& rstd, const Tensor& h, const Tensor& h_act);
  void finish_sublayer(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out, const Tensor& x_in, const Tensor& x_out);
  // Backward of finish_sublayer: returns d(y) given d(x_out) in scratch.dx.
  Tensor sublayer_output_grad(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out, const Tensor& dout_norm_w);
  void norm_input_backward(const Tensor& dh, const Tensor& x_in, const Tensor& w, const Tensor& rstd, const Tensor& dw);

  ModelConfig cfg_;
  LossConfig loss_;
  Backend& ops_;
  ParamLayout layout_;
  Dims dims_;
  bool recompute_ = false;
  uint64_t seed_ = 0;
  int64_t head_chunk_ = 0;
  int64_t moe_index_base_ = 0;  // layer index of the first MoE layer
  int64_t layer_begin_ = 0, layer_end_ = 0;  // the stage's layers

  Buffer param_mem_, grad_mem_, operand_mem_;
  Weights params_, grads_, operands_;  // operands_ = params_ in fp32 mode
  std::vector<OwnedTensor> router_bias_;

  Arena arena_;
  // Per slot: (T,D) residual stream into each of the stage's layers, and after its last.
  std::vector<std::vector<Tensor>> resid_;
  // Per slot, per stage layer; with recompute one shared set (acts_[0][0], the largest kind).
  std::vector<std::vector<LayerActs>> acts_;
  LayerActs recompute_dense_;  // recompute in a stage with dense and MoE layers: dense FFN buffers
  Scratch scratch_;
  Tensor rstd_final_, xf_act_;  // (T), (T,D) final norm's statistics and output, operand dtype (last stage only)
  Tensor doc_start_;                  // (B,S) i32 document starts, or empty (plain causal)
  std::function<void(int64_t)> layer_grads_hook_;

  // Expert parallelism (ep > 1): the transport and exchange, the plan per MoE layer (made in the
  // forward, reused by the backward and by recompute), counters; recomputing_ marks the
  // backward's forward re-runs.
  std::unique_ptr<ExpertTransport> transport_;
  std::unique_ptr<ExpertExchange> exchange_;
  Buffer plan_mem_;                               // every plan's i32 words, on the device
  std::vector<std::vector<ExchangePlan>> plans_;  // [activation slot][MoE layer]
  OwnedTensor exchange_counts_;
  bool recomputing_ = false;
};

}  // namespace moe
