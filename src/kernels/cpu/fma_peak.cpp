// Register-only loops at the CPU's arithmetic limit (kernels/cpu/fma_peak.h). Each loop keeps
// enough independent accumulator chains in registers to cover the FMA latency on every pipe
// (16 zmm chains: 2 pipes x 4-5 cycles on Zen 4/5 and Intel cores; 12 ymm chains under AVX2's
// 16 registers), and reads no memory. The instruction sets are chosen at run time from CPUID, so
// the peak is the machine's whatever -march the build used.
#include "kernels/cpu/fma_peak.h"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "core/fnv1a.h"
#include "kernels/cpu/amx.h"

namespace moe::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- the loops
// Each returns a value of its accumulators (summed into a sink) so the work cannot be dropped.
// The chains iterate a = a * m + c with m < 1: the values settle near c / (1 - m), never
// denormal, never overflowing.

constexpr int kZmmChains = 16, kYmmChains = 12;

// (Not _mm512_reduce_add_ps: GCC 12's reads an uninitialized register, which -Werror refuses.)
__attribute__((target("avx512f"))) float sum_lanes(__m512 s) {
  alignas(64) float v[16];
  _mm512_store_ps(v, s);
  float t = 0;
  for (float x : v) t += x;
  return t;
}

__attribute__((target("avx512f"))) float fp32_avx512(int64_t iters) {
  __m512 acc[kZmmChains];
  for (int j = 0; j < kZmmChains; ++j) acc[j] = _mm512_set1_ps(0.01f * static_cast<float>(j));
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kZmmChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, c);
  __m512 s = acc[0];
  for (int j = 1; j < kZmmChains; ++j) s = _mm512_add_ps(s, acc[j]);
  return sum_lanes(s);
}
constexpr double kFp32Avx512Flops = kZmmChains * 16 * 2;  // per iteration

__attribute__((target("avx2,fma"))) float fp32_avx2(int64_t iters) {
  __m256 acc[kYmmChains];
  for (int j = 0; j < kYmmChains; ++j) acc[j] = _mm256_set1_ps(0.01f * static_cast<float>(j));
  const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kYmmChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, c);
  __m256 s = acc[0];
  for (int j = 1; j < kYmmChains; ++j) s = _mm256_add_ps(s, acc[j]);
  alignas(32) float v[8];
  _mm256_store_ps(v, s);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}
constexpr double kFp32Avx2Flops = kYmmChains * 8 * 2;

// Without FMA (a pre-Haswell x86): a multiply and an add per element, SSE's 4 lanes.
float fp32_sse(int64_t iters) {
  __m128 acc[kYmmChains];
  for (int j = 0; j < kYmmChains; ++j) acc[j] = _mm_set1_ps(0.01f * static_cast<float>(j));
  const __m128 m = _mm_set1_ps(0.999f), c = _mm_set1_ps(1e-4f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kYmmChains; ++j) acc[j] = _mm_add_ps(_mm_mul_ps(acc[j], m), c);
  __m128 s = acc[0];
  for (int j = 1; j < kYmmChains; ++j) s = _mm_add_ps(s, acc[j]);
  alignas(16) float v[4];
  _mm_store_ps(v, s);
  return v[0] + v[1] + v[2] + v[3];
}
constexpr double kFp32SseFlops = kYmmChains * 4 * 2;

// vdpbf16ps: 16 lanes, each += two bf16 products (4 FLOP per lane).
__attribute__((target("avx512f,avx512bf16"))) float bf16_avx512(int64_t iters) {
  __m512 acc[kZmmChains];
  for (int j = 0; j < kZmmChains; ++j) acc[j] = _mm512_set1_ps(0.01f * static_cast<float>(j));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kZmmChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  __m512 s = acc[0];
  for (int j = 1; j < kZmmChains; ++j) s = _mm512_add_ps(s, acc[j]);
  return sum_lanes(s);
}
constexpr double kBf16Avx512Flops = kZmmChains * 16 * 4;

