#include "report/run_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/check.h"

namespace moe::report {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr size_t kMaxWarnings = 200, kMaxEvents = 2000;

// A number as metrics.jsonl writes it: a JSON number, or "nan" / "inf" / "-inf" (step_record
// keeps non-finite values visible as strings); null and anything else are NaN.
double number(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s == "inf" || s == "+inf" || s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "-inf" || s == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return kNaN;
}

// Seven significant digits: below a pixel on any plot, and short in the page.
double rounded(double v, int digits = 7) {
  if (!std::isfinite(v) || v == 0) return v;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return std::strtod(buf, nullptr);
}

nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(rounded(v, 10)) : nlohmann::json(); }

// Scalars drawn from each record, and the per-MoE-layer vectors.
constexpr const char* kScalars[] = {"loss",  "ce",          "lm_z",           "valid_ce",    "lr",
                                    "grad_norm", "tokens_per_s", "tflops",      "mfu",         "peak_rss_mb",
                                    "peak_device_mb", "pp_bubble_s", "lbl_sum", "router_z_sum"};
constexpr const char* kPerLayer[] = {"lbl", "router_z", "max_load", "load_cv", "ep_drop_fraction"};

nlohmann::json whole(double v) {  // whole numbers print without ".0"
  if (std::floor(v) == v && std::fabs(v) < 9e15) return static_cast<int64_t>(v);
  return v;
}

nlohmann::json series_json(const Envelope& e) {
  nlohmann::json s, t, x, y, k, m;
  s = t = x = y = k = m = nlohmann::json::array();
  int64_t prev_step = 0;
  double prev_tokens = 0;
  const auto point = [&](const Point& p) {
    s.push_back(p.at.step - prev_step);
    t.push_back(whole(p.at.tokens - prev_tokens));
    prev_step = p.at.step;
    prev_tokens = p.at.tokens;
    x.push_back(rounded(p.at.wall_s));
    y.push_back(rounded(p.y));
  };
  for (const Bucket& b : e.buckets()) {
    const bool one = b.lo.at.step == b.hi.at.step;
    const Point& first = b.lo.at.step <= b.hi.at.step ? b.lo : b.hi;
    const Point& second = b.lo.at.step <= b.hi.at.step ? b.hi : b.lo;
    point(first);
    if (!one) point(second);
    k.push_back(one ? 1 : 2);
    if (e.width() > 1) m.push_back(rounded(b.sum / static_cast<double>(b.count)));
  }
  const SeriesStats& st = e.stats();
  nlohmann::json j = {{"w", e.width()}, {"s", s}, {"t", t}, {"x", x}, {"y", y}, {"k", k}};
  if (e.width() > 1) j["m"] = m;
  j["st"] = {{"count", st.count},
             {"nonfinite", st.nonfinite},
             {"min", finite_or_null(st.min)},
             {"min_step", st.min_step},
             {"max", finite_or_null(st.max)},
             {"max_step", st.max_step},
             {"first", finite_or_null(st.first)},
             {"last", finite_or_null(st.last)},
             {"last_step", st.last_step},
             {"mean", st.count ? finite_or_null(st.sum / static_cast<double>(st.count)) : nlohmann::json()}};
  return j;
}

nlohmann::json position_json(const Position& p) { return {p.step, whole(p.tokens), rounded(p.wall_s)}; }

}  // namespace

RunReport::RunReport(std::string dir) : dir_(std::move(dir)) {}

void RunReport::add(const std::string& name, const Position& at, double y) {
  auto it = series_.find(name);
  if (it == series_.end()) it = series_.emplace(name, Envelope{}).first;
  it->second.add(at, y);
}

