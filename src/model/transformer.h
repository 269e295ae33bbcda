// The MoE transformer's step: the forward and backward of one micro-batch over this rank's part
// of the model. It holds three things, each in its own unit:
//   ModelState (model/model_state.h)         parameters, gradients, operand copies, router biases
//   ActivationPlan (model/activations.h)     the arena of saved activations and shared scratch
//   the step code (this file's class)        which runs the sublayers in order:
//   embedding -> [attention (model/attention_block.h) -> FFN (model/dense_ffn.h or
//   model/moe_ffn.h)] x L -> head (model/lm_head.h: final norm, LM head + loss in row chunks)
//   -> backward of the same, in reverse, gradients accumulating into one flat buffer.
// Each sublayer is a free function of an explicit context (backend, dims, choices, scratch, the
// micro-batch's document starts), its weights and its saved activations. Auxiliary MoE losses
// are computed in each MoE layer's backward, where their gradients are injected; their values
// land in StepStats. A pipeline stage holds the layer chunks of its ModelShard (one range, or
// several with interleaved pipelining); parallel/pipeline.h runs the schedule: stage_forward,
// head_step (last stage), stage_backward, each on one chunk.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "config/config.h"
#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/activations.h"
#include "model/lm_head.h"
#include "model/model_state.h"
#include "model/params.h"
#include "model/step_stats.h"
#include "model/expert_dispatch.h"
#include "model/exchange_bounds.h"
#include "model/moe_ffn.h"
#include "model/sublayer.h"

namespace moe {

// How one micro-batch's losses enter the step's total (docs/MODEL.md, "Losses of one optimizer step").
struct MicroBatchScales {
  double ce_scale = 1.0;    // 1 / (loss tokens in the whole step)
  double aux_weight = 1.0;  // the auxiliary losses' weight: tokens in this micro-batch / loss.aux_divisor
  double stat_weight = 1.0;  // routing statistics' weight: tokens in this micro-batch / tokens in the step
  int64_t token_base = 0;   // global index of this micro-batch's first token (random routing)
};

// One micro-batch, passed down explicitly to every step of the schedule.
struct MicroBatch {
  Tensor ids, labels;  // (B,S) i32; label < 0: no loss
  Tensor doc_start;    // (B,S) i32 document starts (intra-document masking), or empty: plain causal
  // Sliding windows: per window of ModelConfig::attention_windows(), (B,S) i32 the first key each
  // query sees, document starts included (AttentionMasks builds them).
  std::vector<Tensor> window_start;
  MicroBatchScales scales;
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
  // Expert parallelism: ranks in the EP group (1 = none); rank r holds experts [r*E/ep,
  // (r+1)*E/ep) (shard.expert_begin, shard.num_local_experts). The exchange itself is installed
  // after construction (set_expert_dispatch; parallel/parallelize.h).
  int64_t ep = 1;
  double ep_capacity_factor = 0;  // 0 = dropless (see parallel.ep_capacity_factor)
  ExchangeTransportKind ep_transport = ExchangeTransportKind::kP2p;  // parallel.ep_transport
  // Micro-batches whose saved activations a pipeline stage holds at once (1F1B: min(pp - stage,
  // micro-batches)); each slot is a residual stream + per-layer activations, scratch is shared.
  int64_t pipeline_slots = 1;
  // Interleaved pipelining: slots per chunk of shard.chunks (set instead of pipeline_slots).
  std::vector<int64_t> chunk_slots;
  MxMode mx;  // MXFP8 experts (train.precision = "mxfp8"): model/activations.h, model/mx_experts.h
};

class Transformer {
 public:
  Transformer(const ModelConfig& config, const LossConfig& loss, const ModelOptions& options,
              Backend& ops);

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return state_.layout(); }
  Backend& ops() { return ops_; }
  DType compute_dtype() const { return dims_.cdt; }
  const Dims& dims() const { return dims_; }  // the micro-batch's sizes (model/activations.h)

