// out_dir/events.jsonl: what happened to a run, one JSON object per line, appended (never
// rewritten) by world rank 0 and flushed per line. Every record has "event" and "time" (UTC,
// ISO 8601); the events and their fields (docs/OUTPUTS.md, "Run events"):
//   start       version, git, build, command-line resume flag, threads, ranks, layout
//               {pp, dp, ep, zero1}, precision, backend, config_hash (SHA-256 of the resolved
//               config's TOML, first 16 hex digits), steps
//   resume      step, checkpoint, next_instance, elapsed_s, metrics_dropped (records past the
//               checkpoint removed from metrics.jsonl), config_changes (keys that differ)
//   checkpoint  step, path, bytes, seconds
//   eval        step, valid_ce
//   skipped     step, tensor, skipped_total (train.on_nonfinite = "skip")
//   stop        step, reason ("completed", "time_limit", "error"), message (errors), elapsed_s
// A run killed from outside (SIGKILL, another rank's MPI_Abort) has no stop event: the next
// start or resume follows its last record.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace moe {

class RunEvents {
 public:
  // path "" writes nothing (ranks other than 0).
  explicit RunEvents(const std::string& path);
  // Adds "time" after "event" and appends the record as one line.
  void write(const std::string& event, const nlohmann::json& fields);

 private:
  std::ofstream out_;
};

// "2026-12-01T12:08:36Z"
std::string utc_timestamp();

}  // namespace moe
