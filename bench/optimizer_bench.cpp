// The optimizer phase on the cpu backend at olmoe_compat.toml's size (63 M parameters), 2 threads:
// the separate passes it used to make (scale the gradients by the clip factor, AdamW, convert the
// parameters to their bf16 operand copies) against adamw_by_control's one pass that reads the
// gradient times the clip factor and writes the bf16 copy. A clipped step (the clip pass only ran
// then).
// Run: build/bench/kernels_bench --benchmark_filter=Optimizer
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

// Args: bf16 copies (0/1), fused (0/1).
void BM_OptimizerStep(benchmark::State& state) {
  omp_set_num_threads(2);
  const bool bf16 = state.range(0) != 0, fused = state.range(1) != 0;
  static State s;
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
}
BENCHMARK(BM_OptimizerStep)->ArgNames({"bf16", "fused"})->ArgsProduct({{0, 1}, {0, 1}})->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moe
