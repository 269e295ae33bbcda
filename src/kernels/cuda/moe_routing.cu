// CUDA MoE routing: the ops of kernels/ref/moe_routing.cpp (contracts: kernels/op_list.inc,
// kernels/checks/routing_checks.h), launching the kernels of moe_routing.cuh.
#include "kernels/checks/routing_checks.h"
#include "kernels/checks/step_control_checks.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/moe_routing.cuh"
// The expert-parallel and step-control families (kernels/ref/expert_parallel.cpp, step_control.cpp)
// compile in this translation unit: every nvcc unit costs ~6 s of start-up for its three targets.
#include "kernels/cuda/expert_parallel.cuh"
#include "kernels/cuda/step_control.cuh"

namespace moe::cuda {

void router_scores_fwd(Context& ctx, const Tensor& logits, ScoreKind kind, double eps, const Tensor& scores) {
  check_device({&logits, &scores}, "router_scores_fwd");
  const RoutingDims d = check_router_scores(logits, kind, eps, scores, "router_scores_fwd");
  require_f32(logits, "router_scores_fwd");
  require_f32(scores, "router_scores_fwd");
  const int64_t N = d.T, E = d.E;
  if (N == 0) return;
  router_scores_fwd_kernel<<<warp_blocks(N), kThreads, 0, ctx.stream>>>(ptr<const float>(logits), static_cast<int>(kind),
                                                                        static_cast<float>(eps), ptr<float>(scores), N, E);
  check_launch("router_scores_fwd");
}

void router_scores_bwd(Context& ctx, const Tensor& dscores, const Tensor& scores, ScoreKind kind, double eps,
                       const Tensor& dlogits) {
  check_device({&dscores, &scores, &dlogits}, "router_scores_bwd");
  const RoutingDims d = check_router_scores_bwd(dscores, scores, kind, eps, dlogits);
  for (const Tensor* t : {&dscores, &scores, &dlogits}) require_f32(*t, "router_scores_bwd");
  const int64_t N = d.T, E = d.E;
  if (N == 0) return;
  router_scores_bwd_kernel<<<warp_blocks(N), kThreads, 0, ctx.stream>>>(ptr<const float>(dscores), ptr<const float>(scores),
                                                                        static_cast<int>(kind), static_cast<float>(eps), ptr<float>(dlogits), N, E);
  check_launch("router_scores_bwd");
}

void router_topk(Context& ctx, const Tensor& scores, const Tensor& bias, int64_t n_group, int64_t topk_group,
                 const Tensor& expert_idx) {
  check_device({&scores, &bias, &expert_idx}, "router_topk");
  const RoutingDims d = check_router_topk(scores, bias, n_group, topk_group, expert_idx);
  const int64_t N = d.T, E = d.E, K = d.K;
  MOE_CHECK(E <= kMaxExperts, "router_topk: ", E, " experts exceed the CUDA kernel's ", kMaxExperts);
  if (!bias.empty()) require_f32(bias, "router_topk bias");
  require_f32(scores, "router_topk");
  if (N == 0) return;
  router_topk_kernel<<<blocks_for(N, 128), 128, 0, ctx.stream>>>(ptr<const float>(scores), ptr<const float>(bias), n_group,
                                                                 topk_group, ptr<int32_t>(expert_idx), N, E, K);
  check_launch("router_topk");
}

void router_assign(Context& ctx, RouterAssignment kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
                   const Tensor& expert_idx) {
  check_device(expert_idx, "router_assign");
  const RoutingDims d = check_router_assign(kind, num_experts, expert_idx);
  const int64_t N = d.T, E = d.E, K = d.K;
  MOE_CHECK(E <= kMaxExperts, "router_assign: ", E, " experts exceed the CUDA kernel's ", kMaxExperts);
  if (N == 0) return;
  router_assign_kernel<<<blocks_for(N, 128), 128, 0, ctx.stream>>>(static_cast<int>(kind), seed, stream, token_base, E,
                                                                   ptr<int32_t>(expert_idx), N, K);
  check_launch("router_assign");
}

void router_gather(Context& ctx, const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule,
                   const Tensor& weights) {
  check_device({&scores, &expert_idx, &weights}, "router_gather");
  const RoutingDims d = check_router_gather(scores, expert_idx, rule, weights);
  const int64_t N = d.T, E = d.E, K = d.K;
  require_f32(scores, "router_gather");
  require_f32(weights, "router_gather");
  if (N == 0) return;
  router_gather_kernel<<<blocks_for(N, kThreads), kThreads, 0, ctx.stream>>>(
      ptr<const float>(scores), ptr<const int32_t>(expert_idx), rule.norm_p, rule.factor, ptr<float>(weights), N, E, K);
  check_launch("router_gather");
}

void router_gather_bwd(Context& ctx, const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                       const ExpertWeightRule& rule, const Tensor& dscores) {
  check_device({&dweights, &scores, &expert_idx, &dscores}, "router_gather_bwd");
  const RoutingDims d = check_router_gather_bwd(dweights, scores, expert_idx, rule, dscores);
  const int64_t N = d.T, E = d.E, K = d.K;
  for (const Tensor* t : {&dweights, &scores, &dscores}) require_f32(*t, "router_gather_bwd");
  if (N == 0) return;
  router_gather_bwd_kernel<<<blocks_for(N, kThreads), kThreads, 0, ctx.stream>>>(
      ptr<const float>(dweights), ptr<const float>(scores), ptr<const int32_t>(expert_idx), rule.norm_p, rule.factor,
      ptr<float>(dscores), N, E, K);
  check_launch("router_gather_bwd");
}

namespace {
void bias_update(Context& ctx, const Tensor& step_counts, double gamma, const Tensor& bias, const double* control,
                 const char* op) {
  const int64_t E = check_router_bias_update(step_counts, bias);
  require_f32(bias, op);
  if (E == 0) return;
  router_bias_update_kernel<<<1, kThreads, 0, ctx.stream>>>(ptr<const int32_t>(step_counts), gamma, ptr<float>(bias), E, control);
  check_launch(op);
}
}  // namespace

void router_bias_update(Context& ctx, const Tensor& step_counts, double gamma, const Tensor& bias) {
  check_device({&step_counts, &bias}, "router_bias_update");
  bias_update(ctx, step_counts, gamma, bias, nullptr, "router_bias_update");
}

void router_bias_update_by_control(Context& ctx, const Tensor& step_counts, double gamma, const Tensor& bias,
                                   const Tensor& control) {
  check_device({&step_counts, &bias, &control}, "router_bias_update_by_control");
  check_control(control, "router_bias_update_by_control control");
  bias_update(ctx, step_counts, gamma, bias, ptr<const double>(control), "router_bias_update_by_control");
}

void expert_counts(Context& ctx, const Tensor& expert_idx, const Tensor& counts) {
  check_device({&expert_idx, &counts}, "expert_counts");
  check_expert_counts(expert_idx, counts);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  MOE_CHECK(E <= kMaxExperts, "expert_counts: ", E, " experts (the CUDA kernel takes 1..", kMaxExperts, ")");
  expert_counts_kernel<<<1, kThreads, sizeof(int) * static_cast<size_t>(E), ctx.stream>>>(ptr<const int32_t>(expert_idx), R, E,
                                                                                          ptr<int32_t>(counts), ctx.error);
  check_launch("expert_counts");
}

void add_counts(Context& ctx, const Tensor& counts, const Tensor& total) {
  check_device({&counts, &total}, "add_counts");
  check_add_counts(counts, total);
  const int64_t n = counts.numel();
  if (n == 0) return;
  add_counts_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<const int32_t>(counts), ptr<int32_t>(total), n);
  check_launch("add_counts");
}

