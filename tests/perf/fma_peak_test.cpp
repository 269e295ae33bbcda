// The FMA peak moecore divides MFU by (kernels/cpu/fma_peak.h) against a loop written separately
// here: different chain counts, the unrolling by hand. Label perf (a timing, run by hand:
// `ctest --test-dir build -L perf`). Both are measured alternately on the same threads, best
// rounds, so a busy moment hits both; they must agree within 10%.
#include <gtest/gtest.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fma_peak.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;
volatile float g_sink = 0;

// fp32: 10 chains of a = a * b + c, unrolled by hand, one function per vector width (each
// compiled for its instruction set, so the loop body is the FMAs alone).
#define MOE_TEN_CHAINS(V, FMA, SET, STORE)                                                                  \
  V a0 = SET(0.1f), a1 = SET(0.2f), a2 = SET(0.3f), a3 = SET(0.4f), a4 = SET(0.5f);                         \
  V a5 = SET(0.6f), a6 = SET(0.7f), a7 = SET(0.8f), a8 = SET(0.9f), a9 = SET(1.0f);                         \
  const V b = SET(0.9995f), c = SET(2e-4f);                                                                 \
  for (int64_t i = 0; i < iters; ++i) {                                                                     \
    a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c); a4 = FMA(a4, b, c);     \
    a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c); a8 = FMA(a8, b, c); a9 = FMA(a9, b, c);     \
  }                                                                                                         \
  alignas(64) float out[16];                                                                                \
  STORE(out, FMA(a0, a1, FMA(a2, a3, FMA(a4, a5, FMA(a6, a7, FMA(a8, a9, c))))));                          \
  return out[0];

__attribute__((target("avx2,fma"))) float loop256(int64_t iters) {
  MOE_TEN_CHAINS(__m256, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_store_ps)
}
__attribute__((target("avx512f"))) float loop512(int64_t iters) {
  MOE_TEN_CHAINS(__m512, _mm512_fmadd_ps, _mm512_set1_ps, _mm512_store_ps)
}

// FLOP/s of `threads` threads running f(iters) at once, as fma_peak counts it: the threads times
// the fastest thread's rate, the best of `rounds` rounds.
double best_rate(float (*f)(int64_t), int64_t iters, double flops_per_iter, int threads, int rounds) {
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    double fastest = 1e30;
#pragma omp parallel num_threads(threads) reduction(min : fastest)
    {
      const Clock::time_point t0 = Clock::now();
      g_sink = g_sink + f(iters);
      fastest = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    best = std::max(best, threads * static_cast<double>(iters) * flops_per_iter / fastest);
  }
  return best;
}

TEST(FmaPeak, MatchesASeparatelyWrittenLoopOnTheRunsThreads) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) GTEST_SKIP() << "no AVX2 FMA";
  const bool zmm = __builtin_cpu_supports("avx512f");
  float (*loop)(int64_t) = zmm ? loop512 : loop256;
  const double per_iter = 10.0 * (zmm ? 16 : 8) * 2;
  for (int threads : {1, cpu::num_threads()}) {
    SCOPED_TRACE(threads);
    const int64_t iters = 2'000'000;  // ~10-30 ms a round
    best_rate(loop, iters / 10, per_iter, threads, 1);  // wake the cores
    double mine = 0, theirs = 0;
    for (int r = 0; r < 4; ++r) {  // alternated: noise hits both
      mine = std::max(mine, best_rate(loop, iters, per_iter, threads, 2));
      theirs = std::max(theirs, cpu::measure_fma_peak(threads).fp32_flops);
    }
    std::printf("%d thread(s): this loop %.1f GFLOP/s, fma_peak %.1f GFLOP/s (%s)\n", threads, mine / 1e9, theirs / 1e9,
                cpu::fma_isa().c_str());
    EXPECT_NEAR(theirs / mine, 1.0, 0.10);
  }
}

}  // namespace
}  // namespace moe
