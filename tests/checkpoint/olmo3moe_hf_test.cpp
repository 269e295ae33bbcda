// Olmo-core 3's Hugging Face format (olmo3moe) both ways, against a model Olmo-core 3 itself saved
// (tools/reference/make_olmo3moe_fixture.py: its OLMoDDPModel, its converter, Olmo3MoeForCausalLM's
// save_pretrained, a tokenizer beside it): the import computes Olmo3MoeForCausalLM's logits and
// trains with Olmo-core's own losses; import then export keeps every tensor byte-identical, every
// config.json field and the tokenizer files; what olmo3moe cannot compute is refused by name; a
// field missing from config.json takes Olmo3MoeConfig's default; large exports are sharded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <set>
#include <tuple>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "common/paths.h"
#include "common/test_util.h"
#include "core/check.h"
#include "kernels/ops.h"
#include "model/params.h"
#include "train/trainer.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using test::read_file;
using test::write_file;

const std::string kHf = std::string(::moe::test::source_dir()) + "/tests/golden/hf/";
const std::string kFolder = kHf + "olmo3moe";

std::string tmp(const std::string& name) { return test::scratch_path("moe_olmo3moe_test", name); }

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_file(path)); }

// The recorded Olmo-core / Olmo3MoeForCausalLM results, and the training settings they ran with.
struct Expected {
  SafetensorsFile file{kHf + "olmo3moe_expected.safetensors"};
  Config settings = config_from_json(file.meta("config"));
  OwnedTensor read(const std::string& name, DType t) const { return file.read(name, t); }
};

// A model of the imported config with the recorded training settings, holding the imported weights.
Config imported_config(const HfModel& m, const Expected& e) {
  Config c = e.settings;
  c.model = m.config.model;
  c.data.eos_id = m.config.data.eos_id;
  c.data.bos_id = m.config.data.bos_id;
  c.validate();
  return c;
}

TEST(Olmo3moe, ImportsOlmoCoresOwnSaveWithItsSettings) {
  const HfModel m = import_hf(kFolder);
  const ModelConfig& c = m.config.model;
  EXPECT_EQ(m.carried.format, "olmo3moe");
  EXPECT_EQ(c.norm_placement, "reordered");  // use_peri_ln = false
  EXPECT_EQ(c.qk_norm, "per_head");
  EXPECT_EQ(c.score_func, "sigmoid");
  EXPECT_DOUBLE_EQ(c.sigmoid_eps, 1e-7);  // olmo3moe's router adds it
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.norm_topk_p, 2.0);
  EXPECT_TRUE(c.restore_weight_scale);
  EXPECT_EQ(c.original_top_k, 4);
  EXPECT_EQ(c.dense_layers, "1");
  EXPECT_EQ(c.shared_hidden, 8);
  EXPECT_TRUE(c.embedding_norm);
  EXPECT_NEAR(c.embed_scale, std::sqrt(32.0), 1e-15);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);  // rope_parameters wins over the stale top-level rope_theta
  EXPECT_EQ(c.attention_window(0), 12);
  EXPECT_EQ(c.attention_window(1), 0);
  EXPECT_EQ(c.attention_window(2), 12);
  EXPECT_EQ(m.config.data.eos_id, 63);
  EXPECT_EQ(c.pad_id, -1);
  EXPECT_EQ(m.carried.files.count("tokenizer.json"), 1u);
}

// Olmo3MoeForCausalLM's logits (float64 arithmetic on the saved float32 weights): the f64 ref path
// at float64 rounding (1e-9, the f64 bound), the fp32 cpu path at fp32 rounding (1e-5).
TEST(Olmo3moe, ImportComputesOlmo3MoeForCausalLMsLogits) {
  const Expected e;
  const HfModel m = import_hf(kFolder);
  const Config config = imported_config(m, e);
  const OwnedTensor ids = e.read("ids", DType::kI32), want = e.read("logits", DType::kF64);
  const int64_t B = config.train.micro_batch_size, S = config.train.seq_len, V = config.model.vocab_size;
  for (const auto& [backend, dtype, bound] : {std::tuple{"ref", DType::kF64, 1e-9}, std::tuple{"cpu", DType::kF32, 1e-5}}) {
    SCOPED_TRACE(backend);
    std::unique_ptr<Backend> ops = make_backend(backend);
    Trainer trainer(config, *ops, dtype);
    load_into(m.params, trainer.model());
    OwnedTensor logits(dtype, {B * S, V});
    trainer.model().forward_logits(ids.t.slice(0, B), logits);
    const double err = test::rel_error(logits, want);
    std::printf("  moecore %s logits vs Olmo3MoeForCausalLM: max|d|/max|x| = %.2e\n", backend, err);
    EXPECT_LE(err, bound);
  }
}

