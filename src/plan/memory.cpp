#include "plan/memory.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "kernels/cpu_memory.h"
#include "kernels/cuda_memory.h"
#include "model/activations.h"
#include "model/params.h"
#include "model/exchange_bounds.h"
#include "kernels/step_control.h"
#include "parallel/pipeline_schedule.h"

namespace moe {

// Weights, gradients and AdamW state count what the rank's ParamLayout holds; the activations
// are the ActivationPlan the Transformer would carve, measured by the same planning code
// (model/activations.cpp), so they equal Transformer::activation_arena_bytes() exactly.
MemoryEstimate estimate_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                               bool recompute, int64_t ep, double capacity_factor) {
  return estimate_stage_memory(c, micro_batch, seq_len, bf16, recompute, 0, c.n_layers, 1, ep, capacity_factor);
}

MemoryEstimate estimate_stage_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                                     bool recompute, int64_t layer_begin, int64_t layer_end, int64_t slots,
                                     int64_t ep, double capacity_factor, int64_t zero1_dp, bool padded_exchange,
                                     const MxMode& mx) {
  return estimate_stage_memory(c, micro_batch, seq_len, bf16, StagePlan(layer_begin, layer_end, slots, recompute),
                               ep, capacity_factor, zero1_dp, padded_exchange, mx);
}

