// GEMM family benchmarks on the cpu backend: GFLOP/s and the fraction of this machine's FMA peak
// at the benchmark's thread count (kernels/cpu/fma_peak.h, measured where it runs), with 1 and 2
// threads.
//   linear:  (m, n, k) = x(m,k) * w(n,k)^T and its two gradients, at T=4096 D=512 F=1536 and at
//            small M (64 rows; 64x512x1536 is the case oneDNN's own threading does not scale).
//   grouped: 64 experts, mean 64 rows each (4096 rows), D=512 -> F=1024, with a balanced load and
//            a skewed one of the same total (max/mean = 4: one expert in 8 takes 4x the mean).
// Run: build/bench/kernels_bench --benchmark_filter=Gemm --benchmark_repetitions=3
// with the default OMP_WAIT_POLICY: the tests' PASSIVE policy adds a thread wake-up to every
// call, which costs the sub-millisecond small-M GEMMs up to a third of their 2-thread speed.
// The machine is shared: take the best repetition.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/transpose16.h"

namespace moe {
namespace {


enum Op { kFwd = 0, kBwdData = 1, kBwdWeight = 2 };
const char* kOpNames[] = {"fwd", "bwd_data", "bwd_weight"};

void fill(const Tensor& t, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float v = static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) / (1 << 23);
    if (t.dtype == DType::kBF16)
      static_cast<bf16*>(t.data)[i] = bf16(v);
    else
      static_cast<float*>(t.data)[i] = v;
  }
}

OwnedTensor make(DType t, std::initializer_list<int64_t> dims, uint64_t seed) {
  OwnedTensor o(t, dims);
  fill(o, seed);
  return o;
}

// Sets the thread count for one benchmark and restores it.
struct ThreadScope {
  int saved = omp_get_max_threads();
  explicit ThreadScope(int n) { cpu::set_num_threads(n); }
  ~ThreadScope() { cpu::set_num_threads(saved); }
};

void set_counters(benchmark::State& st, double flops, int dtype, int threads) {
  const double total = flops * static_cast<double>(st.iterations());
  st.counters["GFLOP/s"] = benchmark::Counter(total / 1e9, benchmark::Counter::kIsRate);
  const cpu::FmaPeak& peak = cpu::fma_peak(threads);
  st.counters["peak_frac"] =
      benchmark::Counter(total / (dtype ? peak.bf16_flops : peak.fp32_flops), benchmark::Counter::kIsRate);
}

// Args: op, dtype (0 f32, 1 bf16), m, n, k, threads.
void BM_GemmLinear(benchmark::State& st) {
  const int op = static_cast<int>(st.range(0)), dt = static_cast<int>(st.range(1));
  const int64_t m = st.range(2), n = st.range(3), k = st.range(4);
  const int threads = static_cast<int>(st.range(5));
  const DType t = dt ? DType::kBF16 : DType::kF32;
  ThreadScope scope(threads);
  auto x = make(t, {m, k}, 1), w = make(t, {n, k}, 2), dy = make(t, {m, n}, 3);
  OwnedTensor y(DType::kF32, {m, n}), dx(DType::kF32, {m, k}), dw(DType::kF32, {n, k});
  auto run = [&] {
    if (op == kFwd) cpu::linear_fwd(x, w, y, false);
    if (op == kBwdData) cpu::linear_bwd_data(dy, w, dx, false);
    if (op == kBwdWeight) cpu::linear_bwd_weight(dy, x, dw, true);
  };
  run();  // creates the primitives
  for (auto _ : st) run();
  st.SetLabel(std::string(kOpNames[op]) + (dt ? " bf16" : " f32"));
  set_counters(st, 2.0 * m * n * k, dt, threads);
}

