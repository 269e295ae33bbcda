// moecore bench --calibrate on a tiny config: a cluster file that the planner reads back, every
// measured number citing this run, and the kernels timed on the threads the peaks are measured at.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "common/small_config.h"
#include "config/config.h"
#include "kernels/cpu/cpu_ops.h"
#include "plan/calibrate.h"
#include "plan/hardware.h"

namespace moe {
namespace {

TEST(Calibrate, WritesAClusterFileMeasuredOnTrainThreads) {
  const int saved = cpu::num_threads();
  Config c = test::small_config();  // the training tests' small model
  c.train.threads = 1;
  CalibrateOptions o;
  o.min_seconds = 0.002;
  std::ostringstream log;
  const std::string text = calibrate_machine(c, o, log);
  // Before, calibrate measured the peaks on train.threads and timed the kernels on every core.
  EXPECT_EQ(cpu::num_threads(), 1);
  cpu::set_num_threads(saved);
  const Cluster cluster = parse_cluster(text, "calibration");
  EXPECT_GT(cluster.device.fp32_flops, 0);
  EXPECT_GT(cluster.device.bf16_flops, 0);
  EXPECT_NE(cluster.name.find("-calibrated"), std::string::npos) << cluster.name;
  const std::string peak_source = cluster.sources.at("device.fp32_tflops");
  EXPECT_NE(peak_source.find("1 thread(s) per rank"), std::string::npos) << peak_source;
  EXPECT_NE(peak_source.find("moecore bench --calibrate"), std::string::npos) << peak_source;
  EXPECT_NE(log.str().find("attention:"), std::string::npos) << log.str();
}

}  // namespace
}  // namespace moe
