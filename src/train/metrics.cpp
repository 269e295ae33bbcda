#include "train/metrics.h"

#ifdef MOE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/check.h"
#include "kernels/cpu/cpu_ops.h"
#include "plan/calibrate.h"

namespace moe {

LoadStats load_stats(const std::vector<int32_t>& counts) {
  LoadStats s;
  if (counts.empty()) return s;
  double sum = 0, mx = 0;
  for (int32_t c : counts) {
    sum += c;
    mx = std::max(mx, static_cast<double>(c));
  }
  if (sum <= 0) return s;
  const double mean = sum / static_cast<double>(counts.size());
  double var = 0;
  for (int32_t c : counts) var += (c - mean) * (c - mean);
  var /= static_cast<double>(counts.size());
  s.max_over_mean = mx / mean;
  s.cv = std::sqrt(var) / mean;
  return s;
}

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream s(line.substr(6));
      int64_t kb = 0;
      s >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

MfuPeak mfu_peak(const Config& config, Communicator* world) {
  const bool bf16 = config.train.precision != "fp32";
  const int ranks = world ? world->size() : 1;
  const std::string per_rank = ranks > 1 ? " per rank x " + std::to_string(ranks) + " ranks" : "";
  std::ostringstream detail;
  detail.precision(4);
  MfuPeak p;
  if (config.metrics.peak_tflops > 0) {
    p.tflops = config.metrics.peak_tflops * ranks;
    p.source = "config";
    detail << "metrics.peak_tflops = " << config.metrics.peak_tflops << per_rank;
    p.detail = detail.str();
    return p;
  }
#ifdef MOE_WITH_CUDA
  if (config.train.backend == "cuda") {
    const double one = cuda_peak_tflops(bf16);  // mxfp8 against the bf16 peak, as Olmo-core 3 reports it
    p.tflops = one * ranks;
    p.source = one > 0 ? "datasheet" : "none";
    detail << (one > 0 ? "dense " : "no datasheet peak for this GPU") << (one > 0 ? (bf16 ? "bf16 " : "fp32 ") : "");
    if (one > 0) detail << one << " TFLOP/s" << per_rank;
    p.detail = detail.str();
    return p;
  }
#endif
  const cpu::FmaPeak m = ranks_fma_peak(config, world);
  p.tflops = (bf16 ? m.bf16_flops : m.fp32_flops) * 1e-12;
  p.source = "measured";
  detail << (bf16 ? m.bf16_kernel : m.fp32_kernel) << ", " << m.threads << (m.threads == 1 ? " thread" : " threads");
  if (ranks > 1) detail << " x " << ranks << " ranks (summed)";
  if (m.from_cache) detail << ", the best measured on this machine";
  p.detail = detail.str();
  return p;
}

double peak_device_mb() {
#ifdef MOE_WITH_CUDA
  return static_cast<double>(cuda_peak_allocated_bytes()) / (1024.0 * 1024.0);
#else
  return 0;
#endif
}

TrendStats trend(const std::vector<double>& v) {
  const int64_t n = static_cast<int64_t>(v.size());
  MOE_CHECK(n >= 3, "trend needs at least 3 points, got ", n);
  TrendStats t;
  const double tm = static_cast<double>(n - 1) / 2.0;
  double sum = 0;
  for (double x : v) sum += x;
  t.mean = sum / static_cast<double>(n);
  double sxx = 0, sxy = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double dt = static_cast<double>(i) - tm;
    sxx += dt * dt;
    sxy += dt * (v[static_cast<size_t>(i)] - t.mean);
  }
  t.slope = sxy / sxx;
  double sse = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = v[static_cast<size_t>(i)] - t.mean - t.slope * (static_cast<double>(i) - tm);
    sse += r * r;
  }
  const double se = std::sqrt(sse / static_cast<double>(n - 2) / sxx);
  if (se > 0) t.t_stat = t.slope / se;
  else t.t_stat = t.slope == 0 ? 0 : std::copysign(std::numeric_limits<double>::infinity(), t.slope);
  t.change = t.mean != 0 ? t.slope * static_cast<double>(n - 1) / std::fabs(t.mean) : 0;
  return t;
}

