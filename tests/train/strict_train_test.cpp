// Device discipline of the whole training run: `moecore train` on the strict backend (memory the
// host cannot read, ops released only by waits, fresh memory NaN; kernels/strict) against the
// cpu backend, through clipped steps, a skipped non-finite step, evaluations, checkpoints and a
// --resume: every logged number and the final training state bitwise equal. And the host <->
// device budget of a plain step, asserted as equalities: exactly one download (the step's
// statistics, StepStats), of a size stated below.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "model/params.h"
#include "common/cli_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Clipping every step (max_grad_norm 0.05), evaluations and checkpoints every 2 steps, a
// transient NaN gradient at step 4 that is skipped.
std::string run_sets() {
  return test::tiny_model_sets() +
         " --set train.eval_every=2 --set train.eval_batches=2 --set checkpoint.every=2 --set train.steps=6"
         " --set optim.max_grad_norm=0.05 --set train.on_nonfinite=skip --set train.log_every=1";
}

struct Run {
  fs::path dir;
  std::vector<json> steps;
};

test::CliResult train(const fs::path& root, const std::string& backend, const std::string& variant, const fs::path& out,
                      const char* fault, bool resume = false) {
  if (fault) ::setenv("MOE_INJECT_FAULT", fault, 1);
  const test::CliResult r = test::run_cli("train" + run_sets() + variant + " --set train.backend=" + backend +
                                          " --set data.train_path=" + (root / "train.bin").string() +
                                          " --set data.valid_path=" + (root / "valid.bin").string() +
                                          " --set train.out_dir=" + out.string() + (resume ? " --resume" : ""),
                                          120);
  ::unsetenv("MOE_INJECT_FAULT");
  return r;
}

// Fields that measure time or memory, or count transfers (they differ by backend by design).
bool measured(const std::string& key) {
  static const std::set<std::string> k{"step_s", "tokens_per_s", "tflops", "mfu", "peak_tflops", "peak_source", "peak_rss_mb", "elapsed_s", "pp_bubble_s",
                                       "to_host", "to_host_bytes", "to_device", "to_device_bytes",
                                       "staged_to_host_bytes", "staged_to_device_bytes"};
  return k.count(key) > 0;
}

