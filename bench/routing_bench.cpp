// Router ops on the cpu backend at the expert-scaling bench's shape (bench/expert_scaling.sh: a
// micro-batch of 16,384 tokens, top-4 of 8 or 128 experts): the element-wise work beside the
// router's GEMM, which grows with the expert count (16x from 8 to 128 experts) and is part of
// what makes 128 experts slower than 8 (docs/PERFORMANCE.md). Time per call, 2 threads.
// Run: build/bench/kernels_bench --benchmark_filter=Router
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

void router_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"E", "thr"});
  for (int64_t experts : {8, 128}) b->Args({experts, 2});
}

BENCHMARK(BM_RouterTopk)->Apply(router_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RouterScoresFwd)->Apply(router_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RouterZLossWithGrad)->Apply(router_args)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace moe
