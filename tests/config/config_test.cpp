// Config parsing: every mistake is an error naming the key, the value and what is allowed.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>

#include "common/paths.h"
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "core/check.h"
#include "model/params.h"

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

std::string error_of_validate(const Config& c) {
  try {
    c.validate();
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

// Checkpoints and fixtures written before a key existed carry configs without it: they read as
// the key's default, which keeps the function they were trained with.
TEST(Config, JsonWithoutTheOlmoCore3KeysReadsAsTheModelItWasWrittenFor) {
  nlohmann::json j = nlohmann::json::parse(config_to_json(parse_config("", {"model.norm_placement=peri"})));
  for (const char* key : {"dense_layers", "sigmoid_eps", "norm_topk_p", "restore_weight_scale", "expert_weight_scale",
                          "original_top_k", "embed_scale", "embedding_norm"})
    ASSERT_EQ(j["model"].erase(key), 1u) << key;
  const Config c = config_from_json(j.dump());
  EXPECT_EQ(config_to_toml(c), config_to_toml(parse_config("", {"model.norm_placement=peri"})));
  EXPECT_DOUBLE_EQ(c.model.expert_weight_factor(), 1);
  EXPECT_DOUBLE_EQ(c.model.expert_weight_norm_p(), 0);
  EXPECT_EQ(c.model.num_moe_layers(), c.model.n_layers);
}

TEST(Config, TheCommittedDefaultConfigParses) {
  std::ifstream in(std::string(::moe::test::source_dir()) + "/configs/default.toml");
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

// Olmo-core 3's options (docs/MODEL.md): dense layers anywhere number the MoE layers in order;
// each option's check names its key.
TEST(Config, OlmoCore3OptionsParseAndNameTheirKeysInErrors) {
  Config c = parse_config("", {"model.n_layers=5", "model.dense_layers=1,3", "model.norm_placement=reordered",
                               "model.score_func=sigmoid", "model.sigmoid_eps=1e-7", "model.norm_topk_prob=true",
                               "model.norm_topk_p=2", "model.restore_weight_scale=true", "model.top_k=2",
                               "model.original_top_k=8", "model.expert_weight_scale=0.5", "model.embed_scale=16",
                               "model.embedding_norm=true"});
  const ModelConfig& m = c.model;
  EXPECT_EQ(m.num_moe_layers(), 3);
  EXPECT_EQ(m.num_dense_layers(), 2);
  const bool moe[] = {true, false, true, false, true};
  for (int64_t l = 0; l < 5; ++l) EXPECT_EQ(m.is_moe_layer(l), moe[l]) << l;
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(m.moe_layer(i), 2 * i);
    EXPECT_EQ(m.moe_index(2 * i), i);
  }
  EXPECT_THROW(m.moe_index(1), Error);
  EXPECT_DOUBLE_EQ(m.expert_weight_norm_p(), 2);
  EXPECT_DOUBLE_EQ(m.expert_weight_factor(), 2 * 0.5 * 2);  // K, the scale, sqrt(8 / 2)
  EXPECT_EQ(config_to_toml(parse_config(config_to_toml(c), {})), config_to_toml(c));
  EXPECT_EQ(model_choices(m).norm_placement, NormPlacement::kReordered);
  // A softmax over the chosen logits divides by their sum.
  EXPECT_DOUBLE_EQ(parse_config("", {"model.score_func=topk_softmax"}).model.expert_weight_norm_p(), 1);
  EXPECT_DOUBLE_EQ(parse_config("", {}).model.expert_weight_norm_p(), 0);

  expect_mentions(error_of("", {"model.dense_layers=1,x"}), {"model.dense_layers", "'x'"});
  expect_mentions(error_of("", {"model.dense_layers=4"}), {"model.dense_layers", "layer 4", "n_layers = 4"});
  expect_mentions(error_of("", {"model.dense_layers=2,1"}), {"model.dense_layers", "increase"});
  expect_mentions(error_of("", {"model.dense_layers=1", "model.n_dense_layers=1"}),
                  {"model.dense_layers", "model.n_dense_layers"});
  expect_mentions(error_of("", {"model.sigmoid_eps=1e-7"}), {"model.sigmoid_eps", "sigmoid", "softmax"});
  expect_mentions(error_of("", {"model.norm_topk_p=2"}), {"model.norm_topk_p", "model.norm_topk_prob"});
  expect_mentions(error_of("", {"model.score_func=top_k"}), {"model.score_func", "topk_softmax"});
  expect_mentions(error_of("", {"model.embed_scale=0"}), {"model.embed_scale"});
  expect_mentions(error_of("", {"model.n_group=2"}), {"model.n_group = 2", "model.topk_group = 0"});
  expect_mentions(error_of("", {"model.n_group=3", "model.topk_group=1"}), {"model.n_group = 3", "num_experts = 8"});
  expect_mentions(error_of("", {"model.n_group=4", "model.topk_group=5"}), {"model.topk_group = 5"});
  expect_mentions(error_of("", {"model.n_group=8", "model.topk_group=1", "model.top_k=2"}), {"model.top_k = 2", "1 groups"});
  expect_mentions(error_of("", {"model.n_group=4", "model.topk_group=2", "model.score_func=topk_softmax"}),
                  {"model.n_group", "topk_softmax"});
  expect_mentions(error_of("", {"model.score_correction_bias=true", "model.routing=uniform"}),
                  {"model.score_correction_bias", "learned"});
  expect_mentions(error_of("", {"loss.aux_divisor=labels"}), {"loss.aux_divisor", "labelled"});
  expect_mentions(error_of("", {"model.shared_hidden=8", "model.shared_experts=2"}),
                  {"model.shared_experts", "model.shared_router"});
  expect_mentions(error_of("", {"model.shared_router=true"}), {"model.shared_router", "model.shared_hidden"});
  expect_mentions(error_of("", {"model.shared_hidden=8", "model.shared_router=true", "model.shared_merge=v1"}),
                  {"model.shared_router", "model.shared_merge"});
  expect_mentions(error_of("", {"model.shared_hidden=8", "model.shared_router=true",
                                "model.shared_router_score=topk_softmax"}),
                  {"model.shared_router_score", "topk_softmax"});
  expect_mentions(error_of("", {"model.shared_router_bias=true"}), {"model.shared_router_score", "model.shared_router"});
  expect_mentions(error_of("", {"model.shared_hidden=8", "model.shared_router=true", "model.shared_router_sigmoid_eps=1e-7"}),
                  {"model.shared_router_sigmoid_eps", "sigmoid"});
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

// The FLOPs by part (the bench's per-phase GFLOP/s): hand counts of each, and their sum is the
// model's count for every kind of layer (dense, windowed, shared experts with their router, GQA).
TEST(Config, TrainFlopsByPartCountEachPartAndSumToTheModelsCount) {
  Config c = parse_config("", {"model.n_dense_layers=1", "model.shared_hidden=64"});
  const ModelConfig& m = c.model;
  const double D = static_cast<double>(m.d_model), q = static_cast<double>(m.n_heads * m.hd()),
               kv = static_cast<double>(m.n_kv_heads * m.hd()), L = static_cast<double>(m.n_layers), S = 256;
  const ModelConfig::TrainFlops f = m.train_flops_by_part(256);
  EXPECT_DOUBLE_EQ(f.lm_head, 6.0 * static_cast<double>(m.vocab_size) * D);
  EXPECT_DOUBLE_EQ(f.attention, L * (6.0 * (2 * D * q + 2 * D * kv) + 12.0 * q * (S + 1) / 2));
  EXPECT_DOUBLE_EQ(f.dense_ffn, 6.0 * 3 * D * static_cast<double>(m.dense_width()));
  EXPECT_DOUBLE_EQ(f.router, (L - 1) * 6.0 * static_cast<double>(m.num_experts) * D);
  EXPECT_DOUBLE_EQ(f.experts, (L - 1) * 6.0 * 3 * D * static_cast<double>(m.top_k * m.expert_hidden + m.shared_hidden));
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{}, {"model.n_dense_layers=1", "model.shared_hidden=64"},
        {"model.n_layers=6", "model.sliding_window=\"64,64,-1\"", "model.n_kv_heads=1"},
        {"model.shared_hidden=32", "model.shared_experts=3", "model.shared_router=true"}}) {
    const ModelConfig mc = parse_config("", sets).model;
    EXPECT_NEAR(mc.train_flops_by_part(256).total(), mc.train_flops_per_token(256), 1e-12 * mc.train_flops_per_token(256))
        << testing::PrintToString(sets);
  }
}

// Olmo-core 3's SlidingWindowAttentionConfig: the pattern repeats from layer 1 (full_first), the
// last layer is full, -1 is full; the FLOP count takes each layer's query-key pairs.
TEST(Config, SlidingWindowsFollowOlmoCore3sPatternAndCutTheAttentionFlops) {
  Config c = parse_config("", {"model.n_layers=6", "model.sliding_window=\"64,64,-1\""});
  const ModelConfig& m = c.model;
  const std::vector<int64_t> want{0, 64, 64, 0, 64, 0};
  for (int64_t l = 0; l < 6; ++l) EXPECT_EQ(m.attention_window(l), want[static_cast<size_t>(l)]) << "layer " << l;
  EXPECT_EQ(m.attention_windows(), std::vector<int64_t>{64});
  Config flat = parse_config("", {"model.n_layers=3", "model.sliding_window=\"8,16\"", "model.sliding_window_full_first=false",
                                  "model.sliding_window_full_last=false"});
  EXPECT_EQ(flat.model.attention_window(0), 8);
  EXPECT_EQ(flat.model.attention_window(1), 16);
  EXPECT_EQ(flat.model.attention_window(2), 8);
  EXPECT_EQ(flat.model.attention_windows(), (std::vector<int64_t>{8, 16}));
  // Hand count at S = 256: a full layer has S(S+1)/2 = 32896 pairs, a window of 64 has
  // 64*65/2 + (256-64)*64 = 14368 (the first 64 queries a triangle, the rest 64 keys each).
  const double S = 256, active = static_cast<double>(m.num_active_matmul_params());
  const double per_pair = 12.0 * static_cast<double>(m.n_heads * m.hd()) / S;
  EXPECT_DOUBLE_EQ(m.attention_pairs(1, 256), 14368.0);
  EXPECT_DOUBLE_EQ(m.attention_pairs(0, 256), 32896.0);
  EXPECT_DOUBLE_EQ(m.train_flops_per_token(256), 6.0 * active + per_pair * (3 * 32896.0 + 3 * 14368.0));
  EXPECT_DOUBLE_EQ(m.train_flops_per_token_noncausal(256),
                   6.0 * active + 12.0 * static_cast<double>(m.n_heads * m.hd()) * (3 * S + 3 * 64));
  EXPECT_LT(m.train_flops_per_token(256), parse_config("", {"model.n_layers=6"}).model.train_flops_per_token(256));
  // A window at least S is full attention.
  EXPECT_DOUBLE_EQ(m.attention_pairs(1, 64), 64.0 * 65 / 2);
  for (const char* bad : {"model.sliding_window=\"64,0\"", "model.sliding_window=\"64,x\"", "model.sliding_window=\"-2\""})
    EXPECT_THROW(
        {
          try {
            parse_config("", {bad});
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("model.sliding_window"), std::string::npos) << e.what();
            throw;
          }
        },
        Error)
        << bad;
  EXPECT_THROW(parse_config("", {"model.sliding_window_full_last=false"}), Error);  // no window to apply it to
}

