// Every reader of a user path, given a directory, a FIFO, a dangling symlink or an empty file
// (folder readers: a file, a FIFO, a dangling symlink or an empty folder), stops with one line
// naming the path: never std::bad_alloc, never a silent empty config, never blocked on a FIFO
// (each command runs under a time limit).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "common/paths.h"
#include "common/cli_util.h"

namespace moe {
namespace {
namespace fs = std::filesystem;
using test::run_cli;
using test::shell_quote;

enum class Kind { kDirectory, kFifo, kDanglingLink, kEmptyFile, kRegularFile, kEmptyDirectory };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kDirectory: return "directory";
    case Kind::kFifo: return "FIFO";
    case Kind::kDanglingLink: return "dangling symlink";
    case Kind::kEmptyFile: return "empty file";
    case Kind::kRegularFile: return "regular file";
    case Kind::kEmptyDirectory: return "empty directory";
  }
  return "?";
}
// What the error line must say about each kind.
const char* kind_words(Kind k) {
  switch (k) {
    case Kind::kDirectory: return "is a directory";
    case Kind::kFifo: return "FIFO";
    case Kind::kDanglingLink: return "dangling symbolic link";
    case Kind::kEmptyFile: return "is empty";
    case Kind::kRegularFile: return "not a directory";
    case Kind::kEmptyDirectory: return "";  // reader-specific (what the folder lacks)
  }
  return "?";
}

void make(const fs::path& p, Kind k) {
  fs::remove_all(p);
  switch (k) {
    case Kind::kDirectory: fs::create_directories(p); break;
    case Kind::kFifo: ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0); break;
    case Kind::kDanglingLink: fs::create_symlink(p.string() + ".nowhere", p); break;
    case Kind::kEmptyFile: std::ofstream(p).close(); break;
    case Kind::kRegularFile: std::ofstream(p) << "not a folder\n"; break;
    case Kind::kEmptyDirectory: fs::create_directories(p); break;
  }
}

struct Reader {
  std::string name;
  // The command line reading `path`; setup prepares what else it needs inside dir.
  std::function<std::string(const fs::path& dir, const fs::path& path)> command;
  std::function<fs::path(const fs::path& dir)> target;  // which path gets the bad kind
  bool folder = false;
  std::string empty_dir_words;  // for folder readers given an empty folder
};

class UserPaths : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = test::fresh_test_dir("user_paths");
    test::write_tokens(root_ / "good.bin", 4000);
    // A checkpoint to damage, and Hugging Face folders to copy.
    const test::CliResult r = run_cli("train" + test::tiny_model_sets() + " --set train.steps=2 --set data.train_path=" +
                                      (root_ / "good.bin").string() + " --set train.out_dir=" + (root_ / "run").string());
    ASSERT_EQ(r.status, 0) << r.output;
    checkpoint_ = moe_latest();
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }
  static std::string moe_latest() {
    for (const auto& e : fs::directory_iterator(root_ / "run/checkpoints")) return e.path().string();
    return "";
  }
  static fs::path copy_of(const fs::path& from, const fs::path& to) {
    fs::remove_all(to);
    fs::copy(from, to, fs::copy_options::recursive);
    return to;
  }
  static fs::path root_;
  static std::string checkpoint_;
};
fs::path UserPaths::root_;
std::string UserPaths::checkpoint_;