void expect_same_records(const std::vector<json>& a, const std::vector<json>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (const auto& [key, value] : a[i].items())
      if (!measured(key)) {
        EXPECT_EQ(value, b[i].value(key, json())) << "step " << i + 1 << " field " << key;
      }
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class StrictRun : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Variants, StrictRun,
                         ::testing::Values("fp32", "recompute", "bf16", "mxfp8", "mxfp8_recompute", "mxfp8_attention",
                                           "olmo_core3_recompute", "olmo_core3_bf16", "olmo_core3_mxfp8"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// Olmo-core 3's options together (docs/MODEL.md): reordered norms, scaled and normed embedding,
// a dense layer between MoE layers, sigmoid scores with their epsilon, L2-normed weights times K,
// a scale and sqrt(original_top_k / K), two gated shared experts, the routers' logit biases,
// loss-free bias, a sliding window of 5 on the middle layer.
std::string olmo_core3_sets() {
  return " --set model.n_layers=3 --set model.dense_layers=1 --set model.dense_hidden=24"
         " --set model.norm_placement=reordered --set model.embed_scale=5.6568542494923806 --set model.embedding_norm=true"
         " --set model.qk_norm=per_head --set model.score_func=sigmoid --set model.sigmoid_eps=1e-7"
         " --set model.norm_topk_prob=true --set model.norm_topk_p=2 --set model.restore_weight_scale=true"
         " --set model.expert_weight_scale=0.8 --set model.original_top_k=4 --set model.shared_hidden=16"
         " --set model.router_bias_gamma=0.001 --set model.sliding_window=5 --set model.shared_experts=2"
         " --set model.shared_router=true --set model.shared_router_bias=true --set model.router_logit_bias=true";
}

std::string variant_sets(const std::string& v) {
  if (v == "olmo_core3_recompute") return olmo_core3_sets() + " --set train.recompute=true";
  if (v == "olmo_core3_bf16") return olmo_core3_sets() + " --set train.precision=bf16";
  if (v == "olmo_core3_mxfp8") return olmo_core3_sets() + " --set train.precision=mxfp8 --set model.expert_hidden=32";
  if (v == "recompute") return " --set train.recompute=true";
  if (v == "bf16") return " --set train.precision=bf16";
  // MXFP8 needs blocks of 32 along the expert width.
  if (v == "mxfp8") return " --set train.precision=mxfp8 --set model.expert_hidden=32";
  if (v == "mxfp8_attention")
    return " --set train.precision=mxfp8 --set model.expert_hidden=32 --set model.n_kv_heads=4 --set mxfp8.attention=true"
           " --set train.recompute=true";
  if (v == "mxfp8_recompute") return " --set train.precision=mxfp8 --set model.expert_hidden=32 --set train.recompute=true";
  return "";
}

TEST_P(StrictRun, MatchesCpuBitwiseThroughClipSkipEvalCheckpointAndResume) {
  const fs::path root = test::fresh_test_dir("strict_" + GetParam());
  test::write_tokens(root / "train.bin", 6000);
  test::write_tokens(root / "valid.bin", 2000, 5);
  const std::string v = variant_sets(GetParam());
  const test::CliResult cpu = train(root, "cpu", v, root / "cpu", "nangrad@0:4");
  ASSERT_EQ(cpu.status, 0) << cpu.output;
  // strict: the whole run, then again from its step-2 checkpoint (later ones removed).
  const test::CliResult first = train(root, "strict", v, root / "strict", "nangrad@0:4");
  ASSERT_EQ(first.status, 0) << first.output;
  for (const auto& d : fs::directory_iterator(root / "strict" / "checkpoints"))
    if (d.path().filename() != "step_00000002") fs::remove_all(d.path());
  const test::CliResult resumed = train(root, "strict", v, root / "strict", "nangrad@0:4", true);
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  ASSERT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;

  const std::vector<json> a = test::read_metrics(root / "cpu"), b = test::read_metrics(root / "strict");
  ASSERT_EQ(a.size(), 6u);
  expect_same_records(a, b);
  // The run covered what it claims: clipped steps, the skipped one, evaluations.
  int clipped = 0, skipped = 0, evals = 0;
  for (const json& r : a) {
    clipped += r.value("clipped", false);
    skipped += r.value("skipped", false);
    evals += r.contains("valid_ce");
  }
  EXPECT_GE(clipped, 4);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(evals, 3);
  // The final training state (parameters, moments, router biases), byte for byte.
  const std::string last = "step_00000005";
  const std::string state_cpu = file_bytes(root / "cpu" / "checkpoints" / last / "rank_00000.safetensors");
  ASSERT_FALSE(state_cpu.empty());
  EXPECT_TRUE(state_cpu == file_bytes(root / "strict" / "checkpoints" / last / "rank_00000.safetensors"));
  fs::remove_all(root);
}

// The bytes of the one download of a plain step: StepStats (model/transformer.cpp make_stats):
// f64 [ce, lm_z, lbl and router_z per MoE layer] + the 8 f64 step decisions (step_control) + f64
// per-parameter gradient sums of squares + mean router probabilities (compute dtype, f32) and
// counts (i32) per MoE layer and expert.
uint64_t step_statistics_bytes(const ModelConfig& m) {
  const int64_t M = m.num_moe_layers(), E = m.num_experts, P = ParamLayout(m).num_global_params();
  return static_cast<uint64_t>(8 * (2 + 2 * M + 8 + P) + 4 * M * E + 4 * M * E);
}

TEST(StrictBudget, APlainStepReadsTheDeviceExactlyOnceAndAnExtraReadCounts) {
  const fs::path root = test::fresh_test_dir("strict_budget");
  test::write_tokens(root / "train.bin", 6000);
  test::write_tokens(root / "valid.bin", 2000, 5);
  for (const std::string backend : {"cpu", "strict"}) {
    SCOPED_TRACE(backend);
    const test::CliResult r = train(root, backend, "", root / backend, "extraread@0:3");
    ASSERT_EQ(r.status, 0) << r.output;
    const uint64_t bytes = step_statistics_bytes(load_config((root / backend / "config.toml").string(), {}).model);
    const std::vector<json> steps = test::read_metrics(root / backend);
    ASSERT_EQ(steps.size(), 6u);
    for (const json& s : steps) {
      const int64_t step = s.at("step").get<int64_t>();
      const uint64_t extra = step == 3 ? 1 : 0;  // the injected read: one more, 8 bytes
      EXPECT_EQ(s.at("to_host").get<uint64_t>(), 1 + extra) << "step " << step;
      EXPECT_EQ(s.at("to_host_bytes").get<uint64_t>(), bytes + 8 * extra) << "step " << step;
      // The batch's ids and labels go up when the host cannot address the backend's memory.
      EXPECT_EQ(s.at("to_device").get<uint64_t>(), backend == "strict" ? 2u : 0u) << "step " << step;
    }
  }
  fs::remove_all(root);
}

// A missing wait must not pass by luck: without the wait before the statistics are read, the
// strict backend has not run the step when the host reads, so the record differs from cpu's;
// on the cpu backend (synchronous) the same bug goes unnoticed.
TEST(StrictBudget, ADroppedWaitIsCaughtOnlyByStrict) {
  const fs::path root = test::fresh_test_dir("strict_nowait");
  test::write_tokens(root / "train.bin", 6000);
  test::write_tokens(root / "valid.bin", 2000, 5);
  ASSERT_EQ(train(root, "cpu", "", root / "ref", nullptr).status, 0);
  ASSERT_EQ(train(root, "cpu", "", root / "cpu", "nowait@0:2").status, 0);
  const test::CliResult strict = train(root, "strict", "", root / "strict", "nowait@0:2");
  ASSERT_EQ(strict.status, 0) << strict.output;
  const std::vector<json> ref = test::read_metrics(root / "ref"), cpu = test::read_metrics(root / "cpu"),
                          bad = test::read_metrics(root / "strict");
  ASSERT_EQ(bad.size(), ref.size());
  expect_same_records(ref, cpu);
  EXPECT_NE(ref[1].at("ce"), bad[1].at("ce")) << "the strict backend must expose the missing wait";
  fs::remove_all(root);
}

}  // namespace
}  // namespace moe
