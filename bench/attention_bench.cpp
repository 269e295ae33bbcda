// Causal attention, cpu kernel with fp32 or bf16 tile products: forward and backward throughput
// on two training-like shapes, grouped-query (kv:2: B=8, S=512, H=8, G=2) and multi-head as
// olmoe_compat (kv:8: B=4, S=512, H=G=8, a quarter of the kv:2 case's K/V reuse), for hd 32, 64 and
// 128, on 1 and 2 threads. bf16: 0 fp32 products, 1 bf16 products on fp32 tensors, 2 bf16 products on bf16 q, k,
// v and o (as bf16 mode saves them; dO and the gradients stay fp32).
// GFLOP/s counts the useful causal FLOPs only: forward 2 matmuls of 2*B*H*hd*S*(S+1)/2 each;
// backward 2.5x forward (the FlashAttention-2 convention: 5 matmuls; the dq pass's recomputation
// of the scores and dp is not counted).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdint>
#include <tuple>

#include "core/buffer.h"
#include "core/rng.h"
#include "kernels/cpu/cpu_ops.h"

namespace moe {
namespace {

constexpr int64_t kS = 512, kH = 8;
// Batch for G kv heads: the grouped-query case's 8, or 4 (olmoe_compat's) for multi-head.
int64_t batch(int64_t G) { return G == kH ? 4 : 8; }

void fill(const OwnedTensor& t, uint64_t salt) {
  float* p = t.as<float>();
  for (int64_t i = 0; i < t.t.numel(); ++i)
    p[i] = static_cast<float>(2.0 * random_uniform(1234, salt, static_cast<uint64_t>(i)) - 1.0);
}

struct Tensors {
  OwnedTensor q, k, v, dout, o, lse, dq, dk, dv;
  // stored: the dtype of q, k, v and o; G kv heads.
  Tensors(int64_t hd, DType stored, int64_t G) : Tensors(hd, stored, G, batch(G)) {}
  Tensors(int64_t hd, DType stored, int64_t G, int64_t B)
      : q(stored, {B, kS, kH, hd}), k(stored, {B, kS, G, hd}), v(stored, {B, kS, G, hd}),
        dout(DType::kF32, {B, kS, kH, hd}), o(stored, {B, kS, kH, hd}), lse(DType::kF32, {B, kH, kS}),
        dq(DType::kF32, {B, kS, kH, hd}), dk(DType::kF32, {B, kS, G, hd}), dv(DType::kF32, {B, kS, G, hd}) {
    for (auto [t, heads, salt] : {std::tuple{&q, kH, 1}, {&k, G, 2}, {&v, G, 3}}) {
      OwnedTensor f(DType::kF32, {B, kS, heads, hd});
      fill(f, static_cast<uint64_t>(salt));
      cpu::convert(f, *t);
    }
    fill(dout, 4);
  }
};

double forward_flops(int64_t hd, int64_t G) { return 2.0 * 2.0 * batch(G) * kH * hd * kS * (kS + 1) / 2.0; }

void BM_AttentionFwd(benchmark::State& state) {
  const int64_t hd = state.range(0);
  omp_set_num_threads(static_cast<int>(state.range(1)));
  const bool bf16 = state.range(2) != 0;
  const int64_t G = state.range(3);
  Tensors t(hd, state.range(2) == 2 ? DType::kBF16 : DType::kF32, G);
  for (auto _ : state) {
    cpu::attention_fwd(t.q, t.k, t.v, t.o, t.lse, Tensor(), bf16);
    benchmark::DoNotOptimize(t.o.t.data);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      forward_flops(hd, G) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AttentionBwd(benchmark::State& state) {
  const int64_t hd = state.range(0);
  omp_set_num_threads(static_cast<int>(state.range(1)));
  const bool bf16 = state.range(2) != 0;
  const int64_t G = state.range(3);
  Tensors t(hd, state.range(2) == 2 ? DType::kBF16 : DType::kF32, G);
  cpu::attention_fwd(t.q, t.k, t.v, t.o, t.lse, Tensor(), bf16);
  for (auto _ : state) {
    cpu::attention_bwd(t.dout, t.q, t.k, t.v, t.o, t.lse, t.dq, t.dk, t.dv, Tensor(), bf16);
    benchmark::DoNotOptimize(t.dq.t.data);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.5 * forward_flops(hd, G) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_AttentionFwd)
    ->ArgNames({"hd", "threads", "bf16", "kv"})
    ->ArgsProduct({{32, 64, 128}, {1, 2}, {0, 1, 2}, {2, 8}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionBwd)
    ->ArgNames({"hd", "threads", "bf16", "kv"})
    ->ArgsProduct({{32, 64, 128}, {1, 2}, {0, 1, 2}, {2, 8}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moe

BENCHMARK_MAIN();
