// ModelConfig's own logic: its checks, the enums its strings parse to, which layers are MoE,
// the routed weights' constants, and its parameter and FLOP counts.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"

namespace moe {
namespace {
// The integers of a comma-separated list ("0,3"); `key` and `example` name them in errors, each
// value must satisfy ok (described by `want`).
template <class Ok>
std::vector<int64_t> parse_int_list(const std::string& text, const char* key, const char* want, const char* example, Ok ok) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(at, end - at);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    char* stop = nullptr;
    const long long v = item.empty() ? 0 : std::strtoll(item.c_str(), &stop, 10);
    MOE_CHECK(!item.empty() && stop && *stop == '\0' && ok(v), key, " = \"", text, "\": '", item, "' is not ", want,
              " (e.g. \"", example, "\")");
    out.push_back(v);
    at = end + 1;
  }
  return out;
}

// model.dense_layers as indices (checked: integers in [0, n_layers), increasing).
std::vector<int64_t> parse_dense_layers(const std::string& text, int64_t n_layers) {
  const std::vector<int64_t> out =
      parse_int_list(text, "model.dense_layers", "a layer index", "0,3", [](long long) { return true; });
  for (size_t i = 0; i < out.size(); ++i) {
    MOE_CHECK(out[i] >= 0 && out[i] < n_layers, "model.dense_layers = \"", text, "\": layer ", out[i],
              " is outside [0, model.n_layers = ", n_layers, ")");
    MOE_CHECK(i == 0 || out[i] > out[i - 1], "model.dense_layers = \"", text, "\": indices must increase (each layer once)");
  }
  return out;
}

// model.sliding_window as window sizes (checked: integers > 0 or -1).
std::vector<int64_t> parse_window_pattern(const std::string& text) {
  return parse_int_list(text, "model.sliding_window", "a window (a size > 0, or -1 for full)", "4096,4096,4096,-1",
                        [](long long v) { return v > 0 || v == -1; });
}
}  // namespace

int64_t ModelConfig::attention_window(int64_t layer) const {
  if (sliding_window.empty()) return 0;
  if (sliding_window_full_first && layer == 0) return 0;
  if (sliding_window_full_last && layer == n_layers - 1) return 0;
  const std::vector<int64_t> pattern = parse_window_pattern(sliding_window);
  const int64_t i = layer - (sliding_window_full_first ? 1 : 0);
  const int64_t w = pattern[static_cast<size_t>(i % static_cast<int64_t>(pattern.size()))];
  return w == -1 ? 0 : w;
}

bool ModelConfig::rope_on(int64_t layer) const {
  if (rope == "none") return false;
  return rope != "windowed" || attention_window(layer) > 0;
}

std::vector<int64_t> ModelConfig::attention_windows() const {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < n_layers; ++l)
    if (const int64_t w = attention_window(l); w > 0 && std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  std::sort(out.begin(), out.end());
  return out;
}

double ModelConfig::attention_pairs(int64_t layer, int64_t S) const {
  const double s = static_cast<double>(S), w = static_cast<double>(attention_window(layer));
  if (w == 0 || w >= s) return s * (s + 1) / 2;
  return w * (w + 1) / 2 + (s - w) * w;
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (dense_layers.empty()) return layer >= n_dense_layers;
  const std::vector<int64_t> dense = parse_dense_layers(dense_layers, n_layers);
  return !std::binary_search(dense.begin(), dense.end(), layer);
}

int64_t ModelConfig::num_moe_layers() const {
  if (dense_layers.empty()) return n_layers - n_dense_layers;
  return n_layers - static_cast<int64_t>(parse_dense_layers(dense_layers, n_layers).size());
}

int64_t ModelConfig::moe_index(int64_t layer) const {
  MOE_CHECK(layer >= 0 && layer < n_layers && is_moe_layer(layer), "layer ", layer, " is not an MoE layer");
  if (dense_layers.empty()) return layer - n_dense_layers;
  const std::vector<int64_t> dense = parse_dense_layers(dense_layers, n_layers);
  return layer - (std::lower_bound(dense.begin(), dense.end(), layer) - dense.begin());
}