// Rows per expert: balanced (0); skewed (1) with max/mean = 4 at the same total (one expert in 8
// takes 4x the mean; the rest share the remaining half as evenly as integers allow); or uneven
// (2) as learned routing leaves them: mean +- 50%, spread by a fixed generator, pairs summing to
// 2 x mean (so the total is the same), i.e. every expert has its own remainder of rows; or
// collapsed (3) as a router that sends every token to the same two experts leaves them: the
// first two experts take half the total each, the others none (where olmoe_compat's bench steps
// head: their load is 5-8 of this one's 8 = 16 / 2).
std::vector<int32_t> expert_rows(int64_t experts, int64_t mean, int skew) {
  std::vector<int32_t> rows(static_cast<size_t>(experts), static_cast<int32_t>(mean));
  if (skew == 0) return rows;
  if (skew == 3) {
    for (int64_t e = 0; e < experts; ++e) rows[static_cast<size_t>(e)] = e < 2 ? static_cast<int32_t>(experts * mean / 2) : 0;
    return rows;
  }
  if (skew == 2) {
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int64_t e = 0; e + 1 < experts; e += 2) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const auto d = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(mean + 1)) - mean / 2;
      rows[static_cast<size_t>(e)] = static_cast<int32_t>(mean + d);
      rows[static_cast<size_t>(e + 1)] = static_cast<int32_t>(mean - d);
    }
    return rows;
  }
  const int64_t hot = experts / 8, cold = experts - hot;
  const int64_t rest = experts * mean - hot * 4 * mean;
  int64_t c = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (e % 8 == 0) {
      rows[static_cast<size_t>(e)] = static_cast<int32_t>(4 * mean);
    } else {
      rows[static_cast<size_t>(e)] = static_cast<int32_t>(rest / cold + (c < rest % cold ? 1 : 0));
      ++c;
    }
  }
  return rows;
}

// Args: op, dtype, experts, mean rows, n, k, skewed, threads. Weight gradients accumulate, except
// on a collapsed load, which writes them as a step's first backward does (the empty experts' dw
// set to zero).
void BM_GemmGrouped(benchmark::State& st) {
  const int op = static_cast<int>(st.range(0)), dt = static_cast<int>(st.range(1));
  const int64_t experts = st.range(2), mean = st.range(3), n = st.range(4), k = st.range(5);
  const int skew = static_cast<int>(st.range(6));
  const int threads = static_cast<int>(st.range(7));
  const DType t = dt ? DType::kBF16 : DType::kF32;
  ThreadScope scope(threads);
  const auto rows = expert_rows(experts, mean, skew);
  OwnedTensor off(DType::kI32, {experts + 1});
  int32_t* o = off.as<int32_t>();
  o[0] = 0;
  for (int64_t e = 0; e < experts; ++e) o[e + 1] = o[e] + rows[static_cast<size_t>(e)];
  const int64_t r = o[experts];
  auto x = make(t, {r, k}, 1), w = make(t, {experts, n, k}, 2), dy = make(t, {r, n}, 3);
  OwnedTensor y(DType::kF32, {r, n}), dx(DType::kF32, {r, k}), dw(DType::kF32, {experts, n, k});
  auto run = [&] {
    if (op == kFwd) cpu::grouped_linear_fwd(x, w, off, y);
    if (op == kBwdData) cpu::grouped_linear_bwd_data(dy, w, off, dx);
    if (op == kBwdWeight) cpu::grouped_linear_bwd_weight(dy, x, off, dw, skew != 3);
  };
  run();
  for (auto _ : st) run();
  static const char* const kSkewNames[] = {" balanced", " skewed", " uneven", " collapsed"};
  st.SetLabel(std::string(kOpNames[op]) + (dt ? " bf16" : " f32") + kSkewNames[skew]);
  set_counters(st, 2.0 * static_cast<double>(r) * n * k, dt, threads);
}

void linear_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"op", "bf16", "m", "n", "k", "thr"});
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {4096, 1536, 512}, {64, 1536, 512}, {64, 512, 1536},
      // the fine-grained bench config's LM head: a micro-batch of 1,024 rows, vocabulary 50,304
      {1024, 50304, 256},
      // olmoe_compat.toml (2,048 tokens a step): an attention projection, the LM head
      {2048, 512, 512}, {2048, 8192, 512},
      // the expert-scaling bench's router at 128 experts (a micro-batch of 16,384 tokens, d_model 256)
      {16384, 128, 256}};
  for (int threads : {1, 2})
    for (int dt : {0, 1})
      for (const auto& [m, n, k] : shapes)
        for (int op : {kFwd, kBwdData, kBwdWeight}) b->Args({op, dt, m, n, k, threads});
}

