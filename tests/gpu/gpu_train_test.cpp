// Whole training runs on the cuda backend (label gpu; each test reports Skipped without a GPU):
// `moecore train --set train.backend=cuda` against the cpu backend and against itself.
//  - fp32 runs match cpu within the stated bounds; every run repeats bitwise; the non-deterministic
//    attention backward follows the deterministic one;
//  - a plain step reads the device exactly once (the strict backend's budget);
//  - a checkpoint written on the GPU resumes on the CPU and the reverse;
//  - expert parallelism (two ranks on the one GPU, over MPI) with both expert transports;
//  - 200 bf16 steps of the default config on the KJV data follow docs/default_loss_curve.csv.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/paths.h"
#include "config/config.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/params.h"
#include "common/cli_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class GpuTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no GPU: " << why;
    root_ = test::fresh_test_dir("gpu_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    test::write_tokens(root_ / "train.bin", 20000);
    test::write_tokens(root_ / "valid.bin", 2000, 5);
  }
  void TearDown() override {
    if (!root_.empty()) fs::remove_all(root_);
  }

  test::CliResult train(const std::string& backend, const std::string& extra, const fs::path& out, bool resume = false,
                        const std::string& launcher = "") {
    return test::run_cli("train" + test::tiny_model_sets() + " --set train.log_every=1 --set train.backend=" + backend +
                             " --set data.train_path=" + (root_ / "train.bin").string() +
                             " --set data.valid_path=" + (root_ / "valid.bin").string() + " --set train.out_dir=" +
                             out.string() + extra + (resume ? " --resume" : ""),
                         300, launcher);
  }

  fs::path root_;
};

bool measured(const std::string& key) {
  static const std::set<std::string> k{"step_s", "tokens_per_s", "tflops", "mfu", "peak_tflops", "peak_source", "peak_rss_mb", "peak_device_mb", "elapsed_s",
                                       "pp_bubble_s", "to_host", "to_host_bytes", "to_device", "to_device_bytes",
                                       "staged_to_host_bytes", "staged_to_device_bytes"};
  return k.count(key) > 0;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// fp32 cuda against fp32 cpu, six steps. The kernels compute the same functions in another
// summation order (and full-fp32 GEMMs, no TF32), so the first step's loss agrees to the golden
// fp32 tolerance (1e-5 relative); AdamW then amplifies the differences step by step (its update is
// m/sqrt(v): direction-sensitive for tiny gradients), so later steps are held to 1e-3.
TEST_F(GpuTrain, Fp32RunMatchesCpu) {
  const std::string extra = " --set train.steps=6";
  ASSERT_EQ(train("cpu", extra, root_ / "cpu").status, 0);
  const test::CliResult g = train("cuda", extra, root_ / "cuda");
  ASSERT_EQ(g.status, 0) << g.output;
  const std::vector<json> a = test::read_metrics(root_ / "cpu"), b = test::read_metrics(root_ / "cuda");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i].at("loss").get<double>(), lb = b[i].at("loss").get<double>();
    EXPECT_LE(std::fabs(la - lb), (i == 0 ? 1e-5 : 1e-3) * std::fabs(la)) << "step " << i + 1;
    const double na = a[i].at("grad_norm").get<double>(), nb = b[i].at("grad_norm").get<double>();
    EXPECT_LE(std::fabs(na - nb), (i == 0 ? 1e-4 : 1e-2) * na) << "grad norm, step " << i + 1;
  }
}

// Ten steps twice, fp32 and bf16, with checkpoints: every logged number and the final training
// state byte for byte (no atomics, fixed reduction orders, cached GEMM algorithms).
TEST_F(GpuTrain, RepeatsBitwise) {
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const std::string extra = " --set train.steps=10 --set checkpoint.every=5 --set train.precision=" + precision;
    const fs::path one = root_ / (precision + "_1"), two = root_ / (precision + "_2");
    const test::CliResult r1 = train("cuda", extra, one), r2 = train("cuda", extra, two);
    ASSERT_EQ(r1.status, 0) << r1.output;
    ASSERT_EQ(r2.status, 0) << r2.output;
    const std::vector<json> a = test::read_metrics(one), b = test::read_metrics(two);
    ASSERT_EQ(a.size(), 10u);
    ASSERT_EQ(b.size(), 10u);
    for (size_t i = 0; i < a.size(); ++i)
      for (const auto& [key, value] : a[i].items()) {
        if (!measured(key)) {
          EXPECT_EQ(value, b[i].value(key, json())) << "step " << i + 1 << " field " << key;
        }
      }
    const std::string last = "checkpoints/step_00000010/rank_00000.safetensors";
    const std::string state = file_bytes(one / last);
    ASSERT_FALSE(state.empty());
    EXPECT_TRUE(state == file_bytes(two / last));
  }
}

