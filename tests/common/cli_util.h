// Running the moecore binary from tests: a command line through the shell with a time limit
// (a reader that blocks, e.g. on a FIFO, fails the test instead of hanging it), and the small
// model and token file most command-line tests train.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/paths.h"

namespace moe::test {

struct CliResult {
  int status = -1;     // exit code; 124 when the time limit killed it; -1 on a signal
  std::string output;  // stdout and stderr together
};

// launcher: a command line the binary runs under ("mpirun -np 2 "), or "".
inline CliResult run_cli(const std::string& args, int timeout_s = 60, const std::string& launcher = "") {
  const std::string cmd = "timeout -s KILL " + std::to_string(timeout_s) + " " + launcher + std::string(::moe::test::moecore_binary()) +
                          " " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  CliResult r;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (r.status == 137) r.status = 124;
  return r;
}

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

inline std::filesystem::path fresh_test_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("moecore_cli_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// n uint16 tokens below 64 with some structure (a model learns it), written flat.
inline void write_tokens(const std::filesystem::path& path, size_t n, uint32_t salt = 0) {
  std::vector<uint16_t> toks(n);
  for (size_t i = 0; i < n; ++i) toks[i] = static_cast<uint16_t>((i * 7 + i / 3 + salt) % 64);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 2));
}

// A model that trains in milliseconds (vocab 64), no validation, one thread.
inline std::string tiny_model_sets() {
  return " --set model.vocab_size=64 --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=4"
         " --set model.n_kv_heads=2 --set model.num_experts=4 --set model.expert_hidden=16 --set train.seq_len=24"
         " --set train.batch_size=4 --set train.micro_batch_size=2 --set optim.warmup_steps=1"
         " --set train.eval_every=0 --set data.valid_path= --set train.threads=1 --set train.log_every=1000";
}

// The records of dir/metrics.jsonl, one JSON object per step.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace moe::test