void grouped_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"op", "bf16", "E", "rows", "n", "k", "skew", "thr"});
  for (int threads : {1, 2})
    for (int dt : {0, 1})
      for (int op : {kFwd, kBwdData, kBwdWeight})
        for (int skew : {0, 1}) b->Args({op, dt, 64, 64, 1024, 512, skew, threads});
  // The expert-scaling bench's MoE layer at 128 experts (bench/expert_scaling.sh): 512 rows per
  // expert on average, expert_hidden = d_model = 256; balanced vs learned-routing-like loads.
  // And its other end, 8 experts of 8,192 rows each (the same FLOPs).
  for (int dt : {0, 1})
    for (int op : {kFwd, kBwdData, kBwdWeight}) {
      for (int skew : {0, 1, 2}) b->Args({op, dt, 128, 512, 256, 256, skew, 2});
      b->Args({op, dt, 8, 8192, 256, 256, 0, 2});
    }
  // The same 65,536 rows cut finer, balanced (fp32): the rate of an expert's GEMM by its rows, the
  // cost of many small experts (a skewed load's cold experts) with the packing per call unchanged.
  for (int op : {kFwd, kBwdData})
    for (int rows : {256, 64, 32}) b->Args({op, 0, 65536 / rows, rows, 256, 256, 0, 2});
  // The same at expert_hidden = 1,024 (EXTRA="--set model.expert_hidden=1024"): each expert's
  // weights 1 MiB, as the published 8 -> 128 benchmark's large experts make them outgrow the
  // caches; the gate / up projections (n 1,024, k 256) and the down projection (n 256, k 1,024).
  for (const auto& [n, k] : {std::pair<int64_t, int64_t>{1024, 256}, {256, 1024}})
    for (int op : {kFwd, kBwdData, kBwdWeight}) {
      for (int skew : {0, 2}) b->Args({op, 0, 128, 512, n, k, skew, 2});
      b->Args({op, 0, 8, 8192, n, k, 0, 2});
    }
  // olmoe_compat.toml's MoE layer: 16 experts, top-2 of 2,048 tokens (256 rows each on average),
  // d_model = expert_hidden = 512 (the gate, up and down projections are each one such GEMM):
  // balanced, uneven and collapsed loads.
  for (int dt : {0, 1})
    for (int op : {kFwd, kBwdData, kBwdWeight})
      for (int skew : {0, 2, 3}) b->Args({op, dt, 16, 256, 512, 512, skew, 2});
  // fine_grained.toml's MoE layer: 64 experts, top-4 of a 1,024-token micro-batch (64 rows each on
  // average), d_model 256, expert_hidden 128: the gate and up projections (n 128, k 256), the
  // down projection (n 256, k 128); balanced and uneven loads.
  for (int dt : {0, 1})
    for (int op : {kFwd, kBwdData, kBwdWeight})
      for (const auto& [n, k] : {std::pair<int64_t, int64_t>{128, 256}, {256, 128}})
        for (int skew : {0, 2}) b->Args({op, dt, 64, 64, n, k, skew, 2});
}

// The transposed copy an AMX weight gradient makes of dy (kernels/cpu/transpose16.h), at the
// fine_grained LM head's: a micro-batch's 1,024 x 50,304 bf16 dlogits in the dense weight
// gradient's tiles (512 rows of dy by a band of 256 of its columns), each thread into its own
// buffer, 2 threads. GB/s of dy read.
void BM_Transpose16(benchmark::State& st) {
  constexpr int64_t kRows = 1024, kCols = 50304, kChunk = 512, kBand = 256;
  std::vector<uint16_t> dy(static_cast<size_t>(kRows * kCols));
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = static_cast<uint16_t>(i * 40503u);
  omp_set_num_threads(2);
  for (auto _ : st) {
#pragma omp parallel
    {
      std::vector<uint16_t> out(static_cast<size_t>(kChunk * kBand));
#pragma omp for schedule(static) collapse(2)
      for (int64_t r0 = 0; r0 < kRows; r0 += kChunk)
        for (int64_t c0 = 0; c0 < kCols; c0 += kBand)
          cpu::transpose_block16(dy.data() + r0 * kCols + c0, kCols, out.data(), kChunk, kChunk,
                                 std::min(kBand, kCols - c0));
      benchmark::DoNotOptimize(out.data());
    }
  }
  st.counters["GB/s"] = benchmark::Counter(static_cast<double>(kRows * kCols) * 2 * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_GemmLinear)->Apply(linear_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GemmGrouped)->Apply(grouped_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Transpose16)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moe