void moe_plan(Context& ctx, const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets, const Tensor& sorted_slot,
              const Tensor& slot_pos) {
  check_device({&expert_idx, &counts, &offsets, &sorted_slot, &slot_pos}, "moe_plan");
  check_moe_plan(expert_idx, counts, offsets, sorted_slot, slot_pos);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  MOE_CHECK(E >= 1 && E <= kMaxExperts, "moe_plan: ", E, " experts (the CUDA kernel takes 1..", kMaxExperts, ")");
  const int64_t nb = (R + kThreads - 1) / kThreads > 0 ? (R + kThreads - 1) / kThreads : 1;
  int32_t* block = ctx.scratch_as<int32_t>(static_cast<size_t>(nb * E), "moe_plan");
  const size_t shared = sizeof(int) * kWarps * static_cast<size_t>(E);
  moe_plan_count_kernel<<<static_cast<unsigned>(nb), kThreads, shared, ctx.stream>>>(ptr<const int32_t>(expert_idx), R, E,
                                                                                     block, ctx.error);
  moe_plan_scan_kernel<<<1, 1024, 0, ctx.stream>>>(block, nb, E, ptr<int32_t>(counts), ptr<int32_t>(offsets));
  moe_plan_scatter_kernel<<<static_cast<unsigned>(nb), kThreads, shared, ctx.stream>>>(
      ptr<const int32_t>(expert_idx), R, E, block, ptr<int32_t>(sorted_slot), ptr<int32_t>(slot_pos), ctx.error);
  check_launch("moe_plan");
}

