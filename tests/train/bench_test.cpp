// moecore bench on a tiny config: the phase rows sum to the step time and every MoE phase runs.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli_util.h"
#include "common/paths.h"
#include "config/config.h"
#include "kernels/cpu/cpu_ops.h"
#include "train/bench.h"

namespace moe {
namespace {

// 2 layers of attention and 4 experts top-2, 2 micro-batches of 2 x 32 tokens.
Config tiny_moe_config() {
  return parse_config(R"(
[model]
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
num_experts = 4
top_k = 2
expert_hidden = 32
[optim]
warmup_steps = 2
[train]
seq_len = 32
batch_size = 4
micro_batch_size = 2
steps = 10
)", {}, "bench test config");
}

// A short bench: one warm-up step, then `steps` timed ones.
BenchOptions short_bench(int64_t steps) {
  BenchOptions o;
  o.warmup = 1;
  o.steps = steps;
  return o;
}

TEST(Bench, PhasesSumToStepTimeAndMoePhasesAreNonZero) {
  const Config c = tiny_moe_config();
  const BenchResult r = run_bench(c, short_bench(3));
  ASSERT_EQ(r.step_s.size(), 3u);
  EXPECT_GT(r.tokens_per_s, 0);
  EXPECT_LE(r.phase_error, 0.03) << "phases " << r.phase_sum_s << " s vs step " << r.mean_step_s << " s";
  for (Phase p : {Phase::kAttention, Phase::kRouter, Phase::kPermute, Phase::kExpertGemm, Phase::kCombine,
                  Phase::kLmHeadLoss, Phase::kOptimizer})
    EXPECT_GT(r.phase_s[static_cast<size_t>(p)], 0.0) << phase_name(p);
  // Each MoE layer's load, the busiest expert's tokens over the mean: between even (1) and
  // every token on the same top_k experts (num_experts / top_k = 2).
  ASSERT_EQ(r.max_load.size(), 2u);
  for (double l : r.max_load) {
    EXPECT_GE(l, 1.0);
    EXPECT_LE(l, 2.0);
  }
  std::ostringstream printed;
  print_bench(c, r, printed);
  EXPECT_NE(printed.str().find("expert load (tokens of the busiest expert / the mean"), std::string::npos);
  EXPECT_EQ(r.alloc_steps, 0);  // no counter installed in the test binary
  EXPECT_FALSE(PhaseTimer::enabled());  // bench leaves the profiler off
  // The phases' model FLOPs are the step's (no dense layer here: none in "other").
  double flops = 0;
  for (double f : r.phase_flops) flops += f;
  EXPECT_NEAR(flops, r.flops_per_token * static_cast<double>(r.tokens_per_step), 1e-9 * flops);
  for (Phase p : {Phase::kAttention, Phase::kRouter, Phase::kExpertGemm, Phase::kLmHeadLoss})
    EXPECT_GT(r.phase_flops[static_cast<size_t>(p)], 0.0) << phase_name(p);
  EXPECT_EQ(r.phase_flops[static_cast<size_t>(Phase::kOther)], 0.0);
}

// train.threads is the thread count the steps run on, as in `moecore train` (bench once ran on
// every core and divided by the peak of train.threads: 114% MFU at train.threads = 1).
TEST(Bench, RunsOnTrainThreads) {
  const int saved = cpu::num_threads();
  Config c = tiny_moe_config();
  c.train.threads = 1;
  const BenchResult r = run_bench(c, short_bench(1));
  EXPECT_EQ(r.host_threads, 1);
  EXPECT_EQ(cpu::num_threads(), 1);
  cpu::set_num_threads(saved);
}

// --versus: two configurations' steps alternated in one process. Each runs the steps it would
// run alone (the same ids, the same routing: the per-layer loads are equal), and the paired line
// is each pair's time per token, B over A.
TEST(Bench, VersusAlternatesTwoConfigurationsThatRunAsAlone) {
  const Config a = tiny_moe_config();
  Config b = a;
  b.model.num_experts = 8;
  const BenchOptions o = short_bench(3);
  const VersusResult v = run_bench_versus(a, b, o);
  const BenchResult alone_a = run_bench(a, o), alone_b = run_bench(b, o);
  ASSERT_EQ(v.a.step_s.size(), 3u);
  ASSERT_EQ(v.b.step_s.size(), 3u);
  EXPECT_EQ(v.a.max_load, alone_a.max_load);
  EXPECT_EQ(v.b.max_load, alone_b.max_load);
  EXPECT_GT(v.b.params, v.a.params);
  for (const BenchResult* r : {&v.a, &v.b}) EXPECT_LE(r->phase_error, 0.03);
  std::ostringstream printed;
  print_versus(a, b, "model.num_experts=8", v, printed);
  const std::string out = printed.str();
  EXPECT_NE(out.find("== B: the configuration with model.num_experts=8 =="), std::string::npos) << out;
  std::vector<double> change;
  for (size_t i = 0; i < 3; ++i) change.push_back(100 * (v.b.step_s[i] / v.a.step_s[i] - 1));
  std::sort(change.begin(), change.end());
  char want[64];
  std::snprintf(want, sizeof want, "%+.1f%%  (%+.1f .. %+.1f)", change[1], change[0], change[2]);
  const size_t at = out.find("  step (wall)");
  ASSERT_NE(at, std::string::npos) << out;
  EXPECT_NE(out.substr(at, out.find('\n', at) - at).find(want), std::string::npos) << out.substr(at, 80) << " vs " << want;
  for (const char* row : {"fwd+bwd (wall)", "step (cpu)", "fwd+bwd (cpu)"})
    EXPECT_NE(out.find(row), std::string::npos) << row;
  // By phase: A's and B's means, and the change per token as a share of A's step.
  const size_t router = out.find("  router ", out.find("by phase: A -> B"));
  ASSERT_NE(router, std::string::npos) << out;
  const size_t r_idx = static_cast<size_t>(Phase::kRouter);
  std::snprintf(want, sizeof want, "%.1f ->", v.a.phase_s[r_idx] * 1e3);
  EXPECT_NE(out.substr(router, 60).find(want), std::string::npos) << out.substr(router, 60) << " vs " << want;
  std::snprintf(want, sizeof want, "%+.1f%%", 100 * (v.b.phase_s[r_idx] - v.a.phase_s[r_idx]) / v.a.mean_step_s);
  EXPECT_NE(out.substr(router, 60).find(want), std::string::npos) << out.substr(router, 60) << " vs " << want;
  // What it cannot compare is an error naming the option.
  BenchOptions alone = o;
  alone.alone = true;
  EXPECT_THROW(
      try { run_bench_versus(a, b, alone); } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("--alone"), std::string::npos) << e.what();
        throw;
      },
      Error);
  Config one_thread = b;
  one_thread.train.threads = 1;
  EXPECT_THROW(
      try { run_bench_versus(a, one_thread, o); } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("train.threads"), std::string::npos) << e.what();
        throw;
      },
      Error);
}

