// The activation plan: every tensor one pipeline stage keeps between its forward and backward
// (saved activations, per in-flight micro-batch) and the scratch its backward shares, carved out
// of ONE arena by the same code that measures it. The memory estimate (plan/memory.cpp) runs
// this code in measure mode, so the estimate is the arena, byte for byte.
//
// Shapes are for one micro-batch of T = B*S tokens. Shape suffixes of the scratch names:
//   T tokens, D d_model, E experts, K top_k, R = T*K permuted expert rows, X = Rx rows this
//   rank's experts may compute (R without expert parallelism), B,S,H,G,d = batch, sequence,
//   query heads, KV heads, head dim (Hd = H*d, Gd = G*d), C = LM-head chunk rows, V vocabulary,
//   W = the widest SwiGLU activation (max of X*F, T*shared_experts*shared_hidden,
//   T*dense_width), N = the largest upstream gradient that is converted for a GEMM.
// "act" tensors are GEMM operands in the operand dtype (bf16 in bf16 mode); everything else is
// in the compute dtype (f32, or f64 on the reference path). With block recompute all layers
// share one LayerActs (a stage with dense and MoE layers: their FFN sets over the same bytes)
// and only the residual stream is kept per layer.
#pragma once

#include <utility>
#include <vector>

#include "config/config.h"
#include "core/buffer.h"
#include "core/mxfp8.h"
#include "core/tensor.h"

