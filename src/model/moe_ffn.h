// MoE FFN sublayer, forward then backward (moe_ffn.cpp). Dropless token-choice routing:
//   h = RMSNorm(x); z = h router^T (compute dtype, master weights); s = softmax|sigmoid(z)
//   choose K experts per token (learned: top-k of s + bias; or uniform/random); w = s[chosen]
//   plan: stable counting sort of the T*K (token, slot) pairs by expert -> offsets, positions
//   xs = h rows in expert-major order; ys = grouped SwiGLU experts over xs (row tiles per expert)
//   y = sum_j w_tj * ys[pos(t,j)]  (+ shared expert: sum, or v1 u/(K+1) + r*K/(K+1))
// Expert parallelism (model/expert_dispatch.h): after the gather, rows move to the ranks holding
// their experts and the outputs come back before the combine; backward moves the gradients the
// same two ways. Routing, the plan, the combine and the router losses stay on the tokens' rank.
// Backward mirrors it and injects the load-balancing and router z-loss gradients into the
// router, weighted by this micro-batch's share of the step's tokens. With MXFP8 experts the grouped
// GEMMs are model/mx_experts.h's.
#pragma once

#include <functional>

#include "model/model_state.h"
#include "model/sublayer.h"
#include "model/expert_dispatch.h"

namespace moe {

// The expert choice's inputs beyond the activations.
struct MoeRouting {
  int64_t layer = 0;       // model layer index (random routing's stream)
  Tensor router_bias;      // (E) loss-free balancing bias, or empty
  uint64_t seed = 0;       // random routing draws
  int64_t token_base = 0;  // global index of the micro-batch's first token
  Tensor quant_stats;      // MXFP8: (8) f64 quantization statistics of the step (model/mx_experts.h),
                           // or empty (no MXFP8, or a recomputed forward: counted once)
};

// Expert parallelism for one (activation slot, MoE layer); exchange == nullptr: none.
struct MoeExchangeStep {
  ExpertDispatch* exchange = nullptr;
  int64_t slot = 0, moe_layer = 0;  // the route (model/expert_dispatch.h)
  bool new_plan = true;             // false when recompute re-runs the forward: the plan is kept
};

// Where the backward adds the auxiliary losses and routing statistics, and their weights.
// Global load balancing: sums a micro-batch's counts (E) i32 of one layer over the data-parallel
// group, in place (installed by the trainer; the model itself crosses no ranks).
struct CountSum {
  std::function<void(const Tensor& counts)> sum;
  int64_t ranks = 1;
};

enum class LblGranularity { kLocalBatch, kInstance, kGlobal };

struct MoeLossOutputs {
  LblGranularity granularity = LblGranularity::kLocalBatch;
  const CountSum* count_sum = nullptr;  // kGlobal
  int64_t sequences = 1;                // kInstance: the micro-batch's sequences (equal lengths)
  double aux_weight = 1;   // the auxiliary losses' weight: tokens in this micro-batch / loss.aux_divisor
  double stat_weight = 1;  // the mean probabilities' weight: tokens in this micro-batch / in the step
  double lbl_coef = 0, router_z_coef = 0;
  Tensor lbl, router_z;   // (1) f64 step statistics
  Tensor mean_prob;       // (E) token-weighted mean router probabilities over the step
  Tensor counts;          // (E) i32 tokens per expert over the step
  Tensor quant_stats;     // MXFP8: (8) f64, as MoeRouting::quant_stats; else empty
};

void moe_ffn_forward(const SublayerContext& ctx, const LayerParams& p, const MoeRouting& routing,
                     const MoeExchangeStep& ex, const Tensor& x_in, FfnActs& a, const Tensor& x_out);
// scratch.dresid_TD: d(x_out) in, d(x_in) out.
void moe_ffn_backward(const SublayerContext& ctx, const LayerParams& p, const MoeExchangeStep& ex,
                      const MoeLossOutputs& out, const Tensor& x_in, FfnActs& a);

}  // namespace moe
