// moecore command line: train, config, prepare. Every error reaches the user as one line
// naming what was wrong; the exit status is non-zero.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cli/default_config.h"
#include "config/config.h"
#include "core/check.h"
#include "data/prepare.h"
#include "model/memory.h"
#include "train/train_loop.h"

namespace {

const char* kUsage =
    "usage: moecore <command> [options]\n"
    "commands:\n"
    "  train    [--config FILE] [--set section.key=value ...]   train (embedded default config)\n"
    "  config   [--config FILE] [--set section.key=value ...]   print the resolved config and sizes\n"
    "  prepare  --input TEXT --out DIR                           byte-level token files + bigram entropy\n"
    "  help\n";

struct Args {
  std::string command, config_path, input, out;
  std::vector<std::string> overrides;
};

Args parse_args(int argc, char** argv) {
  Args a;
  MOE_CHECK(argc >= 2, "missing command\n", kUsage);
  a.command = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      MOE_CHECK(i + 1 < argc, "option ", flag, " needs a value");
      return argv[++i];
    };
    if (flag == "--config") a.config_path = value();
    else if (flag == "--set") a.overrides.push_back(value());
    else if (flag == "--input") a.input = value();
    else if (flag == "--out") a.out = value();
    else MOE_FAIL("unknown option '", flag, "' (allowed: --config, --set, --input, --out)\n", kUsage);
  }
  return a;
}

moe::Config resolve(const Args& a) {
  if (a.config_path.empty()) return moe::parse_config(moe::kDefaultConfigToml, a.overrides, "embedded default config");
  return moe::load_config(a.config_path, a.overrides);
}

int run(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  if (a.command == "help" || a.command == "--help") {
    std::cout << kUsage;
    return 0;
  }
  if (a.command == "config") {
    moe::Config c = resolve(a);
    const auto& m = c.model;
    std::cout << moe::config_to_toml(c) << "\n# parameters: " << m.num_params()
              << "\n# active matmul parameters per token: " << m.num_active_matmul_params()
              << "\n# training FLOPs per token (causal attention): " << m.train_flops_per_token(c.train.seq_len)
              << "\n# training FLOPs per token (non-causal convention, 12*L*H*hd*S): "
              << m.train_flops_per_token_noncausal(c.train.seq_len) << "\n"
              << "# memory estimate (closed form, src/model/memory.cpp; micro-batch of "
              << c.train.micro_batch_size << " x " << c.train.seq_len << " tokens, " << c.train.precision
              << (c.train.recompute ? ", block recompute" : "") << "):\n"
              << moe::format_memory(moe::estimate_memory(c));
    return 0;
  }
  if (a.command == "prepare") {
    MOE_CHECK(!a.input.empty() && !a.out.empty(), "prepare needs --input TEXT and --out DIR");
    moe::PrepareResult r = moe::prepare_text(a.input, a.out);
    std::cout << "prepared " << a.out << ": " << r.train_tokens << " training and " << r.valid_tokens
              << " validation byte tokens\nunigram entropy " << r.unigram_entropy_nats
              << " nats/token\nbigram conditional entropy " << r.bigram_entropy_nats
              << " nats/token (the bar a trained model must beat on validation)\n";
    return 0;
  }
  if (a.command == "train") {
    moe::TrainSummary s = moe::run_training(resolve(a), std::cout);
    std::cout << "done: " << s.steps << " steps in " << s.seconds << " s, " << s.tokens_per_s
              << " tok/s, final train ce " << s.final_train_loss;
    if (s.final_valid_loss >= 0) std::cout << ", validation ce " << s.final_valid_loss;
    std::cout << "\n";
    return 0;
  }
  MOE_FAIL("unknown command '", a.command, "'\n", kUsage);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moecore: error: %s\n", e.what());
    return 1;
  }
}