namespace moe {

// Hands out tensors from an arena, or from a region already carved out of one (within), or only
// counts bytes (measure pass) when it has neither.
struct ArenaPlan {
  Arena* arena = nullptr;
  Tensor region;              // within(): tensors laid out from region.data, at most its bytes
  // 64-bit whatever size_t is (the planner runs as 32-bit WebAssembly too).
  uint64_t bytes = 0;         // arena bytes, 64-byte padded per tensor
  uint64_t tensor_bytes = 0;  // the tensors' own bytes
  Tensor operator()(DType dtype, std::initializer_list<int64_t> dims);
  // A plan over `storage` (a tensor of this arena): sets whose lifetimes never meet are laid out
  // over the same bytes, each through its own within(). Measure mode: storage has no data.
  static ArenaPlan within(const Tensor& storage);
};

// MXFP8 in the routed experts and the attention projections (train.precision = "mxfp8", config
// [mxfp8]; model/mx_experts.h, model/attention_block.cpp).
struct MxMode {
  bool experts = false;            // the expert GEMMs' forward and data gradient in MXFP8
  bool attention = false;          // the q/k/v/o projections' forward and data gradient in MXFP8
  bool dispatch = false;           // EP: the quantized input rows are what crosses the wire
  mx::ScaleRule rule = mx::ScaleRule::kRceil;  // the quantizers' scale rule
  DType grad_elem = DType::kE4M3;  // the output gradients' elements in the data gradients
};
MxMode mx_mode(const Config& config);
// Bytes of the MXFP8 weight caches of one MoE layer holding `local_experts` experts
// (model/model_state.h, MxExpertWeights): two copies of 33/32 bytes per expert weight.
inline int64_t mx_expert_cache_bytes(const ModelConfig& c, int64_t local_experts) {
  const int64_t per_weight = local_experts * c.expert_hidden * c.d_model;
  return 3 * 2 * (per_weight + per_weight / 32);
}
// Bytes of the MXFP8 caches of one layer's attention projections (MxAttentionWeights): wq, wk,
// wv, wo, two copies of 33/32 bytes each.
inline int64_t mx_attention_cache_bytes(const ModelConfig& c) {
  const int64_t w = c.d_model * c.hd() * (2 * c.n_heads + 2 * c.n_kv_heads);
  return 2 * (w + w / 32);
}

struct Dims {
  int64_t B = 0, S = 0, T = 0, R = 0;
  // Expert parallelism: ep ranks share the experts, El = E / ep local experts each; Rx = rows this
  // rank's experts may compute in one micro-batch (R without EP; expert_rows_bound with EP).
  int64_t ep = 1, El = 0, Rx = 0;
  // The padded expert transport's slab rows per peer (exchange_slab_rows); 0 with the p2p one.
  int64_t slab_rows = 0;
  DType cdt = DType::kF32;  // compute dtype
  DType adt = DType::kF32;  // GEMM operand dtype
  MxMode mx;                // MXFP8 (then adt is bf16 with f32 compute)
};
// The dims of micro-batches of `batch` sequences of seq_len tokens; ep > 1: expert parallelism
// with that capacity factor (0 = dropless).
Dims model_dims(const ModelConfig& c, int64_t batch, int64_t seq_len, DType compute, bool bf16_operands,
                int64_t ep = 1, double capacity_factor = 0, bool padded_exchange = false, const MxMode& mx = {});

struct AttnActs {
  Tensor rstd_in;          // (T) (pre, peri)
  Tensor h_act;            // (T,D) normed input, GEMM operand (MXFP8 attention: scratch.mx_attn_x_N;
                           // reordered norms in fp32: the input itself, set by the forward)
  Tensor h_q, h_qs;        // (T,D), (T,D/32) MXFP8 attention: h_act quantized (e4m3, e8m0)
  Tensor q_lin, k_lin;     // (T,H*hd), (T,G*hd) projections before QK-norm (only with QK-norm), operand dtype
  Tensor q_pre, k_pre, v_pre;  // (T,H*hd), (T,G*hd), (T,G*hd) projections before the clamp (clip_qkv only)
  Tensor rstd_q, rstd_k;   // (T) or (T*H), (T*G)
  Tensor q, k, v;          // (B,S,H,hd), (B,S,G,hd) after QK-norm and RoPE, in the operand dtype
  Tensor o;                // (B,S,H,hd) attention output, in the operand dtype (wo's operand)
  Tensor o_q, o_qs;        // (T,H*hd), (T,H*hd/32) MXFP8 attention: o quantized
  Tensor lse;              // (B,H,S)
  Tensor out;              // (T,D) o * wo^T (peri, reordered: input of attn_out_norm)
  Tensor rstd_out;         // (T) (peri, reordered)
};

struct FfnActs {
  Tensor rstd_in;          // (T) (pre, peri)
  Tensor h;                // (T,D) normed input in compute dtype (fp32 mode; router input of the
                           // gated shared experts' layers in bf16 mode; reordered: x_mid)
  Tensor h_act;            // (T,D) GEMM operand copy (bf16 mode), else = h
  // dense SwiGLU, or the shared expert of an MoE layer
  Tensor g, u;             // (T,F) saved in the operand dtype
  Tensor a_act;            // (T,F) silu(g)*u, GEMM operand (gated shared experts: times their weights)
  // the gate of the shared experts (model.shared_router; model/shared_experts.h), Es experts
  Tensor shared_logits, shared_scores, shared_w;  // (T,Es) fp32/f64
  Tensor shared_idx;       // (T,Es) i32 every expert, in order
  Tensor shared_pos;       // (T*Es) i32 identity slot positions of the per-expert scaling
  // routed experts
  Tensor logits, scores;   // (T,E) router, fp32/f64
  Tensor expert_idx;       // (T,K) i32
  Tensor weights;          // (T,K)
  Tensor counts;           // (E) i32
  Tensor offsets;          // (E+1) i32
  Tensor sorted_slot;      // (R) i32
  Tensor slot_pos;         // (R) i32
  Tensor xs_act;           // (R,D) permuted inputs, GEMM operand; without EP only (= xr_act)
  Tensor xr_act;           // (Rx,D) rows received for the local experts (EP), else the permuted rows
  Tensor recv_offsets;     // (El+1) i32 with EP: grouped GEMM offsets over xr_act (a view of the
                           // exchange plan, model state); else = offsets
  Tensor eg, eu;           // (Rx,F) saved in the operand dtype
  Tensor ea_act;           // (Rx,F)
  // MXFP8 experts, instead of xs_act / xr_act / ea_act (saved for the weight gradients, which
  // read them dequantized): the received rows and the down projection's input, quantized
  // row-wise (e4m3 codes, e8m0 scales per 32 values).
  Tensor xr_q, xr_qs;      // (Rx,D), (Rx,D/32)
  Tensor ea_q, ea_qs;      // (Rx,F), (Rx,F/32)
  Tensor ys;               // (R,D) expert outputs (returned to their tokens), saved in the operand dtype
  Tensor out;              // (T,D) FFN output (peri, reordered: input of ffn_out_norm)
  Tensor rstd_out;         // (T) (peri, reordered)
};

struct LayerActs {
  AttnActs attn;
  FfnActs ffn;
  Tensor x_mid;            // (T,D) residual stream between attention and FFN
};

// The embedding's output before its norm (model.embedding_norm, first stage only), per slot.
struct EmbedActs {
  Tensor x0;               // (T,D) embed(ids) * embed_scale
  Tensor rstd;             // (T)
};

// The final norm's saved output (last stage only), shared by every slot: the LM-head step
// recomputes it from the slot's stage output.
struct FinalNormActs {
  Tensor rstd;             // (T)
  Tensor out_act;          // (T,D) GEMM operand of the LM head
};

// Scratch shared by every layer of the stage, sized for the largest. Lifetimes (one backward
// runs the layers in reverse; "sublayer" = from its output gradient to its input gradient):
//   buffer           written by                             last read by
//   dresid_TD        LM-head step, or the received gradient  the embedding backward: the running
//                    (then every sublayer's input norm)      d(residual stream), whole backward
//   dy_TD            a sublayer's out-norm backward (peri),  the same sublayer / final norm bwd
//                    LM-head data gradient (per chunk rows)
//   droute_TD        MoE v1 merge: routed share of dy        moe_combine_bwd, same sublayer
//   dshared_TD       MoE v1 merge: shared share of dy        shared-expert backward, same sublayer
//   dnormed_TD       a sublayer's GEMM data gradients        its input norm's backward
//   shared_out_TD    MoE forward, v1 shared-expert output    the next axpy (forward only; dshared's storage)
//   dq/dk/dv/do_*    attention backward                      the q/k/v projection gradients
//   dq_lin/dk_lin_*  QK-norm backward (dq_lin: do's storage)  the q/k projection gradients
//   gate/up_f32_W    bf16 forward: SwiGLU GEMM outputs       swiglu_fwd (forward only)
//   dgate/dup/dact_W SwiGLU backward                         the same MLP's GEMMs
//   ys_f32_XD        MoE forward (bf16 or EP): expert outputs the return / convert (forward only;
//                    dxs_XD's storage)
//   dys_RD           moe_combine_bwd, in the operand dtype   the expert-output GEMM gradients
//                                                            (EP: sent to the experts' ranks)
//   returned_RD      EP: rows returned to this rank: expert  the combine (forward), moe_gather_bwd
//                    outputs (bf16 mode), input gradients    (backward); dact_W's storage
//   xs_RD            MoE forward, EP or MXFP8: permuted rows  their send or quantization (forward
//                                                            only; dys_RD's storage)
//   dxs_XD, dxs_up_XD the routed experts' input gradients    moe_gather_bwd / the return (dxs_up:
//                    (EP: dxs_up after the SwiGLU backward)  dact_W's storage)
//   dyr_XD           EP: output gradients received            the expert GEMM gradients
//   dweights_TK, dscores_TE, dlogits_TE   router backward    the router GEMM gradients
//   dshared_w/scores/logits_TS  gated shared experts' backward  the shared router's GEMMs
//   shared_zero_N, shared_sorted_N, shared_plan_3   the       the same forward
//                    gated shared experts' identity plan
//   ones_T1          any bias (attention, router logits): T  the same rank-1 GEMM
//                    ones, filled before each use
//   dy_operand_N     operand_grad: bf16 copy of a gradient   the GEMMs right after it
//   logits_CV, row_ce_C, row_z_C   LM-head chunk             the same chunk
//   mean_prob_E      load_balance_loss                       the step statistics' axpy
//   lbl_counts_E     expert_counts (instance, global)        the same layer's load_balance_loss
//   ep_slabs         EP, padded transport: the send and the  the same exchange (one move)
//                    receive slabs, (2, ep, slab_rows, D)
// Forward-only roles share storage with backward-only ones (plan_scratch says which): a stage
// never runs a forward inside a sublayer's backward (recompute re-runs a layer's forward before
// its backward starts), and every role above ends within its sublayer except dresid_TD.
// The SwiGLU buffers in bf16 mode: dgate_W and dup_W hold operand-dtype values (they only feed
// GEMMs) in one fp32-sized buffer, gate_f32_W is dact_W's storage and up_f32_W theirs; with the
// gated shared experts or MXFP8 experts (whose forward holds dact_W too) each is its own fp32
// buffer and the forward's gate and up use dgate's and dup's.
struct Scratch {
  Tensor dresid_TD, dy_TD, dnormed_TD;
  Tensor droute_TD, dshared_TD, shared_out_TD;  // v1 merge of the (ungated) shared experts only
  Tensor dq_BSHd, dk_BSGd, dv_BSGd, do_BSHd;
  Tensor dq_lin_THd, dk_lin_TGd;   // QK-norm only
  Tensor gate_f32_W, up_f32_W;     // bf16 mode only
  Tensor dgate_W, dup_W, dact_W;   // dgate, dup: the operand dtype in bf16 mode (see above)
  Tensor ys_f32_XD;                // bf16 mode or EP
  Tensor dys_RD, dxs_XD;           // dys: the operand dtype (rounded by moe_combine_bwd)
  Tensor returned_RD;              // EP: rows returned to this rank (compute dtype; dact_W's storage)
  Tensor dyr_XD, dxs_up_XD;        // EP only (dyr in the operand dtype)
  Tensor dweights_TK, dscores_TE, dlogits_TE;
  Tensor dshared_w_TS, dshared_scores_TS, dshared_logits_TS;  // model.shared_router
  Tensor shared_zero_N, shared_sorted_N, shared_plan_3;        // (T*Es), (T*Es), (3) i32
  Tensor ones_T1;                  // compute dtype (T,1): SublayerContext::add_row_bias
  Tensor dy_operand_N;             // operand dtype
  Tensor logits_CV, row_ce_C, row_z_C;
  Tensor mean_prob_E;
  Tensor lbl_counts_E;             // i32: a sequence's or the group's counts (load-balancing granularity)
  Tensor ep_slabs;                 // compute dtype, 2*ep*slab_rows*D elements; padded transport only
  Tensor xs_RD;                    // operand dtype, EP or MXFP8 experts: the permuted rows before
                                   // they are sent or quantized (dys_RD's storage)
  // MXFP8 experts (model/mx_experts.cpp): the quantized send buffer (EP with dispatch) or the
  // bf16 receive buffer (EP without), the quantized output gradient and SwiGLU gradient of the
  // data gradients, and one bf16 buffer the weight gradients dequantize their saved operand into.
  Tensor mx_xs_q, mx_xs_qs;        // (R,D), (R,D/32)
  Tensor mx_xr_XD;                 // operand dtype
  Tensor mx_dy_q, mx_dy_qs;        // (Rx,D), (Rx,D/32) in the gradient element
  Tensor mx_dh_q, mx_dh_qs;        // (Rx,F), (Rx,F/32) in the gradient element
  Tensor mx_deq_W;                 // operand dtype, Rx * max(D,F)
  // MXFP8 attention (model/attention_block.cpp): the normed input before quantization (forward),
  // then the weight gradients' dequantized operand (backward); the quantized upstream gradient of
  // each projection's data gradient, in the gradient element. W = max(D, H*hd).
  Tensor mx_attn_x_N;              // operand dtype, T * W
  Tensor mx_attn_g_q, mx_attn_g_qs;  // T * W, T * W/32
};

// What one plan covers: a pipeline stage's layers and its in-flight micro-batches.
// slots: micro-batches whose saved activations the stage holds at once (1F1B); with interleaved
// pipelining, per chunk of the stage's layers.
struct StagePlan {
  StagePlan(int64_t layer_begin, int64_t layer_end, int64_t slots, bool recompute_)
      : chunks{{layer_begin, layer_end}}, chunk_slots{slots}, recompute(recompute_) {}
  StagePlan(std::vector<LayerRange> chunks_, std::vector<int64_t> chunk_slots_, bool recompute_)
      : chunks(std::move(chunks_)), chunk_slots(std::move(chunk_slots_)), recompute(recompute_) {}
  std::vector<LayerRange> chunks;
  std::vector<int64_t> chunk_slots;
  bool recompute = false;
};

class ActivationPlan {
 public:
  ActivationPlan() = default;
  // memory == nullptr: measure only (every tensor has no data; bytes() is the arena's size).
  ActivationPlan(const ModelConfig& c, const Dims& d, const StagePlan& stage, Allocator* memory);
  ActivationPlan(ActivationPlan&&) = default;
  ActivationPlan& operator=(ActivationPlan&&) = default;