GerrymanderDetector::GerrymanderDetector(GerrymanderOptions options) : o_(options) {
  MOE_CHECK(o_.window == 0 || o_.window >= 3, "gerrymander window ", o_.window, " is too short");
}

std::optional<std::string> GerrymanderDetector::observe(int64_t step, double lbl_sum, double max_load) {
  if (o_.window <= 0 || !std::isfinite(lbl_sum) || !std::isfinite(max_load)) return std::nullopt;
  lbl_.push_back(lbl_sum);
  load_.push_back(max_load);
  if (static_cast<int64_t>(lbl_.size()) > o_.window) {
    lbl_.pop_front();
    load_.pop_front();
  }
  if (static_cast<int64_t>(lbl_.size()) < o_.window || step < quiet_until_) return std::nullopt;
  const TrendStats x = trend(std::vector<double>(lbl_.begin(), lbl_.end()));
  const TrendStats y = trend(std::vector<double>(load_.begin(), load_.end()));
  if (!(x.change <= -o_.min_lbl_drop && y.change >= o_.min_load_rise && x.t_stat <= -o_.min_t &&
        y.t_stat >= o_.min_t))
    return std::nullopt;
  quiet_until_ = step + o_.window;
  ++warnings_;
  std::ostringstream s;
  s.precision(3);
  s << "warning: possible token gerrymandering at step " << step << ": over the last " << o_.window
    << " steps the load-balancing loss (sum over layers) fell " << -100 * x.change << "% (fit "
    << x.mean - x.slope * (o_.window - 1) / 2.0 << " -> " << x.mean + x.slope * (o_.window - 1) / 2.0
    << ") while the worst max/mean expert load rose " << 100 * y.change << "% (fit "
    << y.mean - y.slope * (o_.window - 1) / 2.0 << " -> " << y.mean + y.slope * (o_.window - 1) / 2.0
    << "); the router may be satisfying the loss without balancing tokens";
  return s.str();
}

double sum_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