// --versus with --ops: each configuration's steps time their own ops, and the printout sets each
// op's mean in A beside B's with its change per token as a share of A's step.
TEST(Bench, VersusWithOpsComparesEachOp) {
  const Config a = tiny_moe_config();
  Config b = a;
  b.model.num_experts = 8;
  BenchOptions o = short_bench(2);
  o.ops = true;
  const VersusResult v = run_bench_versus(a, b, o);
  const auto at = [](OpId op) { return static_cast<size_t>(op); };
  for (const BenchResult* r : {&v.a, &v.b}) {  // per timed step, as alone (OpTimesNameTheOpsInsideTheStep)
    EXPECT_EQ(r->op_times.calls[at(OpId::grouped_linear_fwd)], 4.0 * 3);
    EXPECT_EQ(r->op_times.calls[at(OpId::cross_entropy)], 2.0);
    double total = 0;
    for (double s : r->op_times.seconds) total += s;
    EXPECT_GT(total, 0.0);
    EXPECT_LE(total, r->mean_step_s) << "the ops' time is inside the step's";
  }
  EXPECT_EQ(op_times_sink(), nullptr);
  std::ostringstream printed;
  print_versus(a, b, "model.num_experts=8", v, printed);
  const std::string out = printed.str();
  const size_t by_op = out.find("by op: A -> B");
  ASSERT_NE(by_op, std::string::npos) << out;
  // Every op that ran is listed under "by op" or counted as having moved less than 0.05%.
  const size_t k = at(OpId::grouped_linear_fwd);
  const double change = 100 * (v.b.op_times.seconds[k] - v.a.op_times.seconds[k]) / v.a.mean_step_s;
  const size_t row = out.find("  grouped_linear_fwd ", by_op);
  if (std::abs(change) >= 0.05) {
    ASSERT_NE(row, std::string::npos) << out;
    char want[64];
    std::snprintf(want, sizeof want, "%.1f ->", v.a.op_times.seconds[k] * 1e3);
    EXPECT_NE(out.substr(row, 70).find(want), std::string::npos) << out.substr(row, 70) << " vs " << want;
    std::snprintf(want, sizeof want, "%+.1f%%", change);
    EXPECT_NE(out.substr(row, 70).find(want), std::string::npos) << out.substr(row, 70) << " vs " << want;
  } else {
    EXPECT_NE(out.find("more ops moved less than 0.05% each", by_op), std::string::npos) << out;
  }
  Config strict = b;
  strict.train.backend = "strict";
  EXPECT_THROW(
      try { run_bench_versus(a, strict, o); } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("--ops"), std::string::npos) << e.what();
        throw;
      },
      Error);
}

