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
};

// One measurement: each loop runs `rounds` rounds of about `round_s` seconds on `threads` OpenMP
// threads at once, and the fastest round counts (a busy machine only ever slows a round down).
FmaPeak measure_fma_peak(int threads, int rounds = 8, double round_s = 0.004);

// measure_fma_peak(threads) once per thread count in this process (under 0.1 s the first time).
const FmaPeak& fma_peak(int threads);

// The instruction sets the loops can use on this CPU, e.g. "avx2 fma avx512f avx512_bf16".
std::string fma_isa();

}  // namespace moe::cpu