TEST_F(UserPaths, EveryReaderNamesThePathForEveryKind) {
  const std::string golden = std::string(::moe::test::source_dir()) + "/tests/golden/";
  const std::string good = (root_ / "good.bin").string();
  const std::string train = "train" + test::tiny_model_sets() + " --set train.steps=1";
  auto at = [](const char* name) { return [name](const fs::path& d) { return d / name; }; };
  std::vector<Reader> readers = {
      {"--config", [](const fs::path&, const fs::path& p) { return "config --config " + shell_quote(p); }, at("c.toml"), false, ""},
      {"data.train_path", [&](const fs::path& d, const fs::path& p) {
         return train + " --set data.train_path=" + shell_quote(p) + " --set train.out_dir=" + (d / "o").string(); },
       at("t.bin"), false, ""},
      {"data.valid_path", [&](const fs::path& d, const fs::path& p) {
         return train + " --set data.train_path=" + good + " --set data.valid_path=" + shell_quote(p) +
                " --set train.out_dir=" + (d / "o").string(); },
       at("v.bin"), false, ""},
      {"train.init_from", [&](const fs::path& d, const fs::path& p) {
         return train + " --set data.train_path=" + good + " --set train.init_from=" + shell_quote(p) +
                " --set train.out_dir=" + (d / "o").string(); },
       at("p.safetensors"), false, ""},
      {"export-hf --from", [](const fs::path& d, const fs::path& p) {
         return "export-hf --from " + shell_quote(p) + " --out " + (d / "hf").string(); },
       at("p.safetensors"), false, ""},
      {"prepare --input", [](const fs::path& d, const fs::path& p) {
         return "prepare --input " + shell_quote(p) + " --out " + (d / "prep").string(); },
       at("text.txt"), false, ""},
      {"HF config.json", [&](const fs::path& d, const fs::path&) {
         return "import-hf --from " + (d / "hf").string() + " --out " + (d / "x.safetensors").string(); },
       [&](const fs::path& d) { return copy_of(golden + "hf/fused", d / "hf") / "config.json"; }, false, ""},
      {"HF model.safetensors", [&](const fs::path& d, const fs::path&) {
         return "import-hf --from " + (d / "hf").string() + " --out " + (d / "x.safetensors").string(); },
       [&](const fs::path& d) { return copy_of(golden + "hf/fused", d / "hf") / "model.safetensors"; }, false, ""},
      {"HF shard", [&](const fs::path& d, const fs::path&) {
         return "import-hf --from " + (d / "hf").string() + " --out " + (d / "x.safetensors").string(); },
       [&](const fs::path& d) {
         return copy_of(golden + "hf/save_pretrained", d / "hf") / "model-00002-of-00005.safetensors"; }, false, ""},
      {"HF shard index", [&](const fs::path& d, const fs::path&) {
         return "import-hf --from " + (d / "hf").string() + " --out " + (d / "x.safetensors").string(); },
       [&](const fs::path& d) { return copy_of(golden + "hf/save_pretrained", d / "hf") / "model.safetensors.index.json"; }, false, ""},
      {"checkpoint manifest", [&](const fs::path& d, const fs::path&) {
         return "eval --checkpoint " + (d / "ck").string() + " --set data.valid_path=" + good; },
       [&](const fs::path& d) { return copy_of(checkpoint_, d / "ck") / "manifest.json"; }, false, ""},
      {"checkpoint rank file", [&](const fs::path& d, const fs::path&) {
         return "eval --checkpoint " + (d / "ck").string() + " --set data.valid_path=" + good; },
       [&](const fs::path& d) { return copy_of(checkpoint_, d / "ck") / "rank_00000.safetensors"; }, false, ""},
      {"--checkpoint", [&](const fs::path&, const fs::path& p) {
         return "eval --checkpoint " + shell_quote(p) + " --set data.valid_path=" + good; },
       at("ckpt"), true, "no checkpoint in"},
      {"import-hf --from", [](const fs::path& d, const fs::path& p) {
         return "import-hf --from " + shell_quote(p) + " --out " + (d / "x.safetensors").string(); },
       at("hfdir"), true, "config.json' does not exist"},
  };
  int checked = 0;
  for (const Reader& reader : readers) {
    const std::vector<Kind> kinds = reader.folder ? std::vector<Kind>{Kind::kRegularFile, Kind::kFifo, Kind::kDanglingLink,
                                                                      Kind::kEmptyDirectory}
                                                  : std::vector<Kind>{Kind::kDirectory, Kind::kFifo, Kind::kDanglingLink,
                                                                      Kind::kEmptyFile};
    for (Kind k : kinds) {
      SCOPED_TRACE(reader.name + " given a " + kind_name(k));
      const fs::path dir = root_ / ("case_" + std::to_string(checked));
      fs::create_directories(dir);
      const fs::path path = reader.target(dir);
      make(path, k);
      const test::CliResult r = run_cli(reader.command(dir, path), 30);
      EXPECT_EQ(r.status, 1) << r.output;  // 124: blocked (a FIFO opened); other: crashed
      EXPECT_EQ(r.output.find("bad_alloc"), std::string::npos) << r.output;
      const std::string words = k == Kind::kEmptyDirectory ? reader.empty_dir_words : kind_words(k);
      // The error line names the path (a checkpoint file's empty case names the file by its
      // size check) and what is wrong with it.
      const bool names_path = r.output.find(path.string()) != std::string::npos;
      EXPECT_TRUE(names_path) << r.output;
      const bool size_check = reader.name == "checkpoint rank file" && k == Kind::kEmptyFile &&
                              r.output.find("is 0 bytes, the manifest says") != std::string::npos;
      const bool manifest_check = reader.name == "checkpoint manifest" && k == Kind::kEmptyFile &&
                                  r.output.find("malformed manifest") != std::string::npos;
      const bool shard_index_check = reader.name == "HF shard index" && k == Kind::kDanglingLink &&
                                     r.output.find("dangling symbolic link") != std::string::npos;
      EXPECT_TRUE(r.output.find(words) != std::string::npos || size_check || manifest_check || shard_index_check)
          << "expected '" << words << "' in: " << r.output;
      EXPECT_NE(r.output.find("moecore: error:"), std::string::npos) << r.output;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 56);
}

TEST_F(UserPaths, ConfigFileThatIsADirectoryIsNotAnEmptyConfig) {
  // The case users hit: --config pointing at a folder used to train on the defaults.
  fs::create_directories(root_ / "configs_dir");
  const test::CliResult r = run_cli("train --config " + (root_ / "configs_dir").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("config file '" + (root_ / "configs_dir").string() + "' is a directory"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace moe