// --ops: the wall time inside each cpu backend call of the timed steps, within the step's time.
TEST(Bench, OpTimesNameTheOpsInsideTheStep) {
  const Config c = tiny_moe_config();
  BenchOptions o = short_bench(2);
  o.ops = true;
  const BenchResult r = run_bench(c, o);
  const auto at = [](OpId op) { return static_cast<size_t>(op); };
  // Per timed step: 2 micro-batches x 2 layers of attention and MoE, one LM head each.
  EXPECT_EQ(r.op_times.calls[at(OpId::attention_fwd)], 4.0);
  EXPECT_EQ(r.op_times.calls[at(OpId::grouped_linear_fwd)], 4.0 * 3);
  EXPECT_EQ(r.op_times.calls[at(OpId::cross_entropy)], 2.0);
  double total = 0;
  for (double s : r.op_times.seconds) total += s;
  EXPECT_GT(total, 0.0);
  EXPECT_LE(total, r.mean_step_s) << "the ops' time is inside the step's";
  EXPECT_EQ(op_times_sink(), nullptr);  // bench leaves the op clock off
  std::ostringstream out;
  print_bench(c, r, out);
  EXPECT_NE(out.str().find("ops (mean per timed step"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("  grouped_linear_fwd "), std::string::npos) << out.str();
  Config strict = c;
  strict.train.backend = "strict";
  EXPECT_THROW(run_bench(strict, o), Error);
}

// --alone: each phase's kernels timed alone at the step's shapes, for the four phases that carry
// GEMMs or attention, and said so; a model the measurement does not cover is named, not measured.
TEST(Bench, KernelsAloneTimeThePhasesThatCarryGemmsAndAttention) {
  const Config c = tiny_moe_config();
  BenchOptions o = short_bench(2);
  o.alone = true;
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    Config cp = c;
    cp.train.precision = precision;
    const BenchResult r = run_bench(cp, o);
    EXPECT_EQ(r.alone.not_measured, "");
    for (int p = 0; p < PhaseTimer::kNum; ++p) {
      const Phase ph = static_cast<Phase>(p);
      const bool carries = ph == Phase::kAttention || ph == Phase::kRouter || ph == Phase::kExpertGemm ||
                           ph == Phase::kLmHeadLoss;
      if (carries) EXPECT_GT(r.alone.seconds[static_cast<size_t>(p)], 0.0) << phase_name(ph);
      else EXPECT_EQ(r.alone.seconds[static_cast<size_t>(p)], 0.0) << phase_name(ph);
    }
    std::ostringstream out;
    print_bench(cp, r, out);
    EXPECT_NE(out.str().find("alone GFLOP/s  of alone"), std::string::npos) << out.str();
    EXPECT_NE(out.str().find("kernels alone (--alone): each phase's GEMMs"), std::string::npos) << out.str();
  }
  Config shared = c;
  shared.model.shared_hidden = 32;
  const BenchResult r = run_bench(shared, o);
  EXPECT_EQ(r.alone.not_measured, "models without shared experts only");
  std::ostringstream out;
  print_bench(shared, r, out);
  EXPECT_NE(out.str().find("kernels alone (--alone): not measured (models without shared experts only)"),
            std::string::npos) << out.str();
}

