// Reading Hugging Face checkpoints (olmoe and olmo3moe folders) and our own parameter files.
#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/hf_export.h"
#include "checkpoint/hf_json.h"
#include "checkpoint/hf_olmo3moe.h"
#include "checkpoint/hf_targets.h"
#include "checkpoint/safetensors.h"
#include "core/check.h"
#include "core/user_path.h"
#include "model/params.h"

namespace moe {
namespace {

const nlohmann::json& need(const nlohmann::json& j, const char* key) {
  MOE_CHECK(j.contains(key), "config.json lacks '", key, "'");
  return j.at(key);
}

int64_t need_int(const nlohmann::json& j, const char* key) {
  const auto& v = need(j, key);
  MOE_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, "config.json: '", key, "' = ", v.dump(),
            " (need a positive integer)");
  return v.get<int64_t>();
}

// config.json's text as a JSON object of a supported model type.
nlohmann::json parse_hf_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    MOE_FAIL("config.json is not valid JSON: ", e.what());
  }
  MOE_CHECK(j.is_object(), "config.json is not a JSON object");
  MOE_CHECK(j.contains("model_type") && (j["model_type"] == "olmoe" || j["model_type"] == "olmo3moe"),
            "config.json: model_type ", j.contains("model_type") ? j["model_type"].dump() : std::string("missing"),
            " (supported: \"olmoe\", OlmoeForCausalLM; \"olmo3moe\", Olmo-core 3's Olmo3MoeForCausalLM)");
  return j;
}

// OLMoE's fields moecore reads or ignores; any other is refused by name, as is another architecture.
void check_olmoe_fields(const nlohmann::json& j) {
  static const char* kIgnored[] = {"architectures", "model_type", "use_cache", "output_router_logits",
                                   "router_aux_loss_coef", "transformers_version", "dtype", "torch_dtype",
                                   "_name_or_path", "initializer_range", "return_dict", "output_hidden_states",
                                   "output_attentions", "tokenizer_class"};
  static const char* kRead[] = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "num_experts", "num_local_experts",
                                "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps", "rope_theta",
                                "rope_parameters", "rope_scaling", "tie_word_embeddings", "hidden_act",
                                "attention_bias", "attention_dropout", "clip_qkv", "head_dim", "pad_token_id",
                                "bos_token_id", "eos_token_id", "max_position_embeddings"};
  for (auto& [key, v] : j.items()) {
    bool known = false;
    for (const char* k : kIgnored) known |= key == k;
    for (const char* k : kRead) known |= key == k;
    MOE_CHECK(known, "config.json: unsupported field '", key, "' = ", v.dump(), " (moecore cannot honour it)");
  }
  if (j.contains("architectures") && !j["architectures"].is_null())
    MOE_CHECK(j["architectures"] == nlohmann::json::array({"OlmoeForCausalLM"}), "config.json: architectures ",
              j["architectures"].dump(), " (only [\"OlmoeForCausalLM\"] is supported)");
}

// OLMoE's attention: default RoPE, SiLU experts, no dropout, no clamp, heads of hidden_size /
// num_attention_heads; attention_bias read on the way (refusals in config.json's order).
void read_olmoe_attention(const nlohmann::json& j, ModelConfig& c) {
  if (j.contains("rope_scaling"))
    MOE_CHECK(j["rope_scaling"].is_null(), "config.json: rope_scaling ", j["rope_scaling"].dump(),
              " (only unscaled default RoPE)");
  if (j.contains("hidden_act"))
    MOE_CHECK(j["hidden_act"] == "silu", "config.json: hidden_act ", j["hidden_act"].dump(), " (only \"silu\")");
  c.attention_bias = hf_json::boolean(j, "attention_bias", false);  // q/k/v/o_proj.bias
  if (j.contains("attention_dropout"))
    MOE_CHECK(j["attention_dropout"].is_number() && j["attention_dropout"].get<double>() == 0.0,
              "config.json: attention_dropout ", j["attention_dropout"].dump(), " (only 0)");
  if (j.contains("clip_qkv"))
    MOE_CHECK(j["clip_qkv"].is_null(), "config.json: clip_qkv ", j["clip_qkv"].dump(),
              " (OLMoE clamps q and k after their QK-norm; moecore's model.clip_qkv, as Olmo-core 3's, "
              "clamps before it: only null)");
  MOE_CHECK(c.d_model % c.n_heads == 0, "config.json: hidden_size ", c.d_model,
            " is not a multiple of num_attention_heads ", c.n_heads);
  if (j.contains("head_dim") && !j["head_dim"].is_null())
    MOE_CHECK(j["head_dim"] == c.d_model / c.n_heads, "config.json: head_dim ", j["head_dim"].dump(),
              " != hidden_size / num_attention_heads = ", c.d_model / c.n_heads);
}

