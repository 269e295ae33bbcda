// read_run: a run directory's files into a RunReport, stating (never failing on) what is wrong
// with their content.
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <toml++/toml.h>

#include "core/check.h"
#include "report/run_report.h"

namespace moe::report {

namespace {

namespace fs = std::filesystem;

// The step of a record line without parsing it (the only top-level key "step" that step_record
// writes; nested objects have no such key). -1 when absent.
int64_t quick_step(const std::string& line) {
  const size_t at = line.find("\"step\":");
  if (at == std::string::npos) return -1;
  size_t i = at + 7;
  while (i < line.size() && line[i] == ' ') ++i;
  int64_t v = 0;
  bool any = false;
  for (; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i) {
    if (v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (line[i] - '0');
    any = true;
  }
  return any ? v : -1;
}

struct LineRef {
  int64_t step = 0;
  std::streamoff offset = 0;
  size_t length = 0;
  int64_t line = 0;  // 1-based
};

std::string plural(int64_t n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

void read_metrics(const std::string& path, RunReport& run) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) {
    run.add_notice("metrics.jsonl: not found (no step has been recorded)");
    return;
  }
  std::vector<LineRef> refs;
  std::string line;
  int64_t n = 0, no_step = 0;
  std::streamoff offset = 0;
  while (std::getline(in, line)) {
    ++n;
    const bool complete = !in.eof();
    const std::streamoff next = offset + static_cast<std::streamoff>(line.size()) + (complete ? 1 : 0);
    if (!complete) {
      run.add_notice("metrics.jsonl: truncated line " + std::to_string(n) +
                     " skipped (no newline at its end: the run is writing it, or was stopped mid-write)");
    } else if (line.find_first_not_of(" \t\r") == std::string::npos) {
      // blank lines are no records and no loss
    } else if (const int64_t step = quick_step(line); step < 0) {
      ++no_step;
      run.add_notice("metrics.jsonl: line " + std::to_string(n) + " skipped (no \"step\")");
    } else {
      refs.push_back({step, offset, line.size(), n});
    }
    offset = next;
  }
  (void)no_step;
  // A later record of a step replaces an earlier one (a step run again); steps in order.
  const bool sorted = std::is_sorted(refs.begin(), refs.end(), [](const LineRef& a, const LineRef& b) { return a.step < b.step; });
  std::stable_sort(refs.begin(), refs.end(), [](const LineRef& a, const LineRef& b) { return a.step < b.step; });
  std::vector<LineRef> kept;
  int64_t repeated = 0;
  for (const LineRef& r : refs) {
    if (!kept.empty() && kept.back().step == r.step) {
      kept.back() = r;
      ++repeated;
    } else {
      kept.push_back(r);
    }
  }
  if (repeated > 0)
    run.add_notice("metrics.jsonl: " + plural(repeated, "repeated step", "repeated steps") +
                   " replaced (the later record of a step is drawn)");
  if (!sorted && repeated == 0) run.add_notice("metrics.jsonl: records out of step order, drawn sorted by step");
  in.clear();
  std::streamoff at = -1;
  std::string text;
  for (const LineRef& r : kept) {
    if (at != r.offset) in.seekg(r.offset);
    text.resize(r.length);
    in.read(text.data(), static_cast<std::streamsize>(r.length));
    at = r.offset + static_cast<std::streamoff>(r.length);
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) {
      run.add_notice("metrics.jsonl: line " + std::to_string(r.line) + " skipped (not a JSON record)");
      continue;
    }
    try {
      run.add_record(j);
    } catch (const std::exception& e) {
      run.add_notice("metrics.jsonl: line " + std::to_string(r.line) + " skipped (" + e.what() + ")");
    }
  }
}

// 0.003, not 0.0030000000000000001: the shortest text that reads back as the same double.
std::string shortest(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string first_path(const std::string& list) { return list.substr(0, list.find(',')); }

}  // namespace

void read_events(const std::string& dir, RunReport& run) {
  run.clear_events();
  std::ifstream in(dir + "/events.jsonl", std::ios::binary);
  if (!in.good()) return;
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // a partial last line: being written
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    run.add_event(j);
  }
}

std::map<std::string, std::string> read_flat_config(const std::string& path, std::vector<std::string>& notices) {
  std::map<std::string, std::string> flat;
  if (!fs::exists(path)) {
    notices.push_back("config.toml: not found (the config table is empty)");
    return flat;
  }
  try {
    const toml::table root = toml::parse_file(path);
    for (const auto& [section, node] : root) {
      const toml::table* t = node.as_table();
      if (!t) continue;
      for (const auto& [key, value] : *t) {
        std::ostringstream s;
        if (auto str = value.as_string()) s << str->get();  // without TOML's quotes
        else if (auto d = value.as_floating_point()) s << shortest(d->get());
        else value.visit([&](const auto& v) { s << v; });
        flat[std::string(section.str()) + "." + std::string(key.str())] = s.str();
      }
    }
  } catch (const std::exception& e) {
    notices.push_back("config.toml: not readable (" + std::string(e.what()) + ")");
  }
  return flat;
}

RunReport read_run(const std::string& dir) {
  MOE_CHECK(fs::is_directory(dir), "report: '", dir, "' is not a run directory");
  MOE_CHECK(fs::exists(dir + "/metrics.jsonl") || fs::exists(dir + "/events.jsonl"), "report: '", dir,
            "' holds neither metrics.jsonl nor events.jsonl (is it a train.out_dir?)");
  RunReport run(dir);
  std::vector<std::string> notices;
  // A resume with other settings wrote config.resume_step_N.toml beside config.toml (the
  // config the run started with): the latest one is the run's config now.
  std::string config_path = dir + "/config.toml", latest;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("config.resume_", 0) == 0 && name.size() > 5 && name.substr(name.size() - 5) == ".toml" && name > latest)
      latest = name;
  }
  if (!latest.empty()) {
    config_path = dir + "/" + latest;
    notices.push_back("config: " + latest + ", the latest resume's (config.toml is the config the run started with)");
  }
  run.set_config(read_flat_config(config_path, notices));
  for (auto& n : notices) run.add_notice(std::move(n));
  read_events(dir, run);
  read_metrics(dir + "/metrics.jsonl", run);
  // The bigram entropy beside data.train_path (moecore prepare): relative paths as the run saw
  // them (from where it was started), or beside the run directory's parent.
  const auto it = run.config().find("data.train_path");
  if (it != run.config().end() && !it->second.empty()) {
    const fs::path data_dir = fs::path(first_path(it->second)).parent_path();
    std::vector<fs::path> tries{data_dir / "bigram_entropy.txt"};
    if (data_dir.is_relative()) tries.push_back(fs::path(dir).parent_path().parent_path() / data_dir / "bigram_entropy.txt");
    std::string looked;
    for (const fs::path& p : tries) {
      std::ifstream b(p);
      double v = 0;
      if (b >> v) {
        run.set_bigram_entropy(v, p.string());
        return run;
      }
      looked += (looked.empty() ? "" : ", ") + p.string();
    }
    run.set_bigram_entropy(std::nullopt, "not found (" + looked + ")");
  }
  return run;
}

}  // namespace moe::report