// train.deterministic_attention = false: cuDNN's default attention backward (atomics for dQ, no dP
// workspace). The first step's forward is the same kernels: its loss is bitwise the deterministic
// run's; dQ's summation order then differs by fp32 roundings, which bf16 weight copies and AdamW
// carry into later steps: held to 1e-2 relative (bf16 runs of different kernels differ by ~1e-3).
TEST_F(GpuTrain, NondeterministicAttentionFollowsTheDeterministicRun) {
  const std::string extra = " --set train.steps=10 --set train.precision=bf16";
  const test::CliResult a = train("cuda", extra, root_ / "det");
  const test::CliResult b = train("cuda", extra + " --set train.deterministic_attention=false", root_ / "atomic");
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(b.status, 0) << b.output;
  const std::vector<json> x = test::read_metrics(root_ / "det"), y = test::read_metrics(root_ / "atomic");
  ASSERT_EQ(x.size(), 10u);
  ASSERT_EQ(y.size(), 10u);
  EXPECT_EQ(x[0].at("loss").get<double>(), y[0].at("loss").get<double>());
  for (size_t i = 1; i < x.size(); ++i) {
    const double la = x[i].at("loss").get<double>(), lb = y[i].at("loss").get<double>();
    EXPECT_LE(std::fabs(la - lb), 1e-2 * std::fabs(la)) << "step " << i + 1;
  }
}

// The strict backend's budget (tests/train/strict_train_test.cpp): one download per plain step,
// the batch's ids and labels up.
TEST_F(GpuTrain, APlainStepReadsTheDeviceOnce) {
  const test::CliResult r = train("cuda", " --set train.steps=4", root_ / "cuda");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const json& s : test::read_metrics(root_ / "cuda")) {
    EXPECT_EQ(s.at("to_host").get<uint64_t>(), 1u) << s.dump();
    EXPECT_EQ(s.at("to_device").get<uint64_t>(), 2u) << s.dump();
  }
}

