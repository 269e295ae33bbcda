// Olmo-core 3's Hugging Face model type `olmo3moe` (Olmo3MoeConfig / Olmo3MoeForCausalLM in
// olmo_core/nn/moe/v2/hf): its config.json both ways and its tensor names. A field missing from
// config.json takes Olmo3MoeConfig's default (restore_weight_scale = true, dense layer [0],
// alternating 4096-token windows, ...), as from_pretrained would; a field is refused by name only
// when its value changes what the model computes and moecore cannot compute it.
#include "checkpoint/hf_olmo3moe.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/hf_json.h"
#include "core/check.h"

namespace moe {
namespace {

// Olmo3MoeConfig's defaults (configuration_olmo3moe.py, Olmo-core 3.0.0), where moecore reads them.
constexpr int64_t kDefaultWindow = 4096;
constexpr int64_t kDefaultPad = 1, kDefaultEos = 50279;

// Per-layer windows as moecore's pattern: the shortest prefix that repeats over the layers, with
// the first and last layer not forced full ("" when every layer is full).
std::string window_pattern(const std::vector<int64_t>& per_layer) {
  if (std::all_of(per_layer.begin(), per_layer.end(), [](int64_t w) { return w == 0; })) return "";
  size_t period = 1;
  for (; period < per_layer.size(); ++period) {
    bool repeats = true;
    for (size_t i = period; i < per_layer.size() && repeats; ++i) repeats = per_layer[i] == per_layer[i % period];
    if (repeats) break;
  }
  std::string out;
  for (size_t i = 0; i < period; ++i) {
    if (i) out.push_back(',');
    out.append(std::to_string(per_layer[i] > 0 ? per_layer[i] : -1));
  }
  return out;
}

// Fields moecore reads, fields that carry no function (kept by the export from the imported file),
// and fields whose only values moecore can honour are their neutral ones.
const std::set<std::string>& known_fields() {
  static const std::set<std::string> k = {
      // read
      "vocab_size", "hidden_size", "attention_hidden_size", "head_dim", "dense_mlp_intermediate_size",
      "moe_intermediate_size", "shared_expert_intermediate_size", "n_routed_experts", "num_experts_per_tok",
      "original_num_experts_per_tok", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_act",
      "gating_function", "normalize_expert_weights", "restore_weight_scale", "max_position_embeddings",
      "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_theta",
      "rope_scaling", "rope_parameters", "attention_bias", "attention_dropout", "rms_norm_eps", "sliding_window",
      "use_head_qk_norm", "layer_types", "dense_layers_indices", "dense_layers_use_shared_expert", "embed_scale",
      "embed_norm", "use_peri_ln",
      "use_rope",
      // only their neutral values
      "qk_norm_per_head_gains", "scalable_softmax", "attention_gate_type", "attention_gate_full_precision",
      "latent_moe_dim", "latent_moe_bias", "latent_moe_up_proj_input_norm", "emo_min_document_expert_pool",
      "emo_max_document_expert_pool", "emo_eval_document_expert_pool", "emo_eos_token_id", "linear_num_key_heads",
      "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
      "linear_allow_neg_eigval", "linear_norm_eps",
      // training-time or loader settings: no effect on the function
      "global_load_balancing", "architectures", "model_type", "auto_map", "use_cache", "transformers_version", "dtype",
      "torch_dtype", "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "tokenizer_class",
      "output_router_logits", "router_aux_loss_coef"};
  return k;
}

void require_neutral(const nlohmann::json& j, const char* key, const nlohmann::json& neutral, const char* why) {
  if (!j.contains(key) || j[key] == neutral || (neutral.is_null() && j[key].is_null())) return;
  MOE_FAIL("config.json: '", key, "' = ", j[key].dump(), " is not supported (", why, "; only ", neutral.dump(), ")");
}

// Fields moecore cannot honour, refused by name: unknown ones, another architecture, and the
// neutral-only ones at any other value.
void check_olmo3moe_fields(const nlohmann::json& j) {
  namespace H = hf_json;
  for (auto& [key, v] : j.items())
    MOE_CHECK(known_fields().count(key), "config.json: unsupported field '", key, "' = ", v.dump(),
              " (moecore cannot honour it)");
  if (H::present(j, "architectures"))
    MOE_CHECK(j["architectures"] == nlohmann::json::array({"Olmo3MoeForCausalLM"}), "config.json: architectures ",
              j["architectures"].dump(), " (olmo3moe: [\"Olmo3MoeForCausalLM\"])");
  require_neutral(j, "qk_norm_per_head_gains", false, "per-head QK gains");
  require_neutral(j, "scalable_softmax", false, "scalable softmax");
  require_neutral(j, "attention_gate_type", nullptr, "attention output gates");
  require_neutral(j, "latent_moe_dim", nullptr, "latent MoE");
  for (const char* k : {"emo_min_document_expert_pool", "emo_max_document_expert_pool", "emo_eval_document_expert_pool"})
    require_neutral(j, k, nullptr, "EMO document expert pools");
  require_neutral(j, "attention_dropout", 0.0, "no dropout");
  require_neutral(j, "hidden_act", "silu", "SwiGLU experts");
  require_neutral(j, "rope_scaling", nullptr, "only unscaled default RoPE");
}

// Widths, heads, experts and the router's rule.
void read_olmo3moe_shape(const nlohmann::json& j, ModelConfig& c) {
  namespace H = hf_json;
  c.vocab_size = H::positive_int(j, "vocab_size", 50304);
  c.d_model = H::positive_int(j, "hidden_size", 4096);
  c.n_layers = H::positive_int(j, "num_hidden_layers", 32);
  c.n_heads = H::positive_int(j, "num_attention_heads", 32);
  c.n_kv_heads = H::positive_int(j, "num_key_value_heads", c.n_heads);
  const int64_t attn_hidden = H::positive_int(j, "attention_hidden_size", c.d_model);
  c.head_dim = H::positive_int(j, "head_dim", attn_hidden / c.n_heads);
  MOE_CHECK(c.head_dim * c.n_heads == attn_hidden, "config.json: attention_hidden_size = ", attn_hidden,
            " is not num_attention_heads x head_dim = ", c.n_heads, " x ", c.head_dim);
  c.expert_hidden = H::positive_int(j, "moe_intermediate_size", 2048);
  c.dense_hidden = H::positive_int(j, "dense_mlp_intermediate_size", 11008);
  c.shared_hidden = j.contains("shared_expert_intermediate_size")
                        ? (j["shared_expert_intermediate_size"].is_null() ? 0 : H::positive_int(j, "shared_expert_intermediate_size", 0))
                        : 2048;
  c.num_experts = H::positive_int(j, "n_routed_experts", 64);
  c.top_k = H::positive_int(j, "num_experts_per_tok", 4);
  c.original_top_k = H::present(j, "original_num_experts_per_tok") ? H::positive_int(j, "original_num_experts_per_tok", 0) : 0;
  const std::string gating = j.contains("gating_function") ? j["gating_function"].get<std::string>() : "softmax";
  MOE_CHECK(gating == "softmax" || gating == "sigmoid", "config.json: gating_function \"", gating,
            "\" (olmo3moe: softmax or sigmoid)");
  c.score_func = gating;
  c.sigmoid_eps = gating == "sigmoid" ? 1e-7 : 0.0;  // olmo3moe's router adds 1e-7 to sigmoid scores
  if (!j.contains("normalize_expert_weights")) {
    c.norm_topk_prob = true;  // default 1.0
  } else if (!j["normalize_expert_weights"].is_null()) {
    c.norm_topk_prob = true;
    c.norm_topk_p = H::positive_number(j, "normalize_expert_weights", 1.0);
  }
}

// Dense layers (default [0]) as moecore's list: sorted, each once.
std::string olmo3moe_dense_layers(const nlohmann::json& j, int64_t n_layers) {
  std::vector<int64_t> dense{0};
  if (j.contains("dense_layers_indices")) {
    dense.clear();
    if (!j["dense_layers_indices"].is_null()) {
      MOE_CHECK(j["dense_layers_indices"].is_array(), "config.json: dense_layers_indices is not a list");
      for (const auto& v : j["dense_layers_indices"]) {
        MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < n_layers,
                  "config.json: dense_layers_indices holds ", v.dump(), " (need layer indices in [0, ", n_layers, "))");
        dense.push_back(v.get<int64_t>());
      }
    }
  }
  std::sort(dense.begin(), dense.end());
  dense.erase(std::unique(dense.begin(), dense.end()), dense.end());
  std::string out;
  for (size_t i = 0; i < dense.size(); ++i) {
    if (i) out.push_back(',');
    out.append(std::to_string(dense[i]));
  }
  return out;
}

// Attention per layer (default: sliding on even layers, 4096 keys): each layer's window (0: full).
std::vector<int64_t> olmo3moe_windows(const nlohmann::json& j, int64_t n_layers) {
  namespace H = hf_json;
  const int64_t window = j.contains("sliding_window") ? (j["sliding_window"].is_null() ? 0 : H::positive_int(j, "sliding_window", 0))
                                                       : kDefaultWindow;
  std::vector<int64_t> per_layer(static_cast<size_t>(n_layers), 0);
  for (int64_t l = 0; l < n_layers; ++l) {
    std::string type = l % 2 == 0 ? "sliding_attention" : "full_attention";
    if (H::present(j, "layer_types")) {
      MOE_CHECK(j["layer_types"].is_array() && static_cast<int64_t>(j["layer_types"].size()) == n_layers,
                "config.json: layer_types must list num_hidden_layers = ", n_layers, " entries");
      type = j["layer_types"][static_cast<size_t>(l)].get<std::string>();
    }
    MOE_CHECK(type == "full_attention" || type == "sliding_attention", "config.json: layer_types[", l, "] = \"", type,
              "\" (moecore has full_attention and sliding_attention; no linear / KDA layers)");
    if (type == "sliding_attention") {
      MOE_CHECK(window > 0, "config.json: layer_types[", l, "] is sliding_attention but sliding_window is null");
      per_layer[static_cast<size_t>(l)] = window;
    }
  }
  return per_layer;
}

}  // namespace

