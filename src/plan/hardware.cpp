#include "plan/hardware.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "core/check.h"
#include "core/user_path.h"

namespace moe {

namespace {

struct Preset {
  const char* name;
  const char* text;
};
// configs/clusters/*.toml, built in by CMake.
constexpr Preset kPresets[] = {
#include "plan/cluster_presets.inc"
};

// Reads one table's keys into the cluster, refusing unknown keys, missing ones and numbers
// without a source.
class Reader {
 public:
  Reader(const toml::table& root, std::string source) : root_(root), source_(std::move(source)) {
    if (const toml::table* s = root_["sources"].as_table())
      for (auto&& [k, v] : *s) {
        MOE_CHECK(v.is_string(), source_, ": sources.", std::string(k.str()), " must be a string");
        sources_[std::string(k.str())] = *v.value<std::string>();
      }
  }
  const toml::table& table(const std::string& name) {
    const toml::table* t = root_[name].as_table();
    MOE_CHECK(t, source_, ": missing the [", name, "] table");
    for (auto&& [k, v] : *t) known_[name].insert(std::string(k.str()));
    return *t;
  }
  double number(const std::string& section, const std::string& key, double lo, double hi) {
    const std::string full = section.empty() ? key : section + "." + key;
    const toml::node* n = section.empty() ? root_.get(key) : table(section).get(key);
    MOE_CHECK(n && (n->is_floating_point() || n->is_integer()), source_, ": ", full, " must be a number");
    const double v = n->is_integer() ? static_cast<double>(*n->value<int64_t>()) : *n->value<double>();
    MOE_CHECK(std::isfinite(v) && v >= lo && v <= hi, source_, ": ", full, " = ", v, " is outside [", lo, ", ", hi, "]");
    cite(full);
    used_[section].insert(key);
    return v;
  }
  Curve curve(const std::string& section, const std::string& key, double ylo, double yhi) {
    const std::string full = section.empty() ? key : section + "." + key;
    const toml::array* a = table(section).get_as<toml::array>(key);
    MOE_CHECK(a && !a->empty(), source_, ": ", full, " must be a list of [x, y] points");
    Curve c;
    for (const toml::node& p : *a) {
      const toml::array* xy = p.as_array();
      MOE_CHECK(xy && xy->size() == 2, source_, ": ", full, ": every point is [x, y]");
      double v[2];
      for (size_t i = 0; i < 2; ++i) {
        const toml::node& e = *xy->get(i);
        MOE_CHECK(e.is_integer() || e.is_floating_point(), source_, ": ", full, ": points are numbers");
        v[i] = e.is_integer() ? static_cast<double>(*e.value<int64_t>()) : *e.value<double>();
      }
      MOE_CHECK(v[0] > 0 && v[1] >= ylo && v[1] <= yhi, source_, ": ", full, ": point [", v[0], ", ", v[1],
                "] needs x > 0 and y in [", ylo, ", ", yhi, "]");
      MOE_CHECK(c.points.empty() || v[0] > c.points.back().first, source_, ": ", full, ": x must increase");
      c.points.emplace_back(v[0], v[1]);
    }
    cite(full);
    used_[section].insert(key);
    return c;
  }
  std::string text(const std::string& section, const std::string& key) {
    const toml::node* n = section.empty() ? root_.get(key) : table(section).get(key);
    MOE_CHECK(n && n->is_string(), source_, ": ", section.empty() ? key : section + "." + key, " must be a string");
    used_[section].insert(key);
    return *n->value<std::string>();
  }
  void finish() {
    for (auto&& [k, v] : root_) {
      const std::string key(k.str());
      if (key == "sources" || v.is_table()) continue;
      MOE_CHECK(used_[""].count(key), source_, ": unknown key '", key, "'");
    }
    for (const auto& [section, keys] : known_)
      for (const std::string& k : keys)
        MOE_CHECK(used_[section].count(k), source_, ": unknown key '", section, ".", k, "'");
    for (auto&& [k, v] : root_)
      if (v.is_table() && std::string(k.str()) != "sources")
        MOE_CHECK(known_.count(std::string(k.str())), source_, ": unknown table [", std::string(k.str()), "]");
  }
  std::map<std::string, std::string> sources() const { return sources_; }

