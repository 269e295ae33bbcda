// Metrics: load statistics, the token-gerrymandering detector on synthetic series, the JSONL
// record, peak RSS, and the progress line's formatting.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "core/rng.h"
#include "kernels/cpu/fma_peak.h"
#include "train/metrics.h"

namespace moe {
namespace {

// Linear from a to b over n steps plus uniform noise in [-amp, amp] (Philox, fixed seed).
std::vector<double> series(double a, double b, int64_t n, double amp, uint64_t seed, uint64_t salt) {
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) {
    const double u = random_uniform(seed, static_cast<uint64_t>(RngStream::kTest),
                                    salt * 1000003 + static_cast<uint64_t>(i));
    v.push_back(a + (b - a) * static_cast<double>(i) / static_cast<double>(n - 1) + amp * (2 * u - 1));
  }
  return v;
}

int64_t count_warnings(const std::vector<double>& lbl, const std::vector<double>& load, int64_t window,
                       std::string* first = nullptr) {
  GerrymanderOptions o;
  o.window = window;
  GerrymanderDetector d(o);
  for (size_t i = 0; i < lbl.size(); ++i)
    if (auto w = d.observe(static_cast<int64_t>(i) + 1, lbl[i], load[i]); w && first && first->empty()) *first = *w;
  return d.warnings();
}

TEST(Metrics, LoadStats) {
  LoadStats even = load_stats({5, 5, 5, 5});
  EXPECT_DOUBLE_EQ(even.max_over_mean, 1.0);
  EXPECT_DOUBLE_EQ(even.cv, 0.0);
  LoadStats one = load_stats({4, 0, 0, 0});
  EXPECT_DOUBLE_EQ(one.max_over_mean, 4.0);
  EXPECT_NEAR(one.cv, std::sqrt(3.0), 1e-12);
  LoadStats none = load_stats({0, 0});
  EXPECT_EQ(none.max_over_mean, 0.0);
}

TEST(Metrics, TrendOfALine) {
  TrendStats t = trend({1, 3, 5, 7, 9});
  EXPECT_DOUBLE_EQ(t.slope, 2.0);
  EXPECT_DOUBLE_EQ(t.mean, 5.0);
  EXPECT_DOUBLE_EQ(t.change, 8.0 / 5.0);
  EXPECT_TRUE(std::isinf(t.t_stat) && t.t_stat > 0);
  EXPECT_EQ(trend({2, 2, 2}).t_stat, 0.0);
}

// Olmo-core 3's report, compressed into 100 steps: summed LBL 46.9 -> 41.3 while the worst
// max/mean load goes 2.75 -> 6.32, with step noise on both.
TEST(Gerrymander, ReportLikeSeriesWarns) {
  const auto lbl = series(46.9, 41.3, 100, 0.5, 7, 1);
  const auto load = series(2.75, 6.32, 100, 0.4, 7, 2);
  std::string first;
  const int64_t n = count_warnings(lbl, load, 50, &first);
  EXPECT_GE(n, 1);
  EXPECT_LE(n, 2) << "at most one warning per window";
  EXPECT_NE(first.find("token gerrymandering"), std::string::npos) << first;
  // Clean lines warn as well, as soon as the window is full, and name the step.
  std::string clean;
  EXPECT_EQ(count_warnings(series(46.9, 41.3, 50, 0, 1, 1), series(2.75, 6.32, 50, 0, 1, 2), 50, &clean), 1);
  EXPECT_NE(clean.find("at step 50"), std::string::npos) << clean;
}

TEST(Gerrymander, HealthySeriesDoNotWarn) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE(seed);
    // Both falling: the balancing loss works.
    EXPECT_EQ(count_warnings(series(46.9, 41.3, 300, 0.5, seed, 1), series(6.32, 2.75, 300, 0.4, seed, 2), 50), 0);
    // Loss flat while the load rises: a problem, but not the gerrymandering signature.
    EXPECT_EQ(count_warnings(series(46.9, 46.9, 300, 0.5, seed, 3), series(2.75, 6.32, 300, 0.4, seed, 4), 50), 0);
    // Loss falls, load flat.
    EXPECT_EQ(count_warnings(series(46.9, 41.3, 300, 0.5, seed, 5), series(3.0, 3.0, 300, 0.4, seed, 6), 50), 0);
  }
}

