// Router ops on the cpu backend at the expert-scaling bench's shape (bench/expert_scaling.sh: a
// micro-batch of 16,384 tokens, top-4 of 8 or 128 experts): the element-wise work beside the
// router's GEMM, which grows with the expert count (16x from 8 to 128 experts) and is part of
// what makes 128 experts slower than 8 (docs/PERFORMANCE_HISTORY.md). Time per call, 2 threads.
// Run: build/bench/kernels_bench --benchmark_filter='Router|MoePermute'
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdint>

#include "core/buffer.h"
#include "core/rng.h"
#include "kernels/cpu/cpu_ops.h"

namespace moe {
namespace {

constexpr int64_t kTokens = 16384, kTopK = 4;

OwnedTensor logits(int64_t experts) {
  OwnedTensor t(DType::kF32, {kTokens, experts});
  float* p = t.as<float>();
  for (int64_t i = 0; i < t.t.numel(); ++i)
    p[i] = static_cast<float>(4.0 * random_uniform(1234, 7, static_cast<uint64_t>(i)) - 2.0);
  return t;
}

// Args: experts, threads.
void BM_RouterTopk(benchmark::State& state) {
  const int64_t E = state.range(0);
  omp_set_num_threads(static_cast<int>(state.range(1)));
  OwnedTensor z = logits(E), s(DType::kF32, {kTokens, E}), idx(DType::kI32, {kTokens, kTopK});
  cpu::router_scores_fwd(z, ScoreKind::kSoftmax, 0, s);
  for (auto _ : state) {
    cpu::router_topk(s, Tensor(), 0, 0, idx);
    benchmark::DoNotOptimize(idx.t.data);
  }
}

void BM_RouterScoresFwd(benchmark::State& state) {
  const int64_t E = state.range(0);
  omp_set_num_threads(static_cast<int>(state.range(1)));
  OwnedTensor z = logits(E), s(DType::kF32, {kTokens, E});
  for (auto _ : state) {
    cpu::router_scores_fwd(z, ScoreKind::kSoftmax, 0, s);
    benchmark::DoNotOptimize(s.t.data);
  }
}

void BM_RouterZLossWithGrad(benchmark::State& state) {
  const int64_t E = state.range(0);
  omp_set_num_threads(static_cast<int>(state.range(1)));
  OwnedTensor z = logits(E), dz(DType::kF32, {kTokens, E}), out(DType::kF64, {1});
  for (auto _ : state) {
    cpu::router_z_loss(z, 1.0, 1.0, out, dz);
    benchmark::DoNotOptimize(dz.t.data);
  }
}

// The permutation around the experts at the expert-scaling shape (d_model 256): the gather of
// token rows into expert order, its backward (scatter-add), the weighted combine and its backward.
// Args: experts, threads, op (0 gather, 1 gather_bwd, 2 combine, 3 combine_bwd).
void BM_MoePermute(benchmark::State& state) {
  const int64_t E = state.range(0), D = 256, R = kTokens * kTopK;
  omp_set_num_threads(static_cast<int>(state.range(1)));
  OwnedTensor z = logits(E), s(DType::kF32, {kTokens, E}), idx(DType::kI32, {kTokens, kTopK});
  cpu::router_scores_fwd(z, ScoreKind::kSoftmax, 0, s);
  cpu::router_topk(s, Tensor(), 0, 0, idx);
  OwnedTensor counts(DType::kI32, {E}), offsets(DType::kI32, {E + 1}), sorted(DType::kI32, {R}),
      slot_pos(DType::kI32, {R});
  cpu::moe_plan(idx, counts, offsets, sorted, slot_pos);
  OwnedTensor x(DType::kF32, {kTokens, D}), xs(DType::kF32, {R, D}), w(DType::kF32, {kTokens, kTopK}),
      dw(DType::kF32, {kTokens, kTopK}), dxs(DType::kF32, {R, D});
  for (OwnedTensor* t : {&x, &xs, &w}) {
    float* p = t->as<float>();
    for (int64_t i = 0; i < t->t.numel(); ++i) p[i] = static_cast<float>(random_uniform(99, 3, static_cast<uint64_t>(i)));
  }
  for (auto _ : state) {
    switch (state.range(2)) {
      case 0: cpu::moe_gather(x, sorted, xs); break;
      case 1: cpu::moe_gather_bwd(xs, slot_pos, x); break;
      case 2: cpu::moe_combine(xs, slot_pos, w, x, false); break;
      default: cpu::moe_combine_bwd(x, xs, slot_pos, w, dxs, dw); break;
    }
    benchmark::ClobberMemory();
  }
}

void router_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"E", "thr"});
  for (int64_t experts : {8, 128}) b->Args({experts, 2});
}

BENCHMARK(BM_RouterTopk)->Apply(router_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RouterScoresFwd)->Apply(router_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RouterZLossWithGrad)->Apply(router_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MoePermute)
    ->ArgNames({"E", "thr", "op"})
    ->ArgsProduct({{8, 128}, {2}, {0, 1, 2, 3}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace moe