 private:
  void cite(const std::string& full) {
    MOE_CHECK(sources_.count(full) && !sources_.at(full).empty(), source_, ": ", full,
              " has no source (add sources.\"", full, "\" = \"where the number comes from\")");
  }
  const toml::table& root_;
  std::string source_;
  std::map<std::string, std::string> sources_;
  std::map<std::string, std::set<std::string>> known_, used_;
};

}  // namespace

double Curve::at(double x) const {
  MOE_CHECK(!points.empty(), "empty efficiency curve");
  if (x <= points.front().first) return points.front().second;
  if (x >= points.back().first) return points.back().second;
  size_t i = 1;
  while (points[i].first < x) ++i;
  const auto [x0, y0] = points[i - 1];
  const auto [x1, y1] = points[i];
  const double f = (std::log(x) - std::log(x0)) / (std::log(x1) - std::log(x0));
  return y0 + f * (y1 - y0);
}

Cluster parse_cluster(const std::string& toml_text, const std::string& source_name) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    MOE_FAIL("cluster file parse error: ", e.description(), " at ", source_name, ":", e.source().begin.line, ":",
             e.source().begin.column);
  }
  Reader r(root, source_name);
  Cluster c;
  c.name = r.text("", "name");
  const double gib = 1024.0 * 1024.0 * 1024.0;
  c.nodes = static_cast<int64_t>(r.number("", "nodes", 1, 1e6));
  c.ranks_per_node = static_cast<int64_t>(r.number("", "ranks_per_node", 1, 1e4));
  DeviceSpec& d = c.device;
  d.kind = r.text("device", "kind");
  d.backend = r.text("device", "backend");
  MOE_CHECK(d.backend == "cpu" || d.backend == "cuda", source_name, ": device.backend = \"", d.backend,
            "\" is not one of cpu, cuda");
  d.memory_bytes = r.number("device", "memory_gib", 1e-3, 1e6) * gib;
  d.reserved_bytes = r.number("device", "reserved_gib", 0, 1e6) * gib;
  d.process_bytes = r.number("device", "process_mib", 0, 1e9) * 1024.0 * 1024.0;
  d.bf16_flops = r.number("device", "bf16_tflops", 1e-6, 1e6) * 1e12;
  d.fp32_flops = r.number("device", "fp32_tflops", 1e-6, 1e6) * 1e12;
  d.memory_bytes_per_s = r.number("device", "memory_gbps", 1e-3, 1e6) * 1e9;
  d.memory_efficiency = r.number("device", "memory_efficiency", 1e-3, 1);
  d.storage_bytes_per_s = r.number("device", "storage_gbps", 1e-6, 1e6) * 1e9;
  d.timing_spread = r.number("device", "timing_spread", 0, 10);
  d.power_capped_gemm = r.number("device", "power_capped_gemm", 1e-3, 1);
  d.attention_efficiency = r.number("device", "attention_efficiency", 1e-3, 1);
  d.attention_efficiency_fp32 = r.number("device", "attention_efficiency_fp32", 1e-3, 1);
  d.gemm_efficiency = r.curve("device", "gemm_efficiency", 1e-3, 1);
  d.grouped_efficiency = r.curve("device", "grouped_efficiency", 1e-3, 1);
  c.intra.bytes_per_s = r.number("network", "intra_gbps", 1e-6, 1e6) * 1e9;
  c.intra.latency_s = r.number("network", "intra_latency_us", 0, 1e6) * 1e-6;
  c.intra.efficiency = r.curve("network", "intra_efficiency", 1e-3, 1);
  c.inter.bytes_per_s = r.number("network", "inter_gbps", 1e-6, 1e6) * 1e9;
  c.inter.latency_s = r.number("network", "inter_latency_us", 0, 1e6) * 1e-6;
  c.inter.efficiency = r.curve("network", "inter_efficiency", 1e-3, 1);
  r.finish();
  MOE_CHECK(d.reserved_bytes + d.process_bytes < d.memory_bytes, source_name,
            ": device.reserved_gib + device.process_mib is not below device.memory_gib");
  c.sources = r.sources();
  return c;
}

