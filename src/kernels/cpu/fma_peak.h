// The CPU's arithmetic peak where the run runs: register-only FMA loops on the run's threads, the
// widest each instruction set offers (fp32: AVX-512 or AVX2 FMA; bf16: AVX512-BF16 dot products
// and AMX tiles where present, else fp32 FMAs, which is how bf16 products run on such a CPU).
// These are MFU's denominators on the cpu and strict backends (train/metrics.h): a constant
// measured on another machine was off by 2x between one session's Zen 4 and the next's Zen 5.
#pragma once

#include <string>

namespace moe::cpu {

struct FmaPeak {
  int threads = 0;
  double fp32_flops = 0;  // FLOP/s on all `threads` together
  double bf16_flops = 0;  // bf16 products (the fastest of the instructions that compute them)
  std::string fp32_kernel;  // the instruction that set it, e.g. "avx512f vfmadd231ps zmm"
  std::string bf16_kernel;
  double seconds = 0;  // what the measurement took
  bool from_cache = false;  // a peak came from an earlier measurement on this machine (fma_peak)
};

// One measurement: each loop runs `rounds` rounds of about `round_s` seconds on `threads` OpenMP
// threads at once; the peak is `threads` x the fastest rate one thread reached (a busy machine
// only ever slows a thread down, and a vCPU that lost its core must not halve the peak).
FmaPeak measure_fma_peak(int threads, int rounds = 12, double round_s = 0.004);

// measure_fma_peak(threads) once per thread count in this process (0.1-0.5 s the first time).
// cached: merged with a per-machine file (~/.cache/moecore/fma_peak.tsv; MOE_FMA_PEAK_CACHE names
// another, "off" none) keyed by CPUID, model name, instruction sets and threads, which keeps the
// largest of every measurement: a VM that lost half its cores during one 0.1 s measurement (seen
// here: 104 of 206 GFLOP/s, 1 run in 12) would otherwise double that run's MFU. Not for ranks that
// share cores, which each measure their share at once (train/metrics.cpp).
const FmaPeak& fma_peak(int threads, bool cached = true);

// Merges a measurement into that file's line for (this CPU, p.threads): the larger of each peak,
// with the instruction that reached it, is kept and returned (from_cache when one was the file's).
// A file that cannot be read or written leaves `p` as measured; unreadable lines are dropped.
FmaPeak best_on_this_machine(FmaPeak p);

// The instruction sets the loops can use on this CPU, e.g. "avx2 fma avx512f avx512_bf16".
std::string fma_isa();

}  // namespace moe::cpu
