#include "checkpoint/hf_export.h"
#include "kernels/host_view.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/hf_json.h"
#include "checkpoint/hf_olmo3moe.h"
#include "checkpoint/hf_targets.h"
#include "checkpoint/safetensors.h"
#include "core/bf16.h"
#include "core/check.h"
#include "core/user_path.h"
#include "model/params.h"
#include "model/transformer.h"

namespace moe {
namespace hf {
namespace {

std::string olmoe_name_of(const std::string& ours) {
  static const std::map<std::string, std::string> per_layer = {
      {"attn_norm", "input_layernorm.weight"}, {"wq", "self_attn.q_proj.weight"},
      {"wk", "self_attn.k_proj.weight"},       {"wv", "self_attn.v_proj.weight"},
      {"wo", "self_attn.o_proj.weight"},       {"q_norm", "self_attn.q_norm.weight"},
      {"k_norm", "self_attn.k_norm.weight"},   {"ffn_norm", "post_attention_layernorm.weight"},
      {"router", "mlp.gate.weight"},           {"bq", "self_attn.q_proj.bias"},
      {"bk", "self_attn.k_proj.bias"},         {"bv", "self_attn.v_proj.bias"},
      {"bo", "self_attn.o_proj.bias"}};
  if (ours == "embed") return "model.embed_tokens.weight";
  if (ours == "final_norm") return "model.norm.weight";
  if (ours == "lm_head") return "lm_head.weight";
  const size_t dot = ours.find('.', 7);  // "layers.L.rest"
  MOE_CHECK(ours.rfind("layers.", 0) == 0 && dot != std::string::npos, "no HF name for parameter '", ours, "'");
  auto it = per_layer.find(ours.substr(dot + 1));
  MOE_CHECK(it != per_layer.end(), "no HF name for parameter '", ours, "'");
  return "model." + ours.substr(0, dot + 1) + it->second;
}


template <class T>
void append_bytes(std::vector<unsigned char>& out, const T& v) {
  const auto* b = reinterpret_cast<const unsigned char*>(&v);
  out.insert(out.end(), b, b + sizeof(T));
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

SafetensorsTensorOut make_tensor(const std::string& name, const std::vector<int64_t>& shape, const float* src,
                                 int64_t n, bool bf) {
  SafetensorsTensorOut t;
  t.name = name;
  t.dtype = bf ? "BF16" : "F32";
  t.shape = shape;
  t.bytes.reserve(static_cast<size_t>(n) * (bf ? 2 : 4));
  for (int64_t i = 0; i < n; ++i) {
    if (bf) append_bytes(t.bytes, bf16(src[i]).bits);
    else append_bytes(t.bytes, src[i]);
  }
  return t;
}

std::map<std::string, Target> targets(const ModelConfig& c, const ParamLayout& layout, HfFormat format) {
  const bool olmoe = format == HfFormat::kOlmoe;
  std::map<std::string, Target> out;
  for (const ParamInfo& p : layout.entries()) {
    const bool gate = p.name.ends_with(".experts.gate"), up = p.name.ends_with(".experts.up"),
               down = p.name.ends_with(".experts.down");
    if (!gate && !up && !down) {
      out[olmoe ? olmoe_name_of(p.name) : olmo3moe_name_of(p.name)] = Target{p.name, p.shape, p.offset};
      continue;
    }
    const std::string base = p.name.substr(0, p.name.size() - (up ? 2 : 4));  // "layers.L.experts."
    const std::string prefix = "model." + base.substr(0, base.size() - 8) + "mlp.experts.";
    const std::string proj = gate ? "gate_proj" : up ? "up_proj" : "down_proj";
    const int64_t per = p.numel / c.num_experts;
    for (int64_t e = 0; e < c.num_experts; ++e)
      out[prefix + std::to_string(e) + "." + proj + ".weight"] =
          Target{p.name, {p.shape[1], p.shape[2]}, p.offset + e * per};
    if (down && olmoe) out[prefix + "down_proj"] = Target{p.name, p.shape, p.offset};
    if (gate && olmoe) {
      Target t;
      t.ours = base + "gate+up";
      t.kind = Kind::kFusedGateUp;
      t.E = c.num_experts;
      t.F = c.expert_hidden;
      t.D = c.d_model;
      t.shape = {t.E, 2 * t.F, t.D};
      t.gate_offset = p.offset;
      t.up_offset = layout.find(base + "up").offset;
      out[prefix + "gate_up_proj"] = t;
    }
  }
  return out;
}


}  // namespace hf

namespace {
namespace fs = std::filesystem;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MOE_CHECK(out.good(), "cannot write '", path, "'");
  out << text;
  out.flush();
  MOE_CHECK(out.good(), "writing '", path, "' failed");
}

}  // namespace

std::string olmoe_unsupported_reason(const ModelConfig& c) {
  std::vector<std::string> r;
  if (c.norm_placement != "pre")
    r.push_back(c.norm_placement + " norms (model.norm_placement = \"" + c.norm_placement +
                "\"): OLMoE has pre-norm blocks without output norms");
  if (c.qk_norm == "none") r.push_back("QK-norm off (model.qk_norm = \"none\"): OLMoE always normalizes q and k");
  if (c.qk_norm == "per_head")
    r.push_back("per-head QK-norm (model.qk_norm = \"per_head\"): OLMoE's q_norm/k_norm span all heads (\"full\")");
  if (c.num_dense_layers() > 0)
    r.push_back("dense layers (model.n_dense_layers = " + std::to_string(c.n_dense_layers) + ", model.dense_layers = \"" +
                c.dense_layers + "\"): every OLMoE layer is MoE");
  if (c.shared_hidden > 0)
    r.push_back("shared experts (model.shared_hidden = " + std::to_string(c.shared_hidden) + "): OLMoE has none");
  if (c.score_func != "softmax")
    r.push_back("model.score_func = \"" + c.score_func + "\": OLMoE's router uses softmax and chooses on its scores");
  if (c.norm_topk_prob && c.norm_topk_p != 1.0)
    r.push_back("p-norm weights (model.norm_topk_p = " + std::to_string(c.norm_topk_p) + "): OLMoE divides by the sum");
  if (c.expert_weight_factor() != 1.0)
    r.push_back("scaled expert weights (model.restore_weight_scale, expert_weight_scale, original_top_k): OLMoE has none");
  if (c.embed_scale != 1.0)
    r.push_back("model.embed_scale = " + std::to_string(c.embed_scale) + ": OLMoE does not scale its embedding");
  if (c.embedding_norm) r.push_back("model.embedding_norm = true: OLMoE has no embedding norm");
  if (c.router_logit_bias) r.push_back("model.router_logit_bias: OLMoE's gate is a Linear without bias");
  if (c.router_bias_selects())
    r.push_back("router bias (model.router_bias_gamma > 0 or model.score_correction_bias): OLMoE's router has none");
  if (c.n_group > 0) r.push_back("group-limited routing (model.n_group > 0): OLMoE chooses among all experts");
  if (!c.attention_windows().empty())
    r.push_back("sliding windows (model.sliding_window = \"" + c.sliding_window + "\"): OLMoE attends to every earlier position");
  if (c.rope != "all") r.push_back("model.rope = \"" + c.rope + "\": OLMoE applies RoPE on every layer");
  if (c.clip_qkv > 0)
    r.push_back("model.clip_qkv = " + std::to_string(c.clip_qkv) +
                ": OLMoE's clip_qkv clamps q and k after their QK-norm, moecore's (Olmo-core 3's) before it");
  if (c.rope_partial != 1.0)
    r.push_back("partial RoPE (model.rope_partial = " + std::to_string(c.rope_partial) + "): OLMoE rotates every head dim");
  if (c.routing != "learned")
    r.push_back("non-learned routing (model.routing = \"" + c.routing + "\"): OLMoE routes by the learned router");
  if (c.hd() * c.n_heads != c.d_model)
    r.push_back("head_dim != d_model / n_heads (head_dim " + std::to_string(c.hd()) + ", d_model " +
                std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
                "): OLMoE derives head_dim from hidden_size");
  std::string out;
  for (const auto& s : r) out += (out.empty() ? "" : "; ") + s;
  return out;
}

namespace {
nlohmann::ordered_json olmoe_config(const Config& full, const std::string& dtype, const nlohmann::json* carried) {
  using hf_json::id_or_null;
  const ModelConfig& c = full.model;
  MOE_CHECK(dtype == "f32" || dtype == "bf16", "export dtype '", dtype, "' (allowed: f32, bf16)");
  const std::string why = olmoe_unsupported_reason(c);
  MOE_CHECK(why.empty(), "cannot export to OlmoeForCausalLM: ", whole(why));
  const char* torch_dtype = dtype == "bf16" ? "bfloat16" : "float32";
  nlohmann::ordered_json j;
  j["architectures"] = {"OlmoeForCausalLM"};
  j["model_type"] = "olmoe";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.d_model;
  j["intermediate_size"] = c.expert_hidden;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.top_k;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;  // transformers 4.x
  j["rope_parameters"] = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};  // 5.x
  j["max_position_embeddings"] = c.max_position_embeddings > 0 ? c.max_position_embeddings : full.train.seq_len;
  j["attention_bias"] = c.attention_bias;  // q/k/v/o_proj.bias
  j["attention_dropout"] = 0.0;
  j["clip_qkv"] = nullptr;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["initializer_range"] = c.init_std;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.01;
  j["use_cache"] = true;
  j["pad_token_id"] = id_or_null(c.pad_id);
  j["bos_token_id"] = id_or_null(full.data.bos_id);
  j["eos_token_id"] = id_or_null(full.data.eos_id);
  j["torch_dtype"] = torch_dtype;  // transformers 4.x
  j["dtype"] = torch_dtype;        // 5.x
  if (carried)  // the imported file's fields moecore does not model, as they were
    for (auto& [key, v] : carried->items())
      if (!j.contains(key) && key != "transformers_version") j[key] = v;
  return j;
}

// The settings that make up what the weights compute, and their token ids: equal in both.
bool same_weights_function(const Config& a, const Config& b) {
  const auto ea = config_entries(a), eb = config_entries(b);
  for (size_t i = 0; i < ea.size(); ++i) {
    const std::string& key = ea[i].first;
    if (key.rfind("model.", 0) != 0 && key != "data.eos_id" && key != "data.bos_id") continue;
    if (ea[i].second != eb[i].second) return false;
  }
  return true;
}

nlohmann::json carried_config(const HfExportOptions& o) {
  if (!o.carried || o.carried->format != hf_format_name(o.format) || o.carried->config_json.empty()) return nullptr;
  try {
    return nlohmann::json::parse(o.carried->config_json);
  } catch (const std::exception& e) {
    MOE_FAIL("the carried config.json of the import is not valid JSON: ", e.what());
  }
}
}  // namespace


HfFormat hf_format_from_name(const std::string& name) {
  if (name == "olmoe") return HfFormat::kOlmoe;
  MOE_CHECK(name == "olmo3moe", "Hugging Face format '", name, "' (allowed: olmoe, olmo3moe)");
  return HfFormat::kOlmo3moe;
}

const char* hf_format_name(HfFormat f) { return f == HfFormat::kOlmoe ? "olmoe" : "olmo3moe"; }

const std::vector<std::string>& hf_tokenizer_files() {
  static const std::vector<std::string> names = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                                 "vocab.json", "merges.txt", "tokenizer.model"};
  return names;
}