// Every Olmo-core 3 option that changes the FLOP count, together: a dense layer inside the stack
// (its own width), a shared expert, windows on some layers, per-head QK-norm and the embedding norm
// (no matmul), counted by hand.
TEST(Config, AllOptionsFlopCountByHand) {
  Config c = parse_config("", {"model.n_layers=4", "model.dense_layers=\"2\"", "model.dense_hidden=300",
                                "model.shared_hidden=64", "model.shared_experts=3", "model.shared_router=true",
                                "model.shared_router_bias=true", "model.router_logit_bias=true", "model.sliding_window=\"32\"", "model.qk_norm=per_head",
                                "model.norm_placement=reordered", "model.embedding_norm=true", "model.embed_scale=16",
                                "model.restore_weight_scale=true", "model.rope=windowed", "train.seq_len=100"});
  const ModelConfig& m = c.model;
  const double D = static_cast<double>(m.d_model), hd = static_cast<double>(m.hd());
  const double q = static_cast<double>(m.n_heads) * hd, kv = static_cast<double>(m.n_kv_heads) * hd;
  const double attn = 2 * D * q + 2 * D * kv;
  // Three shared experts of 64 and their gate (3 x D); the logit biases are no matmul.
  const double moe = static_cast<double>(m.num_experts) * D + 3.0 * static_cast<double>(m.top_k * m.expert_hidden) * D +
                     3.0 * 3 * 64 * D + 3 * D;
  const double active = static_cast<double>(m.vocab_size) * D + 4 * attn + 3 * moe + 3.0 * 300 * D;
  EXPECT_DOUBLE_EQ(static_cast<double>(m.num_active_matmul_params()), active);
  // Layers 0 and 3 full (forced), 1 and 2 windowed (32 of 100): 2 x 5050 + 2 x (528 + 68 x 32) pairs.
  const double pairs = 2 * 5050.0 + 2 * (32.0 * 33 / 2 + 68.0 * 32);
  EXPECT_DOUBLE_EQ(m.train_flops_per_token(100), 6 * active + 12 * static_cast<double>(m.n_heads) * hd * pairs / 100);
  // Parameters: per MoE layer two more shared experts, the gate (3 x D + 3 bias) and the routed bias (E).
  ModelConfig one = m;
  one.shared_experts = 1;
  one.shared_router = one.shared_router_bias = one.router_logit_bias = false;
  EXPECT_EQ(m.num_params() - one.num_params(),
            3 * (2 * 3 * 64 * m.d_model + 3 * m.d_model + 3 + m.num_experts));
}

