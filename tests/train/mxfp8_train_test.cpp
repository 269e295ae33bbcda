// train.precision = "mxfp8" (model/mx_experts.h): config errors that name the key, the memory
// estimate against the arena and the caches actually allocated, losses against bf16 on the same
// data, the quantization statistics in metrics.jsonl, and a precision switch on resume.
// (Device discipline and exact resume: tests/train/strict_train_test.cpp's mxfp8 variants; EP and
// its bytes: tests/parallel.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "config/config.h"
#include "parallel/parallelize.h"
#include "plan/memory.h"
#include "model/model_state.h"
#include "model/transformer.h"
#include "common/cli_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<std::string> small_model() {
  return {"model.vocab_size=96", "model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
          "model.num_experts=4", "model.top_k=2", "model.expert_hidden=32", "train.seq_len=16",
          "train.micro_batch_size=3", "train.batch_size=3", "optim.warmup_steps=0", "train.precision=mxfp8"};
}

TEST(Mxfp8Config, ShapesThatAreNotBlocksOf32NameTheKey) {
  auto error = [](std::vector<std::string> extra) {
    std::vector<std::string> o = small_model();
    o.insert(o.end(), extra.begin(), extra.end());
    return test::error_of([&] { parse_config("", o).validate(); });
  };
  EXPECT_NE(error({"model.d_model=48"}).find("model.d_model = 48 is not a multiple of 32"), std::string::npos)
      << error({"model.d_model=48"});
  EXPECT_NE(error({"model.expert_hidden=40"}).find("model.expert_hidden = 40 is not a multiple of 32"),
            std::string::npos);
  EXPECT_NE(error({"mxfp8.experts=false"}).find("mxfp8.dispatch = true needs mxfp8.experts = true"),
            std::string::npos);
  EXPECT_NE(error({"train.backend=cuda"}).find("mxfp8"), std::string::npos);
  // The attention projections reduce over D forward and over their widths backward.
  const std::string heads = error({"mxfp8.attention=true", "model.head_dim=12"});
  EXPECT_NE(heads.find("the query width model.n_heads x head dim = 4 x 12 (model.head_dim"), std::string::npos) << heads;
  EXPECT_NE(heads.find("mxfp8.attention = true"), std::string::npos) << heads;
  const std::string kv = error({"mxfp8.attention=true", "model.n_kv_heads=1"});
  EXPECT_NE(kv.find("the key/value width model.n_kv_heads x head dim = 1 x 16"), std::string::npos) << kv;
  EXPECT_EQ(error({"model.n_kv_heads=1"}), "(no error)");  // attention stays bf16 by default
  // The same shapes are fine without MXFP8, and with MXFP8 off in the experts (nothing else
  // is quantized yet).
  EXPECT_EQ(error({"model.d_model=48", "train.precision=bf16"}), "(no error)");
  EXPECT_EQ(error({"model.expert_hidden=40", "mxfp8.experts=false", "mxfp8.dispatch=false"}), "(no error)");
}

// The estimate is the arena (the same plan, measured), plus two 33/32-byte caches per expert
// weight, which the model state allocates.
TEST(Mxfp8Memory, EstimateEqualsTheArenaAndCountsTheCaches) {
  std::unique_ptr<Backend> ops = make_backend("cpu");
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {}, {"train.recompute=true"}, {"model.n_dense_layers=1", "model.shared_hidden=32"},
           {"mxfp8.experts=false", "mxfp8.dispatch=false"}, {"mxfp8.attention=true"},
           {"mxfp8.attention=true", "train.recompute=true", "model.n_dense_layers=1", "model.shared_hidden=32"},
           {"mxfp8.attention=true", "mxfp8.experts=false", "mxfp8.dispatch=false"}}) {
    std::vector<std::string> o = small_model();
    o.insert(o.end(), extra.begin(), extra.end());
    const Config c = parse_config("", o);
    const Transformer model(c.model, c.loss, model_options(c, DType::kF32, nullptr), *ops);
    const MemoryEstimate m = estimate_memory(c);
    EXPECT_EQ(static_cast<double>(model.activation_arena_bytes()), m.activations) << o.back();
    const int64_t moe_layers = c.model.num_moe_layers(), w = c.model.num_experts * c.model.expert_hidden * c.model.d_model;
    // Attention: wq, wk, wv, wo in every layer, (2H + 2G) x hd x D values.
    const int64_t wa = (2 * c.model.n_heads + 2 * c.model.n_kv_heads) * c.model.hd() * c.model.d_model;
    const double expert_caches = c.mxfp8.experts ? static_cast<double>(moe_layers * 6 * (w + w / 32)) : 0.0;
    const double attention_caches = c.mxfp8.attention ? static_cast<double>(c.model.n_layers * 2 * (wa + wa / 32)) : 0.0;
    EXPECT_EQ(m.mx_caches, expert_caches + attention_caches) << o.back();
  }
}

