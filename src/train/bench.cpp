#include "train/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <utility>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/ops.h"
#ifdef MOE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif
#include "plan/memory.h"
#include "parallel/communicator.h"
#include "parallel/process_groups.h"
#include "train/metrics.h"
#include "train/run_checks.h"
#include "train/trainer.h"

namespace moe {

namespace {
// Payload bytes this rank has sent over its groups (world-level ops are the norm's partials).
uint64_t comm_bytes_sent(const ProcessGroups& g) {
  uint64_t n = g.world->stats().total_sent();
  for (const auto* c : {g.dp.get(), g.ep.get(), g.edp.get(), g.pp.get()}) n += c->stats().total_sent();
  return n;
}

// Per timed step: its phases (measured by the call that enqueued it) and, once its record is
// read, its time. A step's time is StepResult::step_s, stream time between the backend's events
// exactly as `moecore train` records it: the host's clock would time only the enqueue on an
// asynchronous backend (strict, cuda).
struct TimedStep {
  std::array<double, PhaseTimer::kNum> phase{}, cpu{};
  double step_s = -1, bubble = 0;
  std::vector<double> max_load;  // per MoE layer: the busiest expert's tokens over the mean
};

// The bench's steps: the trainer and what it runs on (groups null: one process), and the record
// of each timed step.
struct BenchSteps {
  Trainer& trainer;
  Backend& ops;
  Communicator& world;
  ProcessGroups* groups;
  const BenchOptions& opt;
  bool overlap_host;
  std::vector<TimedStep> timed;
  std::vector<std::vector<int32_t>> last_counts;  // the last step's tokens per expert (opt.alone)

  // A step's record, read by the call that enqueued it or (lagged) by the next one.
  void record(const StepResult* rec, int64_t step) {
    if (rec == nullptr || step <= opt.warmup) return;
    TimedStep& t = timed[static_cast<size_t>(step - opt.warmup - 1)];
    t.step_s = rec->step_s;
    t.bubble = rec->pp_bubble_s;
    t.max_load.clear();
    for (const auto& c : rec->counts) t.max_load.push_back(load_stats(c).max_over_mean);
    if (opt.alone && step == opt.warmup + opt.steps) last_counts = rec->counts;
  }

