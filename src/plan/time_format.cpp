// moecore plan --cluster: the step-time tables and the layout sweep.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "plan/plan_json.h"
#include "plan/time_model.h"

namespace moe {

std::string format_step_time(const Config& config, const Plan& plan, const Cluster& cl, const StepTime& t) {
  std::ostringstream o;
  char buf[256];
  o << "\n## step time on " << cl.name << " (" << cl.nodes << " x " << cl.ranks_per_node << " " << cl.device.kind
    << "; roofline with the preset's efficiency curves, nothing overlapped)\n";
  std::snprintf(buf, sizeof buf, "%-8s %12s %12s %12s %12s %12s %12s %12s\n", "stage", "fwd ms/mb", "bwd ms/mb",
                "exchange ms", "busy ms", "bubble ms", "sync ms", "optim ms");
  o << buf;
  const double M = static_cast<double>(plan.micro_batches);
  for (size_t s = 0; s < t.stages.size(); ++s) {
    const StageTime& x = t.stages[s];
    std::snprintf(buf, sizeof buf, "%-8zu %12.3f %12.3f %12.3f %12.3f %12.3f %12.3f %12.3f\n", s, 1e3 * x.forward_s(),
                  1e3 * x.backward_s(), 1e3 * M * (x.forward_exchange_s + x.backward_exchange_s), 1e3 * x.busy_s,
                  1e3 * x.bubble_s, 1e3 * x.sync_s, 1e3 * x.optimizer_s);
    o << buf;
  }
  std::snprintf(buf, sizeof buf,
                "step %.4f s%s (pipeline %.4f s, bubble %.1f%% of it); %.1f tokens/s, %.1f per device; "
                "%.2f TFLOP/s per device; MFU %.1f%% of the %s peak, %.1f%% of bf16's (Olmo-core 3's convention; "
                "peaks %.4g / %.4g TFLOP/s fp32 / bf16, %s)\n",
                t.step_s, t.step_spread > 0 ? (" +- " + std::to_string(static_cast<int>(std::lround(100 * t.step_spread))) + "% (calibration spread)").c_str() : "",
                t.pipeline_s, 100 * t.bubble_fraction, t.tokens_per_s, t.tokens_per_s_per_device,
                t.achieved_flops_per_device / 1e12, 100 * t.mfu, config.train.precision.c_str(), 100 * t.mfu_bf16,
                cl.device.fp32_flops / 1e12, cl.device.bf16_flops / 1e12, peak_source(cl).c_str());
  o << buf;
  std::snprintf(buf, sizeof buf, "checkpoint save: %.2f s (the largest shard at %.2f GB/s per rank)\n", t.checkpoint_save_s,
                cl.device.storage_bytes_per_s / 1e9);
  o << buf << "where the step goes (critical stage):";
  for (const auto& [name, s] : t.waterfall) {
    std::snprintf(buf, sizeof buf, " %s %.1f ms;", name.c_str(), 1e3 * s);
    o << buf;
  }
  o << "\n";
  return o.str();
}

std::string format_sweep(const Cluster& cl, const std::vector<SweepRow>& rows) {
  std::ostringstream o;
  char buf[512];
  o << "\n## layouts of " << cl.ranks() << " ranks on " << cl.name << ", best first\n";
  std::snprintf(buf, sizeof buf, "%-4s %-4s %-4s %10s %12s %14s %8s %8s  %s\n", "dp", "ep", "pp", "peak GiB", "step s",
                "tokens/s/dev", "MFU", "bubble", "");
  o << buf;
  for (const SweepRow& r : rows) {
    const bool timed = r.time.step_s > 0;
    std::snprintf(buf, sizeof buf, "%-4lld %-4lld %-4lld %10.2f %12.4f %14.1f %7.1f%% %7.1f%%  %s\n",
                  static_cast<long long>(r.layout.dp), static_cast<long long>(r.layout.ep),
                  static_cast<long long>(r.layout.pp), r.peak_bytes / (1024.0 * 1024.0 * 1024.0),
                  timed ? r.time.step_s : 0.0, timed ? r.time.tokens_per_s_per_device : 0.0, 100 * r.time.mfu,
                  100 * r.time.bubble_fraction, r.fits ? "fits" : ("rejected: " + r.reason).c_str());
    o << buf;
  }
  return o.str();
}

namespace {

nlohmann::json time_json(const StepTime& t) {
  nlohmann::json stages = nlohmann::json::array();
  for (const StageTime& x : t.stages)
    stages.push_back({{"forward_compute_s", x.forward_compute_s}, {"forward_exchange_s", x.forward_exchange_s},
                      {"backward_compute_s", x.backward_compute_s}, {"backward_exchange_s", x.backward_exchange_s},
                      {"transfer_s", x.transfer_s}, {"grouped_s", x.grouped_s}, {"busy_s", x.busy_s}, {"bubble_s", x.bubble_s},
                      {"sync_s", x.sync_s}, {"optimizer_s", x.optimizer_s}});
  nlohmann::json timeline = nlohmann::json::array();
  for (const TimelineEntry& e : t.timeline)
    timeline.push_back({{"stage", e.stage}, {"micro", e.micro}, {"chunk", e.chunk}, {"forward", e.forward}, {"start_s", e.start_s}, {"end_s", e.end_s}});
  nlohmann::json waterfall = nlohmann::json::array();
  for (const auto& [name, s] : t.waterfall) waterfall.push_back({{"what", name}, {"s", s}});
  return {{"stages", stages},
          {"timeline", timeline},
          {"waterfall", waterfall},
          {"pipeline_s", t.pipeline_s},
          {"step_s", t.step_s},
          {"step_spread", t.step_spread},
          {"tokens_per_s", t.tokens_per_s},
          {"tokens_per_s_per_device", t.tokens_per_s_per_device},
          {"model_flops_per_token", t.model_flops_per_token},
          {"achieved_flops_per_device", t.achieved_flops_per_device},
          {"mfu", t.mfu},
          {"mfu_bf16", t.mfu_bf16},
          {"bubble_fraction", t.bubble_fraction},
          {"checkpoint_save_s", t.checkpoint_save_s}};
}

}  // namespace

std::string plan_report_json(const Config& config, const Plan& plan, const Cluster* cluster, const StepTime* time,
                             const std::vector<SweepRow>* sweep) {
  nlohmann::json j = plan_json(config, plan);
  if (cluster)
    j["cluster"] = {{"name", cluster->name}, {"nodes", cluster->nodes}, {"ranks_per_node", cluster->ranks_per_node},
                    {"device", cluster->device.kind}, {"memory_bytes", cluster->device.memory_bytes},
                    {"reserved_bytes", cluster->device.reserved_bytes}, {"process_bytes", cluster->device.process_bytes},
                    {"bf16_flops", cluster->device.bf16_flops}, {"fp32_flops", cluster->device.fp32_flops},
                    {"peak_source", peak_source(*cluster)}, {"sources", cluster->sources}};
  if (time) j["time"] = time_json(*time);
  if (sweep) {
    nlohmann::json rows = nlohmann::json::array();
    for (const SweepRow& r : *sweep)
      rows.push_back({{"dp", r.layout.dp}, {"ep", r.layout.ep}, {"pp", r.layout.pp}, {"fits", r.fits},
                      {"reason", r.reason}, {"peak_bytes", r.peak_bytes}, {"step_s", r.time.step_s},
                      {"tokens_per_s_per_device", r.time.tokens_per_s_per_device}, {"mfu", r.time.mfu},
                      {"bubble_fraction", r.time.bubble_fraction}});
    j["sweep"] = rows;
  }
  return j.dump(1) + "\n";
}

}  // namespace moe
