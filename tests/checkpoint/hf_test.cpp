// Hugging Face interop: export to OlmoeForCausalLM files, byte-exact against the SHA-256 recorded
// by tools/reference/check_hf_export.py (which also checks the export's logits in transformers);
// import of transformers' own save_pretrained output (sharded, bf16) and of the fused expert
// layout; import -> export round trips; every refusal with its reason; SHA-256 known answers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "common/paths.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sha256.h"
#include "core/check.h"
#include "common/test_util.h"
#include "kernels/ops.h"
#include "model/params.h"
#include "model/transformer.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using test::read_file;
using test::write_file;

const std::string kGolden = std::string(::moe::test::source_dir()) + "/tests/golden/";
const std::string kFixture = kGolden + "olmoe_pre.safetensors";

std::string tmp(const std::string& name) { return test::scratch_path("moe_hf_test", name); }

using test::error_of;

#define EXPECT_ERROR(stmt, text)                                              \
  do {                                                                        \
    const std::string msg_ = error_of([&] { stmt; });                         \
    EXPECT_NE(msg_.find(text), std::string::npos) << "expected '" << (text) \
                                                  << "' in: " << msg_;      \
  } while (0)

Config fixture_full() { return config_from_json(SafetensorsFile(kFixture).meta("config")); }
ModelConfig fixture_config() { return fixture_full().model; }
// Exports a model with the fixture's other settings (token ids, sequence length).
void export_model(const ModelConfig& c, const float* params, const std::string& dir, const std::string& dtype) {
  Config full = fixture_full();
  full.model = c;
  export_hf(full, params, dir, dtype);
}

nlohmann::json recorded() { return nlohmann::json::parse(read_file(kGolden + "hf_export.json")); }

