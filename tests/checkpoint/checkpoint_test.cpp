// Checkpoints: bit-exact resume (in process, resharded, and through the moecore binary), refusal
// of every kind of damaged checkpoint with a message naming the file and tensor, deterministic
// crash points inside the save, and random SIGKILLs during a run that saves every step.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/paths.h"
#include "checkpoint/checkpoint.h"
#include "common/small_config.h"
#include "common/test_util.h"
#include "core/rng.h"
#include "kernels/cpu/cpu_ops.h"
#include "train/trainer.h"

namespace moe {
namespace {
namespace fs = std::filesystem;

Config small_config() {
  Config c = test::small_config();
  c.model.router_bias_gamma = 1e-3;  // loss-free biases are part of the state
  return c;
}

using test::synthetic_batch;

uint64_t bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, 8);
  return u;
}

struct Trace {
  std::vector<uint64_t> loss, norm;
};

// Steps [from, to) (0-based batch index = step - 1).
void run_steps(Trainer& t, int64_t from, int64_t to, Trace& trace) {
  for (int64_t s = from; s < to; ++s) {
    OwnedTensor ids, labels;
    synthetic_batch(t.config(), s, ids, labels);
    StepResult r = t.step(ids, labels);
    trace.loss.push_back(bits(r.total));
    trace.norm.push_back(bits(r.grad_norm));
  }
}

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("moecore_ckpt_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

using test::error_of;

TEST(Checkpoint, Crc32cMatchesTheStandardCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  std::vector<unsigned char> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<unsigned char>(i * 31 + 7);
  EXPECT_EQ(crc32c(v.data() + 3, 997), crc32c(v.data() + 500, 500, crc32c(v.data() + 3, 497)));  // streaming
}

void exact_resume(const Config& c, int64_t shards) {
  auto ops = make_backend("cpu");
  Trace full, resumed;
  Trainer a(c, *ops, DType::kF32);
  run_steps(a, 0, c.train.steps, full);

  const fs::path dir = fresh_dir("exact" + std::to_string(shards));
  Trainer b(c, *ops, DType::kF32);
  run_steps(b, 0, 3, resumed);
  SaveOptions o;
  o.num_shards = shards;
  const std::string path = save_checkpoint(dir.string(), b.state(), 3 * c.train.batch_size, o);
  EXPECT_EQ(fs::path(path).filename(), "step_00000003");
  Trainer fresh(c, *ops, DType::kF32);
  CheckpointInfo info = load_checkpoint(path, fresh.state());
  EXPECT_EQ(info.step, 3);
  EXPECT_EQ(info.next_instance, 12);
  EXPECT_TRUE(info.warnings.empty());
  EXPECT_EQ(training_state_hash(fresh.state()), training_state_hash(b.state()));
  run_steps(fresh, 3, c.train.steps, resumed);
  EXPECT_EQ(resumed.loss, full.loss);
  EXPECT_EQ(resumed.norm, full.norm);
  EXPECT_EQ(training_state_hash(fresh.state()), training_state_hash(a.state()));
  fs::remove_all(dir);
}

TEST(Checkpoint, ResumeInProcessIsBitExact) { exact_resume(small_config(), 1); }

TEST(Checkpoint, ResumeFromThreeRankShardsIsBitExact) { exact_resume(small_config(), 3); }

TEST(Checkpoint, ResumeInBf16IsBitExact) {
  Config c = small_config();
  c.train.precision = "bf16";
  exact_resume(c, 1);
}

// A saved checkpoint plus helpers that damage a copy of it.
class CheckpointDamage : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    ops_ = make_backend("cpu");
    trainer_ = std::make_unique<Trainer>(small_config(), *ops_, DType::kF32);
    Trace t;
    run_steps(*trainer_, 0, 2, t);
    path_ = save_checkpoint(dir_.string(), trainer_->state(), 8);
    rank_ = (fs::path(path_) / "rank_00000.safetensors").string();
  }
  void TearDown() override {
    fs::remove_all(dir_);
    fs::remove_all(dir_.string() + ".previous");
  }
  std::string load_error() {
    Trainer t(small_config(), *ops_, DType::kF32);
    return error_of([&] { load_checkpoint(path_, t.state()); });
  }
  // Byte offset of a tensor's data in the rank file.
  size_t data_offset(const std::string& tensor) {
    std::ifstream in(rank_, std::ios::binary);
    uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    std::string h(len, ' ');
    in.read(h.data(), static_cast<std::streamsize>(len));
    return 8 + len + nlohmann::json::parse(h)[tensor]["data_offsets"][0].get<size_t>();
  }
  void flip_byte(const std::string& file, size_t at) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char ch;
    f.read(&ch, 1);
    ch = static_cast<char>(ch ^ 0x10);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&ch, 1);
  }
  fs::path dir_;
  std::unique_ptr<Backend> ops_;
  std::unique_ptr<Trainer> trainer_;
  std::string path_, rank_;
};