int64_t ModelConfig::moe_layer(int64_t m) const {
  MOE_CHECK(m >= 0 && m < num_moe_layers(), "MoE layer ", m, " of ", num_moe_layers());
  for (int64_t l = 0, seen = 0; l < n_layers; ++l)
    if (is_moe_layer(l) && seen++ == m) return l;
  MOE_FAIL("MoE layer ", m, " not found");
}

double ModelConfig::expert_weight_norm_p() const {
  if (norm_topk_prob) return norm_topk_p;
  return score_func == "topk_softmax" ? 1.0 : 0.0;  // a softmax over the chosen logits
}

double ModelConfig::expert_weight_factor() const {
  double f = restore_weight_scale ? static_cast<double>(top_k) : 1.0;
  f *= expert_weight_scale;
  if (original_top_k > 0 && original_top_k != top_k)
    f *= std::sqrt(static_cast<double>(original_top_k) / static_cast<double>(top_k));
  return f;
}

void ModelConfig::validate() const {
  Config whole_config;
  whole_config.model = *this;
  check_ranges(whole_config, "model");
  MOE_CHECK(pad_id < vocab_size, "model.pad_id = ", pad_id, " is not below model.vocab_size = ", vocab_size);
  MOE_CHECK(n_heads % n_kv_heads == 0, "model.n_kv_heads = ", n_kv_heads,
            " does not divide model.n_heads = ", n_heads);
  MOE_CHECK(head_dim > 0 || d_model % n_heads == 0, "model.d_model = ", d_model,
            " is not divisible by model.n_heads = ", n_heads, " (set model.head_dim explicitly)");
  MOE_CHECK(hd() % 2 == 0, "head dim ", hd(), " must be even for rotate-halves RoPE");
  MOE_CHECK(rotary_dim() >= 2 && rotary_dim() % 2 == 0, "model.rope_partial = ", rope_partial, " rotates int(",
            hd(), " x ", rope_partial, ") = ", rotary_dim(), " dims of each head: rotate-halves needs an even count >= 2");
  MOE_CHECK(n_dense_layers <= n_layers, "model.n_dense_layers = ", n_dense_layers,
            " exceeds model.n_layers = ", n_layers);
  MOE_CHECK(top_k <= num_experts, "model.top_k = ", top_k, " exceeds model.num_experts = ", num_experts);
  MOE_CHECK(router_bias_gamma == 0 || routing == "learned",
            "model.router_bias_gamma needs model.routing = \"learned\"");
  MOE_CHECK(dense_layers.empty() || n_dense_layers == 0, "model.dense_layers = \"", dense_layers,
            "\" and model.n_dense_layers = ", n_dense_layers, " both name dense layers: set one of them");
  parse_dense_layers(dense_layers, n_layers);  // throws naming a bad model.dense_layers
  MOE_CHECK(sigmoid_eps == 0 || score_func == "sigmoid", "model.sigmoid_eps = ", sigmoid_eps,
            " applies to sigmoid scores only (model.score_func = \"", score_func, "\")");
  MOE_CHECK((n_group == 0) == (topk_group == 0), "model.n_group = ", n_group, " and model.topk_group = ", topk_group,
            ": group-limited routing needs both (or neither)");
  if (n_group > 0) {
    MOE_CHECK(num_experts % n_group == 0, "model.n_group = ", n_group, " does not divide model.num_experts = ",
              num_experts);
    MOE_CHECK(topk_group <= n_group, "model.topk_group = ", topk_group, " exceeds model.n_group = ", n_group);
    MOE_CHECK(top_k <= topk_group * (num_experts / n_group), "model.top_k = ", top_k, " exceeds the ",
              topk_group * (num_experts / n_group), " experts of model.topk_group = ", topk_group, " groups");
    MOE_CHECK(score_func != "topk_softmax", "model.n_group: group-limited routing chooses on scores; "
              "model.score_func = \"topk_softmax\" chooses on logits (Olmo-core 3 refuses the pair too)");
    MOE_CHECK(routing == "learned", "model.n_group needs model.routing = \"learned\"");
  }
  MOE_CHECK(!score_correction_bias || routing == "learned",
            "model.score_correction_bias needs model.routing = \"learned\"");
  parse_window_pattern(sliding_window);  // throws naming a bad model.sliding_window
  MOE_CHECK(rope != "windowed" || !sliding_window.empty(),
            "model.rope = \"windowed\" applies RoPE on the sliding-window layers only, but model.sliding_window is empty");
  MOE_CHECK(!sliding_window.empty() || (sliding_window_full_first && sliding_window_full_last),
            "model.sliding_window_full_first / _full_last apply only with model.sliding_window");
  MOE_CHECK(shared_experts == 1 || shared_router, "model.shared_experts = ", shared_experts,
            " needs model.shared_router = true (Olmo-core 3 requires a shared_experts_router for several)");
  MOE_CHECK(!shared_router || shared_hidden > 0, "model.shared_router needs shared experts (model.shared_hidden > 0)");
  MOE_CHECK(!shared_router || shared_merge == "sum", "model.shared_router needs model.shared_merge = \"sum\"");
  MOE_CHECK(shared_router || (shared_router_score == "softmax" && shared_router_sigmoid_eps == 0 &&
                              shared_router_norm_p == 0 && !shared_router_bias),
            "model.shared_router_score / _sigmoid_eps / _norm_p / _bias apply only with model.shared_router = true");
  // topk_softmax has no scores-only form (Olmo-core 3's router refuses it there too).
  MOE_CHECK(shared_router_score != "topk_softmax",
            "model.shared_router_score = \"topk_softmax\": the shared router has no top-k (Olmo-core 3 refuses "
            "topk_softmax for scores-only routing)");
  MOE_CHECK(shared_router_sigmoid_eps == 0 || shared_router_score == "sigmoid", "model.shared_router_sigmoid_eps = ",
            shared_router_sigmoid_eps, " applies to sigmoid scores only (model.shared_router_score = \"",
            shared_router_score, "\")");
  MOE_CHECK(shared_router_norm_p == 0 || shared_router_norm_p >= 1e-3, "model.shared_router_norm_p = ",
            shared_router_norm_p, " (0 = not normalized, else >= 1e-3)");
  MOE_CHECK(norm_topk_prob || norm_topk_p == 1.0, "model.norm_topk_p = ", norm_topk_p,
            " has no effect without model.norm_topk_prob = true");
}

