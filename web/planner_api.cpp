// The guide page's entry into the planner (WebAssembly): one JSON request in, the JSON that
// `moecore plan --json` prints for the same input out, or {"error": "..."} with the message the
// command line would print. Model configs come from the built-in presets (configs/published/,
// configs/bench/) or from TOML text pasted into the page.
#include <emscripten/emscripten.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"
#include "plan/hardware.h"
#include "plan/plan_command.h"

namespace {

struct Preset {
  const char* name;
  const char* text;
};
constexpr Preset kModels[] = {
#include "web/model_presets.inc"
};

std::string result;  // the last answer, alive until the next call

std::string answer(const std::string& request) {
  using nlohmann::json;
  const json q = json::parse(request);
  const std::string model = q.value("model", std::string("default"));
  std::string toml = q.value("toml", std::string());
  std::string source = "pasted TOML";
  if (toml.empty()) {
    bool found = false;
    for (const Preset& p : kModels)
      if (model == p.name) {
        toml = p.text;
        found = true;
      }
    MOE_CHECK(found, "unknown model preset '", model, "'");
    source = model;
  }
  std::vector<std::string> sets;
  for (const auto& s : q.value("set", json::array())) sets.push_back(s.get<std::string>());
  moe::PlanRequest r;
  r.layout = q.value("layout", std::string());
  r.cluster = q.value("cluster", std::string());
  r.sweep = q.value("sweep", false);
  r.step = q.value("step", int64_t{1});
  return moe::run_plan(moe::parse_config(toml, sets, source), r).json();
}

}  // namespace

extern "C" {

EMSCRIPTEN_KEEPALIVE const char* planner_run(const char* request) {
  try {
    result = answer(request);
  } catch (const std::exception& e) {
    result = nlohmann::json{{"error", e.what()}}.dump();
  }
  return result.c_str();
}

// The built-in presets, for the page's menus: {"models": [...], "clusters": [...]}.
EMSCRIPTEN_KEEPALIVE const char* planner_presets() {
  nlohmann::json j;
  for (const Preset& p : kModels) j["models"].push_back(p.name);
  j["clusters"] = moe::cluster_presets();
  result = j.dump();
  return result.c_str();
}

}  // extern "C"
