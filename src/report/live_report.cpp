#include "report/live_report.h"

#include <chrono>
#include <cstdio>

#include "report/report_html.h"

namespace moe::report {

LiveReport::LiveReport(const std::string& out_dir, bool enabled) : dir_(out_dir) {
  if (!enabled) return;
  try {
    run_ = std::make_unique<RunReport>(read_run(out_dir));
  } catch (const std::exception& e) {  // the report must not stop a run: start from nothing
    run_ = std::make_unique<RunReport>(out_dir);
    run_->add_notice(std::string("the run's earlier records were not read: ") + e.what());
  }
}

void LiveReport::record(const nlohmann::json& metrics_record) {
  if (run_) run_->add_record(metrics_record);
}

std::string LiveReport::write() {
  if (!run_) return "";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string path = dir_ + "/report.html";
  try {
    read_events(dir_, *run_);
    const size_t bytes = write_report(path, {run_.get()});
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    char buf[64];
    std::snprintf(buf, sizeof buf, " (%.0f KB, %.0f ms)", static_cast<double>(bytes) / 1024.0, ms);
    return "report: " + path + buf;
  } catch (const std::exception& e) {
    return "report: " + path + " not written: " + e.what();
  }
}

}  // namespace moe::report
