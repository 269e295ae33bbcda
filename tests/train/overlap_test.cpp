// train.overlap_host (Trainer::submit): the host enqueues step n+1 before it reads step n's
// record. The run must be the eager one's, bit for bit, also where the lag bites: a skipped
// non-finite step whose successor was already enqueued (the device leaves it out by the sticky
// flag, the host enqueues it again), random routing (its draws are numbered by the optimizer
// step, which the host only knows after the read), clipping, loss-free bias; and a non-finite
// step under "stop" stops the run at that step with nothing applied after it. On the strict
// backend, so a host read that comes too early shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/cli_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<json> read_jsonl(const fs::path& p) {
  std::vector<json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool measured(const std::string& key) {
  static const std::set<std::string> k{"step_s", "tokens_per_s", "tflops", "mfu", "peak_tflops", "peak_source", "peak_rss_mb", "elapsed_s", "pp_bubble_s",
                                       "to_host", "to_host_bytes", "to_device", "to_device_bytes",
                                       "staged_to_host_bytes", "staged_to_device_bytes"};
  return k.count(key) > 0;
}

class Overlap : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::fresh_test_dir("overlap_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    test::write_tokens(root_ / "train.bin", 6000);
  }
  void TearDown() override { if (!HasFailure()) fs::remove_all(root_); }
  // No evaluations and a checkpoint only at the end: every step but the last is handled late.
  test::CliResult train(bool overlap, const std::string& extra, const fs::path& out, const char* fault) {
    if (fault) ::setenv("MOE_INJECT_FAULT", fault, 1);
    const test::CliResult r = test::run_cli(
        "train" + test::tiny_model_sets() + " --set train.backend=strict --set train.steps=7 --set train.log_every=1" +
            " --set optim.max_grad_norm=0.05 --set data.train_path=" +
            (root_ / "train.bin").string() + " --set train.out_dir=" + out.string() +
            " --set train.overlap_host=" + (overlap ? "true" : "false") + extra,
        120);
    ::unsetenv("MOE_INJECT_FAULT");
    return r;
  }
  fs::path root_;
};

TEST_F(Overlap, LaggedRunsEqualEagerOnesBitwiseThroughSkipsAndRandomRouting) {
  for (const std::string routing : {"learned", "random"}) {
    SCOPED_TRACE(routing);
    const std::string extra = " --set train.on_nonfinite=skip --set model.routing=" + routing +
                              " --set model.router_bias_gamma=" + (routing == "learned" ? "0.01" : "0");
    const fs::path eager = root_ / (routing + "_eager"), lagged = root_ / (routing + "_lagged");
    // A NaN gradient at step 3: step 4 is already enqueued when the host learns of it.
    const test::CliResult e = train(false, extra, eager, "nangrad@0:3");
    ASSERT_EQ(e.status, 0) << e.output;
    const test::CliResult l = train(true, extra, lagged, "nangrad@0:3");
    ASSERT_EQ(l.status, 0) << l.output;
    const std::vector<json> a = read_jsonl(eager / "metrics.jsonl"), b = read_jsonl(lagged / "metrics.jsonl");
    ASSERT_EQ(a.size(), 7u);
    ASSERT_EQ(b.size(), 7u);
    int skipped = 0, clipped = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const auto& [key, value] : a[i].items())
        if (!measured(key)) {
          EXPECT_EQ(value, b[i].value(key, json())) << "step " << i + 1 << " field " << key;
        }
      skipped += a[i].value("skipped", false);
      clipped += a[i].value("clipped", false);
      // The device is read once per step; the skipped step also carries its successor's first,
      // discarded attempt (one more read, two more uploads).
      const bool skip = b[i].value("skipped", false);
      EXPECT_EQ(b[i].at("to_host").get<uint64_t>(), skip ? 2u : 1u) << "step " << i + 1;
      EXPECT_EQ(b[i].at("to_device").get<uint64_t>(), skip ? 4u : 2u) << "step " << i + 1;
    }
    EXPECT_EQ(skipped, 1);
    EXPECT_GE(clipped, 4);
    // Checkpoints are named by optimizer step: 7 batches, one skipped.
    const std::string last = "checkpoints/step_00000006/rank_00000.safetensors";
    const std::string state = file_bytes(eager / last);
    ASSERT_FALSE(state.empty());
    EXPECT_TRUE(state == file_bytes(lagged / last)) << "final training state";
  }
}