// Olmo-core 3's own three AdamW steps from these weights (its model in float64, the auxiliary
// losses over the labelled tokens): moecore fp32 within the 1e-5 relative on every step.
TEST(Olmo3moe, ImportTrainsWithOlmoCoresLosses) {
  const Expected e;
  const HfModel m = import_hf(kFolder);
  const Config config = imported_config(m, e);
  ASSERT_EQ(config.loss.aux_divisor, "labelled");
  const OwnedTensor ids = e.read("ids", DType::kI32), labels = e.read("labels", DType::kI32);
  const OwnedTensor total = e.read("train.total", DType::kF64), ce = e.read("train.ce", DType::kF64);
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Trainer trainer(config, *ops, DType::kF32);
  load_into(m.params, trainer.model());
  for (int64_t s = 0; s < config.train.steps; ++s) {
    const StepResult& r = trainer.step(ids, labels);
    const double want_total = total.as<double>()[s], want_ce = ce.as<double>()[s];
    std::printf("  step %lld: total %.9f (Olmo-core %.9f), ce %.9f (Olmo-core %.9f)\n", static_cast<long long>(s + 1),
                r.total, want_total, r.ce, want_ce);
    EXPECT_LE(std::abs(r.ce - want_ce) / want_ce, 1e-5) << "step " << s + 1;
    EXPECT_LE(std::abs(r.total - want_total) / want_total, 1e-5) << "step " << s + 1;
  }
}

TEST(Olmo3moe, ImportThenExportKeepsTensorsConfigAndTokenizer) {
  const HfModel m = import_hf(kFolder);
  const std::string params = tmp("imported.safetensors");
  save_our_params(params, m.config, m.params.data(), &m.carried);
  const SafetensorsFile stored(params);
  const HfCarried carried = load_hf_carried(stored);
  ASSERT_EQ(carried.format, "olmo3moe");
  HfExportOptions o;
  o.format = HfFormat::kOlmo3moe;
  o.carried = &carried;
  const std::string out = tmp("back");
  export_hf(m.config, load_our_params(stored, m.config.model).data(), out, o);
  // Every tensor byte-identical in the same dtype (f32).
  const SafetensorsFile a(kFolder + "/model.safetensors"), b(out + "/model.safetensors");
  ASSERT_EQ(a.entries().size(), b.entries().size());
  for (const auto& [key, entry] : a.entries()) {
    ASSERT_TRUE(b.contains(key)) << key;
    EXPECT_EQ(b.entry(key).dtype, entry.dtype) << key;
    EXPECT_EQ(b.entry(key).shape, entry.shape) << key;
    const OwnedTensor x = a.read(key, DType::kF32), y = b.read(key, DType::kF32);
    EXPECT_TRUE(test::bitwise_equal(x, y)) << key;
  }
  // Every config.json field as it was.
  const nlohmann::json before = read_json(kFolder + "/config.json"), after = read_json(out + "/config.json");
  for (auto& [key, v] : before.items()) EXPECT_EQ(after.value(key, nlohmann::json("(missing)")), v) << key;
  for (auto& [key, v] : after.items()) EXPECT_TRUE(before.contains(key)) << "added " << key;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_EQ(read_file(out + "/" + f), read_file(kFolder + "/" + f)) << f;
  // bf16: the dtype fields follow, the rest stays.
  o.dtype = "bf16";
  export_hf(m.config, m.params.data(), tmp("back_bf16"), o);
  const nlohmann::json bf = read_json(tmp("back_bf16") + "/config.json");
  EXPECT_EQ(bf["dtype"], "bfloat16");
  EXPECT_EQ(bf["layer_types"], before["layer_types"]);
  // A model whose settings changed gets a config of its own, the unmodelled fields carried.
  Config changed = m.config;
  changed.model.rope_theta = 20000.0;
  o.dtype = "f32";
  export_hf(changed, m.params.data(), tmp("changed"), o);
  const nlohmann::json ch = read_json(tmp("changed") + "/config.json");
  EXPECT_EQ(ch["rope_parameters"]["rope_theta"], 20000.0);
  EXPECT_EQ(ch["linear_conv_kernel_dim"], before["linear_conv_kernel_dim"]);
  EXPECT_EQ(import_hf(tmp("changed")).config.model.rope_theta, 20000.0);
}

