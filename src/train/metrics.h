// Honest per-step metrics: the JSONL record of one optimizer step, expert-load statistics, the
// token-gerrymandering detector, peak RSS, and the terminal progress line.
#pragma once

#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "kernels/cpu/fma_peak.h"
#include "parallel/communicator.h"
#include "train/trainer.h"

namespace moe {

// Load of one MoE layer from its tokens-per-expert vector f (the step's sum over micro-batches).
// max_over_mean = max_e f_e / mean_e f_e (1 = perfectly balanced, E = everything on one expert);
// cv = population std_e f_e / mean_e f_e. Both 0 when no token was routed.
struct LoadStats {
  double max_over_mean = 0;
  double cv = 0;
};
LoadStats load_stats(const std::vector<int32_t>& counts);

// Peak resident set size of this process in bytes (VmHWM in /proc/self/status); 0 if unknown.
int64_t peak_rss_bytes();

// MFU's denominator: the peak of the whole run (every rank together) at the run's precision
// (fp32 runs against the fp32 peak; bf16 and mxfp8 against the bf16 one), and where it came from:
//   "config"     metrics.peak_tflops, per rank, times the ranks
//   "datasheet"  cuda: the GPU's dense datasheet peak (cuda_peak_tflops) times the ranks
//   "measured"   cpu, strict, ref: the FMA peak measured on each rank's threads when the run
//                starts (kernels/cpu/fma_peak.h), every rank at once, summed over the ranks
//   "none"       a GPU without a datasheet entry: tflops 0, MFU not reported (0)
// (The planner's cluster files say "calibration" for peaks `moecore bench --calibrate` measured.)
// With a world of several ranks every rank must call it (a barrier and an all-reduce).
struct MfuPeak {
  double tflops = 0;
  std::string source;
  std::string detail;  // how, e.g. "avx2 vfmadd231ps ymm, 2 threads, 1 rank"
  double mfu(double achieved_tflops) const { return tflops > 0 ? achieved_tflops / tflops : 0.0; }
};
MfuPeak mfu_peak(const Config& config, Communicator* world = nullptr);
// MiB the cuda backend held at most (0 on host backends).
double peak_device_mb();

// Token-gerrymandering detector. Olmo-core 3's report: the summed load-balancing loss fell
// (46.9 -> 41.3) while the worst per-layer imbalance rose (max/mean load 2.75 -> 6.32): the
// router learned to satisfy the loss without balancing the tokens.
//
// Definition. Per step the detector receives x = sum over MoE layers of the (unweighted)
// load-balancing loss and y = max over MoE layers of max/mean load. Over the last W steps
// (W = metrics.gerrymander_window) it fits least-squares lines x(t) = a + b t, y(t) = c + d t,
// t = 0..W-1, and measures for each series
//   change    = slope * (W - 1) / mean      (the fitted relative change across the window)
//   t_stat    = slope / standard error of the slope (W - 2 degrees of freedom)
// It warns when all of
//   change_x <= -min_lbl_drop     (default 2%: the balancing loss falls)
//   change_y >= +min_load_rise    (default 10%: the worst imbalance rises)
//   t_stat_x <= -min_t and t_stat_y >= +min_t   (default 6: both trends are not noise)
// hold. After a warning it stays quiet for W steps (one warning per window of evidence).
// The thresholds are per window, so W should match the time scale of the drift to catch: a run
// whose imbalance creeps up over thousands of steps needs a window of hundreds.
// The t-statistic requirement keeps step-to-step noise from triggering it: for W = 50 and
// independent noise a trend reaches t >= 6 with probability below 1e-6 per series and step, so a
// genuinely falling loss with a flat but noisy load (or the reverse) stays quiet over long runs.
// Step-to-step correlation in the load inflates t; the thresholds on `change` guard that case.
struct GerrymanderOptions {
  int64_t window = 50;
  double min_lbl_drop = 0.02;
  double min_load_rise = 0.10;
  double min_t = 6.0;
};

struct TrendStats {
  double slope = 0, mean = 0, change = 0, t_stat = 0;
};
// Least-squares trend of v against 0..n-1 (n >= 3). A perfect line has t_stat = +-inf
// (or 0 when flat).
TrendStats trend(const std::vector<double>& v);

class GerrymanderDetector {
 public:
  explicit GerrymanderDetector(GerrymanderOptions options = {});
  // Feeds one step; returns a one-line warning when the condition above holds.
  std::optional<std::string> observe(int64_t step, double lbl_sum, double max_load);
  int64_t warnings() const { return warnings_; }

 private:
  GerrymanderOptions o_;
  std::deque<double> lbl_, load_;
  int64_t quiet_until_ = 0, warnings_ = 0;
};

// Sum of the per-layer values (the summed auxiliary losses of the JSONL record).
double sum_of(const std::vector<double>& v);

// One optimizer step's JSONL record. Fields (docs/OUTPUTS.md, "Metrics"):
//   step, loss (total), ce, lm_z, lbl_sum, router_z_sum, lbl[], router_z[] (per MoE layer,
//   unweighted), grad_norm (before clipping), lr, clipped, tokens, step_s (StepResult::step_s),
//   tokens_per_s (tokens / step_s),
//   tflops (achieved model TFLOP/s), mfu (tflops / peak), peak_tflops and peak_source (MfuPeak), peak_rss_mb, peak_device_mb (cuda), elapsed_s, pp_bubble_s
//   (seconds this rank blocked receiving pipeline activations/gradients: the bubble; 0 without pp),
//   max_load[] and load_cv[] per MoE layer, and with_vectors: f[][] (tokens per expert) and
//   P[][] (mean router probability per expert) per MoE layer. Skipped steps carry
//   "skipped": true, "nonfinite_tensor" and "skipped_total".
// elapsed_s: training seconds so far (stitched across resumes).
nlohmann::json step_record(const StepResult& r, double elapsed_s, double flops_per_token,
                           const MfuPeak& peak, bool with_vectors);

// On resume: keeps the records of metrics.jsonl up to and including `step` (the checkpoint's)
// and drops every later one, and any line that is not a complete record (a killed run's
// partial last line), so the resumed run continues the file exactly from the checkpoint.
// Rewrites the file atomically (temp file, fsync, rename). Returns the records dropped; a
// missing file is not an error.
struct MetricsTrim {
  int64_t kept = 0, dropped = 0, bad_lines = 0;
};
MetricsTrim keep_metrics_through(const std::string& path, int64_t step);

// Whether to show the live progress line: train.progress "on"/"off", or "auto": stdout is a
// terminal and no launcher started the process (Open MPI hands every rank a pseudo-terminal
// even when mpirun's output is redirected, so isatty cannot tell).
bool show_progress(const std::string& setting, bool stdout_is_terminal, bool launched_by_mpi);

// Terminal progress: "step 12/1100 | loss 2.3456 | 12345 tok/s | ETA 3m05s".
// eta_s < 0 prints "ETA --".
struct Progress {
  int64_t step = 0, total = 0;
  double loss = 0, tokens_per_s = 0, eta_s = -1;
};
std::string format_progress(const Progress& p);
// 59 -> "59s", 185 -> "3m05s", 7322 -> "2h02m".
std::string format_duration(double seconds);
// Seconds left: the steps still to run at the average pace so far, capped by the time limit.
double eta_seconds(int64_t step, int64_t total, double elapsed_s, double time_limit_s);

}  // namespace moe
