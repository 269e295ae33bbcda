#include "train/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iomanip>
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

// The median of v (the mean of the middle two for an even count).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

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

// Checks the run's options and applies train.threads (as `moecore train` does): the thread count
// the peak is measured at is the one the steps run on.
void start_bench(const Config& config, const BenchOptions& opt) {
  MOE_CHECK(opt.warmup >= 0 && opt.steps >= 1, "bench: --warmup must be >= 0 and --steps >= 1");
  MOE_CHECK(!opt.ops || config.train.backend == "cpu", "bench --ops: per-op times need train.backend = \"cpu\" ",
            "(its calls are synchronous), not \"", config.train.backend, "\"");
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
  MOE_CHECK(!opt.ops && !opt.alone, "bench --versus: --ops and --alone describe one configuration's steps; "
            "run them without --versus");
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

namespace {
// What the grouped GEMMs were timed on: a router that sends every token to the same top_k
// experts (load num_experts / top_k) leaves them top_k dense GEMMs, which run faster than the
// num_experts smaller ones of an even load. The bench's random ids and a high learning rate head
// there within a few steps (olmoe_compat's default steps: 5-8 of a possible 8; PyTorch's OLMoE on
// the same ids: 7.7-8 by its eighth step).
void print_expert_load(const Config& config, const BenchResult& r, std::ostream& os) {
  if (r.max_load.empty()) return;
  const ModelConfig& m = config.model;
  const double collapsed = static_cast<double>(m.num_experts) / static_cast<double>(m.top_k);
  double worst = 0;
  os << std::setprecision(2) << "expert load (tokens of the busiest expert / the mean, median of the timed steps, "
     << "per MoE layer):";
  for (double l : r.max_load) os << " " << l, worst = std::max(worst, l);
  os << " (1 = even; " << collapsed << " = every token on the same " << m.top_k << " of " << m.num_experts
     << " experts)\n";
  if (worst >= 0.9 * collapsed)
    os << "  a router near collapse: a layer sent nearly every token to the same " << m.top_k
       << " experts, whose grouped GEMMs then run about as " << m.top_k << " dense ones (an even load's "
       << m.num_experts << " smaller ones run slower)\n";
}

// With --ops: every op that ran, longest first (the phases above group several of them).
void print_op_times(const BenchResult& r, std::ostream& os) {
  std::vector<size_t> ran;
  double total = 0;
  for (size_t k = 0; k < OpTimes::kOps; ++k)
    if (r.op_times.calls[k] > 0) ran.push_back(k), total += r.op_times.seconds[k];
  if (ran.empty()) return;
  std::sort(ran.begin(), ran.end(),
            [&](size_t a, size_t b) { return r.op_times.seconds[a] > r.op_times.seconds[b]; });
  os << "ops (mean per timed step, wall time inside each cpu backend call; " << std::setprecision(1)
     << 100 * total / r.mean_step_s << "% of the step):\n";
  os << "  op                           ms/step  calls/step  % of step\n";
  for (const size_t k : ran)
    os << "  " << std::left << std::setw(27) << op_name(static_cast<OpId>(k)) << std::right << std::setw(10)
       << std::setprecision(2) << r.op_times.seconds[k] * 1e3 << std::setw(12) << std::setprecision(1)
       << r.op_times.calls[k] << std::setw(11) << 100 * r.op_times.seconds[k] / r.mean_step_s << "\n";
}
}  // namespace

void print_bench(const Config& config, const BenchResult& r, std::ostream& os) {
  const auto flags = os.flags();
  os << std::fixed;
  os << "precision " << config.train.precision << ", " << r.tokens_per_step << " tokens/step ("
     << config.train.batch_size << " x " << config.train.seq_len << ", micro-batch " << config.train.micro_batch_size
     << "), " << r.step_s.size() << " timed steps\n";
  os << std::setprecision(4) << "step time: median " << r.median_step_s << " s, mean " << r.mean_step_s << " s\n";
  os << std::setprecision(3) << "step times (s):";
  for (double t : r.step_s) os << " " << t;
  // Forward + backward of all micro-batches: each step less its optimizer phase (grad norm,
  // clipping, AdamW, bf16 refresh). Per step, so a noisy machine's best step can be picked.
  os << "\nfwd+bwd times (s):";
  for (double t : r.fwd_bwd_s) os << " " << t;
  // CPU seconds of all threads: robust to other processes on the cores (see phase_timer.h).
  os << "\ncpu times (s):";
  for (double t : r.cpu_s) os << " " << t;
  os << "\ncpu fwd+bwd times (s):";
  for (double t : r.cpu_fwd_bwd_s) os << " " << t;
  // The wait policy moves both: passive wakes a sleeping thread at each parallel region (wall
  // time, ~10% of a fine_grained bf16 step), the default's spinning counts as CPU time.
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  os << "\nOMP_WAIT_POLICY: "
     << (wait && *wait ? wait : "unset (the OpenMP runtime's default: waiting threads spin a while, then sleep)")
     << "\n";
  os << std::setprecision(0) << "tokens/s (median): " << r.tokens_per_s << "\n";
  print_expert_load(config, r, os);
  if (r.ranks > 1)
    os << "ranks: " << r.ranks << " (rank 0's phases; communication = time blocked in collectives), "
       << std::setprecision(2) << r.comm_bytes_per_step / 1e6 << " MB sent per step by rank 0\n";
  if (config.parallel.pp > 1)
    os << std::setprecision(4) << "pipeline bubble (rank 0, blocked in receives): " << r.pp_bubble_s << " s per step\n";
  os << std::setprecision(2) << "model FLOPs/token (causal): " << r.flops_per_token * 1e-6 << " M\n";
  os << std::setprecision(1) << "model GFLOP/s: " << r.tflops * 1e3 << "  MFU: " << r.mfu * 100 << "% of "
     << r.peak.tflops * 1e3 << " GFLOP/s (" << r.peak.source << ": " << r.peak.detail << ")\n";
  if (r.peak_now_tflops > 0)
    os << "MFU against the peak measured right after the timed steps: " << r.mfu_now * 100 << "% of "
       << r.peak_now_tflops * 1e3 << " GFLOP/s (this machine's speed as the steps ran; the line above "
       << "divides by the best measured here)\n";
  os << "phase breakdown (mean per timed step, exclusive):\n";
  double alone_total = 0;
  for (double a : r.alone.seconds) alone_total += a;
  const bool alone = alone_total > 0;
  os << "  phase          ms/step      %  cpu ms/step" << (r.alloc_steps > 0 ? "   allocs/step" : "")
     << (r.ranks == 1 ? "   GFLOP/s  % of peak" : "") << (alone ? "  alone GFLOP/s  of alone" : "") << "\n";
  for (int p = 1; p <= PhaseTimer::kNum; ++p) {
    const int idx = p % PhaseTimer::kNum;  // "other" last
    const double s = r.phase_s[static_cast<size_t>(idx)];
    os << "  " << std::left << std::setw(13) << phase_name(static_cast<Phase>(idx)) << std::right
       << std::setw(9) << std::setprecision(2) << s * 1e3 << std::setw(8) << std::setprecision(1)
       << 100 * s / r.mean_step_s << std::setw(13) << std::setprecision(2)
       << r.phase_cpu_s[static_cast<size_t>(idx)] * 1e3;
    if (r.alloc_steps > 0) os << std::setw(14) << r.phase_allocs[static_cast<size_t>(idx)];
    // Model FLOPs over the phase's time: where the step falls short of the peak (the attention
    // phase's include the causal products).
    const double flops = r.phase_flops[static_cast<size_t>(idx)];
    if (flops > 0 && s > 0)
      os << std::setw(10) << std::setprecision(1) << flops / s * 1e-9 << std::setw(11)
         << (r.peak.tflops > 0 ? 100 * flops / s / (r.peak.tflops * 1e12) : 0.0);
    // The same FLOPs over the time the phase's kernels take alone, and the share of that rate the
    // phase reached.
    const double a = r.alone.seconds[static_cast<size_t>(idx)];
    if (alone && a > 0 && flops > 0 && s > 0)
      os << std::setw(15) << std::setprecision(1) << flops / a * 1e-9 << std::setw(9) << std::setprecision(0)
         << 100 * a / s << "%";
    os << "\n";
  }
  os << std::setprecision(2) << "  sum           " << std::setw(9) << r.phase_sum_s * 1e3 << "  vs step " << r.mean_step_s * 1e3
     << " ms: " << r.phase_error * 100 << "% " << (r.phase_error <= 0.03 ? "(within 3%: ok)" : "(MORE THAN 3%)") << "\n";
  if (alone) {
    double phases = 0;
    for (size_t p = 0; p < r.alone.seconds.size(); ++p)
      if (r.alone.seconds[p] > 0) phases += r.phase_s[p];
    os << std::setprecision(1) << "kernels alone (--alone): each phase's GEMMs and attention kernels at the step's "
       << "shapes and expert loads, after the steps, each the median of 5 rounds: " << alone_total * 1e3
       << " ms per step against those phases' " << phases * 1e3 << " ms (" << std::setprecision(0)
       << 100 * alone_total / phases << "%)\n";
  } else if (!r.alone.not_measured.empty()) {
    os << "kernels alone (--alone): not measured (" << r.alone.not_measured << ")\n";
  }
  print_op_times(r, os);
  if (r.alloc_steps > 0)
    os << std::setprecision(1) << "heap allocations per step (operator new, steps 3-" << 2 + r.alloc_steps
       << "): " << r.allocs_per_step << "\n";
  if (r.alloc_steps > 0 && r.dnnl_allocs_per_step >= 0)
    os << "  inside oneDNN primitive execution: " << r.dnnl_allocs_per_step
       << "\n  outside oneDNN: " << r.allocs_per_step - r.dnnl_allocs_per_step << "\n";
  if (r.alloc_steps == 0)
    os << "heap allocations: not counted (no counter installed)\n";
  os << std::setprecision(1) << "host <-> device transfers per step (" << config.train.backend << " backend): "
     << r.to_host_per_step << " to host (" << std::setprecision(0) << r.to_host_bytes_per_step << " bytes), "
     << std::setprecision(1) << r.to_device_per_step << " to device (" << std::setprecision(0)
     << r.to_device_bytes_per_step << " bytes)\n";
  if (!r.kernel_paths.empty()) os << "kernel paths (calls in the timed steps): " << r.kernel_paths << "\n";
  if (r.setup_s > 0)
    os << std::setprecision(2) << "setup: " << r.setup_s << " s (allocation, parameter init of " << r.params
       << " parameters on " << r.host_threads << (r.host_threads == 1 ? " host thread" : " host threads") << ", plans)\n";
  os << std::setprecision(1) << "peak RSS: " << static_cast<double>(r.peak_rss_bytes) / (1 << 20) << " MiB\n";
  if (r.peak_device_mb > 0)
    os << "peak device memory: " << r.peak_device_mb << " MiB (estimate " << r.estimate_mb << " MiB + the backend's "
       << "fixed scratch and workspace: " << std::setprecision(0) << 100 * r.peak_device_mb / r.estimate_mb << "%)\n";
  os.flags(flags);
}

namespace {
// B's time per token over A's, less one, for each pair of timed steps: the median, min and max.
struct PairedChange {
  double median = 0, min = 0, max = 0;
};
PairedChange paired_change(const std::vector<double>& a, const std::vector<double>& b, double a_tokens, double b_tokens) {
  std::vector<double> change;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) change.push_back((b[i] / b_tokens) / (a[i] / a_tokens) - 1);
  const auto [lo, hi] = std::minmax_element(change.begin(), change.end());
  return {median(change), *lo, *hi};
}
}  // namespace

