#include "model/params.h"

namespace moe {

bool ModelShard::holds_layer(int64_t l) const {
  if (chunks.empty()) return l >= layer_begin && l < layer_end;
  for (const LayerRange& r : chunks)
    if (l >= r.begin && l < r.end) return true;
  return false;
}

int64_t ModelShard::held_layers() const {
  int64_t n = 0;
  for (const LayerRange& r : chunks) n += r.end - r.begin;
  return n;
}

ModelShard ModelShard::resolved(const ModelConfig& c) const {
  ModelShard s = *this;
  if (s.chunks.empty()) {
    if (s.layer_end < 0) s.layer_end = c.n_layers;
    s.chunks = {LayerRange{s.layer_begin, s.layer_end}};
  }
  if (s.num_local_experts < 0) s.num_local_experts = c.num_experts - s.expert_begin;
  int64_t after = 0;
  for (const LayerRange& r : s.chunks) {
    MOE_CHECK(r.begin >= after && r.begin < r.end && r.end <= c.n_layers, "model shard: layers [", r.begin, ", ",
              r.end, ") outside the ", c.n_layers, " layers or not after the previous chunk");
    after = r.end + (s.chunks.size() > 1 ? 1 : 0);  // chunks apart: another stage's layers lie between
  }
  s.layer_begin = s.chunks.front().begin;
  s.layer_end = s.chunks.back().end;
  MOE_CHECK(s.expert_begin >= 0 && s.num_local_experts >= 1 && s.expert_begin + s.num_local_experts <= c.num_experts,
            "model shard: experts [", s.expert_begin, ", ", s.expert_begin + s.num_local_experts, ") outside the ",
            c.num_experts, " experts");
  MOE_CHECK(!c.tie_embeddings || (s.chunks.size() == 1 && s.layer_begin == 0 && s.layer_end == c.n_layers),
            "model.tie_embeddings = true needs the embedding and the LM head on one pipeline stage (use pp = 1 "
            "or model.tie_embeddings = false)");
  return s;
}

ParamLayout::ParamLayout(const ModelConfig& c, const ModelShard& shard, int64_t dense_chunks, int64_t expert_chunks) {
  MOE_CHECK(dense_chunks >= 1 && expert_chunks >= 1, "ParamLayout: chunk counts must be >= 1");
  auto round_up = [](int64_t x, int64_t m) { return (x + m - 1) / m * m; };
  shard_ = shard.resolved(c);
  global_experts_ = c.num_experts;
  // Dense region first, then experts: two passes over the model order.
  for (int pass = 0; pass < 2; ++pass) {
    const bool experts = pass == 1;
    if (experts) dense_end_ = total_ = round_up(total_, 16 * dense_chunks);
    for (int64_t l = -1; l <= c.n_layers; ++l) {
      const size_t first = entries_.size();
      add_layer(c, l, experts);
      if (l >= 0 && l < c.n_layers)
        for (size_t i = first; i < entries_.size(); ++i) entries_[i].layer = l;
    }
  }
  total_ = dense_end_ + round_up(total_ - dense_end_, 16 * expert_chunks);
  // Global indices: positions in the whole model's layout (same two-pass order).
  const bool whole_model = shard_.chunks.size() == 1 && shard_.layer_begin == 0 && shard_.layer_end == c.n_layers &&
                           shard_.num_local_experts == c.num_experts;
  if (whole_model) {
    for (size_t i = 0; i < entries_.size(); ++i) entries_[i].global_index = static_cast<int64_t>(i);
    num_global_ = static_cast<int64_t>(entries_.size());
  } else {
    const ParamLayout whole(c);
    num_global_ = whole.num_global_params();
    for (auto& e : entries_) e.global_index = whole.find(e.name).global_index;
  }
}

void ParamLayout::add_layer(const ModelConfig& c, int64_t l, bool experts) {
  const ModelShard& sh = shard_;
  const int64_t D = c.d_model, hd = c.hd(), q = c.n_heads * hd, kv = c.n_kv_heads * hd;
  // l = -1: the embedding (first stage); l = n_layers: final norm and LM head (last stage).
  if (l == -1 || l == c.n_layers) {
    if (experts) return;
    if (l == -1 && sh.first_stage()) {
      add("embed", {c.vocab_size, D}, false, true);
      if (c.embedding_norm) add("embed_norm", {D}, true);
    }
    if (l == c.n_layers && sh.last_stage(c)) {
      add("final_norm", {D}, true);
      if (!c.tie_embeddings) add("lm_head", {c.vocab_size, D});
    }
    return;
  }
  if (!sh.holds_layer(l)) return;
  const std::string p = "layers." + std::to_string(l) + ".";
  if (experts) {
    if (!c.is_moe_layer(l)) return;
    const int64_t E = sh.num_local_experts, F = c.expert_hidden;
    add(p + "experts.gate", {E, F, D}, false, false, true);
    add(p + "experts.up", {E, F, D}, false, false, true);
    add(p + "experts.down", {E, D, F}, false, false, true);
    return;
  }
  const bool input_norm = c.norm_placement != "reordered", output_norm = c.norm_placement != "pre";
  if (input_norm) add(p + "attn_norm", {D}, true);
  if (output_norm) add(p + "attn_out_norm", {D}, true);
  add(p + "wq", {q, D});
  add(p + "wk", {kv, D});
  add(p + "wv", {kv, D});
  add(p + "wo", {D, q});
  if (c.attention_bias) {
    add(p + "bq", {q}, false, false, false, true);
    add(p + "bk", {kv}, false, false, false, true);
    add(p + "bv", {kv}, false, false, false, true);
    add(p + "bo", {D}, false, false, false, true);
  }
  if (c.qk_norm == "full") {
    add(p + "q_norm", {q}, true);
    add(p + "k_norm", {kv}, true);
  } else if (c.qk_norm == "per_head") {
    add(p + "q_norm", {hd}, true);
    add(p + "k_norm", {hd}, true);
  }
  if (input_norm) add(p + "ffn_norm", {D}, true);
  if (output_norm) add(p + "ffn_out_norm", {D}, true);
  if (!c.is_moe_layer(l)) {
    const int64_t F = c.dense_width();
    add(p + "mlp.gate", {F, D});
    add(p + "mlp.up", {F, D});
    add(p + "mlp.down", {D, F});
    return;
  }
  add(p + "router", {c.num_experts, D});
  // Logit biases are decayed like the router weights: Olmo-core 3's optimizer decays every
  // parameter its group overrides do not name (its scripts name the embedding only).
  if (c.router_logit_bias) add(p + "router.bias", {c.num_experts}, false, false, false, true);
  if (c.shared_hidden > 0) {
    // The shared experts stacked: expert e's hidden units are rows [e*H, (e+1)*H) of gate and up
    // and columns of down, so one GEMM computes them all (Es = 1: the single shared expert).
    const int64_t Fs = c.shared_width();
    add(p + "shared.gate", {Fs, D});
    add(p + "shared.up", {Fs, D});
    add(p + "shared.down", {D, Fs});
    if (c.shared_router) add(p + "shared.router", {c.shared_experts, D});
    if (c.shared_router_bias) add(p + "shared.router.bias", {c.shared_experts}, false, false, false, true);
  }
}

void ParamLayout::add(std::string name, std::vector<int64_t> shape, bool is_norm, bool is_embedding, bool is_expert,
                      bool is_bias) {
  ParamInfo info;
  info.name = std::move(name);
  info.shape = std::move(shape);
  info.global_shape = info.shape;
  info.numel = 1;
  for (int64_t d : info.shape) info.numel *= d;
  if (is_expert) {  // local experts are a contiguous block of the whole (E, ...) tensor
    info.global_shape[0] = global_experts_;
    info.global_begin = shard_.expert_begin * (info.numel / info.shape[0]);
  }
  // Each parameter starts on a 64-byte boundary (16 floats), good for SIMD and bf16 copies.
  total_ = (total_ + 15) / 16 * 16;
  info.offset = total_;
  info.is_norm = is_norm;
  info.is_embedding = is_embedding;
  info.is_expert = is_expert;
  info.is_bias = is_bias;
  total_ += info.numel;
  entries_.push_back(std::move(info));
}

bool ParamLayout::contains(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return true;
  return false;
}

const ParamInfo& ParamLayout::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return e;
  MOE_FAIL("no parameter named '", name, "' in this model");
}

