// Config parsing: every mistake is an error naming the key, the value and what is allowed.
#include <gtest/gtest.h>

#include <fstream>

#include "config/config.h"
#include "core/check.h"

namespace moe {
namespace {

std::string error_of(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(toml, overrides);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_mentions(const std::string& msg, std::initializer_list<const char*> parts) {
  EXPECT_FALSE(msg.empty()) << "expected an error";
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' missing from: " << msg;
}

TEST(Config, DefaultsAreValidAndRoundTripThroughToml) {
  Config c = parse_config("", {});
  Config again = parse_config(config_to_toml(c), {});
  EXPECT_EQ(config_to_toml(c), config_to_toml(again));
  Config j = config_from_json(config_to_json(c));
  EXPECT_EQ(config_to_toml(c), config_to_toml(j));
}

TEST(Config, TheCommittedDefaultConfigParses) {
  std::ifstream in(std::string(MOE_SOURCE_DIR) + "/configs/default.toml");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Config c = parse_config(text, {});
  EXPECT_EQ(c.model.vocab_size, 256);
}

TEST(Config, UnknownKeysNameTheKeyAndTheAllowedOnes) {
  expect_mentions(error_of("[model]\nnum_expert = 8\n"), {"model.num_expert", "num_experts", "top_k"});
  expect_mentions(error_of("[modle]\nx = 1\n"), {"modle", "model", "optim"});
  expect_mentions(error_of("", {"train.stepz=3"}), {"train.stepz", "steps"});
}

TEST(Config, WrongTypesAndRangesNameTheValue) {
  expect_mentions(error_of("[model]\nd_model = \"big\"\n"), {"model.d_model", "big", "integer"});
  expect_mentions(error_of("[optim]\nbeta2 = 1.5\n"), {"optim.beta2", "1.5", "range"});
  expect_mentions(error_of("[model]\nnorm_placement = \"post\"\n"), {"norm_placement", "post", "pre, peri"});
  expect_mentions(error_of("", {"model.routing=randm"}), {"model.routing", "randm", "learned, uniform, random"});
  expect_mentions(error_of("", {"train.recompute=yes"}), {"train.recompute", "true or false"});
  expect_mentions(error_of("", {"model.top_k=2.5"}), {"model.top_k", "integer"});
  expect_mentions(error_of("[model\n"), {"parse error"});
}

TEST(Config, CrossFieldChecksNameBothFields) {
  expect_mentions(error_of("", {"model.n_heads=8", "model.n_kv_heads=3"}), {"n_kv_heads = 3", "n_heads = 8"});
  expect_mentions(error_of("", {"model.top_k=9", "model.num_experts=8"}), {"top_k = 9", "num_experts = 8"});
  expect_mentions(error_of("", {"train.batch_size=6", "train.micro_batch_size=4"}), {"batch_size = 6", "micro_batch_size = 4"});
  expect_mentions(error_of("", {"train.precision=bf16", "train.backend=ref"}), {"precision", "backend"});
}

TEST(Config, OverridesApplyInOrderWithTypes) {
  Config c = parse_config("[model]\ntop_k = 1\n", {"model.top_k=4", "optim.min_lr=1e-5", "optim.lr=1e-4", "model.tie_embeddings=true", "model.qk_norm=per_head"});
  EXPECT_EQ(c.model.top_k, 4);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-4);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.model.qk_norm, "per_head");
}

TEST(Config, FlopsFollowTheStatedFormula) {
  Config c = parse_config("", {"model.n_dense_layers=1", "model.shared_hidden=64"});
  const ModelConfig& m = c.model;
  const int64_t D = m.d_model, hd = m.hd(), q = m.n_heads * hd, kv = m.n_kv_heads * hd;
  int64_t active = m.vocab_size * D;
  active += m.n_layers * (2 * D * q + 2 * D * kv);
  active += 3 * D * m.dense_width();
  active += (m.n_layers - 1) * (m.num_experts * D + 3 * m.top_k * m.expert_hidden * D + 3 * D * m.shared_hidden);
  EXPECT_EQ(m.num_active_matmul_params(), active);
  const double S = 256;
  EXPECT_DOUBLE_EQ(m.train_flops_per_token(256), 6.0 * active + 12.0 * m.n_layers * m.n_heads * hd * (S + 1) / 2);
  EXPECT_DOUBLE_EQ(m.train_flops_per_token_noncausal(256), 6.0 * active + 12.0 * m.n_layers * m.n_heads * hd * S);
}

}  // namespace
}  // namespace moe
