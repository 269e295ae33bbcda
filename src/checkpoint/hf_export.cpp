#include "checkpoint/hf_export.h"
#include "kernels/host_view.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/safetensors.h"
#include "core/bf16.h"
#include "core/check.h"
#include "core/user_path.h"
#include "model/params.h"
#include "model/transformer.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}


void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MOE_CHECK(out.good(), "cannot write '", path, "'");
  out << text;
  out.flush();
  MOE_CHECK(out.good(), "writing '", path, "' failed");
}

// One HF tensor's place in our flat buffer.
enum class Kind { kCopy, kFusedGateUp };
struct Target {
  std::string ours;             // our parameter name
  std::vector<int64_t> shape;   // expected HF shape
  int64_t offset = 0;           // element offset in the flat buffer (kCopy)
  int64_t gate_offset = 0, up_offset = 0, F = 0, D = 0, E = 0;  // kFusedGateUp
  Kind kind = Kind::kCopy;
};

std::string hf_name_of(const std::string& ours) {
  static const std::map<std::string, std::string> per_layer = {
      {"attn_norm", "input_layernorm.weight"}, {"wq", "self_attn.q_proj.weight"},
      {"wk", "self_attn.k_proj.weight"},       {"wv", "self_attn.v_proj.weight"},
      {"wo", "self_attn.o_proj.weight"},       {"q_norm", "self_attn.q_norm.weight"},
      {"k_norm", "self_attn.k_norm.weight"},   {"ffn_norm", "post_attention_layernorm.weight"},
      {"router", "mlp.gate.weight"}};
  if (ours == "embed") return "model.embed_tokens.weight";
  if (ours == "final_norm") return "model.norm.weight";
  if (ours == "lm_head") return "lm_head.weight";
  const size_t dot = ours.find('.', 7);  // "layers.L.rest"
  MOE_CHECK(ours.rfind("layers.", 0) == 0 && dot != std::string::npos, "no HF name for parameter '", ours, "'");
  auto it = per_layer.find(ours.substr(dot + 1));
  MOE_CHECK(it != per_layer.end(), "no HF name for parameter '", ours, "'");
  return "model." + ours.substr(0, dot + 1) + it->second;
}