  uint64_t bytes() const { return bytes_; }                    // the arena, padding included
  uint64_t saved_tensor_bytes() const { return saved_bytes_; }  // kept for backward: residual + layers
  uint64_t layer_bytes() const { return layer_bytes_; }         // the arena bytes of the layers' activations
  int64_t chunks() const { return static_cast<int64_t>(chunks_.size()); }
  int64_t slots(int64_t chunk) const { return static_cast<int64_t>(resid_[static_cast<size_t>(chunk)].size()); }
  int64_t head_chunk() const { return head_chunk_; }
  // (T,D) the residual stream into layer l of a slot (l = a chunk's end: after its last layer).
  // The chunk is l's: chunks are apart, so each l names one.
  const Tensor& resid(int64_t slot, int64_t l) const {
    const size_t c = chunk_at(l);
    return resid_[c][static_cast<size_t>(slot)][static_cast<size_t>(l - chunks_[c].begin)];
  }
  const Tensor& stage_input(int64_t chunk, int64_t slot) const {
    return resid_[static_cast<size_t>(chunk)][static_cast<size_t>(slot)].front();
  }
  const Tensor& stage_output(int64_t chunk, int64_t slot) const {
    return resid_[static_cast<size_t>(chunk)][static_cast<size_t>(slot)].back();
  }
  // Saved activations of layer l in a slot (with recompute: the one shared set).
  LayerActs& layer(int64_t slot, int64_t l) {
    if (recompute_) return acts_[0][0][0];
    const size_t c = chunk_at(l);
    return acts_[c][static_cast<size_t>(slot)][static_cast<size_t>(l - chunks_[c].begin)];
  }
  // A dense layer's FFN activations (with recompute in a stage of both kinds: their own tensors,
  // over the bytes of the MoE layers' FFN set: one layer's set exists at a time).
  FfnActs& dense_ffn(int64_t slot, int64_t l) { return recompute_dense_ ? recompute_dense_ffn_ : layer(slot, l).ffn; }
  Scratch& scratch() { return scratch_; }
  const FinalNormActs& final_norm() const { return final_norm_; }
  // The embedding norm's saved input of a slot (first stage with model.embedding_norm only).
  const EmbedActs& embed(int64_t slot) const { return embed_[static_cast<size_t>(slot)]; }