std::string cluster_to_toml(const Cluster& c) {
  std::ostringstream o;
  o.precision(17);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const auto quoted = [](const std::string& s) {
    std::string q = "\"";
    for (char ch : s) q += ch == '"' || ch == '\\' ? std::string("\\") + ch : std::string(1, ch);
    return q + "\"";
  };
  const auto curve = [&](const Curve& k) {
    std::ostringstream s;
    s.precision(17);
    s << "[";
    for (size_t i = 0; i < k.points.size(); ++i) s << (i ? ", " : "") << "[" << k.points[i].first << ", " << k.points[i].second << "]";
    return s.str() + "]";
  };
  const DeviceSpec& d = c.device;
  o << "name = " << quoted(c.name) << "\nnodes = " << c.nodes << "\nranks_per_node = " << c.ranks_per_node << "\n\n[device]\n"
    << "backend = " << quoted(d.backend) << "\nkind = " << quoted(d.kind) << "\nmemory_gib = " << d.memory_bytes / gib
    << "\nreserved_gib = " << d.reserved_bytes / gib << "\nprocess_mib = " << d.process_bytes / (1024.0 * 1024.0)
    << "\nbf16_tflops = " << d.bf16_flops / 1e12
    << "\nfp32_tflops = " << d.fp32_flops / 1e12 << "\nmemory_gbps = " << d.memory_bytes_per_s / 1e9
    << "\nmemory_efficiency = " << d.memory_efficiency << "\nstorage_gbps = " << d.storage_bytes_per_s / 1e9 << "\ntiming_spread = " << d.timing_spread << "\npower_capped_gemm = " << d.power_capped_gemm << "\nattention_efficiency = " << d.attention_efficiency
    << "\nattention_efficiency_fp32 = " << d.attention_efficiency_fp32 << "\ngemm_efficiency = " << curve(d.gemm_efficiency)
    << "\ngrouped_efficiency = " << curve(d.grouped_efficiency) << "\n\n[network]\nintra_gbps = " << c.intra.bytes_per_s / 1e9
    << "\nintra_latency_us = " << c.intra.latency_s * 1e6 << "\nintra_efficiency = " << curve(c.intra.efficiency)
    << "\ninter_gbps = " << c.inter.bytes_per_s / 1e9 << "\ninter_latency_us = " << c.inter.latency_s * 1e6
    << "\ninter_efficiency = " << curve(c.inter.efficiency) << "\n\n[sources]\n";
  for (const auto& [k, v] : c.sources) o << quoted(k) << " = " << quoted(v) << "\n";
  return o.str();
}

std::vector<std::string> cluster_presets() {
  std::vector<std::string> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name);
  return out;
}

Cluster load_cluster(const std::string& name_or_path) {
  std::string name = name_or_path;
  int64_t ranks = 0;
  const size_t x = name.rfind('x');
  if (x != std::string::npos && x + 1 < name.size() &&
      name.find_first_not_of("0123456789", x + 1) == std::string::npos) {
    const std::string base = name.substr(0, x);
    for (const Preset& p : kPresets)
      if (base == p.name) {
        ranks = std::stoll(name.substr(x + 1));
        name = base;
      }
  }
  for (const Preset& p : kPresets)
    if (name == p.name) {
      Cluster c = parse_cluster(p.text, std::string("preset ") + p.name);
      if (ranks > 0) {
        MOE_CHECK(ranks % c.ranks_per_node == 0 || ranks < c.ranks_per_node, "--cluster ", name_or_path, ": ", ranks,
                  " ranks are not whole nodes of ", c.ranks_per_node);
        if (ranks < c.ranks_per_node) c.ranks_per_node = ranks;
        c.nodes = std::max<int64_t>(1, ranks / c.ranks_per_node);
        c.name = name_or_path;
      }
      return c;
    }
  std::string presets;
  for (const Preset& p : kPresets) presets += std::string(presets.empty() ? "" : ", ") + p.name;
  MOE_CHECK(name_or_path.find('/') != std::string::npos || name_or_path.find(".toml") != std::string::npos,
            "--cluster ", name_or_path, ": not a preset (presets: ", presets, ", each optionally xN ranks) and not a file path");
  return parse_cluster(read_input_file(name_or_path, "--cluster"), name_or_path);
}

std::string peak_source(const Cluster& cluster) {
  const auto it = cluster.sources.find("device.bf16_tflops");
  return it != cluster.sources.end() && it->second.rfind("calibration", 0) == 0 ? "calibration" : "datasheet";
}

}  // namespace moe