void RunReport::add_record(const nlohmann::json& r) {
  MOE_CHECK(r.is_object() && r.contains("step") && r["step"].is_number_integer(), "report: a record without a step");
  const int64_t step = r["step"].get<int64_t>();
  MOE_CHECK(records_ == 0 || step > last_step_, "report: step ", step, " after step ", last_step_);
  ++records_;
  last_step_ = step;
  if (r.contains("tokens")) tokens_ += number(r["tokens"]);
  const Position at{step, tokens_, r.contains("elapsed_s") ? number(r["elapsed_s"]) : kNaN};
  positions_.add(at, std::isfinite(at.wall_s) ? at.wall_s : static_cast<double>(step));
  bool nonfinite = false;
  for (const char* key : kScalars) {
    if (!r.contains(key)) continue;
    const double v = number(r[key]);
    nonfinite |= !std::isfinite(v);
    add(key, at, v);
  }
  nonfinite_records_ += nonfinite ? 1 : 0;
  if (r.contains("peak_tflops") && r.contains("peak_source") && r["peak_source"].is_string()) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.4g TFLOP/s, ", number(r["peak_tflops"]));
    const std::string peak = buf + echo(r["peak_source"].get<std::string>(), 40);
    if (mfu_peaks_.size() < kMaxPeaks && std::find(mfu_peaks_.begin(), mfu_peaks_.end(), peak) == mfu_peaks_.end())
      mfu_peaks_.push_back(peak);
  }
  for (const char* key : kPerLayer) {
    if (!r.contains(key) || !r[key].is_array()) continue;
    const auto& v = r[key];
    for (size_t l = 0; l < v.size(); ++l) add(std::string(key) + "." + std::to_string(l), at, number(v[l]));
    if (std::string(key) == "lbl") moe_layers_ = std::max<int64_t>(moe_layers_, static_cast<int64_t>(v.size()));
  }
  if (r.contains("ep_rows_received") && r["ep_rows_received"].is_array()) {
    const auto& layers = r["ep_rows_received"];
    for (size_t l = 0; l < layers.size(); ++l) {
      if (!layers[l].is_array()) continue;
      for (size_t k = 0; k < layers[l].size(); ++k)
        add("ep_rows_received." + std::to_string(l) + "." + std::to_string(k), at, number(layers[l][k]));
    }
  }
  if (r.contains("f") && r.contains("P") && r["f"].is_array() && r["P"].is_array() && r["f"].size() == r["P"].size()) {
    const auto& f = r["f"];
    const auto& p = r["P"];
    if (vectors_.size() < f.size()) vectors_.resize(f.size());
    for (size_t l = 0; l < f.size(); ++l) {
      std::vector<double> fv, pv;
      for (const auto& x : f[l]) fv.push_back(number(x));
      for (const auto& x : p[l]) pv.push_back(number(x));
      if (fv.size() != pv.size()) continue;
      if (!vectors_[l].columns().empty() && vectors_[l].columns().back().f_sum.size() != fv.size()) continue;
      vectors_[l].add(step, fv, pv);
    }
  }
  if (r.value("clipped", false)) clipped_.add(at);
  if (r.value("skipped", false)) skipped_.add(at);
  if (r.contains("warning") && r["warning"].is_string()) {
    ++warnings_total_;
    if (warnings_.size() < kMaxWarnings) warnings_.push_back({at, r["warning"].get<std::string>()});
  }
}

void RunReport::clear_events() {
  events_.clear();
  events_total_ = 0;
  resumes_ = 0;
  start_ = nlohmann::json::object();
  stop_ = nlohmann::json();
}

void RunReport::add_event(const nlohmann::json& e) {
  if (!e.is_object() || !e.contains("event") || !e["event"].is_string()) return;
  const std::string what = e["event"].get<std::string>();
  const int64_t step = e.contains("step") && e["step"].is_number_integer() ? e["step"].get<int64_t>() : 0;
  if (what == "start") {
    start_ = e;
    stop_ = nlohmann::json();  // a stop belongs to the start before it
    return;
  }
  if (what == "stop") stop_ = e;
  if (what == "eval") return;  // valid_ce is in the metrics records
  std::string detail;
  if (what == "checkpoint") detail = e.value("path", std::string());
  if (what == "resume") ++resumes_, detail = "from " + e.value("checkpoint", std::string());
  if (what == "skipped") detail = e.value("tensor", std::string());
  if (what == "stop") detail = e.value("reason", std::string()) + (e.contains("message") ? ": " + e.value("message", std::string()) : "");
  ++events_total_;
  if (events_.size() < kMaxEvents) events_.push_back({step, what, detail});
}

