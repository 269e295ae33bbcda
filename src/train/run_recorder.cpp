#include "train/run_recorder.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <limits>
#include <unistd.h>

#include "core/check.h"
#include "parallel/communicator.h"

namespace moe {

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

namespace {
GerrymanderOptions gerrymander_options(const Config& config) {
  GerrymanderOptions o;
  o.window = config.metrics.gerrymander_window;
  return o;
}
}  // namespace

RunRecorder::RunRecorder(const Config& config, std::ostream& log, bool rank0, bool resume, const CheckpointInfo& start,
                         RunEvents& events, const MfuPeak& peak)
    : config_(config),
      log_(log),
      rank0_(rank0),
      start_(start),
      events_(events),
      peak_(peak),
      flops_per_token_(config.model.train_flops_per_token(config.train.seq_len)),
      gerrymander_(gerrymander_options(config)) {
  const TrainConfig& tc = config.train;
  summary_.steps = start.step;
  // A live progress line, rewritten in place (train.progress; metrics.h show_progress).
  live_ = rank0 && &log == &std::cout && show_progress(tc.progress, isatty(STDOUT_FILENO), launched_by_mpi());
  if (rank0) {
    const std::string metrics_path = tc.out_dir + "/metrics.jsonl";
    MetricsTrim trim;
    if (resume) trim = keep_metrics_through(metrics_path, start.step);  // continue exactly from the checkpoint
    metrics_.open(metrics_path, resume ? std::ios::app : std::ios::trunc);
    // config.toml is the config the run started with; a resume with other settings keeps it
    // and writes its own beside it.
    const std::string toml = config_to_toml(config), config_path = tc.out_dir + "/config.toml";
    std::string resume_config;
    if (!resume || !std::filesystem::exists(config_path)) {
      std::ofstream(config_path, std::ios::trunc) << toml;
    } else {
      std::ifstream in(config_path);
      const std::string before((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (before != toml) {
        resume_config = tc.out_dir + "/config.resume_" + checkpoint_name(start.step) + ".toml";
        std::ofstream(resume_config, std::ios::trunc) << toml;
      }
    }
    if (resume) {
      if (trim.dropped + trim.bad_lines > 0)
        log << "metrics.jsonl: dropped " << trim.dropped << " record(s) after step " << start.step
            << (trim.bad_lines ? " and " + std::to_string(trim.bad_lines) + " incomplete line(s)" : "")
            << " (written before the run stopped, past its last checkpoint)\n";
      events.write("resume", {{"step", start.step},
                              {"checkpoint", start.path},
                              {"next_instance", start.next_instance},
                              {"elapsed_s", start.elapsed_s},
                              {"metrics_dropped", trim.dropped},
                              {"metrics_incomplete_lines", trim.bad_lines},
                              {"config_changes", start.warnings},
                              {"config", resume_config}});
    }
  }
  // metrics.report: the page of plots, rank 0 (report/live_report.h).
  live_report_.emplace(tc.out_dir, rank0 && config.metrics.report);
  t_start_ = now_s();
}

std::ostream& RunRecorder::note() {
  if (live_shown_) log_ << "\r\033[K";
  live_shown_ = false;
  return log_;
}

nlohmann::json RunRecorder::record(const StepResult& r, int64_t step, bool last, double t, int64_t skipped_total) {
  const TrainConfig& tc = config_.train;
  tokens_window_ += r.tokens;
  step_s_window_ += r.step_s;
  summary_.steps = step;
  if (!r.skipped) summary_.final_train_loss = r.ce;
  const bool vectors = config_.metrics.vectors_every > 0 && step % config_.metrics.vectors_every == 0;
  nlohmann::json j = step_record(r, elapsed(t), flops_per_token_, peak_, vectors);
  j["step"] = step;
  if (r.skipped) {
    const std::string tensor = r.nonfinite_tensor.empty() ? "the loss terms" : r.nonfinite_tensor;
    j["skipped_total"] = skipped_total;
    note() << "step " << step << ": non-finite loss or gradients (first in " << tensor << "); update skipped ("
           << skipped_total << " skipped so far)\n" << std::flush;
    events_.write("skipped", {{"step", step}, {"tensor", tensor}, {"skipped_total", skipped_total}});
  } else if (!r.counts.empty()) {
    double worst = 0;
    for (const auto& c : r.counts) worst = std::max(worst, load_stats(c).max_over_mean);
    if (auto w = gerrymander_.observe(step, sum_of(r.lbl), worst)) {
      note() << *w << "\n" << std::flush;
      j["warning"] = *w;
    }
  }
  if (step % tc.log_every == 0 || last) {
    // The window's own step times (as the metrics' tokens_per_s), not the wall time between records:
    // with train.overlap_host a record is handled a step late and the last two back to back, so
    // the last line read millions of tokens/s.
    const double tps = step_s_window_ > 0 ? static_cast<double>(tokens_window_) / step_s_window_ : 0;
    note() << "step " << step << "/" << tc.steps << std::fixed << std::setprecision(4) << " | loss " << r.total
           << " | ce " << r.ce << " | grad " << r.grad_norm << std::scientific << std::setprecision(2) << " | lr "
           << r.lr << std::fixed << std::setprecision(0) << " | " << tps << " tok/s" << std::setprecision(3)
           << " | MFU " << peak_.mfu(tps * flops_per_token_ / 1e12) << std::setprecision(1) << " | " << elapsed(t)
           << " s\n" << std::defaultfloat << std::setprecision(6) << std::flush;
    tokens_window_ = 0;
    step_s_window_ = 0;
  }
  return j;
}

void RunRecorder::write(const nlohmann::json& record, const StepResult& r, int64_t step, bool last, double t) {
  const TrainConfig& tc = config_.train;
  if (live_ && !last) {
    Progress p;
    p.step = step;
    p.total = tc.steps;
    p.loss = r.total;
    // Pace of this process only: a resumed run counts from its first step.
    p.tokens_per_s = static_cast<double>((step - start_.step) * r.tokens) / (t - t_start_);
    p.eta_s = eta_seconds(step - start_.step, tc.steps - start_.step, t - t_start_, tc.time_limit_s);
    log_ << "\r" << format_progress(p) << "\033[K" << std::flush;
    live_shown_ = true;
  }
  if (!rank0_) return;
  metrics_ << record.dump() << "\n" << std::flush;
  live_report_->record(record);
}

void RunRecorder::write_report() {
  const std::string line = live_report_->write();
  if (!line.empty()) log_ << line << "\n" << std::flush;
}

TrainSummary RunRecorder::finish(const std::string& reason, int64_t skipped_total) {
  const TrainConfig& tc = config_.train;
  note();
  if (skipped_total > 0) log_ << skipped_total << " steps skipped for non-finite values\n";
  summary_.seconds = now_s() - t_start_;
  summary_.tokens_per_s =
      static_cast<double>((summary_.steps - start_.step) * tc.batch_size * tc.seq_len) / summary_.seconds;
  events_.write("stop", {{"step", summary_.steps}, {"reason", reason}, {"elapsed_s", elapsed(now_s())}});
  write_report();
  return summary_;
}

}  // namespace moe