nlohmann::json step_record(const StepResult& r, double elapsed_s, double flops_per_token,
                           const MfuPeak& peak, bool with_vectors) {
  const double tps = r.step_s > 0 ? static_cast<double>(r.tokens) / r.step_s : 0;
  const double tflops = tps * flops_per_token / 1e12;
  nlohmann::json j = {{"step", r.step},
                      {"loss", r.total},
                      {"ce", r.ce},
                      {"lm_z", r.lm_z},
                      {"lbl_sum", sum_of(r.lbl)},
                      {"router_z_sum", sum_of(r.router_z)},
                      {"lbl", r.lbl},
                      {"router_z", r.router_z},
                      {"grad_norm", r.grad_norm},
                      {"lr", r.lr},
                      {"clipped", r.clipped},
                      {"tokens", r.tokens},
                      {"step_s", r.step_s},
                      {"tokens_per_s", tps},
                      {"tflops", tflops},
                      {"mfu", peak.mfu(tflops)},
                      {"peak_tflops", peak.tflops},
                      {"peak_source", peak.source},
                      {"peak_rss_mb", static_cast<double>(peak_rss_bytes()) / (1024.0 * 1024.0)},
                      {"peak_device_mb", peak_device_mb()},
                      {"elapsed_s", elapsed_s},
                      {"pp_bubble_s", r.pp_bubble_s},
                      {"to_host", r.transfers.to_host},
                      {"to_host_bytes", r.transfers.to_host_bytes},
                      {"to_device", r.transfers.to_device},
                      {"to_device_bytes", r.transfers.to_device_bytes},
                      {"staged_to_host_bytes", r.staged.to_host_bytes},
                      {"staged_to_device_bytes", r.staged.to_device_bytes}};
  std::vector<double> max_load, cv;
  for (const auto& c : r.counts) {
    const LoadStats s = load_stats(c);
    max_load.push_back(s.max_over_mean);
    cv.push_back(s.cv);
  }
  j["max_load"] = max_load;
  j["load_cv"] = cv;
  if (!r.ep_drop_fraction.empty()) {  // expert parallelism, per MoE layer
    j["ep_drop_fraction"] = r.ep_drop_fraction;
    j["ep_rows_received"] = r.ep_rows_received;
  }
  if (!r.mx_quant.empty()) {  // MXFP8 experts, per MoE layer on rank 0: fractions of the values quantized
    for (const auto& [key, at] : {std::pair{"fwd", 0}, std::pair{"bwd", 4}}) {
      std::vector<double> amax, saturated, underflow;
      for (const auto& q : r.mx_quant) {
        const double n = std::max(q[at + 3], 1.0);
        amax.push_back(q[at]);
        saturated.push_back(q[at + 1] / n);
        underflow.push_back(q[at + 2] / n);
      }
      j[std::string("mx_") + key + "_amax"] = amax;
      j[std::string("mx_") + key + "_saturated"] = saturated;
      j[std::string("mx_") + key + "_underflow"] = underflow;
    }
  }
  if (with_vectors) {
    j["f"] = r.counts;
    j["P"] = r.mean_prob;
  }
  if (r.skipped) {
    j["skipped"] = true;
    j["nonfinite_tensor"] = r.nonfinite_tensor;
  }
  // nlohmann dumps NaN/Inf as null; keep the non-finite values visible as strings.
  for (const char* key : {"loss", "ce", "lm_z", "grad_norm"}) {
    const double v = j[key].get<double>();
    if (!std::isfinite(v)) j[key] = std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  }
  return j;
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return "--";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>((s % 3600) / 60));
  return buf;
}

double eta_seconds(int64_t step, int64_t total, double elapsed_s, double time_limit_s) {
  if (step <= 0 || elapsed_s <= 0) return -1;
  double eta = elapsed_s / static_cast<double>(step) * static_cast<double>(std::max<int64_t>(total - step, 0));
  if (time_limit_s > 0) eta = std::min(eta, std::max(0.0, time_limit_s - elapsed_s));
  return eta;
}

std::string format_progress(const Progress& p) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "step %lld/%lld | loss %.4f | %.0f tok/s | ETA %s",
                static_cast<long long>(p.step), static_cast<long long>(p.total), p.loss, p.tokens_per_s,
                p.eta_s < 0 ? "--" : format_duration(p.eta_s).c_str());
  return buf;
}

}  // namespace moe

namespace moe {

MetricsTrim keep_metrics_through(const std::string& path, int64_t step) {
  MetricsTrim t;
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return t;
  std::string kept, line;
  bool changed = false;
  while (std::getline(in, line)) {
    const bool complete = !in.eof();  // the last line of a killed run may lack its newline
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!complete || j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) {
      ++t.bad_lines;
      changed = true;
      continue;
    }
    if (j["step"].get<int64_t>() > step) {
      ++t.dropped;
      changed = true;
      continue;
    }
    ++t.kept;
    kept += line;
    kept += '\n';
  }
  in.close();
  if (!changed) return t;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << kept;
    out.flush();
    MOE_CHECK(out.good(), "cannot write '", tmp, "'");
  }
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  MOE_CHECK(fd >= 0 && ::fsync(fd) == 0, "fsync of '", tmp, "' failed");
  ::close(fd);
  MOE_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot replace '", path, "': ", std::strerror(errno));
  return t;
}

bool show_progress(const std::string& setting, bool stdout_is_terminal, bool launched_by_mpi) {
  if (setting == "on") return true;
  if (setting == "off") return false;
  MOE_CHECK(setting == "auto", "train.progress = \"", setting, "\" (allowed: auto, on, off)");
  return stdout_is_terminal && !launched_by_mpi;
}

}  // namespace moe
