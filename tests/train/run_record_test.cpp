// What a run leaves behind, across resumes: metrics.jsonl continues exactly from the checkpoint
// (no repeated or missing step, whatever the killed run wrote after it), events.jsonl records
// start / resume / checkpoint / eval / skipped / stop, config.toml is the starting config,
// elapsed_s is stitched across resumes, and printed losses carry every digit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "common/cli_util.h"
#include "train/metrics.h"

namespace moe {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using test::run_cli;

std::vector<json> read_jsonl(const fs::path& p) {
  std::vector<json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) out.push_back(json::parse(line));
  return out;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct RunDir {
  fs::path root, data;
  std::string sets(const fs::path& out, int64_t steps, int64_t every) const {
    return test::tiny_model_sets() + " --set data.train_path=" + data.string() + " --set train.out_dir=" + out.string() +
           " --set train.steps=" + std::to_string(steps) + " --set checkpoint.every=" + std::to_string(every) +
           " --set checkpoint.keep_last=100";
  }
};

RunDir make_run(const std::string& name) {
  RunDir r;
  r.root = test::fresh_test_dir(name);
  r.data = r.root / "train.bin";
  test::write_tokens(r.data, 6000);
  return r;
}

TEST(RunRecord, MetricsContinueExactlyFromTheCheckpointAfterAKill) {
  const RunDir run = make_run("metrics_resume");
  const fs::path ref = run.root / "ref", out = run.root / "killed";
  ASSERT_EQ(run_cli("train" + run.sets(ref, 8, 2)).status, 0);
  const std::vector<json> want = read_jsonl(ref / "metrics.jsonl");
  ASSERT_EQ(want.size(), 8u);
  // The killed run: it wrote steps 1-8 but its checkpoints of steps 6 and 8 never completed (a
  // kill during the save), and the kill cut its last line in half.
  ASSERT_EQ(run_cli("train" + run.sets(out, 8, 2)).status, 0);
  fs::remove_all(out / "checkpoints" / checkpoint_name(8));
  fs::rename(out / "checkpoints" / checkpoint_name(6), out / "checkpoints" / (".tmp." + checkpoint_name(6) + ".1"));
  { std::ofstream(out / "metrics.jsonl", std::ios::app) << "{\"step\": 9, \"loss\": 2."; }
  const test::CliResult resumed = run_cli("train" + run.sets(out, 8, 2) + " --resume");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("dropped 4 record(s) after step 4 and 1 incomplete line(s)"), std::string::npos)
      << resumed.output;
  const std::vector<json> got = read_jsonl(out / "metrics.jsonl");
  ASSERT_EQ(got.size(), 8u) << "each step exactly once";
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i]["step"], static_cast<int64_t>(i + 1));
    EXPECT_EQ(got[i]["loss"].get<double>(), want[i]["loss"].get<double>()) << "step " << i + 1;  // bit-exact resume
    EXPECT_EQ(got[i]["grad_norm"].get<double>(), want[i]["grad_norm"].get<double>()) << "step " << i + 1;
  }
  // elapsed_s continues from the checkpoint's (stitched), it does not restart at 0.
  for (size_t i = 1; i < got.size(); ++i)
    EXPECT_GE(got[i]["elapsed_s"].get<double>(), got[i - 1]["elapsed_s"].get<double>()) << "step " << i + 1;
  fs::remove_all(run.root);
}

TEST(RunRecord, KeepMetricsThroughDropsLaterAndBrokenLines) {
  const fs::path root = test::fresh_test_dir("trim");
  struct Case {
    std::string text;
    int64_t step, kept, dropped, bad;
    std::string after;
  };
  const std::vector<Case> cases = {
      {"", 3, 0, 0, 0, ""},
      {"{\"step\":1}\n{\"step\":2}\n", 3, 2, 0, 0, "{\"step\":1}\n{\"step\":2}\n"},
      {"{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4}\n", 2, 2, 2, 0, "{\"step\":1}\n{\"step\":2}\n"},
      {"{\"step\":1}\n{\"step\":2}\n{\"st", 2, 2, 0, 1, "{\"step\":1}\n{\"step\":2}\n"},
      {"{\"step\":1}\ngarbage\n{\"step\":2}\n", 5, 2, 0, 1, "{\"step\":1}\n{\"step\":2}\n"},
      {"{\"step\":1}\n{\"loss\":1}\n{\"step\":\"2\"}\n", 5, 1, 0, 2, "{\"step\":1}\n"},
      {"{\"step\":1}\n{\"step\":2}\n", 0, 0, 2, 0, ""},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    std::string name = "metrics_";  // (not "m" + to_string: GCC 12's -Wrestrict false positive)
    name += std::to_string(i);
    const fs::path p = root / (name + ".jsonl");
    std::ofstream(p, std::ios::binary) << cases[i].text;
    const MetricsTrim t = keep_metrics_through(p.string(), cases[i].step);
    EXPECT_EQ(t.kept, cases[i].kept);
    EXPECT_EQ(t.dropped, cases[i].dropped);
    EXPECT_EQ(t.bad_lines, cases[i].bad);
    EXPECT_EQ(read_text(p), cases[i].after);
  }
  const MetricsTrim missing = keep_metrics_through((root / "none.jsonl").string(), 3);
  EXPECT_EQ(missing.kept + missing.dropped + missing.bad_lines, 0);
  EXPECT_FALSE(fs::exists(root / "none.jsonl"));
  fs::remove_all(root);
}

