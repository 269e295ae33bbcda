// The rows `moecore bench --kernels` prints (kernels/cuda/bench_rows.h) are what
// tests/golden/gpu_kernels.txt holds, the saved list scripts/gpu_check.sh's reader is tested on
// (tests/scripts/gpu_check_test.sh): the cuBLAS-best label is 29 characters, the value has decimals.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "common/paths.h"
#include "kernels/cuda/bench_rows.h"

namespace moe {
namespace {

TEST(KernelBenchRows, TheSavedListIsWhatTheBenchPrints) {
  std::ostringstream o;
  kernel_bench_row(o, "kernel", "shape", "TFLOP/s", "note");
  kernel_bench_row(o, "dense bf16 GEMM (linear_fwd)", "8192 x 8192 x 8192, fp32 out", 612.25, "cuBLASLt, no split-K");
  kernel_bench_row(o, "dense bf16 GEMM (cuBLAS best)", "8192 x 8192 x 8192, fp32 out", 650.31, "fastest of 16 heuristic algorithms");
  kernel_bench_row(o, "grouped bf16 fwd (CUTLASS)", "32 x 128 rows, 2048 x 2048", 301.4, "49% of dense (linear_fwd)");
  kernel_bench_row(o, "grouped bf16 wgrad (SIMT)", "8 x 2048 rows, 2048 x 2048", 41.0, "7% of dense (linear_fwd)");
  kernel_bench_row(o, "attention fwd (cuDNN)", "B2 S4096 H16 hd128 causal", 455.9, "bf16 products, fp32 storage");
  kernel_bench_row(o, "attention bwd (ours)", "B2 S4096 H16 hd128 causal", 88.7, "2.5x the forward's FLOPs");
  std::ifstream in(std::string(test::source_dir()) + "/tests/golden/gpu_kernels.txt");
  ASSERT_TRUE(in) << "tests/golden/gpu_kernels.txt";
  std::stringstream saved;
  saved << in.rdbuf();
  EXPECT_EQ(o.str(), saved.str());
}

TEST(KernelBenchRows, ALabelLongerThanItsColumnKeepsTheSeparators) {
  std::ostringstream o;
  kernel_bench_row(o, "grouped bf16 dgrad (CUTLASS+SIMT) and more", "s", 1.25, "n");
  EXPECT_EQ(o.str(), "grouped bf16 dgrad (CUTLASS+SIMT) and more | s                                  |       1.2 | n\n");
}

}  // namespace
}  // namespace moe