MemoryEstimate estimate_stage_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                                     const StagePlan& stage, int64_t ep, double capacity_factor, int64_t zero1_dp,
                                     bool padded_exchange, const MxMode& mx) {
  MemoryEstimate m;
  ModelShard shard;
  shard.chunks = stage.chunks;
  shard.num_local_experts = c.num_experts / ep;
  const bool whole = stage.chunks.size() == 1 && stage.chunks[0].begin == 0 && stage.chunks[0].end == c.n_layers && ep == 1;
  int64_t held_layers = 0, most_slots = 0;
  for (const LayerRange& r : stage.chunks) held_layers += r.end - r.begin;
  for (const int64_t n : stage.chunk_slots) most_slots = std::max(most_slots, n);
  // A shard's parameters: its layers, its 1/ep of the experts (padding included).
  const ParamLayout held(c, shard, zero1_dp, std::max<int64_t>(zero1_dp / ep, 1));
  const double N = static_cast<double>(whole && zero1_dp == 1 ? c.num_params() : held.total());
  m.params = 4 * N;
  m.operand_copies = bf16 ? 2 * N : 0;
  m.grads = 4 * N;
  // ZeRO-1: the moments of one dense chunk (1/dp) and one expert chunk (1/edp).
  m.optimizer = zero1_dp > 1 ? 8.0 * (static_cast<double>(held.dense_end()) / static_cast<double>(zero1_dp) +
                                      static_cast<double>(held.total() - held.dense_end()) /
                                          static_cast<double>(std::max<int64_t>(zero1_dp / ep, 1)))
                             : 8 * N;
  m.router_bias = 4.0 * static_cast<double>(c.num_experts * c.num_moe_layers());

  const int64_t Ti = micro_batch * seq_len;
  const double T = static_cast<double>(Ti);
  const double H = static_cast<double>(c.n_heads), G = static_cast<double>(c.n_kv_heads), hd = static_cast<double>(c.hd());
  const double Ha = H * hd, Ga = G * hd;
  const Dims dims = model_dims(c, micro_batch, seq_len, DType::kF32, bf16, ep, capacity_factor, padded_exchange, mx);
  const ActivationPlan plan(c, dims, stage, nullptr);
  m.activations = static_cast<double>(plan.bytes());
  // Per layer per token: one MoE layer (a dense one if the model has none), as its own plan.
  const int64_t widest = c.num_moe_layers() > 0 ? c.moe_layer(0) : 0;
  const ActivationPlan one(c, dims, StagePlan{widest, widest + 1, 1, false}, nullptr);
  m.act_per_layer_token = static_cast<double>(one.layer_bytes()) / T;
  m.act_shared = static_cast<double>(plan.bytes() - plan.layer_bytes());
  // Outside the arena (parallel/pipeline.cpp, model/transformer.cpp, model/step_stats.cpp).
  const double D = static_cast<double>(c.d_model), nm = static_cast<double>(c.num_moe_layers());
  const double E = static_cast<double>(c.num_experts), cdt = 4;
  for (size_t k = 0; k < stage.chunks.size(); ++k)  // a chunk after the model's start: its gradient copies
    if (stage.chunks[k].begin > 0) m.comm_buffers += static_cast<double>(stage.chunk_slots[k]) * T * D * cdt;
  if (ep > 1)
    m.comm_buffers += 4 * (static_cast<double>(most_slots) * nm * static_cast<double>(exchange_plan_words(ep, c.num_experts)) +
                           nm * static_cast<double>(4 + ep));
  const double P = static_cast<double>(ParamLayout(c).num_global_params());
  m.step_stats = 8 * (2 + 2 * nm + static_cast<double>(kCtlSize) + P) + nm * E * (cdt + 4) + (ep > 1 ? 4 * nm * static_cast<double>(4 + ep) : 0);
  int64_t local_moe = 0;
  for (int64_t l = 0; l < c.n_layers; ++l) local_moe += shard.holds_layer(l) && c.is_moe_layer(l) ? 1 : 0;
  if (mx.experts && nm > 0) {
    m.mx_caches = static_cast<double>(local_moe * mx_expert_cache_bytes(c, c.num_experts / ep));
    m.step_stats += 2 * 8 * 8 * nm;  // the quantization statistics: the record's and the model's
  }
  if (mx.attention) m.mx_caches += static_cast<double>(held_layers * mx_attention_cache_bytes(c));
  // bf16 mode: the attention kernel packs, once per op into grow-only slots, the forms it reads
  // that the bf16 q, k and v are not already (kernels/cpu/attention.cpp, pack_for_bf16): dO's bf16
  // rows (plus 64 bytes of alignment) and pair rows (ceil(S/2) positions), q's pair rows and k's (v's
  // in the forward, the same size); the rows of q, k and v are the tensors themselves. On a CPU with
  // AMX tiles the pair rows are columns of round_up(S, 32) positions instead (attention_amx.h):
  // the larger of the two, on every CPU.
  if (bf16 && c.hd() % 2 == 0 && held_layers > 0) {
    const bool amx_shape = seq_len % 16 == 0 && c.hd() % 32 == 0;
    const int64_t positions = std::max<int64_t>((seq_len + 1) / 2 * 2, amx_shape ? (seq_len + 31) / 32 * 32 : 0);
    const double Bm = static_cast<double>(micro_batch), Sp = static_cast<double>(positions) / 2;
    auto pairs = [&](double row) { return 4 * Bm * Sp * row; };
    m.kernel_scratch = 2 * T * Ha + 64 + 2 * pairs(Ha) + pairs(Ga);
  }
  // bf16 mode, the stage with the LM head: its data gradient's pairing of the weight
  // (kernels/cpu_memory.h; made where the CPU has AVX512-BF16, counted on every CPU).
  if (bf16 && shard.last_stage(c))
    m.kernel_scratch += static_cast<double>(cpu_long_reduction_pairs_bytes(c.vocab_size, c.d_model));
  // The cpu attention backward's store of score-gradient tiles and its row sums (kernels/cpu_memory.h).
  if (held_layers > 0)
    m.kernel_scratch += static_cast<double>(cpu_attention_backward_bytes(micro_batch, c.n_heads, c.n_kv_heads, seq_len));
  // The cpu MXFP8 GEMMs' grow-only bf16 operands (kernels/cpu/mxfp8.cpp), one pair per process:
  // the widest row operand, experts (Rx, max(D,F)) or attention (T, max(D,H*hd)), and the widest
  // weight, one layer's local experts (El, F, D) or a projection (max(H,G)*hd, D).
  const bool mx_experts = mx.experts && local_moe > 0;
  if ((mx_experts || mx.attention) && held_layers > 0) {
    const double F = static_cast<double>(c.expert_hidden);
    double rows = 0, weight = 0;
    if (mx_experts) {
      rows = static_cast<double>(dims.Rx) * std::max(D, F);
      weight = static_cast<double>(dims.El) * F * D;
    }
    if (mx.attention) {
      rows = std::max(rows, T * std::max(D, Ha));
      weight = std::max(weight, std::max(Ha, Ga) * D);
    }
    m.kernel_scratch += 2 * rows + 2 * weight;
  }
  return m;
}