// Runs `moecore bench` (the binary has the counting operator new) on a tiny config and returns
// {total, inside oneDNN} allocations per step over steps 3-10.
std::pair<double, double> binary_bench_allocs(const std::string& sets) {
  const test::CliResult r = test::run_cli(
      "bench --warmup 2 --steps 8 --set model.vocab_size=64 --set model.d_model=32"
      " --set model.n_layers=2 --set model.n_heads=4 --set model.n_kv_heads=2"
      " --set model.num_experts=4 --set model.top_k=2 --set model.expert_hidden=32"
      " --set optim.warmup_steps=2 --set train.micro_batch_size=2" + sets, 120);
  const std::string& out = r.output;
  EXPECT_EQ(r.status, 0) << out;
  std::smatch total, dnnl;
  if (!std::regex_search(out, total, std::regex(R"(heap allocations per step \(operator new, steps 3-10\): ([0-9.]+))")) ||
      !std::regex_search(out, dnnl, std::regex(R"(inside oneDNN primitive execution: ([0-9.]+))"))) {
    ADD_FAILURE() << "no allocation count in:\n" << out;  // e.g. a sanitizer build (no counter)
    return {-1, -1};
  }
  return {std::stod(total[1].str()), std::stod(dnnl[1].str())};
}

// Inside a step the only allocations left are oneDNN's own in its primitive execution (it copies
// its arguments into a std::unordered_map on every call, unavoidable through oneDNN 2.6's API):
// kernels, GEMM tiles, routing scratch, the pipeline schedule, the micro-batch views and the
// trainer's StepResult record are all reused.
TEST(Bench, NoAllocationsOutsideOneDnnPrimitiveExecution) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "sanitizer builds keep their own allocator (no counting operator new)";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "sanitizer builds keep their own allocator (no counting operator new)";
#endif
#endif
  for (const char* precision : {"fp32", "bf16", "mxfp8"}) {
    SCOPED_TRACE(precision);
    const std::string p = std::string(" --set train.precision=") + precision;
    const auto small = binary_bench_allocs(p + " --set train.seq_len=32 --set train.batch_size=4");
    const auto big = binary_bench_allocs(p + " --set train.seq_len=128 --set train.batch_size=8");
    EXPECT_GT(small.second, 0);  // the GEMMs ran through oneDNN and were attributed to it
    EXPECT_EQ(small.first - small.second, 0);
    EXPECT_EQ(big.first - big.second, 0);  // 8x the tokens, 4x the micro-batches
  }
}

// `moecore bench` with these options: its median tokens/s, MFU, and MFU against the peak measured
// right after its steps (fractions).
struct BenchRate {
  double tps = 0, mfu = 0, mfu_now = 0;
};
BenchRate binary_bench_rate(const std::string& sets) {
  const test::CliResult r = test::run_cli("bench --warmup 2 --steps 5" + sets, 120);
  const std::string& out = r.output;
  EXPECT_EQ(r.status, 0) << out;
  // (Plain string search: a second std::regex here trips g++ 12's -Wmaybe-uninitialized inside
  // <regex> in the sanitizer build.)
  const auto number_after = [&](const std::string& key) {
    const size_t at = out.find(key);
    return at == std::string::npos ? -1.0 : std::atof(out.c_str() + at + key.size());
  };
  const double tps = number_after("tokens/s (median): "), mfu = number_after("  MFU: ");
  const double now = number_after("MFU against the peak measured right after the timed steps: ");
  const bool named = out.find("GFLOP/s (measured: ") != std::string::npos || out.find("GFLOP/s (config: ") != std::string::npos ||
                     out.find("GFLOP/s (datasheet: ") != std::string::npos;
  if (tps < 0 || mfu < 0 || !named) {
    ADD_FAILURE() << "no tokens/s or MFU with its source in:\n" << out;
    return {};
  }
  return {tps, mfu / 100, now / 100};
}

// On an asynchronous backend (strict runs its calls on a worker thread, as a GPU does) a step's
// time is the stream's, from the backend's events: the host's clock around the enqueue gave
// 23,766,007 tokens/s and MFU 81,956% where cpu gave 36,363. strict does the cpu's work plus a
// copy of every batch, so it cannot be much faster; cpu runs twice around it and its faster run
// counts (noise only slows a run down). And no MFU exceeds 1: its peak is measured here, both the
// best on this machine and the one measured again right after the steps (host backends print both).
TEST(Bench, AnAsynchronousBackendIsTimedByItsStreamAndNoMfuExceedsOne) {
  const std::string sets = " --set model.n_layers=2";
  const BenchRate cpu1 = binary_bench_rate(sets);
  const BenchRate strict = binary_bench_rate(sets + " --set train.backend=strict");
  const BenchRate cpu2 = binary_bench_rate(sets);
  const double cpu = std::max(cpu1.tps, cpu2.tps);
  ASSERT_GT(cpu, 0);
  EXPECT_GT(strict.tps, 0);
  EXPECT_LE(strict.tps, 1.5 * cpu) << "strict " << strict.tps << " tokens/s against cpu's " << cpu;
  for (const BenchRate& b : {cpu1, strict, cpu2}) {
    EXPECT_GT(b.mfu, 0) << b.tps;
    EXPECT_LE(b.mfu, 1.0) << b.tps;
    EXPECT_GT(b.mfu_now, 0) << b.tps;
    EXPECT_LE(b.mfu_now, 1.0) << b.tps;
  }
}

