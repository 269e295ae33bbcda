// moecore plan's output: terminal tables and JSON.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "plan/plan_json.h"

namespace moe {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct MemoryRow {
  const char* name;
  double MemoryEstimate::*field;
};
constexpr MemoryRow kMemoryRows[] = {
    {"fp32 master weights", &MemoryEstimate::params},
    {"bf16 operand copies", &MemoryEstimate::operand_copies},
    {"MXFP8 weight caches", &MemoryEstimate::mx_caches},
    {"fp32 gradients", &MemoryEstimate::grads},
    {"AdamW moments", &MemoryEstimate::optimizer},
    {"router biases", &MemoryEstimate::router_bias},
    {"activations (arena)", &MemoryEstimate::activations},
    {"kernel scratch", &MemoryEstimate::kernel_scratch},
    {"backend buffers (cuda)", &MemoryEstimate::backend_buffers},
    {"pipeline copies, exchange plans", &MemoryEstimate::comm_buffers},
    {"step statistics", &MemoryEstimate::step_stats},
};

// A fraction as a percentage, 3 significant digits; a nonzero one below 1e-4 % is not printed as a
// figure (random routing's expected drops reach 1e-297 %).
std::string percent_text(double fraction) {
  const double v = 100 * fraction;
  if (v != 0 && std::fabs(v) < 1e-4) return "< 0.0001%";
  char b[32];
  std::snprintf(b, sizeof b, "%.3g%%", v);
  return b;
}

std::string layout_name(const Layout& L) {
  return "dp=" + std::to_string(L.dp) + " ep=" + std::to_string(L.ep) + " pp=" + std::to_string(L.pp);
}

// The plan's first lines: layout, micro-batches, precision; with EP the experts, their rows and drops.
void write_plan_header(std::ostringstream& o, const Config& config, const Plan& plan) {
  const Layout& L = plan.layout;
  o << "# moecore plan: " << layout_name(L) << " (world " << L.world() << ", edp " << L.edp() << "), "
    << plan.micro_batches << " micro-batch(es) of " << plan.tokens_per_micro << " tokens per rank per step, "
    << config.train.precision << (config.train.recompute ? ", block recompute" : "")
    << (config.parallel.zero1 ? ", ZeRO-1" : "") << "\n";
  if (L.ep > 1) {
    o << "# experts: " << config.model.num_experts / L.ep << " per rank; up to " << plan.expert_rows
      << " rows per micro-batch (" << (plan.capacity < 0 ? "dropless bound" : "capacity " + std::to_string(plan.capacity))
      << "); routes dropped " << percent_text(plan.drop_fraction) << " ("
      << (plan.exact_comm ? "exact: uniform routing" : "expected: random routing, normal approximation") << "); "
      << config.parallel.ep_transport << " transport\n";
    if (!plan.skewed_drops.empty()) {
      o << "# expected drops at this capacity if routing were random (skew 0) or skewed (expert e's weight (e+1)^-skew):";
      for (const auto& [skew, f] : plan.skewed_drops) {
        char b[32];
        std::snprintf(b, sizeof b, " skew %.1f ", skew);
        o << b << percent_text(f) << ";";
      }
      o << "\n";
    }
  }
}

// Memory per rank, a column per stage, by component; then the activation slots.
void write_memory_table(std::ostringstream& o, const Plan& plan) {
  char buf[256];
  double largest = 0;
  for (const PlannedStage& st : plan.stages) largest = std::max(largest, st.memory.total());
  const bool mib = largest < kGiB;  // small models read better in MiB
  const double unit = mib ? 1024.0 * 1024.0 : kGiB;
  o << "\n## memory per rank (" << (mib ? "MiB" : "GiB") << ")\n";
  std::snprintf(buf, sizeof buf, "%-52s", "component");
  o << buf;
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const PlannedStage& st = plan.stages[s];
    char name[64];
    if (st.chunks.size() > 1)  // interleaved: its chunks
      std::snprintf(name, sizeof name, "stage %zu, v=%zu", s, st.chunks.size());
    else
      std::snprintf(name, sizeof name, "stage %zu [%lld,%lld)", s, static_cast<long long>(st.layer_begin),
                    static_cast<long long>(st.layer_end));
    std::snprintf(buf, sizeof buf, " %14s", name);
    o << buf;
  }
  o << "\n";
  auto row = [&](const std::string& name, auto value) {
    std::snprintf(buf, sizeof buf, "%-52s", name.c_str());
    o << buf;
    for (const PlannedStage& st : plan.stages) {
      std::snprintf(buf, sizeof buf, " %14.4f", value(st) / unit);
      o << buf;
    }
    o << "\n";
  };
  for (const MemoryRow& r : kMemoryRows) {
    bool any = false;
    for (const PlannedStage& st : plan.stages) any = any || st.memory.*r.field > 0;
    if (any) row(r.name, [&](const PlannedStage& st) { return st.memory.*r.field; });
  }
  row("  of the arena: sized by the expert rows", [](const PlannedStage& st) { return st.expert_row_buffers; });
  row("total", [](const PlannedStage& st) { return st.memory.total(); });
  row("total, master weights sharded too (not in trainer)", [](const PlannedStage& st) { return st.total_sharded_master; });
  std::snprintf(buf, sizeof buf, "%-52s",
                plan.stages.front().chunks.size() > 1 ? "activation slots (busiest chunk)" : "activation slots (1F1B)");
  o << buf;
  for (const PlannedStage& st : plan.stages) {
    std::snprintf(buf, sizeof buf, " %14lld", static_cast<long long>(st.slots));
    o << buf;
  }
}