// AMX: tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 (16,384 FLOP);
// four accumulator tiles in flight, the operands loaded once.
__attribute__((target("amx-tile,amx-bf16"))) float bf16_amx(int64_t iters) {
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float out[16 * 16];
  std::fill(a, a + 16 * 32, uint16_t{0x3a83});  // bf16 1e-3
  std::fill(b, b + 16 * 32, uint16_t{0x3f00});  // bf16 0.5
  amx::load_full_tiles();
  _tile_loadd(4, a, 64);
  _tile_loadd(5, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
constexpr double kBf16AmxFlops = 4.0 * 16 * 16 * 32 * 2;

// ---------------------------------------------------------------- what this CPU has
struct Isa {
  bool avx2_fma = false, avx512f = false, avx512_bf16 = false, amx_bf16 = false;
};

const Isa& isa() {
  static const Isa i = [] {
    Isa r;
    __builtin_cpu_init();
    r.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    r.avx512f = __builtin_cpu_supports("avx512f");
    r.avx512_bf16 = r.avx512f && __builtin_cpu_supports("avx512bf16");
    unsigned a = 0, b = 0, c = 0, d = 0;
    // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1)) r.amx_bf16 = amx::permitted();
    return r;
  }();
  return i;
}

struct Loop {
  float (*run)(int64_t);
  double flops_per_iter;
  const char* name;
};

std::atomic<float> g_sink{0};

// FLOP/s of `threads` threads running at once: every thread runs the loop from a common barrier
// (so each core runs under an all-core load, at its all-core clock), and the peak is the threads
// times the fastest rate any thread reached in any round. On a shared VM a vCPU can lose its
// core for seconds: the slowest thread's time (or a mean) then measured half the machine, and
// MFU against it doubled. Cores are taken as equal: on a CPU with slower cores this errs high,
// the side on which an MFU stays honest.
double rate(const Loop& loop, int threads, int rounds, double round_s) {
  // Iterations for one round from a short single-thread run (after a warm-up that wakes the core).
  loop.run(2000);
  int64_t iters = 1000;
  double t = 0;
  for (;;) {
    const Clock::time_point t0 = Clock::now();
    g_sink.store(g_sink.load(std::memory_order_relaxed) + loop.run(iters), std::memory_order_relaxed);
    t = std::chrono::duration<double>(Clock::now() - t0).count();
    if (t >= round_s / 8 || iters > (int64_t{1} << 40)) break;
    iters *= 4;
  }
  iters = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(iters) * round_s / t));
  double best = 0;
  std::vector<double> took(static_cast<size_t>(threads));
  // At least `rounds` rounds, and on until the best has held (within 1%) for `rounds` rounds in a
  // row, at most 8 x rounds: a whole VM slowed for tens of milliseconds is waited out.
  int held = 0;
  for (int r = -1; r < 8 * rounds && held < rounds; ++r) {  // round -1 wakes every thread's core, untimed
    int ran = 1;
#pragma omp parallel num_threads(threads)
    {
      const int me = omp_get_thread_num();
#pragma omp master
      ran = omp_get_num_threads();
#pragma omp barrier
      const Clock::time_point t0 = Clock::now();
      const float v = loop.run(iters);
      took[static_cast<size_t>(me)] = std::chrono::duration<double>(Clock::now() - t0).count();
      g_sink.store(g_sink.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
    }
    const double fastest = *std::min_element(took.begin(), took.begin() + ran);
    if (r < 0 || fastest <= 0) continue;
    const double now = static_cast<double>(ran) * static_cast<double>(iters) * loop.flops_per_iter / fastest;
    held = now > best * 1.01 ? 0 : held + 1;
    best = std::max(best, now);
  }
  return best;
}

}  // namespace

std::string fma_isa() {
  const Isa& i = isa();
  std::string s = i.avx2_fma ? "avx2 fma" : "sse";
  if (i.avx512f) s += " avx512f";
  if (i.avx512_bf16) s += " avx512_bf16";
  if (i.amx_bf16) s += " amx_bf16";
  return s;
}