// MXFP8 arenas are smaller than bf16 ones: the saved expert inputs are 1 + 1/32 bytes per value.
TEST(Mxfp8Memory, SavedExpertInputsAreStoredQuantized) {
  std::vector<std::string> o = small_model();
  const Config mx = parse_config("", o);
  o.back() = "train.precision=bf16";
  const Config bf = parse_config("", o);
  const Dims dm = model_dims(mx.model, 3, 16, DType::kF32, true, 1, 0, false, mx_mode(mx));
  const Dims db = model_dims(bf.model, 3, 16, DType::kF32, true);
  const ActivationPlan pm(mx.model, dm, StagePlan{0, 3, 1, false}, nullptr), pb(bf.model, db, StagePlan{0, 3, 1, false}, nullptr);
  // Per MoE layer, bf16 saved xs (R,D) and ea (R,F) at 2 bytes; MXFP8 saves both at 33/32.
  const int64_t R = 3 * 16 * 2, D = 64, F = 32, layers = 3;
  const double saved_bf16 = static_cast<double>(layers * R * (D + F) * 2);
  const double saved_mx = static_cast<double>(layers * R * (D + F) * 33 / 32);
  EXPECT_EQ(static_cast<double>(pb.saved_tensor_bytes()) - static_cast<double>(pm.saved_tensor_bytes()), saved_bf16 - saved_mx);
}

// MXFP8 attention saves the normed input quantized instead of bf16, and the attention output
// quantized too (wo's weight gradient reads it dequantized) beside the bf16 o the attention
// backward reads: per layer T x D values at 33/32 bytes instead of 2, plus T x H x hd at 33/32.
TEST(Mxfp8Memory, SavedAttentionOperandsAreStoredQuantized) {
  std::vector<std::string> o = small_model();
  const Config experts = parse_config("", o);
  o.push_back("mxfp8.attention=true");
  const Config both = parse_config("", o);
  const Dims de = model_dims(experts.model, 3, 16, DType::kF32, true, 1, 0, false, mx_mode(experts));
  const Dims db = model_dims(both.model, 3, 16, DType::kF32, true, 1, 0, false, mx_mode(both));
  ASSERT_TRUE(db.mx.attention);
  const ActivationPlan pe(experts.model, de, StagePlan{0, 3, 1, false}, nullptr), pb(both.model, db, StagePlan{0, 3, 1, false}, nullptr);
  const int64_t T = 3 * 16, D = 64, Hd = 4 * 16, layers = 3;
  EXPECT_EQ(static_cast<double>(pe.saved_tensor_bytes()) - static_cast<double>(pb.saved_tensor_bytes()),
            static_cast<double>(layers * T * D * 2) - static_cast<double>(layers * T * (D + Hd) * 33 / 32));
}

test::CliResult train(const fs::path& root, const std::string& sets, const fs::path& out, bool resume = false) {
  return test::run_cli("train" + test::tiny_model_sets() + " --set model.expert_hidden=32 --set train.steps=12" + sets +
                           " --set data.train_path=" + (root / "train.bin").string() +
                           " --set train.out_dir=" + out.string() + (resume ? " --resume" : ""),
                       120);
}

