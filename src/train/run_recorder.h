// What a training run writes about its steps, in one place: metrics.jsonl (trimmed to the
// checkpoint on resume), config.toml, the log's header and step lines, the live progress line,
// the token-gerrymandering warnings, skipped-step events and the live report (rank 0 writes;
// every rank keeps the counts). The loop (train/train_loop.cpp) hands it each step's record;
// the callbacks (train/train_callbacks.h) add to the record and act between its steps.
#pragma once

#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "report/live_report.h"
#include "train/events.h"
#include "train/metrics.h"
#include "train/train_loop.h"

namespace moe {

double now_s();  // steady clock, seconds

class RunRecorder {
 public:
  // Opens metrics.jsonl (appending after the checkpoint's step on resume) and writes config.toml
  // and the resume event. start: where the run begins (the checkpoint resumed, or step 0).
  RunRecorder(const Config& config, std::ostream& log, bool rank0, bool resume, const CheckpointInfo& start,
              RunEvents& events, const MfuPeak& peak);
  std::ostream& log() { return log_; }
  // A line about to be logged: the progress line is cleared first.
  std::ostream& note();
  RunEvents& events() { return events_; }
  // Training seconds stitched across resumes (the checkpoint's elapsed_s + this process's).
  double elapsed(double t) const { return start_.elapsed_s + (t - t_start_); }
  bool out_of_time(double t) const { return config_.train.time_limit_s > 0 && t - t_start_ >= config_.train.time_limit_s; }
  // The step's record, made at time t: counted, its warnings logged, its line logged every
  // train.log_every steps and at the last. skipped_total: the trainer's count of skipped steps.
  nlohmann::json record(const StepResult& r, int64_t step, bool last, double t, int64_t skipped_total);
  // After the callbacks added to it: the progress line (not at the last step), then the record.
  void write(const nlohmann::json& record, const StepResult& r, int64_t step, bool last, double t);
  // The run's page of plots (metrics.report), its line logged.
  void write_report();
  TrainSummary& summary() { return summary_; }
  // The stop event and the last report; the summary's time and pace.
  TrainSummary finish(const std::string& reason, int64_t skipped_total);

 private:
  const Config& config_;
  std::ostream& log_;
  bool rank0_;
  CheckpointInfo start_;
  RunEvents& events_;
  MfuPeak peak_;
  double flops_per_token_;
  double t_start_;
  double step_s_window_ = 0;  // the steps' own times since the last console line
  int64_t tokens_window_ = 0;
  bool live_ = false, live_shown_ = false;  // the progress line (train.progress)
  std::ofstream metrics_;
  std::optional<report::LiveReport> live_report_;  // made after metrics.jsonl is trimmed: it reads it
  GerrymanderDetector gerrymander_;
  TrainSummary summary_;
};

}  // namespace moe