  // Step i on this batch: its phases, and for the timed steps its traffic (transfers, bytes
  // sent) and, on steps 3-10 with a counter, its heap allocations, into r.
  void run(int64_t i, const OwnedTensor& ids, const OwnedTensor& labels, BenchResult& r) {
    const bool timed_step = i > opt.warmup;
    const bool count_allocs = opt.alloc_counter && i >= 3 && i <= 10;
    uint64_t alloc_before = 0, foreign_before = 0;
    if (count_allocs) {
      alloc_before = opt.alloc_counter->load(std::memory_order_relaxed);
      foreign_before = PhaseTimer::foreign_allocs();
    }
    PhaseTimer::set_alloc_counter(count_allocs ? opt.alloc_counter : nullptr);
    PhaseTimer::set_enabled(true);
    PhaseTimer::reset();
    if (groups) world.barrier();  // steps start together: a rank's wait is not the previous step's
    const uint64_t sent_before = groups ? comm_bytes_sent(*groups) : 0;
    const TransferStats moved_before = ops.transfers();
    {
      const OpTimesScope op_times(opt.ops && timed_step ? &r.op_times : nullptr);
      // As `moecore train` runs them (train.overlap_host): each call enqueues a step and reads the
      // one before, whose record carries that step's time.
      if (overlap_host) {
        record(trainer.submit(ids.t, labels.t), i - 1);
      } else {
        record(&trainer.step(ids.t, labels.t), i);
      }
    }
    if (timed_step) {
      const TransferStats moved = ops.transfers() - moved_before;
      r.to_host_per_step += static_cast<double>(moved.to_host);
      r.to_host_bytes_per_step += static_cast<double>(moved.to_host_bytes);
      r.to_device_per_step += static_cast<double>(moved.to_device);
      r.to_device_bytes_per_step += static_cast<double>(moved.to_device_bytes);
    }
    if (groups && timed_step) r.comm_bytes_per_step += static_cast<double>(comm_bytes_sent(*groups) - sent_before);
    PhaseTimer::flush();  // waits for the stream: the phases of this call's step
    PhaseTimer::set_enabled(false);
    if (count_allocs) {
      r.allocs_per_step += static_cast<double>(opt.alloc_counter->load(std::memory_order_relaxed) - alloc_before);
      r.dnnl_allocs_per_step += static_cast<double>(PhaseTimer::foreign_allocs() - foreign_before);
      ++r.alloc_steps;
      for (int p = 0; p < PhaseTimer::kNum; ++p)
        r.phase_allocs[static_cast<size_t>(p)] += static_cast<double>(PhaseTimer::allocs()[static_cast<size_t>(p)]);
    }
    PhaseTimer::set_alloc_counter(nullptr);
    if (!timed_step) return;
    TimedStep& t = timed[static_cast<size_t>(i - opt.warmup - 1)];
    t.phase = PhaseTimer::seconds();
    t.cpu = PhaseTimer::cpu_seconds();
  }
};

// The warm-up and timed steps on fresh random ids (labels: the ids shifted by one), phases timed
// with the backend's events: stream time, whatever the backend's asynchrony. One step per call,
// so that `bench --versus` can alternate two configurations' steps.
class StepLoop {
 public:
  StepLoop(const Config& config, const BenchOptions& opt, Trainer& trainer, Backend& ops, Communicator& world,
           ProcessGroups* groups)
      : ops_(ops),
        B_(trainer.local_batch()),
        S_(config.train.seq_len),
        rng_(config.train.seed),
        dist_(0, static_cast<int32_t>(config.model.vocab_size - 1)),
        row_(static_cast<size_t>(S_ + 1)),
        ids_(DType::kI32, {B_, S_}),
        labels_(DType::kI32, {B_, S_}),
        steps_{trainer, ops, world, groups, opt, config.train.overlap_host,
               std::vector<TimedStep>(static_cast<size_t>(opt.steps)), {}},
        clock_{&ops, [](void* b) { return static_cast<Backend*>(b)->record().seq; },
               [](void* b) { static_cast<Backend*>(b)->synchronize(); },
               [](void* b, uint64_t from, uint64_t to) {
                 return static_cast<Backend*>(b)->elapsed_seconds(Event{from}, Event{to});
               }} {
    // Room for every layer's load, so recording a step allocates nothing (the allocation count).
    for (TimedStep& t : steps_.timed) t.max_load.reserve(static_cast<size_t>(config.model.n_layers));
  }

  // Step i (1-based: warm-up steps first) on fresh ids.
  void step(int64_t i, BenchResult& r) {
    PhaseTimer::set_clock(&clock_);
    struct Unset {
      ~Unset() { PhaseTimer::set_clock(nullptr); }  // also when a step throws
    } unset;
#ifdef MOE_WITH_CUDA
    // Which implementation the timed steps' grouped GEMMs and attention took (the step table says).
    if (ops_.device() == Device::kCuda && i == steps_.opt.warmup + 1) paths_before_ = cuda_paths(ops_);
#endif
    // Fresh random ids each step (outside the phases); labels are the ids shifted by one.
    for (int64_t b = 0; b < B_; ++b) {
      for (auto& x : row_) x = dist_(rng_);
      std::copy(row_.begin(), row_.end() - 1, ids_.t.as<int32_t>() + b * S_);
      std::copy(row_.begin() + 1, row_.end(), labels_.t.as<int32_t>() + b * S_);
    }
    steps_.run(i, ids_, labels_, r);
    last_ = i;
  }

  // Reads the step still in flight (train.overlap_host), if any: before the other configuration's
  // step (bench --versus), and after the last.
  void drain() {
    if (steps_.overlap_host) steps_.record(steps_.trainer.collect(), last_);
  }

