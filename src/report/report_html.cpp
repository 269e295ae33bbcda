#include "report/report_html.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/build_info.h"
#include "core/check.h"

namespace moe::report {

namespace {

struct PageText {
  const char* name;
  const char* text;
};
// report_page.html, report_script.js, report_style.css (cmake: moe_embed_texts).
constexpr PageText kPage[] = {
#include "report/report_page.inc"
};

std::string page_text(const std::string& name) {
  for (const PageText& p : kPage)
    if (name == p.name) return p.text;
  MOE_FAIL("report: the built-in page has no '", name, "'");
}

void replace_once(std::string& s, const std::string& marker, const std::string& with) {
  const size_t at = s.find(marker);
  MOE_CHECK(at != std::string::npos, "report: the page template lacks ", marker);
  s.replace(at, marker.size(), with);
}

std::string base_name(const std::string& dir) {
  std::filesystem::path p(dir);
  while (!p.empty() && p.filename().empty()) p = p.parent_path();  // "runs/a/" -> "a"
  const std::string name = p.filename().string();
  return name.empty() || name == "." ? dir : name;
}

}  // namespace

std::vector<std::string> run_labels(const std::vector<const RunReport*>& runs) {
  std::set<std::string> keys;
  for (const RunReport* r : runs)
    for (const auto& [k, v] : r->config()) keys.insert(k);
  std::vector<std::string> differing;
  if (runs.size() > 1) {
    for (const std::string& k : keys) {
      if (k == "train.out_dir" || k == "checkpoint.dir") continue;
      std::set<std::string> values;
      for (const RunReport* r : runs) {
        const auto it = r->config().find(k);
        values.insert(it == r->config().end() ? "(unset)" : it->second);
      }
      if (values.size() > 1) differing.push_back(k);
    }
  }
  std::vector<std::string> labels;
  for (const RunReport* r : runs) {
    std::string label = base_name(r->dir()), extra;
    for (const std::string& k : differing) {
      const auto it = r->config().find(k);
      extra += (extra.empty() ? "" : ", ") + k + "=" + (it == r->config().end() ? "(unset)" : it->second);
    }
    labels.push_back(extra.empty() ? label : label + " (" + extra + ")");
  }
  return labels;
}

std::string report_html(const std::vector<const RunReport*>& runs) {
  MOE_CHECK(!runs.empty(), "report: no runs");
  const std::vector<std::string> labels = run_labels(runs);
  nlohmann::json data = {{"generator", build_description()}, {"runs", nlohmann::json::array()}};
  for (size_t i = 0; i < runs.size(); ++i) {
    nlohmann::json r = runs[i]->to_json();
    r["label"] = labels[i];
    data["runs"].push_back(std::move(r));
  }
  // Inline JSON inside <script>: "</" must not appear ("<\/" is the same JSON string).
  std::string json = data.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
  for (size_t at = 0; (at = json.find("</", at)) != std::string::npos; at += 3) json.replace(at, 2, "<\\/");
  std::string page = page_text("report_page");
  std::string title = labels.size() == 1 ? labels[0] : std::to_string(labels.size()) + " runs";
  for (const char* bad : {"&", "<", ">"}) {
    const std::string with = std::string(bad) == "&" ? "&amp;" : std::string(bad) == "<" ? "&lt;" : "&gt;";
    for (size_t at = 0; (at = title.find(bad, at)) != std::string::npos; at += with.size()) title.replace(at, 1, with);
  }
  replace_once(page, "/*MOECORE_REPORT_TITLE*/", title);
  replace_once(page, "/*MOECORE_REPORT_STYLE*/", page_text("report_style"));
  replace_once(page, "/*MOECORE_REPORT_DATA*/", json);
  replace_once(page, "/*MOECORE_REPORT_SCRIPT*/", page_text("report_script"));
  return page;
}

size_t write_report(const std::string& path, const std::vector<const RunReport*>& runs) {
  const std::string page = report_html(runs);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    MOE_CHECK(out.good(), "report: cannot write '", tmp, "'");
    out << page;
    out.flush();
    MOE_CHECK(out.good(), "report: cannot write '", tmp, "'");
  }
  MOE_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "report: cannot replace '", path, "': ", std::strerror(errno));
  return page.size();
}

}  // namespace moe::report
