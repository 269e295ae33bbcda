// A checkpoint through the command line: eval, generate and export-hf read what train wrote, and
// train.init_from starts a run from an imported Hugging Face checkpoint, refusing settings the
// file contradicts (each error names the key and both values).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/cli_util.h"
#include "common/paths.h"

namespace moe {
namespace {
namespace fs = std::filesystem;
using test::run_cli;

TEST(CheckpointCli, EvalGenerateAndExportReadACheckpoint) {
  const fs::path root = test::fresh_test_dir("ckpt_cli");
  std::string text;
  // prepare holds out every 20th 16 KiB block: 6,000 lines give ~340 KB, one validation block.
  for (int i = 0; i < 6000; ++i) text += "In the beginning God created the heaven and the earth. ";
  std::ofstream(root / "t.txt") << text;
  const std::string sets = " --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=4"
                           " --set model.n_kv_heads=2 --set model.num_experts=4 --set model.expert_hidden=16"
                           " --set train.seq_len=32 --set train.batch_size=4 --set train.micro_batch_size=2"
                           " --set train.steps=4 --set optim.warmup_steps=1 --set train.eval_every=0"
                           " --set train.threads=1 --set data.train_path=" + (root / "d/train.bin").string() +
                           " --set data.valid_path=" + (root / "d/valid.bin").string() +
                           " --set train.out_dir=" + (root / "run").string();
  ASSERT_EQ(run_cli("prepare --input " + (root / "t.txt").string() + " --out " + (root / "d").string()).status, 0);
  auto [train_status, train_log] = run_cli("train" + sets);
  ASSERT_EQ(train_status, 0) << train_log;
  const std::string ckpt = (root / "run/checkpoints").string();
  auto [eval_status, eval_out] = run_cli("eval --checkpoint " + ckpt + " --batches 2");
  EXPECT_EQ(eval_status, 0) << eval_out;
  EXPECT_NE(eval_out.find("perplexity"), std::string::npos) << eval_out;
  const std::string gen = "generate --checkpoint " + ckpt + " --prompt 'In the' --max-tokens 12 --seed 7";
  auto [g1_status, g1] = run_cli(gen);
  auto [g2_status, g2] = run_cli(gen);
  EXPECT_EQ(g1_status, 0) << g1;
  EXPECT_EQ(g1, g2) << "the same seed must give the same text";
  EXPECT_EQ(g1.rfind("In the", 0), 0u) << g1;
  auto [x_status, x_out] = run_cli("export-hf --checkpoint " + ckpt + " --out " + (root / "hf").string());
  EXPECT_EQ(x_status, 0) << x_out;
  EXPECT_TRUE(fs::exists(root / "hf/model.safetensors"));
  auto [bad_status, bad_out] = run_cli("eval --checkpoint " + (root / "nothing").string());
  EXPECT_EQ(bad_status, 1);
  EXPECT_NE(bad_out.find("--checkpoint '" + (root / "nothing").string() + "' does not exist"), std::string::npos) << bad_out;
  fs::remove_all(root);
}

TEST(CheckpointCli, TrainingContinuesFromAnImportedHuggingFaceCheckpoint) {
  const fs::path root = test::fresh_test_dir("ckpt_init_from");
  const std::string params = (root / "imported.safetensors").string();
  auto [imp_status, imp_out] = run_cli("import-hf --from " + std::string(::moe::test::source_dir()) + "/tests/golden/hf/fused --out " + params);
  ASSERT_EQ(imp_status, 0) << imp_out;
  test::write_tokens(root / "train.bin", 4000);
  // The architecture of tests/golden/olmoe_pre (which the committed HF checkpoint was made from).
  const std::string model = " --set model.vocab_size=64 --set model.d_model=32 --set model.n_layers=2"
                            " --set model.n_heads=4 --set model.n_kv_heads=2 --set model.num_experts=8"
                            " --set model.top_k=2 --set model.norm_eps=1e-5 --set model.max_position_embeddings=150"
                            " --set train.seq_len=24"
                            " --set train.batch_size=2 --set train.micro_batch_size=2 --set train.steps=3"
                            " --set optim.warmup_steps=1 --set train.eval_every=0 --set data.valid_path="
                            " --set train.threads=1 --set data.train_path=" + (root / "train.bin").string() +
                            " --set train.out_dir=" + (root / "run").string() + " --set train.init_from=" + params;
  auto [ok_status, ok_out] = run_cli("train" + model + " --set model.expert_hidden=16");
  EXPECT_EQ(ok_status, 0) << ok_out;
  EXPECT_NE(ok_out.find("parameters initialized from"), std::string::npos) << ok_out;
  EXPECT_NE(ok_out.find("its stored model settings match"), std::string::npos) << ok_out;
  // A setting the tensor shapes cannot show: refused naming the key, both values and the fix.
  auto [theta_status, theta_out] = run_cli("train" + model + " --set model.expert_hidden=16 --set model.rope_theta=500000");
  EXPECT_EQ(theta_status, 1) << theta_out;
  EXPECT_NE(theta_out.find("model.rope_theta = 500000.0 (this run) differs from 10000.0 (the file)"), std::string::npos)
      << theta_out;
  EXPECT_NE(theta_out.find("--set model.rope_theta=10000.0"), std::string::npos) << theta_out;
  // A setting that changes nothing the weights compute: noted, the run's value applies.
  auto [meta_status, meta_out] =
      run_cli("train" + model + " --set model.expert_hidden=16 --set model.max_position_embeddings=0 --set data.eos_id=7");
  EXPECT_EQ(meta_status, 0) << meta_out;
  EXPECT_NE(meta_out.find("note: model.max_position_embeddings = 0 (this run; the file has 150)"), std::string::npos)
      << meta_out;
  EXPECT_NE(meta_out.find("note: data.eos_id = 7"), std::string::npos) << meta_out;
  auto [bad_status, bad_out] = run_cli("train" + model + " --set model.expert_hidden=24");
  EXPECT_EQ(bad_status, 1) << bad_out;
  EXPECT_NE(bad_out.find("model.expert_hidden = 24 (this run) differs from 16 (the file)"), std::string::npos) << bad_out;
  fs::remove_all(root);
}

}  // namespace
}  // namespace moe