 private:
  size_t chunk_at(int64_t l) const {
    size_t c = 0;
    while (c + 1 < chunks_.size() && l > chunks_[c].end) ++c;
    return c;
  }
  std::vector<LayerRange> chunks_;
  bool recompute_ = false;
  int64_t head_chunk_ = 0;
  Arena arena_;
  uint64_t bytes_ = 0, saved_bytes_ = 0, layer_bytes_ = 0;
  std::vector<std::vector<std::vector<Tensor>>> resid_;    // [chunk][slot][chunk layer, and after the last]
  std::vector<std::vector<std::vector<LayerActs>>> acts_;  // [chunk][slot][chunk layer]; recompute: one
  bool recompute_dense_ = false;  // recompute in a stage with dense and MoE layers
  FfnActs recompute_dense_ffn_;   // then the dense layers' FFN set
  std::vector<EmbedActs> embed_;  // [slot of chunk 0], model.embedding_norm on the first stage
  Scratch scratch_;
  FinalNormActs final_norm_;
};

// Rows of the LM head + cross-entropy processed at once (of a micro-batch's `tokens`): as many as
// fit 64 Mi logits (256 MiB in fp32; 1,334 rows at a 50,304 vocabulary), so the full fp32 logits
// of a micro-batch are held at most once. Each chunk re-reads the LM-head weight and reads and
// writes its whole fp32 gradient: at the earlier 8 MiB bound (41 rows at 50,304) that traffic
// took the fine-grained bench config's LM head from 0.49 to 0.78 s per step
// (docs/PERFORMANCE_HISTORY.md, "LM-head chunk sized for the GEMMs").
int64_t lm_head_chunk_rows(int64_t vocab_size, int64_t tokens);

}  // namespace moe