std::string olmo3moe_unsupported_reason(const ModelConfig& c) {
  std::vector<std::string> r;
  if (c.norm_placement == "pre")
    r.push_back("pre-norm (model.norm_placement = \"pre\"): olmo3moe has reordered (use_peri_ln = false) and peri norms only");
  if (c.qk_norm == "none") r.push_back("QK-norm off (model.qk_norm = \"none\"): olmo3moe always normalizes q and k");
  if (c.score_func == "topk_softmax")
    r.push_back("model.score_func = \"topk_softmax\": olmo3moe's gating_function is softmax or sigmoid");
  if (c.score_func == "sigmoid" && c.sigmoid_eps != 1e-7)
    r.push_back("model.sigmoid_eps = " + std::to_string(c.sigmoid_eps) + ": olmo3moe adds 1e-7 to sigmoid scores");
  if (c.shared_merge != "sum") r.push_back("model.shared_merge = \"v1\": olmo3moe sums the shared expert");
  if (c.expert_weight_scale != 1.0)
    r.push_back("model.expert_weight_scale = " + std::to_string(c.expert_weight_scale) + ": olmo3moe has no such field");
  if (c.router_bias_selects())
    r.push_back("router bias (model.router_bias_gamma > 0 or model.score_correction_bias): olmo3moe's router has "
                "none (Olmo-core's own converter refuses score_bias too)");
  if (c.n_group > 0) r.push_back("group-limited routing (model.n_group > 0): olmo3moe has no n_group / topk_group");
  if (c.shared_experts > 1 || c.shared_router)
    r.push_back("gated shared experts (model.shared_experts = " + std::to_string(c.shared_experts) +
                ", model.shared_router): olmo3moe has one ungated shared expert (Olmo-core's converter refuses "
                "them too)");
  if (c.router_logit_bias) r.push_back("model.router_logit_bias: olmo3moe's gate is a Linear without bias");
  if (c.routing != "learned") r.push_back("model.routing = \"" + c.routing + "\": olmo3moe routes by the learned router");
  if (c.rope == "windowed")
    r.push_back("RoPE on the sliding-window layers only (model.rope = \"windowed\"): olmo3moe has use_rope for all or none");
  if (c.clip_qkv > 0)
    r.push_back("model.clip_qkv = " + std::to_string(c.clip_qkv) +
                ": olmo3moe has no clip_qkv (Olmo-core's own HF export refuses it too)");
  if (c.rope_partial != 1.0)
    r.push_back("partial RoPE (model.rope_partial = " + std::to_string(c.rope_partial) +
                "): olmo3moe rotates every head dim");
  if (c.attention_windows().size() > 1)
    r.push_back("several window sizes (model.sliding_window = \"" + c.sliding_window + "\"): olmo3moe has one sliding_window");
  std::string out;
  for (const std::string& s : r) out.append(out.empty() ? "" : "; ").append(s);
  return out;
}