// scripts/gpu_check.sh reads print_bench's text (scripts/gpu_check_lib.sh): each reader on what
// print_bench prints for a cuda run.
TEST(Bench, TheGpuCheckScriptReadsWhatPrintBenchPrints) {
  Config c;
  c.train.backend = "cuda";
  BenchResult r;
  r.tokens_per_step = 32768;
  r.step_s = {0.5, 0.4, 0.45};
  r.fwd_bwd_s = r.cpu_s = r.cpu_fwd_bwd_s = r.step_s;
  r.median_step_s = r.mean_step_s = 0.45;
  r.tokens_per_s = 72817.8;
  r.flops_per_token = 4.2484e9;
  r.tflops = 309.4;
  r.peak = MfuPeak{989.4, "datasheet", "dense bf16 989.4 TFLOP/s"};
  r.mfu = r.tflops / r.peak.tflops;
  r.peak_device_mb = 81234.5;
  r.estimate_mb = 80012.25;
  r.kernel_paths = "grouped GEMM: 96 CUTLASS, 0 SIMT; attention: 64 cuDNN, 0 ours";
  r.setup_s = 12.5;
  r.params = 3562604544;
  r.host_threads = 16;
  const std::string file = ::testing::TempDir() + "/bench_output.txt";
  {
    std::ofstream o(file);
    print_bench(c, r, o);
  }
  const auto read = [&](const std::string& reader) {
    const std::string cmd = "bash -c '. " + std::string(test::source_dir()) + "/scripts/gpu_check_lib.sh && " + reader +
                            " < " + file + "'";
    FILE* pipe = ::popen(cmd.c_str(), "r");
    std::string out;
    char buf[512];
    while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
    ::pclose(pipe);
    while (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  };
  EXPECT_EQ(read("bench_tokens_per_s"), "72818");
  EXPECT_EQ(read("bench_gflops"), "309400.0");
  EXPECT_EQ(read("bench_mfu"), "31.3");
  EXPECT_EQ(read("bench_peak"), "989400.0 GFLOP/s (datasheet: dense bf16 989.4 TFLOP/s)");
  EXPECT_EQ(read("bench_device_mib"), "81234.5");
  EXPECT_EQ(read("bench_estimate_mib"), "80012.2");
  EXPECT_EQ(read("bench_paths"), r.kernel_paths);
  EXPECT_EQ(read("bench_setup_s"), "12.50");
}

// The OpenMP wait policy moves the wall and CPU times: the bench names the one it ran under.
TEST(Bench, PrintsTheOpenMpWaitPolicy) {
  Config c;
  BenchResult r;
  r.tokens_per_step = 1024;
  r.step_s = r.fwd_bwd_s = r.cpu_s = r.cpu_fwd_bwd_s = {0.5};
  r.median_step_s = r.mean_step_s = 0.5;
  const char* was = std::getenv("OMP_WAIT_POLICY");
  const std::string saved = was ? was : "";
  auto printed = [&] {
    std::ostringstream o;
    print_bench(c, r, o);
    const std::string out = o.str(), key = "OMP_WAIT_POLICY: ";
    const size_t at = out.find(key);
    if (at == std::string::npos) return std::string("(none)");
    return out.substr(at + key.size(), out.find('\n', at) - at - key.size());
  };
  ::setenv("OMP_WAIT_POLICY", "passive", 1);
  EXPECT_EQ(printed(), "passive");
  ::unsetenv("OMP_WAIT_POLICY");
  EXPECT_EQ(printed().rfind("unset", 0), 0u) << printed();
  if (was) ::setenv("OMP_WAIT_POLICY", saved.c_str(), 1);
}

}  // namespace
}  // namespace moe