void print_versus(const Config& a, const Config& b, const std::string& b_is, const VersusResult& r, std::ostream& os) {
  os << "== A: the configuration ==\n";
  print_bench(a, r.a, os);
  os << "== B: the configuration with " << b_is << " ==\n";
  print_bench(b, r.b, os);
  const auto flags = os.flags();
  const double ta = static_cast<double>(r.a.tokens_per_step), tb = static_cast<double>(r.b.tokens_per_step);
  os << "versus: B against A, each timed step paired with the other configuration's step of the same number, run "
     << "back to back (A B, B A, A B, ...: a machine whose speed drifts moves both); time per token, B / A - 1, the "
     << "median (min .. max) over " << std::min(r.a.step_s.size(), r.b.step_s.size()) << " pairs:\n"
     << std::fixed << std::showpos << std::setprecision(1);
  const struct {
    const char* name;
    const std::vector<double>& a;
    const std::vector<double>& b;
  } rows[] = {{"step (wall)", r.a.step_s, r.b.step_s},
              {"fwd+bwd (wall)", r.a.fwd_bwd_s, r.b.fwd_bwd_s},
              {"step (cpu)", r.a.cpu_s, r.b.cpu_s},
              {"fwd+bwd (cpu)", r.a.cpu_fwd_bwd_s, r.b.cpu_fwd_bwd_s}};
  for (const auto& row : rows) {
    const PairedChange c = paired_change(row.a, row.b, ta, tb);
    os << "  " << std::left << std::setw(16) << row.name << std::right << std::setw(7) << 100 * c.median << "%  ("
       << 100 * c.min << " .. " << 100 * c.max << ")\n";
  }
  // Where the difference goes: each phase's mean per token (means, not pairs: noisier), its
  // change as a share of A's step per token.
  os << "by phase: A -> B, ms per timed step (mean), and B - A per token as % of A's step per token:\n";
  for (int p = 1; p <= PhaseTimer::kNum; ++p) {
    const size_t idx = static_cast<size_t>(p % PhaseTimer::kNum);  // "other" last
    const double sa = r.a.phase_s[idx], sb = r.b.phase_s[idx];
    if (sa < 5e-5 && sb < 5e-5) continue;  // under 0.05 ms in both: not printed
    os << "  " << std::left << std::setw(14) << phase_name(static_cast<Phase>(idx)) << std::right << std::noshowpos
       << std::setw(9) << sa * 1e3 << " ->" << std::setw(9) << sb * 1e3 << std::showpos << std::setw(8)
       << 100 * (sb / tb - sa / ta) / (r.a.mean_step_s / ta) << "%\n";
  }
  os << std::noshowpos << "peak RSS above: the process's, both configurations together\n";
  os.flags(flags);
}

}  // namespace moe