nlohmann::ordered_json olmo3moe_config(const Config& full, const std::string& torch_dtype, const nlohmann::json* carried) {
  using hf_json::id_or_null;
  const ModelConfig& c = full.model;
  const std::string why = olmo3moe_unsupported_reason(c);
  MOE_CHECK(why.empty(), "cannot export to Olmo3MoeForCausalLM (olmo3moe): ", why);
  std::vector<int64_t> dense;
  for (int64_t l = 0; l < c.n_layers; ++l)
    if (!c.is_moe_layer(l)) dense.push_back(l);
  const std::vector<int64_t> windows = c.attention_windows();
  nlohmann::json layer_types = nlohmann::json::array();
  for (int64_t l = 0; l < c.n_layers; ++l) layer_types.push_back(c.attention_window(l) > 0 ? "sliding_attention" : "full_attention");
  nlohmann::ordered_json j;
  j["architectures"] = {"Olmo3MoeForCausalLM"};
  j["model_type"] = "olmo3moe";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.d_model;
  j["attention_hidden_size"] = c.n_heads * c.hd();
  j["head_dim"] = c.hd();
  j["dense_mlp_intermediate_size"] = c.dense_width();
  j["moe_intermediate_size"] = c.expert_hidden;
  j["shared_expert_intermediate_size"] = c.shared_hidden > 0 ? nlohmann::json(c.shared_hidden) : nlohmann::json(nullptr);
  j["n_routed_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.top_k;
  j["original_num_experts_per_tok"] = c.original_top_k > 0 ? nlohmann::json(c.original_top_k) : nlohmann::json(nullptr);
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["hidden_act"] = "silu";
  j["gating_function"] = c.score_func;
  j["normalize_expert_weights"] = c.norm_topk_prob ? nlohmann::json(c.norm_topk_p) : nlohmann::json(nullptr);
  j["restore_weight_scale"] = c.restore_weight_scale;
  j["max_position_embeddings"] = c.max_position_embeddings > 0 ? c.max_position_embeddings : full.train.seq_len;
  j["initializer_range"] = c.init_std;
  j["pad_token_id"] = id_or_null(c.pad_id);
  j["bos_token_id"] = id_or_null(full.data.bos_id);
  j["eos_token_id"] = id_or_null(full.data.eos_id);
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  j["attention_bias"] = c.attention_bias;  // q/k/v/o_proj.bias
  j["attention_dropout"] = 0.0;
  j["rms_norm_eps"] = c.norm_eps;
  j["sliding_window"] = windows.empty() ? nlohmann::json(nullptr) : nlohmann::json(windows[0]);
  j["use_head_qk_norm"] = c.qk_norm == "per_head";
  j["use_rope"] = c.rope != "none";
  j["layer_types"] = layer_types;
  j["dense_layers_indices"] = dense;
  // Olmo-core's converter then loads dense layers into its shared-expert-only blocks (its form).
  j["dense_layers_use_shared_expert"] = true;
  j["embed_scale"] = c.embed_scale;
  j["embed_norm"] = c.embedding_norm;
  j["use_peri_ln"] = c.norm_placement == "peri";
  j["use_cache"] = true;
  j["torch_dtype"] = torch_dtype;  // transformers 4.x
  j["dtype"] = torch_dtype;        // 5.x
  // What the imported file held and moecore does not model (neutral values, loader settings): kept.
  if (carried)
    for (auto& [key, v] : carried->items())
      if (!j.contains(key) && key != "transformers_version") j[key] = v;
  return j;
}

Config config_from_olmo3moe(const nlohmann::json& j, std::vector<std::string>* notes) {
  namespace H = hf_json;
  check_olmo3moe_fields(j);
  Config full;
  ModelConfig& c = full.model;
  read_olmo3moe_shape(j, c);
  c.restore_weight_scale = H::boolean(j, "restore_weight_scale", true);
  c.norm_eps = H::positive_number(j, "rms_norm_eps", 1e-5);
  c.rope_theta = H::rope_theta(j, 10000.0);
  if (j.contains("initializer_range") && j["initializer_range"].is_number()) c.init_std = j["initializer_range"].get<double>();
  c.tie_embeddings = H::boolean(j, "tie_word_embeddings", false);
  c.norm_placement = H::boolean(j, "use_peri_ln", false) ? "peri" : "reordered";
  c.qk_norm = H::boolean(j, "use_head_qk_norm", false) ? "per_head" : "full";
  c.rope = H::boolean(j, "use_rope", true) ? "all" : "none";
  c.embed_scale = H::positive_number(j, "embed_scale", 1.0);
  c.embedding_norm = H::boolean(j, "embed_norm", false);
  c.attention_bias = H::boolean(j, "attention_bias", false);  // q/k/v/o_proj.bias (and g_proj's: no gate here)
  c.n_dense_layers = 0;
  c.dense_layers = olmo3moe_dense_layers(j, c.n_layers);
  c.sliding_window = window_pattern(olmo3moe_windows(j, c.n_layers));
  c.sliding_window_full_first = c.sliding_window.empty();
  c.sliding_window_full_last = c.sliding_window.empty();
  c.pad_id = H::token_id(j, "pad_token_id", c.vocab_size, kDefaultPad < c.vocab_size ? kDefaultPad : -1);
  full.data.eos_id = H::token_id(j, "eos_token_id", c.vocab_size, kDefaultEos < c.vocab_size ? kDefaultEos : -1);
  full.data.bos_id = H::token_id(j, "bos_token_id", c.vocab_size);
  c.max_position_embeddings = H::positive_int(j, "max_position_embeddings", 2048);
  c.pad_id = H::pad_unless_eos(c.pad_id, full.data.eos_id, notes);
  if (notes && H::boolean(j, "global_load_balancing", false))
    notes->push_back("global_load_balancing = true: a training setting, not part of the weights' function; train "
                     "with --set loss.lbl_granularity=global to balance over the data-parallel group as it did");
  try {
    c.validate();
  } catch (const std::exception& e) {
    MOE_FAIL("config.json: ", e.what());
  }
  return full;
}

std::string olmo3moe_name_of(const std::string& ours) {
  static const std::vector<std::pair<std::string, std::string>> per_layer = {
      {"attn_norm", "pre_attention_layernorm.weight"},   {"attn_out_norm", "post_attention_layernorm.weight"},
      {"ffn_norm", "pre_feedforward_layernorm.weight"},  {"ffn_out_norm", "post_feedforward_layernorm.weight"},
      {"wq", "self_attn.q_proj.weight"},                 {"wk", "self_attn.k_proj.weight"},
      {"wv", "self_attn.v_proj.weight"},                 {"wo", "self_attn.o_proj.weight"},
      {"q_norm", "self_attn.q_norm.weight"},             {"k_norm", "self_attn.k_norm.weight"},
      {"mlp.gate", "mlp.gate_proj.weight"},              {"mlp.up", "mlp.up_proj.weight"},
      {"mlp.down", "mlp.down_proj.weight"},              {"router", "mlp.router.gate.weight"},
      {"shared.gate", "mlp.shared_expert.gate_proj.weight"}, {"shared.up", "mlp.shared_expert.up_proj.weight"},
      {"shared.down", "mlp.shared_expert.down_proj.weight"}, {"bq", "self_attn.q_proj.bias"},
      {"bk", "self_attn.k_proj.bias"},                   {"bv", "self_attn.v_proj.bias"},
      {"bo", "self_attn.o_proj.bias"}};
  if (ours == "embed") return "model.embed_tokens.weight";
  if (ours == "embed_norm") return "model.embed_norm.weight";
  if (ours == "final_norm") return "model.norm.weight";
  if (ours == "lm_head") return "lm_head.weight";
  const size_t dot = ours.find('.', 7);  // "layers.L.rest"
  MOE_CHECK(ours.rfind("layers.", 0) == 0 && dot != std::string::npos, "no olmo3moe name for parameter '", ours, "'");
  const std::string rest = ours.substr(dot + 1);
  for (const auto& [mine, theirs] : per_layer)
    if (rest == mine) return "model." + ours.substr(0, dot + 1) + theirs;
  MOE_FAIL("no olmo3moe name for parameter '", ours, "'");
}

}  // namespace moe