std::vector<std::string> RunReport::notices() const {
  std::vector<std::string> notices = notices_;
  if (warnings_total_ > static_cast<int64_t>(kMaxWarnings))
    notices.push_back(std::to_string(warnings_total_ - static_cast<int64_t>(kMaxWarnings)) +
                      " gerrymandering warnings past the first " + std::to_string(kMaxWarnings) + " not marked");
  if (events_total_ > static_cast<int64_t>(kMaxEvents))
    notices.push_back(std::to_string(events_total_ - static_cast<int64_t>(kMaxEvents)) + " events past the first " +
                      std::to_string(kMaxEvents) + " not marked");
  if (nonfinite_records_ > 0)
    notices.push_back(std::to_string(nonfinite_records_) + (nonfinite_records_ == 1 ? " record" : " records") +
                      " with non-finite values (nan/inf): those values are not drawn (the tables count them)");
  if (records_ > 0 && moe_layers_ == 0) notices.push_back("no MoE layers: the load-balance plots are not drawn");
  const int64_t w = positions_.width();
  if (w > 1)
    notices.push_back("downsampled for drawing: " + std::to_string(records_) + " steps in buckets of " +
                      std::to_string(w) + " steps, each drawn by its minimum and maximum; the tables use every step");
  return notices;
}

nlohmann::json RunReport::to_json() const {
  nlohmann::json series = nlohmann::json::object();
  for (const auto& [name, e] : series_) series[name] = series_json(e);
  nlohmann::json marks = nlohmann::json::object();
  for (const auto& [name, mb] : {std::pair{"clipped", &clipped_}, std::pair{"skipped", &skipped_}}) {
    nlohmann::json list = nlohmann::json::array();
    for (const Mark& m : mb->marks()) list.push_back({position_json(m.at), m.count});
    marks[name] = {{"total", mb->total()}, {"width", mb->width()}, {"at", list}};
  }
  nlohmann::json warnings = nlohmann::json::array();
  for (const Warning& w : warnings_) warnings.push_back({position_json(w.at), w.text});
  marks["warnings"] = {{"total", warnings_total_}, {"at", warnings}};
  nlohmann::json events = nlohmann::json::array();
  for (const EventMark& e : events_) events.push_back({e.step, e.what, e.detail});
  nlohmann::json vectors = nlohmann::json::array();
  for (const VectorColumns& vc : vectors_) {
    nlohmann::json steps = nlohmann::json::array(), f = nlohmann::json::array(), p = nlohmann::json::array();
    for (const VectorColumn& c : vc.columns()) {
      steps.push_back({c.first_step, c.last_step, c.count});
      nlohmann::json fc = nlohmann::json::array(), pc = nlohmann::json::array();
      for (size_t e = 0; e < c.f_sum.size(); ++e) {
        fc.push_back(rounded(c.f_sum[e] / static_cast<double>(c.count), 5));
        pc.push_back(rounded(c.p_sum[e] / static_cast<double>(c.count), 5));
      }
      f.push_back(fc);
      p.push_back(pc);
    }
    vectors.push_back({{"width", vc.width()}, {"records", vc.records()}, {"steps", steps}, {"f", f}, {"P", p}});
  }
  nlohmann::json pos = series_json(positions_);
  pos.erase("st");
  const std::vector<std::string> notices = this->notices();
  nlohmann::json j = {{"dir", dir_},
                      {"config", config_},
                      {"start", start_},
                      {"stop", stop_},
                      {"resumes", resumes_},
                      {"records", records_},
                      {"last_step", last_step_},
                      {"moe_layers", moe_layers_},
                      {"mfu_peaks", mfu_peaks_},
                      {"series", series},
                      {"positions", pos},
                      {"marks", marks},
                      {"events", events},
                      {"vectors", vectors},
                      {"notices", notices}};
  j["bigram"] = bigram_ ? nlohmann::json(*bigram_) : nlohmann::json();
  j["bigram_source"] = bigram_source_;
  return j;
}

}  // namespace moe::report