MemoryEstimate estimate_stage_memory(const Config& config, int64_t stage) {
  const ParallelConfig& pc = config.parallel;
  const int64_t pp = pc.pp, zero1_dp = pc.zero1 ? pc.dp : 1;
  // 1F1B activation slots: min(pp - stage, micro-batches); interleaved: per chunk, from its schedule.
  const int64_t micro = config.train.batch_size / (config.train.micro_batch_size * pc.dp);
  const StagePlan plan(configured_stage_chunks(pc, config.model.n_layers, stage),
                       stage_chunk_slots(pp, stage, micro, pc.pp_interleave), config.train.recompute);
  MemoryEstimate m = estimate_stage_memory(config.model, config.train.micro_batch_size, config.train.seq_len,
                                           config.train.precision != "fp32", plan, pc.ep, pc.ep_capacity_factor,
                                           zero1_dp, pc.ep_transport == "padded", mx_mode(config));
  if (config.train.backend == "cuda") {
    // The cpu attention's packing is not made on the GPU; the cuda backend's buffers are.
    const ModelConfig& c = config.model;
    m.kernel_scratch = 0;
    m.backend_buffers = static_cast<double>(cuda_scratch_bytes() + kCublasLtWorkspaceBytes);
    // cuDNN attention (bf16 products, no document masking, head dim a multiple of 8): its one
    // buffer grows to the backward's size.
    if (config.train.precision != "fp32" && !config.data.intra_doc_mask && c.hd() % 8 == 0) {
      const int64_t B = config.train.micro_batch_size, S = config.train.seq_len;
      m.backend_buffers += static_cast<double>(cudnn_sdpa_buffer_bytes(
          true, /*stored_bf16=*/true, B * S * c.n_heads * c.hd(), B * S * c.n_kv_heads * c.hd(),
          cudnn_sdpa_backward_workspace_bound(B, c.n_heads, S, c.hd(), config.train.deterministic_attention)));
    }
  }
  return m;
}

MemoryEstimate estimate_memory(const Config& config) {
  // Pipeline: the stage that needs the most.
  MemoryEstimate most;
  for (int64_t s = 0; s < config.parallel.pp; ++s) {
    const MemoryEstimate m = estimate_stage_memory(config, s);
    if (m.total() > most.total()) most = m;
  }
  return most;
}

std::string format_memory(const MemoryEstimate& m) {
  std::ostringstream o;
  auto line = [&](const char* name, double bytes) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "# memory %-34s %16.0f bytes %10.3f GiB\n", name, bytes, bytes / (1024.0 * 1024.0 * 1024.0));
    o << buf;
  };
  line("parameters (fp32 master)", m.params);
  if (m.operand_copies > 0) line("bf16 operand copies", m.operand_copies);
  if (m.mx_caches > 0) line("MXFP8 weight caches", m.mx_caches);
  line("gradients (fp32)", m.grads);
  line("AdamW state (2 x fp32)", m.optimizer);
  if (m.router_bias > 0) line("router biases", m.router_bias);
  line("activations (arena, one micro-batch)", m.activations);
  line("  of which per layer per token (MoE layer)", m.act_per_layer_token);
  line("  of which shared scratch + residual", m.act_shared);
  if (m.kernel_scratch > 0) line("kernel scratch (bf16 operands)", m.kernel_scratch);
  if (m.backend_buffers > 0) line("cuda: scratch, cuBLASLt, cuDNN attention", m.backend_buffers);
  if (m.comm_buffers > 0) line("pipeline copies, exchange plans", m.comm_buffers);
  line("step statistics", m.step_stats);
  line("total", m.total());
  return o.str();
}

}  // namespace moe