void moe_gather(Context& ctx, const Tensor& x, const Tensor& sorted_slot, const Tensor& xs) {
  check_device({&x, &sorted_slot, &xs}, "moe_gather");
  const PermuteDims d = check_moe_gather(x, sorted_slot, xs);
  const int64_t D = d.D, K = d.K, R = d.T * K;
  if (R == 0) return;
  dispatch_storage(x.dtype, "moe_gather", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    moe_gather_kernel<<<row_blocks(R), 128, 0, ctx.stream>>>(ptr<const S>(x), ptr<const int32_t>(sorted_slot), ptr<S>(xs), R, D, K);
  });
  check_launch("moe_gather");
}

void moe_gather_bwd(Context& ctx, const Tensor& dxs, const Tensor& slot_pos, const Tensor& dx) {
  check_device({&dxs, &slot_pos, &dx}, "moe_gather_bwd");
  const PermuteDims d = check_moe_gather_bwd(dxs, slot_pos, dx);
  const int64_t T = d.T, D = d.D, K = d.K;
  require_f32(dx, "moe_gather_bwd");
  require_f32(dxs, "moe_gather_bwd");
  moe_gather_bwd_kernel<<<row_blocks(T), 128, 0, ctx.stream>>>(ptr<const float>(dxs), ptr<const int32_t>(slot_pos), ptr<float>(dx),
                                                              T, D, K);
  check_launch("moe_gather_bwd");
}

void moe_combine(Context& ctx, const Tensor& ys, const Tensor& slot_pos, const Tensor& weights, const Tensor& out,
                 bool accumulate) {
  check_device({&ys, &slot_pos, &weights, &out}, "moe_combine");
  const PermuteDims d = check_moe_combine(ys, slot_pos, weights, out);
  const int64_t T = d.T, D = d.D, K = d.K;
  for (const Tensor* t : {&ys, &weights, &out}) require_f32(*t, "moe_combine");
  if (T == 0) return;
  moe_combine_kernel<<<row_blocks(T), 128, 0, ctx.stream>>>(ptr<const float>(ys), ptr<const int32_t>(slot_pos),
                                                           ptr<const float>(weights), ptr<float>(out), T, D, K, accumulate);
  check_launch("moe_combine");
}