// Olmo-core 3's attention options: the biases are 4 vectors a layer, counted in num_params and in
// the layout (hence the planner and checkpoints); their adds, the clamp and partial RoPE are not
// matmul FLOPs (like the norms), so the MFU count is unchanged. Invalid values are refused by key.
TEST(Config, AttentionOptionsCountParametersNotFlops) {
  const Config base = parse_config("", {"model.n_layers=3", "model.head_dim=24"});
  const Config c = parse_config("", {"model.n_layers=3", "model.head_dim=24", "model.attention_bias=true",
                                     "model.clip_qkv=8", "model.rope_partial=0.25"});
  const ModelConfig& m = c.model;
  const int64_t q = m.n_heads * m.hd(), kv = m.n_kv_heads * m.hd();
  EXPECT_EQ(m.num_params() - base.model.num_params(), 3 * (q + 2 * kv + m.d_model));
  const ParamLayout layout(m);
  int64_t in_layout = 0;
  for (const ParamInfo& p : layout.entries()) in_layout += p.numel;
  EXPECT_EQ(in_layout, m.num_params());
  EXPECT_EQ(layout.find("layers.2.bk").numel, kv);
  EXPECT_DOUBLE_EQ(m.train_flops_per_token(100), base.model.train_flops_per_token(100));
  EXPECT_EQ(m.rotary_dim(), 6);  // int(24 x 0.25)
  for (const char* bad : {"model.rope_partial=0.1", "model.rope_partial=1.5", "model.clip_qkv=-1"}) {
    const std::string msg = error_of("", {bad});
    EXPECT_NE(msg.find(std::string(bad).substr(0, std::string(bad).find('='))), std::string::npos) << msg;
  }
}