// Same data, same init: per step the MXFP8 cross-entropy stays within 1% of bf16's (the tiny
// model's losses move by ~0.3 per step early on; quantization noise is far smaller), and the
// records carry each MoE layer's quantization statistics.
TEST(Mxfp8Train, LossesFollowBf16AndMetricsCarryTheQuantizationStatistics) {
  const fs::path root = test::fresh_test_dir("mxfp8_train");
  test::write_tokens(root / "train.bin", 6000);
  ASSERT_EQ(train(root, " --set train.precision=bf16", root / "bf16").status, 0);
  const test::CliResult r = train(root, " --set train.precision=mxfp8", root / "mxfp8");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<json> a = test::read_metrics(root / "bf16"), b = test::read_metrics(root / "mxfp8");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double ca = a[i].at("ce").get<double>(), cb = b[i].at("ce").get<double>();
    EXPECT_LT(std::fabs(cb - ca) / ca, 0.01) << "step " << i + 1 << ": bf16 " << ca << ", mxfp8 " << cb;
    EXPECT_NE(ca, cb) << "step " << i + 1 << ": MXFP8 changed nothing?";
    for (const char* key : {"mx_fwd_amax", "mx_fwd_saturated", "mx_fwd_underflow", "mx_bwd_amax", "mx_bwd_saturated",
                            "mx_bwd_underflow"}) {
      ASSERT_TRUE(b[i].contains(key)) << key;
      ASSERT_EQ(b[i].at(key).size(), 2u) << key;  // the two MoE layers
      for (double v : b[i].at(key).get<std::vector<double>>()) {
        EXPECT_GE(v, 0) << key;
        if (std::string(key).find("amax") == std::string::npos) {
          EXPECT_LE(v, 1) << key;
        }
      }
    }
    EXPECT_FALSE(a[i].contains("mx_fwd_amax"));
    // rceil rounds every scale up: nothing saturates.
    for (double v : b[i].at("mx_fwd_saturated").get<std::vector<double>>()) EXPECT_EQ(v, 0);
    for (double v : b[i].at("mx_fwd_amax").get<std::vector<double>>()) EXPECT_GT(v, 0);
  }
  fs::remove_all(root);
}

// The attention projections in MXFP8 too (mxfp8.attention; MHA so that the key/value width is a
// block): still within 1% of bf16 per step, and different from the experts-only run.
TEST(Mxfp8Train, AttentionProjectionsInMxfp8FollowBf16) {
  const fs::path root = test::fresh_test_dir("mxfp8_attention");
  test::write_tokens(root / "train.bin", 6000);
  const std::string mha = " --set model.n_kv_heads=4";
  ASSERT_EQ(train(root, mha + " --set train.precision=bf16", root / "bf16").status, 0);
  ASSERT_EQ(train(root, mha + " --set train.precision=mxfp8", root / "experts").status, 0);
  const test::CliResult r = train(root, mha + " --set train.precision=mxfp8 --set mxfp8.attention=true", root / "attn");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<json> a = test::read_metrics(root / "bf16"), e = test::read_metrics(root / "experts"),
                          b = test::read_metrics(root / "attn");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  ASSERT_EQ(e.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double ca = a[i].at("ce").get<double>(), cb = b[i].at("ce").get<double>();
    EXPECT_LT(std::fabs(cb - ca) / ca, 0.01) << "step " << i + 1 << ": bf16 " << ca << ", mxfp8 attention " << cb;
    if (i > 0) {
      EXPECT_NE(cb, e[i].at("ce").get<double>()) << "step " << i + 1 << ": the attention switch changed nothing?";
    }
  }
  fs::remove_all(root);
}

// The OCP floor rule saturates the largest values of a block (its scale rounds down).
TEST(Mxfp8Train, FloorRuleSaturatesAndTheRecordSaysSo) {
  const fs::path root = test::fresh_test_dir("mxfp8_floor");
  test::write_tokens(root / "train.bin", 6000);
  const test::CliResult r = train(root, " --set train.precision=mxfp8 --set mxfp8.scale_rule=floor --set mxfp8.grad_format=e5m2", root / "floor");
  ASSERT_EQ(r.status, 0) << r.output;
  double saturated = 0;
  for (const json& s : test::read_metrics(root / "floor"))
    for (double v : s.at("mx_fwd_saturated").get<std::vector<double>>()) saturated += v;
  EXPECT_GT(saturated, 0);
  fs::remove_all(root);
}

// Checkpoints keep the fp32 masters only: a run resumed in another precision rebuilds the caches
// and says it is not bit-exact.
TEST(Mxfp8Train, ResumingInAnotherPrecisionWarns) {
  const fs::path root = test::fresh_test_dir("mxfp8_resume");
  test::write_tokens(root / "train.bin", 6000);
  ASSERT_EQ(train(root, " --set train.precision=bf16 --set checkpoint.every=4 --set train.steps=4", root / "run").status, 0);
  const test::CliResult r = train(root, " --set train.precision=mxfp8 --set checkpoint.every=4 --set train.steps=8", root / "run", true);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("train.precision = \"mxfp8\" differs from the checkpoint's \"bf16\" (resume is not bit-exact)"),
            std::string::npos)
      << r.output;
  fs::remove_all(root);
}

}  // namespace
}  // namespace moe