  // After the last step: the timed steps' records and the last step's tokens per expert.
  std::vector<TimedStep> finish(BenchResult& r, std::vector<std::vector<int32_t>>& last_counts) {
    drain();
#ifdef MOE_WITH_CUDA
    if (ops_.device() == Device::kCuda) r.kernel_paths = cuda_paths_text(cuda_paths(ops_) - paths_before_);
#else
    (void)r;
#endif
    last_counts = std::move(steps_.last_counts);
    return std::move(steps_.timed);
  }

 private:
  Backend& ops_;
  int64_t B_, S_;
  std::mt19937_64 rng_;
  std::uniform_int_distribution<int32_t> dist_;
  std::vector<int32_t> row_;
  OwnedTensor ids_, labels_;
  BenchSteps steps_;
  PhaseClock clock_;
  int64_t last_ = 0;
#ifdef MOE_WITH_CUDA
  CudaPaths paths_before_;
#endif
};

}  // namespace

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

namespace {

// The timed steps' times, phases and counters as means per step (the median step time too).
void summarize_steps(const std::vector<TimedStep>& timed_steps, const BenchOptions& opt, BenchResult& r) {
  std::array<double, PhaseTimer::kNum> sums{}, cpu_sums{};
  double step_sum = 0;
  for (const TimedStep& t : timed_steps) {
    MOE_CHECK(t.step_s >= 0, "bench: a timed step's record was never read");
    const size_t opt_phase = static_cast<size_t>(Phase::kOptimizer);
    r.step_s.push_back(t.step_s);
    r.fwd_bwd_s.push_back(t.step_s - t.phase[opt_phase]);
    double cpu = 0;
    for (double c : t.cpu) cpu += c;
    r.cpu_s.push_back(cpu);
    r.cpu_fwd_bwd_s.push_back(cpu - t.cpu[opt_phase]);
    r.pp_bubble_s += t.bubble;
    step_sum += t.step_s;
    for (size_t p = 0; p < static_cast<size_t>(PhaseTimer::kNum); ++p) {
      sums[p] += t.phase[p];
      cpu_sums[p] += t.cpu[p];
    }
  }
  r.comm_bytes_per_step /= static_cast<double>(opt.steps);
  r.pp_bubble_s /= static_cast<double>(opt.steps);
  for (double* x : {&r.to_host_per_step, &r.to_host_bytes_per_step, &r.to_device_per_step, &r.to_device_bytes_per_step})
    *x /= static_cast<double>(opt.steps);
  for (size_t k = 0; k < OpTimes::kOps; ++k) {
    r.op_times.seconds[k] /= static_cast<double>(opt.steps);
    r.op_times.calls[k] /= static_cast<double>(opt.steps);
  }
  PhaseTimer::set_thread_alloc_reader(nullptr);
  if (!opt.thread_alloc_reader) r.dnnl_allocs_per_step = -1;
  if (r.alloc_steps > 0) {
    r.allocs_per_step /= static_cast<double>(r.alloc_steps);
    if (opt.thread_alloc_reader) r.dnnl_allocs_per_step /= static_cast<double>(r.alloc_steps);
    for (double& a : r.phase_allocs) a /= static_cast<double>(r.alloc_steps);
  }

  const double n = static_cast<double>(r.step_s.size());
  r.median_step_s = median(r.step_s);
  r.mean_step_s = step_sum / n;
  for (int p = 0; p < PhaseTimer::kNum; ++p) {
    r.phase_s[static_cast<size_t>(p)] = sums[static_cast<size_t>(p)] / n;
    r.phase_cpu_s[static_cast<size_t>(p)] = cpu_sums[static_cast<size_t>(p)] / n;
    r.phase_sum_s += r.phase_s[static_cast<size_t>(p)];
  }
  r.phase_error = std::abs(r.phase_sum_s - r.mean_step_s) / r.mean_step_s;
  // Each MoE layer's load: the median over the timed steps.
  for (size_t l = 0; l < timed_steps.front().max_load.size(); ++l) {
    std::vector<double> v;
    for (const TimedStep& t : timed_steps)
      if (l < t.max_load.size()) v.push_back(t.max_load[l]);
    r.max_load.push_back(median(std::move(v)));
  }
}
}  // namespace

namespace {
// One configuration's bench in this process: its backend, device groups and trainer, its step
// loop and its result. Members in construction order: the trainer goes before its backend.
struct Arm {
  Config config;
  std::unique_ptr<Backend> ops;
  std::unique_ptr<DeviceGroups> nccl;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<StepLoop> loop;
  BenchResult r;
  std::vector<std::vector<int32_t>> last_counts;  // the last step's tokens per expert (--alone)
};

// --ops times the wall time around each call: only a backend whose calls are synchronous.
void check_ops_backend(const Config& config, const BenchOptions& opt) {
  MOE_CHECK(!opt.ops || config.train.backend == "cpu", "bench --ops: per-op times need train.backend = \"cpu\" ",
            "(its calls are synchronous), not \"", config.train.backend, "\"");
}

// Checks the run's options and applies train.threads (as `moecore train` does): the thread count
// the peak is measured at is the one the steps run on.
void start_bench(const Config& config, const BenchOptions& opt) {
  MOE_CHECK(opt.warmup >= 0 && opt.steps >= 1, "bench: --warmup must be >= 0 and --steps >= 1");
  check_ops_backend(config, opt);
  if (config.train.threads > 0) cpu::set_num_threads(static_cast<int>(config.train.threads));
  PhaseTimer::set_thread_alloc_reader(opt.thread_alloc_reader);
}

// A configuration's trainer (its construction timed: the setup line) and step loop.
std::unique_ptr<Arm> make_arm(const Config& config_in, const BenchOptions& opt, Communicator& world,
                              ProcessGroups* groups) {
  auto a = std::make_unique<Arm>();
  a->config = config_in;
  // Schedule length covers the run so the LR never hits a degenerate point.
  a->config.train.steps = std::max(config_in.train.steps, opt.warmup + opt.steps);
  const Config& config = a->config;
  validate_layout(layout_from_config(config.parallel), world.size(), config.model.num_experts, config.model.n_layers);
  a->ops = make_backend(config.train.backend);
  a->ops->set_deterministic_attention(config.train.deterministic_attention);
  // parallel.communicator = "nccl": tensors go over NCCL groups of the same ranks.
  a->nccl = device_groups(config.parallel.communicator, groups, *a->ops);
  const auto setup_start = std::chrono::steady_clock::now();
  a->trainer = std::make_unique<Trainer>(config, *a->ops, DType::kF32, a->nccl ? &a->nccl->groups : groups);
  a->ops->synchronize();
  BenchResult& r = a->r;
  r.setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
  r.params = a->trainer->model().layout().total();  // this rank's (padding included)
  r.host_threads = cpu::num_threads();
  r.tokens_per_step = config.train.batch_size * config.train.seq_len;  // the global step
  r.ranks = world.size();
  a->loop = std::make_unique<StepLoop>(config, opt, *a->trainer, *a->ops, world, groups);
  return a;
}

// After the last step: the rates, each phase's model FLOPs, MFU (against the cached peak and one
// measured after every step: `now`, measured here if the run has not yet), peak memory.
void finish_arm(Arm& a, const BenchOptions& opt, Communicator& world, std::optional<cpu::FmaPeak>& now) {
  const Config& config = a.config;
  BenchResult& r = a.r;
  summarize_steps(a.loop->finish(r, a.last_counts), opt, r);
  r.tokens_per_s = static_cast<double>(r.tokens_per_step) / r.median_step_s;
  r.flops_per_token = config.model.train_flops_per_token(config.train.seq_len);
  r.tflops = r.tokens_per_s * r.flops_per_token * 1e-12;
  if (r.ranks == 1) {  // (a rank of a layout computes a share that depends on it: not split)
    const ModelConfig::TrainFlops f = config.model.train_flops_by_part(config.train.seq_len);
    const double tokens = static_cast<double>(r.tokens_per_step);
    r.phase_flops[static_cast<size_t>(Phase::kAttention)] = f.attention * tokens;
    r.phase_flops[static_cast<size_t>(Phase::kRouter)] = f.router * tokens;
    r.phase_flops[static_cast<size_t>(Phase::kExpertGemm)] = f.experts * tokens;
    r.phase_flops[static_cast<size_t>(Phase::kLmHeadLoss)] = f.lm_head * tokens;
    r.phase_flops[static_cast<size_t>(Phase::kOther)] = f.dense_ffn * tokens;
  }
  r.peak = mfu_peak(config, &world);
  r.mfu = r.peak.mfu(r.tflops);
  if (r.ranks == 1 && r.peak.source == "measured") {
    if (!now) now = cpu::measure_fma_peak(cpu::num_threads());  // once a run: both arms' steps are done
    r.peak_now_tflops = (config.train.precision != "fp32" ? now->bf16_flops : now->fp32_flops) * 1e-12;
    r.mfu_now = r.peak_now_tflops > 0 ? r.tflops / r.peak_now_tflops : 0.0;
  }
  // Peak memory before --alone: the kernels' operands are not the step's.
  r.peak_rss_bytes = peak_rss_bytes();
  r.peak_device_mb = peak_device_mb();
  r.estimate_mb = estimate_memory(config).total() / (1024.0 * 1024.0);
}
}  // namespace

BenchResult run_bench(const Config& config, const BenchOptions& opt) {
  start_bench(config, opt);
  // Under mpirun every rank benches its share of the step; rank 0 prints (main.cpp).
  std::unique_ptr<Communicator> world = launch_world();
  check_ranks_agree(config, *world, /*with_data_files=*/false);  // bench reads no data
  const Layout layout = layout_from_config(config.parallel);
  validate_layout(layout, world->size(), config.model.num_experts, config.model.n_layers);
  std::unique_ptr<ProcessGroups> groups;
  if (world->size() > 1) groups = std::make_unique<ProcessGroups>(make_process_groups(*world, layout));
  const std::unique_ptr<Arm> arm = make_arm(config, opt, *world, groups.get());
  for (int64_t i = 1; i <= opt.warmup + opt.steps; ++i) arm->loop->step(i, arm->r);
  std::optional<cpu::FmaPeak> now;
  finish_arm(*arm, opt, *world, now);
  BenchResult& r = arm->r;
  if (opt.alone)
    r.alone = r.ranks == 1 ? time_kernels_alone(arm->config, *arm->ops, arm->last_counts)
                           : KernelsAlone{{}, "one process only"};
  return std::move(r);
}

VersusResult run_bench_versus(const Config& a, const Config& b, const BenchOptions& opt) {
  MOE_CHECK(!opt.alone, "bench --versus: --alone times one configuration's kernels after its steps; run it "
            "without --versus");
  check_ops_backend(b, opt);  // each configuration's steps time their own ops (--ops)
  MOE_CHECK(a.train.threads == b.train.threads, "bench --versus: train.threads is the process's, the same for both "
            "configurations (", a.train.threads, " and ", b.train.threads, ")");
  start_bench(a, opt);
  std::unique_ptr<Communicator> world = launch_world();
  MOE_CHECK(world->size() == 1, "bench --versus: one process runs both configurations, not ", world->size(),
            " ranks under mpirun");
  const std::unique_ptr<Arm> arm_a = make_arm(a, opt, *world, nullptr), arm_b = make_arm(b, opt, *world, nullptr);
  // A B, B A, A B, ...: each pair back to back, neither always first (a step can warm the
  // caches or the clock for the next).
  for (int64_t i = 1; i <= opt.warmup + opt.steps; ++i) {
    Arm* order[2] = {arm_a.get(), arm_b.get()};
    if (i % 2 == 0) std::swap(order[0], order[1]);
    for (Arm* arm : order) {
      arm->loop->step(i, arm->r);
      arm->loop->drain();  // this step's record read before the other configuration's step
    }
  }
  std::optional<cpu::FmaPeak> now;
  finish_arm(*arm_a, opt, *world, now);
  finish_arm(*arm_b, opt, *world, now);
  return {std::move(arm_a->r), std::move(arm_b->r)};
}

}  // namespace moe