// Every number of a config is finite: inf, -inf and nan are refused for every numeric key, in
// TOML and in --set, naming the key (where "no limit" makes sense, 0 means off).
TEST(Config, EveryNumericKeyRefusesInfinityAndNan) {
  int checked = 0;
  for (const auto& [key, value] : config_entries(parse_config("", {}))) {
    const bool number = !value.empty() && (std::isdigit(static_cast<unsigned char>(value[0])) || value[0] == '-');
    if (!number) continue;
    const bool is_double = value.find_first_of(".eE") != std::string::npos;
    const std::string section = key.substr(0, key.find('.')), name = key.substr(key.find('.') + 1);
    for (const char* bad : {"inf", "-inf", "nan", "+inf"}) {
      SCOPED_TRACE(key + " = " + bad);
      const std::string via_set = error_of("", {key + "=" + bad});
      const std::string via_toml = error_of("[" + section + "]\n" + name + " = " + bad + "\n");
      for (const std::string& msg : {via_set, via_toml}) {
        EXPECT_NE(msg.find(key), std::string::npos) << msg;
        if (is_double) {
          EXPECT_TRUE(msg.find("must be finite") != std::string::npos || msg.find("is not a number") != std::string::npos)
              << msg;
        }
      }
    }
    ++checked;
  }
  EXPECT_GE(checked, 40);
  // Configs built in code (or from a Hugging Face config.json) get the same checks.
  Config c = parse_config("", {});
  c.optim.lr = std::numeric_limits<double>::infinity();
  expect_mentions(error_of_validate(c), {"optim.lr", "must be finite"});
  c = parse_config("", {});
  c.model.init_std = std::nan("");
  expect_mentions(error_of_validate(c), {"model.init_std", "is not a number"});
  c = parse_config("", {});
  c.model.norm_eps = 5;
  expect_mentions(error_of_validate(c), {"model.norm_eps", "out of range [0, 1]"});
}