TEST(Gerrymander, NoiseAloneDoesNotWarn) {
  // Large step noise around flat levels, many seeds: a spurious joint trend must not pass.
  int64_t total = 0;
  for (uint64_t seed = 1; seed <= 20; ++seed)
    total += count_warnings(series(44, 44, 1000, 4.0, seed, 7), series(4, 4, 1000, 1.5, seed, 8), 50);
  EXPECT_EQ(total, 0);
}

TEST(Gerrymander, SlowDriftBelowTheThresholdsDoesNotWarn) {
  // 0.5% LBL fall and 2% load rise per window: within what the thresholds treat as drift.
  EXPECT_EQ(count_warnings(series(46.9, 46.9 * 0.97, 300, 0, 1, 1), series(3.0, 3.36, 300, 0, 1, 2), 50), 0);
}

TEST(Metrics, StepRecordFields) {
  StepResult r;
  r.step = 3;
  r.total = 2.5;
  r.ce = 2.4;
  r.lbl = {1.0, 1.5};
  r.router_z = {0.25, 0.5};
  r.counts = {{10, 10, 10, 10}, {40, 0, 0, 0}};
  r.mean_prob = {{0.25, 0.25, 0.25, 0.25}, {0.7, 0.1, 0.1, 0.1}};
  r.tokens = 1000;
  r.step_s = 0.5;
  const MfuPeak peak{4.0, "config", "metrics.peak_tflops = 4"};
  nlohmann::json j = step_record(r, 10.0, 1e9, peak, false);
  EXPECT_DOUBLE_EQ(j["lbl_sum"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(j["router_z_sum"].get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(j["step_s"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(j["tokens_per_s"].get<double>(), 2000.0);
  EXPECT_DOUBLE_EQ(j["tflops"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(j["peak_tflops"].get<double>(), 4.0);
  EXPECT_EQ(j["peak_source"], "config");
  EXPECT_DOUBLE_EQ(j["max_load"][1].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(j["load_cv"][0].get<double>(), 0.0);
  EXPECT_GT(j["peak_rss_mb"].get<double>(), 1.0);
  EXPECT_FALSE(j.contains("f"));
  nlohmann::json v = step_record(r, 10.0, 1e9, peak, true);
  EXPECT_EQ(v["f"][1][0].get<int>(), 40);
  EXPECT_DOUBLE_EQ(v["P"][1][0].get<double>(), 0.7);
  EXPECT_FALSE(j.contains("ep_drop_fraction"));  // expert parallelism only
  r.ep_drop_fraction = {0.0, 0.125};
  r.ep_rows_received = {{30, 34}, {40, 16}};
  nlohmann::json e = step_record(r, 10.0, 1e9, peak, false);
  EXPECT_DOUBLE_EQ(e["ep_drop_fraction"][1].get<double>(), 0.125);
  EXPECT_EQ(e["ep_rows_received"][1][0].get<int>(), 40);
  r.total = std::nan("");
  r.skipped = true;
  r.nonfinite_tensor = "layers.0.attn.wq";
  nlohmann::json s = step_record(r, 10.0, 1e9, peak, false);
  EXPECT_EQ(s["loss"], "nan");
  EXPECT_EQ(s["skipped"], true);
  EXPECT_EQ(s["nonfinite_tensor"], "layers.0.attn.wq");
}

TEST(Metrics, PeakRss) { EXPECT_GT(peak_rss_bytes(), 1 << 20); }

// MFU's denominator: a configured peak is used as given (per rank); otherwise the cpu backends
// measure this machine's FMA peak on the run's threads, bf16 at least as fast as fp32.
TEST(Metrics, MfuPeakFromConfigOrMeasuredHere) {
  Config c;
  c.metrics.peak_tflops = 1.5;
  MfuPeak p = mfu_peak(c);
  EXPECT_DOUBLE_EQ(p.tflops, 1.5);
  EXPECT_EQ(p.source, "config");
  EXPECT_DOUBLE_EQ(p.mfu(0.75), 0.5);
  c.metrics.peak_tflops = 0;
  c.train.threads = 1;
  const MfuPeak fp32 = mfu_peak(c);
  EXPECT_EQ(fp32.source, "measured");
  // One core of any x86 this runs on: above a 2 GHz SSE core's 16 GFLOP/s, below 1 TFLOP/s.
  EXPECT_GT(fp32.tflops, 0.008);
  EXPECT_LT(fp32.tflops, 1.0);
  EXPECT_NE(fp32.detail.find("1 thread"), std::string::npos) << fp32.detail;
  c.train.precision = "bf16";
  const MfuPeak bf16 = mfu_peak(c);
  EXPECT_EQ(bf16.source, "measured");
  EXPECT_GE(bf16.tflops, fp32.tflops);  // the same measurement: bf16 is the faster of its loops and fp32's
  EXPECT_EQ(mfu_peak(c).tflops, bf16.tflops);  // measured once per thread count
}

// The per-machine file keeps the largest of every measurement, per thread count, so one run
// measured while the VM lost a core does not set that run's MFU against half the machine.
TEST(Metrics, FmaPeakCacheKeepsTheLargestPerThreadCount) {
  const std::string file = ::testing::TempDir() + "/fma_peak_cache_test.tsv";
  std::remove(file.c_str());
  const char* saved = std::getenv("MOE_FMA_PEAK_CACHE");
  const std::string restore = saved ? saved : "";
  ::setenv("MOE_FMA_PEAK_CACHE", file.c_str(), 1);
  cpu::FmaPeak a;
  a.threads = 7;
  a.fp32_flops = 1e11, a.bf16_flops = 2e11, a.fp32_kernel = "k32", a.bf16_kernel = "k16";
  cpu::FmaPeak r = cpu::best_on_this_machine(a);
  EXPECT_EQ(r.fp32_flops, 1e11);
  EXPECT_FALSE(r.from_cache);
  {
    std::ofstream(file, std::ios::app) << "not a line of the cache\n";
  }
  cpu::FmaPeak b = a;
  b.fp32_flops = 5e10, b.bf16_flops = 3e11, b.fp32_kernel = "slow", b.bf16_kernel = "k16b";
  r = cpu::best_on_this_machine(b);
  EXPECT_EQ(r.fp32_flops, 1e11);  // the file's, with its instruction
  EXPECT_EQ(r.fp32_kernel, "k32");
  EXPECT_EQ(r.bf16_flops, 3e11);  // this measurement's
  EXPECT_EQ(r.bf16_kernel, "k16b");
  EXPECT_TRUE(r.from_cache);
  cpu::FmaPeak c = b;
  c.threads = 8;  // another thread count: its own line
  EXPECT_EQ(cpu::best_on_this_machine(c).fp32_flops, 5e10);
  std::ifstream in(file);
  int lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  EXPECT_EQ(lines, 2);  // 7 and 8 threads; the unreadable line dropped
  ::setenv("MOE_FMA_PEAK_CACHE", "off", 1);
  EXPECT_FALSE(cpu::best_on_this_machine(b).from_cache);
  if (saved) ::setenv("MOE_FMA_PEAK_CACHE", restore.c_str(), 1);
  else ::unsetenv("MOE_FMA_PEAK_CACHE");
  std::remove(file.c_str());
}

TEST(Progress, Formatting) {
  Progress p;
  p.step = 12;
  p.total = 1100;
  p.loss = 2.34567;
  p.tokens_per_s = 12345.4;
  p.eta_s = 185;
  EXPECT_EQ(format_progress(p), "step 12/1100 | loss 2.3457 | 12345 tok/s | ETA 3m05s");
  p.eta_s = -1;
  EXPECT_EQ(format_progress(p), "step 12/1100 | loss 2.3457 | 12345 tok/s | ETA --");
  EXPECT_EQ(format_duration(59), "59s");
  EXPECT_EQ(format_duration(7322), "2h02m");
  EXPECT_DOUBLE_EQ(eta_seconds(10, 100, 20, 0), 180.0);
  EXPECT_DOUBLE_EQ(eta_seconds(10, 100, 20, 100), 80.0);
  EXPECT_LT(eta_seconds(0, 100, 0, 0), 0);
}

}  // namespace
}  // namespace moe