namespace {
template <typename E>
E parse_choice(const std::string& key, const std::string& value, std::initializer_list<std::pair<const char*, E>> allowed) {
  std::string names;
  for (const auto& [name, e] : allowed) {
    if (value == name) return e;
    names += names.empty() ? name : std::string(", ") + name;
  }
  MOE_FAIL(key, " = \"", value, "\" (allowed: ", names, ")");
}
}  // namespace

ModelChoices model_choices(const ModelConfig& c) {
  ModelChoices m;
  m.norm_placement = parse_choice<NormPlacement>("model.norm_placement", c.norm_placement,
                                                 {{"pre", NormPlacement::kPre}, {"peri", NormPlacement::kPeri}, {"reordered", NormPlacement::kReordered}});
  m.qk_norm = parse_choice<QkNorm>("model.qk_norm", c.qk_norm,
                                   {{"none", QkNorm::kNone}, {"full", QkNorm::kFull}, {"per_head", QkNorm::kPerHead}});
  m.score_func = parse_choice<ScoreFunc>("model.score_func", c.score_func,
                                         {{"softmax", ScoreFunc::kSoftmax}, {"sigmoid", ScoreFunc::kSigmoid}, {"topk_softmax", ScoreFunc::kTopkSoftmax}});
  m.routing = parse_choice<Routing>("model.routing", c.routing,
                                    {{"learned", Routing::kLearned}, {"uniform", Routing::kUniform}, {"random", Routing::kRandom}});
  m.shared_merge = parse_choice<SharedMerge>("model.shared_merge", c.shared_merge,
                                             {{"sum", SharedMerge::kSum}, {"v1", SharedMerge::kV1}});
  m.shared_router_score = parse_choice<ScoreFunc>("model.shared_router_score", c.shared_router_score,
                                                  {{"softmax", ScoreFunc::kSoftmax}, {"sigmoid", ScoreFunc::kSigmoid}});
  return m;
}