TEST_F(CheckpointDamage, IntactCheckpointLoadsAndVerifies) {
  EXPECT_EQ(load_error(), "(no error)");
  EXPECT_EQ(verify_checkpoint(path_).step, 2);
  EXPECT_EQ(latest_checkpoint(dir_.string()), path_);
}

TEST_F(CheckpointDamage, TruncatedTensorFileIsRefused) {
  fs::resize_file(rank_, fs::file_size(rank_) - 100);
  const std::string e = load_error();
  EXPECT_NE(e.find("rank_00000.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("(truncated)"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, FlippedDataByteNamesTheTensor) {
  flip_byte(rank_, data_offset("exp_avg:layers.1.wq") + 17);
  const std::string e = load_error();
  EXPECT_NE(e.find("tensor 'exp_avg:layers.1.wq' in '"), std::string::npos) << e;
  EXPECT_NE(e.find("fails its checksum"), std::string::npos) << e;
  EXPECT_NE(e.find("rank_00000.safetensors"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, FlippedRouterBiasByteNamesTheTensor) {
  flip_byte(rank_, data_offset("router_bias.1") + 2);
  const std::string e = load_error();
  EXPECT_NE(e.find("tensor 'router_bias.1'"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, FlippedHeaderByteIsRefused) {
  flip_byte(rank_, 9);  // inside the JSON header: either malformed or the file checksum fails
  const std::string e = load_error();
  EXPECT_NE(e.find("rank_00000.safetensors"), std::string::npos) << e;
  EXPECT_TRUE(e.find("not a valid safetensors") != std::string::npos || e.find("fails its checksum") != std::string::npos) << e;
}

TEST_F(CheckpointDamage, MissingTensorFileIsRefused) {
  fs::remove(rank_);
  const std::string e = load_error();
  EXPECT_NE(e.find("missing file 'rank_00000.safetensors'"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, MissingManifestIsRefusedAndSkippedByLatest) {
  fs::remove(fs::path(path_) / "manifest.json");
  const std::string e = load_error();
  EXPECT_NE(e.find("has no manifest.json"), std::string::npos) << e;
  EXPECT_EQ(latest_checkpoint(dir_.string()), "");
}

TEST_F(CheckpointDamage, MalformedManifestIsRefused) {
  const fs::path m = fs::path(path_) / "manifest.json";
  fs::resize_file(m, fs::file_size(m) / 2);
  const std::string e = load_error();
  EXPECT_NE(e.find("malformed manifest '"), std::string::npos) << e;
  EXPECT_NE(e.find("manifest.json"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, EditedManifestFailsItsChecksum) {
  const fs::path m = fs::path(path_) / "manifest.json";
  std::stringstream ss;
  ss << std::ifstream(m).rdbuf();
  std::string text = ss.str();
  const size_t at = text.find("\"next_instance\": 8");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 400);
  text.replace(at, 18, "\"next_instance\": 9");
  std::ofstream(m, std::ios::trunc) << text;
  const std::string e = load_error();
  EXPECT_NE(e.find("fails its checksum"), std::string::npos) << e;
  EXPECT_NE(e.find("manifest.json"), std::string::npos) << e;
}

// A manifest edited with care (checksum recomputed), or written by a bug: the data position must
// agree with the anchor (the last resume) and the batch size, or resuming would read other data.
TEST_F(CheckpointDamage, DataPositionMustAgreeWithTheAnchor) {
  const fs::path m = fs::path(path_) / "manifest.json";
  std::stringstream ss;
  ss << std::ifstream(m).rdbuf();
  const nlohmann::json original = nlohmann::json::parse(ss.str());
  auto reseal = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = original;
    j.erase("manifest_crc32c");
    edit(j["data"]);
    const std::string body = j.dump();
    char crc[16];
    std::snprintf(crc, sizeof crc, "%08x", crc32c(body.data(), body.size()));
    j["manifest_crc32c"] = crc;
    std::ofstream(m, std::ios::trunc) << j.dump(1);
  };
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> edit;
    std::string error;  // "" = loads
  };
  const std::vector<Case> cases = {
      {"as written", [](nlohmann::json&) {}, ""},
      {"off by one", [](nlohmann::json& d) { d["next_instance"] = 9; },
       "data.next_instance = 9 disagrees with the run: data.anchor_instance 0 at data.anchor_step 0 + (step 2 - 0) x "
       "data.batch_size 4 = 8"},
      {"negative", [](nlohmann::json& d) { d["next_instance"] = -8; }, "data.next_instance = -8 is negative"},
      {"anchor after the step", [](nlohmann::json& d) { d["anchor_step"] = 5; }, "data.anchor_step = 5 is not in [0, step = 2]"},
      {"negative anchor", [](nlohmann::json& d) { d["anchor_instance"] = -4; }, "data.anchor_instance = -4 is negative"},
      {"no batch", [](nlohmann::json& d) { d["batch_size"] = 0; }, "data.batch_size = 0"},
      {"resumed at step 1 with batch 4", [](nlohmann::json& d) { d["anchor_step"] = 1; d["anchor_instance"] = 4; }, ""},
      {"resumed, position moved", [](nlohmann::json& d) { d["anchor_step"] = 1; d["anchor_instance"] = 5; },
       "data.next_instance = 8 disagrees with the run"},
      {"older manifest without an anchor", [](nlohmann::json& d) { d.erase("anchor_step"); d.erase("anchor_instance"); }, ""},
      {"older manifest, position moved",
       [](nlohmann::json& d) { d.erase("anchor_step"); d.erase("anchor_instance"); d["next_instance"] = 12; },
       "(no anchor recorded: 0 at step 0)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    reseal(c.edit);
    const std::string e = load_error();
    if (c.error.empty()) {
      EXPECT_EQ(e, "(no error)");
    } else {
      EXPECT_NE(e.find(c.error), std::string::npos) << e;
      EXPECT_NE(e.find(m.string()), std::string::npos) << e;
    }
  }
}

TEST_F(CheckpointDamage, DifferentModelShapeIsRefusedNamingTheKey) {
  Config c = small_config();
  c.model.expert_hidden = 32;
  Trainer t(c, *ops_, DType::kF32);
  const std::string e = error_of([&] { load_checkpoint(path_, t.state()); });
  EXPECT_NE(e.find("model.expert_hidden = 32 differs from the checkpoint's 24"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, DifferentOptimizerDtypeIsRefused) {
  Config c = small_config();
  c.train.backend = "ref";
  Trainer t(c, *ops_, DType::kF64);
  const std::string e = error_of([&] { load_checkpoint(path_, t.state()); });
  EXPECT_NE(e.find("optimizer state are F32, this run keeps them in F64"), std::string::npos) << e;
}

TEST_F(CheckpointDamage, ChangedLearningRateLoadsWithAWarning) {
  Config c = small_config();
  c.optim.lr = 1e-3;
  Trainer t(c, *ops_, DType::kF32);
  CheckpointInfo info = load_checkpoint(path_, t.state());
  ASSERT_EQ(info.warnings.size(), 1u);
  EXPECT_NE(info.warnings[0].find("optim.lr"), std::string::npos) << info.warnings[0];
}

TEST_F(CheckpointDamage, ResumeFallsBackToTheNewestCheckpointThatVerifies) {
  Trace t;
  run_steps(*trainer_, 2, 3, t);
  const std::string newer = save_checkpoint(dir_.string(), trainer_->state(), 12);
  flip_byte((fs::path(newer) / "rank_00000.safetensors").string(), data_offset("params:embed") + 5);
  Trainer fresh(small_config(), *ops_, DType::kF32);
  std::ostringstream log;
  CheckpointInfo info = resume_latest(dir_.string(), fresh.state(), log);
  EXPECT_EQ(info.path, path_);
  EXPECT_NE(log.str().find("skipping checkpoint"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("tensor 'params:embed'"), std::string::npos) << log.str();
}

TEST_F(CheckpointDamage, FreshRunMovesAnEarlierRunsCheckpointsAside) {
  Config c = small_config();
  c.checkpoint.dir = dir_.string();
  Trainer t(c, *ops_, DType::kF32);
  std::ostringstream log;
  CheckpointInfo start = begin_checkpointing(c, t.state(), false, log);
  EXPECT_EQ(start.step, 0);
  EXPECT_EQ(latest_checkpoint(dir_.string()), "");
  EXPECT_EQ(list_checkpoints(dir_.string() + ".previous").size(), 1u);
  EXPECT_NE(log.str().find("moved to"), std::string::npos) << log.str();
  EXPECT_EQ(error_of([&] { begin_checkpointing(c, t.state(), true, log); }).find("no complete checkpoint") != std::string::npos, true);
}

// ---- deterministic crash points (the save runs in a forked child) ------------------------------

TEST(Checkpoint, EveryCrashPointLeavesTheLatestCompleteCheckpointLoadable) {
  const Config c = small_config();
  auto ops = make_backend("cpu");
  Trainer t(c, *ops, DType::kF32);
  Trace tr;
  const fs::path dir = fresh_dir("crash");
  run_steps(t, 0, 1, tr);
  const std::string first = save_checkpoint(dir.string(), t.state(), 4);
  const uint64_t first_hash = training_state_hash(t.state());
  run_steps(t, 1, 2, tr);
  const std::string second = (dir / checkpoint_name(2)).string();
  SaveOptions keep1;
  keep1.keep_last = 1;  // so the save prunes step 1
  // Tensors: params, exp_avg, exp_avg_sq, router_bias.0, router_bias.1.
  const std::vector<std::pair<std::string, bool>> points = {
      {"after_tensor:1", false}, {"after_tensor:3", false},   {"after_tensor:5", false},
      {"before_manifest", false}, {"before_rename", false},   {"before_dir_fsync", true},
      {"before_prune", true},     {"during_prune", true}};
  for (const auto& [point, new_is_durable] : points) {
    SCOPED_TRACE(point);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::setenv("MOE_CRASH_AT", point.c_str(), 1);
      try {
        save_checkpoint(dir.string(), t.state(), 8, keep1);
      } catch (...) {
        _exit(3);
      }
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 77);
    const std::string latest = latest_checkpoint(dir.string());
    EXPECT_EQ(latest, new_is_durable ? second : first);
    Trainer fresh(c, *ops, DType::kF32);
    CheckpointInfo info = load_checkpoint(latest, fresh.state());
    EXPECT_EQ(training_state_hash(fresh.state()), new_is_durable ? training_state_hash(t.state()) : first_hash);
    if (new_is_durable) {
      EXPECT_EQ(info.step, 2);
      // Put the world back to "only step 1 complete" for the next crash point.
      fs::remove_all(second);
      if (!fs::exists(first)) {
        Trainer one(c, *ops, DType::kF32);
        Trace x;
        run_steps(one, 0, 1, x);
        save_checkpoint(dir.string(), one.state(), 4);
      }
    }
  }
  // A clean save afterwards removes every leftover temp and trash directory.
  save_checkpoint(dir.string(), t.state(), 8);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind("step_", 0), 0u) << e.path();
  EXPECT_EQ(list_checkpoints(dir.string()).size(), 2u);
  fs::remove_all(dir);
}

TEST(Checkpoint, KeepLastPrunesOldestOnly) {
  const Config c = small_config();
  auto ops = make_backend("cpu");
  Trainer t(c, *ops, DType::kF32);
  const fs::path dir = fresh_dir("prune");
  SaveOptions o;
  o.keep_last = 2;
  Trace tr;
  for (int64_t s = 0; s < 4; ++s) {
    run_steps(t, s, s + 1, tr);
    save_checkpoint(dir.string(), t.state(), (s + 1) * 4, o);
  }
  fs::create_directories(dir / ".tmp.step_00000009.1");  // a crashed save's leftovers never count
  std::vector<std::string> all = list_checkpoints(dir.string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(fs::path(all[0]).filename(), "step_00000003");
  EXPECT_EQ(fs::path(all[1]).filename(), "step_00000004");
  fs::remove_all(dir);
}

// ---- through the binary: random SIGKILLs, then --resume --------------------------------------

constexpr int64_t kBinarySteps = 150;

std::vector<std::string> binary_args(const fs::path& data, const fs::path& out, int64_t every) {
  return {::moe::test::moecore_binary(), "train",
          "--set", "model.vocab_size=64", "--set", "model.d_model=32", "--set", "model.n_layers=2",
          "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--set", "model.num_experts=4",
          "--set", "model.top_k=2", "--set", "model.expert_hidden=24", "--set", "model.router_bias_gamma=0.001",
          "--set", "optim.warmup_steps=3", "--set", "train.steps=" + std::to_string(kBinarySteps), "--set", "train.seq_len=24",
          "--set", "train.batch_size=4", "--set", "train.micro_batch_size=2", "--set", "train.threads=1",
          "--set", "train.log_every=1000", "--set", "train.eval_every=0", "--set", "train.time_limit_s=0",
          "--set", "data.train_path=" + data.string(), "--set", "data.valid_path=",
          "--set", "train.out_dir=" + out.string(), "--set", "checkpoint.every=" + std::to_string(every),
          "--set", "checkpoint.keep_last=2"};
}

pid_t spawn(std::vector<std::string> args, const std::string& stderr_path = "/dev/null") {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    const int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(null, 1);
    ::dup2(err, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// The step in a checkpoint directory's name (step_00000012 -> 12); 0 for no checkpoint.
int64_t checkpoint_step(const std::string& path) {
  if (path.empty()) return 0;
  const std::string name = fs::path(path).filename().string();
  return std::stoll(name.substr(name.find('_') + 1));
}

int wait_for(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// step -> "loss grad_norm" as written (the JSON numbers round-trip doubles exactly). Every line
// must be a complete record and every step appear once, in order: a resume drops what a killed
// run logged past its last checkpoint (train/metrics.h keep_metrics_through).
std::map<int64_t, std::pair<double, double>> read_metrics(const fs::path& file) {
  std::map<int64_t, std::pair<double, double>> out;
  std::ifstream in(file);
  std::string line;
  int64_t previous = 0;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "incomplete metrics line in " << file << ": " << line;
    if (j.is_discarded()) continue;
    const int64_t step = j["step"].get<int64_t>();
    EXPECT_EQ(step, previous + 1) << "metrics step " << step << " after step " << previous << " in " << file;
    previous = step;
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  }
  return out;
}

TEST(Checkpoint, BinarySurvivesRandomSigkillsAndResumesBitExactly) {
  const fs::path root = fresh_dir("binary");
  const fs::path data = root / "train.bin";
  {
    std::vector<uint16_t> toks(20000);
    int64_t tok = 1;
    for (size_t i = 0; i < toks.size(); ++i) {
      toks[i] = static_cast<uint16_t>(tok);
      const double u = random_uniform(5, 9, i);
      tok = u < 0.6 ? (5 * tok + 3) % 64 : (tok + 1 + static_cast<int64_t>((u - 0.6) * 10)) % 64;
    }
    std::ofstream(data, std::ios::binary).write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 2));
  }
  const auto t0 = std::chrono::steady_clock::now();
  // The uninterrupted reference run (also saving every step, so its duration scales the kills).
  const int ref_status = wait_for(spawn(binary_args(data, root / "ref", 1)));
  ASSERT_TRUE(WIFEXITED(ref_status) && WEXITSTATUS(ref_status) == 0);
  const double ref_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const fs::path out = root / "killed", ckpt = out / "checkpoints";
  // The killed run: save every step, SIGKILL at pseudo-random moments, check, resume. Every third
  // attempt dies at a random moment after its start (often while starting or resuming, before a
  // save); the others at a random moment within the two steps after the attempt's first new
  // checkpoint appears (often mid-save or mid-prune). Waiting for that progress, rather than
  // sleeping a fraction of the reference run, keeps the kills inside the run however loaded the
  // machine is: a fixed schedule once killed a CI run before every save but two.
  int kills = 0, loads_checked = 0;
  const double step_s = ref_s / static_cast<double>(kBinarySteps);
  for (int attempt = 0; attempt < 60 && (kills < 10 || loads_checked < 6); ++attempt) {
    std::vector<std::string> args = binary_args(data, out, 1);
    const std::string before = latest_checkpoint(ckpt.string());
    if (!before.empty()) args.push_back("--resume");
    const pid_t pid = spawn(args);
    const double u = random_uniform(42, 1, static_cast<uint64_t>(attempt));
    int status = 0;
    bool exited = false;
    if (attempt % 3 != 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (checkpoint_step(latest_checkpoint(ckpt.string())) <= checkpoint_step(before)) {
        if (::waitpid(pid, &status, WNOHANG) == pid) { exited = true; break; }
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "attempt " << attempt << " saved nothing in 120 s";
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    if (!exited) {
      const double delay_s = attempt % 3 != 0 ? 2.0 * u * step_s : (0.02 + 0.1 * u) * ref_s;
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(delay_s * 1e6)));
      ::kill(pid, SIGKILL);
      status = wait_for(pid);
    }
    if (WIFSIGNALED(status)) ++kills;
    const std::string latest = latest_checkpoint(ckpt.string());
    if (!latest.empty()) {
      const CheckpointInfo info = verify_checkpoint(latest);  // must be complete and intact
      EXPECT_GT(info.step, 0);
      EXPECT_EQ(info.step, checkpoint_step(latest)) << latest;
      ++loads_checked;
    }
    if (WIFEXITED(status)) break;  // finished before the kill
  }
  std::vector<std::string> args = binary_args(data, out, 1);
  if (!latest_checkpoint(ckpt.string()).empty()) args.push_back("--resume");
  const int final_status = wait_for(spawn(args));
  ASSERT_TRUE(WIFEXITED(final_status) && WEXITSTATUS(final_status) == 0);
  EXPECT_GE(kills, 8);
  EXPECT_GE(loads_checked, 5);

  const auto ref = read_metrics(root / "ref" / "metrics.jsonl"), got = read_metrics(out / "metrics.jsonl");
  ASSERT_EQ(ref.size(), static_cast<size_t>(kBinarySteps));
  ASSERT_EQ(got.size(), static_cast<size_t>(kBinarySteps));
  for (const auto& [step, v] : ref) {
    EXPECT_EQ(bits(got.at(step).first), bits(v.first)) << "loss at step " << step;
    EXPECT_EQ(bits(got.at(step).second), bits(v.second)) << "grad norm at step " << step;
  }
  // The final state (parameters, Adam m and v, router biases, step): same hash.
  Config c = small_config();
  c.model.shared_hidden = 0;
  c.model.router_bias_gamma = 0.001;
  c.optim.warmup_steps = 3;
  c.train.steps = kBinarySteps;
  c.train.threads = 1;
  auto ops = make_backend("cpu");
  Trainer a(c, *ops, DType::kF32), b(c, *ops, DType::kF32);
  load_checkpoint(latest_checkpoint((root / "ref" / "checkpoints").string()), a.state());
  load_checkpoint(latest_checkpoint(ckpt.string()), b.state());
  EXPECT_EQ(a.steps_taken(), kBinarySteps);
  EXPECT_EQ(training_state_hash(a.state()), training_state_hash(b.state()));
  // --resume with a different model shape stops with one line naming the key.
  args = binary_args(data, out, 1);
  args.insert(args.end(), {"--set", "model.expert_hidden=16", "--resume"});
  const int wrong = wait_for(spawn(args, (root / "stderr.txt").string()));
  EXPECT_TRUE(WIFEXITED(wrong) && WEXITSTATUS(wrong) == 1);
  std::stringstream err;
  err << std::ifstream(root / "stderr.txt").rdbuf();
  EXPECT_NE(err.str().find("model.expert_hidden = 16 differs from the checkpoint's 24"), std::string::npos) << err.str();
  std::printf("[          ] %d SIGKILLs, %d latest checkpoints verified, reference run %.2f s\n", kills, loads_checked, ref_s);
  fs::remove_all(root);
}

}  // namespace
}  // namespace moe
