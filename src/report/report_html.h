// The run report page: one self-contained HTML file (inline CSS, SVG drawn by inline JS, the
// runs' data as inline JSON; no network, opens from disk). The page's script and style live in
// src/report/page/ and are built in as text.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "report/run_report.h"

namespace moe::report {

// Each run's label: its directory's name, and where runs differ, the config keys that differ
// ("optim.lr=0.001, parallel.ep=2"; train.out_dir and checkpoint.dir never count).
std::vector<std::string> run_labels(const std::vector<const RunReport*>& runs);

std::string report_html(const std::vector<const RunReport*>& runs);

// Writes the page to `path` through a temporary file renamed over it (a reader never sees half
// a page). Returns the bytes written.
size_t write_report(const std::string& path, const std::vector<const RunReport*>& runs);

}  // namespace moe::report
