// Memory estimate of one training process, without allocating: parameters, gradients, AdamW
// state from the rank's parameter layout, and the activation arena measured by the same planning
// code that sizes the Transformer's (ActivationPlan in measure mode, model/activations.h).
#pragma once

#include <cstdint>
#include <string>

#include "config/config.h"
#include "model/activations.h"

namespace moe {

struct MemoryEstimate {
  double params = 0;           // fp32 master weights: 4 N
  double operand_copies = 0;   // bf16 GEMM operand copies (bf16 mode): 2 N
  double mx_caches = 0;        // MXFP8: 2 x 33/32 bytes per local expert (and attention) weight (two orientations)
  double grads = 0;            // fp32 gradients: 4 N
  double optimizer = 0;        // AdamW first and second moments: 2 x 4 N
  double router_bias = 0;      // loss-free biases: 4 E per MoE layer
  double activations = 0;      // the activation arena: saved activations + shared scratch (= the trainer's arena)
  // Kernel buffers outside the arena that scale with the batch: the bf16 attention operands, and
  // the cpu MXFP8 GEMMs' dequantized bf16 operands (kernels/cpu/mxfp8.cpp).
  double kernel_scratch = 0;
  // train.backend = "cuda": the backend's own buffers (kernel scratch, cuBLASLt workspace) and
  // cuDNN attention's bf16 copies + workspace (bounded by the Hopper formula, kernels/cuda_memory.h)
  double backend_buffers = 0;
  // Buffers outside the arena: pipeline gradient send copies (stages after the first: one
  // (T,D) per slot), expert-exchange plans and counters (EP: one plan per slot and MoE layer).
  double comm_buffers = 0;
  double step_stats = 0;  // the step's record (StepStats: losses, per-parameter norms, counts)
  double act_per_layer_token = 0;  // arena bytes per layer per token (an MoE layer; dense if no MoE)
  double act_shared = 0;           // the arena less the layers: residual stream, shared scratch, final norm
  double total() const {
    return params + operand_copies + mx_caches + grads + optimizer + router_bias + activations + kernel_scratch + backend_buffers +
           comm_buffers + step_stats;
  }
};

// micro_batch sequences of seq_len tokens per forward/backward; bf16 = GEMM operands in bf16;
// ep > 1: expert parallelism (buffers for the rows this rank's experts may receive, bounded by
// the capacity factor when > 0). Parameters are counted for the whole model.
MemoryEstimate estimate_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                               bool recompute, int64_t ep = 1, double capacity_factor = 0);
// With parallel.* : the rank that needs the most (pipeline stage, expert shard, ZeRO-1 chunk).
MemoryEstimate estimate_memory(const Config& config);
// A rank of pipeline stage `stage` under config's [parallel] and [train] (the backend's own
// buffers included).
MemoryEstimate estimate_stage_memory(const Config& config, int64_t stage);
// One rank: pipeline stage layers [layer_begin, layer_end) with `slots` micro-batches of saved
// activations (parallel/pipeline.h; scratch shared), 1/ep of the experts, and with zero1_dp > 1
// the ZeRO-1 moments of one chunk; weights, gradients and AdamW state count what the rank holds
// (the first stage holds the embedding, the last final norm + LM head).
MemoryEstimate estimate_stage_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                                     bool recompute, int64_t layer_begin, int64_t layer_end, int64_t slots,
                                     int64_t ep = 1, double capacity_factor = 0, int64_t zero1_dp = 1,
                                     bool padded_exchange = false, const MxMode& mx = {});
// The same for a stage given as its layer chunks and their slots (interleaved pipelining;
// stage.recompute applies).
MemoryEstimate estimate_stage_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                                     const StagePlan& stage, int64_t ep = 1, double capacity_factor = 0,
                                     int64_t zero1_dp = 1, bool padded_exchange = false, const MxMode& mx = {});
// Human-readable lines ("# memory ..."), bytes and GiB.
std::string format_memory(const MemoryEstimate& m);

}  // namespace moe