TEST(Olmo3moe, ExportRefusesByNameWhatOlmo3moeCannotCompute) {
  const HfModel m = import_hf(kFolder);
  HfExportOptions o;
  o.format = HfFormat::kOlmo3moe;
  auto refused = [&](const std::function<void(ModelConfig&)>& edit, const std::string& reason) {
    Config c = m.config;
    edit(c.model);
    const std::vector<float> params(static_cast<size_t>(ParamLayout(c.model).total()), 0.0f);
    const std::string msg = test::error_of([&] { export_hf(c, params.data(), tmp("refused"), o); });
    EXPECT_NE(msg.find("cannot export to Olmo3MoeForCausalLM"), std::string::npos) << msg;
    EXPECT_NE(msg.find(reason), std::string::npos) << msg;
  };
  refused([](ModelConfig& c) { c.norm_placement = "pre"; }, "model.norm_placement = \"pre\"");
  refused([](ModelConfig& c) { c.qk_norm = "none"; }, "model.qk_norm = \"none\"");
  refused([](ModelConfig& c) { c.sigmoid_eps = 0; }, "model.sigmoid_eps");
  refused([](ModelConfig& c) { c.expert_weight_scale = 2; }, "model.expert_weight_scale");
  refused([](ModelConfig& c) { c.router_bias_gamma = 1e-3; }, "router bias");
  refused([](ModelConfig& c) { c.sliding_window.append(",24"); }, "several window sizes");
  refused([](ModelConfig& c) { c.rope = "windowed"; }, "model.rope = \"windowed\"");
  refused([](ModelConfig& c) { c.clip_qkv = 8; }, "model.clip_qkv");
  refused([](ModelConfig& c) { c.rope_partial = 0.5; }, "model.rope_partial");
  refused(
      [](ModelConfig& c) {
        c.n_group = 4;
        c.topk_group = 2;
      },
      "model.n_group");
  refused(
      [](ModelConfig& c) {
        c.shared_hidden = 8;
        c.shared_experts = 2;
        c.shared_router = true;
      },
      "gated shared experts (model.shared_experts = 2");
  refused([](ModelConfig& c) { c.router_logit_bias = true; }, "model.router_logit_bias");
}

// from_pretrained fills what config.json leaves out with Olmo3MoeConfig's defaults; so does the
// import (restore_weight_scale true, p = 1, dense layer 0, sliding windows of 4096 on even layers,
// eos 50279 and pad 1 when the vocabulary has them).
TEST(Olmo3moe, MissingFieldsTakeOlmo3MoeConfigsDefaults) {
  nlohmann::json j = read_json(kFolder + "/config.json");
  for (const char* k : {"restore_weight_scale", "normalize_expert_weights", "dense_layers_indices", "layer_types",
                        "sliding_window", "eos_token_id", "pad_token_id", "use_peri_ln", "embed_scale"})
    j.erase(k);
  j["vocab_size"] = 50304;
  j["num_hidden_layers"] = 4;
  const Config c = config_from_hf_json(j.dump());
  EXPECT_TRUE(c.model.restore_weight_scale);
  EXPECT_TRUE(c.model.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.model.norm_topk_p, 1.0);
  EXPECT_EQ(c.model.dense_layers, "0");
  EXPECT_EQ(c.model.attention_window(0), 4096);
  EXPECT_EQ(c.model.attention_window(1), 0);
  EXPECT_EQ(c.model.attention_window(2), 4096);
  EXPECT_EQ(c.model.attention_window(3), 0);
  EXPECT_EQ(c.data.eos_id, 50279);
  EXPECT_EQ(c.model.pad_id, 1);
  EXPECT_EQ(c.model.norm_placement, "reordered");
  EXPECT_DOUBLE_EQ(c.model.embed_scale, 1.0);
  // Refused by name: values that change the function and that moecore cannot compute.
  for (const auto& [key, value] : {std::pair<const char*, nlohmann::json>{"qk_norm_per_head_gains", true},
                                   {"latent_moe_dim", 16}, {"attention_gate_type", "elementwise"},
                                   {"gating_function", "relu"}}) {
    nlohmann::json bad = read_json(kFolder + "/config.json");
    bad[key] = value;
    const std::string msg = test::error_of([&] { config_from_hf_json(bad.dump()); });
    EXPECT_NE(msg.find(key), std::string::npos) << msg;
  }
  nlohmann::json nope = read_json(kFolder + "/config.json");
  nope["use_rope"] = false;  // Olmo-core's rope = None
  EXPECT_EQ(config_from_hf_json(nope.dump()).model.rope, "none");
  nlohmann::json kda = read_json(kFolder + "/config.json");
  kda["layer_types"][1] = "linear_attention";
  EXPECT_NE(test::error_of([&] { config_from_hf_json(kda.dump()); }).find("layer_types[1]"), std::string::npos);
}

