// The report `moecore train` keeps while it runs (metrics.report): rank 0 feeds it each record as
// metrics.jsonl gets it and writes out_dir/report.html at every checkpoint and at the end. The
// envelopes are bounded (report/envelope.h), so a write costs the same at step 10 and 10^6.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "report/run_report.h"

namespace moe::report {

class LiveReport {
 public:
  // Reads what out_dir already holds (metrics.jsonl after a resume's trim, events.jsonl,
  // config.toml). Nothing is kept when !enabled.
  LiveReport(const std::string& out_dir, bool enabled);
  void record(const nlohmann::json& metrics_record);
  // Writes out_dir/report.html (events.jsonl re-read first). Returns a line for the log; a
  // failure is reported in that line, never thrown: the report must not stop a training run.
  std::string write();

 private:
  std::string dir_;
  std::unique_ptr<RunReport> run_;
};

}  // namespace moe::report