// Expert parallelism with the GPU: two ranks under mpirun share the one GPU (NCCL refuses two
// ranks on one device, so the payload is staged through the host over MPI), EP=2, fp32, both
// transports against the cpu backend at the same layout (bounds as in Fp32RunMatchesCpu); the
// padded transport reads the device once per plain step, the p2p one also per plan.
TEST_F(GpuTrain, ExpertParallelOverMpiMatchesCpu) {
  // A GPU machine may have our libraries unpacked but no working launcher (scripts/gpu_check.sh).
  if (std::string(::moe::test::mpiexec()).empty() || std::system((std::string(::moe::test::mpiexec()) + " --version > /dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "no working mpirun (" << ::moe::test::mpiexec() << ")";
  const std::string mpi = std::string(::moe::test::mpiexec()) + " --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 ";
  const std::string extra = " --set train.steps=4 --set parallel.dp=2 --set parallel.ep=2";
  const test::CliResult c = train("cpu", extra, root_ / "cpu", false, mpi);
  ASSERT_EQ(c.status, 0) << c.output;
  const std::vector<json> a = test::read_metrics(root_ / "cpu");
  ASSERT_EQ(a.size(), 4u);
  for (const std::string transport : {"p2p", "padded"}) {
    SCOPED_TRACE(transport);
    const fs::path out = root_ / ("cuda_" + transport);
    const test::CliResult g = train("cuda", extra + " --set parallel.ep_transport=" + transport, out, false, mpi);
    ASSERT_EQ(g.status, 0) << g.output;
    const std::vector<json> b = test::read_metrics(out);
    ASSERT_EQ(b.size(), 4u);
    for (size_t i = 0; i < a.size(); ++i) {
      const double la = a[i].at("loss").get<double>(), lb = b[i].at("loss").get<double>();
      EXPECT_LE(std::fabs(la - lb), (i == 0 ? 1e-5 : 1e-3) * std::fabs(la)) << "step " << i + 1;
      const uint64_t reads = b[i].at("to_host").get<uint64_t>();
      if (transport == "padded") EXPECT_EQ(reads, 1u) << "step " << i + 1;
      else EXPECT_GT(reads, 1u) << "step " << i + 1;
    }
  }
}

// A checkpoint moves between devices: nine steps on one backend with a checkpoint at step 4, then
// steps 5-9 again from that checkpoint on the other backend and on the same one. fp32; the five
// losses agree to the golden fp32 tolerance (1e-5 relative): the state is the same bytes, only the
// summation order differs.
TEST_F(GpuTrain, CheckpointsMoveBetweenCpuAndGpu) {
  const std::string extra = " --set train.steps=9 --set checkpoint.every=4";
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{{"cuda", "cpu"}, {"cpu", "cuda"}}) {
    SCOPED_TRACE(from + " -> " + to);
    const fs::path same = root_ / (from + "_same"), moved = root_ / (from + "_to_" + to);
    ASSERT_EQ(train(from, extra, same).status, 0);
    for (const auto& d : fs::directory_iterator(same / "checkpoints"))
      if (d.path().filename() != "step_00000004") fs::remove_all(d.path());
    fs::copy(same, moved, fs::copy_options::recursive);
    const test::CliResult a = train(from, extra, same, true), b = train(to, extra, moved, true);
    ASSERT_EQ(a.status, 0) << a.output;
    ASSERT_EQ(b.status, 0) << b.output;
    ASSERT_NE(b.output.find("resumed from"), std::string::npos) << b.output;
    const std::vector<json> ma = test::read_metrics(same), mb = test::read_metrics(moved);
    ASSERT_EQ(ma.size(), 9u);
    ASSERT_EQ(mb.size(), 9u);
    for (size_t i = 4; i < 9; ++i) {
      const double la = ma[i].at("loss").get<double>(), lb = mb[i].at("loss").get<double>();
      EXPECT_LE(std::fabs(la - lb), 1e-5 * std::fabs(la)) << "step " << i + 1;
    }
  }
}

// A model too large for the GPU: the run ends with an error that names the component being
// allocated and this rank's estimate, not a bare CUDA error.
TEST_F(GpuTrain, OutOfDeviceMemoryNamesTheComponentAndTheEstimate) {
  const test::CliResult r = train("cuda", " --set train.steps=2 --set model.d_model=32768 --set model.n_heads=256"
                                  " --set model.n_kv_heads=256 --set model.n_layers=64 --set model.expert_hidden=32768",
                                  root_ / "oom");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("out of device memory allocating"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" for parameters, gradients"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("this rank's estimate is"), std::string::npos) << r.output;
}

// bf16 on the GPU, configs/default.toml on the KJV data (its whole 1,100-step schedule, so the
// learning rates are the curve's), against the committed fp32 cpu curve: the mean train loss of
// each 25-step window of the first 200 steps within 2%.
TEST(GpuKjv, Bf16DefaultRunFollowsTheCommittedCurve) {
  std::string why;
  if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no GPU: " << why;
  const fs::path data = fs::path(::moe::test::source_dir()) / "data" / "kjv";
  if (!fs::exists(data / "train.bin")) GTEST_SKIP() << "no " << (data / "train.bin") << " (scripts/train_default.sh prepares it)";
  const fs::path out = test::fresh_test_dir("gpu_kjv");
  const test::CliResult r = test::run_cli("train --config " + (fs::path(::moe::test::source_dir()) / "configs/default.toml").string() +
                                              " --set train.backend=cuda --set train.precision=bf16"
                                              " --set train.eval_every=0 --set checkpoint.every=0 --set train.out_dir=" +
                                              out.string() + " --set data.train_path=" + (data / "train.bin").string() +
                                              " --set data.valid_path=" + (data / "valid.bin").string(),
                                          900);
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<double> curve;
  std::ifstream in(fs::path(::moe::test::source_dir()) / "docs/default_loss_curve.csv");
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#' || line.rfind("step", 0) == 0) continue;
    std::stringstream ss(line);
    std::string step, elapsed, loss;
    std::getline(ss, step, ',');
    std::getline(ss, elapsed, ',');
    std::getline(ss, loss, ',');
    curve.push_back(std::stod(loss));
  }
  const std::vector<json> m = test::read_metrics(out);
  ASSERT_GE(m.size(), 200u);
  ASSERT_GE(curve.size(), 200u);
  for (size_t w = 0; w < 200; w += 25) {
    double a = 0, b = 0;
    for (size_t i = w; i < w + 25; ++i) {
      a += m[i].at("loss").get<double>();
      b += curve[i];
    }
    EXPECT_LE(std::fabs(a - b), 0.02 * b) << "steps " << w + 1 << "-" << w + 25 << ": " << a / 25 << " vs " << b / 25;
  }
  fs::remove_all(out);
}

}  // namespace
}  // namespace moe