int64_t ModelConfig::num_params() const {
  const int64_t D = d_model, q = n_heads * hd(), kv = n_kv_heads * hd();
  int64_t n = vocab_size * D * (tie_embeddings ? 1 : 2) + D + (embedding_norm ? D : 0);
  const int64_t norms_per_layer = norm_placement == "peri" ? 4 : 2;  // pre: inputs, reordered: outputs
  // The routers' logit biases and the shared router.
  const int64_t gates = (router_logit_bias ? num_experts : 0) +
                        (shared_router ? shared_experts * (D + (shared_router_bias ? 1 : 0)) : 0);
  for (int64_t l = 0; l < n_layers; ++l) {
    n += D * norms_per_layer;
    n += D * q * 2 + D * kv * 2;
    if (attention_bias) n += q + 2 * kv + D;
    if (qk_norm == "full") n += q + kv;
    if (qk_norm == "per_head") n += 2 * hd();
    if (!is_moe_layer(l)) n += 3 * D * dense_width();
    else n += num_experts * D + 3 * num_experts * expert_hidden * D + 3 * D * shared_width() + gates;
  }
  return n;
}

ModelConfig::ActiveParams ModelConfig::active_matmul_params_by_part() const {
  const int64_t D = d_model, q = n_heads * hd(), kv = n_kv_heads * hd();
  ActiveParams n;
  n.lm_head = vocab_size * D;  // runs even when tied
  const int64_t shared_gate = shared_router ? shared_experts * D : 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    n.attention += D * q * 2 + D * kv * 2;
    if (!is_moe_layer(l)) {
      n.dense_ffn += 3 * D * dense_width();
    } else {
      n.router += num_experts * D;
      n.experts += 3 * top_k * expert_hidden * D + 3 * D * shared_width() + shared_gate;
    }
  }
  return n;
}

int64_t ModelConfig::num_active_matmul_params() const { return active_matmul_params_by_part().total(); }

double ModelConfig::train_flops_per_token(int64_t seq_len) const {
  double pairs = 0;
  for (int64_t l = 0; l < n_layers; ++l) pairs += attention_pairs(l, seq_len);
  return 6.0 * static_cast<double>(num_active_matmul_params()) +
         12.0 * static_cast<double>(n_heads * hd()) * pairs / static_cast<double>(seq_len);
}

ModelConfig::TrainFlops ModelConfig::train_flops_by_part(int64_t seq_len) const {
  const ActiveParams n = active_matmul_params_by_part();
  auto flops = [](int64_t params) { return 6.0 * static_cast<double>(params); };
  TrainFlops f{flops(n.attention), flops(n.router), flops(n.experts), flops(n.dense_ffn), flops(n.lm_head)};
  for (int64_t l = 0; l < n_layers; ++l)
    f.attention += 12.0 * static_cast<double>(n_heads * hd()) * attention_pairs(l, seq_len) / static_cast<double>(seq_len);
  return f;
}

double ModelConfig::train_flops_per_token_noncausal(int64_t seq_len) const {
  double keys = 0;  // each query against every key of the layer's reach
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t w = attention_window(l);
    keys += static_cast<double>(w > 0 ? std::min(w, seq_len) : seq_len);
  }
  return 6.0 * static_cast<double>(num_active_matmul_params()) + 12.0 * static_cast<double>(n_heads * hd()) * keys;
}

}  // namespace moe