// Every HF key we accept (per-expert and fused layouts) and where it goes.
std::map<std::string, Target> hf_targets(const ModelConfig& c, const ParamLayout& layout) {
  std::map<std::string, Target> out;
  for (const ParamInfo& p : layout.entries()) {
    const bool gate = p.name.ends_with(".experts.gate"), up = p.name.ends_with(".experts.up"),
               down = p.name.ends_with(".experts.down");
    if (!gate && !up && !down) {
      out[hf_name_of(p.name)] = Target{p.name, p.shape, p.offset};
      continue;
    }
    const std::string base = p.name.substr(0, p.name.size() - (up ? 2 : 4));  // "layers.L.experts."
    const std::string prefix = "model." + base.substr(0, base.size() - 8) + "mlp.experts.";
    const std::string proj = gate ? "gate_proj" : up ? "up_proj" : "down_proj";
    const int64_t per = p.numel / c.num_experts;
    for (int64_t e = 0; e < c.num_experts; ++e)
      out[prefix + std::to_string(e) + "." + proj + ".weight"] =
          Target{p.name, {p.shape[1], p.shape[2]}, p.offset + e * per};
    if (down) out[prefix + "down_proj"] = Target{p.name, p.shape, p.offset};
    if (gate) {
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

template <class T>
void append_bytes(std::vector<unsigned char>& out, const T& v) {
  const auto* b = reinterpret_cast<const unsigned char*>(&v);
  out.insert(out.end(), b, b + sizeof(T));
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
  if (c.router_bias_selects())
    r.push_back("router bias (model.router_bias_gamma > 0 or model.score_correction_bias): OLMoE's router has none");
  if (c.n_group > 0) r.push_back("group-limited routing (model.n_group > 0): OLMoE chooses among all experts");
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
nlohmann::json id_or_null(int64_t id) { return id >= 0 ? nlohmann::json(id) : nlohmann::json(nullptr); }
}  // namespace

std::string hf_config_json(const Config& full, const std::string& dtype) {
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
  j["attention_bias"] = false;
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
  return j.dump(2) + "\n";
}

std::string hf_generation_config_json(const Config& full) {
  nlohmann::ordered_json j;
  j["_from_model_config"] = true;
  j["bos_token_id"] = id_or_null(full.data.bos_id);
  j["eos_token_id"] = id_or_null(full.data.eos_id);
  j["pad_token_id"] = id_or_null(full.model.pad_id);
  return j.dump(2) + "\n";
}

void export_hf(const Config& full, const float* params, const std::string& out_dir, const std::string& dtype) {
  const ModelConfig& c = full.model;
  const std::string config_text = hf_config_json(full, dtype);  // checks dtype and the architecture
  const bool bf = dtype == "bf16";
  const ParamLayout layout(c);
  std::vector<SafetensorsTensorOut> tensors;
  for (const auto& [hf, t] : hf_targets(c, layout)) {
    if (t.kind != Kind::kCopy) continue;
    if (t.shape.size() == 3) continue;  // fused down_proj: export writes per-expert keys
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    tensors.push_back(make_tensor(hf, t.shape, params + t.offset, n, bf));
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  MOE_CHECK(fs::is_directory(out_dir), "cannot create directory '", out_dir, "'");
  write_text(out_dir + "/config.json", config_text);
  write_text(out_dir + "/generation_config.json", hf_generation_config_json(full));
  write_safetensors(out_dir + "/model.safetensors", std::move(tensors), {{"format", "pt"}});
}

void export_hf(const Transformer& model, const Config& config, const std::string& out_dir, const std::string& dtype) {
  Transformer& m = const_cast<Transformer&>(model);  // params() has no const overload; we only read
  Config full = config;
  full.model = model.config();
  const HostView host(m.ops(), m.params().flat);
  const Tensor& flat = host.tensor();
  if (flat.dtype == DType::kF32) return export_hf(full, static_cast<const float*>(flat.data), out_dir, dtype);
  MOE_CHECK(flat.dtype == DType::kF64, "export_hf: master parameters must be f32 or f64");
  std::vector<float> f32(static_cast<size_t>(flat.numel()));
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<float>(static_cast<const double*>(flat.data)[i]);
  export_hf(full, f32.data(), out_dir, dtype);
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

Config config_from_hf_json(const std::string& text, std::vector<std::string>* notes) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    MOE_FAIL("config.json is not valid JSON: ", e.what());
  }
  MOE_CHECK(j.is_object(), "config.json is not a JSON object");
  MOE_CHECK(j.contains("model_type") && j["model_type"] == "olmoe", "config.json: model_type ",
            j.contains("model_type") ? j["model_type"].dump() : std::string("missing"),
            " (only \"olmoe\", OlmoeForCausalLM, is supported)");
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
  auto get_bool = [&](const char* key, bool dflt) {
    if (!j.contains(key)) return dflt;
    MOE_CHECK(j[key].is_boolean(), "config.json: '", key, "' = ", j[key].dump(), " (need true or false)");
    return j[key].get<bool>();
  };
  auto get_num = [&](const nlohmann::json& obj, const char* key, double dflt) {
    if (!obj.contains(key)) return dflt;
    MOE_CHECK(obj[key].is_number() && obj[key].get<double>() > 0, "config.json: '", key, "' = ", obj[key].dump(),
              " (need a positive number)");
    return obj[key].get<double>();
  };
  c.norm_topk_prob = get_bool("norm_topk_prob", false);
  c.tie_embeddings = get_bool("tie_word_embeddings", false);
  c.norm_eps = get_num(j, "rms_norm_eps", 1e-5);
  c.rope_theta = get_num(j, "rope_theta", 10000.0);
  if (j.contains("initializer_range") && j["initializer_range"].is_number())
    c.init_std = j["initializer_range"].get<double>();
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rp = j["rope_parameters"];
    MOE_CHECK(rp.is_object(), "config.json: rope_parameters is not an object");
    for (auto& [k, v] : rp.items()) {
      MOE_CHECK(k == "rope_theta" || k == "rope_type", "config.json: unsupported rope_parameters field '", k,
                "' = ", v.dump(), " (only default RoPE)");
      if (k == "rope_type")
        MOE_CHECK(v == "default", "config.json: rope_parameters.rope_type ", v.dump(), " (only \"default\" RoPE)");
    }
    c.rope_theta = get_num(rp, "rope_theta", c.rope_theta);
  }
  if (j.contains("rope_scaling"))
    MOE_CHECK(j["rope_scaling"].is_null(), "config.json: rope_scaling ", j["rope_scaling"].dump(),
              " (only unscaled default RoPE)");
  if (j.contains("hidden_act"))
    MOE_CHECK(j["hidden_act"] == "silu", "config.json: hidden_act ", j["hidden_act"].dump(), " (only \"silu\")");
  MOE_CHECK(get_bool("attention_bias", false) == false, "config.json: attention_bias = true (moecore has no biases)");
  if (j.contains("attention_dropout"))
    MOE_CHECK(j["attention_dropout"].is_number() && j["attention_dropout"].get<double>() == 0.0,
              "config.json: attention_dropout ", j["attention_dropout"].dump(), " (only 0)");
  if (j.contains("clip_qkv"))
    MOE_CHECK(j["clip_qkv"].is_null(), "config.json: clip_qkv ", j["clip_qkv"].dump(),
              " (moecore does not clip q, k, v; only null)");
  MOE_CHECK(c.d_model % c.n_heads == 0, "config.json: hidden_size ", c.d_model,
            " is not a multiple of num_attention_heads ", c.n_heads);
  if (j.contains("head_dim") && !j["head_dim"].is_null())
    MOE_CHECK(j["head_dim"] == c.d_model / c.n_heads, "config.json: head_dim ", j["head_dim"].dump(),
              " != hidden_size / num_attention_heads = ", c.d_model / c.n_heads);
  // Token ids: an integer in [0, vocab_size) or null (-1). moecore keeps one id of each kind.
  auto token_id = [&](const char* key) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) return -1;
    const auto& v = j[key];
    MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < c.vocab_size, "config.json: '",
              key, "' = ", v.dump(), " (need null or one token id in [0, vocab_size = ", c.vocab_size,
              "); a list of several ids is not supported)");
    return v.get<int64_t>();
  };
  c.pad_id = token_id("pad_token_id");
  full.data.eos_id = token_id("eos_token_id");
  full.data.bos_id = token_id("bos_token_id");
  if (j.contains("max_position_embeddings") && !j["max_position_embeddings"].is_null())
    c.max_position_embeddings = need_int(j, "max_position_embeddings");
  // pad == eos (common for models without a pad token): a pad id equal to the end-of-text id
  // would unlabel every document end and freeze its embedding, so only the eos id is kept.
  if (c.pad_id >= 0 && c.pad_id == full.data.eos_id) {
    if (notes)
      notes->push_back("pad_token_id = eos_token_id = " + std::to_string(c.pad_id) +
                       ": kept as data.eos_id only (a pad id equal to the end-of-text id would unlabel every "
                       "document end); model.pad_id = -1");
    c.pad_id = -1;
  }
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
  m.config = config_from_hf_json(read_input_file(dir + "/config.json", "Hugging Face config"), &m.notes);
  const ModelConfig& c = m.config.model;
  const ParamLayout layout(c);
  m.params.assign(static_cast<size_t>(layout.total()), 0.0f);

  // The files and which keys each should hold (from the index, if sharded).
  std::vector<std::string> files;
  std::map<std::string, std::string> index_of;  // key -> shard file named by the index
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
      index_of[k] = f;
      if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
    }
    std::sort(files.begin(), files.end());
  } else {
    MOE_CHECK(path_entry_exists(dir + "/model.safetensors"), "'", dir,
              "' has neither model.safetensors nor model.safetensors.index.json");
    files.push_back("model.safetensors");
  }

  const auto targets = hf_targets(c, layout);
  std::map<std::string, int64_t> covered;  // our parameter -> elements written
  std::map<std::string, std::string> seen;  // HF key -> file
  std::vector<float> tied_head;
  for (const std::string& f : files) {
    SafetensorsFile st(dir + "/" + f, "Hugging Face weights file");
    for (const auto& [key, e] : st.entries()) {
      auto prev = seen.find(key);
      MOE_CHECK(prev == seen.end(), "tensor '", key, "' appears in both '", prev->second, "' and '", f, "'");
      seen[key] = f;
      if (!index_of.empty()) {
        auto it = index_of.find(key);
        MOE_CHECK(it != index_of.end() && it->second == f, "'", dir + "/" + f, "' holds '", key,
                  "', which the index places ", it == index_of.end() ? std::string("nowhere") : "in '" + it->second + "'");
      }
      if (key == "lm_head.weight" && c.tie_embeddings) {  // tied: must equal the embedding (checked below)
        MOE_CHECK(e.shape == layout.find("embed").shape, "'", dir + "/", f, "': tied lm_head.weight has shape ",
                  shape_str(e.shape), ", expected ", shape_str(layout.find("embed").shape));
        OwnedTensor v = st.read(key, DType::kF32);
        tied_head.assign(v.as<float>(), v.as<float>() + v.t.numel());
        continue;
      }
      auto t = targets.find(key);
      MOE_CHECK(t != targets.end(), "'", dir + "/", f, "': unexpected tensor '", key,
                "' (not part of OlmoeForCausalLM with this config.json)");
      const Target& tg = t->second;
      MOE_CHECK(e.shape == tg.shape, "'", dir + "/", f, "': tensor '", key, "' has shape ", shape_str(e.shape),
                ", expected ", shape_str(tg.shape));
      MOE_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16" || e.dtype == "F64", "'", dir + "/", f,
                "': tensor '", key, "' has dtype ", e.dtype, " (need a float type)");
      OwnedTensor v = st.read(key, DType::kF32);
      const float* src = v.as<float>();
      if (tg.kind == Kind::kCopy) {
        std::memcpy(m.params.data() + tg.offset, src, static_cast<size_t>(v.t.numel()) * sizeof(float));
        covered[tg.ours] += v.t.numel();
      } else {
        const int64_t per = tg.F * tg.D;
        for (int64_t x = 0; x < tg.E; ++x) {
          std::memcpy(m.params.data() + tg.gate_offset + x * per, src + x * 2 * per, per * sizeof(float));
          std::memcpy(m.params.data() + tg.up_offset + x * per, src + x * 2 * per + per, per * sizeof(float));
        }
        const std::string base = tg.ours.substr(0, tg.ours.size() - 7);  // "layers.L.experts."
        covered[base + "gate"] += tg.E * per;
        covered[base + "up"] += tg.E * per;
      }
    }
  }
  if (!tied_head.empty()) {
    const ParamInfo emb = layout.find("embed");  // a copy: no reference to a call given a temporary
    MOE_CHECK(std::memcmp(tied_head.data(), m.params.data() + emb.offset, tied_head.size() * sizeof(float)) == 0,
              "'", dir, "': tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight");
  }
  for (const auto& [k, f] : index_of)
    MOE_CHECK(seen.count(k), "the index places '", k, "' in '", f, "', which does not hold it");
  for (const ParamInfo& p : layout.entries()) {
    const int64_t n = covered.count(p.name) ? covered[p.name] : 0;
    MOE_CHECK(n <= p.numel, "'", dir, "' gives parameter '", p.name, "' more than once (per-expert and fused keys both present?)");
    MOE_CHECK(n == p.numel, "'", dir, "' lacks tensors for parameter '", p.name, "' (", n, " of ", p.numel,
              " elements present)");
  }
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
    MOE_CHECK(e.shape == p.shape, "'", path, "': parameter '", p.name, "' has shape ", shape_str(e.shape),
              ", expected ", shape_str(p.shape));
    OwnedTensor v = st.read(name, DType::kF32);
    std::memcpy(out.data() + p.offset, v.as<float>(), static_cast<size_t>(p.numel) * sizeof(float));
  }
  return out;
}

void save_our_params(const std::string& path, const Config& config, const float* params) {
  const ModelConfig& c = config.model;
  const ParamLayout layout(c);
  std::vector<SafetensorsTensorOut> tensors;
  for (const ParamInfo& p : layout.entries())
    tensors.push_back(make_tensor(p.name, p.shape, params + p.offset, p.numel, false));
  Config stored;  // the settings that belong to the weights; the rest stays at the defaults
  stored.model = c;
  stored.data.eos_id = config.data.eos_id;
  stored.data.bos_id = config.data.bos_id;
  write_safetensors(path, std::move(tensors), {{"config", config_to_json(stored)}, {"format", "moecore-params-v1"}});
}

}  // namespace moe
