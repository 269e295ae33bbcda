// Hardware as data: a cluster file (TOML) names a device kind with its peak rates, memory and
// efficiency curves, and the links within and across nodes. Every number carries its source (a
// row of a reference file, a spec sheet, a calibration run, or "guess: why"); a number without
// one is refused. Presets live in configs/clusters/ and are built into the binary.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moe {

// y(x) through (x, y) points, linear in log(x) between them, flat beyond the ends.
struct Curve {
  std::vector<std::pair<double, double>> points;
  double at(double x) const;
};

struct DeviceSpec {
  std::string kind;
  std::string backend = "cpu";  // train.backend the ranks run (memory: the backend's own buffers)
  double memory_bytes = 0;    // usable by one rank
  double reserved_bytes = 0;  // context, communicator and allocator slack, off the top
  double process_bytes = 0;   // what one rank's process holds before it plans anything (code, libraries, runtime)
  double bf16_flops = 0, fp32_flops = 0;  // dense peak FLOP/s
  double memory_bytes_per_s = 0;          // peak memory bandwidth
  double memory_efficiency = 1;           // memory-bound kernels' fraction of it
  double storage_bytes_per_s = 0;         // one rank's checkpoint writes (fsync'd) to its store
  double power_capped_gemm = 1;  // GEMM rate under the power cap, as a fraction of the uncapped (1: no source gives one)
  double timing_spread = 0;  // relative spread of the calibration's repeated measurements (error bars; 0 = unknown)
  double attention_efficiency = 1;        // attention kernels' fraction of the bf16 peak (bf16 runs)
  double attention_efficiency_fp32 = 1;   // ... of the fp32 peak (fp32 runs)
  Curve gemm_efficiency;      // dense GEMM: fraction of the peak by FLOPs per call (2 m n k)
  Curve grouped_efficiency;   // grouped expert GEMM: fraction of the dense rate (a GEMM of its whole size) by rows per expert
};

struct LinkSpec {
  double bytes_per_s = 0;  // per rank, per direction
  double latency_s = 0;    // per call
  Curve efficiency;        // fraction of bytes_per_s by message bytes
};

struct Cluster {
  std::string name;
  int64_t nodes = 1, ranks_per_node = 1;
  DeviceSpec device;
  LinkSpec intra, inter;  // within a node, across nodes
  std::map<std::string, std::string> sources;  // key -> where its number comes from
  int64_t ranks() const { return nodes * ranks_per_node; }
};

// Parses a cluster file's text; errors name the file and the key.
Cluster parse_cluster(const std::string& toml_text, const std::string& source_name);
// A preset name ("h200"; "h200x64": 64 ranks of that node type, nodes = 64 / ranks_per_node) or
// a path to a cluster file (with "xN" allowed after a preset name only).
Cluster load_cluster(const std::string& name_or_path);
// A cluster file that parse_cluster reads back to the same cluster (sources included).
std::string cluster_to_toml(const Cluster& cluster);
// Where a cluster's peak FLOP/s come from: "calibration" when `moecore bench --calibrate` measured
// them (its sources say so), else "datasheet" (a preset's cited figures, or a hand-written file's).
std::string peak_source(const Cluster& cluster);
// The built-in presets' names.
std::vector<std::string> cluster_presets();

}  // namespace moe
