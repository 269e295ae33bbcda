// Checks before training: train.init_from refuses a parameter file made for another model
// (every model setting, not only the tensor shapes); the items ranks compare (build, every
// config key but train.threads, token file fingerprints). The collective comparison itself runs
// under mpirun in tests/parallel (rank_agreement_test.cpp, mpi_cli.sh).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "checkpoint/hf_export.h"
#include "common/test_util.h"
#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "core/check.h"
#include "model/params.h"
#include "train/run_checks.h"

namespace moe {
namespace {
namespace fs = std::filesystem;

using test::error_of;

Config imported_config() {
  // As import-hf writes it for an OLMoE checkpoint.
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.num_experts = 8;
  m.top_k = 2;
  m.expert_hidden = 16;
  m.norm_eps = 1e-5;
  m.rope_theta = 500000;
  m.norm_topk_prob = false;
  m.pad_id = 1;
  m.max_position_embeddings = 4096;
  c.data.eos_id = 50 % 64;
  c.data.bos_id = -1;
  return c;
}

std::string params_file(const std::string& name, const Config& c) {
  const std::string path = (fs::temp_directory_path() / ("moe_init_from_" + std::to_string(::getpid()) + name)).string();
  std::vector<float> p(static_cast<size_t>(ParamLayout(c.model).total()), 0.01f);
  save_our_params(path, c, p.data());
  return path;
}

TEST(InitFrom, EveryModelSettingMustMatchTheFile) {
  const Config file = imported_config();
  const std::string path = params_file("a.safetensors", file);
  Config run = file;  // the same settings: accepted
  EXPECT_TRUE(check_init_from(run, SafetensorsFile(path)).notes.empty());
  // Settings that keep every tensor shape, so the shape check cannot see them.
  struct Case {
    std::string key;
    std::function<void(Config&)> edit;
    std::string run_value, file_value;
  };
  const std::vector<Case> cases = {
      {"model.rope_theta", [](Config& c) { c.model.rope_theta = 10000; }, "10000.0", "500000.0"},
      {"model.norm_eps", [](Config& c) { c.model.norm_eps = 1e-6; }, "1e-06", "1e-05"},
      {"model.top_k", [](Config& c) { c.model.top_k = 4; }, "4", "2"},
      {"model.norm_topk_prob", [](Config& c) { c.model.norm_topk_prob = true; }, "true", "false"},
      {"model.score_func", [](Config& c) { c.model.score_func = "sigmoid"; }, "\"sigmoid\"", "\"softmax\""},
      {"model.routing", [](Config& c) { c.model.routing = "random"; }, "\"random\"", "\"learned\""},
      {"model.sliding_window", [](Config& c) { c.model.sliding_window.append(std::to_string(8)); }, "\"8\"", "\"\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    Config r = file;
    c.edit(r);
    const std::string msg = error_of([&] { check_init_from(r, SafetensorsFile(path)); });
    EXPECT_NE(msg.find("train.init_from '" + path + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.key + " = " + c.run_value + " (this run) differs from " + c.file_value + " (the file)"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("--set " + c.key + "=" + c.file_value), std::string::npos) << msg;
  }
  // Several differences are all listed.
  Config two = file;
  two.model.rope_theta = 10000;
  two.model.top_k = 4;
  const std::string msg = error_of([&] { check_init_from(two, SafetensorsFile(path)); });
  EXPECT_NE(msg.find("model.rope_theta"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.top_k"), std::string::npos) << msg;
  // Settings that change nothing the weights compute are noted, the run's values applying: an
  // imported max_position_embeddings against the run's 0, a file without an eos id (-1) against
  // data.eos_id = 7, another pad id, a bos id.
  Config meta = file;
  meta.model.max_position_embeddings = 0;
  meta.data.eos_id = 7;
  meta.model.pad_id = -1;
  meta.data.bos_id = 0;
  const InitFromCheck noted = check_init_from(meta, SafetensorsFile(path));
  EXPECT_TRUE(noted.settings_checked);
  ASSERT_EQ(noted.notes.size(), 4u);
  for (const char* key : {"model.max_position_embeddings = 0", "data.eos_id = 7", "model.pad_id = -1", "data.bos_id = 0"}) {
    bool found = false;
    for (const std::string& n : noted.notes) found = found || n.find(key) != std::string::npos;
    EXPECT_TRUE(found) << key;
  }
  // Not compared: the init scale (the weights replace the init) and loss-free balancing (its
  // biases start at zero), and everything outside [model] and the token ids.
  Config free = file;
  free.model.init_std = 0.5;
  free.model.router_bias_gamma = 1e-3;
  free.optim.lr = 0.1;
  free.train.seq_len = 1024;
  free.data.intra_doc_mask = true;
  EXPECT_TRUE(check_init_from(free, SafetensorsFile(path)).notes.size() == 2u);  // init_std, router_bias_gamma
  fs::remove(path);
}

TEST(InitFrom, AFileWithoutStoredSettingsIsCheckedByShapesOnly) {
  const Config c = imported_config();
  const std::string path = (fs::temp_directory_path() / ("moe_init_from_bare_" + std::to_string(::getpid()))).string();
  std::vector<SafetensorsTensorOut> none;
  none.push_back({"embed", "F32", {1}, std::vector<unsigned char>(4, 0)});
  write_safetensors(path, none);
  EXPECT_FALSE(check_init_from(c, SafetensorsFile(path)).settings_checked);
  fs::remove(path);
}

TEST(RankAgreement, ItemsCoverBuildConfigAndTokenFiles) {
  const fs::path dir = fs::temp_directory_path() / ("moe_agree_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string file = (dir / "t.bin").string();
  auto write = [&](size_t n, char fill, size_t poke = std::string::npos) {
    std::string bytes(n, fill);
    if (poke != std::string::npos) bytes[poke] ^= 1;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  };
  Config c;
  c.data.train_path = file;
  c.data.valid_path = "";
  auto fingerprint = [&] {
    for (const auto& [k, v] : rank_agreement_items(c, true))
      if (k.rfind("token file data.train_path[0]", 0) == 0) return v;
    return std::string("missing");
  };
  write(5 << 20, 'a');
  const std::string base = fingerprint();
  EXPECT_NE(base, "missing");
  write(5 << 20, 'a', 10);  // first MiB
  EXPECT_NE(fingerprint(), base);
  write(5 << 20, 'a', (5 << 20) - 10);  // last MiB
  EXPECT_NE(fingerprint(), base);
  write((5 << 20) + 2, 'a');  // size
  EXPECT_NE(fingerprint(), base);
  write(5 << 20, 'a', 3 << 20);  // the middle is not read (2 MiB per file at start)
  EXPECT_EQ(fingerprint(), base);
  // Every config key but train.threads; the build first.
  const auto items = rank_agreement_items(c, false);
  EXPECT_EQ(items.front().first, "build");
  size_t keys = 0;
  for (const auto& [k, v] : items) {
    EXPECT_NE(k, "train.threads");
    keys += k.find('.') != std::string::npos;
  }
  EXPECT_EQ(keys, config_entries(c).size() - 1);
  EXPECT_TRUE(may_differ_between_ranks("train.threads"));
  EXPECT_FALSE(may_differ_between_ranks("train.seed"));
  EXPECT_EQ(config_hash(c), config_hash(c));
  Config other = c;
  other.optim.lr = 1e-4;
  EXPECT_NE(config_hash(c), config_hash(other));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe
