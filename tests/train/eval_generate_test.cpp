// Evaluation (loss, perplexity) and sampling on a small model trained on a learnable synthetic
// stream: token t+1 = (5 t + 3) mod V with probability 0.7, else one of four neighbours of t.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/rng.h"
#include "data/token_file.h"
#include "train/eval_commands.h"
#include "train/evaluate.h"
#include "train/generate.h"
#include "train/trainer.h"

namespace moe {
namespace {

constexpr int64_t kV = 64;

Config tiny_config() {
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = kV;
  m.d_model = 48;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.num_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 32;
  c.optim.lr = 1e-2;
  c.optim.warmup_steps = 5;
  c.train.seq_len = 32;
  c.train.batch_size = 8;
  c.train.micro_batch_size = 4;
  c.train.steps = 80;
  return c;
}

std::string write_stream(const std::string& name, int64_t n, uint64_t seed) {
  // Per process: ctest -j runs this file's tests side by side, and truncating a file another
  // process has mapped kills that one with SIGBUS.
  const std::string path =
      (std::filesystem::temp_directory_path() / ("moe_evalgen_" + std::to_string(getpid()) + "_" + name)).string();
  std::vector<uint16_t> v;
  int64_t tok = 1;
  for (int64_t i = 0; i < n; ++i) {
    v.push_back(static_cast<uint16_t>(tok));
    const double u = random_uniform(seed, 77, static_cast<uint64_t>(i));
    tok = u < 0.7 ? (5 * tok + 3) % kV : (tok + 1 + static_cast<int64_t>((u - 0.7) * 13)) % kV;
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 2));
  return path;
}

struct Trained {
  Config config = tiny_config();
  std::unique_ptr<Backend> ops = make_backend("cpu");
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<TokenDataset> train, valid;
  std::string valid_path;
  double loss_before = 0;
};

Trained& trained() {
  static Trained* t = [] {
    auto* t = new Trained;
    const Config& c = t->config;
    t->train = std::make_unique<TokenDataset>(std::vector<std::string>{write_stream("train.bin", 40000, 1)}, "uint16", kV, c.train.seq_len);
    t->valid_path = write_stream("valid.bin", 4000, 2);
    t->valid = std::make_unique<TokenDataset>(std::vector<std::string>{t->valid_path}, "uint16", kV, c.train.seq_len);
    t->trainer = std::make_unique<Trainer>(c, *t->ops, DType::kF32);
    t->loss_before = evaluate(t->trainer->model(), *t->valid, c.train.micro_batch_size, 0).loss;
    OwnedTensor ids(DType::kI32, {c.train.batch_size, c.train.seq_len}), labels(DType::kI32, {c.train.batch_size, c.train.seq_len});
    std::vector<int64_t> order;
    int64_t epoch = -1;
    for (int64_t s = 0; s < c.train.steps; ++s) {
      fill_batch(*t->train, c.train.seed, s * c.train.batch_size, ids, labels, order, epoch);
      t->trainer->step(ids, labels);
    }
    return t;
  }();
  return *t;
}

TEST(Evaluate, LossFallsWithTrainingAndPerplexityIsExpOfLoss) {
  Trained& t = trained();
  EXPECT_NEAR(t.loss_before, std::log(static_cast<double>(kV)), 0.3) << "an untrained model is near uniform";
  const EvalResult all = evaluate(t.trainer->model(), *t.valid, t.config.train.micro_batch_size, 0);
  EXPECT_LT(all.loss, t.loss_before - 1.0) << "before " << t.loss_before << ", after " << all.loss;
  EXPECT_DOUBLE_EQ(all.perplexity, std::exp(all.loss));
  EXPECT_EQ(all.batches, (t.valid->num_instances() + 3) / 4);
  EXPECT_EQ(all.tokens, all.batches * 4 * (t.config.train.seq_len - 1));
  const EvalResult two = evaluate(t.trainer->model(), *t.valid, t.config.train.micro_batch_size, 2);
  EXPECT_EQ(two.batches, 2);
  EXPECT_EQ(two.tokens, 2 * 4 * (t.config.train.seq_len - 1));
}

TEST(Generate, SampleTokenTemperatureAndTopK) {
  const std::vector<double> logits = {0.0, std::log(3.0), -1.0};
  EXPECT_EQ(sample_token(logits, 0.0, 0, 0.99), 1) << "temperature 0 is greedy";
  EXPECT_EQ(sample_token(logits, 1.0, 1, 0.99), 1) << "top-1 is greedy";
  // top_k = 2: p = (0.75 for id 1, 0.25 for id 0).
  EXPECT_EQ(sample_token(logits, 1.0, 2, 0.74), 1);
  EXPECT_EQ(sample_token(logits, 1.0, 2, 0.76), 0);
  EXPECT_EQ(sample_token(logits, 1.0, 0, 0.9999), 2) << "top_k = 0 keeps every token";
  EXPECT_EQ(ids_to_bytes(bytes_to_ids("In the beginning\n")), "In the beginning\n");
}

TEST(Generate, LearnedRuleSeededAndDeterministic) {
  Trained& t = trained();
  Transformer& model = t.trainer->model();
  const int64_t B = t.config.train.micro_batch_size, S = t.config.train.seq_len;
  GenerateOptions greedy;
  greedy.max_new_tokens = 40;
  greedy.temperature = 0;
  const std::vector<int32_t> prompt = {7};
  std::vector<int32_t> g = generate(model, B, S, prompt, greedy);
  ASSERT_EQ(g.size(), 40u);
  int64_t follows = 0;
  int32_t prev = prompt.back();
  for (int32_t x : g) {
    follows += x == (5 * prev + 3) % kV;
    prev = x;
  }
  EXPECT_GE(follows, 32) << "greedy decoding follows the learned rule t -> 5t+3 mod V";

  GenerateOptions o;
  o.max_new_tokens = 50;  // the context grows past seq_len = 32 and is cropped
  o.temperature = 1.0;
  o.top_k = 0;
  o.seed = 11;
  const auto a = generate(model, B, S, prompt, o), b = generate(model, B, S, prompt, o);
  EXPECT_EQ(a, b) << "same seed, same text";
  o.seed = 12;
  EXPECT_NE(generate(model, B, S, prompt, o), a) << "another seed draws other tokens";
  GenerateOptions top1 = o;
  top1.top_k = 1;
  top1.max_new_tokens = 40;
  EXPECT_EQ(generate(model, B, S, prompt, top1), g) << "top-1 sampling is greedy";
  EXPECT_THROW(generate(model, B, S, {kV}, o), Error);
}

TEST(EvalCommands, EvalPrintsLossAndPerplexityAndGenerateNeedsBytes) {
  Trained& t = trained();
  Config c = t.config;
  c.data.valid_path = t.valid_path;  // this process's own file (write_stream)
  Trainer trainer(c, *t.ops, DType::kF32);
  std::ostringstream out;
  const EvalResult r = run_eval_command(trainer, 2, out);
  EXPECT_NE(out.str().find("validation loss "), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("perplexity "), std::string::npos) << out.str();
  EXPECT_GT(r.perplexity, 1.0);
  EXPECT_THROW(run_generate_command(trainer, "abc", {}, out), Error) << "vocab 64 is not byte-level";
}

}  // namespace
}  // namespace moe