// The shard files of a Hugging Face folder and, when sharded, the file its index names for each key.
struct HfShards {
  std::vector<std::string> files;
  std::map<std::string, std::string> index_of;  // key -> shard file named by the index
};

HfShards hf_shards(const std::string& dir) {
  HfShards out;
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (path_entry_exists(index_path)) {
    nlohmann::json idx;
    try {
      idx = nlohmann::json::parse(read_input_file(index_path, "Hugging Face shard index"));
    } catch (const std::exception& e) {
      MOE_FAIL("'", index_path, "' is not valid JSON: ", e.what());
    }
    MOE_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(), "'", index_path,
              "' has no weight_map object");
    for (auto& [k, v] : idx["weight_map"].items()) {
      MOE_CHECK(v.is_string(), "'", index_path, "': weight_map['", k, "'] is not a file name");
      const std::string f = v.get<std::string>();
      MOE_CHECK(f.find('/') == std::string::npos && f.find("..") == std::string::npos, "'", index_path,
                "': shard name '", f, "' is not a plain file name");
      out.index_of[k] = f;
      if (std::find(out.files.begin(), out.files.end(), f) == out.files.end()) out.files.push_back(f);
    }
    std::sort(out.files.begin(), out.files.end());
  } else {
    MOE_CHECK(path_entry_exists(dir + "/model.safetensors"), "'", dir,
              "' has neither model.safetensors nor model.safetensors.index.json");
    out.files.push_back("model.safetensors");
  }
  return out;
}

// What the weight files gave so far: elements written per parameter of ours, the file of each HF
// key, and a tied lm_head to compare with the embedding.
struct HfRead {
  std::map<std::string, int64_t> covered;
  std::map<std::string, std::string> seen;
  std::vector<float> tied_head;
};

// One HF tensor into our flat parameters: a copy, or OLMoE's fused gate_up split into gate and up.
void place_hf_tensor(const hf::Target& tg, const OwnedTensor& v, std::vector<float>& params, HfRead& read) {
  const float* src = v.as<float>();
  if (tg.kind == hf::Kind::kCopy) {
    std::memcpy(params.data() + tg.offset, src, static_cast<size_t>(v.t.numel()) * sizeof(float));
    read.covered[tg.ours] += v.t.numel();
  } else {
    const int64_t per = tg.F * tg.D;
    for (int64_t x = 0; x < tg.E; ++x) {
      std::memcpy(params.data() + tg.gate_offset + x * per, src + x * 2 * per, per * sizeof(float));
      std::memcpy(params.data() + tg.up_offset + x * per, src + x * 2 * per + per, per * sizeof(float));
    }
    const std::string base = tg.ours.substr(0, tg.ours.size() - 7);  // "layers.L.experts."
    read.covered[base + "gate"] += tg.E * per;
    read.covered[base + "up"] += tg.E * per;
  }
}

// Every tensor of weight file f: once in the folder, where the index says, a known key of the
// format with its shape and a float dtype.
void read_hf_file(const std::string& dir, const std::string& f, const HfShards& shards,
                  const std::map<std::string, hf::Target>& targets, const ModelConfig& c, const ParamLayout& layout,
                  HfFormat format, std::vector<float>& params, HfRead& read) {
  SafetensorsFile st(dir + "/" + f, "Hugging Face weights file");
  for (const auto& [key, e] : st.entries()) {
    auto prev = read.seen.find(key);
    MOE_CHECK(prev == read.seen.end(), "tensor '", key, "' appears in both '", prev->second, "' and '", f, "'");
    read.seen[key] = f;
    if (!shards.index_of.empty()) {
      auto it = shards.index_of.find(key);
      MOE_CHECK(it != shards.index_of.end() && it->second == f, "'", dir + "/" + f, "' holds '", key,
                "', which the index places ", it == shards.index_of.end() ? std::string("nowhere") : "in '" + it->second + "'");
    }
    if (key == "lm_head.weight" && c.tie_embeddings) {  // tied: must equal the embedding (checked below)
      MOE_CHECK(e.shape == layout.find("embed").shape, "'", dir + "/", f, "': tied lm_head.weight has shape ",
                hf::shape_str(e.shape), ", expected ", hf::shape_str(layout.find("embed").shape));
      OwnedTensor v = st.read(key, DType::kF32);
      read.tied_head.assign(v.as<float>(), v.as<float>() + v.t.numel());
      continue;
    }
    auto t = targets.find(key);
    MOE_CHECK(t != targets.end(), "'", dir + "/", f, "': unexpected tensor '", key, "' (not part of ",
              format == HfFormat::kOlmoe ? "OlmoeForCausalLM" : "Olmo3MoeForCausalLM", " with this config.json)");
    const hf::Target& tg = t->second;
    MOE_CHECK(e.shape == tg.shape, "'", dir + "/", f, "': tensor '", key, "' has shape ", hf::shape_str(e.shape),
              ", expected ", hf::shape_str(tg.shape));
    MOE_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16" || e.dtype == "F64", "'", dir + "/", f,
              "': tensor '", key, "' has dtype ", e.dtype, " (need a float type)");
    place_hf_tensor(tg, st.read(key, DType::kF32), params, read);
  }
}