  // The model state (model/model_state.h) and its pieces.
  ModelState& state() { return state_; }
  Weights& params() { return state_.params(); }
  Weights& grads() { return state_.grads(); }
  std::vector<OwnedTensor>& router_bias() { return state_.router_bias(); }
  void init_params(uint64_t seed) { state_.init_params(seed); }
  void refresh_operand_weights(bool bf16_done = false) { state_.refresh_operand_weights(bf16_done); }
  const Weights* bf16_operands() const { return state_.bf16_operands(); }
  // A step's gradients start here: the first write of each overwrites it (model/grad_writes.h).
  void start_gradients() { state_.grad_writes().start_step(); }
  GradWrites& grad_writes() { return state_.grad_writes(); }
  StepStats make_stats() const;
  void zero_stats(StepStats& stats) const;

  // One micro-batch on the whole model: stage_forward + head_step + stage_backward. Accumulates
  // parameter gradients of the step's total loss and adds the micro-batch's loss terms to stats.
  void forward_backward(const MicroBatch& mb, StepStats& stats);

  // Pipeline stage API (the shard's layer chunks, 0 .. pipeline_chunks() - 1 in layer order;
  // parallel/pipeline.h runs the schedule). A slot holds one in-flight micro-batch's saved
  // activations of one chunk.
  int64_t pipeline_chunks() const { return plan_.chunks(); }
  int64_t pipeline_slots(int64_t chunk = 0) const { return plan_.slots(chunk); }
  bool first_stage() const { return layout().shard().first_stage(); }  // holds the embedding (chunk 0)
  bool last_stage() const { return layout().shard().last_stage(cfg_); }  // holds the head (the last chunk)
  // (T,D) compute dtype: a chunk that does not start the model receives the previous one's output here.
  const Tensor& stage_input(int64_t chunk, int64_t slot) const { return plan_.stage_input(chunk, slot); }
  // (T,D): the residual stream after the chunk's last layer (sent on unless it ends the model).
  const Tensor& stage_output(int64_t chunk, int64_t slot) const { return plan_.stage_output(chunk, slot); }
  // (T,D) gradient of the residual stream: before stage_backward it holds d(stage output) (a
  // non-last stage receives it here; the last stage's head_step writes it); after, on a
  // non-first stage, d(stage input) (valid until the next backward).
  const Tensor& stage_grad() { return plan_.scratch().dresid_TD; }
  // Forward of a chunk's layers (the first stage's chunk 0 embeds mb.ids; others read
  // stage_input(chunk, slot)).
  void stage_forward(int64_t chunk, int64_t slot, const MicroBatch& mb);
  // Last stage, after stage_forward of its last chunk: final norm, LM head and loss, forward and
  // backward (mb.labels, scales.ce_scale); loss terms added to stats; d(output) into stage_grad().
  void head_step(int64_t slot, const MicroBatch& mb, StepStats& stats);
  // Backward of a chunk's layers from stage_grad(), gradients accumulating (with recompute each
  // layer's forward re-runs first); the first stage's chunk 0 ends with the embedding.
  void stage_backward(int64_t chunk, int64_t slot, const MicroBatch& mb, StepStats& stats);
  // Last stage, after stage_forward of its last chunk: summed cross-entropy over labeled positions
  // added to out (1) f64.
  void stage_loss(int64_t slot, const Tensor& labels, const Tensor& out);
  // Called after each layer's backward with its index (data-parallel gradient reduction starts
  // a finished layer's bucket there); empty = none.
  void set_layer_grads_hook(std::function<void(int64_t)> hook) { layer_grads_hook_ = std::move(hook); }
  // Expert parallelism (options.ep > 1): how routed rows reach the experts of other ranks (not
  // owned; set before the first forward, by parallelize in parallel/parallelize.h).
  void set_expert_dispatch(ExpertDispatch* dispatch);
  // loss.lbl_granularity = "global": how a micro-batch's counts are summed over the data-parallel
  // group (the trainer's; without one, or with one rank, the local counts are used).
  void set_count_sum(CountSum sum) { count_sum_ = std::move(sum); }
  // Forward only: full logits (B*S, V) in the compute dtype (tests, generation); doc_start: (B,S)
  // i32 document starts in host memory, or empty.
  void forward_logits(const Tensor& ids, const Tensor& logits, const Tensor& host_doc_start = Tensor());
  // Forward only: summed cross-entropy over labeled positions added to out (1) f64 (validation).
  // Whole model only; Trainer::forward_loss runs it across pipeline stages.
  void forward_loss(const MicroBatch& mb, const Tensor& out);