// Attention biases (olmo3moe attention_bias): q/k/v/o_proj.bias out and back in, the
// same bytes; a model with them is the imported one plus four tensors per layer.
TEST(HfExport, AttentionBiasesRoundTripThroughOlmo3moe) {
  const HfModel m = import_hf(kFolder);
  Config c = m.config;
  c.model.attention_bias = true;
  const ParamLayout biased(c.model), plain(m.config.model);
  std::vector<float> params(static_cast<size_t>(biased.total()), 0.0f);
  for (const ParamInfo& p : biased.entries()) {
    float* dst = params.data() + p.offset;
    if (p.is_bias)
      for (int64_t i = 0; i < p.numel; ++i) dst[i] = 0.01f * static_cast<float>(i + 1) * (p.name.back() == 'q' ? -1.f : 1.f);
    else
      std::memcpy(dst, m.params.data() + plain.find(p.name).offset, static_cast<size_t>(p.numel) * sizeof(float));
  }
  HfExportOptions o;
  o.format = HfFormat::kOlmo3moe;
  const std::string out = tmp("biased");
  export_hf(c, params.data(), out, o);
  EXPECT_EQ(read_json(out + "/config.json")["attention_bias"], true);
  EXPECT_TRUE(SafetensorsFile(out + "/model.safetensors").entries().count("model.layers.1.self_attn.o_proj.bias"));
  const HfModel back = import_hf(out);
  EXPECT_TRUE(back.config.model.attention_bias);
  ASSERT_EQ(back.params.size(), params.size());
  EXPECT_EQ(std::memcmp(back.params.data(), params.data(), params.size() * sizeof(float)), 0);
}

// A budget below the model's size gives shards and an index, which the import reads back exactly.
TEST(HfExport, ShardsWithAnIndexThatTheImportReads) {
  const HfModel m = import_hf(kFolder);
  HfExportOptions o;
  o.format = HfFormat::kOlmo3moe;
  o.max_shard_bytes = 40000;  // the model is ~118 KB of f32: several shards
  const std::string out = tmp("sharded");
  export_hf(m.config, m.params.data(), out, o);
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  const nlohmann::json index = read_json(out + "/model.safetensors.index.json");
  std::set<std::string> files;
  for (auto& [key, f] : index["weight_map"].items()) files.insert(f.get<std::string>());
  EXPECT_GE(files.size(), 3u);
  int64_t total = 0;
  for (const std::string& f : files) {
    EXPECT_LE(fs::file_size(out + "/" + f), 40000u + 16384u) << f;  // the budget, plus one header
    const SafetensorsFile shard(out + "/" + f);
    for (const auto& [key, e] : shard.entries()) total += static_cast<int64_t>(e.end - e.begin);
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
  const HfModel back = import_hf(out);
  ASSERT_EQ(back.params.size(), m.params.size());
  EXPECT_EQ(std::memcmp(back.params.data(), m.params.data(), m.params.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace moe