// After every file: a tied head equal to the embedding, every indexed key found, every parameter
// of ours written exactly once.
void check_hf_complete(const std::string& dir, const ParamLayout& layout, const std::vector<float>& params,
                       const HfShards& shards, HfRead& read) {
  if (!read.tied_head.empty()) {
    const ParamInfo emb = layout.find("embed");  // a copy: no reference to a call given a temporary
    MOE_CHECK(std::memcmp(read.tied_head.data(), params.data() + emb.offset, read.tied_head.size() * sizeof(float)) == 0,
              "'", dir, "': tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight");
  }
  for (const auto& [k, f] : shards.index_of)
    MOE_CHECK(read.seen.count(k), "the index places '", k, "' in '", f, "', which does not hold it");
  for (const ParamInfo& p : layout.entries()) {
    const int64_t n = read.covered.count(p.name) ? read.covered[p.name] : 0;
    MOE_CHECK(n <= p.numel, "'", dir, "' gives parameter '", p.name, "' more than once (per-expert and fused keys both present?)");
    MOE_CHECK(n == p.numel, "'", dir, "' lacks tensors for parameter '", p.name, "' (", n, " of ", p.numel,
              " elements present)");
  }
}

}  // namespace

Config config_from_hf_json(const std::string& text, std::vector<std::string>* notes) {
  const nlohmann::json j = parse_hf_config(text);
  if (j["model_type"] == "olmo3moe") return config_from_olmo3moe(j, notes);
  check_olmoe_fields(j);
  Config full;
  ModelConfig& c = full.model;
  c.vocab_size = need_int(j, "vocab_size");
  c.d_model = need_int(j, "hidden_size");
  c.expert_hidden = need_int(j, "intermediate_size");
  c.n_layers = need_int(j, "num_hidden_layers");
  c.n_heads = need_int(j, "num_attention_heads");
  c.n_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                     ? need_int(j, "num_key_value_heads") : c.n_heads;
  c.num_experts = j.contains("num_local_experts") && !j.contains("num_experts") ? need_int(j, "num_local_experts")
                                                                                : need_int(j, "num_experts");
  c.top_k = need_int(j, "num_experts_per_tok");
  c.head_dim = 0;
  c.norm_placement = "pre";
  c.qk_norm = "full";
  c.n_dense_layers = 0;
  c.shared_hidden = 0;
  c.score_func = "softmax";
  c.routing = "learned";
  c.router_bias_gamma = 0;
  c.norm_topk_prob = hf_json::boolean(j, "norm_topk_prob", false);
  c.tie_embeddings = hf_json::boolean(j, "tie_word_embeddings", false);
  c.norm_eps = hf_json::positive_number(j, "rms_norm_eps", 1e-5);
  c.rope_theta = hf_json::rope_theta(j, 10000.0);
  if (j.contains("initializer_range") && j["initializer_range"].is_number())
    c.init_std = j["initializer_range"].get<double>();
  read_olmoe_attention(j, c);
  // Token ids: an integer in [0, vocab_size) or null (-1). moecore keeps one id of each kind.
  auto token_id = [&](const char* key) { return hf_json::token_id(j, key, c.vocab_size); };
  c.pad_id = token_id("pad_token_id");
  full.data.eos_id = token_id("eos_token_id");
  full.data.bos_id = token_id("bos_token_id");
  if (j.contains("max_position_embeddings") && !j["max_position_embeddings"].is_null())
    c.max_position_embeddings = need_int(j, "max_position_embeddings");
  c.pad_id = hf_json::pad_unless_eos(c.pad_id, full.data.eos_id, notes);
  try {
    c.validate();
  } catch (const std::exception& e) {
    MOE_FAIL("config.json: ", e.what());
  }
  return full;
}