FmaPeak measure_fma_peak(int threads, int rounds, double round_s) {
  MOE_CHECK(threads >= 1 && rounds >= 1 && round_s > 0, "measure_fma_peak: threads ", threads, ", rounds ", rounds,
            ", round_s ", round_s);
  const Clock::time_point t0 = Clock::now();
  const Isa& i = isa();
  const Loop fp32 = i.avx512f    ? Loop{fp32_avx512, kFp32Avx512Flops, "avx512f vfmadd231ps zmm"}
                    : i.avx2_fma ? Loop{fp32_avx2, kFp32Avx2Flops, "avx2 vfmadd231ps ymm"}
                                 : Loop{fp32_sse, kFp32SseFlops, "sse mulps + addps"};
  FmaPeak p;
  p.threads = threads;
  p.fp32_flops = rate(fp32, threads, rounds, round_s);
  p.fp32_kernel = fp32.name;
  // bf16 products: the fastest instruction that computes them; without one, fp32 FMAs on widened
  // operands (as oneDNN and our attention kernels run bf16 there).
  p.bf16_flops = p.fp32_flops;
  p.bf16_kernel = std::string("no bf16 instruction: ") + fp32.name;
  if (i.avx512_bf16) {
    const double r = rate(Loop{bf16_avx512, kBf16Avx512Flops, "avx512_bf16 vdpbf16ps zmm"}, threads, rounds, round_s);
    if (r > p.bf16_flops) {
      p.bf16_flops = r;
      p.bf16_kernel = "avx512_bf16 vdpbf16ps zmm";
    }
  }
  if (i.amx_bf16) {
    const double r = rate(Loop{bf16_amx, kBf16AmxFlops, "amx tdpbf16ps"}, threads, rounds, round_s);
    if (r > p.bf16_flops) {
      p.bf16_flops = r;
      p.bf16_kernel = "amx_bf16 tdpbf16ps";
    }
  }
  p.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return p;
}

namespace {

// This CPU, as the cache file keys it: CPUID's family, model and stepping, the model name and the
// instruction sets the loops use (a VM moved to another host of the same kind keeps its key).
std::string cpu_signature() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, sig;
  while (std::getline(in, line)) {
    if (line.empty()) break;  // the first processor's block
    for (const char* key : {"vendor_id", "cpu family", "model", "model name", "stepping"})
      if (line.rfind(key, 0) == 0 && line.size() > std::strlen(key) && (line[std::strlen(key)] == ' ' || line[std::strlen(key)] == '\t'))
        sig += line + ";";
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a(sig + fma_isa())));
  return hex;
}

// The cache file: MOE_FMA_PEAK_CACHE (a path, or "off"), else $XDG_CACHE_HOME or ~/.cache.
std::string cache_path() {
  if (const char* p = std::getenv("MOE_FMA_PEAK_CACHE")) return std::string(p) == "off" ? "" : p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/moecore/fma_peak.tsv";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/moecore/fma_peak.tsv";
  return "";
}

}  // namespace

FmaPeak best_on_this_machine(FmaPeak p) {
  const std::string path = cache_path();
  if (path.empty()) return p;
  const std::string sig = cpu_signature();
  std::vector<std::string> keep;
  {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      std::istringstream f(line);
      std::string s, fp32_kernel, bf16_kernel;
      int threads = 0;
      double fp32 = 0, bf16 = 0;
      if (!std::getline(f, s, '\t') || !(f >> threads >> fp32 >> bf16)) continue;  // unreadable: dropped
      f.ignore(1);
      std::getline(f, fp32_kernel, '\t');
      std::getline(f, bf16_kernel);
      if (s != sig || threads != p.threads) {
        keep.push_back(line);
        continue;
      }
      p.from_cache = fp32 > p.fp32_flops || bf16 > p.bf16_flops;
      if (fp32 > p.fp32_flops) p.fp32_flops = fp32, p.fp32_kernel = fp32_kernel;
      if (bf16 > p.bf16_flops) p.bf16_flops = bf16, p.bf16_kernel = bf16_kernel;
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp);
    for (const std::string& line : keep) out << line << "\n";
    out << sig << "\t" << p.threads << "\t" << std::setprecision(6) << p.fp32_flops << "\t" << p.bf16_flops << "\t"
        << p.fp32_kernel << "\t" << p.bf16_kernel << "\n";
    if (!out) {
      std::remove(tmp.c_str());
      return p;
    }
  }
  std::filesystem::rename(tmp, path, ec);  // atomic: a reader sees the old file or the new one
  if (ec) std::remove(tmp.c_str());
  return p;
}

const FmaPeak& fma_peak(int threads, bool cached) {
  static std::mutex mu;
  static std::map<std::pair<int, bool>, FmaPeak> measured;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = measured.find({threads, cached});
  if (it == measured.end()) {
    FmaPeak p = measure_fma_peak(threads);
    if (cached) p = best_on_this_machine(p);
    it = measured.emplace(std::pair{threads, cached}, p).first;
  }
  return it->second;
}

}  // namespace moe::cpu