std::string hf_config_json(const Config& full, const std::string& dtype) {
  HfExportOptions o;
  o.dtype = dtype;
  return hf_config_json(full, o);
}

std::string hf_config_json(const Config& full, const HfExportOptions& o) {
  MOE_CHECK(o.dtype == "f32" || o.dtype == "bf16", "export dtype '", o.dtype, "' (allowed: f32, bf16)");
  const nlohmann::json carried = carried_config(o);
  const nlohmann::json* c = carried.is_null() ? nullptr : &carried;
  const std::string torch_dtype = o.dtype == "bf16" ? "bfloat16" : "float32";
  // The model an import read, unchanged: its config.json as it was (every field as from_pretrained
  // reads it), with the export's dtype. (A model whose settings changed gets a new file below,
  // with the imported file's other fields carried.)
  if (c && same_weights_function(config_from_hf_json(o.carried->config_json), full)) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(o.carried->config_json);
    for (const char* key : {"dtype", "torch_dtype"})
      if (j.contains(key)) j[key] = torch_dtype;
    return j.dump(2) + "\n";
  }
  if (o.format == HfFormat::kOlmoe) return olmoe_config(full, o.dtype, c).dump(2) + "\n";
  return olmo3moe_config(full, torch_dtype, c).dump(2) + "\n";
}

