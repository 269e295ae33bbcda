// Saved activations of one block, and the shared backward scratch. Shapes for one micro-batch
// of T = B*S tokens; R = T*K permuted expert rows; Rx rows computed by this rank's experts
// (= R without expert parallelism). "act" tensors are GEMM operands and use the
// operand dtype (bf16 in bf16 mode); everything else uses the compute dtype (f32, or f64 in the
// reference path). With block recompute, all blocks share one LayerActs and only the residual
// stream is kept per block.
#pragma once

#include <vector>

#include "config/config.h"
#include "core/tensor.h"

namespace moe {

// Hands out tensors from an arena, or only counts bytes (measure pass) when arena is null.
class Arena;
struct ArenaPlan {
  Arena* arena = nullptr;
  size_t bytes = 0;
  Tensor operator()(DType dtype, std::initializer_list<int64_t> dims);
};

struct Dims {
  int64_t B = 0, S = 0, T = 0, R = 0;
  // Expert parallelism: ep ranks share the experts, El = E / ep local experts each; Rx = rows this
  // rank's experts may compute in one micro-batch (R without EP; expert_rows_bound with EP).
  int64_t ep = 1, El = 0, Rx = 0;
  DType cdt = DType::kF32;  // compute dtype
  DType adt = DType::kF32;  // GEMM operand dtype
};

struct AttnActs {
  Tensor rstd_in;          // (T)
  Tensor h_act;            // (T,D) normed input, GEMM operand
  Tensor q_lin, k_lin;     // (T,H*hd), (T,G*hd) projections before QK-norm (only with QK-norm)
  Tensor rstd_q, rstd_k;   // (T) or (T*H), (T*G)
  Tensor q, k, v;          // (B,S,H,hd), (B,S,G,hd) after QK-norm and RoPE
  Tensor o;                // (B,S,H,hd) attention output
  Tensor o_act;            // (T,H*hd) GEMM operand copy of o (bf16 mode only)
  Tensor lse;              // (B,H,S)
  Tensor out;              // (T,D) o * wo^T (peri only: input of attn_out_norm)
  Tensor rstd_out;         // (T) (peri only)
};

struct FfnActs {
  Tensor rstd_in;          // (T)
  Tensor h;                // (T,D) normed input in compute dtype (router input)
  Tensor h_act;            // (T,D) GEMM operand copy (bf16 mode), else = h
  // dense SwiGLU, or the shared expert of an MoE layer
  Tensor g, u;             // (T,F) saved in the operand dtype
  Tensor a_act;            // (T,F) silu(g)*u, GEMM operand
  // routed experts
  Tensor logits, scores;   // (T,E) router, fp32/f64
  Tensor expert_idx;       // (T,K) i32
  Tensor weights;          // (T,K)
  Tensor counts;           // (E) i32
  Tensor offsets;          // (E+1) i32
  Tensor sorted_slot;      // (R) i32
  Tensor slot_pos;         // (R) i32
  Tensor xs_act;           // (R,D) permuted inputs, GEMM operand (with EP: the send buffer)
  Tensor xr_act;           // (Rx,D) with EP: rows received for the local experts; else = xs_act
  Tensor recv_offsets;     // (El+1) i32 with EP: grouped GEMM offsets over xr_act (a view of the
                           // exchange plan, model state); else = offsets
  Tensor eg, eu;           // (Rx,F) saved in the operand dtype
  Tensor ea_act;           // (Rx,F)
  Tensor ys;               // (R,D) expert outputs (returned to their tokens), saved in the operand dtype
  Tensor out;              // (T,D) FFN output (peri only: input of ffn_out_norm)
  Tensor rstd_out;         // (T) (peri only)
};

struct LayerActs {
  AttnActs attn;
  FfnActs ffn;
  Tensor x_mid;            // (T,D) residual stream between attention and FFN
};

// Backward scratch shared by all layers (sized for the largest layer).
struct Scratch {
  Tensor dx;               // (T,D) gradient of the residual stream
  Tensor dtmp, dtmp2, dtmp3;  // (T,D)
  Tensor dh;               // (T,D) gradient of a normed FFN input
  Tensor fg, fu;           // (max(R,T), Fmax) bf16 mode: SwiGLU inputs in fp32 before they are saved
  Tensor fys;              // (Rx,D) bf16 mode or EP: expert outputs in the compute dtype
  Tensor fwd_dtmp;         // (T,D) forward temp (shared-expert output)
  Tensor dq, dk, dv, dO;   // (B,S,H,hd) / (B,S,G,hd)
  Tensor dq_lin, dk_lin;   // (T,H*hd), (T,G*hd)
  Tensor dg, du, da;       // (max(R,T), Fmax)
  Tensor dys;              // (R,D) (with EP also the forward's returned rows in bf16 mode)
  Tensor dxs;              // (Rx,D)
  Tensor dyr;              // (Rx,D) EP only: received expert-output gradients, operand dtype
  Tensor dxs2;             // (Rx,D) EP only: the up projection's input gradient
  Tensor dweights;         // (T,K)
  Tensor dscores, dlogits; // (T,E)
  Tensor dy_act;           // (max rows, max cols) operand-dtype copy of an upstream gradient
  Tensor logits;           // (Tc,V) one chunk of LM-head logits / their gradient
  Tensor row_ce, row_z;    // (Tc)
  Tensor mean_prob;        // (E) one micro-batch's mean router probabilities
};

void plan_layer(ArenaPlan& alloc, const ModelConfig& c, const Dims& d, int64_t layer, LayerActs& a);
void plan_scratch(ArenaPlan& alloc, const ModelConfig& c, const Dims& d, int64_t head_chunk, Scratch& s);

// Rows of the LM head + cross-entropy processed at once (of a micro-batch's `tokens`): as many as
// fit 64 Mi logits (256 MiB in fp32; 1,334 rows at a 50,304 vocabulary), so the full fp32 logits
// of a micro-batch are held at most once. Each chunk re-reads the LM-head weight and reads and
// writes its whole fp32 gradient: at the earlier 8 MiB bound (41 rows at 50,304) that traffic
// took the fine-grained bench config's LM head from 0.49 to 0.78 s per step
// (docs/PERFORMANCE.md, "LM head chunk").
int64_t lm_head_chunk_rows(int64_t vocab_size, int64_t tokens);

}  // namespace moe