void moe_combine_bwd(Context& ctx, const Tensor& dout, const Tensor& ys, const Tensor& slot_pos, const Tensor& weights,
                     const Tensor& dys, const Tensor& dweights) {
  check_device({&dout, &ys, &slot_pos, &weights, &dys, &dweights}, "moe_combine_bwd");
  const PermuteDims d = check_moe_combine_bwd(dout, ys, slot_pos, weights, dys, dweights);
  const int64_t T = d.T, D = d.D, K = d.K;
  for (const Tensor* t : {&dout, &weights, &dweights}) require_f32(*t, "moe_combine_bwd");
  if (T * K == 0) return;
  dispatch_storage(ys.dtype, "moe_combine_bwd ys", [&](auto* tag) {
    using Y = std::remove_pointer_t<decltype(tag)>;
    dispatch_storage(dys.dtype, "moe_combine_bwd dys", [&](auto* otag) {  // f32, or bf16 (rounded)
      using O = std::remove_pointer_t<decltype(otag)>;
      moe_combine_bwd_kernel<<<warp_blocks(T * K), kThreads, 0, ctx.stream>>>(
          ptr<const float>(dout), ptr<const Y>(ys), ptr<const int32_t>(slot_pos), ptr<const float>(weights), ptr<O>(dys),
          ptr<float>(dweights), T, D, K);
    });
  });
  check_launch("moe_combine_bwd");
}

void load_balance_loss(Context& ctx, const Tensor& scores, const Tensor& counts, ScoreKind kind, int top_k, double value_scale,
                       double grad_scale, const Tensor& out, const Tensor& dscores, const Tensor& mean_prob) {
  check_device({&scores, &counts, &out, &dscores, &mean_prob}, "load_balance_loss");
  const RoutingDims d = check_load_balance_loss(scores, counts, kind, top_k, out, dscores, mean_prob);
  const int64_t T = d.T, E = d.E;
  require_f32(scores, "load_balance_loss");
  require_f32(mean_prob, "load_balance_loss");
  check_dtype(out, DType::kF64, "load_balance_loss out");
  if (!dscores.empty()) require_f32(dscores, "load_balance_loss dscores");
  const int chunks = static_cast<int>(T < kRowChunks ? T : kRowChunks);
  float* norm = ctx.scratch_as<float>(static_cast<size_t>(T + E + chunks * E), "load_balance_loss");
  float* f = norm + T;
  float* partial = f + E;
  row_norm_kernel<<<warp_blocks(T), kThreads, 0, ctx.stream>>>(ptr<const float>(scores), static_cast<int>(kind), norm, T, E);
  column_parts_kernel<<<dim3(blocks_for(E, kThreads), chunks), kThreads, 0, ctx.stream>>>(ptr<const float>(scores), norm, T, E,
                                                                                         chunks, partial);
  lbl_finish_kernel<<<1, 1, 0, ctx.stream>>>(partial, chunks, ptr<const int32_t>(counts), T, E, top_k, value_scale,
                                             ptr<double>(out), ptr<float>(mean_prob), f);
  if (!dscores.empty()) {
    const float gscale = static_cast<float>(grad_scale) * static_cast<float>(E) / static_cast<float>(T);
    lbl_grad_kernel<<<warp_blocks(T), kThreads, 0, ctx.stream>>>(ptr<const float>(scores), f, norm, static_cast<int>(kind), gscale,
                                                                 ptr<float>(dscores), T, E);
  }
  check_launch("load_balance_loss");
}

void router_z_loss(Context& ctx, const Tensor& logits, double value_scale, double grad_scale, const Tensor& out,
                   const Tensor& dlogits) {
  check_device({&logits, &out, &dlogits}, "router_z_loss");
  const RoutingDims d = check_router_z_loss(logits, out, dlogits);
  const int64_t T = d.T, E = d.E;
  require_f32(logits, "router_z_loss");
  check_dtype(out, DType::kF64, "router_z_loss out");
  if (!dlogits.empty()) require_f32(dlogits, "router_z_loss dlogits");
  float* lse = ctx.scratch_as<float>(static_cast<size_t>(T), "router_z_loss");
  z_rows_kernel<<<warp_blocks(T), kThreads, 0, ctx.stream>>>(ptr<const float>(logits), static_cast<float>(grad_scale), lse,
                                                             ptr<float>(dlogits), T, E);
  z_finish_kernel<<<1, kThreads, 0, ctx.stream>>>(lse, T, value_scale, ptr<double>(out));
  check_launch("router_z_loss");
}

}  // namespace moe::cuda
