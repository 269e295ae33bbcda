// `moecore bench`: full training steps on random token ids after a warm-up, with throughput,
// model TFLOP/s, MFU, a per-phase breakdown (core/phase_timer.h) and heap allocations per step.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/phase_timer.h"
#include "kernels/op_times.h"
#include "train/bench_alone.h"
#include "train/metrics.h"

namespace moe {

struct BenchOptions {
  int64_t warmup = 3;
  int64_t steps = 10;
  // Heap allocation counter (incremented by a counting operator new in the moecore binary), or
  // null when none is installed. Counted over steps 3-10 of the whole run (warm-up included).
  const std::atomic<uint64_t>* alloc_counter = nullptr;
  // The calling thread's count of the same counter (PhaseTimer::set_thread_alloc_reader), or
  // null: splits the count into allocations inside oneDNN's primitive execution and the rest.
  uint64_t (*thread_alloc_reader)() = nullptr;
  // Wall time inside each op of the timed steps (kernels/op_times.h; the cpu backend only).
  bool ops = false;
  // After the steps, each phase's GEMM and attention kernels timed alone at the step's shapes
  // (train/bench_alone.h; the cpu backend, one process).
  bool alone = false;
};

struct BenchResult {
  int64_t tokens_per_step = 0;         // the global step (all data-parallel ranks)
  int64_t ranks = 1;
  double comm_bytes_per_step = 0;      // payload this rank sent (Communicator byte counters)
  std::vector<double> step_s;          // timed steps: StepResult::step_s (stream time)
  std::vector<double> fwd_bwd_s;       // the same steps less their optimizer phase
  std::vector<double> cpu_s, cpu_fwd_bwd_s;  // the same in process CPU seconds (all threads)
  double median_step_s = 0, mean_step_s = 0;
  double pp_bubble_s = 0;              // rank 0's time blocked in pipeline receives, mean per timed step
  double tokens_per_s = 0;             // tokens_per_step / median step time
  // Per MoE layer: the busiest expert's tokens over the mean (load_stats), the median over the
  // timed steps. 1 is an even load, num_experts / top_k a collapsed router (every token on the
  // same top_k experts).
  std::vector<double> max_load;
  double flops_per_token = 0, tflops = 0, mfu = 0;
  MfuPeak peak;                        // MFU's denominator and its source (train/metrics.h)
  // Host backends, one rank: the peak measured again right after the timed steps (uncached), and
  // the MFU against it. A shared VM's speed moves by the hour (one Emerald Rapids VM: fp32 354 to
  // 497 GFLOP/s), the cached best only up: this says how close the steps came to the machine as
  // it was while they ran. 0 where not measured.
  double peak_now_tflops = 0, mfu_now = 0;
  std::array<double, PhaseTimer::kNum> phase_s{};  // mean seconds per timed step, exclusive
  std::array<double, PhaseTimer::kNum> phase_cpu_s{};  // the same in process CPU seconds
  // Model FLOPs each phase computes per timed step (ModelConfig::train_flops_by_part: attention,
  // router, expert_gemm, lm_head_loss, and other for dense FFN layers); all 0 on more than one rank.
  std::array<double, PhaseTimer::kNum> phase_flops{};
  double phase_sum_s = 0;              // sum of phase_s (other measured, not derived)
  double phase_error = 0;              // |phase_sum_s - mean_step_s| / mean_step_s
  int64_t alloc_steps = 0;             // steps counted for allocations (0: no counter)
  double allocs_per_step = 0;
  double dnnl_allocs_per_step = 0;     // of which inside oneDNN's primitive execution (-1: unknown)
  std::array<double, PhaseTimer::kNum> phase_allocs{};  // per counted step, by phase
  OpTimes op_times;                    // with BenchOptions::ops: per op, seconds and calls per timed step
  KernelsAlone alone;                  // with BenchOptions::alone
  std::string kernel_paths;            // cuda: which implementation the timed steps' calls took (CudaPaths)
  double setup_s = 0;                  // the trainer's construction: allocation, parameter init, plans
  int64_t params = 0, host_threads = 0;
  int64_t peak_rss_bytes = 0;
  double peak_device_mb = 0, estimate_mb = 0;  // cuda: most device memory held, and estimate_memory's total
  // Host <-> device staging copies per timed step (Backend::transfers), mean.
  double to_host_per_step = 0, to_host_bytes_per_step = 0, to_device_per_step = 0, to_device_bytes_per_step = 0;
};

BenchResult run_bench(const Config& config, const BenchOptions& opt);
void print_bench(const Config& config, const BenchResult& r, std::ostream& os);

// The median of v (the mean of the middle two for an even count): the bench's step statistics.
double median(std::vector<double> v);

// `moecore bench --versus`: two configurations in one process, their steps alternated (A B, B A,
// A B, ...), so that each pair of steps runs seconds apart: on a shared VM whose speed drifts by
// the minute, runs minutes apart compare the machine's moments as much as the configurations.
// One process; the same train.threads; not with --alone (with --ops, each op A against B).
struct VersusResult {
  BenchResult a, b;
};
VersusResult run_bench_versus(const Config& a, const Config& b, const BenchOptions& opt);
// Both results (print_bench), then B's time per token against A's, pair by pair. b_is says how B
// differs ("model.num_experts=128").
void print_versus(const Config& a, const Config& b, const std::string& b_is, const VersusResult& r, std::ostream& os);

}  // namespace moe