TEST(RunRecord, EventsRecordStartResumeCheckpointEvalSkipAndStop) {
  const RunDir run = make_run("events");
  test::write_tokens(run.root / "valid.bin", 2000, 5);
  const fs::path out = run.root / "run";
  const std::string valid = " --set data.valid_path=" + (run.root / "valid.bin").string() + " --set train.eval_every=2";
  ASSERT_EQ(run_cli("train" + run.sets(out, 4, 2) + valid).status, 0);
  const std::string config_before = read_text(out / "config.toml");
  // Resume with more steps and another learning rate: config.toml stays the starting config.
  const test::CliResult r = run_cli("train" + run.sets(out, 6, 2) + valid + " --set optim.lr=0.002 --resume");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_text(out / "config.toml"), config_before);
  const fs::path resume_config = out / ("config.resume_" + checkpoint_name(4) + ".toml");
  ASSERT_TRUE(fs::exists(resume_config));
  EXPECT_NE(read_text(resume_config).find("lr = 0.002"), std::string::npos);

  const std::vector<json> ev = read_jsonl(out / "events.jsonl");
  std::vector<std::string> kinds;
  for (const json& e : ev) {
    kinds.push_back(e["event"].get<std::string>() + (e.contains("step") ? ":" + std::to_string(e["step"].get<int64_t>()) : ""));
    EXPECT_EQ(e["time"].get<std::string>().size(), 20u) << e.dump();  // 2026-12-01T12:00:00Z
  }
  const std::vector<std::string> want = {"start", "eval:2", "checkpoint:2", "eval:4", "checkpoint:4", "stop:4",
                                         "start", "resume:4", "eval:6", "checkpoint:6", "stop:6"};
  EXPECT_EQ(kinds, want);
  EXPECT_EQ(ev[0]["resume"], false);
  EXPECT_EQ(ev[6]["resume"], true);
  EXPECT_EQ(ev[0]["version"].get<std::string>().substr(0, 2), "0.");
  EXPECT_FALSE(ev[0]["git"].get<std::string>().empty());
  EXPECT_EQ(ev[0]["ranks"], 1);
  EXPECT_EQ(ev[0]["threads"], 1);
  EXPECT_EQ(ev[0]["layout"]["dp"], 1);
  EXPECT_EQ(ev[0]["config_hash"].get<std::string>().size(), 16u);
  EXPECT_NE(ev[0]["config_hash"], ev[6]["config_hash"]);  // the learning rate changed
  EXPECT_EQ(ev[5]["reason"], "completed");
  EXPECT_EQ(ev[7]["checkpoint"].get<std::string>(), (fs::absolute(out / "checkpoints") / checkpoint_name(4)).string());
  EXPECT_EQ(ev[7]["next_instance"], 16);
  ASSERT_EQ(ev[7]["config_changes"].size(), 2u);  // optim.lr and train.steps
  EXPECT_GT(ev[4]["bytes"].get<int64_t>(), 0);
  EXPECT_GE(ev[4]["seconds"].get<double>(), 0.0);
  EXPECT_TRUE(ev[3]["valid_ce"].is_number());
  // elapsed_s of the resumed run continues the first run's.
  EXPECT_GE(ev[10]["elapsed_s"].get<double>(), ev[5]["elapsed_s"].get<double>());
  EXPECT_GE(ev[7]["elapsed_s"].get<double>(), 0.0);
  fs::remove_all(run.root);
}