Tensor param_view(const ParamInfo& info, const Tensor& flat) {
  MOE_CHECK(flat.ndim == 1 && info.offset + info.numel <= flat.numel(), "parameter '", info.name, "' lies outside the ",
            flat.shape_str(), " buffer");
  Tensor t = flat.slice(info.offset, info.offset + info.numel);
  t.ndim = static_cast<int>(info.shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = info.shape[static_cast<size_t>(i)];
  return t;
}

Weights bind_weights(const ParamLayout& layout, const ModelConfig& c, const Tensor& flat) {
  MOE_CHECK(flat.ndim == 1 && flat.numel() == layout.total(), "parameter buffer ", flat.shape_str(), " does not hold the ",
            layout.total(), " parameters of the layout");
  Weights w;
  auto get = [&](const std::string& name) {
    return layout.contains(name) ? param_view(layout.find(name), flat) : Tensor();
  };
  w.embed = get("embed");
  w.embed_norm = get("embed_norm");
  w.final_norm = get("final_norm");
  w.lm_head = c.tie_embeddings ? w.embed : get("lm_head");
  w.flat = flat;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerWeights L;
    L.attn_norm = get(p + "attn_norm");
    L.attn_out_norm = get(p + "attn_out_norm");
    L.wq = get(p + "wq");
    L.wk = get(p + "wk");
    L.wv = get(p + "wv");
    L.wo = get(p + "wo");
    L.bq = get(p + "bq");
    L.bk = get(p + "bk");
    L.bv = get(p + "bv");
    L.bo = get(p + "bo");
    L.q_norm = get(p + "q_norm");
    L.k_norm = get(p + "k_norm");
    L.ffn_norm = get(p + "ffn_norm");
    L.ffn_out_norm = get(p + "ffn_out_norm");
    L.mlp_gate = get(p + "mlp.gate");
    L.mlp_up = get(p + "mlp.up");
    L.mlp_down = get(p + "mlp.down");
    L.router = get(p + "router");
    L.router_bias = get(p + "router.bias");
    L.shared_router = get(p + "shared.router");
    L.shared_router_bias = get(p + "shared.router.bias");
    L.exp_gate = get(p + "experts.gate");
    L.exp_up = get(p + "experts.up");
    L.exp_down = get(p + "experts.down");
    L.shared_gate = get(p + "shared.gate");
    L.shared_up = get(p + "shared.up");
    L.shared_down = get(p + "shared.down");
    w.layers.push_back(L);
  }
  return w;
}

}  // namespace moe