  // The expert choice (T,K) of MoE layer l in the last forward (tests check no choice flips).
  const Tensor& expert_choice(int64_t l) { return plan_.layer(0, l).ffn.expert_idx; }
  // The expert outputs (T*K,D) of MoE layer l in the last forward, in the plan's expert-major
  // order (with EP: as returned to this rank; rows the capacity dropped are zero).
  const Tensor& expert_outputs(int64_t l) { return plan_.layer(0, l).ffn.ys; }
  // The router scores (T,E) of MoE layer l in the last forward.
  const Tensor& router_scores(int64_t l) { return plan_.layer(0, l).ffn.scores; }
  const Tensor& router_logits(int64_t l) { return plan_.layer(0, l).ffn.logits; }
  // Layer l's attention activations of the last forward (tests: clip_qkv's pre-clamp projections).
  const AttnActs& attention_acts(int64_t l) { return plan_.layer(0, l).attn; }
  // MXFP8 experts: each MoE layer's quantization statistics since the last reset, (MoE layers,
  // 8) f64 on the device (forward then backward, each as the mx_quantize op's: max |x|,
  // saturated, underflowed, values; recompute re-runs are not counted); empty otherwise.
  const Tensor& quant_stats() const { return quant_stats_.t; }
  void reset_quant_stats();
  int64_t ep_size() const { return dims_.ep; }
  // Bytes of saved activations per token (all layers), for the report.
  double activation_bytes_per_token() const { return static_cast<double>(plan_.saved_tensor_bytes()) / static_cast<double>(dims_.T); }
  // Bytes of the one activation arena (saved activations + shared scratch, 64-byte padded);
  // estimate_memory() (plan/memory.h) runs the same plan in measure mode.
  size_t activation_arena_bytes() const { return plan_.bytes(); }

 private:
  // The context every sublayer of layer l on this micro-batch gets (its attention's first keys).
  SublayerContext sublayer_context(const MicroBatch& mb, int64_t l);
  HeadContext head_context() {
    return HeadContext{ops_, cfg_, dims_, plan_.scratch(), plan_.final_norm(), plan_.head_chunk()};
  }
  HeadWeights head_weights() { return HeadWeights{params().final_norm, state_.operands().lm_head}; }
  // The first stage's embedding: x = embed(ids) * embed_scale, then its RMSNorm (embedding_norm),
  // into stage_input(slot); backward from stage_grad() into the embedding's gradients.
  void embed_forward(int64_t slot, const Tensor& ids);
  void embed_backward(int64_t slot, const Tensor& ids);
  // recomputing: the backward's re-run of the forward (the expert exchange plans once).
  void layer_forward(const SublayerContext& ctx, int64_t slot, int64_t l, const MicroBatch& mb, bool recomputing);
  void layer_backward(const SublayerContext& ctx, int64_t slot, int64_t l, const MicroBatch& mb, StepStats& stats);
  MoeExchangeStep exchange_step(int64_t slot, int64_t m, bool recomputing);

  ModelConfig cfg_;
  ModelChoices choice_;
  LossConfig loss_;
  Backend& ops_;
  Dims dims_;
  bool recompute_ = false;
  uint64_t seed_ = 0;
  std::vector<LayerRange> chunks_;  // the stage's layers
  std::vector<int> window_slot_;  // per layer: its window in MicroBatch::window_start, -1 = full causal
  std::vector<char> rope_layer_;  // per layer: applies RoPE (model.rope)

  ModelState state_;
  ActivationPlan plan_;
  std::function<void(int64_t)> layer_grads_hook_;
  LblGranularity lbl_granularity_ = LblGranularity::kLocalBatch;
  CountSum count_sum_;

  ExpertDispatch* dispatch_ = nullptr;  // expert parallelism only
  OwnedTensor quant_stats_;  // MXFP8 experts only
};

}  // namespace moe