HfModel import_hf(const std::string& dir) {
  HfModel m;
  check_input_dir(dir, "Hugging Face checkpoint folder");
  m.carried.config_json = read_input_file(dir + "/config.json", "Hugging Face config");
  m.config = config_from_hf_json(m.carried.config_json, &m.notes);
  const HfFormat format = hf_format_from_name(nlohmann::json::parse(m.carried.config_json)["model_type"].get<std::string>());
  m.carried.format = hf_format_name(format);
  for (const std::string& name : hf_tokenizer_files())
    if (path_entry_exists(dir + "/" + name))
      m.carried.files[name] = read_input_file(dir + "/" + name, "tokenizer file", /*allow_empty=*/true);
  const ModelConfig& c = m.config.model;
  const ParamLayout layout(c);
  m.params.assign(static_cast<size_t>(layout.total()), 0.0f);
  // The files and which keys each should hold (from the index, if sharded).
  const HfShards shards = hf_shards(dir);
  const auto targets = hf::targets(c, layout, format);
  HfRead read;
  for (const std::string& f : shards.files) read_hf_file(dir, f, shards, targets, c, layout, format, m.params, read);
  check_hf_complete(dir, layout, m.params, shards, read);
  return m;
}

std::vector<float> load_our_params(const std::string& path, const ModelConfig& c, std::string_view what) {
  return load_our_params(SafetensorsFile(path, what), c);
}

std::vector<float> load_our_params(const SafetensorsFile& st, const ModelConfig& c) {
  const std::string& path = st.path();
  const ParamLayout layout(c);
  std::vector<float> out(static_cast<size_t>(layout.total()), 0.0f);
  for (const ParamInfo& p : layout.entries()) {
    const std::string name = st.contains("param." + p.name) ? "param." + p.name : p.name;
    MOE_CHECK(st.contains(name), "'", path, "' has no parameter '", p.name, "'");
    const auto& e = st.entry(name);
    MOE_CHECK(e.shape == p.shape, "'", path, "': parameter '", p.name, "' has shape ", hf::shape_str(e.shape),
              ", expected ", hf::shape_str(p.shape));
    OwnedTensor v = st.read(name, DType::kF32);
    std::memcpy(out.data() + p.offset, v.as<float>(), static_cast<size_t>(p.numel) * sizeof(float));
  }
  return out;
}

void save_our_params(const std::string& path, const Config& config, const float* params, const HfCarried* carried) {
  const ModelConfig& c = config.model;
  const ParamLayout layout(c);
  std::vector<SafetensorsTensorOut> tensors;
  for (const ParamInfo& p : layout.entries())
    tensors.push_back(hf::make_tensor(p.name, p.shape, params + p.offset, p.numel, false));
  Config stored;  // the settings that belong to the weights; the rest stays at the defaults
  stored.model = c;
  stored.data.eos_id = config.data.eos_id;
  stored.data.bos_id = config.data.bos_id;
  std::map<std::string, std::string> meta{{"config", config_to_json(stored)}, {"format", "moecore-params-v1"}};
  if (carried && !carried->format.empty()) {  // what the import read and our config does not hold
    meta["hf_format"] = carried->format;
    meta["hf_config"] = carried->config_json;
    for (const auto& [name, bytes] : carried->files) meta["hf_file." + name] = bytes;
  }
  write_safetensors(path, std::move(tensors), meta);
}

HfCarried load_hf_carried(const SafetensorsFile& st) {
  HfCarried c;
  const auto& meta = st.metadata();
  auto it = meta.find("hf_format");
  if (it == meta.end()) return c;
  c.format = it->second;
  hf_format_from_name(c.format);  // a known format, or an error naming it
  if (auto cfg = meta.find("hf_config"); cfg != meta.end()) c.config_json = cfg->second;
  for (const auto& [key, value] : meta)
    if (key.rfind("hf_file.", 0) == 0) {
      const std::string name = key.substr(8);
      MOE_CHECK(std::find(hf_tokenizer_files().begin(), hf_tokenizer_files().end(), name) != hf_tokenizer_files().end(),
                "'", st.path(), "': carried file '", name, "' is not a tokenizer file moecore carries");
      c.files[name] = value;
    }
  return c;
}

}  // namespace moe
