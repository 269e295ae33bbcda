// The optimizer phase on the cpu backend at olmoe_compat.toml's size (63 M parameters), 2 threads:
// the separate passes it used to make (scale the gradients by the clip factor, AdamW, convert the
// parameters to their bf16 operand copies) against adamw_by_control's one pass that reads the
// gradient times the clip factor and writes the bf16 copy. A clipped step (the clip pass only ran
// then). GB/s counts the bytes the fused pass must move (parameters, gradients and both moments
// read, parameters and moments written: 28 per parameter, 30 with the bf16 copy), against
// BM_StreamUpdate: p += s * g over as many floats (12 bytes each), this machine's memory bandwidth
// for a read-modify-write stream on the same 2 threads.
// Run: build/bench/kernels_bench --benchmark_filter='Optimizer|StreamUpdate'
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdint>

#include "core/buffer.h"
#include "core/rng.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/step_control.h"

namespace moe {
namespace {

constexpr int64_t kParams = 62956032;

struct State {
  OwnedTensor p{DType::kF32, {kParams}}, g{DType::kF32, {kParams}}, m{DType::kF32, {kParams}},
      v{DType::kF32, {kParams}}, copy{DType::kBF16, {kParams}}, control{DType::kF64, {kCtlSize}};
  State() {
    float* pg = g.as<float>();
    for (int64_t i = 0; i < kParams; ++i) pg[i] = static_cast<float>(random_uniform(1, 2, static_cast<uint64_t>(i)) - 0.5);
    double* c = control.as<double>();
    c[kCtlClipped] = 1;
    c[kCtlClipCoef] = 1.0;  // clipped by a factor of 1: the clip pass runs, the gradients stay
    c[kCtlLr] = 1e-3;
    c[kCtlUpdates] = 3;
  }
};

// One set of 63 M-parameter buffers (1.4 GB) for every benchmark here.
State& state_once() {
  static State s;
  return s;
}

// Args: bf16 copies (0/1), fused (0/1).
void BM_OptimizerStep(benchmark::State& state) {
  omp_set_num_threads(2);
  const bool bf16 = state.range(0) != 0, fused = state.range(1) != 0;
  State& s = state_once();
  for (auto _ : state) {
    if (fused) {
      cpu::adamw_by_control(s.p, s.g, s.m, s.v, s.control, 0.9, 0.95, 1e-8, 0.1, bf16 ? s.copy.t : Tensor());
    } else {
      cpu::scale(s.g, s.control.as<double>()[kCtlClipCoef]);  // the clip pass the step made before
      cpu::adamw_by_control(s.p, s.g, s.m, s.v, s.control, 0.9, 0.95, 1e-8, 0.1, Tensor());
      if (bf16) cpu::convert(s.p, s.copy);
    }
    benchmark::DoNotOptimize(s.p.t.data);
  }
  if (fused)
    state.counters["GB/s"] = benchmark::Counter(static_cast<double>(kParams) * (bf16 ? 30 : 28) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_OptimizerStep)->ArgNames({"bf16", "fused"})->ArgsProduct({{0, 1}, {0, 1}})->UseRealTime()->Unit(benchmark::kMillisecond);

// The fused pass on moments left subnormal (a long run's parameters whose gradient stays zero, as
// the embedding rows of absent tokens): gradients zero, m and v 1e-39. AdamW flushes them to zero
// (elementwise.cpp, FlushSubnormals); without that, each instruction on them took a microcode
// assist on Intel cores (Emerald Rapids: 549-567 ms against 60-62 for ordinary values). Its own
// buffers, set before every pass (not timed).
void BM_OptimizerSubnormal(benchmark::State& state) {
  omp_set_num_threads(2);
  static OwnedTensor p{DType::kF32, {kParams}}, g{DType::kF32, {kParams}}, m{DType::kF32, {kParams}},
      v{DType::kF32, {kParams}}, copy{DType::kBF16, {kParams}};
  State& s = state_once();
  for (auto _ : state) {
    state.PauseTiming();
    cpu::fill(p, 0.01), cpu::fill(g, 0.0), cpu::fill(m, 1e-39), cpu::fill(v, 1e-39);
    state.ResumeTiming();
    cpu::adamw_by_control(p, g, m, v, s.control, 0.9, 0.95, 1e-8, 0.1, copy.t);
    benchmark::DoNotOptimize(p.t.data);
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(kParams) * 30 * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_OptimizerSubnormal)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_StreamUpdate(benchmark::State& state) {
  omp_set_num_threads(2);
  State& s = state_once();
  float* p = s.p.as<float>();
  const float* g = s.g.as<float>();
  for (auto _ : state) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < kParams; ++i) p[i] += 1e-6f * g[i];
    benchmark::DoNotOptimize(p);
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(kParams) * 12 * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_StreamUpdate)->UseRealTime()->Unit(benchmark::kMillisecond);

// The gradient norm's pass before AdamW: the sum of squares of every gradient (sumsq_segments,
// one segment per parameter tensor of olmoe_compat: 51 of them, here of equal length), 4 bytes
// read per parameter.
void BM_GradSumsq(benchmark::State& state) {
  omp_set_num_threads(2);
  State& s = state_once();
  constexpr int64_t kSegments = 51;
  OwnedTensor seg(DType::kI64, {kSegments, 3}), out(DType::kF64, {kSegments});
  int64_t* sg = seg.as<int64_t>();
  for (int64_t i = 0; i < kSegments; ++i) {
    sg[3 * i] = kParams * i / kSegments;
    sg[3 * i + 1] = kParams * (i + 1) / kSegments;
    sg[3 * i + 2] = i;
  }
  for (auto _ : state) {
    cpu::fill(out, 0.0);
    cpu::sumsq_segments(s.g, seg, out);
    benchmark::DoNotOptimize(out.t.data);
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(kParams) * 4 * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_GradSumsq)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moe