std::string hf_generation_config_json(const Config& full) {
  using hf_json::id_or_null;
  nlohmann::ordered_json j;
  j["_from_model_config"] = true;
  j["bos_token_id"] = id_or_null(full.data.bos_id);
  j["eos_token_id"] = id_or_null(full.data.eos_id);
  j["pad_token_id"] = id_or_null(full.model.pad_id);
  return j.dump(2) + "\n";
}

void export_hf(const Config& full, const float* params, const std::string& out_dir, const std::string& dtype) {
  HfExportOptions o;
  o.dtype = dtype;
  export_hf(full, params, out_dir, o);
}

void export_hf(const Config& full, const float* params, const std::string& out_dir, const HfExportOptions& o) {
  const ModelConfig& c = full.model;
  const std::string config_text = hf_config_json(full, o);  // checks dtype and the architecture
  MOE_CHECK(o.max_shard_bytes > 0, "export: max_shard_bytes = ", o.max_shard_bytes, " (need > 0)");
  const bool bf = o.dtype == "bf16";
  const ParamLayout layout(c);
  // Shards in key order, each up to max_shard_bytes (a larger tensor alone), written one at a
  // time: only one shard's bytes are in memory.
  struct Item {
    std::string key;
    const hf::Target* target;
    int64_t n;
  };
  const auto targets = hf::targets(c, layout, o.format);
  std::vector<std::vector<Item>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [key, t] : targets) {
    if (t.kind != hf::Kind::kCopy || t.shape.size() == 3) continue;  // fused layouts: import only
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const int64_t bytes = n * (bf ? 2 : 4);
    if (in_shard > 0 && in_shard + bytes > o.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(Item{key, &t, n});
    in_shard += bytes;
    total += bytes;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  MOE_CHECK(fs::is_directory(out_dir), "cannot create directory '", out_dir, "'");
  nlohmann::ordered_json weight_map;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    const std::string file = shards.size() == 1 ? "model.safetensors" : name;
    std::vector<SafetensorsTensorOut> tensors;
    for (const Item& it : shards[s]) {
      tensors.push_back(hf::make_tensor(it.key, it.target->shape, params + it.target->offset, it.n, bf));
      weight_map[it.key] = file;
    }
    write_safetensors(out_dir + "/" + file, std::move(tensors), {{"format", "pt"}});
  }
  if (shards.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    write_text(out_dir + "/model.safetensors.index.json", index.dump(2) + "\n");
  }
  write_text(out_dir + "/config.json", config_text);
  write_text(out_dir + "/generation_config.json", hf_generation_config_json(full));
  if (o.carried && !o.carried->format.empty())
    for (const auto& [name, bytes] : o.carried->files) write_text(out_dir + "/" + name, bytes);
}