TEST(Config, RangesWithoutUpperLimitShowAsHalfOpen) {
  expect_mentions(error_of("", {"optim.lr=-1"}), {"optim.lr", "out of range [0, inf)"});
}

// Error lines echo at most ~200 bytes of what the user wrote, then "... (N bytes)".
TEST(Config, ErrorLinesBoundEchoedInput) {
  const std::string huge(10 << 20, 'x');
  const std::vector<std::string> errors = {
      error_of("[model]\n" + huge + " = 1\n"),
      error_of("[" + huge + "]\nx = 1\n"),
      error_of("[train]\nprecision = \"" + huge + "\"\n"),
      error_of("", {"model." + huge + "=1"}),
      error_of("", {"model.d_model=" + huge}),
      error_of("", {huge}),
      error_of("[model]\nd_model = \"" + huge + "\"\n"),
  };
  for (const std::string& e : errors) {
    EXPECT_LT(e.size(), 1500u) << e.substr(0, 300);
    EXPECT_NE(e.find("... (1048576"), std::string::npos) << e.substr(0, 300);  // the 10 MiB (+ quotes)
  }
  EXPECT_EQ(echo(std::string(200, 'a')), std::string(200, 'a'));
  EXPECT_EQ(echo(std::string(201, 'a')), std::string(200, 'a') + "... (201 bytes)");
  // A UTF-8 sequence is never split: 199 ASCII bytes, then a 2-byte character across the cut.
  const std::string utf = std::string(199, 'a') + "\xc3\xa9" + "tail";
  EXPECT_EQ(echo(utf), std::string(199, 'a') + "... (205 bytes)");
  EXPECT_EQ(echo(utf, 201), std::string(199, 'a') + "\xc3\xa9... (205 bytes)");
}

TEST(Config, EmptyPathsAreRefusedNamingTheKey) {
  expect_mentions(error_of("", {"train.out_dir="}), {"train.out_dir is empty"});
  expect_mentions(error_of("[train]\nout_dir = \"\"\n"), {"train.out_dir is empty"});
}

TEST(Config, TokenIdsAreBelowTheVocabularyAndPadDiffersFromEos) {
  expect_mentions(error_of("", {"model.pad_id=256"}), {"model.pad_id = 256", "vocab_size = 256"});
  expect_mentions(error_of("", {"data.bos_id=300"}), {"data.bos_id = 300", "vocab_size"});
  expect_mentions(error_of("", {"model.pad_id=3", "data.eos_id=3"}), {"model.pad_id = data.eos_id = 3"});
  EXPECT_EQ(parse_config("", {"model.pad_id=0", "data.eos_id=1", "data.bos_id=2"}).model.pad_id, 0);
}

TEST(Config, StringsWithQuotesAndBackslashesRoundTripThroughToml) {
  const Config c = parse_config("", {"train.out_dir=runs/a \"quoted\" \\ name"});
  EXPECT_EQ(parse_config(config_to_toml(c), {}).train.out_dir, "runs/a \"quoted\" \\ name");
}

}  // namespace
}  // namespace moe