// What a checkpoint writes (all ranks, rank 0) and the host memory a save stages.
void write_checkpoint_line(std::ostringstream& o, const Plan& plan) {
  char buf[256];
  double checkpoint = 0;
  for (const PlannedRank& r : plan.ranks) checkpoint += r.checkpoint_bytes;
  double host = 0;
  for (const PlannedStage& st : plan.stages) host = std::max(host, st.checkpoint_host_bytes);
  std::snprintf(buf, sizeof buf, "\ncheckpoint: %.4f GiB in all, %.4f GiB from rank 0%s", checkpoint / kGiB,
                plan.ranks.front().checkpoint_bytes / kGiB, host > 0 ? "" : "\n");
  o << buf;
  if (host > 0) {
    std::snprintf(buf, sizeof buf, "; %.4f GiB of host memory per rank to stage it (cuda)\n", host / kGiB);
    o << buf;
  }
}

// Per stage, its rank that sends the most: every collective of its step.
void write_communication_tables(std::ostringstream& o, const Plan& plan) {
  char buf[256];
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const PlannedRank* most = nullptr;
    for (const PlannedRank& r : plan.ranks)
      if (r.coords.pp == static_cast<int64_t>(s) && (!most || r.bytes_sent() > most->bytes_sent())) most = &r;
    std::snprintf(buf, sizeof buf, "\n## communication per step: rank %lld (stage %zu, dp %lld, ep %lld), %.3f MB sent\n",
                  static_cast<long long>(most->rank), s, static_cast<long long>(most->coords.dp),
                  static_cast<long long>(most->coords.ep), most->bytes_sent() / 1e6);
    o << buf;
    std::snprintf(buf, sizeof buf, "%-6s %-15s %-28s %10s %16s %16s %8s\n", "group", "op", "what", "calls", "bytes sent",
                  "received", "link");
    o << buf;
    for (const PlannedCollective& c : most->comm) {
      std::snprintf(buf, sizeof buf, "%-6s %-15s %-28s %10.0f %16.0f %16.0f %8s%s\n", c.group.c_str(), c.op.c_str(),
                    c.what.c_str(), c.calls, c.bytes, c.received, c.link.c_str(), c.exact ? "" : "  (expected)");
      o << buf;
    }
  }
}

}  // namespace

std::string format_plan(const Config& config, const Plan& plan) {
  std::ostringstream o;
  write_plan_header(o, config, plan);
  write_memory_table(o, plan);
  write_checkpoint_line(o, plan);
  write_communication_tables(o, plan);
  return o.str();
}

std::string plan_to_json(const Config& config, const Plan& plan) { return plan_json(config, plan).dump(1) + "\n"; }

nlohmann::json plan_json(const Config& config, const Plan& plan) {
  using nlohmann::json;
  json j;
  const Layout& L = plan.layout;
  j["layout"] = {{"dp", L.dp}, {"ep", L.ep}, {"pp", L.pp}, {"edp", L.edp()}, {"world", L.world()}};
  j["precision"] = config.train.precision;
  j["micro_batches"] = plan.micro_batches;
  j["tokens_per_micro_batch"] = plan.tokens_per_micro;
  j["expert_rows"] = plan.expert_rows;
  j["capacity"] = plan.capacity;
  j["drop_fraction"] = plan.drop_fraction;
  j["comm_exact"] = plan.exact_comm;
  j["skewed_drops"] = json::array();
  for (const auto& [skew, f] : plan.skewed_drops) j["skewed_drops"].push_back({{"skew", skew}, {"drop_fraction", f}});
  json stages = json::array();
  for (const PlannedStage& st : plan.stages) {
    json m;
    for (const MemoryRow& r : kMemoryRows) m[r.name] = st.memory.*r.field;
    json chunks = json::array();
    for (const LayerRange& r : st.chunks) chunks.push_back({r.begin, r.end});
    stages.push_back({{"layers", {st.layer_begin, st.layer_end}},
                      {"chunks", chunks},
                      {"chunk_slots", st.chunk_slots},
                      {"moe_layers", st.moe_layers},
                      {"slots", st.slots},
                      {"memory_bytes", m},
                      {"total_bytes", st.memory.total()},
                      {"expert_row_buffer_bytes", st.expert_row_buffers},
                      {"checkpoint_host_bytes", st.checkpoint_host_bytes},
                      {"total_bytes_sharded_master", st.total_sharded_master}});
  }
  j["stages"] = stages;
  json ranks = json::array();
  for (const PlannedRank& r : plan.ranks) {
    json comm = json::array();
    for (const PlannedCollective& c : r.comm)
      comm.push_back({{"group", c.group}, {"op", c.op}, {"what", c.what}, {"calls", c.calls}, {"groups", c.groups}, {"bytes", c.bytes}, {"received", c.received},
                      {"exact", c.exact}, {"host", c.host}, {"link", c.link}});
    ranks.push_back({{"rank", r.rank},
                     {"pp", r.coords.pp},
                     {"dp", r.coords.dp},
                     {"ep", r.coords.ep},
                     {"edp", r.coords.edp},
                     {"bytes_sent", r.bytes_sent()},
                     {"checkpoint_bytes", r.checkpoint_bytes},
                     {"comm", comm}});
  }
  j["ranks"] = ranks;
  return j;
}

}  // namespace moe