TEST(Sha256, KnownAnswers) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55, 56 and 64 bytes: the padding boundaries
  EXPECT_EQ(sha256_hex(std::string(55, 'a')), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_hex(std::string(56, 'a')), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha256_hex(std::string(64, 'a')), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST(HfExport, ReexportsTheRecordedBytes) {
  const auto rec = recorded();
  for (const std::string fixture : {"olmoe_pre", "olmoe_topk"}) {  // olmoe_topk: tied, norm_topk_prob
    const std::string path = kGolden + fixture + ".safetensors";
    const Config full = config_from_json(SafetensorsFile(path).meta("config"));
    const ModelConfig& c = full.model;
    const std::vector<float> params = load_our_params(path, c);
    for (const std::string dtype : {"f32", "bf16"}) {
      SCOPED_TRACE(fixture + " " + dtype);
      const auto& r = rec[fixture][dtype];
      const std::string dir = tmp("export_" + fixture + "_" + dtype);
      export_hf(full, params.data(), dir, dtype);
      EXPECT_EQ(sha256_file(dir + "/config.json"), r["config.json"].get<std::string>());
      EXPECT_EQ(sha256_file(dir + "/generation_config.json"), r["generation_config.json"].get<std::string>());
      EXPECT_EQ(sha256_file(dir + "/model.safetensors"), r["model.safetensors"].get<std::string>());
      // exporting twice gives the same bytes
      export_hf(full, params.data(), dir + "_again", dtype);
      EXPECT_EQ(read_file(dir + "/model.safetensors"), read_file(dir + "_again/model.safetensors"));
      // this export's logits in transformers were checked against the fixture's when recorded
      EXPECT_LT(r["max_rel_logit_diff"].get<double>(), dtype == "f32" ? 1e-5 : 5e-2);
      // export -> import -> export: identical bytes
      const HfModel m = import_hf(dir);
      export_hf(m.config, m.params.data(), dir + "_rt", dtype);
      EXPECT_EQ(read_file(dir + "/model.safetensors"), read_file(dir + "_rt/model.safetensors"));
      EXPECT_EQ(read_file(dir + "/config.json"), read_file(dir + "_rt/config.json"));
      EXPECT_EQ(read_file(dir + "/generation_config.json"), read_file(dir + "_rt/generation_config.json"));
    }
  }
  EXPECT_FALSE(SafetensorsFile(tmp("export_olmoe_topk_f32") + "/model.safetensors").contains("lm_head.weight"));
  // per-expert keys as published OLMoE checkpoints
  SafetensorsFile st(tmp("export_olmoe_pre_f32") + "/model.safetensors");
  EXPECT_TRUE(st.contains("model.layers.1.mlp.experts.7.gate_proj.weight"));
  EXPECT_EQ(st.entry("model.layers.1.mlp.experts.7.down_proj.weight").shape, (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(st.entry("model.layers.0.mlp.gate.weight").shape, (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(st.entry("model.layers.0.self_attn.k_norm.weight").shape, (std::vector<int64_t>{16}));
  EXPECT_EQ(st.entries().size(), 3u + 2u * (9u + 3u * 8u));
}

void expect_fixture_config(const ModelConfig& got) {
  const ModelConfig want = fixture_config();
  EXPECT_EQ(got.vocab_size, want.vocab_size);
  EXPECT_EQ(got.d_model, want.d_model);
  EXPECT_EQ(got.n_layers, want.n_layers);
  EXPECT_EQ(got.n_heads, want.n_heads);
  EXPECT_EQ(got.n_kv_heads, want.n_kv_heads);
  EXPECT_EQ(got.hd(), want.hd());
  EXPECT_EQ(got.num_experts, want.num_experts);
  EXPECT_EQ(got.top_k, want.top_k);
  EXPECT_EQ(got.expert_hidden, want.expert_hidden);
  EXPECT_EQ(got.norm_topk_prob, want.norm_topk_prob);
  EXPECT_EQ(got.tie_embeddings, want.tie_embeddings);
  EXPECT_EQ(got.norm_eps, want.norm_eps);
  EXPECT_EQ(got.rope_theta, want.rope_theta);
  EXPECT_EQ(olmoe_unsupported_reason(got), "");
}

TEST(HfImport, FusedLayoutGivesTheFixtureParametersExactly) {
  const HfModel m = import_hf(kGolden + "hf/fused");
  expect_fixture_config(m.config.model);
  const std::vector<float> want = load_our_params(kFixture, fixture_config());
  ASSERT_EQ(m.params.size(), want.size());
  EXPECT_EQ(std::memcmp(m.params.data(), want.data(), want.size() * sizeof(float)), 0);
}

TEST(HfImport, ShardedBf16SavePretrainedWithinBf16Rounding) {
  const std::string dir = kGolden + "hf/save_pretrained";
  ASSERT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  const HfModel m = import_hf(dir);
  expect_fixture_config(m.config.model);
  const ModelConfig c = fixture_config();
  const ParamLayout layout(c);
  SafetensorsFile fx(kFixture);
  for (const ParamInfo& p : layout.entries()) {
    OwnedTensor ref = fx.read("param." + p.name, DType::kF64);
    for (int64_t i = 0; i < p.numel; ++i) {
      const double want = ref.as<double>()[i], got = m.params[static_cast<size_t>(p.offset + i)];
      ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -8) + 1e-30) << p.name << "[" << i << "]";
      ASSERT_EQ(got, static_cast<float>(bf16(static_cast<float>(got)))) << "not a bf16 value: " << p.name;
    }
  }
}

TEST(HfImport, ImportExportRoundTripsExactly) {
  const auto rec = recorded();
  // fused f32 (transformers' in-memory layout) -> per-expert export: the recorded f32 bytes
  HfModel fused = import_hf(kGolden + "hf/fused");
  const std::string a = tmp("rt_fused");
  export_hf(fused.config, fused.params.data(), a, "f32");
  EXPECT_EQ(sha256_file(a + "/model.safetensors"), rec["olmoe_pre"]["f32"]["model.safetensors"].get<std::string>());
  EXPECT_EQ(sha256_file(a + "/config.json"), rec["olmoe_pre"]["f32"]["config.json"].get<std::string>());
  // save_pretrained bf16 -> our params file -> export bf16 -> import: same parameters
  HfModel sp = import_hf(kGolden + "hf/save_pretrained");
  const std::string ours = tmp("ours.safetensors");
  save_our_params(ours, sp.config, sp.params.data());
  const Config c2 = config_from_json(SafetensorsFile(ours).meta("config"));
  const std::vector<float> p2 = load_our_params(ours, c2.model);
  EXPECT_EQ(p2, sp.params);
  export_hf(c2, p2.data(), tmp("rt_sp"), "bf16");
  EXPECT_EQ(import_hf(tmp("rt_sp")).params, sp.params);
}

// OLMoE's attention_bias (OlmoeAttention's q/k/v/o_proj.bias, the same function as moecore's
// model.attention_bias): out and back in, the same bytes.
TEST(HfImport, AttentionBiasesRoundTripThroughOlmoe) {
  const HfModel m = import_hf(kGolden + "hf/fused");
  Config c = m.config;
  c.model.attention_bias = true;
  const ParamLayout biased(c.model), plain(m.config.model);
  std::vector<float> params(static_cast<size_t>(biased.total()), 0.0f);
  for (const ParamInfo& p : biased.entries()) {
    float* dst = params.data() + p.offset;
    if (p.is_bias)
      for (int64_t i = 0; i < p.numel; ++i) dst[i] = 0.02f * static_cast<float>(i % 7) - 0.05f;
    else
      std::memcpy(dst, m.params.data() + plain.find(p.name).offset, static_cast<size_t>(p.numel) * sizeof(float));
  }
  const std::string out = tmp("olmoe_biased");
  export_hf(c, params.data(), out, "f32");
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(out + "/config.json"))["attention_bias"], true);
  const HfModel back = import_hf(out);
  EXPECT_TRUE(back.config.model.attention_bias);
  EXPECT_EQ(back.params, params);
}

// moecore's own forward on the imported checkpoints reproduces the fixture's logits (the logits
// transformers computes; check_hf_export.py compares transformers on our export with the same).
TEST(HfImport, ImportedModelsComputeTheFixtureLogits) {
  SafetensorsFile fx(kFixture);
  const Config full = config_from_json(fx.meta("config"));
  OwnedTensor ids = fx.read("ids", DType::kI32), ref = fx.read("step0.logits", DType::kF64);
  const int64_t B = ids.t.shape[0], S = ids.t.shape[1], V = full.model.vocab_size;
  std::unique_ptr<Backend> ops = make_backend("cpu");
  for (const auto& [dir, tol] : {std::pair<std::string, double>{"fused", 1e-5}, {"save_pretrained", 2e-2}}) {
    SCOPED_TRACE(dir);
    const HfModel m = import_hf(kGolden + "hf/" + dir);
    ModelOptions opt;
    opt.batch = B;
    opt.seq_len = S;
    Transformer model(m.config.model, full.loss, opt, *ops);
    load_into(m.params, model);
    OwnedTensor logits(DType::kF32, {B * S, V});
    test::poison(logits);
    model.forward_logits(ids.t, logits);
    const double err = test::rel_error(logits, ref.t);
    EXPECT_LT(err, tol);
    std::printf("  moecore logits on imported %s vs fixture (transformers) logits: relative error %.2e\n",
                dir.c_str(), err);
    // and the live model exports the recorded bytes (fused: f32 values are the fixture's)
    if (dir == "fused") {
      export_hf(model, m.config, tmp("from_model"), HfExportOptions{});
      EXPECT_EQ(sha256_file(tmp("from_model") + "/model.safetensors"),
                recorded()["olmoe_pre"]["f32"]["model.safetensors"].get<std::string>());
    }
  }
}

TEST(HfExport, RefusesWhatOlmoeCannotExpress) {
  auto refused = [](const std::function<void(ModelConfig&)>& edit, const std::string& reason) {
    ModelConfig c = fixture_config();
    edit(c);
    const std::vector<float> params(static_cast<size_t>(ParamLayout(c).total()), 0.0f);
    EXPECT_ERROR(export_model(c, params.data(), tmp("refused"), "f32"), "cannot export to OlmoeForCausalLM");
    EXPECT_ERROR(export_model(c, params.data(), tmp("refused"), "f32"), reason);
  };
  refused([](ModelConfig& c) { c.norm_placement = "peri"; }, "peri norms");
  refused([](ModelConfig& c) { c.norm_placement = "reordered"; }, "reordered norms");
  refused([](ModelConfig& c) { c.qk_norm = "none"; }, "QK-norm off");
  refused([](ModelConfig& c) { c.qk_norm = "per_head"; }, "per-head QK-norm");
  refused([](ModelConfig& c) { c.n_dense_layers = 1; }, "dense layers");
  refused([](ModelConfig& c) { c.dense_layers.push_back('1'); }, "model.dense_layers = \"1\"");
  refused([](ModelConfig& c) { c.shared_hidden = 16; }, "shared experts");
  refused([](ModelConfig& c) { c.clip_qkv = 8; }, "model.clip_qkv");
  refused([](ModelConfig& c) { c.rope_partial = 0.5; }, "model.rope_partial");
  refused([](ModelConfig& c) { c.score_func = "sigmoid"; }, "model.score_func = \"sigmoid\"");
  refused([](ModelConfig& c) { c.score_func = "topk_softmax"; }, "model.score_func = \"topk_softmax\"");
  refused([](ModelConfig& c) { c.router_bias_gamma = 1e-3; }, "router bias");
  refused([](ModelConfig& c) { c.score_correction_bias = true; }, "router bias");
  refused([](ModelConfig& c) {
    c.n_group = 2;
    c.topk_group = 1;
  }, "group-limited routing");
  refused([](ModelConfig& c) {
    c.norm_topk_prob = true;
    c.norm_topk_p = 2;
  }, "model.norm_topk_p");
  refused([](ModelConfig& c) { c.restore_weight_scale = true; }, "scaled expert weights");
  refused([](ModelConfig& c) { c.expert_weight_scale = 2; }, "scaled expert weights");
  refused([](ModelConfig& c) { c.original_top_k = 4; }, "scaled expert weights");
  refused([](ModelConfig& c) { c.embed_scale = 8; }, "model.embed_scale");
  refused([](ModelConfig& c) { c.embedding_norm = true; }, "model.embedding_norm");
  refused([](ModelConfig& c) { c.router_logit_bias = true; }, "model.router_logit_bias");
  refused([](ModelConfig& c) { c.routing = "uniform"; }, "non-learned routing");
  refused([](ModelConfig& c) { c.routing = "random"; }, "non-learned routing");
  refused([](ModelConfig& c) { c.head_dim = 16; }, "head_dim != d_model / n_heads");
  const ModelConfig c = fixture_config();
  const std::vector<float> params(static_cast<size_t>(ParamLayout(c).total()), 0.0f);
  EXPECT_ERROR(export_model(c, params.data(), tmp("refused"), "f16"), "allowed: f32, bf16");
  EXPECT_FALSE(fs::exists(tmp("refused") + "/model.safetensors"));
}

// A copy of the f32 export in DIR with config.json edited or tensors replaced.
std::string variant(const std::string& name, const std::function<void(nlohmann::json&)>& edit_config,
                    const std::function<void(std::vector<SafetensorsTensorOut>&)>& edit_tensors = nullptr) {
  const ModelConfig c = fixture_config();
  const std::vector<float> params = load_our_params(kFixture, c);
  const std::string dir = tmp("variant_" + name);
  export_model(c, params.data(), dir, "f32");
  nlohmann::json j = nlohmann::json::parse(read_file(dir + "/config.json"));
  edit_config(j);
  write_file(dir + "/config.json", j.dump(2));
  if (edit_tensors) {
    SafetensorsFile st(dir + "/model.safetensors");
    std::vector<SafetensorsTensorOut> ts;
    for (const auto& [k, e] : st.entries()) {
      OwnedTensor v = st.read(k, DType::kF32);
      SafetensorsTensorOut t{k, "F32", e.shape, {}};
      t.bytes.resize(static_cast<size_t>(v.t.numel()) * 4);
      std::memcpy(t.bytes.data(), v.as<float>(), t.bytes.size());
      ts.push_back(std::move(t));
    }
    edit_tensors(ts);
    write_safetensors(dir + "/model.safetensors", ts);
  }
  return dir;
}

TEST(HfImport, RefusesUnsupportedConfigsAndTensors) {
  auto none = [](nlohmann::json&) {};
  EXPECT_ERROR(import_hf(variant("mt", [](nlohmann::json& j) { j["model_type"] = "mixtral"; })), "model_type");
  EXPECT_ERROR(import_hf(variant("act", [](nlohmann::json& j) { j["hidden_act"] = "gelu"; })), "hidden_act");
  EXPECT_ERROR(import_hf(variant("clip", [](nlohmann::json& j) { j["clip_qkv"] = 8.0; })), "clip_qkv");
  // attention_bias = true is a model moecore computes: here refused only for the missing tensors.
  EXPECT_ERROR(import_hf(variant("bias", [](nlohmann::json& j) { j["attention_bias"] = true; })),
               "lacks tensors for parameter 'layers.0.bq'");
  EXPECT_ERROR(import_hf(variant("rope", [](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = "yarn"; })),
               "rope_type");
  EXPECT_ERROR(import_hf(variant("hd", [](nlohmann::json& j) { j["head_dim"] = 16; })), "head_dim 16");
  EXPECT_ERROR(import_hf(variant("unk", [](nlohmann::json& j) { j["sliding_window"] = 128; })),
               "unsupported field 'sliding_window'");
  EXPECT_ERROR(import_hf(variant("arch", [](nlohmann::json& j) { j["architectures"] = {"MixtralForCausalLM"}; })),
               "architectures");
  EXPECT_ERROR(import_hf(variant("noexp", [](nlohmann::json& j) { j.erase("num_experts"); })), "lacks 'num_experts'");
  // shape mismatch against the expected parameter shape
  EXPECT_ERROR(import_hf(variant("shape", none, [](std::vector<SafetensorsTensorOut>& ts) {
                 for (auto& t : ts)
                   if (t.name == "model.layers.0.mlp.gate.weight") t.shape = {4, 64};
               })),
               "'model.layers.0.mlp.gate.weight' has shape (4, 64), expected (8, 32)");
  // config and tensors disagree: intermediate_size says 8, tensors are 16 wide
  EXPECT_ERROR(import_hf(variant("isz", [](nlohmann::json& j) { j["intermediate_size"] = 8; })),
               "has shape (32, 16), expected (32, 8)");
  // wrong dtype
  EXPECT_ERROR(import_hf(variant("dtype", none, [](std::vector<SafetensorsTensorOut>& ts) {
                 for (auto& t : ts)
                   if (t.name == "model.norm.weight") t.dtype = "I32";
               })),
               "dtype I32");
  // a missing tensor, an unexpected one, a layer given both per-expert and fused
  EXPECT_ERROR(import_hf(variant("missing", none, [](std::vector<SafetensorsTensorOut>& ts) {
                 std::erase_if(ts, [](const auto& t) { return t.name == "model.layers.1.mlp.experts.3.up_proj.weight"; });
               })),
               "lacks tensors for parameter 'layers.1.experts.up'");
  EXPECT_ERROR(import_hf(variant("extra", none, [](std::vector<SafetensorsTensorOut>& ts) {
                 ts.push_back({"model.layers.0.mlp.shared_expert.weight", "F32", {1}, {0, 0, 0, 0}});
               })),
               "unexpected tensor 'model.layers.0.mlp.shared_expert.weight'");
  EXPECT_ERROR(import_hf(variant("both", none, [](std::vector<SafetensorsTensorOut>& ts) {
                 SafetensorsTensorOut t{"model.layers.0.mlp.experts.down_proj", "F32", {8, 32, 16}, {}};
                 t.bytes.resize(8 * 32 * 16 * 4);
                 ts.push_back(t);
               })),
               "more than once");
  EXPECT_ERROR(import_hf(tmp("nowhere")), "Hugging Face checkpoint folder '" + tmp("nowhere") + "' does not exist");
}

TEST(HfImport, ShardIndexMustMatchTheShards) {
  const std::string src = kGolden + "hf/save_pretrained", dir = tmp("bad_index");
  fs::remove_all(dir);
  fs::copy(src, dir);
  nlohmann::json idx = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  auto& wm = idx["weight_map"];
  const std::string key = "model.norm.weight";
  const std::string real = wm[key];
  wm[key] = real == "model-00001-of-00005.safetensors" ? "model-00002-of-00005.safetensors"
                                                       : "model-00001-of-00005.safetensors";
  write_file(dir + "/model.safetensors.index.json", idx.dump());
  EXPECT_ERROR(import_hf(dir), "which the index places");
  wm[key] = "../evil.safetensors";
  write_file(dir + "/model.safetensors.index.json", idx.dump());
  EXPECT_ERROR(import_hf(dir), "not a plain file name");
  wm[key] = real;
  wm["model.extra.weight"] = real;
  write_file(dir + "/model.safetensors.index.json", idx.dump());
  EXPECT_ERROR(import_hf(dir), "does not hold it");
}

std::string raw_safetensors(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\0');
}

TEST(Safetensors, WriterIsDeterministicAndReadable) {
  std::vector<SafetensorsTensorOut> ts = {{"b", "F32", {2}, {0, 0, 128, 63, 0, 0, 0, 64}},
                                          {"a", "BF16", {1, 1}, {0x80, 0x3f}}};
  write_safetensors(tmp("w1.st"), ts, {{"format", "pt"}});
  std::reverse(ts.begin(), ts.end());
  write_safetensors(tmp("w2.st"), ts, {{"format", "pt"}});
  EXPECT_EQ(read_file(tmp("w1.st")), read_file(tmp("w2.st")));
  const std::string bytes = read_file(tmp("w1.st"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  SafetensorsFile st(tmp("w1.st"));
  EXPECT_EQ(st.read("b", DType::kF32).as<float>()[1], 2.0f);
  EXPECT_EQ(st.read("a", DType::kF32).as<float>()[0], 1.0f);
  EXPECT_EQ(st.entry("a").begin, 0u);  // data in name order
  EXPECT_EQ(st.meta("format"), "pt");
  EXPECT_ERROR(write_safetensors(tmp("w3.st"), {{"x", "F32", {3}, {0, 0, 0, 0}}}), "has 4 bytes");
}

TEST(Safetensors, RefusesMoreMalformedHeaders) {
  auto refused = [](const std::string& header, size_t data, const std::string& expect) {
    write_file(tmp("bad.st"), raw_safetensors(header, data));
    EXPECT_ERROR(SafetensorsFile f(tmp("bad.st")), expect);
  };
  refused(R"({"x":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", 8, "non-string dtype");
  refused(R"({"x":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8, "non-array shape");
  refused(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8, "bad data_offsets");
  refused(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "bad data_offsets");
  refused(R"({"x":{"dtype":"F32","shape":[2]}})", 8, "lacks dtype, shape or data_offsets");
  refused(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "bad shape");
  refused(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "out of range");
  refused(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
          8, "overlap");
  refused(R"({"__metadata__":{"k":1}})", 0, "metadata 'k' is not a string");
  refused(R"([1,2])", 0, "not a JSON object");
}

// Token ids and the maximum length survive import -> our parameter file -> export, and
// generation_config.json carries them (transformers' generate() stops at eos_token_id:
// tools/reference/check_hf_export.py checks that in transformers).
TEST(HfImport, TokenIdsAndLengthSurviveTheRoundTrip) {
  struct Case {
    nlohmann::json bos, eos, pad, max_pos;
  };
  const std::vector<Case> cases = {
      {1, 2, 0, 2048},
      {nullptr, 5, nullptr, 4096},
      {nullptr, nullptr, nullptr, 150},
      {7, 7, 9, 64},  // bos may equal eos
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(i);
    const std::string dir = variant("ids" + std::to_string(i), [&](nlohmann::json& j) {
      j["bos_token_id"] = c.bos;
      j["eos_token_id"] = c.eos;
      j["pad_token_id"] = c.pad;
      j["max_position_embeddings"] = c.max_pos;
    });
    const HfModel m = import_hf(dir);
    EXPECT_EQ(m.config.data.bos_id, c.bos.is_null() ? -1 : c.bos.get<int64_t>());
    EXPECT_EQ(m.config.data.eos_id, c.eos.is_null() ? -1 : c.eos.get<int64_t>());
    EXPECT_EQ(m.config.model.pad_id, c.pad.is_null() ? -1 : c.pad.get<int64_t>());
    EXPECT_EQ(m.config.model.max_position_embeddings, c.max_pos.get<int64_t>());
    const std::string ours = tmp("ids_ours" + std::to_string(i) + ".safetensors");
    save_our_params(ours, m.config, m.params.data());
    const Config stored = config_from_json(SafetensorsFile(ours).meta("config"));
    const std::string out = tmp("ids_export" + std::to_string(i));
    export_hf(stored, load_our_params(ours, stored.model).data(), out, "f32");
    const nlohmann::json cfg = nlohmann::json::parse(read_file(out + "/config.json"));
    const nlohmann::json gen = nlohmann::json::parse(read_file(out + "/generation_config.json"));
    for (const nlohmann::json& j : {cfg, gen}) {
      EXPECT_EQ(j["bos_token_id"], c.bos);
      EXPECT_EQ(j["eos_token_id"], c.eos);
      EXPECT_EQ(j["pad_token_id"], c.pad);
    }
    EXPECT_EQ(cfg["max_position_embeddings"], c.max_pos);
  }
  // Refused: ids outside the vocabulary, lists of ids; pad == eos keeps eos and says so.
  EXPECT_ERROR(import_hf(variant("ids_big", [](nlohmann::json& j) { j["eos_token_id"] = 64; })), "'eos_token_id' = 64");
  EXPECT_ERROR(import_hf(variant("ids_list", [](nlohmann::json& j) { j["eos_token_id"] = {1, 2}; })),
               "a list of several ids is not supported");
  const HfModel same = import_hf(variant("ids_same", [](nlohmann::json& j) {
    j["eos_token_id"] = 4;
    j["pad_token_id"] = 4;
  }));
  EXPECT_EQ(same.config.data.eos_id, 4);
  EXPECT_EQ(same.config.model.pad_id, -1);
  ASSERT_EQ(same.notes.size(), 1u);
  EXPECT_NE(same.notes[0].find("pad_token_id = eos_token_id = 4"), std::string::npos);
}

// A model trained here exports its own ids: data.eos_id, data.bos_id, model.pad_id and the
// training length (model.max_position_embeddings = 0).
TEST(HfExport, TrainedModelsExportTheirTokenIds) {
  Config full = fixture_full();
  full.data.eos_id = 10;
  full.data.bos_id = -1;
  full.model.pad_id = 11;
  full.train.seq_len = 96;
  full.model.max_position_embeddings = 0;
  const std::vector<float> params = load_our_params(kFixture, full.model);
  export_hf(full, params.data(), tmp("trained_ids"), "f32");
  const nlohmann::json cfg = nlohmann::json::parse(read_file(tmp("trained_ids") + "/config.json"));
  EXPECT_EQ(cfg["eos_token_id"], 10);
  EXPECT_TRUE(cfg["bos_token_id"].is_null());
  EXPECT_EQ(cfg["pad_token_id"], 11);
  EXPECT_EQ(cfg["max_position_embeddings"], 96);
}

}  // namespace
}  // namespace moe