TEST_F(Overlap, ANonFiniteStepStopsTheRunThereWithNothingAppliedAfterIt) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "lagged" : "eager");
    const fs::path out = root_ / (overlap ? "lagged" : "eager");
    const test::CliResult r = train(overlap, " --set checkpoint.every=2", out, "nangrad@0:3");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("non-finite values at step 3"), std::string::npos) << r.output;
    EXPECT_EQ(read_jsonl(out / "metrics.jsonl").size(), 2u);
    const std::vector<json> ev = read_jsonl(out / "events.jsonl");
    ASSERT_FALSE(ev.empty());
    EXPECT_EQ(ev.back()["event"], "stop");
    EXPECT_EQ(ev.back()["step"], 3);
    // The last checkpoint is step 2's, whole; resuming from it replays step 3 exactly.
    EXPECT_TRUE(fs::exists(out / "checkpoints" / "step_00000002"));
  }
}

// Each record's step_s is its own step's time, lagged or not, on the cpu backend (steps run as
// they are enqueued) and on strict (its own thread): a step drained for an evaluation or a
// checkpoint once measured the next step's compute to the one before and ~0 to itself (10^8
// tokens/s at every evaluation). No step can be 5x faster than the median of identical steps
// (noise only slows steps); the steps' intervals never overlap (their sum fits in the run).
TEST_F(Overlap, EachRecordTimesItsOwnStepAcrossEvaluationsAndCheckpoints) {
  test::write_tokens(root_ / "valid.bin", 3000, 5);
  for (const std::string backend : {"cpu", "strict"}) {
    for (const bool overlap : {true, false}) {
      SCOPED_TRACE(backend + (overlap ? ", lagged" : ", eager"));
      const fs::path out = root_ / (backend + (overlap ? "_lagged" : "_eager"));
      const test::CliResult r = test::run_cli(
          "train" + test::tiny_model_sets() + " --set model.d_model=64 --set train.seq_len=64 --set train.steps=12" +
              " --set train.eval_every=3 --set train.eval_batches=4 --set checkpoint.every=4 --set train.log_every=1" +
              " --set train.backend=" +
              backend + " --set data.train_path=" + (root_ / "train.bin").string() +
              " --set data.valid_path=" + (root_ / "valid.bin").string() + " --set train.out_dir=" + out.string() +
              " --set train.overlap_host=" + (overlap ? "true" : "false"),
          120);
      ASSERT_EQ(r.status, 0) << r.output;
      const std::vector<json> m = read_jsonl(out / "metrics.jsonl");
      ASSERT_EQ(m.size(), 12u);
      std::vector<double> t;
      double sum = 0;
      for (const json& j : m) {
        const double s = j.at("step_s").get<double>();
        ASSERT_GT(s, 0) << "step " << j["step"];
        EXPECT_DOUBLE_EQ(j.at("tokens_per_s").get<double>(), j.at("tokens").get<double>() / s) << "step " << j["step"];
        t.push_back(s);
        sum += s;
      }
      EXPECT_LE(sum, m.back().at("elapsed_s").get<double>()) << "the steps' times overlap";
      std::vector<double> sorted = t;
      std::sort(sorted.begin(), sorted.end());
      const double median = sorted[sorted.size() / 2];
      for (size_t i = 0; i < t.size(); ++i)
        EXPECT_GE(t[i], median / 5) << "step " << i + 1 << " (evaluations after 3, 6, 9, checkpoints after 4, 8)";
      // The log's line per step says the record's pace: the last line once said millions of
      // tokens/s (the wall time between the last two records, handled back to back).
      for (const json& j : m) {
        const std::string head = "step " + std::to_string(j.at("step").get<int>()) + "/12 |";
        const size_t at = r.output.find(head);
        ASSERT_NE(at, std::string::npos) << head << "\n" << r.output;
        const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
        const size_t end = line.find(" tok/s"), begin = line.rfind("| ", end);
        ASSERT_NE(end, std::string::npos) << line;
        EXPECT_NEAR(std::stod(line.substr(begin + 2, end - begin - 2)), j.at("tokens_per_s").get<double>(), 0.5) << line;
      }
    }
  }
}

}  // namespace
}  // namespace moe