TEST(RunRecord, StopEventsSayWhy) {
  const RunDir run = make_run("stops");
  // An error in a step: the stop event carries the message.
  ::setenv("MOE_INJECT_FAULT", "error@0:3", 1);
  const test::CliResult err = run_cli("train" + run.sets(run.root / "err", 6, 0));
  ::unsetenv("MOE_INJECT_FAULT");
  EXPECT_EQ(err.status, 1);
  std::vector<json> ev = read_jsonl(run.root / "err" / "events.jsonl");
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[1]["event"], "stop");
  EXPECT_EQ(ev[1]["reason"], "error");
  EXPECT_EQ(ev[1]["step"], 3);
  EXPECT_NE(ev[1]["message"].get<std::string>().find("injected fault"), std::string::npos);
  // A time limit.
  ASSERT_EQ(run_cli("train" + run.sets(run.root / "time", 1000, 0) + " --set train.time_limit_s=1e-9").status, 0);
  ev = read_jsonl(run.root / "time" / "events.jsonl");
  EXPECT_EQ(ev.back()["reason"], "time_limit");
  EXPECT_EQ(ev.back()["step"], 1);
  // Skipped steps (NaN parameters from step 2 on, train.on_nonfinite = "skip").
  ::setenv("MOE_INJECT_FAULT", "nan@0:2", 1);
  const test::CliResult skip = run_cli("train" + run.sets(run.root / "skip", 3, 0) + " --set train.on_nonfinite=skip");
  ::unsetenv("MOE_INJECT_FAULT");
  EXPECT_EQ(skip.status, 0) << skip.output;
  ev = read_jsonl(run.root / "skip" / "events.jsonl");
  std::vector<int64_t> skipped;
  for (const json& e : ev)
    if (e["event"] == "skipped") {
      skipped.push_back(e["step"].get<int64_t>());
      EXPECT_EQ(e["tensor"].get<std::string>(), "embed");
    }
  EXPECT_EQ(skipped, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ev.back()["reason"], "completed");
  fs::remove_all(run.root);
}

// The data position is checked against the (step, position) of the last resume: a resume with
// another batch size re-anchors it, so resuming again stays possible.
TEST(RunRecord, ResumeWithAnotherBatchSizeReanchorsTheDataPosition) {
  const RunDir run = make_run("anchor");
  const fs::path out = run.root / "run";
  ASSERT_EQ(run_cli("train" + run.sets(out, 4, 2)).status, 0);
  const test::CliResult r8 = run_cli("train" + run.sets(out, 8, 2) + " --set train.batch_size=8 --resume");
  ASSERT_EQ(r8.status, 0) << r8.output;
  const CheckpointInfo at8 = verify_checkpoint((out / "checkpoints" / checkpoint_name(8)).string());
  EXPECT_EQ(at8.anchor.step, 4);
  EXPECT_EQ(at8.anchor.next_instance, 16);
  EXPECT_EQ(at8.next_instance, 16 + 4 * 8);
  const test::CliResult r10 = run_cli("train" + run.sets(out, 10, 2) + " --set train.batch_size=8 --resume");
  ASSERT_EQ(r10.status, 0) << r10.output;
  EXPECT_EQ(verify_checkpoint((out / "checkpoints" / checkpoint_name(10)).string()).next_instance, 48 + 2 * 8);
  fs::remove_all(run.root);
}

TEST(RunRecord, PrintedLossesCarryEveryDigit) {
  const RunDir run = make_run("digits");
  test::write_tokens(run.root / "valid.bin", 2000, 5);
  const fs::path out = run.root / "run";
  const test::CliResult t = run_cli("train" + run.sets(out, 3, 0) + " --set data.valid_path=" + (run.root / "valid.bin").string());
  ASSERT_EQ(t.status, 0) << t.output;
  const std::vector<json> m = read_jsonl(out / "metrics.jsonl");
  // "done: ..., final train ce X, validation ce Y": X and Y are the metrics' doubles exactly.
  const size_t at = t.output.find("final train ce ");
  ASSERT_NE(at, std::string::npos) << t.output;
  EXPECT_EQ(std::strtod(t.output.c_str() + at + 15, nullptr), m.back()["ce"].get<double>());
  const size_t vat = t.output.find(", validation ce ");
  ASSERT_NE(vat, std::string::npos) << t.output;
  const double valid_ce = std::strtod(t.output.c_str() + vat + 16, nullptr);
  EXPECT_EQ(valid_ce, m.back()["valid_ce"].get<double>());
  // eval of the checkpoint prints the same validation loss, every digit.
  const test::CliResult e = run_cli("eval --checkpoint " + (out / "checkpoints").string() + " --batches " +
                                    std::to_string(8));
  ASSERT_EQ(e.status, 0) << e.output;
  const size_t lat = e.output.find("validation loss ");
  ASSERT_NE(lat, std::string::npos) << e.output;
  const double eval_loss = std::strtod(e.output.c_str() + lat + 16, nullptr);
  EXPECT_EQ(eval_loss, valid_ce) << e.output;
  EXPECT_GT(e.output.substr(lat + 16, e.output.find(' ', lat + 16) - lat - 16).size(), 12u) << e.output;
  fs::remove_all(run.root);
}

}  // namespace
}  // namespace moe