void export_hf(const Transformer& model, const Config& config, const std::string& out_dir, const std::string& dtype) {
  HfExportOptions o;
  o.dtype = dtype;
  export_hf(model, config, out_dir, o);
}

void export_hf(const Transformer& model, const Config& config, const std::string& out_dir, const HfExportOptions& o) {
  Transformer& m = const_cast<Transformer&>(model);  // params() has no const overload; we only read
  Config full = config;
  full.model = model.config();
  const HostView host(m.ops(), m.params().flat);
  const Tensor& flat = host.tensor();
  if (flat.dtype == DType::kF32) return export_hf(full, static_cast<const float*>(flat.data), out_dir, o);
  MOE_CHECK(flat.dtype == DType::kF64, "export_hf: master parameters must be f32 or f64");
  std::vector<float> f32(static_cast<size_t>(flat.numel()));
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<float>(static_cast<const double*>(flat.data)[i]);
  export_hf(full, f32.data(), out_dir, o);
}

void load_into(const std::vector<float>& params, Transformer& model) {
  HostView host(model.ops(), model.params().flat, HostView::kWrite);
  const Tensor& flat = host.tensor();
  MOE_CHECK(static_cast<int64_t>(params.size()) == flat.numel(), "load_into: ", params.size(),
            " parameters for a model of ", flat.numel(), " (different configs?)");
  if (flat.dtype == DType::kF32) {
    std::memcpy(flat.data, params.data(), params.size() * sizeof(float));
  } else {
    MOE_CHECK(flat.dtype == DType::kF64, "load_into: master parameters must be f32 or f64");
    for (size_t i = 0; i < params.size(); ++i) static_cast<double*>(flat.data)[i] = params[i];
  }
  host.commit();
  model.refresh_operand_weights();
}

}  // namespace moe
