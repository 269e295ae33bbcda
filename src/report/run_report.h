// One run as the report shows it: every metrics.jsonl record and events.jsonl event folded into
// bounded envelopes (report/envelope.h), the resolved config, the environment and the notices
// of what was skipped. `moecore report` builds it from a run directory (read_run); `moecore
// train` feeds it each record as it writes it and writes the page at checkpoints and at the end.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "report/envelope.h"

namespace moe::report {

struct Warning {
  Position at;
  std::string text;
};

struct EventMark {
  int64_t step = 0;
  std::string what;  // "checkpoint", "resume", "skipped", "stop"
  std::string detail;
};

class RunReport {
 public:
  explicit RunReport(std::string dir);

  // One metrics.jsonl record, in step order (a record for an earlier step is an error here:
  // read_run resolves repeats first). NaN/Inf may be numbers or the strings "nan", "inf", "-inf".
  void add_record(const nlohmann::json& record);
  // One events.jsonl record.
  void add_event(const nlohmann::json& event);
  // Forgets the events (the trainer re-reads events.jsonl before each page).
  void clear_events();
  void set_config(std::map<std::string, std::string> flat) { config_ = std::move(flat); }
  void set_bigram_entropy(std::optional<double> nats, std::string source) {
    bigram_ = nats;
    bigram_source_ = std::move(source);
  }
  void add_notice(std::string text) { notices_.push_back(std::move(text)); }

  // The run's part of the page's data (report_html.cpp): series, marks, vectors, tables.
  nlohmann::json to_json() const;

  const std::string& dir() const { return dir_; }
  const std::map<std::string, std::string>& config() const { return config_; }
  const std::map<std::string, Envelope>& series() const { return series_; }
  const std::vector<VectorColumns>& vectors() const { return vectors_; }
  // What was skipped or is missing, as the page states it (read_run's and the run's own).
  std::vector<std::string> notices() const;
  int64_t records() const { return records_; }
  int64_t last_step() const { return last_step_; }
  int64_t moe_layers() const { return moe_layers_; }

 private:
  void add(const std::string& name, const Position& at, double y);
  std::string dir_;
  std::map<std::string, std::string> config_;
  std::optional<double> bigram_;
  std::string bigram_source_;
  std::vector<std::string> notices_;
  std::map<std::string, Envelope> series_;
  std::vector<VectorColumns> vectors_;  // per MoE layer
  Envelope positions_{500};             // step -> tokens, wall time (for marks drawn on other axes)
  MarkBuckets clipped_, skipped_;
  std::vector<Warning> warnings_;
  int64_t warnings_total_ = 0;
  std::vector<EventMark> events_;
  int64_t events_total_ = 0;
  nlohmann::json start_ = nlohmann::json::object(), stop_ = nlohmann::json();
  // MFU's denominators the records name ("0.1798 TFLOP/s, measured"), in order of first use
  // (a run resumed on another machine has two); at most kMaxPeaks kept.
  static constexpr size_t kMaxPeaks = 8;
  std::vector<std::string> mfu_peaks_;
  int64_t resumes_ = 0;
  int64_t records_ = 0, last_step_ = 0, moe_layers_ = 0, nonfinite_records_ = 0;
  double tokens_ = 0;
};

// Reads RUN_DIR/metrics.jsonl, events.jsonl and config.toml (and the bigram entropy that
// `moecore prepare` wrote beside data.train_path) into a RunReport. Never fails on the
// content of those files: a truncated last line, lines that are not records, repeated steps,
// missing files are skipped and stated as notices. Fails only when RUN_DIR is not a directory
// or holds neither metrics.jsonl nor events.jsonl.
RunReport read_run(const std::string& dir);

// Re-reads RUN_DIR/events.jsonl into `run` (its events replaced).
void read_events(const std::string& dir, RunReport& run);

// config.toml flattened to "section.key" -> value as TOML writes it; {} when the file is missing.
std::map<std::string, std::string> read_flat_config(const std::string& path, std::vector<std::string>& notices);

}  // namespace moe::report
